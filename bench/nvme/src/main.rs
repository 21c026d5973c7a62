//! bench/nvme: 4 KiB random reads and writes through the virtual NVMe
//! controller driven by a host-side driver at native speed (no vCPU), on the
//! memory and the file backend, beside plain io_uring on the same file in
//! the same run; then the guest-side figures from the emulated vCPU when a
//! `transit` binary is available. No arguments. Last line: JSON rows.

use devices::nvme::harness::{setup, HostDriver};
use devices::nvme::spec::Command;
use io_uring::{opcode, types, IoUring};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const BS: usize = 4096;
const FILE_BYTES: u64 = 256 << 20;
const RUN: Duration = Duration::from_millis(1000);

#[derive(Clone)]
struct Row {
    side: &'static str,
    backend: &'static str,
    pattern: &'static str,
    qd: u32,
    queues: u32,
    iops: f64,
    p50_us: f64,
    p99_us: f64,
    /// Operations per second of CPU time the process used during the run:
    /// the machine is shared, so this is the "per core" figure.
    cpu_iops: f64,
}

impl Row {
    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "side": self.side, "backend": self.backend, "pattern": self.pattern,
            "qd": self.qd, "queues": self.queues, "iops": self.iops.round(),
            "lat_p50_us": (self.p50_us * 100.0).round() / 100.0,
            "lat_p99_us": (self.p99_us * 100.0).round() / 100.0,
            "iops_per_cpu_core": self.cpu_iops.round(),
        })
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// CPU time of this process (all threads), ns.
fn cpu_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: plain syscall filling a timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn percentiles(lat_ns: &mut [u32]) -> (f64, f64) {
    if lat_ns.is_empty() {
        return (0.0, 0.0);
    }
    lat_ns.sort_unstable();
    let at = |p: f64| lat_ns[((lat_ns.len() as f64 * p) as usize).min(lat_ns.len() - 1)] as f64 / 1000.0;
    (at(0.50), at(0.99))
}

/// The device alone: `queues` queue pairs each kept `qd` deep by one thread.
fn device_run(spec: &str, backend: &'static str, write: bool, qd: u32, queues: u32, blocks: u64) -> Row {
    let mut d: HostDriver = setup(spec, 512 << 20);
    d.create_io_queues(queues as u16, 4096).unwrap();
    let bufs: Vec<u64> = (0..queues * qd).map(|_| d.alloc(BS as u64)).collect();
    if backend == "memory" {
        // Touch every page of the memory namespace once, so the run measures
        // the device rather than the host's first-touch page faults.
        for b in 0..blocks {
            let c = d.rw_cmd(true, 1, b * (BS / 512) as u64, (BS / 512) as u32, bufs[0], BS, None);
            assert!(d.io_cmd(1, c).status.is_success());
        }
    }
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let nlb = (BS / 512) as u32;
    let mut started = vec![Instant::now(); (queues * qd) as usize];
    let mut lats: Vec<u32> = Vec::with_capacity(4 << 20);
    let submit = |d: &mut HostDriver, q: usize, slot: u32, rng: &mut Rng, started: &mut [Instant]| {
        let lba = (rng.next() % blocks) * nlb as u64;
        let idx = (q as u32 - 1) * qd + slot;
        let mut c: Command = d.rw_cmd(write, 1, lba, nlb, bufs[idx as usize], BS, None);
        c.cid = slot as u16;
        started[idx as usize] = Instant::now();
        d.push(q, &c);
    };
    for q in 1..=queues as usize {
        for s in 0..qd {
            submit(&mut d, q, s, &mut rng, &mut started);
        }
        d.ring(q);
    }
    let t0 = Instant::now();
    let cpu0 = cpu_ns();
    let mut done = 0u64;
    let mut out = Vec::with_capacity(64);
    let mut measuring = true;
    while measuring {
        for q in 1..=queues as usize {
            out.clear();
            d.poll_many(q, qd as usize, &mut out);
            let now = Instant::now();
            for c in &out {
                assert!(c.status.is_success(), "I/O failed: {:?}", c.status);
                let idx = (q as u32 - 1) * qd + c.cid as u32;
                lats.push(now.duration_since(started[idx as usize]).as_nanos() as u32);
                submit(&mut d, q, c.cid as u32, &mut rng, &mut started);
            }
            if !out.is_empty() {
                d.ring(q);
            }
            done += out.len() as u64;
        }
        if done % 1024 < 64 && t0.elapsed() > RUN {
            measuring = false;
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let cpu_secs = (cpu_ns() - cpu0) as f64 / 1e9;
    // Let the last commands finish before the controller goes away.
    for q in 1..=queues as usize {
        let mut left = qd as usize;
        while left > 0 {
            out.clear();
            left -= d.poll_many(q, left, &mut out);
        }
    }
    let (p50, p99) = percentiles(&mut lats);
    Row { side: "device", backend, pattern: if write { "randwrite" } else { "randread" }, qd, queues, iops: done as f64 / secs, p50_us: p50, p99_us: p99, cpu_iops: done as f64 / cpu_secs }
}

/// Plain io_uring on the same file: `queues` rings each kept `qd` deep, one thread.
fn uring_run(path: &Path, write: bool, qd: u32, queues: u32, blocks: u64) -> Row {
    let file = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    let fd = file.as_raw_fd();
    let mut rings: Vec<IoUring> = (0..queues).map(|_| IoUring::new(qd.next_power_of_two().max(8)).unwrap()).collect();
    let mut bufs: Vec<Vec<u8>> = (0..queues * qd).map(|_| vec![0x5au8; BS]).collect();
    let mut started = vec![Instant::now(); (queues * qd) as usize];
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let mut lats: Vec<u32> = Vec::with_capacity(4 << 20);
    let push = |ring: &mut IoUring, idx: usize, buf: &mut Vec<u8>, rng: &mut Rng, started: &mut [Instant]| {
        let off = (rng.next() % blocks) * BS as u64;
        let e = if write {
            opcode::Write::new(types::Fd(fd), buf.as_ptr(), BS as u32).offset(off).build()
        } else {
            opcode::Read::new(types::Fd(fd), buf.as_mut_ptr(), BS as u32).offset(off).build()
        };
        started[idx] = Instant::now();
        unsafe { ring.submission().push(&e.user_data(idx as u64)).unwrap() };
    };
    for (q, ring) in rings.iter_mut().enumerate() {
        for s in 0..qd as usize {
            let idx = q * qd as usize + s;
            push(ring, idx, &mut bufs[idx], &mut rng, &mut started);
        }
        ring.submit().unwrap();
    }
    let t0 = Instant::now();
    let cpu0 = cpu_ns();
    let mut done = 0u64;
    let mut finished = Vec::with_capacity(64);
    loop {
        for ring in rings.iter_mut() {
            finished.clear();
            finished.extend(ring.completion().map(|c| {
                assert_eq!(c.result(), BS as i32, "io_uring I/O failed");
                c.user_data() as usize
            }));
            let now = Instant::now();
            for &idx in &finished {
                lats.push(now.duration_since(started[idx]).as_nanos() as u32);
                push(ring, idx, &mut bufs[idx], &mut rng, &mut started);
            }
            if !finished.is_empty() {
                ring.submit().unwrap();
            }
            done += finished.len() as u64;
        }
        if done % 1024 < 64 && t0.elapsed() > RUN {
            break;
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let cpu_secs = (cpu_ns() - cpu0) as f64 / 1e9;
    // The buffers must outlive the requests still in flight.
    for ring in &mut rings {
        let mut left = qd as usize;
        while left > 0 {
            ring.submit_and_wait(1).unwrap();
            left -= ring.completion().count();
        }
    }
    let (p50, p99) = percentiles(&mut lats);
    Row { side: "io_uring", backend: "file", pattern: if write { "randwrite" } else { "randread" }, qd, queues, iops: done as f64 / secs, p50_us: p50, p99_us: p99, cpu_iops: done as f64 / cpu_secs }
}

fn bench_dir() -> PathBuf {
    // A real file system (not tmpfs), next to the build output.
    let base = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("target"));
    let dir = base.join(format!("nvme-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

struct Cleanup(PathBuf);
impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn main() -> anyhow::Result<()> {
    let dir = bench_dir();
    let _cleanup = Cleanup(dir.clone());
    let disk = dir.join("disk.img");
    {
        // Fill the file so reads hit real data (and the page cache, for both sides alike).
        use std::io::Write;
        let mut f = std::fs::File::create(&disk)?;
        let chunk = vec![0xa5u8; 1 << 20];
        for _ in 0..(FILE_BYTES >> 20) {
            f.write_all(&chunk)?;
        }
        f.sync_all()?;
    }
    let blocks = FILE_BYTES / BS as u64;
    let mut rows = Vec::new();
    // NVME_BENCH_ONLY=randread (or qd32, ...) narrows the host rows while
    // investigating; the default is everything.
    let only = std::env::var("NVME_BENCH_ONLY").unwrap_or_default();
    let combos: Vec<(bool, u32, u32)> = [false, true]
        .iter()
        .flat_map(|&w| [(1u32, 1u32), (32, 1), (1, 4), (32, 4)].map(move |(qd, q)| (w, qd, q)))
        .filter(|&(w, qd, q)| format!("{}-qd{qd}-q{q}", if w { "randwrite" } else { "randread" }).contains(&only))
        .collect();
    // The host is shared: run every configuration REPEAT times, interleaving
    // device and baseline, and keep the run with the median IOPS of each.
    const REPEAT: usize = 3;
    let mut runs: Vec<Vec<Row>> = vec![Vec::new(); combos.len() * 3];
    for _ in 0..REPEAT {
        for (i, &(write, qd, queues)) in combos.iter().enumerate() {
            let mem_spec = format!("ns=mem:{}M,queues=4", FILE_BYTES >> 20);
            runs[i * 3].push(device_run(&mem_spec, "memory", write, qd, queues, blocks));
            let file_spec = format!("ns=file:{},queues=4", disk.display());
            runs[i * 3 + 1].push(device_run(&file_spec, "file", write, qd, queues, blocks));
            runs[i * 3 + 2].push(uring_run(&disk, write, qd, queues, blocks));
        }
    }
    for mut r in runs {
        r.sort_by(|a, b| a.iops.total_cmp(&b.iops));
        rows.push(r[r.len() / 2].clone());
    }
    if only.is_empty() {
        rows.extend(guest_rows(&dir));
    }

    println!(
        "{:<9} {:<7} {:<10} {:>3} {:>6} {:>10} {:>12} {:>9} {:>9} {:>11}",
        "side", "backend", "pattern", "qd", "queues", "IOPS", "IOPS/core", "p50 us", "p99 us", "vs io_uring"
    );
    for r in &rows {
        let base = rows.iter().find(|b| b.side == "io_uring" && b.pattern == r.pattern && b.qd == r.qd && b.queues == r.queues);
        let ratio = match (r.side, r.backend, base) {
            ("device", "file", Some(b)) if b.iops > 0.0 => format!("{:.2}x/{:.2}x", r.iops / b.iops, r.cpu_iops / b.cpu_iops),
            _ => String::new(),
        };
        println!(
            "{:<9} {:<7} {:<10} {:>3} {:>6} {:>10.0} {:>12.0} {:>9.2} {:>9.2} {:>11}",
            r.side, r.backend, r.pattern, r.qd, r.queues, r.iops, r.cpu_iops, r.p50_us, r.p99_us, ratio
        );
    }
    println!("{}", serde_json::json!({ "rows": rows.iter().map(Row::json).collect::<Vec<_>>() }));
    Ok(())
}

/// Guest-side figures: the nvme-perf workload in a VM on the emulated vCPU
/// (the controller attached the way the vmm attaches it: MMIO BAR + PCI).
fn guest_rows(dir: &Path) -> Vec<Row> {
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
                });
            }
        }
    }
    rows
}
