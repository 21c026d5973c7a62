//! Live migration of a VM in the middle of the NVMe verifier at high queue
//! depth: two real `transit vm run --nvme` processes on this machine share
//! the namespace file (the shared storage), the source migrates to the
//! destination over TCP, and the verifier, which checks every block it wrote
//! before and after the move, must end in PASS there.

use serde_json::json;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};
use vmm::testing::{unique_name, VmProcess};

/// Build (if needed) and point `vmm::testing` at the transit binary.
fn transit() -> PathBuf {
    if let Some(p) = std::env::var_os("TRANSIT_BIN") {
        return p.into();
    }
    let dir = testbed::build::build_dir();
    let target = dir.parent().unwrap().to_path_buf();
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.args(["build", "-q", "-p", "transit", "--bin", "transit"]).env("CARGO_TARGET_DIR", &target).env("UNICORN_NO_PKG_CONFIG", "1");
    if dir.ends_with("release") {
        c.arg("--release");
    }
    assert!(c.status().expect("cargo build -p transit").success(), "building transit failed");
    let bin = dir.join("transit");
    std::env::set_var("TRANSIT_BIN", &bin);
    bin
}

#[test]
fn live_migration_in_the_middle_of_the_verifier() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let disk = dir.path().join("shared.img");
    std::fs::File::create(&disk).unwrap().set_len(64 << 20).unwrap();
    migrate_verifier(&format!("name=nvme0,queues=4,depth=1024,ns=file:{}", disk.display()));
}

/// A memory namespace has no shared storage: its contents travel in the
/// controller's state, and the verifier's re-reads on the destination
/// check them. (8 MiB: device state must fit the migration stream's 16 MiB
/// control frame.)
#[test]
fn live_migration_with_a_memory_namespace() {
    migrate_verifier("name=nvme0,queues=4,depth=1024,ns=mem:8M");
}

fn migrate_verifier(nvme: &str) {
    transit();
    let vm_args = |extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = ["--memory", "128M", "--workload", "nvme-verify", "--args", "qd=128 queues=2 ops=40000", "--nvme", nvme]
            .iter()
            .map(|s| s.to_string())
            .collect();
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let src_args = vm_args(&[]);
    let src = VmProcess::run_local(&unique_name("nvmig-src"), &src_args.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
    // A never-run VM listens on a port the kernel picks and says which:
    // a port found free and let go first could be taken meanwhile.
    let dst_args = vm_args(&["--paused"]);
    let mut dst = VmProcess::run_local(&unique_name("nvmig-dst"), &dst_args.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
    let listening = dst.exec("migrate-incoming", json!({"uri": "tcp:127.0.0.1:0", "resume": true})).unwrap();
    let uri = format!("tcp:127.0.0.1:{}", listening["port"]);

    // Migrate while the verifier runs at queue depth 128 on two queues.
    src.wait_progress(3000, Duration::from_secs(300)).unwrap();
    src.exec("migrate", json!({ "uri": uri })).unwrap();
    let t = Instant::now();
    let done = loop {
        let st = dst.exec("query-migrate", json!({})).unwrap();
        if matches!(st["status"].as_str(), Some("completed" | "failed" | "cancelled")) {
            break st;
        }
        assert!(t.elapsed() < Duration::from_secs(300), "migration still {st}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(done["status"], "completed", "destination: {done:#}\nsource console:\n{}", src.console());
    let nvme_dst = dst.exec("query-nvme", json!({})).unwrap();
    assert_eq!(nvme_dst[0]["name"], "nvme0", "{nvme_dst}");

    // The verifier finishes on the destination and finds every block
    // intact; the vmm exits with the guest's code.
    let code = dst.wait_exit(Duration::from_secs(600)).unwrap();
    let console = dst.console();
    assert_eq!(code, Some(0), "verifier failed after live migration:\nsource:\n{}\ndestination:\n{console}", src.console());
    assert!(console.contains("nvme-verify: PASS"), "{console}");
    assert!(!src.console().contains("PASS"), "the source stopped before the verifier finished");
}

#[test]
fn namespace_hot_add_and_remove_through_the_control_socket() {
    transit();
    let vm = VmProcess::run_local(
        &unique_name("nvhot"),
        &["--memory", "64M", "--workload", "nvme-verify", "--args", "qd=16", "--nvme", "name=nvme0,ns=mem:8M"],
    )
    .unwrap();
    vm.wait_progress(512, Duration::from_secs(300)).unwrap();
    let r = vm.exec("nvme-ns-add", json!({ "spec": "mem:4M" })).unwrap();
    assert_eq!(r["nsid"], 2);
    let wait_console = |text: &str| {
        let t = Instant::now();
        while !vm.console().contains(text) {
            assert!(t.elapsed() < Duration::from_secs(120), "no {text:?} on the console:\n{}", vm.console());
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    wait_console("nvme: namespace 2 changed");
    wait_console("1 namespaces changed, 2 active now");
    let q = vm.exec("query-nvme", json!({})).unwrap();
    assert_eq!(q[0]["stats"]["namespaces"].as_array().unwrap().len(), 2, "{q}");
    vm.exec("nvme-ns-remove", json!({ "nsid": 2 })).unwrap();
    wait_console("1 namespaces changed, 1 active now");
    assert!(vm.exec("nvme-ns-remove", json!({ "nsid": 2 })).is_err(), "removing twice is an error");
    assert!(vm.exec("nvme-ns-add", json!({ "spec": "file:/nonexistent/disk.img" })).is_err());
    let p = vm.status().unwrap()["guest_progress"].as_u64().unwrap();
    vm.wait_progress(p + 512, Duration::from_secs(120)).unwrap();
    assert!(!vm.console().contains("FAIL"), "{}", vm.console());
}

/// `save` to a file in the middle of the verifier (memory namespace: its
/// data is in the file), then `transit vm restore` in a new process: the
/// verifier carries on from where it was and passes.
#[test]
fn save_file_and_restore_in_a_new_process() {
    transit();
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let save = dir.path().join("vm.save");
    let mut src = VmProcess::run_local(
        &unique_name("nvsave"),
        &["--memory", "64M", "--workload", "nvme-verify", "--args", "qd=64 ops=20000", "--nvme", "name=nvme0,ns=mem:8M"],
    )
    .unwrap();
    src.wait_progress(2000, Duration::from_secs(300)).unwrap();
    src.exec("save", json!({ "filename": save })).unwrap();
    src.kill();
    let name = unique_name("nvrestore");
    let mut dst = VmProcess::start(Command::new(transit()), &name, &["vm", "restore", save.to_str().unwrap()]).unwrap();
    let code = dst.wait_exit(Duration::from_secs(600)).unwrap();
    let console = dst.console();
    assert_eq!(code, Some(0), "verifier failed after restore:\n{console}");
    assert!(console.contains("nvme-verify: PASS"), "{console}");
}
