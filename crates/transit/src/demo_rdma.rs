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
use vmm::testing::{unique_name, VmProcess};

use crate::demo::{step, DemoArgs};

const PORT: u16 = 4440;
const WAIT: Duration = Duration::from_secs(300);

/// rnicd on every host; dropped after the VMs and the peer.
struct Nics {
    children: Vec<testbed::HostChild>,
    socks: Vec<std::path::PathBuf>,
}

impl Drop for Nics {
    fn drop(&mut self) {
        self.children.clear();
        for s in &self.socks {
            let _ = std::fs::remove_file(s);
        }
    }
}

fn start_nics(tb: &testbed::Testbed, me: &std::path::Path) -> Result<Nics> {
    let mut n = Nics { children: Vec::new(), socks: Vec::new() };
    for i in 0..3 {
        let h = tb.host(i);
        // ARP requests from a host name its own address, not a GID it may
        // lose while the request is out.
        h.sh("sysctl -qw net.ipv4.conf.all.arp_announce=2")?;
        let sock = rnic::daemon::default_socket_path(h.addr(0));
        let _ = std::fs::remove_file(&sock);
        n.children.push(h.spawn(me.to_str().context("path")?, ["--log", "warn", "rnicd", "--addr", &h.addr(0).to_string()])?);
        let t0 = Instant::now();
        while !sock.exists() {
            if t0.elapsed() > Duration::from_secs(20) {
                bail!("rnicd did not start on {}", h.name());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        n.socks.push(sock);
    }
    Ok(n)
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
) -> Result<(VmProcess, Value)> {
    let uri = format!("tcp:0.0.0.0:{PORT}");
    let dst = start_vm(to, me, name, a, gid, &["--incoming", &uri])?;
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
    src.wait_exit(Duration::from_secs(30))?;
    let p0 = dst.status()?["guest_progress"].as_u64().unwrap_or(0);
    dst.wait_progress(p0 + 1, WAIT)?;
    eprintln!(
        "    done in {:.2} s: VM downtime {:.1} ms, {} rounds; the guest runs on and checks on",
        st["total_ms"].as_f64().unwrap_or(0.0) / 1000.0,
        st["downtime_ms"].as_f64().unwrap_or(0.0),
        st["rounds"]
    );
    Ok((dst, json!({"total_ms": st["total_ms"], "downtime_ms": st["downtime_ms"], "rounds": st["rounds"], "migration_mode": a.mode})))
}

pub fn run(a: DemoArgs) -> Result<()> {
    let t0 = Instant::now();
    let me = std::env::current_exe()?;
    step("creating a testbed with three hosts (network namespaces on a bridge), one rnicd (software RoCE NIC) each");
    let tb = testbed::Testbed::create(testbed::TestbedOpts::new("demo", 3))?;
    let (ha, hb, hc) = (tb.host(0), tb.host(1), tb.host(2));
    eprintln!("    host A = {}, host B = {}, peer host C = {}", ha.addr(0), hb.addr(0), hc.addr(0));
    let nics = start_nics(&tb, &me)?;
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
        .args(["--sock", nics.socks[2].to_str().context("path")?, "--timeout", "20", "--stall", "120", "--duration", "86400"])
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
    let (mut vm_b, h1) = hop(&mut vm, hb, &me, &format!("{name}-b"), &a, gid)?;
    hops.push(h1);
    drop(vm);
    settle(&vm_b)?;
    step("and back B -> A");
    let (vm_a, h2) = hop(&mut vm_b, ha, &me, &format!("{name}-a2"), &a, gid)?;
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
    drop(nics);
    drop(tb);

    let n = |k: &str| rep[k].as_u64().unwrap_or(0);
    let peer_errors = n("errors") + n("error_completions");
    let (lost, duplicated) = (n("lost"), n("duplicated"));
    let ok = guest_ok && rep["ok"] == true && peer_errors == 0 && lost == 0 && duplicated == 0;
    // The connection's longest stall: the longest time in which no QP of
    // the peer completed anything (the peer's `max_gap_ms`), the same
    // measure bench/pvrdma-migrate reports.
    let stall = rep["max_gap_ms"].as_f64().unwrap_or(0.0);
    let downtimes: Vec<String> = hops.iter().map(|h| format!("{:.1} ms", h["downtime_ms"].as_f64().unwrap_or(0.0))).collect();
    println!(
        "Transit demo: a VM with a PVRDMA device talking RDMA to a bare-metal peer on {} QPs was live-migrated A -> B -> A ({}). \
         VM downtime {}; the peer's longest stall {:.1} ms; {} messages and {} bytes verified by the peer, {} operations checked by the guest; \
         {} errors, {} lost, {} duplicated; {:.1} s in all.",
        rep["qps"],
        a.mode,
        downtimes.join(" and "),
        stall,
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
               "duplicated": duplicated, "mode": a.mode, "qps": rep["qps"], "peer_max_stall_ms": stall,
               "messages_verified": n("messages_verified"), "bytes_verified": n("bytes_verified"), "guest_checked": p, "migrations": hops})
    );
    if !ok {
        bail!("a check failed");
    }
    Ok(())
}
