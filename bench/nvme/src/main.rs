//! bench/nvme: 4 KiB random reads and writes through the virtual NVMe
//! controller driven by a host-side driver at native speed (no vCPU), on the
//! memory and the file backend, beside plain io_uring on the same file in
//! the same run; then the guest-side figures from the emulated vCPU when a
//! `transit` binary is available. Last line: JSON rows.
//!
//! Run: `bench/nvme/run [--only randwrite-qd1-q1]` (`--only` takes any
//! substring of that form: it narrows the host rows and skips the guest
//! rows).

mod guest;
mod host;

use host::{percentiles, DeviceSide, Load, Side, Tally, UringSide};
use std::path::PathBuf;
use std::time::Duration;

pub const FILE_BYTES: u64 = 256 << 20;
/// The device and plain io_uring on the file take turns in slices this
/// long, ROUNDS times each, the first side alternating: a stall of the
/// shared disk or a burst of other load then hits both sides alike.
const SLICE: Duration = Duration::from_millis(125);
const ROUNDS: usize = 16;
/// Slices of the memory backend (no baseline to interleave with).
const MEMORY_SLICES: usize = 8;
/// The file backend must reach this fraction of plain io_uring (issue target).
const TARGET: f64 = 0.8;

#[derive(Clone, Default)]
pub struct Row {
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
    /// File rows of the device: over plain io_uring in the same
    /// interleaved run.
    vs_uring: Option<Ratio>,
}

impl Row {
    fn from_tally(side: &'static str, backend: &'static str, load: &Load, mut t: Tally) -> Row {
        let (p50_us, p99_us) = percentiles(&mut t.lat_ns);
        Row {
            side,
            backend,
            pattern: load.pattern(),
            qd: load.qd,
            queues: load.queues,
            iops: t.iops(),
            p50_us,
            p99_us,
            cpu_iops: t.cpu_iops(),
            vs_uring: None,
        }
    }

    fn json(&self) -> serde_json::Value {
        let r2 = |x: f64| (x * 100.0).round() / 100.0;
        let mut v = serde_json::json!({
            "side": self.side, "backend": self.backend, "pattern": self.pattern,
            "qd": self.qd, "queues": self.queues, "iops": self.iops.round(),
            "lat_p50_us": r2(self.p50_us),
            "lat_p99_us": r2(self.p99_us),
            "iops_per_cpu_core": self.cpu_iops.round(),
        });
        if let Some(r) = self.vs_uring {
            v["vs_io_uring_iops"] = r2(r.iops).into();
            v["vs_io_uring_iops_per_cpu"] = r2(r.cpu_iops).into();
            v["vs_io_uring_iops_total"] = r2(r.iops_total).into();
            v["vs_io_uring_iops_per_cpu_total"] = r2(r.cpu_iops_total).into();
        }
        v
    }
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

/// The device on the file and plain io_uring on the same file, alternating
/// slices; returns (device row, io_uring row).
fn file_pair(disk: &std::path::Path, load: Load, tails: bool) -> (Row, Row) {
    let mut dev = DeviceSide::new(&format!("ns=file:{},queues=4", disk.display()), load, false);
    let mut uring = UringSide::new(disk, load);
    let (mut td, mut tu) = (Tally::default(), Tally::default());
    for round in 0..ROUNDS {
        if round % 2 == 0 {
            dev.slice(SLICE, &mut td);
            uring.slice(SLICE, &mut tu);
        } else {
            uring.slice(SLICE, &mut tu);
            dev.slice(SLICE, &mut td);
        }
    }
    let ratio = Ratio::paired(&td, &tu);
    if tails {
        tail_report(&load, &[("device", &td), ("io_uring", &tu)]);
        let pairs: Vec<String> = td
            .slices
            .iter()
            .zip(&tu.slices)
            .map(|(d, b)| format!("{:.2}", (d.0 as f64 / d.2 as f64) / (b.0 as f64 / b.2.max(1) as f64)))
            .collect();
        eprintln!("  per-CPU ratio of each pair: {}", pairs.join(" "));
        for (name, t) in [("device", &td), ("io_uring", &tu)] {
            let s: Vec<String> = t.slices.iter().map(|s| format!("{}/{}/{}", s.0, s.1 / 1_000_000, s.2 / 1_000_000)).collect();
            eprintln!("  {name} slices (ops/wall ms/cpu ms): {}", s.join(" "));
        }
    }
    let mut d = Row::from_tally("device", "file", &load, td);
    d.vs_uring = Some(ratio);
    (d, Row::from_tally("io_uring", "file", &load, tu))
}

/// The device over plain io_uring. Slices run in pairs (one of each side,
/// back to back), so each pair saw about the same machine; the median over
/// the pairs is the figure, which one long stall of the shared disk or a
/// burst of other load in a single slice cannot move. Ratios of the totals
/// are kept beside it.
#[derive(Clone, Copy, Default)]
pub struct Ratio {
    pub iops: f64,
    pub cpu_iops: f64,
    pub iops_total: f64,
    pub cpu_iops_total: f64,
}

impl Ratio {
    fn paired(dev: &Tally, base: &Tally) -> Ratio {
        let median = |f: &dyn Fn(&(u64, u64, u64)) -> f64| {
            let mut v: Vec<f64> = dev.slices.iter().zip(&base.slices).map(|(d, b)| f(d) / f(b).max(1e-9)).collect();
            v.sort_by(f64::total_cmp);
            match v.len() {
                0 => 0.0,
                n if n % 2 == 1 => v[n / 2],
                n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
            }
        };
        Ratio {
            iops: median(&|s| s.0 as f64 / s.1.max(1) as f64),
            cpu_iops: median(&|s| s.0 as f64 / s.2.max(1) as f64),
            iops_total: dev.iops() / base.iops(),
            cpu_iops_total: dev.cpu_iops() / base.cpu_iops(),
        }
    }
}

/// `--tails`: where the time went, on stderr (the shared disk and
/// a busy host show up as a few long stalls that dominate the mean).
fn tail_report(load: &Load, sides: &[(&str, &Tally)]) {
    for (name, t) in sides {
        let mut l = t.lat_ns.clone();
        l.sort_unstable();
        if l.is_empty() {
            continue;
        }
        let at = |p: f64| l[((l.len() as f64 * p) as usize).min(l.len() - 1)] as f64 / 1000.0;
        let mean = l.iter().map(|&x| x as f64).sum::<f64>() / l.len() as f64 / 1000.0;
        let slow: Vec<u32> = l.iter().copied().filter(|&x| x > 100_000).collect();
        let slow_ms = slow.iter().map(|&x| x as f64).sum::<f64>() / 1e6;
        eprintln!(
            "{} qd{} q{} {name:9} ops {} mean {mean:.1} p10 {:.1} p50 {:.1} p90 {:.1} p99 {:.1} p99.9 {:.1} us; {} over 100 us ({slow_ms:.0} ms); wall {} ms, cpu {} ms",
            load.pattern(), load.qd, load.queues, l.len(), at(0.1), at(0.5), at(0.9), at(0.99), at(0.999), slow.len(), t.wall_ns / 1_000_000, t.cpu_ns / 1_000_000
        );
    }
}

fn memory_row(load: Load) -> Row {
    let mut dev = DeviceSide::new(&format!("ns=mem:{}M,queues=4", FILE_BYTES >> 20), load, true);
    let mut t = Tally::default();
    for _ in 0..MEMORY_SLICES {
        dev.slice(SLICE, &mut t);
    }
    Row::from_tally("device", "memory", &load, t)
}

/// 4 KiB random I/O through the virtual NVMe controller (memory and file
/// backends, from the host and from the guest), beside plain io_uring on the
/// same file in the same run.
#[derive(clap::Parser)]
#[command(name = "nvme-bench")]
struct Args {
    /// Only the host rows whose PATTERN-qdN-qN label contains this (e.g.
    /// randwrite-qd1-q1); skips the guest rows.
    #[arg(long, default_value = "")]
    only: String,
    /// Latency tails and per-slice ratios of the file rows on stderr (the
    /// shared disk and a busy host show up as a few long stalls).
    #[arg(long)]
    tails: bool,
}

fn main() -> anyhow::Result<()> {
    let Args { only, tails } = clap::Parser::parse();
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
    let blocks = FILE_BYTES / host::BS as u64;
    let loads: Vec<Load> = [false, true]
        .iter()
        .flat_map(|&write| [(1u32, 1u32), (32, 1), (1, 4), (32, 4)].map(move |(qd, queues)| Load { write, qd, queues, blocks }))
        .filter(|l| format!("{}-qd{}-q{}", l.pattern(), l.qd, l.queues).contains(&only))
        .collect();
    let mut rows = Vec::new();
    for load in loads {
        rows.push(memory_row(load));
        let (d, u) = file_pair(&disk, load, tails);
        rows.push(d);
        rows.push(u);
    }
    if only.is_empty() {
        rows.extend(guest::guest_rows(&dir));
    }

    println!(
        "{:<9} {:<7} {:<10} {:>3} {:>6} {:>10} {:>12} {:>9} {:>9}  vs io_uring: IOPS / per CPU-s, median of paired slices  (of the totals)",
        "side", "backend", "pattern", "qd", "queues", "IOPS", "IOPS/CPU-s", "p50 us", "p99 us"
    );
    for r in &rows {
        let ratio = r
            .vs_uring
            .map(|q| format!("{:.2}x / {:.2}x  ({:.2}x / {:.2}x)", q.iops, q.cpu_iops, q.iops_total, q.cpu_iops_total))
            .unwrap_or_default();
        println!(
            "{:<9} {:<7} {:<10} {:>3} {:>6} {:>10.0} {:>12.0} {:>9.2} {:>9.2}  {}",
            r.side, r.backend, r.pattern, r.qd, r.queues, r.iops, r.cpu_iops, r.p50_us, r.p99_us, ratio
        );
    }
    let file_rows: Vec<&Row> = rows.iter().filter(|r| r.vs_uring.is_some()).collect();
    if let Some(worst) = file_rows.iter().min_by(|a, b| a.vs_uring.unwrap().cpu_iops.total_cmp(&b.vs_uring.unwrap().cpu_iops)) {
        let cpu = worst.vs_uring.unwrap().cpu_iops;
        println!(
            "file backend vs plain io_uring per CPU-second (median of paired slices): lowest {cpu:.2}x ({} qd{} q{}); target >= {TARGET}: {}",
            worst.pattern,
            worst.qd,
            worst.queues,
            if cpu >= TARGET { "met" } else { "NOT met" }
        );
    }
    println!("{}", serde_json::json!({ "rows": rows.iter().map(Row::json).collect::<Vec<_>>() }));
    Ok(())
}
