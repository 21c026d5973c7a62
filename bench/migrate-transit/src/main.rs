//! migrate-transit: Transit's rows of bench/migrate-vs-qemu.
//!
//! For each (workload, RAM size, channels): two testbed hosts, a source vmm
//! running the workload in host 0, an incoming vmm in host 1, one precopy
//! migration; raw TCP (iperf3, same stream count, same link) is measured in
//! the same testbed just before. Prints a table, then `{"rows": [...]}`.
//!
//! Usage: migrate-transit [--quick] [--only SUBSTR]

use anyhow::Result;
use migrate_transit::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use testbed::{Testbed, TestbedOpts};

const CAP_MBIT: u32 = 1000;
/// 100 MiB/s of dirtied pages for the dirtier-capped rows.
const CAPPED_DIRTY_PAGES_S: u64 = 100 * 256;

fn precopy_timeout_s(ram_gib: u64, raw_gbps: f64) -> u64 {
    let one_pass = ram_gib as f64 * 8.0 * 1.074 / raw_gbps.max(0.1);
    (5.0 * one_pass).max(30.0) as u64
}

fn row(bin: &std::path::Path, workload: &str, ram_gib: u64, channels: u32) -> Result<Value> {
    let tmp = TempDir::new("migrate-transit")?;
    let tb = Testbed::create(TestbedOpts::new("mt", 2))?;
    let capped = workload == "dirtier-capped";
    if capped {
        tb.set_rate(0, 0, Some(CAP_MBIT))?;
    }
    let raw = raw_tcp_gbps(&tb, channels, 3)?;
    let (wl, args) = match workload {
        "idle" => ("fill", String::new()),
        "dirtier" => ("dirtier", String::new()),
        _ => ("dirtier", format!("rate={CAPPED_DIRTY_PAGES_S}")),
    };
    let mem = format!("{ram_gib}G");
    let spec = VmSpec { name: "bench", memory: &mem, workload: wl, args: &args };
    let mut src = start_vm(bin, &tb, 0, &spec, None, &tmp.0)?;
    let dst = start_vm(bin, &tb, 1, &spec, Some("tcp:0.0.0.0:4444"), &tmp.0)?;
    if capped {
        // The rate-limited dirtier needs a long time per pass: let it run a
        // while rather than waiting for a whole pass.
        std::thread::sleep(Duration::from_secs(5));
    } else {
        wait_guest_progress(&src, 1, Duration::from_secs(600))?;
    }
    let timeout_s = precopy_timeout_s(ram_gib, raw);
    let t = Instant::now();
    src.exec(
        "migrate",
        json!({"uri": format!("tcp:{}:4444", tb.host(1).addr(0)), "channels": channels, "downtime_ms": 300, "timeout_s": timeout_s}),
    )?;
    let d = wait_migration(&dst, Duration::from_secs(timeout_s + 120));
    let wall = t.elapsed().as_secs_f64();
    // The source may have exited already after handing over.
    let s = if src.is_alive() { wait_migration(&src, Duration::from_secs(60)).ok() } else { None };
    let d = d.unwrap_or_else(|e| json!({"status": "failed", "error": e.to_string()}));
    let stats = s.clone().unwrap_or_else(|| d.clone());
    let completed = d["status"] == "completed";
    let secs = stats["total_ms"].as_f64().map(|m| m / 1e3).unwrap_or(wall);
    let tput = stats["wire_bytes"].as_f64().map(|b| b * 8.0 / secs.max(1e-9) / 1e9);
    Ok(json!({
        "system": "transit",
        "mode": "precopy",
        "workload": workload,
        "ram_gib": ram_gib,
        "channels": channels,
        "completed": completed,
        "total_s": if completed { Some(secs) } else { None },
        "downtime_ms": if completed { d["downtime_ms"].as_f64().or(stats["downtime_ms"].as_f64()) } else { None },
        "throughput_gbps": tput,
        "raw_tcp_gbps": raw,
        "fraction_of_raw": tput.map(|t| t / raw),
        "rounds": stats["rounds"],
        "throttle_pct": stats["throttle_pct"],
        "wire_bytes": stats["wire_bytes"],
        "zero_pages": stats["zero_pages"],
        "cpu_s_source": stats["cpu_s_source"],
        "cpu_s_dest": d["cpu_s_dest"],
        "error": d["error"].as_str().or(stats["error"].as_str()),
        "downtime_steps_source": stats["downtime_steps"],
        "downtime_steps_dest": d["downtime_steps"],
    }))
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!("usage: migrate-transit [--quick] [--only SUBSTR]\n  --quick  1 GiB rows only\n  --only   rows whose label (precopy/WORKLOAD/NG/Nch) contains SUBSTR");
        return;
    }
    let quick = args.iter().any(|a| a == "--quick");
    let only = args.iter().position(|a| a == "--only").and_then(|i| args.get(i + 1)).cloned();
    let bin = match transit_bin() {
        Ok(b) => b,
        Err(e) => {
            eprintln!("migrate-transit: {e:#}");
            println!("{}", json!({"rows": [], "error": e.to_string()}));
            std::process::exit(1);
        }
    };
    if !vmm_supports_migration(&bin) {
        let e = "the vmm has no `vm run --incoming` yet: migration is not wired into it";
        eprintln!("migrate-transit: {e}");
        println!("{}", json!({"rows": [], "error": e}));
        std::process::exit(1);
    }
    let sizes: &[u64] = if quick { &[1] } else { &[1, 4] };
    let mut rows = Vec::new();
    for &ram in sizes {
        for wl in ["idle", "dirtier", "dirtier-capped"] {
            for ch in [1u32, 4] {
                let label = format!("precopy/{wl}/{ram}G/{ch}ch");
                if only.as_deref().is_some_and(|o| !label.contains(o)) {
                    continue;
                }
                eprintln!("migrate-transit: {label}");
                let r = row(&bin, wl, ram, ch).unwrap_or_else(|e| {
                    json!({"system": "transit", "mode": "precopy", "workload": wl, "ram_gib": ram, "channels": ch,
                           "completed": false, "total_s": null, "downtime_ms": null, "throughput_gbps": null,
                           "raw_tcp_gbps": null, "error": format!("{e:#}")})
                });
                eprintln!("  {r}");
                rows.push(r);
            }
        }
    }
    println!("{:<32} {:>5} {:>9} {:>11} {:>9} {:>8} {:>6} {:>7}", "row", "done", "total s", "downtime ms", "Gbit/s", "raw", "frac", "thrott");
    for r in &rows {
        let f = |k: &str, p: usize| r[k].as_f64().map(|v| format!("{v:.p$}")).unwrap_or_else(|| "-".into());
        println!(
            "{:<32} {:>5} {:>9} {:>11} {:>9} {:>8} {:>6} {:>7}",
            format!("precopy/{}/{}G/{}ch", r["workload"].as_str().unwrap_or("?"), r["ram_gib"], r["channels"]),
            r["completed"],
            f("total_s", 2),
            f("downtime_ms", 1),
            f("throughput_gbps", 2),
            f("raw_tcp_gbps", 2),
            f("fraction_of_raw", 2),
            r["throttle_pct"]
        );
    }
    println!("{}", json!({ "rows": rows }));
}
