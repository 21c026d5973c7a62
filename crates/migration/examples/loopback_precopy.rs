//! Precopy data path on loopback, two in-process VMs, variants alternating
//! in the same run, with raw TCP (same stream count, same buffer size) as
//! the baseline measured between them.
//!
//! `cargo run --release -p migration --example loopback_precopy -- GIB CHANNELS REPEATS [VARIANT...]`
//! VARIANT: `-` (as built) or `KEY=VALUE`, an environment setting the engine
//! reads, to alternate variants in one run. Each migration moves a filled
//! idle VM into a destination whose RAM is already allocated (as `prealloc`
//! does), then back the other way; raw TCP (same streams, 256 KiB writes)
//! is measured before each migration.

use migration::memvm::MemVm;
use migration::qmp::{handle, MigrationSlot, Outcome};
use migration::vm::MigratableVm;
use serde_json::json;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Instant;

fn raw_tcp(bytes: u64, streams: usize) -> f64 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let per = bytes / streams as u64;
    let t = Instant::now();
    let senders: Vec<_> = (0..streams)
        .map(|_| {
            std::thread::spawn(move || {
                let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
                let b = vec![0x5au8; 256 << 10];
                let mut sent = 0u64;
                while sent < per {
                    s.write_all(&b).unwrap();
                    sent += b.len() as u64;
                }
            })
        })
        .collect();
    let receivers: Vec<_> = (0..streams)
        .map(|_| {
            let (mut s, _) = l.accept().unwrap();
            std::thread::spawn(move || {
                let mut b = vec![0u8; 256 << 10];
                let mut got = 0u64;
                while got < per {
                    match s.read(&mut b) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => got += n as u64,
                    }
                }
            })
        })
        .collect();
    for h in senders.into_iter().chain(receivers) {
        h.join().unwrap();
    }
    (per * streams as u64) as f64 * 8.0 / t.elapsed().as_secs_f64() / 1e9
}

fn migrate_once(src: &Arc<MemVm>, dst: &Arc<MemVm>, channels: u32) -> serde_json::Value {
    let (s, d): (Arc<dyn MigratableVm>, Arc<dyn MigratableVm>) = (src.clone(), dst.clone());
    let (ss, ds) = (MigrationSlot::default(), MigrationSlot::default());
    let port = handle(&d, &ds, "migrate-incoming", &json!({"uri": "tcp:127.0.0.1:0", "resume": false})).unwrap()["port"].as_u64().unwrap();
    src.resume().unwrap();
    handle(&s, &ss, "migrate", &json!({"uri": format!("tcp:127.0.0.1:{port}"), "channels": channels})).unwrap();
    let (os, od) = (ss.wait(), ds.wait());
    assert_eq!(os, Some(Outcome::OutgoingCompleted));
    assert_eq!(od, Some(Outcome::IncomingCompleted { resumed: false }));
    let st = handle(&s, &ss, "query-migrate", &json!({})).unwrap();
    let dt = handle(&d, &ds, "query-migrate", &json!({})).unwrap();
    json!({"total_ms": st["total_ms"], "setup_ms": st["setup_ms"], "setup_steps": st["setup_steps"], "round_ms": st["round_stats"].as_array().map(|v| v.iter().map(|r| r["duration_ms"].clone()).collect::<Vec<_>>()),
           "downtime_steps": st["downtime_steps"], "pass_ms": st["round_stats"][0]["duration_ms"],
           "wire": st["wire_bytes"], "cpu_src": st["cpu_s_source"], "cpu_dst": dt["cpu_s_dest"], "downtime_ms": st["downtime_ms"]})
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let gib: u64 = a.get(1).and_then(|v| v.parse().ok()).unwrap_or(1);
    let channels: u32 = a.get(2).and_then(|v| v.parse().ok()).unwrap_or(1);
    let repeats: usize = a.get(3).and_then(|v| v.parse().ok()).unwrap_or(3);
    let variants: Vec<String> = if a.len() > 4 { a[4..].to_vec() } else { vec!["-".into()] };
    let bytes = gib << 30;
    let vms = [MemVm::new(bytes, 0, 0).unwrap(), MemVm::new(bytes, 0, 0).unwrap()];
    vms[0].fill(0, bytes / 4096);
    vms[1].fill(0, bytes / 4096);
    let mut dir = 0;
    println!(
        "{:<9} {:>8} {:>8} {:>8} {:>7} {:>7} {:>7} {:>6} {:>6}",
        "variant", "total ms", "pass ms", "Gbit/s", "raw", "frac", "down ms", "cpu_s", "cpu_d"
    );
    let mut rows = Vec::new();
    for _ in 0..repeats {
        for v in &variants {
            let raw = raw_tcp(bytes, channels as usize);
            // VARIANT is KEY=VALUE: an environment setting of the engine.
            if let Some((k, val)) = v.split_once('=') {
                std::env::set_var(k, val);
            }
            let r = migrate_once(&vms[dir], &vms[1 - dir], channels);
            dir = 1 - dir;
            let t = r["total_ms"].as_f64().unwrap();
            let g = r["wire"].as_f64().unwrap() * 8.0 / t / 1e6;
            println!(
                "{:<9} {:>8.0} {:>8.0} {:>8.2} {:>7.2} {:>7.2} {:>7.1} {:>6.2} {:>6.2}",
                v,
                t,
                r["pass_ms"].as_f64().unwrap_or(0.0),
                g,
                raw,
                g / raw,
                r["downtime_ms"].as_f64().unwrap_or(0.0),
                r["cpu_src"].as_f64().unwrap_or(0.0),
                r["cpu_dst"].as_f64().unwrap_or(0.0)
            );
            println!("          setup {} rounds {}", r["setup_steps"], r["round_ms"]);
            rows.push(json!({"variant": v, "gbps": g, "raw_tcp_gbps": raw, "stats": r}));
        }
    }
    println!("{}", json!({ "rows": rows }));
}
