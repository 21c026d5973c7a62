//! bench/vm: how fast the emulated vCPU dirties memory, and what save and
//! restore cost per GiB, each beside this machine's memcpy bandwidth
//! measured in the same run; and the share of its speed a throttled vCPU
//! keeps, beside its unthrottled speed in the same run. Prints a table and,
//! last, one JSON line.
//!
//! Run: `bench/vm/run` (or `cargo run --release -p vm-bench -- [--gib N]`).

use anyhow::Result;
use serde_json::json;
use std::time::{Duration, Instant};
use vmm::{Vm, VmConfig};

const GIB: f64 = (1u64 << 30) as f64;

fn vm(name: &str, memory: u64, cmdline: &str) -> Result<std::sync::Arc<Vm>> {
    let config = VmConfig {
        name: name.into(),
        memory,
        vcpus: 1,
        firmware: guest_image::default_path(),
        cmdline: cmdline.into(),
        nvme: vec![],
        pvrdma: vec![],
    };
    Vm::build(config, Box::new(|_| {}))
}

/// Copy `bytes` between two buffers a few times; best GiB/s.
fn memcpy_gib_per_s(bytes: usize) -> f64 {
    let src: Vec<u8> = (0..bytes).map(|i| (i * 7) as u8).collect();
    let mut dst = vec![1u8; bytes]; // touched: time the copy, not page faults
    let mut best = 0.0f64;
    for _ in 0..5 {
        let t = Instant::now();
        dst.copy_from_slice(&src);
        std::hint::black_box(&dst);
        best = best.max(bytes as f64 / GIB / t.elapsed().as_secs_f64());
    }
    best
}

fn dirty_rate(secs: u64) -> Result<(f64, f64)> {
    let mem = 256u64 << 20;
    let v = vm("bench-dirty", mem, "workload=dirtier")?;
    v.boot()?;
    v.resume()?;
    // Let it warm up (translation), then measure passes over guest time.
    std::thread::sleep(Duration::from_millis(500));
    let (p0, t0) = (v.guest_progress(), v.guest_time_ns());
    std::thread::sleep(Duration::from_secs(secs));
    let (p1, t1) = (v.guest_progress(), v.guest_time_ns());
    v.pause();
    v.shutdown();
    let pages_per_pass = (mem - (4 << 20)) / 4096;
    let pages = (p1 - p0) * pages_per_pass;
    let rate = pages as f64 / ((t1 - t0) as f64 / 1e9);
    Ok((rate, rate * 4096.0 / GIB))
}

/// The auto-converge throttle: the dirtier's passes per second (wall
/// clock) at each level, as a fraction of its unthrottled rate measured
/// just before, beside the share the level promises (1 - pct/100).
fn throttle_shares(secs: f64) -> Result<Vec<(u8, f64, f64)>> {
    let v = vm("bench-throttle", 16 << 20, "workload=dirtier")?;
    v.boot()?;
    v.resume()?;
    std::thread::sleep(Duration::from_millis(500));
    let rate = || {
        let (p0, t0) = (v.guest_progress(), Instant::now());
        std::thread::sleep(Duration::from_secs_f64(secs));
        (v.guest_progress() - p0) as f64 / t0.elapsed().as_secs_f64()
    };
    let free = rate();
    let mut out = Vec::new();
    for pct in [20u8, 50, 80, 95] {
        v.set_cpu_throttle(pct);
        out.push((pct, rate() / free.max(1e-9), 1.0 - f64::from(pct) / 100.0));
    }
    v.set_cpu_throttle(0);
    v.pause();
    v.shutdown();
    Ok(out)
}

fn save_restore(gib: u64, dir: &str) -> Result<(f64, f64, u64)> {
    let mem = gib << 30;
    let v = vm("bench-save", mem, "workload=fill")?;
    v.boot()?;
    v.resume()?;
    // The fill workload reports progress 1 when RAM is full.
    let t = Instant::now();
    while v.guest_progress() < 1 {
        anyhow::ensure!(t.elapsed() < Duration::from_secs(600), "fill did not finish");
        std::thread::sleep(Duration::from_millis(100));
    }
    v.pause();
    let file = std::path::PathBuf::from(dir).join(format!("transit-bench-{}.snap", std::process::id()));
    let state = v.save_state()?;
    let t = Instant::now();
    let st = vmm::savefile::write(&file, &v.config, &state, v.ram())?;
    let save_s = t.elapsed().as_secs_f64();
    v.shutdown();
    drop(v);
    let t = Instant::now();
    let r = vmm::savefile::open(&file)?;
    let w = Vm::build(r.header.config.clone(), Box::new(|_| {}))?;
    let state = r.state.clone();
    r.read_ram(w.ram())?;
    w.restore_state(&state)?;
    let restore_s = t.elapsed().as_secs_f64();
    w.shutdown();
    let _ = std::fs::remove_file(&file);
    Ok((gib as f64 / save_s, gib as f64 / restore_s, st.bytes))
}

/// Emulated vCPU speed, throttle shares and save/restore cost per GiB,
/// beside memcpy in the same run. Last line: one JSON object.
#[derive(clap::Parser)]
#[command(name = "vm-bench")]
struct Args {
    /// RAM of the VM saved and restored, GiB.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    gib: u64,
}

fn main() -> Result<()> {
    let Args { gib } = clap::Parser::parse();
    let memcpy = memcpy_gib_per_s(1 << 30);
    let (pages_s, dirty_gib_s) = dirty_rate(5)?;
    let shares = throttle_shares(2.0)?;
    let (save, restore, bytes) = save_restore(gib, "/var/tmp")?;
    let (save_shm, restore_shm, _) = save_restore(gib, "/dev/shm")?;
    println!("bench/vm ({gib} GiB VM filled by the firmware's fill workload)");
    println!("{:<34} {:>12} {:>14}", "measure", "value", "vs memcpy");
    println!("{:<34} {:>12.2} {:>14}", "memcpy GiB/s (baseline)", memcpy, "1.00");
    println!("{:<34} {:>12.0} {:>14.3}", "dirtier pages/s (emulated vCPU)", pages_s, dirty_gib_s / memcpy);
    println!("{:<34} {:>12.2} {:>14.3}", "save GiB/s to /var/tmp (fsync)", save, save / memcpy);
    println!("{:<34} {:>12.2} {:>14.3}", "restore GiB/s from /var/tmp", restore, restore / memcpy);
    println!("{:<34} {:>12.2} {:>14.3}", "save GiB/s to /dev/shm", save_shm, save_shm / memcpy);
    println!("{:<34} {:>12.2} {:>14.3}", "restore GiB/s from /dev/shm", restore_shm, restore_shm / memcpy);
    println!("save file: {} MiB for {} GiB of RAM", bytes >> 20, gib);
    println!("{:<34} {:>12} {:>14}", "throttle: guest's share of its speed", "measured", "promised");
    for (pct, measured, promised) in &shares {
        println!("{:<34} {:>12.3} {:>14.3}", format!("  at {pct} %"), measured, promised);
    }
    println!(
        "{}",
        json!({
            "dirty_pages_per_s": pages_s.round(),
            "save_gib_per_s": save,
            "restore_gib_per_s": restore,
            "memcpy_gib_per_s": memcpy,
            "dirty_vs_memcpy": dirty_gib_s / memcpy,
            "save_vs_memcpy": save / memcpy,
            "restore_vs_memcpy": restore / memcpy,
            "save_shm_gib_per_s": save_shm,
            "restore_shm_gib_per_s": restore_shm,
            "ram_gib": gib,
            "throttle_share": shares.iter().map(|(p, m, pr)| json!({"pct": p, "measured": m, "promised": pr})).collect::<Vec<_>>(),
        })
    );
    Ok(())
}
