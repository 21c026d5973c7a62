//! bench/migrate-links: an idle VM with filled RAM migrated between two
//! testbed hosts over one link and over two (each capped at the same rate),
//! with the channels spread over the links; beside the ideal (RAM over the
//! line rate of the links used) and raw TCP (iperf3, the same streams per
//! link, all links at once) measured over the same links in the same run,
//! with the tcp and the rdma transports. For rdma, one rnicd per host
//! serves both of its links. CPU seconds are the migration engine's
//! threads on both sides, plus both rnicd processes' CPU during the
//! migration for rdma.
//!
//! Output contract: a table, then as the last line one JSON object
//! `{"rows": [{"transport", "links", "ram_gib", "total_s", "downtime_ms",
//! "line_rate_fraction", "cpu_s_per_gb", "raw_tcp_gbps", ...}]}`.

use anyhow::{anyhow, bail, Context, Result};
use migrate_transit::*;
use serde_json::{json, Value};
use std::process::Stdio;
use std::time::Duration;
use testbed::{Testbed, TestbedOpts};

#[derive(clap::Parser)]
#[command(about = "Migration over one and two links, beside the ideal and raw TCP over the same links")]
struct Args {
    /// A 1 GiB VM instead of 4 GiB (a quicker, noisier run).
    #[arg(long)]
    quick: bool,
    /// Guest RAM in GiB (default 4: two 8 GiB VMs do not fit this machine
    /// next to its other work; 1 with --quick).
    #[arg(long)]
    gib: Option<u64>,
    /// tcp, rdma or all.
    #[arg(long, default_value = "all")]
    transport: String,
    /// MTU of every link, for TCP and rnicd alike (9000: jumbo frames
    /// carry rnicd's 4096-byte packets whole, as RoCE NICs are set up).
    #[arg(long, default_value_t = 9000)]
    link_mtu: u32,
    /// Rate cap of every link, each direction, Mbit/s.
    #[arg(long, default_value_t = 10_000)]
    rate_mbit: u32,
    /// Migration channels (and iperf3 streams) per link.
    #[arg(long, default_value_t = 2)]
    channels_per_link: u32,
    /// Link counts to measure, comma-separated.
    #[arg(long, default_value = "1,2", value_delimiter = ',')]
    links: Vec<usize>,
}

/// One GiB in gigabytes (the figures are per GB, as the seed's are).
const GB_PER_GIB: f64 = 1.073_741_824;

fn main() {
    let a: Args = clap::Parser::parse();
    match run(&a) {
        Ok(rows) => {
            print_table(&rows);
            println!("{}", json!({ "rows": rows }));
        }
        Err(e) => {
            eprintln!("migrate-links: {e:#}");
            println!("{}", json!({"rows": [], "error": format!("{e:#}")}));
            std::process::exit(1);
        }
    }
}

fn run(a: &Args) -> Result<Vec<Value>> {
    let transports: Vec<&str> = match a.transport.as_str() {
        "tcp" => vec!["tcp"],
        "rdma" => vec!["rdma"],
        "all" => vec!["tcp", "rdma"],
        t => bail!("unknown transport {t:?} (tcp, rdma or all)"),
    };
    if a.links.is_empty() || a.links.iter().any(|&l| !(1..=2).contains(&l)) {
        bail!("--links takes 1 and/or 2");
    }
    if a.channels_per_link == 0 || a.channels_per_link > 32 {
        bail!("--channels-per-link is 1 to 32");
    }
    let gib = a.gib.unwrap_or(if a.quick { 1 } else { 4 });
    if gib == 0 {
        bail!("--gib is at least 1");
    }
    if !(1280..=65535).contains(&a.link_mtu) {
        bail!("--link-mtu is 1280 to 65535");
    }
    let bin = transit_bin()?;
    if !vmm_supports_migration(&bin) {
        bail!("{} cannot take migrations", bin.display());
    }
    eprintln!(
        "migrate-links: {gib} GiB idle filled VM, links capped at {} Mbit/s, MTU {}, {} channels per link{}",
        a.rate_mbit,
        a.link_mtu,
        a.channels_per_link,
        if a.quick { " (--quick: a smaller VM)" } else { "" }
    );
    let mut rows = Vec::new();
    for t in &transports {
        for &links in &a.links {
            eprintln!("migrate-links: {t}, {links} link(s)");
            let row = run_row(&bin, t, links, gib, a).unwrap_or_else(|e| {
                json!({"transport": t, "links": links, "ram_gib": gib, "completed": false, "total_s": null, "downtime_ms": null,
                       "line_rate_fraction": null, "cpu_s_per_gb": null, "raw_tcp_gbps": null, "error": format!("{e:#}")})
            });
            eprintln!("  {row}");
            rows.push(row);
        }
    }
    Ok(rows)
}

fn run_row(bin: &std::path::Path, transport: &str, links: usize, gib: u64, a: &Args) -> Result<Value> {
    let tb = Testbed::create(TestbedOpts::new("mlinks", 2).nics(2).rate_mbit(a.rate_mbit))?;
    set_link_mtu(&tb, a.link_mtu)?;
    let raw = raw_tcp_with_retries(&tb, links, a.channels_per_link, 5)?;
    let rnicds = if transport == "rdma" { (0..2).map(|h| Rnicd::start(bin, &tb, h)).collect::<Result<Vec<_>>>()? } else { Vec::new() };
    let mem = format!("{gib}G");
    let spec = VmSpec { name: "bench", memory: &mem, workload: "fill", args: "" };
    let src = start_vm(bin, &tb, 0, &spec, None)?;
    let dst = start_vm(bin, &tb, 1, &spec, Some(Incoming::Prealloc("tcp:0.0.0.0:4444")))?;
    wait_guest_progress(&src, 1, Duration::from_secs(60 + 60 * gib)).context("the fill workload did not cover RAM")?;
    wait_prealloc(&dst, gib, Duration::from_secs(10 * gib))?;
    let d = tb.host(1);
    let uri = format!("{transport}:{}", (0..links).map(|k| format!("{}:4444", d.addr(k))).collect::<Vec<_>>().join(","));
    let channels = a.channels_per_link * links as u32;
    let rnicd_cpu = || rnicds.iter().map(Rnicd::cpu_s).sum::<Result<f64>>();
    let rnicd0 = rnicd_cpu()?;
    src.exec("migrate", json!({"uri": uri, "channels": channels, "downtime_ms": 300, "timeout_s": 600}))?;
    let s = wait_migration(&src, Duration::from_secs(660))?;
    let cpu_rnicd = rnicd_cpu()? - rnicd0;
    let dd = wait_migration(&dst, Duration::from_secs(30))?;
    if s["status"] != "completed" || dd["status"] != "completed" {
        bail!("migration {}: {}", s["status"], s["error"].as_str().or(dd["error"].as_str()).unwrap_or("?"));
    }
    let total_s = s["total_ms"].as_f64().ok_or_else(|| anyhow!("no total time"))? / 1e3;
    let ram_gbit = gib as f64 * 8.0 * GB_PER_GIB;
    let line_gbps = a.rate_mbit as f64 / 1e3 * links as f64;
    let ideal_s = ram_gbit / line_gbps;
    let cpu_src = s["cpu_s_source"].as_f64().unwrap_or(0.0);
    let cpu_dst = dd["cpu_s_dest"].as_f64().or(s["cpu_s_dest"].as_f64()).unwrap_or(0.0);
    let tput = s["wire_bytes"].as_f64().unwrap_or(0.0) * 8.0 / total_s / 1e9;
    let gb = gib as f64 * GB_PER_GIB;
    Ok(json!({
        "transport": transport,
        "links": links,
        "ram_gib": gib,
        "completed": true,
        "total_s": total_s,
        "downtime_ms": dd["downtime_ms"].as_f64().or(s["downtime_ms"].as_f64()),
        "ideal_s": ideal_s,
        "line_rate_fraction": ideal_s / total_s,
        "cpu_s_source": cpu_src,
        "cpu_s_dest": cpu_dst,
        "cpu_s_rnicd": cpu_rnicd,
        "cpu_s_per_gb": (cpu_src + cpu_dst + cpu_rnicd) / gb,
        "cpu_s_per_gb_vmm": (cpu_src + cpu_dst) / gb,
        "cpu_s_per_gb_rnicd": cpu_rnicd / gb,
        "raw_tcp_gbps": raw,
        "throughput_gbps": tput,
        "fraction_of_raw_tcp": tput / raw,
        "rate_mbit_per_link": a.rate_mbit,
        "channels": channels,
        "link_mtu": a.link_mtu,
        "per_link_gbps": s["links"].as_array().map(|l| l.iter().map(|x| x["throughput_gbps"].clone()).collect::<Vec<_>>()),
    }))
}

/// Every link of the testbed at `mtu`: both ends of each veth and the
/// bridges (the testbed makes them at 1500).
fn set_link_mtu(tb: &Testbed, mtu: u32) -> Result<()> {
    let m = mtu.to_string();
    let fab = tb.fabric();
    for k in 0..tb.nics() {
        for h in 0..tb.hosts().len() {
            run_ip(&["-n", &fab, "link", "set", &format!("h{h}e{k}"), "mtu", &m])?;
            tb.host(h).sh(&format!("ip link set eth{k} mtu {m}"))?;
        }
        run_ip(&["-n", &fab, "link", "set", &format!("br{k}"), "mtu", &m])?;
    }
    Ok(())
}

fn run_ip(args: &[&str]) -> Result<()> {
    let st = std::process::Command::new("ip").args(args).status()?;
    if !st.success() {
        bail!("ip {} failed", args.join(" "));
    }
    Ok(())
}

/// Raw TCP host 0 -> host 1 over the first `links` links at once, `streams`
/// iperf3 streams on each, Gbit/s summed over the links. Bounded in time
/// whatever the links do.
fn raw_tcp_over_links(tb: &Testbed, links: usize, streams: u32, secs: u32) -> Result<f64> {
    let port = |k: usize| 5301 + k as u16;
    let _servers: Vec<testbed::HostChild> = (0..links)
        .map(|k| {
            let c = tb
                .host(1)
                .command("iperf3")
                .args(["-s", "-1", "-p", &port(k).to_string()])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .spawn();
            c.map(testbed::HostChild::new)
        })
        .collect::<std::io::Result<_>>()?;
    std::thread::sleep(Duration::from_millis(500));
    let clients: Vec<_> = (0..links)
        .map(|k| {
            let cmd = format!(
                "timeout {} iperf3 -c {} -p {} -P {streams} -t {secs} --connect-timeout 3000 -J",
                secs + 20,
                tb.host(1).addr(k),
                port(k)
            );
            let h = tb.host(0).clone();
            std::thread::spawn(move || h.sh(&cmd))
        })
        .collect();
    let mut total = 0.0;
    for c in clients {
        let out = c.join().map_err(|_| anyhow!("iperf3 client thread panicked"))??;
        let v: Value = serde_json::from_str(&out).context("iperf3 JSON")?;
        let bps = v["end"]["sum_received"]["bits_per_second"].as_f64();
        total += bps.ok_or_else(|| anyhow!("iperf3 gave no throughput: {}", v["error"]))? / 1e9;
    }
    Ok(total)
}

/// [`raw_tcp_over_links`], tried up to three times: on this loaded machine
/// an iperf3 server sometimes is not listening yet when its client
/// connects, and that run measures nothing.
fn raw_tcp_with_retries(tb: &Testbed, links: usize, streams: u32, secs: u32) -> Result<f64> {
    let mut last = None;
    for _ in 0..3 {
        match raw_tcp_over_links(tb, links, streams, secs) {
            Ok(g) => return Ok(g),
            Err(e) => {
                eprintln!("  raw TCP: {e:#}; again");
                last = Some(e);
            }
        }
    }
    Err(last.expect("tried"))
}

fn print_table(rows: &[Value]) {
    let f = |v: &Value, k: &str, p: usize| v[k].as_f64().map(|x| format!("{x:.p$}")).unwrap_or_else(|| "-".into());
    println!(
        "{:<9} {:>5} {:>7} {:>9} {:>9} {:>11} {:>9} {:>10} {:>9} {:>9}",
        "transport", "links", "RAM GiB", "total s", "ideal s", "line frac", "raw Gb/s", "migr Gb/s", "down ms", "CPU s/GB"
    );
    for r in rows {
        println!(
            "{:<9} {:>5} {:>7} {:>9} {:>9} {:>11} {:>9} {:>10} {:>9} {:>9}",
            r["transport"].as_str().unwrap_or("?"),
            r["links"],
            r["ram_gib"],
            f(r, "total_s", 2),
            f(r, "ideal_s", 2),
            f(r, "line_rate_fraction", 3),
            f(r, "raw_tcp_gbps", 2),
            f(r, "throughput_gbps", 2),
            f(r, "downtime_ms", 0),
            f(r, "cpu_s_per_gb", 3),
        );
        if let Some(e) = r["error"].as_str() {
            println!("  error: {e}");
        }
    }
    for t in ["tcp", "rdma"] {
        let one = rows.iter().find(|r| r["transport"] == t && r["links"] == 1 && r["total_s"].is_number());
        let two = rows.iter().find(|r| r["transport"] == t && r["links"] == 2 && r["total_s"].is_number());
        if let (Some(o), Some(w)) = (one, two) {
            let speedup = o["total_s"].as_f64().unwrap() / w["total_s"].as_f64().unwrap();
            let raw = w["raw_tcp_gbps"].as_f64().unwrap_or(0.0) / o["raw_tcp_gbps"].as_f64().unwrap_or(1.0).max(1e-9);
            println!("{t}: two links vs one: migration {speedup:.2}x faster; raw TCP {raw:.2}x");
        }
    }
}
