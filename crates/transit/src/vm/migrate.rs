//! `transit vm migrate` and `transit vm migrate-incoming`: the client side.
//! The engine runs inside the vmm processes; this talks to their control
//! sockets, shows progress and prints the final report.

use super::Target;
use anyhow::{bail, Result};
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use vmm::control::Client;

#[derive(clap::Args)]
pub struct MigrateArgs {
    #[command(flatten)]
    pub target: Target,
    /// Destination HOST:PORT (where `migrate-incoming` listens); a
    /// `tcp:` or `rdma:` prefix picks the transport too. Over TCP, several,
    /// comma-separated, one per link between the hosts: the channels are
    /// spread over them and a link lost midway is failed over (the rdma
    /// transport runs over one link).
    #[arg(long)]
    pub to: String,
    /// Parallel data channels (TCP connections, or RDMA queue pairs).
    #[arg(long, default_value_t = 1)]
    pub channels: u32,
    /// tcp: pages over TCP connections; rdma: RDMA WRITEs from this guest
    /// RAM into the destination's through both hosts' rnicd; after a
    /// postcopy switch the destination READs what it lacks (docs/migration.md).
    #[arg(long, default_value = "tcp", value_parser = ["tcp", "rdma"])]
    pub transport: String,
    /// rnicd's control socket for --transport rdma (default: the rnicd
    /// serving an address of this host).
    #[arg(long, default_value = "")]
    pub rnicd: String,
    /// none | lz4 | zstd | zstd:LEVEL (used per page only where it pays).
    #[arg(long, default_value = "none")]
    pub compress: String,
    /// Cap over all channels: bytes/s (125M = 125 MiB/s) or bits/s (1gbit); 0 = none.
    #[arg(long, default_value = "0")]
    pub max_bandwidth: String,
    /// Largest pause of the VM to aim for.
    #[arg(long, default_value_t = 300)]
    pub downtime_ms: u64,
    /// Give up after this many seconds (the VM keeps running here); 0 =
    /// never. It bounds the part before the switch: hybrid switches to
    /// postcopy then, and a postcopy push runs until every page is there.
    #[arg(long, default_value_t = 600)]
    pub timeout: u64,
    /// Do not slow the vCPUs when the guest dirties faster than the link.
    #[arg(long)]
    pub no_auto_converge: bool,
    /// precopy: rounds until the rest fits the downtime; postcopy: switch at
    /// once, the destination fetches what it touches; hybrid: a precopy pass
    /// over RAM, then postcopy unless the rest fits the downtime (sooner if
    /// the guest dirties RAM fast, or on `migrate-start-postcopy`).
    #[arg(long, default_value = "precopy", value_parser = ["precopy", "postcopy", "hybrid"])]
    pub mode: String,
    /// Go on with a postcopy migration paused by a broken connection, to
    /// --to (the destination's original address, or the one its
    /// `migrate-recover` gave).
    #[arg(long)]
    pub resume: bool,
    /// Print the final report as one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Start the migration and return at once.
    #[arg(long)]
    pub detach: bool,
    /// When a postcopy migration pauses (its connection broke), keep waiting
    /// for a recovery (`migrate-recover` on the destination, `migrate
    /// --resume` here, from another shell) instead of returning with
    /// status 3.
    #[arg(long)]
    pub wait_recovery: bool,
}

/// Exit status of `transit vm migrate` (and `migrate-incoming --wait`) when
/// the postcopy migration paused: not failed, but not going on by itself.
pub const EXIT_POSTCOPY_PAUSED: i32 = 3;

/// A postcopy migration paused by a broken connection: the error `main`
/// turns into [`EXIT_POSTCOPY_PAUSED`].
#[derive(Debug)]
pub struct PostcopyPaused(pub String);

impl std::fmt::Display for PostcopyPaused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PostcopyPaused {}

#[derive(clap::Args)]
pub struct MigrateIncomingArgs {
    #[command(flatten)]
    pub target: Target,
    /// Address to listen on for the source, ADDR:PORT (port 0 picks one).
    #[arg(long, default_value = "0.0.0.0:4444")]
    pub listen: String,
    /// Keep the VM paused after it arrived (start it with `transit vm cont`).
    #[arg(long)]
    pub no_resume: bool,
    /// Allocate all of guest RAM while waiting (as QEMU's -mem-prealloc),
    /// so that receiving a page is only a copy.
    #[arg(long)]
    pub prealloc: bool,
    /// rnicd's control socket, for a source that picks the rdma transport
    /// (default: the rnicd serving an address of this host).
    #[arg(long, default_value = "")]
    pub rnicd: String,
    /// Wait until the migration ends and print its report.
    #[arg(long)]
    pub wait: bool,
    /// Print the final report as JSON (with --wait).
    #[arg(long)]
    pub json: bool,
    /// With --wait: when the postcopy migration pauses, keep waiting for a
    /// recovery instead of returning with status 3.
    #[arg(long)]
    pub wait_recovery: bool,
}

pub fn migrate(a: MigrateArgs) -> Result<()> {
    let max_bandwidth =
        units::parse_bandwidth(&a.max_bandwidth).map_err(|e| anyhow::anyhow!("--max-bandwidth {:?}: {e}", a.max_bandwidth))?;
    let mut c = a.target.client()?;
    if a.resume {
        c.execute("migrate", json!({"uri": format!("tcp:{}", a.to), "resume": true}))?;
        if a.detach {
            return Ok(());
        }
        let st = follow(&mut c, !a.json, a.wait_recovery)?;
        return report(&st, a.json);
    }
    c.execute(
        "migrate",
        json!({
            "mode": a.mode,
            "uri": if a.to.starts_with("tcp:") || a.to.starts_with("rdma:") { a.to.clone() } else { format!("{}:{}", a.transport, a.to) },
            "transport": a.transport,
            "rnicd": a.rnicd,
            "channels": a.channels,
            "compress": a.compress,
            "max_bandwidth": max_bandwidth,
            "downtime_ms": a.downtime_ms,
            "timeout_s": a.timeout,
            "auto_converge": !a.no_auto_converge,
        }),
    )?;
    if a.detach {
        return Ok(());
    }
    let st = follow(&mut c, !a.json, a.wait_recovery)?;
    report(&st, a.json)
}

#[derive(clap::Args)]
pub struct MigrateRecoverArgs {
    #[command(flatten)]
    pub target: Target,
    /// New address to listen on for the source, ADDR:PORT (a paused
    /// destination also keeps accepting on its original address).
    #[arg(long)]
    pub listen: String,
}

/// Destination of a paused postcopy: listen for the source on a new address.
pub fn migrate_recover(a: MigrateRecoverArgs) -> Result<()> {
    let mut c = a.target.client()?;
    let r = c.execute("migrate-recover", json!({"uri": format!("tcp:{}", a.listen)}))?;
    eprintln!("listening on port {} for the source's `transit vm migrate --resume`", r["port"]);
    Ok(())
}

/// Parameters for the VM's migrations, as `migrate-set-parameters`.
#[derive(clap::Args)]
pub struct MigrateSetArgs {
    #[command(flatten)]
    pub target: Target,
    /// Cap over all channels: bytes/s (125M = 125 MiB/s) or bits/s
    /// (1gbit); 0 = none. A running outgoing migration takes it at once.
    #[arg(long)]
    pub max_bandwidth: Option<String>,
    /// Largest pause of the VM to aim for. A running outgoing precopy
    /// takes it from its next round on.
    #[arg(long)]
    pub downtime_ms: Option<u64>,
}

/// Sets what was given; prints the parameters now in force.
pub fn set_parameters(a: MigrateSetArgs) -> Result<()> {
    let mut p = serde_json::Map::new();
    if let Some(b) = &a.max_bandwidth {
        let v = units::parse_bandwidth(b).map_err(|e| anyhow::anyhow!("--max-bandwidth {b:?}: {e}"))?;
        p.insert("max_bandwidth".into(), json!(v));
    }
    if let Some(d) = a.downtime_ms {
        p.insert("downtime_ms".into(), json!(d));
    }
    if p.is_empty() {
        bail!("nothing to set: give --max-bandwidth or --downtime-ms");
    }
    let r = a.target.client()?.execute("migrate-set-parameters", Value::Object(p))?;
    println!("{r}");
    Ok(())
}

/// Source of a hybrid migration: switch to postcopy at the end of this round.
pub fn start_postcopy(t: Target) -> Result<()> {
    t.client()?.execute("migrate-start-postcopy", json!({}))?;
    Ok(())
}

pub fn migrate_incoming(a: MigrateIncomingArgs) -> Result<()> {
    let mut c = a.target.client()?;
    let r = c.execute(
        "migrate-incoming",
        json!({"uri": format!("tcp:{}", a.listen), "resume": !a.no_resume, "prealloc": a.prealloc, "rnicd": a.rnicd}),
    )?;
    if !a.json {
        eprintln!("listening on port {}", r["port"]);
    }
    if !a.wait {
        if a.json {
            println!("{r}");
        }
        return Ok(());
    }
    let st = follow(&mut c, !a.json, a.wait_recovery)?;
    report(&st, a.json)
}

/// Poll `query-migrate` until the migration ends (or pauses in postcopy,
/// unless `wait_recovery`), drawing a progress bar.
fn follow(c: &mut Client, bar: bool, wait_recovery: bool) -> Result<Value> {
    let pb = if bar { indicatif::ProgressBar::new(1) } else { indicatif::ProgressBar::hidden() };
    pb.set_style(
        indicatif::ProgressStyle::with_template("{spinner} [{elapsed_precise}] [{bar:40}] {percent:>3}% {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    let t = Instant::now();
    let mut paused_shown = false;
    loop {
        let st = match c.execute("query-migrate", json!({})) {
            Ok(s) => s,
            // The source vmm may exit right after completing.
            Err(e) => bail!("lost the VM's control socket during migration: {e:#}"),
        };
        let status = st["status"].as_str().unwrap_or("none").to_string();
        let total = st["total_pages"].as_u64().unwrap_or(0).max(1);
        let sent = st["pages_sent"].as_u64().unwrap_or(0);
        let remaining = st["remaining_pages"].as_u64().unwrap_or(total);
        let rounds = st["rounds"].as_u64().unwrap_or(0);
        pb.set_length(total);
        pb.set_position(if rounds == 0 { sent.min(total) } else { total - remaining.min(total) });
        let secs = t.elapsed().as_secs_f64().max(1e-3);
        let detail = if status.starts_with("postcopy") {
            format!("faults {} | requested {} pages", st["faults"].as_u64().unwrap_or(0), st["pages_requested"].as_u64().unwrap_or(0))
        } else {
            format!("throttle {}%", st["throttle_pct"].as_u64().unwrap_or(0))
        };
        pb.set_message(format!(
            "{status} round {} | {:.2} Gbit/s | remaining {} pages | {detail}",
            rounds,
            st["wire_bytes"].as_u64().unwrap_or(0) as f64 * 8.0 / secs / 1e9,
            remaining,
        ));
        if status == "postcopy-paused" && !wait_recovery {
            pb.finish_and_clear();
            return Ok(st);
        }
        if status == "postcopy-paused" && !paused_shown {
            pb.println(format!("paused: {}; waiting for a recovery", st["error"].as_str().unwrap_or("")));
        }
        paused_shown = status == "postcopy-paused";
        if matches!(status.as_str(), "completed" | "failed" | "cancelled") {
            pb.finish_and_clear();
            return Ok(st);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// What an operator can do about a paused postcopy, on either side.
fn paused_advice(st: &Value) -> String {
    let why = st["error"].as_str().unwrap_or("the connection broke");
    let missing = st["remaining_pages"].as_u64().map(|n| format!("{n} pages")).unwrap_or_else(|| "some pages".into());
    if st["incoming"].as_bool() == Some(true) {
        format!(
            "postcopy migration paused: {why}\n\
             This destination runs the VM, but {missing} of its memory are still on the source; vCPUs that touch them wait.\n\
             If the source lives: on the source, `transit vm migrate --name SRC --resume --to THIS_HOST:PORT` (this VM still accepts it \
             on its original address, or on a new one after `transit vm migrate-recover --name THIS --listen ADDR:PORT`).\n\
             If the source died, those pages are lost: `transit vm quit` ends this VM."
        )
    } else {
        format!(
            "postcopy migration paused: {why}\n\
             The destination runs the VM; this source never runs it again and keeps all of its memory ({missing} not sent yet).\n\
             To go on: start a destination (the old one if it lives, or `transit vm migrate-recover --name DST --listen ADDR:PORT` on it), \
             then `transit vm migrate --name THIS --resume --to ADDR:PORT` here.\n\
             If the destination died, the VM is lost with it; this source only holds its memory. Do not quit it while a recovery is possible."
        )
    }
}

fn report(st: &Value, as_json: bool) -> Result<()> {
    if as_json {
        println!("{st}");
    } else {
        let f = |k: &str| st[k].as_f64().map(|v| format!("{v:.2}")).unwrap_or_else(|| "-".into());
        let u = |k: &str| st[k].as_u64().map(|v| v.to_string()).unwrap_or_else(|| "-".into());
        println!("status            {}", st["status"].as_str().unwrap_or("?"));
        if let Some(e) = st["error"].as_str() {
            println!("error             {e}");
        }
        println!("total time        {} ms (setup {} ms)", f("total_ms"), f("setup_ms"));
        println!("downtime          {} ms (target estimate {} ms)", f("downtime_ms"), f("expected_downtime_ms"));
        println!("RAM               {} bytes, {} pages", u("ram_bytes"), u("total_pages"));
        println!(
            "pages sent        {} (zero {}, raw {}, compressed {})",
            u("pages_sent"),
            u("zero_pages"),
            u("raw_pages"),
            u("compressed_pages")
        );
        println!("transferred       {} bytes of RAM, {} bytes on the wire", u("ram_transferred_bytes"), u("wire_bytes"));
        println!("throughput        {} Gbit/s on the wire, {} Gbit/s of RAM", f("throughput_gbps"), f("ram_throughput_gbps"));
        for l in st["links"].as_array().into_iter().flatten().filter(|_| st["links"].as_array().is_some_and(|a| a.len() > 1)) {
            println!(
                "  link {:<21} {} channels ({} lost), {} bytes, {:.2} Gbit/s{}",
                l["addr"].as_str().unwrap_or("?"),
                l["channels"],
                l["channels_lost"],
                l["wire_bytes"],
                l["throughput_gbps"].as_f64().unwrap_or(0.0),
                l["error"]
                    .as_str()
                    .map(|e| format!(", {}: {e}", if l["failed"] == true { "failed" } else { "degraded" }))
                    .unwrap_or_default()
            );
        }
        println!("rounds            {} (throttle {}%, {} steps)", u("rounds"), u("throttle_pct"), u("throttle_steps"));
        if let Some(rs) = st["round_stats"].as_array() {
            for r in rs {
                println!(
                    "  round {:>3}: {:>9} pages {:>9.1} ms  dirty {:>10.0} pages/s  throttle {}%",
                    r["round"],
                    r["pages"],
                    r["duration_ms"].as_f64().unwrap_or(0.0),
                    r["dirty_pages_per_s"].as_f64().unwrap_or(0.0),
                    r["throttle_pct"]
                );
            }
        }
        if st["mode"].as_str().is_some_and(|m| m != "precopy") {
            println!("mode              {}", st["mode"].as_str().unwrap_or("?"));
            println!("postcopy          {} ms, pages pushed {} / requested {}", f("postcopy_ms"), u("pages_pushed"), u("pages_requested"));
            println!(
                "faults            {} (wait p50 {} us, p99 {} us, max {} us)",
                u("faults"),
                f("fault_p50_us"),
                f("fault_p99_us"),
                f("fault_max_us")
            );
            println!("recoveries        {} ({} ms paused)", u("recoveries"), f("paused_ms"));
        }
        println!("CPU               source {} s, destination {} s", f("cpu_s_source"), f("cpu_s_dest"));
    }
    match st["status"].as_str() {
        Some("completed") => Ok(()),
        Some("postcopy-paused") => Err(PostcopyPaused(paused_advice(st)).into()),
        _ => bail!("migration {}: {}", st["status"].as_str().unwrap_or("?"), st["error"].as_str().unwrap_or("")),
    }
}
