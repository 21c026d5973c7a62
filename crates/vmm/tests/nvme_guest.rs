//! The guest firmware's NVMe driver and workloads against the controller,
//! under the emulated vCPU: init, verify, perf, namespace hot add, and
//! save/restore in the middle of the verifier at high queue depth. The
//! controller comes from the VM config (`--nvme`), as in `transit vm run`.

use devices::nvme::NvmeController;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use vm_memory::{Bytes, GuestAddress};
use vmm::config::VmConfig;
use vmm::vm::Vm;

struct GuestVm {
    vm: Arc<Vm>,
    nvme: Arc<Mutex<NvmeController>>,
}

impl Drop for GuestVm {
    fn drop(&mut self) {
        self.vm.shutdown();
    }
}

fn start(name: &str, cmdline: &str, nvme_spec: &str, boot: bool) -> GuestVm {
    let config = VmConfig {
        name: name.into(),
        memory: 128 << 20,
        vcpus: 1,
        firmware: guest_image::default_path(),
        cmdline: cmdline.into(),
        nvme: vec![nvme_spec.to_string()],
        pvrdma: vec![],
    };
    let vm = Vm::build(config, Box::new(|_line: &str| {})).expect("build VM");
    let nvme = vm.nvme(None).expect("the VM has its NVMe controller").clone();
    if boot {
        vm.boot().expect("boot");
        vm.resume().expect("run");
    }
    GuestVm { vm, nvme }
}

impl GuestVm {
    fn console(&self) -> String {
        self.vm.console_lines().join("\n")
    }

    /// Wait for the guest to exit; returns its code.
    fn wait_exit(&self, limit: Duration) -> u32 {
        let t = Instant::now();
        loop {
            if let Some(c) = self.vm.guest_exit_code() {
                return c;
            }
            assert!(t.elapsed() < limit, "guest did not exit in {limit:?}; console:\n{}", self.console());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn wait_console(&self, text: &str, limit: Duration) {
        let t = Instant::now();
        while !self.console().contains(text) {
            assert!(self.vm.guest_exit_code().is_none(), "guest exited waiting for {text:?}:\n{}", self.console());
            assert!(t.elapsed() < limit, "no {text:?} on the console in {limit:?}:\n{}", self.console());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn wait_progress(&self, at_least: u64, limit: Duration) {
        let t = Instant::now();
        while self.vm.guest_progress() < at_least {
            assert!(self.vm.guest_exit_code().is_none(), "guest exited:\n{}", self.console());
            assert!(t.elapsed() < limit, "progress stuck at {}:\n{}", self.vm.guest_progress(), self.console());
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

#[test]
fn guest_verifier_passes_on_memory_and_file() {
    let disk = tempfile::NamedTempFile::new().unwrap();
    disk.as_file().set_len(16 << 20).unwrap();
    for (name, spec) in [("nvg-mem", "ns=mem:16M".to_string()), ("nvg-file", format!("ns=file:{}", disk.path().display()))] {
        let g = start(name, "workload=nvme-verify qd=32 ops=2000", &spec, true);
        let code = g.wait_exit(Duration::from_secs(300));
        let console = g.console();
        assert_eq!(code, 0, "{name}: verifier failed:\n{console}");
        assert!(console.contains("nvme-verify: PASS"), "{console}");
        assert!(console.contains("nvme: Transit virtual NVMe"), "{console}");
        let st = g.nvme.lock().unwrap().stats();
        assert!(st["writes"].as_u64().unwrap() > 500, "{st}");
        // The only errors are the malformed commands of the guest's command check.
        assert!(console.contains("nvme-verify: command check passed"), "{console}");
        assert!(st["errors"].as_u64().unwrap() < 30, "{st}");
        assert_eq!(st["io_queues"], 1);
    }
}

#[test]
fn guest_perf_reports_iops_and_latency() {
    let g = start("nvg-perf", "workload=nvme-perf rw=randwrite bs=4096 qd=8 queues=2 secs=1", "ns=mem:16M", true);
    let code = g.wait_exit(Duration::from_secs(300));
    let console = g.console();
    assert_eq!(code, 0, "{console}");
    let line = console.lines().find(|l| l.contains("iops=")).unwrap_or_else(|| panic!("no result line:\n{console}"));
    assert!(line.contains("lat_p50_us=") && line.contains("lat_p99_us="), "{line}");
    let iops: u64 = line.split_whitespace().find_map(|w| w.strip_prefix("iops=")).unwrap().parse().unwrap();
    assert!(iops > 0, "{line}");
    eprintln!("{console}");
}

/// Sequential 128 KiB reads and 64 KiB verified writes: the guest builds
/// PRP lists.
#[test]
fn guest_large_transfers_use_prp_lists() {
    let g = start("nvg-seq", "workload=nvme-perf rw=read bs=128K qd=4 secs=1", "ns=mem:16M", true);
    assert_eq!(g.wait_exit(Duration::from_secs(300)), 0, "{}", g.console());
    assert!(g.console().contains("rw=read bs=131072"), "{}", g.console());
    let g = start("nvg-seqw", "workload=nvme-perf rw=write bs=64K qd=4 secs=1", "ns=mem:16M", true);
    assert_eq!(g.wait_exit(Duration::from_secs(300)), 0, "{}", g.console());
    let g = start("nvg-big", "workload=nvme-verify bs=64K qd=8 ops=400", "ns=mem:16M,block=4096", true);
    assert_eq!(g.wait_exit(Duration::from_secs(300)), 0, "{}", g.console());
    assert!(g.console().contains("nvme-verify: PASS"), "{}", g.console());
}

#[test]
fn guest_sees_namespace_hot_add_and_remove() {
    let g = start("nvg-hot", "workload=nvme-verify qd=8", "ns=mem:8M", true);
    g.wait_progress(512, Duration::from_secs(300));
    let nsid = g.nvme.lock().unwrap().attach_namespace("mem:4M").unwrap();
    assert_eq!(nsid, 2);
    g.wait_console("nvme: namespace 2 changed", Duration::from_secs(120));
    g.wait_console("1 namespaces changed, 2 active now", Duration::from_secs(60));
    g.nvme.lock().unwrap().detach_namespace(2).unwrap();
    g.wait_console("1 namespaces changed, 1 active now", Duration::from_secs(120));
    // The verifier never noticed anything wrong.
    let before = g.vm.guest_progress();
    g.wait_progress(before + 512, Duration::from_secs(120));
    assert!(!g.console().contains("FAIL"), "{}", g.console());
}

/// Pause in the middle of the verifier at queue depth 128 (file backend,
/// commands in flight), move RAM, vCPU and controller state to a new VM,
/// and let the verifier finish there: it must pass (no lost or duplicated write).
#[test]
fn save_restore_in_the_middle_of_the_verifier() {
    let disk = tempfile::NamedTempFile::new().unwrap();
    disk.as_file().set_len(32 << 20).unwrap();
    let spec = format!("ns=file:{},queues=4,depth=1024", disk.path().display());
    let cmd = "workload=nvme-verify qd=128 queues=2 ops=6000";
    let src = start("nvg-src", cmd, &spec, true);
    src.wait_progress(1500, Duration::from_secs(300));
    // The vmm's own pause / save: vCPUs stop, the controller drains.
    src.vm.pause();
    let state = src.vm.save_state().unwrap();
    assert!(state.get("nvme0").is_ok(), "the controller is part of the VM state");
    let progress_at_save = src.vm.guest_progress();
    let size = src.vm.ram().size() as usize;
    let mut ram = vec![0u8; size];
    src.vm.ram().memory().read_slice(&mut ram, GuestAddress(0)).unwrap();
    let src_console = src.console();
    drop(src);

    let dst = start("nvg-dst", cmd, &spec, false);
    dst.vm.ram().memory().write_slice(&ram, GuestAddress(0)).unwrap();
    dst.vm.restore_state(&state).unwrap();
    dst.vm.resume().unwrap();
    let code = dst.wait_exit(Duration::from_secs(600));
    let console = dst.console();
    assert_eq!(code, 0, "verifier failed after restore:\nsource:\n{src_console}\ndestination:\n{console}");
    assert!(console.contains("nvme-verify: PASS"), "{console}");
    assert!(dst.vm.guest_progress() >= progress_at_save);
}

/// The verifier is not vacuous: data changed behind its back is a FAIL.
#[test]
fn guest_verifier_catches_corrupted_blocks() {
    use std::os::unix::fs::FileExt;
    let disk = tempfile::NamedTempFile::new().unwrap();
    disk.as_file().set_len(1 << 20).unwrap();
    let g = start("nvg-corrupt", "workload=nvme-verify qd=4", &format!("ns=file:{}", disk.path().display()), true);
    g.wait_progress(512, Duration::from_secs(300));
    let zeros = vec![0u8; 1 << 20];
    let t = Instant::now();
    while g.vm.guest_exit_code().is_none() {
        disk.as_file().write_all_at(&zeros, 0).unwrap();
        assert!(t.elapsed() < Duration::from_secs(120), "corruption not detected:\n{}", g.console());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(g.vm.guest_exit_code(), Some(1));
    assert!(g.console().contains("nvme-verify: FAIL block"), "{}", g.console());
}

/// ... and so is a command that never completes (here: the controller is
/// paused under a running guest).
#[test]
fn guest_verifier_catches_a_lost_completion() {
    let g = start("nvg-stall", "workload=nvme-verify qd=8 stall=2", "ns=mem:8M", true);
    g.wait_progress(512, Duration::from_secs(300));
    devices::Lifecycle::pause(&mut *g.nvme.lock().unwrap());
    assert_eq!(g.wait_exit(Duration::from_secs(120)), 1);
    assert!(g.console().contains("nvme-verify: FAIL no completion for 2 s"), "{}", g.console());
}
