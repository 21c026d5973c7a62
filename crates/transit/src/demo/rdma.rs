//! `transit demo` (the headline): three hosts (network namespaces), one
//! rnicd each. A VM on host A with a PVRDMA device runs every RDMA workload
//! of its firmware (SEND streams both ways, the peer's WRITE ring, the
//! peer's READ table, atomics, a big RDMA WRITE) against `transit rdma
//! peer` on host C, a plain verbs program that is never told anything. The
//! VM is live-migrated A -> B -> A while everything runs; then the peer
//! stops, and both sides' checks must hold: nothing lost, nothing twice, no
//! error completion, no violation in the guest.

use anyhow::{bail, Context as _, Result};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};
use testbed::rnicd::Rnicd;
use vmm::testing::{unique_name, VmProcess};

use super::{step, DemoArgs};

const PORT: u16 = 4440;
const WAIT: Duration = Duration::from_secs(300);

/// rnicd on every host, each on its host's default socket (the VMs' devices
/// find it there); dropped after the VMs and the peer.
fn start_nics(tb: &testbed::Testbed, me: &std::path::Path) -> Result<Vec<Rnicd>> {
    let me = me.to_str().context("the transit path is not UTF-8")?;
    (0..3)
        .map(|i| {
            let h = tb.host(i);
            // ARP requests from a host name its own address, not a GID it may
            // lose while the request is out.
            h.sh("sysctl -qw net.ipv4.conf.all.arp_announce=2")?;
            let sock = rnic::daemon::default_socket_path(h.addr(0));
            Rnicd::start_cmd(tb, i, &[me, "--log", "warn", "rnicd"], Some(sock), &[])
        })
        .collect()
}

/// The peer process on host C; killed if the demo fails before its report.
struct PeerProc(Child);

impl Drop for PeerProc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl PeerProc {
    /// Ends its run (SIGTERM: what is in flight drains) and reads its report.
    fn stop(mut self) -> Result<Value> {
        // SAFETY: a signal to our own child.
        unsafe { libc::kill(self.0.id() as libc::pid_t, libc::SIGTERM) };
        let mut out = String::new();
        self.0.stdout.take().context("peer stdout")?.read_to_string(&mut out)?;
        let _ = self.0.wait();
        let last = out.lines().last().unwrap_or("");
        serde_json::from_str(last).with_context(|| format!("the peer's report: {last:?}"))
    }
}

/// Milliseconds since the Unix epoch: the clock of the peer's `long_gaps`.
fn unix_ms() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs_f64() * 1e3
}

/// rnicd on the peer's host, asked for its counters around each hop: what
/// standard RC recovery (RNR NAKs, go-back-N, timeouts) did for the peer's
/// QPs while the VM moved.
struct PeerNic(verbs::Context);

/// rnicd's counters that tell why a requester waited.
const RECOVERY_COUNTERS: [&str; 7] =
    ["rnr_naks_received", "rnr_naks_sent", "seq_naks_sent", "retransmit_rewinds", "loss_probes", "timeouts", "dup_requests"];

struct Counters(serde_json::Map<String, Value>);

impl PeerNic {
    fn counters(&self) -> Result<Counters> {
        let s = self.0.stats()?;
        Ok(Counters(RECOVERY_COUNTERS.iter().map(|k| (k.to_string(), s[*k].as_u64().unwrap_or(0).into())).collect()))
    }
}

impl Counters {
    fn since(&self, before: &Counters) -> Counters {
        let n = |c: &Counters, k: &str| c.0.get(k).and_then(Value::as_u64).unwrap_or(0);
        Counters(self.0.keys().map(|k| (k.clone(), n(self, k).saturating_sub(n(before, k)).into())).collect())
    }
}

/// One live migration as the demo saw it.
struct Hop {
    /// From the `migrate` command until the source reported it completed
    /// (Unix ms): the peer's stalls that overlap it are the switch's.
    window: (f64, f64),
    /// From the source's pause of the VM to the destination's start of it
    /// (Unix ms): the VM's downtime on the peer's clock.
    switch: Option<(f64, f64)>,
    downtime_ms: f64,
    /// What the migration and the peer's rnicd reported.
    stats: Value,
}

fn gap_span(g: &Value) -> (f64, f64) {
    let start = g["start_unix_ms"].as_f64().unwrap_or(0.0);
    (start, start + g["ms"].as_f64().unwrap_or(0.0))
}

/// The peer's longest stall that overlaps `span` (Unix ms), from its
/// `long_gaps` (stalls of 1 ms or more): its length and the stall; 0 if
/// none; if none listed overlaps but the list is full (a busy run had more
/// long stalls than it keeps), the shortest listed, an upper bound.
fn longest_gap_in(rep: &Value, span: (f64, f64)) -> (f64, Option<&Value>) {
    let gaps = rep["long_gaps"].as_array().map(Vec::as_slice).unwrap_or_default();
    let ms = |g: &Value| g["ms"].as_f64().unwrap_or(0.0);
    let over = gaps.iter().filter(|g| gap_span(g).0 <= span.1 && gap_span(g).1 >= span.0).max_by(|x, y| ms(x).total_cmp(&ms(y)));
    match over {
        Some(g) => (ms(g), Some(g)),
        None if gaps.len() >= verbs::peer::LONG_GAPS => (gaps.last().map(ms).unwrap_or(0.0), None),
        None => (0.0, None),
    }
}

/// Where the stall `g` was against the hop's pause, and what ended it.
fn gap_place(g: &Value, h: &Hop) -> String {
    let (start, end) = gap_span(g);
    let by = g["ended_by"].as_str().unwrap_or("?");
    match h.switch {
        Some((paused, _)) => format!(" (from {:+.0} to {:+.0} ms of the pause, ended by a {by} completion)", start - paused, end - paused),
        None => format!(" (ended by a {by} completion)"),
    }
}

/// The target for the peer: its longest stall at a switch is at
/// most the VM's downtime + 10 ms.
const GAP_SLACK_MS: f64 = 10.0;

/// What missing pages cost one process on a postcopy destination (the
/// vmm, or rnicd: while rnicd waits, every QP of its host waits), placed
/// against the source's pause.
fn fault_waits_line(w: &Value, paused_unix_ms: Option<f64>) -> String {
    let f = |k: &str| w[k].as_f64().unwrap_or(0.0);
    let at = |k: &str| match (w[k].as_f64(), paused_unix_ms) {
        (Some(t), Some(p)) => format!("{:+.0} ms", t - p),
        _ => "-".into(),
    };
    format!(
        "{} on the destination: {} faults on missing pages ({} on the device's pages, {} on pages already here), {:.1} ms waited in all (longest {:.1} ms), first fault at {} and last wake at {} of the pause",
        w["name"].as_str().unwrap_or("?"),
        w["faults"].as_u64().unwrap_or(0),
        w["device_faults"].as_u64().unwrap_or(0),
        w["faults_present"].as_u64().unwrap_or(0),
        f("wait_ms"),
        f("wait_max_us") / 1e3,
        at("first_fault_unix_ms"),
        at("last_wake_unix_ms"),
    )
}

fn mailbox_msg(vm: &VmProcess) -> Result<String> {
    let t0 = Instant::now();
    loop {
        let r = vm.exec("mailbox-read", json!({}))?;
        if r["seq"].as_u64().unwrap_or(0) > 0 {
            return Ok(r["data"].as_str().unwrap_or("").to_string());
        }
        // Filling the big WRITE's source (64 MiB by default) on an emulated
        // vCPU of a loaded machine can take a minute.
        if t0.elapsed() > WAIT {
            bail!("the guest published no IDs; console:\n{}", vm.console());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn vm_args(a: &DemoArgs, gid: std::net::Ipv4Addr) -> String {
    let mut s = format!("gid={gid} count=0 qps={}", a.qps);
    if a.bigwrite != "0" {
        s += &format!(" bigwrite={}", a.bigwrite);
    }
    s
}

fn start_vm(
    h: &testbed::Host,
    me: &std::path::Path,
    name: &str,
    a: &DemoArgs,
    gid: std::net::Ipv4Addr,
    extra: &[&str],
) -> Result<VmProcess> {
    let (fw, spec) = (vm_args(a, gid), format!("gid={gid}"));
    let mut all =
        vec!["--log", "warn", "vm", "run", "--name", name, "--memory", &a.memory, "--workload", "pvrdma", "--args", &fw, "--pvrdma", &spec];
    all.extend_from_slice(extra);
    VmProcess::start(h.command(me), name, &all)
}

/// Moves the VM from `src` to a new VM on `to`; returns the new VM and
/// what the migration reported.
fn hop(
    src: &mut VmProcess,
    to: &testbed::Host,
    me: &std::path::Path,
    name: &str,
    a: &DemoArgs,
    gid: std::net::Ipv4Addr,
    peer_nic: &PeerNic,
) -> Result<(VmProcess, Hop)> {
    let uri = format!("tcp:0.0.0.0:{PORT}");
    let dst = start_vm(to, me, name, a, gid, &["--incoming", &uri])?;
    let counters_before = peer_nic.counters()?;
    let window_start = unix_ms();
    src.exec("migrate", json!({"uri": format!("tcp:{}:{PORT}", to.addr(0)), "channels": a.channels, "mode": a.mode}))?;
    let t0 = Instant::now();
    let st = loop {
        let st = src.exec("query-migrate", json!({}))?;
        match st["status"].as_str().unwrap_or("") {
            "completed" => break st,
            "failed" | "cancelled" => bail!("migration {}: {}", st["status"], st["error"]),
            _ => {}
        }
        if t0.elapsed() > WAIT {
            bail!("the migration did not finish in {} s", WAIT.as_secs());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let window_end = unix_ms();
    let rounds: Vec<String> = st["round_stats"]
        .as_array()
        .map(|r| r.iter().map(|r| format!("{:.0} ms", r["duration_ms"].as_f64().unwrap_or(0.0))).collect())
        .unwrap_or_default();
    src.wait_exit(Duration::from_secs(30))?;
    let p0 = dst.status()?["guest_progress"].as_u64().unwrap_or(0);
    dst.wait_progress(p0 + 1, WAIT)?;
    let counters = peer_nic.counters()?.since(&counters_before);
    eprintln!(
        "    done in {:.2} s (setup {:.0} ms, RAM rounds of {}): VM downtime {:.1} ms; the guest runs on and checks on",
        st["total_ms"].as_f64().unwrap_or(0.0) / 1000.0,
        st["setup_ms"].as_f64().unwrap_or(0.0),
        if rounds.is_empty() { "none".to_string() } else { rounds.join(", ") },
        st["downtime_ms"].as_f64().unwrap_or(0.0),
    );
    let paused = st["paused_unix_ms"].as_f64();
    for w in st["fault_waits"].as_array().map(Vec::as_slice).unwrap_or_default() {
        eprintln!("    {}", fault_waits_line(w, paused));
    }
    let hop = Hop {
        window: (window_start, window_end),
        switch: st["paused_unix_ms"].as_f64().map(|p| (p, p + st["downtime_ms"].as_f64().unwrap_or(0.0))),
        downtime_ms: st["downtime_ms"].as_f64().unwrap_or(0.0),
        stats: json!({"total_ms": st["total_ms"], "downtime_ms": st["downtime_ms"], "rounds": st["rounds"], "migration_mode": a.mode,
                      "postcopy_ms": st["postcopy_ms"], "fault_waits": st["fault_waits"], "peer_nic": counters.0}),
    };
    Ok((dst, hop))
}

pub fn run(a: DemoArgs) -> Result<()> {
    let t0 = Instant::now();
    let me = std::env::current_exe()?;
    step("creating a testbed with three hosts (network namespaces on a bridge), one rnicd (software RoCE NIC) each");
    let tb = testbed::Testbed::create(testbed::TestbedOpts::new("demo", 3))?;
    let (ha, hb, hc) = (tb.host(0), tb.host(1), tb.host(2));
    eprintln!("    host A = {}, host B = {}, peer host C = {}", ha.addr(0), hb.addr(0), hc.addr(0));
    let nics = start_nics(&tb, &me)?;
    let peer_nic = PeerNic(verbs::Context::open(Some(&nics[2].sock)).context("rnicd on host C")?);
    let gid = tb.spare_addr(0, 1);
    let name = unique_name("demo");
    step(&format!(
        "starting VM {name} on host A: {} of RAM, a PVRDMA device with GID {gid}, every RDMA workload on {} QPs{}",
        a.memory,
        a.qps,
        if a.bigwrite != "0" { format!(" plus {} RDMA WRITEs", a.bigwrite) } else { String::new() }
    ));
    let mut vm = start_vm(ha, &me, &name, &a, gid, &[])?;
    let ids = mailbox_msg(&vm)?;

    step("starting the bare-metal peer on host C (transit rdma peer: plain verbs, RC, never told about a move)");
    let ids_file = std::env::temp_dir().join(format!("{name}.guest-ids"));
    std::fs::write(&ids_file, &ids)?;
    let mut child = hc
        .command(&me)
        .args(["--log", "warn", "rdma", "peer", "--guest", ids_file.to_str().context("path")?])
        .args(["--sock", nics[2].sock.to_str().context("path")?, "--timeout", "20", "--stall", "120", "--duration", "86400"])
        .stdout(Stdio::piped())
        .stdin(Stdio::null())
        .spawn()?;
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().context("peer stdout")?).read_line(&mut line)?;
    let _ = std::fs::remove_file(&ids_file);
    let peer = PeerProc(child);
    if !line.contains("gid=") {
        bail!("the peer did not start: {line:?}");
    }
    vm.exec("mailbox-write", json!({"data": line.trim()}))?;
    let settle = |vm: &VmProcess| -> Result<u64> {
        let p = vm.status()?["guest_progress"].as_u64().unwrap_or(0);
        std::thread::sleep(Duration::from_secs(a.run_secs));
        let q = vm.wait_progress(p + 1, WAIT)?;
        Ok(q)
    };
    let p = settle(&vm)?;
    eprintln!("    the guest checked {p} operations so far");

    let mut hops = Vec::new();
    step(&format!("live-migrating the VM ({}) A -> B over {} TCP channels while every workload runs", a.mode, a.channels));
    let (mut vm_b, h1) = hop(&mut vm, hb, &me, &format!("{name}-b"), &a, gid, &peer_nic)?;
    hops.push(h1);
    drop(vm);
    settle(&vm_b)?;
    step("and back B -> A");
    let (vm_a, h2) = hop(&mut vm_b, ha, &me, &format!("{name}-a2"), &a, gid, &peer_nic)?;
    hops.push(h2);
    drop(vm_b);
    let p = settle(&vm_a)?;

    step("stopping the peer (what is in flight drains) and reading both sides' checks");
    // The guest's checks as they stand before the peer goes: once it is
    // gone, the guest's next operations fail, as they should.
    let console = vm_a.console();
    let rep = peer.stop()?;
    let guest_ok = !console.contains("VIOLATION") && !console.contains("FAIL");
    vm_a.exec("quit", json!({}))?;
    drop(vm_a);
    drop(peer_nic);
    drop(nics);
    drop(tb);

    let n = |k: &str| rep[k].as_u64().unwrap_or(0);
    let peer_errors = n("errors") + n("error_completions");
    let (lost, duplicated) = (n("lost"), n("duplicated"));
    let ok = guest_ok && rep["ok"] == true && peer_errors == 0 && lost == 0 && duplicated == 0;
    // Per hop, the connection's longest stalls (no QP of the peer
    // completed anything): the one that overlaps the switch (the VM's
    // downtime) is what the move cost the peer, the target; the
    // longest while the migration ran also counts its RAM rounds.
    let mut migrations = Vec::new();
    let mut gaps_met = true;
    for (i, h) in hops.iter().enumerate() {
        let (at_switch, g_switch) = longest_gap_in(&rep, h.switch.unwrap_or(h.window));
        let (migrating, g_migrating) = longest_gap_in(&rep, h.window);
        let met = at_switch <= h.downtime_ms + GAP_SLACK_MS;
        gaps_met &= met;
        eprintln!(
            "    hop {}: VM downtime {:.1} ms; the peer's longest stall at the switch {at_switch:.1} ms{} (target: at most the downtime + \
             {GAP_SLACK_MS} ms, {}), while the migration ran {migrating:.1} ms{}; the peer's rnicd meanwhile: {}",
            i + 1,
            h.downtime_ms,
            g_switch.map(|g| gap_place(g, h)).unwrap_or_default(),
            if met { "met" } else { "NOT met" },
            g_migrating.map(|g| gap_place(g, h)).unwrap_or_default(),
            h.stats["peer_nic"]
        );
        let mut m = h.stats.clone();
        m["peer_gap_ms"] = at_switch.into();
        m["peer_gap_target_met"] = met.into();
        m["peer_gap_migrating_ms"] = migrating.into();
        migrations.push(m);
    }
    // Over the whole run: the peer's `max_gap_ms`, the same measure
    // bench/pvrdma-migrate reports as `peer_gap_ms`, placed against the hops.
    let stall = rep["max_gap_ms"].as_f64().unwrap_or(0.0);
    let stall_where = match rep["long_gaps"].as_array().and_then(|g| g.first()) {
        Some(g) => {
            let (start, end) = gap_span(g);
            let by = g["ended_by"].as_str().unwrap_or("?");
            let at = |span: (f64, f64)| start <= span.1 && end >= span.0;
            match hops.iter().position(|h| h.switch.is_some_and(at)) {
                Some(i) => format!("at the switch of hop {}, ended by a {by} completion", i + 1),
                None => match hops.iter().position(|h| at(h.window)) {
                    Some(i) => format!("while hop {} ran, before its switch, ended by a {by} completion", i + 1),
                    None => format!("while no migration ran, ended by a {by} completion"),
                },
            }
        }
        None => "no stall of 1 ms or more".to_string(),
    };
    eprintln!("    over the whole run the peer's longest stall was {stall:.1} ms, {stall_where}");
    let per_hop: Vec<String> = hops
        .iter()
        .zip(&migrations)
        .map(|(h, m)| {
            format!("{:.1} ms (the peer's longest stall at the switch {:.1} ms)", h.downtime_ms, m["peer_gap_ms"].as_f64().unwrap_or(0.0))
        })
        .collect();
    println!(
        "Transit demo: a VM with a PVRDMA device talking RDMA to a bare-metal peer on {} QPs was live-migrated A -> B -> A ({}). \
         VM downtime {}; the peer's longest stall over the whole run {:.1} ms ({}); {} messages and {} bytes verified by the peer, \
         {} operations checked by the guest; {} errors, {} lost, {} duplicated; {:.1} s in all.",
        rep["qps"],
        a.mode,
        per_hop.join(" and "),
        stall,
        stall_where,
        n("messages_verified"),
        n("bytes_verified"),
        p,
        peer_errors,
        lost,
        duplicated,
        t0.elapsed().as_secs_f64()
    );
    if !ok {
        eprintln!("peer violations: {}", rep["violations"]);
        if !guest_ok {
            eprintln!("guest console:\n{console}");
        }
    }
    println!(
        "{}",
        json!({"ok": ok, "hops": hops.len(), "oracle": if ok { "pass" } else { "fail" }, "peer_errors": peer_errors, "lost": lost,
               "duplicated": duplicated, "mode": a.mode, "qps": rep["qps"], "peer_max_stall_ms": stall, "peer_gap_target_met": gaps_met,
               "peer_gap_ms": migrations.iter().map(|m| m["peer_gap_ms"].clone()).collect::<Vec<_>>(),
               "messages_verified": n("messages_verified"), "bytes_verified": n("bytes_verified"), "guest_checked": p, "migrations": migrations})
    );
    if !ok {
        bail!("a check failed");
    }
    Ok(())
}
