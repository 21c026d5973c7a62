//! migrate-transit: Transit's rows of bench/migrate-vs-qemu.
//!
//! For each (workload, RAM size, channels[, compression]): two testbed
//! hosts, a source vmm running the workload in host 0, an incoming vmm in
//! host 1, one migration (precopy, postcopy or hybrid); raw TCP (iperf3, same stream count, same
//! link) and, on uncapped links, RAM-to-RAM TCP (1 GiB from one shared mapping into another,
//! same stream count; column `r2r`) are measured in the same testbed just before. Prints a table, then `{"rows": [...]}`.
//!
//! Every row runs in a child process of its own (`--row LABEL`) in its own
//! process group, with a time limit: a row that hangs is killed with its
//! vmm processes, its testbed is swept, and it is reported as not completed.

use anyhow::{bail, Result};
use migrate_transit::*;
use serde_json::{json, Value};
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use testbed::{Testbed, TestbedOpts};

const CAP_MBIT: u32 = 1000;
/// 100 MiB/s of dirtied pages for the dirtier-capped rows.
const CAPPED_DIRTY_PAGES_S: u64 = 100 * 256;

/// Transit's rows of bench/migrate-vs-qemu: live migration between two
/// testbed hosts, beside raw TCP and RAM-to-RAM TCP measured in the same
/// testbed.
#[derive(clap::Parser)]
#[command(
    name = "migrate-transit",
    after_help = "workloads: idle (fill, then halt), dirtier, dirtier-capped (dirtier at 100 MiB/s, link capped at \
                  1 Gbit/s) and idle-capped (fill on the capped link); compression rows: idle-capped/1G/4ch with \
                  none, lz4, zstd and dirtier-capped/1G/4ch/lz4 (its uncompressed twin is the shared row \
                  dirtier-capped/1G/4ch)"
)]
struct Args {
    /// 1 GiB rows of the shared matrix only (no compression rows).
    #[arg(long)]
    quick: bool,
    /// The row labelled S, else rows whose label (MODE/WORKLOAD/NG/Nch[/COMPRESS]) contains S.
    #[arg(long, value_name = "S")]
    only: Option<String>,
    /// Run the rows N times, in turn (each run on a fresh testbed with its
    /// own iperf3), then print the median, least and most of each row's figures.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    repeat: u32,
    /// Destinations allocate RAM as pages arrive (default: while waiting,
    /// before the migration starts, as with QEMU's -mem-prealloc).
    #[arg(long)]
    no_prealloc: bool,
    /// Print the labels and exit.
    #[arg(long)]
    list: bool,
    /// Only the two references of the rows, REPEATS times (default 1 stream,
    /// 1 GiB, 3 times): raw TCP (iperf3) and RAM-to-RAM TCP (GIB of shared
    /// memory into another).
    #[arg(long, num_args = 0..=3, value_names = ["STREAMS", "GIB", "REPEATS"])]
    baselines: Option<Vec<u64>>,
    /// One row in this process (what the parent runs in each child).
    #[arg(long, hide = true, value_name = "LABEL")]
    row: Option<String>,
}

/// One row of the matrix.
#[derive(Clone)]
struct Row {
    mode: &'static str,
    workload: &'static str,
    ram_gib: u64,
    channels: u32,
    compress: &'static str,
}

impl Row {
    fn label(&self) -> String {
        let mut l = format!("{}/{}/{}G/{}ch", self.mode, self.workload, self.ram_gib, self.channels);
        if self.compress != "none" {
            l += &format!("/{}", self.compress);
        }
        l
    }
    fn capped(&self) -> bool {
        self.workload.ends_with("-capped")
    }
    /// Give up the migration (cancel it) after this long: three passes over
    /// RAM at the link's raw rate, at least 30 s (bench/migrate-vs-qemu's
    /// rule, so that the full run fits in 30 minutes).
    fn precopy_timeout_s(&self, raw_gbps: f64) -> u64 {
        let one_pass = self.ram_gib as f64 * 8.0 * 1.074 / raw_gbps.max(0.1);
        (3.0 * one_pass).max(30.0) as u64
    }
    /// The whole row, from testbed creation to teardown, before it is killed.
    fn limit_s(&self) -> u64 {
        let raw = if self.capped() { 0.9 } else { 5.0 };
        // Boot and fill/first dirtier pass (~15 s per GiB here, 10 s per
        // GiB more when capped), iperf3, the migration and its grace,
        // teardown.
        60 + 30 * self.ram_gib + self.precopy_timeout_s(raw) + 60
    }
}

fn matrix(quick: bool) -> Vec<Row> {
    let sizes: &[u64] = if quick { &[1] } else { &[1, 4] };
    let mut rows = Vec::new();
    for &ram_gib in sizes {
        for workload in ["idle", "dirtier", "dirtier-capped"] {
            for channels in [1, 4] {
                rows.push(Row { mode: "precopy", workload, ram_gib, channels, compress: "none" });
            }
        }
        // bench/migrate-vs-qemu's postcopy and hybrid rows (one channel, as
        // QEMU's postcopy cannot use multifd here), then Transit's own with
        // four channels.
        for mode in ["postcopy", "hybrid"] {
            for workload in ["dirtier", "dirtier-capped"] {
                rows.push(Row { mode, workload, ram_gib, channels: 1, compress: "none" });
            }
            rows.push(Row { mode, workload: "dirtier", ram_gib, channels: 4, compress: "none" });
        }
    }
    if quick {
        // --quick must stay under 10 minutes with the QEMU half.
        return rows;
    }
    // Compression where it matters: a 1 Gbit/s link. The fill content is
    // half random (at most ~2x); the dirtier's pages (a counter byte, the
    // rest zero) are the compressible case: the shared dirtier-capped row
    // with lz4, against the same row uncompressed above.
    for compress in ["none", "lz4", "zstd"] {
        rows.push(Row { mode: "precopy", workload: "idle-capped", ram_gib: 1, channels: 4, compress });
    }
    rows.push(Row { mode: "precopy", workload: "dirtier-capped", ram_gib: 1, channels: 4, compress: "lz4" });
    rows
}

/// RAM moved by the RAM-to-RAM TCP reference: fresh memory costs seconds
/// per GiB to allocate here (4 GiB would add half a minute to a row), and
/// the rate does not depend on the size.
const RAM_TCP_GIB: u64 = 1;

fn run_row(bin: &std::path::Path, r: &Row, prealloc: bool) -> Result<Value> {
    // Postcopy catches faults on absent pages: its destination cannot
    // allocate RAM ahead.
    let tb = Testbed::create(TestbedOpts::new("mt", 2))?;
    if r.capped() {
        tb.set_rate(0, 0, Some(CAP_MBIT))?;
    }
    let raw = raw_tcp_gbps(&tb, r.channels, 3)?;
    // On the capped link the cap is the limit; elsewhere, also what moving
    // RAM over TCP costs here, before the VMs take their memory.
    let ram_tcp = if r.capped() { None } else { Some(ram_tcp_gbps(&tb, r.channels, RAM_TCP_GIB << 30)?) };
    let (wl, args) = match r.workload {
        "idle" | "idle-capped" => ("fill", String::new()),
        "dirtier" => ("dirtier", String::new()),
        _ => ("dirtier", format!("rate={CAPPED_DIRTY_PAGES_S}")),
    };
    let mem = format!("{}G", r.ram_gib);
    let spec = VmSpec { name: "bench", memory: &mem, workload: wl, args: &args };
    let listen = "tcp:0.0.0.0:4444";
    let incoming = if prealloc { Incoming::Prealloc(listen) } else { Incoming::Uri(listen) };
    let src = start_vm(bin, &tb, 0, &spec, None)?;
    let dst = start_vm(bin, &tb, 1, &spec, Some(incoming))?;
    // Migrate once the workload covers all of RAM (the fill is done, or the
    // dirtier finished its first pass: 10 s per GiB when capped), as the
    // QEMU guest's BENCH-READY does.
    // The dirtier's first pass runs unthrottled (the rate applies from the
    // second pass on), so every workload covers RAM in a few seconds per GiB.
    let ready_s = 60 + 60 * r.ram_gib;
    wait_guest_progress(&src, 1, Duration::from_secs(ready_s))
        .map_err(|e| anyhow::anyhow!("the workload did not cover RAM in {ready_s} s: {e:#}"))?;
    if prealloc {
        // The destination allocates its RAM while the source boots and
        // fills; a migration started before that ends would measure the
        // allocation too. Wait a bounded time for it.
        wait_prealloc(&dst, r.ram_gib, Duration::from_secs(10 * r.ram_gib))?;
    }
    let timeout_s = r.precopy_timeout_s(raw);
    src.exec(
        "migrate",
        json!({"uri": format!("tcp:{}:4444", tb.host(1).addr(0)), "mode": r.mode, "channels": r.channels, "compress": r.compress,
               "downtime_ms": 300, "timeout_s": timeout_s}),
    )?;
    // The source's own figures are final once it says so; it stays alive
    // two seconds after completing, so read it first.
    let s = wait_migration(&src, Duration::from_secs(timeout_s + 60));
    let d = wait_migration(&dst, Duration::from_secs(if s.is_ok() { 30 } else { 5 }));
    let s = s.unwrap_or_else(|e| json!({"status": "failed", "error": format!("source: {e:#}")}));
    let d = d.unwrap_or_else(|e| json!({"status": "failed", "error": format!("destination: {e:#}")}));
    let completed = s["status"] == "completed" && d["status"] == "completed";
    let secs = s["total_ms"].as_f64().map(|m| m / 1e3).filter(|&t| t > 0.0);
    let wire = s["wire_bytes"].as_f64();
    let tput = secs.zip(wire).map(|(t, b)| b * 8.0 / t / 1e9);
    // RAM moved per second (non-zero pages as 4 KiB each): what compression
    // multiplies.
    let ram_bytes = s["ram_transferred_bytes"].as_f64();
    let eff = secs.zip(ram_bytes).map(|(t, b)| b * 8.0 / t / 1e9);
    // The guest's RAM in Gbit, over a rate in Gbit/s: the time to move it.
    let ram_gbit = r.ram_gib as f64 * 8.0 * 1.073_741_824;
    if completed && secs.is_none() {
        bail!("completed without a total time: {s}");
    }
    Ok(json!({
        "system": "transit",
        "mode": r.mode,
        "workload": r.workload,
        "ram_gib": r.ram_gib,
        "channels": r.channels,
        "compress": r.compress,
        "prealloc": prealloc,
        "completed": completed,
        "total_s": if completed { secs } else { None },
        "downtime_ms": if completed { d["downtime_ms"].as_f64().or(s["downtime_ms"].as_f64()) } else { None },
        "throughput_gbps": tput,
        "ram_throughput_gbps": eff,
        "raw_tcp_gbps": raw,
        "fraction_of_raw": tput.map(|t| t / raw),
        "ram_tcp_gbps": ram_tcp,
        "fraction_of_ram_tcp": tput.zip(ram_tcp).map(|(t, m)| t / m),
        "timeout_s": timeout_s,
        "setup_ms": s["setup_ms"],
        "round_ms": s["round_stats"].as_array().map(|v| v.iter().map(|r| r["duration_ms"].clone()).collect::<Vec<_>>()),
        "rounds": s["rounds"],
        "throttle_pct": s["throttle_pct"],
        "wire_bytes": s["wire_bytes"],
        "ram_transferred_bytes": s["ram_transferred_bytes"],
        "zero_pages": s["zero_pages"],
        "compressed_pages": s["compressed_pages"],
        "cpu_s_source": s["cpu_s_source"],
        "cpu_s_dest": d["cpu_s_dest"].as_f64().or(s["cpu_s_dest"].as_f64()),
        "error": s["error"].as_str().or(d["error"].as_str()),
        "setup_steps": s["setup_steps"],
        "downtime_steps_source": s["downtime_steps"],
        "downtime_steps_dest": d["downtime_steps"],
        // Postcopy and hybrid (the destination measures faults).
        "faults": d["faults"].as_u64().or(s["faults"].as_u64()),
        "fault_p50_us": d["fault_p50_us"].as_f64().or(s["fault_p50_us"].as_f64()),
        "fault_p99_us": d["fault_p99_us"].as_f64().or(s["fault_p99_us"].as_f64()),
        "fault_max_us": d["fault_max_us"].as_f64().or(s["fault_max_us"].as_f64()),
        "postcopy_ms": s["postcopy_ms"],
        "pages_pushed": s["pages_pushed"],
        "pages_requested": s["pages_requested"],
        // RAM size over the same-run raw TCP rate: the floor for postcopy.
        "ram_over_raw_s": ram_gbit / raw,
        "ram_over_ram_tcp_s": ram_tcp.map(|m| ram_gbit / m),
    }))
}

fn failed_row(r: &Row, error: String) -> Value {
    json!({"system": "transit", "mode": r.mode, "workload": r.workload, "ram_gib": r.ram_gib, "channels": r.channels,
           "compress": r.compress, "completed": false, "total_s": null, "downtime_ms": null, "throughput_gbps": null,
           "raw_tcp_gbps": null, "error": error})
}

/// Set by SIGINT or SIGTERM: the running row is killed with its vmm
/// processes, its testbed swept, and the run ends.
static INTERRUPTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn on_interrupt(_: libc::c_int) {
    INTERRUPTED.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// Run one row in a child process (own process group) within its limit.
fn row_in_child(r: &Row, prealloc: bool) -> Value {
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => return failed_row(r, e.to_string()),
    };
    let mut c = Command::new(exe);
    c.args(["--row", &r.label()]).stdout(Stdio::piped()).stderr(Stdio::inherit()).process_group(0);
    // Its own group keeps a terminal's Ctrl-C from it (handled here); if
    // this process is killed outright, the row goes too.
    vmm::testing::die_with_parent(&mut c);
    if !prealloc {
        c.arg("--no-prealloc");
    }
    let mut child = match c.spawn() {
        Ok(c) => c,
        Err(e) => return failed_row(r, e.to_string()),
    };
    let mut out = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let limit = Duration::from_secs(r.limit_s());
    let t = Instant::now();
    let status = loop {
        if let Ok(Some(st)) = child.try_wait() {
            break Some(st);
        }
        let interrupted = INTERRUPTED.load(std::sync::atomic::Ordering::SeqCst);
        if interrupted || t.elapsed() > limit {
            // The whole group: the vmm processes too.
            unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
            let _ = child.wait();
            let _ = testbed::sweep();
            if interrupted {
                eprintln!("migrate-transit: interrupted; row {} killed with its vmm processes, testbed swept", r.label());
                std::process::exit(130);
            }
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let text = reader.join().unwrap_or_default();
    match status {
        None => failed_row(r, format!("no answer within {limit:?} (killed with its vmm processes)")),
        Some(st) => text
            .lines()
            .last()
            .and_then(|l| serde_json::from_str::<Value>(l).ok())
            .unwrap_or_else(|| failed_row(r, format!("row process exited {st} without a result"))),
    }
}

fn main() {
    let args: Args = clap::Parser::parse();
    let Args { quick, only, list, .. } = args;
    let prealloc = !args.no_prealloc;
    let repeat = args.repeat as usize;
    if list {
        for r in matrix(quick) {
            println!("{}", r.label());
        }
        return;
    }
    if let Some(b) = args.baselines {
        let num = |k: usize, d: u64| b.get(k).copied().unwrap_or(d);
        let (streams, gib, repeats) = (num(0, 1), num(1, 1), num(2, 3));
        if streams == 0 || gib == 0 || repeats == 0 {
            eprintln!("migrate-transit: --baselines takes counts of at least 1");
            std::process::exit(2);
        }
        if let Err(e) = print_baselines(streams as u32, gib, repeats) {
            eprintln!("migrate-transit: {e:#}");
            std::process::exit(1);
        }
        return;
    }
    if let Some(label) = args.row {
        // Child mode: one row, its JSON as the last line.
        let Some(r) = matrix(false).into_iter().find(|r| r.label() == label) else {
            eprintln!("migrate-transit: no row {label}");
            std::process::exit(2);
        };
        let v = transit_bin().and_then(|bin| run_row(&bin, &r, prealloc)).unwrap_or_else(|e| failed_row(&r, format!("{e:#}")));
        println!("{v}");
        return;
    }
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_interrupt as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_interrupt as *const () as libc::sighandler_t);
    }
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
    // The children find the same binary.
    std::env::set_var("TRANSIT_BIN", &bin);
    let all = matrix(quick);
    // A full label selects that row alone (not its compressed variants).
    let exact = only.as_deref().is_some_and(|o| all.iter().any(|r| r.label() == o));
    let selected: Vec<Row> =
        all.into_iter().filter(|r| only.as_deref().is_none_or(|o| if exact { r.label() == o } else { r.label().contains(o) })).collect();
    let mut rows = Vec::new();
    // Rows in turn, not one row N times: a drift of the machine then
    // spreads over all of them.
    for k in 0..repeat {
        let mut run = Vec::new();
        for r in &selected {
            let label = r.label();
            eprintln!(
                "migrate-transit: {label} (limit {} s){}",
                r.limit_s(),
                if repeat > 1 { format!(", run {} of {repeat}", k + 1) } else { String::new() }
            );
            let t = Instant::now();
            let mut v = row_in_child(r, prealloc);
            v["wall_s"] = json!(t.elapsed().as_secs_f64());
            if repeat > 1 {
                v["run"] = json!(k + 1);
            }
            eprintln!("  {v}");
            run.push(v);
        }
        add_compression_gains(&mut run);
        rows.extend(run);
    }
    print_table(&rows);
    if repeat > 1 {
        print_spread(&selected, &rows);
    }
    print_hybrid_verdicts(&selected, &rows);
    println!("{}", json!({ "rows": rows }));
}

/// With `--repeat`: per row, the median, least and most of the figures
/// whose spread decides whether a target is met.
fn print_spread(selected: &[Row], rows: &[Value]) {
    println!("\nover the runs of each row: median (least-most)");
    for r in selected {
        let runs: Vec<&Value> = rows.iter().filter(|v| row_label(v) == r.label()).collect();
        let spread = |f: &dyn Fn(&Value) -> Option<f64>, p: usize| {
            let mut x: Vec<f64> = runs.iter().filter_map(|v| f(v)).collect();
            if x.is_empty() {
                return "-".to_string();
            }
            let mid = median(&mut x);
            format!("{mid:.p$} ({:.p$}-{:.p$})", x[0], x[x.len() - 1])
        };
        let done = runs.iter().filter(|v| v["completed"] == true).count();
        let over = |k: &'static str| move |v: &Value| v["total_s"].as_f64().zip(v[k].as_f64()).map(|(t, f)| t / f);
        let mut line = format!(
            "{:<34} completed {done}/{}, total s {}, of raw TCP {}",
            r.label(),
            runs.len(),
            spread(&|v| v["total_s"].as_f64(), 2),
            spread(&|v| v["fraction_of_raw"].as_f64(), 2)
        );
        if r.mode != "precopy" {
            line += &format!(
                ", total / (RAM / raw TCP) {}, fault p99 us {}",
                spread(&over("ram_over_raw_s"), 2),
                spread(&|v| v["fault_p99_us"].as_f64(), 0)
            );
        }
        println!("{line}");
    }
}

/// Issue 6's target, hybrid never slower than both pure modes, for each
/// hybrid row whose precopy and postcopy twins ran too: run by run (the
/// rows of a run ran one after another) and on the medians. A run that did
/// not complete counts as slower than any that did.
fn print_hybrid_verdicts(selected: &[Row], rows: &[Value]) {
    let totals = |label: &str| -> Vec<f64> {
        rows.iter()
            .filter(|v| row_label(v) == label)
            .map(|v| if v["completed"] == true { v["total_s"].as_f64().unwrap_or(f64::INFINITY) } else { f64::INFINITY })
            .collect()
    };
    // As bench/migrate-vs-qemu's `hybrid_verdicts`: a hybrid that did not
    // complete is behind both only if both did.
    let verdict = |h: f64, pre: f64, post: f64| {
        if h.is_finite() {
            ["ahead", "between", "behind both"][usize::from(h > pre) + usize::from(h > post)]
        } else if pre.is_finite() && post.is_finite() {
            "behind both"
        } else {
            "did not complete"
        }
    };
    let mut header = false;
    for h in selected.iter().filter(|r| r.mode == "hybrid") {
        let twin = |mode: &'static str| Row { mode, ..h.clone() }.label();
        let (th, tpre, tpost) = (totals(&h.label()), totals(&twin("precopy")), totals(&twin("postcopy")));
        if th.is_empty() || tpre.len() != th.len() || tpost.len() != th.len() {
            continue;
        }
        if !header {
            println!("\nhybrid against the pure modes, total s (inf: did not complete)");
            header = true;
        }
        let runs: Vec<String> =
            (0..th.len()).map(|k| format!("{:.2}/{:.2}/{:.2} {}", th[k], tpre[k], tpost[k], verdict(th[k], tpre[k], tpost[k]))).collect();
        let (mh, mpre, mpost) = (median(&mut th.clone()), median(&mut tpre.clone()), median(&mut tpost.clone()));
        println!(
            "{:<34} hybrid/precopy/postcopy: {}; medians {mh:.2}/{mpre:.2}/{mpost:.2} {}",
            h.label(),
            runs.join(", "),
            verdict(mh, mpre, mpost)
        );
    }
}

/// Sorts `x` (not empty) and returns its median.
fn median(x: &mut [f64]) -> f64 {
    x.sort_by(|a, b| a.total_cmp(b));
    if x.len() % 2 == 1 {
        x[x.len() / 2]
    } else {
        (x[x.len() / 2 - 1] + x[x.len() / 2]) / 2.0
    }
}

/// A result row's label, as [`Row::label`] spells it.
fn row_label(v: &Value) -> String {
    let mut label =
        format!("{}/{}/{}G/{}ch", v["mode"].as_str().unwrap_or("?"), v["workload"].as_str().unwrap_or("?"), v["ram_gib"], v["channels"]);
    if let Some(c) = v["compress"].as_str().filter(|c| *c != "none") {
        label += &format!("/{c}");
    }
    label
}

/// Both references of the rows, alternating, on one testbed; the last line
/// is JSON.
fn print_baselines(streams: u32, gib: u64, repeats: u64) -> Result<()> {
    let tb = Testbed::create(TestbedOpts::new("mt", 2))?;
    let (mut raw, mut ram) = (Vec::new(), Vec::new());
    for _ in 0..repeats {
        raw.push(raw_tcp_gbps(&tb, streams, 3)?);
        ram.push(ram_tcp_gbps(&tb, streams, gib << 30)?);
        println!(
            "{streams} stream(s): raw TCP (iperf3) {:6.2} Gbit/s, RAM-to-RAM TCP ({gib} GiB) {:6.2} Gbit/s",
            raw.last().unwrap(),
            ram.last().unwrap()
        );
    }
    println!("{}", json!({"streams": streams, "ram_gib": gib, "raw_tcp_gbps": raw, "ram_tcp_gbps": ram}));
    Ok(())
}

/// `ram_throughput_vs_uncompressed` on every compressed row whose
/// uncompressed twin (same mode, workload, size, channels) ran too: what
/// compression multiplied the effective throughput by, in the same run.
fn add_compression_gains(rows: &mut [Value]) {
    let twin = |r: &Value| (r["mode"].clone(), r["workload"].clone(), r["ram_gib"].clone(), r["channels"].clone());
    let plain: Vec<_> = rows.iter().filter(|r| r["compress"] == "none").map(|r| (twin(r), r["ram_throughput_gbps"].as_f64())).collect();
    for r in rows.iter_mut().filter(|r| r["compress"] != "none" && r["compress"].is_string()) {
        let base = plain.iter().find(|(k, _)| *k == twin(r)).and_then(|(_, v)| *v);
        if let (Some(b), Some(e)) = (base, r["ram_throughput_gbps"].as_f64()) {
            r["ram_throughput_vs_uncompressed"] = json!(e / b);
        }
    }
}

fn print_table(rows: &[Value]) {
    println!(
        "{:<34} {:>5} {:>8} {:>9} {:>7} {:>7} {:>7} {:>5} {:>7} {:>5} {:>6} {:>6} {:>6}",
        "row", "done", "total s", "downtime", "Gbit/s", "RAM", "raw", "frac", "r2r", "frac", "thrott", "cpu_s", "cpu_d"
    );
    for r in rows {
        let f = |k: &str, p: usize| r[k].as_f64().map(|v| format!("{v:.p$}")).unwrap_or_else(|| "-".into());
        let label = row_label(r);
        println!(
            "{:<34} {:>5} {:>8} {:>9} {:>7} {:>7} {:>7} {:>5} {:>7} {:>5} {:>6} {:>6} {:>6}",
            label,
            r["completed"],
            f("total_s", 2),
            f("downtime_ms", 1),
            f("throughput_gbps", 2),
            f("ram_throughput_gbps", 2),
            f("raw_tcp_gbps", 2),
            f("fraction_of_raw", 2),
            f("ram_tcp_gbps", 2),
            f("fraction_of_ram_tcp", 2),
            r["throttle_pct"],
            f("cpu_s_source", 1),
            f("cpu_s_dest", 1),
        );
        let ratio = |k: &str| r["total_s"].as_f64().zip(r[k].as_f64()).map(|(t, f)| format!("{:.2}", t / f)).unwrap_or_else(|| "-".into());
        if r["mode"] != "precopy" {
            println!(
                "    postcopy {} ms, faults {} (wait p50 {} us, p99 {} us, max {} us), total / (RAM / raw TCP) {}, / (RAM / RAM-to-RAM TCP) {}",
                f("postcopy_ms", 0),
                r["faults"],
                f("fault_p50_us", 0),
                f("fault_p99_us", 0),
                f("fault_max_us", 0),
                ratio("ram_over_raw_s"),
                ratio("ram_over_ram_tcp_s"),
            );
        }
        if let Some(g) = r["ram_throughput_vs_uncompressed"].as_f64() {
            println!("    compression: {g:.2}x the effective throughput (guest RAM per second) of the same row uncompressed");
        }
        if let Some(e) = r["error"].as_str() {
            println!("    error: {e}");
        }
    }
}
