//! Guest-side figures: the nvme-perf workload in a VM on the emulated vCPU.

use crate::host::cpu_ns;
use crate::Row;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::FILE_BYTES;

/// Guest-side figures: the nvme-perf workload in a VM on the emulated vCPU
/// (the controller attached the way the vmm attaches it: MMIO BAR + PCI).
pub fn guest_rows(dir: &Path) -> Vec<Row> {
    use std::sync::{Arc, Mutex};
    let mut rows = Vec::new();
    let disk = dir.join("disk.img");
    for (backend, ns) in [("memory", format!("ns=mem:{}M", FILE_BYTES >> 20)), ("file", format!("ns=file:{}", disk.display()))] {
        for write in [false, true] {
            for (qd, queues) in [(1u32, 1u32), (32, 1), (1, 4), (32, 4)] {
                let rw = if write { "randwrite" } else { "randread" };
                let cmdline = format!("workload=nvme-perf rw={rw} bs=4096 qd={qd} queues={queues} secs=2");
                let config = vmm::config::VmConfig {
                    name: "nvme-bench".into(),
                    memory: 256 << 20,
                    vcpus: 1,
                    firmware: guest_image::default_path(),
                    cmdline,
                    nvme: Vec::new(),
                    pvrdma: Vec::new(),
                };
                let vm = match vmm::vm::Vm::build(config, Box::new(|_l: &str| {})) {
                    Ok(vm) => vm,
                    Err(e) => {
                        eprintln!("guest rows skipped: {e:#}");
                        return rows;
                    }
                };
                let bar = devices::layout::PCI_BAR_BASE;
                let cfg = devices::nvme::NvmeConfig::parse(&format!("{ns},queues=4")).unwrap();
                let ctrl = Arc::new(Mutex::new(devices::nvme::NvmeController::new(cfg, vm.ram().memory().clone(), bar).unwrap()));
                vm.buses().mmio.insert(ctrl.clone(), bar, devices::nvme::NvmeController::BAR0_SIZE).unwrap();
                vm.pci().lock().unwrap().add(ctrl.clone()).unwrap();
                vm.boot().unwrap();
                let cpu0 = cpu_ns();
                vm.resume().unwrap();
                let t = Instant::now();
                while vm.guest_exit_code().is_none() && t.elapsed() < Duration::from_secs(120) {
                    std::thread::sleep(Duration::from_millis(20));
                }
                let cpu_secs = (cpu_ns() - cpu0) as f64 / 1e9;
                let console = vm.console_lines().join("\n");
                vm.shutdown();
                let Some(line) = console.lines().find(|l| l.starts_with("nvme-perf:") && l.contains("iops=")) else {
                    eprintln!("guest run {rw} qd={qd} queues={queues} on {backend} gave no result:\n{console}");
                    continue;
                };
                let field = |k: &str| -> f64 {
                    line.split_whitespace().find_map(|w| w.strip_prefix(k)).and_then(|v| v.parse().ok()).unwrap_or(0.0)
                };
                rows.push(Row {
                    side: "guest",
                    backend,
                    pattern: if write { "randwrite" } else { "randread" },
                    qd,
                    queues,
                    iops: field("iops="),
                    p50_us: field("lat_p50_us="),
                    p99_us: field("lat_p99_us="),
                    cpu_iops: field("ios=") / cpu_secs,
                    vs_uring: None,
                });
            }
        }
    }
    rows
}
