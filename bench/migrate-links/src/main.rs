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
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};
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
    /// A `transit` binary whose rnicd serves the rdma rows; given more
    /// than once, every rdma row runs once with each, alternating (an A/B
    /// of rnicd builds in one run, under the same load). Default: the
    /// `transit` built with this bench.
    #[arg(long = "rnicd-bin")]
    rnicd_bins: Vec<PathBuf>,
    /// Runs of every row, in turn.
    #[arg(long, default_value_t = 1)]
    repeat: u32,
    /// Record both rnicds with `perf record -g` during every rdma
    /// migration, into this directory (one file per rnicd and row).
    #[arg(long)]
    perf: Option<PathBuf>,
    /// The host's shared-memory THP settings to measure every row with,
    /// alternating (`never,advise`: an A/B of 4 KiB against 2 MiB pages
    /// for guest RAM, which the vmm and rnicd ask for with MADV_HUGEPAGE).
    /// Written to /sys/kernel/mm/transparent_hugepage/shmem_enabled before
    /// each row and put back at the end. Default: the host's setting as it
    /// is.
    #[arg(long, value_delimiter = ',')]
    shmem_thp: Vec<String>,
}

/// The host's shared-memory THP setting.
const SHMEM_THP: &str = "/sys/kernel/mm/transparent_hugepage/shmem_enabled";

/// The bracketed choice of a sysfs THP file, e.g. `advise`.
fn shmem_thp_now() -> Result<String> {
    let s = std::fs::read_to_string(SHMEM_THP).with_context(|| format!("reading {SHMEM_THP}"))?;
    s.split_whitespace()
        .find_map(|w| w.strip_prefix('[').and_then(|w| w.strip_suffix(']')))
        .map(str::to_string)
        .ok_or_else(|| anyhow!("no current setting in {SHMEM_THP}: {s:?}"))
}

fn set_shmem_thp(v: &str) -> Result<()> {
    std::fs::write(SHMEM_THP, v).with_context(|| format!("writing {v:?} to {SHMEM_THP}"))
}

/// Puts the host's THP setting back as it was, however the bench ends.
struct RestoreShmemThp(String);

impl Drop for RestoreShmemThp {
    fn drop(&mut self) {
        if let Err(e) = set_shmem_thp(&self.0) {
            eprintln!("migrate-links: {e:#}");
        }
    }
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
    let rnicd_bins = if a.rnicd_bins.is_empty() { vec![bin.clone()] } else { a.rnicd_bins.clone() };
    if let Some(d) = &a.perf {
        std::fs::create_dir_all(d)?;
    }
    let _restore = RestoreShmemThp(shmem_thp_now()?);
    let thp_settings = if a.shmem_thp.is_empty() { vec![shmem_thp_now()?] } else { a.shmem_thp.clone() };
    let mut rows = Vec::new();
    for run in 0..a.repeat {
        for t in &transports {
            for &links in &a.links {
                let builds: Vec<Option<&Path>> =
                    if *t == "rdma" { rnicd_bins.iter().map(|b| Some(b.as_path())).collect() } else { vec![None] };
                for (rnicd, thp) in builds.iter().flat_map(|b| thp_settings.iter().map(move |thp| (*b, thp))) {
                    if !a.shmem_thp.is_empty() {
                        set_shmem_thp(thp)?;
                    }
                    let label = rnicd.map(rnicd_label).unwrap_or_default();
                    eprintln!("migrate-links: {t}, {links} link(s) {label} shmem THP {thp} (run {})", run + 1);
                    let row = run_row(&bin, rnicd, t, links, gib, a, run).unwrap_or_else(|e| {
                        json!({"transport": t, "links": links, "ram_gib": gib, "completed": false, "total_s": null, "downtime_ms": null,
                               "line_rate_fraction": null, "cpu_s_per_gb": null, "raw_tcp_gbps": null, "error": format!("{e:#}")})
                    });
                    let mut row = row;
                    if rnicd.is_some() {
                        row["rnicd"] = json!(label);
                    }
                    row["shmem_thp"] = json!(thp);
                    eprintln!("  {row}");
                    rows.push(row);
                }
            }
        }
    }
    Ok(rows)
}

/// A short name for an rnicd build: its binary's file name, with its
/// directory's when that is the generic `transit`.
fn rnicd_label(p: &Path) -> String {
    let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    match p.parent().and_then(|d| d.file_name()) {
        Some(d) if name == "transit" => format!("{}/{name}", d.to_string_lossy()),
        _ => name,
    }
}

/// Waits until the fill workload has covered RAM. The guest runs on an
/// emulated core, so on a loaded host the fill can take minutes of wall
/// time: the limit is the vmm's own CPU seconds (what the fill needs,
/// whatever else runs), with a wall-clock limit well beyond it.
fn wait_fill(vm: &VmProcess, gib: u64) -> Result<()> {
    let cpu0 = process_cpu_s(vm.pid())?;
    let t0 = Instant::now();
    let (cpu_limit, wall_limit) = (120.0 * gib as f64, Duration::from_secs(1200 * gib));
    loop {
        let r = vm.wait_progress(1, Duration::from_secs(5));
        if r.is_ok() {
            return Ok(());
        }
        let cpu = process_cpu_s(vm.pid()).context("the vmm went away during the fill")? - cpu0;
        if cpu > cpu_limit || t0.elapsed() > wall_limit {
            return r.map(|_| ()).with_context(|| format!("after {cpu:.0} s of vmm CPU in {:.0?}", t0.elapsed()));
        }
    }
}

/// rnicd counters of the transport's work and its recoveries, summed over
/// the namespaces `clients` are in.
fn rnicd_counters(clients: &[verbs::Context]) -> Result<Vec<(String, u64)>> {
    const KEYS: &[&str] = &[
        "rx_packets",
        "tx_packets",
        "retransmit_rewinds",
        "loss_probes",
        "timeouts",
        "window_cuts",
        "local_drops",
        "dup_requests",
        "seq_naks_sent",
        "held_out_of_order",
        "rnr_naks_sent",
        "rx_bad_icrc",
        "send_errors",
        "ack_packets_sent",
        "ack_packets_received",
    ];
    let all = clients.iter().map(|c| c.stats()).collect::<Result<Vec<_>>>()?;
    Ok(KEYS.iter().map(|k| (k.to_string(), all.iter().filter_map(|s| s[*k].as_u64()).sum())).collect())
}

/// The event loop's counters of one rnicd (`loop_*` of its stats: the
/// daemon's, whichever namespace is asked), by name without the prefix.
const LOOP_KEYS: &[&str] = &["sleeps", "woken_by_work"];

/// The namespace counters, summed per host, that give the loop's a scale.
const SCALE_KEYS: &[&str] = &["rx_packets", "tx_packets", "ack_packets_sent", "ack_packets_received"];

/// Per host: the event loop's counters and the namespace counters that
/// give them a scale (packets received and sent, ACKs sent and received),
/// from `stats` (a client per host and link, host by host).
fn loop_counters(stats: &[verbs::Context], links: usize) -> Result<Vec<serde_json::Map<String, Value>>> {
    stats
        .chunks(links)
        .map(|host| {
            let all = host.iter().map(|c| c.stats()).collect::<Result<Vec<_>>>()?;
            let mut m = serde_json::Map::new();
            for k in LOOP_KEYS {
                m.insert(k.to_string(), json!(all[0][format!("loop_{k}")].as_u64().unwrap_or(0)));
            }
            for k in SCALE_KEYS {
                m.insert(k.to_string(), json!(all.iter().filter_map(|s| s[*k].as_u64()).sum::<u64>()));
            }
            Ok(m)
        })
        .collect()
}

/// rnicd's wake-ups and ACKs over a migration, from the per-host counters
/// before and after (`loop_counters`): wake-ups per packet the destination
/// received and the source sent, and ACKs per packet received (ACK
/// coalescing of streams).
fn wakeups(before: &[serde_json::Map<String, Value>], after: &[serde_json::Map<String, Value>]) -> Value {
    let d = |h: usize, k: &str| {
        let g = |m: &[serde_json::Map<String, Value>]| m.get(h).and_then(|x| x[k].as_u64()).unwrap_or(0);
        g(after).saturating_sub(g(before)) as f64
    };
    let per = |a: f64, b: f64| if b > 0.0 { json!(a / b) } else { Value::Null };
    let side = |h: usize| {
        let mut m = serde_json::Map::new();
        for k in LOOP_KEYS.iter().chain(SCALE_KEYS) {
            m.insert(k.to_string(), json!(d(h, k)));
        }
        Value::Object(m)
    };
    json!({
        "source": side(0),
        "dest": side(1),
        "wakes_per_packet_dest": per(d(1, "sleeps"), d(1, "rx_packets")),
        "acks_per_packet_dest": per(d(1, "ack_packets_sent"), d(1, "rx_packets")),
        "wakes_per_packet_source": per(d(0, "sleeps"), d(0, "tx_packets")),
    })
}

/// `perf record -g` of one process until dropped (SIGINT, so perf writes its file).
struct Perf(std::process::Child);

impl Perf {
    fn start(pid: u32, out: &Path) -> Result<Perf> {
        let c = std::process::Command::new("perf")
            .args(["record", "-g", "-q", "-p", &pid.to_string(), "-o"])
            .arg(out)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("perf record")?;
        Ok(Perf(c))
    }
}

impl Drop for Perf {
    fn drop(&mut self) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGINT) };
        let _ = self.0.wait();
    }
}

#[allow(clippy::too_many_arguments)]
fn run_row(bin: &Path, rnicd: Option<&Path>, transport: &str, links: usize, gib: u64, a: &Args, run: u32) -> Result<Value> {
    let tb = Testbed::create(TestbedOpts::new("mlinks", 2).nics(2).rate_mbit(a.rate_mbit))?;
    set_link_mtu(&tb, a.link_mtu)?;
    let raw = raw_tcp_with_retries(&tb, links, a.channels_per_link, 5)?;
    let rnicds = match rnicd {
        Some(r) => (0..2).map(|h| Rnicd::start(r, &tb, h, &[])).collect::<Result<Vec<_>>>()?,
        None => Vec::new(),
    };
    let mem = format!("{gib}G");
    let spec = VmSpec { name: "bench", memory: &mem, workload: "fill", args: "" };
    let src = start_vm(bin, &tb, 0, &spec, None)?;
    let dst = start_vm(bin, &tb, 1, &spec, Some(Incoming::Prealloc("tcp:0.0.0.0:4444")))?;
    wait_fill(&src, gib).context("the fill workload did not cover RAM")?;
    wait_prealloc(&dst, gib, Duration::from_secs(10 * gib))?;
    let d = tb.host(1);
    let uri = format!("{transport}:{}", (0..links).map(|k| format!("{}:4444", d.addr(k))).collect::<Vec<_>>().join(","));
    let channels = a.channels_per_link * links as u32;
    let rnicd_cpu = || rnicds.iter().map(Rnicd::cpu_s).collect::<Result<Vec<f64>>>();
    let rnicd0 = rnicd_cpu()?;
    let perf = match (&a.perf, rnicd) {
        (Some(dir), Some(r)) => rnicds
            .iter()
            .enumerate()
            .map(|(h, d)| {
                let label = rnicd_label(r).replace('/', "-");
                let thp = shmem_thp_now().unwrap_or_default();
                Perf::start(d.pid(), &dir.join(format!("rdma-{links}l-{label}-thp_{thp}-run{run}-h{h}.data")))
            })
            .collect::<Result<Vec<_>>>()?,
        _ => Vec::new(),
    };
    // One stats client per rnicd namespace (host, link), opened before the
    // migration: a namespace closes with its last client.
    let tbr = &tb;
    let stats: Vec<verbs::Context> = rnicds
        .iter()
        .enumerate()
        .flat_map(|(h, r)| (0..links).map(move |k| verbs::Context::open_namespace(Some(r.socket()), tbr.host(h).addr(k))))
        .collect::<Result<_>>()?;
    let stats0 = rnicd_counters(&stats)?;
    let loop0 = loop_counters(&stats, links)?;
    // Whether the vCPUs shared a cache through the migration: copies between
    // the CPUs, and so CPU per GB, depend on it (testbed::cpu_distance).
    let rtt0 = testbed::cpu_distance::rtt_now();
    src.exec("migrate", json!({"uri": uri, "channels": channels, "downtime_ms": 300, "timeout_s": 600}))?;
    let s = wait_migration(&src, Duration::from_secs(660))?;
    let rnicd1 = rnicd_cpu()?;
    let rtt1 = testbed::cpu_distance::rtt_now();
    drop(perf);
    let loop1 = loop_counters(&stats, links)?;
    let counters: serde_json::Map<String, Value> =
        rnicd_counters(&stats)?.into_iter().zip(stats0).map(|((k, b), (_, a))| (k, json!(b - a))).collect();
    let rnicd_side = |h: usize| rnicd1.get(h).zip(rnicd0.get(h)).map_or(0.0, |(b, a)| b - a);
    let (rnicd_src, rnicd_dst) = (rnicd_side(0), rnicd_side(1));
    let cpu_rnicd = rnicd_src + rnicd_dst;
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
        "cpu_s_rnicd_source": rnicd_src,
        "cpu_s_rnicd_dest": rnicd_dst,
        "cpu_s_per_gb": (cpu_src + cpu_dst + cpu_rnicd) / gb,
        "cpu_s_per_gb_vmm": (cpu_src + cpu_dst) / gb,
        "cpu_s_per_gb_rnicd": cpu_rnicd / gb,
        "cpu_s_per_gb_source": (cpu_src + rnicd_src) / gb,
        "cpu_s_per_gb_dest": (cpu_dst + rnicd_dst) / gb,
        "raw_tcp_gbps": raw,
        "cpu_rtt_ns": [rtt0.map(|d| d.as_nanos() as u64), rtt1.map(|d| d.as_nanos() as u64)],
        "cache": rtt0.zip(rtt1).map(|(a, b)| testbed::cpu_distance::cache_state(a, b)),
        "rnicd_counters": if rnicds.is_empty() { Value::Null } else { Value::Object(counters) },
        "rnicd_wakeups": if rnicds.is_empty() { Value::Null } else { wakeups(&loop0, &loop1) },
        // Where the time went: connecting (queue pairs, registrations) and the rounds.
        "setup_ms": s["setup_ms"],
        "setup_steps": s["setup_steps"],
        "rounds": s["rounds"],
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
        "{:<9} {:<18} {:<7} {:>5} {:>7} {:>9} {:>9} {:>11} {:>9} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7}",
        "transport",
        "rnicd",
        "THP",
        "links",
        "RAM GiB",
        "total s",
        "ideal s",
        "line frac",
        "raw Gb/s",
        "migr Gb/s",
        "down ms",
        "CPU s/GB",
        "src s/GB",
        "dst s/GB",
        "rnicd s/GB",
        "cache"
    );
    for r in rows {
        println!(
            "{:<9} {:<18} {:<7} {:>5} {:>7} {:>9} {:>9} {:>11} {:>9} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7}",
            r["transport"].as_str().unwrap_or("?"),
            r["rnicd"].as_str().unwrap_or("-"),
            r["shmem_thp"].as_str().unwrap_or("-"),
            r["links"],
            r["ram_gib"],
            f(r, "total_s", 2),
            f(r, "ideal_s", 2),
            f(r, "line_rate_fraction", 3),
            f(r, "raw_tcp_gbps", 2),
            f(r, "throughput_gbps", 2),
            f(r, "downtime_ms", 0),
            f(r, "cpu_s_per_gb", 3),
            f(r, "cpu_s_per_gb_source", 3),
            f(r, "cpu_s_per_gb_dest", 3),
            f(r, "cpu_s_per_gb_rnicd", 3),
            r["cache"].as_str().unwrap_or("-"),
        );
        if let Some(e) = r["error"].as_str() {
            println!("  error: {e}");
        }
    }
    // rnicd's wake-ups, ACKs (coalesced for streams) and seconds.
    if rows.iter().any(|r| r["rnicd_wakeups"].is_object()) {
        println!(
            "\n{:<18} {:>5} {:>12} {:>12} {:>12} {:>12} {:>12}",
            "rnicd", "links", "src rnicd s", "dst rnicd s", "dst wake/pkt", "dst ack/pkt", "src wake/pkt"
        );
        for r in rows.iter().filter(|r| r["rnicd_wakeups"].is_object()) {
            let m = &r["rnicd_wakeups"];
            println!(
                "{:<18} {:>5} {:>12} {:>12} {:>12} {:>12} {:>12}",
                r["rnicd"].as_str().unwrap_or("-"),
                r["links"],
                f(r, "cpu_s_rnicd_source", 2),
                f(r, "cpu_s_rnicd_dest", 2),
                f(m, "wakes_per_packet_dest", 3),
                f(m, "acks_per_packet_dest", 3),
                f(m, "wakes_per_packet_source", 3),
            );
        }
    }
    // Two links against one, per transport, rnicd build and THP setting,
    // from the mean times of the completed runs.
    let mean = |t: &Value, rn: &Value, thp: &Value, links: u64, k: &str| {
        let v: Vec<f64> = rows
            .iter()
            .filter(|r| r["transport"] == *t && r["rnicd"] == *rn && r["shmem_thp"] == *thp && r["links"] == links)
            .filter_map(|r| r[k].as_f64())
            .collect();
        (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
    };
    let mut seen = Vec::new();
    for r in rows {
        let key = (r["transport"].clone(), r["rnicd"].clone(), r["shmem_thp"].clone());
        if seen.contains(&key) {
            continue;
        }
        seen.push(key.clone());
        let (t, rn, thp) = key;
        if let (Some(o), Some(w)) = (mean(&t, &rn, &thp, 1, "total_s"), mean(&t, &rn, &thp, 2, "total_s")) {
            let raw =
                mean(&t, &rn, &thp, 2, "raw_tcp_gbps").unwrap_or(0.0) / mean(&t, &rn, &thp, 1, "raw_tcp_gbps").unwrap_or(1.0).max(1e-9);
            let who = rn.as_str().map(|s| format!(" (rnicd {s})")).unwrap_or_default()
                + &thp.as_str().map(|s| format!(" (shmem THP {s})")).unwrap_or_default();
            println!("{}{who}: two links vs one: migration {:.2}x faster; raw TCP {raw:.2}x", t.as_str().unwrap_or("?"), o / w);
        }
    }
}
