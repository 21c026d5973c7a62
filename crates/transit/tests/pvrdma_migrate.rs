//! Live migration of a VM with a PVRDMA device while `transit rdma peer`
//! on testbed host 2 runs every workload against it (real rnicd, vmm and
//! peer processes; VMs on hosts 0 and 1). The peer is never told about a
//! move: it keeps the VM's GID, QPNs, keys and addresses, and sees RNR NAKs
//! and retransmissions while the VM moves, never an error.
//!
//! What must hold: every workload checked on both sides across A -> B -> A
//! (exactly once, in order, no error completion, no atomic twice); the GID
//! held by exactly one host; the same at 1% loss and with the peer's link
//! cut across the switch; a migration that is cancelled or whose
//! destination dies or refuses the state leaves the VM and its QPs running
//! on the source, and a second migration succeeds. Two negative controls
//! turn a mechanism off (`testing=` in `--pvrdma`) and expect the failure
//! it prevents.

mod pvrdma_bed;

use pvrdma_bed::*;
use serde_json::{json, Value};
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};
use vmm::testing::VmProcess;

/// A destination for `gid` on host `h`, waiting for the migration.
fn destination(bed: &Bed, h: usize, gid: Ipv4Addr, pvrdma: &str) -> VmProcess {
    sized_destination(bed, h, gid, "64M", pvrdma)
}

fn sized_destination(bed: &Bed, h: usize, gid: Ipv4Addr, memory: &str, pvrdma: &str) -> VmProcess {
    bed.vm_sized(h, gid, memory, "count=0", pvrdma, &["--incoming", "tcp:0.0.0.0:4444", "--keep-after-migrate"])
}

/// What runs in the VM: firmware arguments and RAM.
#[derive(Clone, Copy)]
struct Load {
    args: &'static str,
    memory: &'static str,
}

/// Every workload on one QP each.
const PLAIN: Load = Load { args: "count=0", memory: "64M" };

fn start_migration(bed: &Bed, src: &VmProcess, to: usize, params: Value) {
    let mut a = params;
    a["uri"] = json!(format!("tcp:{}:4444", bed.tb.host(to).addr(0)));
    src.exec("migrate", a).unwrap();
}

/// The outgoing migration's last status once it ended.
fn wait_end(src: &VmProcess) -> Value {
    let mut last = Value::Null;
    wait_for("the migration to end", LONG, || {
        last = migration(src);
        matches!(last["status"].as_str(), Some("completed" | "failed" | "cancelled"))
    });
    last
}

/// Moves the VM from `src` to a new destination on host `to`; returns the
/// destination and the source's migration report. The source stays up
/// (`--keep-after-migrate`) for the checks, then quits.
fn hop(bed: &Bed, src: &mut VmProcess, to: usize, gid: Ipv4Addr, memory: &str, params: Value) -> (VmProcess, Value) {
    let dst = sized_destination(bed, to, gid, memory, "");
    start_migration(bed, src, to, params);
    let st = wait_end(src);
    assert_eq!(st["status"], "completed", "{st:#}\nsource console:\n{}", src.console());
    wait_for("the destination to run", LONG, || dst.status().unwrap()["running"] == true);
    (dst, st)
}

/// After a hop: the destination holds the GID, the source does not, the
/// source's device (`traced`: while the peer could reach it) traced the
/// peer's writes during the rounds, and it holds no objects any more.
fn check_hop(bed: &Bed, src: &mut VmProcess, dst: &VmProcess, (from, to): (usize, usize), gid: Ipv4Addr, traced: bool) {
    assert!(bed.holds(to, gid) && !bed.holds(from, gid), "the GID must be on host {to} only");
    let d = pvrdma(src);
    eprintln!("source device after the hop: {}", d["counters"]);
    assert!(!traced || d["counters"]["traced_pages"].as_u64().unwrap() > 0, "the peer's writes were traced: {d:#}");
    // The source closes its namespace when its main loop sees the
    // migration completed, which may be just after query-migrate says so.
    wait_for("the source's namespace to hold nothing", LONG, || pvrdma(src)["objects"]["qps"] == 0);
    assert_qps_running(dst);
    src.exec("quit", json!({})).unwrap();
    src.wait_exit(Duration::from_secs(20)).unwrap();
}

/// A -> B -> A with every workload of `load` running and `params` for
/// each hop; returns the peer's report.
fn there_and_back(tag: &str, load: Load, params: Value, during: impl Fn(&Bed, usize)) -> Value {
    let bed = Bed::new(tag);
    let gid = bed.vm_gid(1);
    let mut a = bed.vm_sized(0, gid, load.memory, load.args, "", &["--keep-after-migrate"]);
    let peer = Peer::start(&bed, &a, &[PEER, &["--duration", "40"]].concat());
    let p0 = a.wait_progress(STEP, LONG).unwrap();
    assert!(bed.holds(0, gid));
    during(&bed, 1);
    let (mut b, st) = hop(&bed, &mut a, 1, gid, load.memory, params.clone());
    eprintln!("A -> B: downtime {} ms, total {} ms", st["downtime_ms"], st["total_ms"]);
    check_hop(&bed, &mut a, &b, (0, 1), gid, true);
    let p1 = b.wait_progress(p0 + STEP, LONG).unwrap();
    during(&bed, 0);
    let (c, st) = hop(&bed, &mut b, 0, gid, load.memory, params);
    eprintln!("B -> A: downtime {} ms, total {} ms", st["downtime_ms"], st["total_ms"]);
    check_hop(&bed, &mut b, &c, (1, 0), gid, true);
    c.wait_progress(p1 + STEP, LONG).unwrap();
    // Read before the peer's run ends: once it is gone, the guest's next
    // operations fail, as they should.
    let consoles = [a.console(), b.console(), c.console()];
    assert_qps_running(&c);
    let rep = peer.report();
    for con in &consoles {
        assert_guest_clean(con);
    }
    assert_peer_clean(&rep);
    for w in ["stream", "ring", "table", "atomic"] {
        assert!(rep["workloads"][w]["verified"].as_u64().unwrap() > 0, "{w}: {rep:#}");
    }
    rep
}

#[test]
fn every_workload_across_a_b_a_in_precopy() {
    there_and_back("pvm-aba", PLAIN, json!({"channels": 2}), |_, _| {});
}

/// 16 QPs (4 of each workload) and a 64 MiB RDMA WRITE the guest repeats
/// without end: the switches land in the middle of WRITEs, partly
/// acknowledged, which the restored QP finishes from its oldest
/// unacknowledged PSN; the peer verifies every WRITE whole.
#[test]
fn sixteen_qps_and_a_64_mib_write_across_a_b_a() {
    let load = Load { args: "count=0 qps=16 bigwrite=64M", memory: "256M" };
    let rep = there_and_back("pvm-big", load, json!({"channels": 2}), |_, _| {});
    assert_eq!(rep["qps"], 17, "16 and the big WRITE's: {rep:#}");
    let big = &rep["workloads"]["big"];
    eprintln!("64 MiB WRITEs verified whole: {}", big["verified"]);
    assert!(big["verified"].as_u64().unwrap() > 0, "{rep:#}");
}

#[test]
fn two_hundred_fifty_six_qps_across_a_b_a() {
    let load = Load { args: "count=0 qps=256", memory: "256M" };
    let rep = there_and_back("pvm-q256", load, json!({"channels": 2}), |_, _| {});
    assert_eq!(rep["qps"], 256, "{rep:#}");
}

#[test]
fn across_a_b_a_at_one_percent_loss() {
    there_and_back("pvm-loss", PLAIN, json!({"channels": 2}), |bed, _| {
        for h in 0..3 {
            bed.tb.set_loss(h, 0, 1.0).unwrap();
        }
    });
}

/// The peer's link goes down as the migration starts and comes back a
/// second later: the switch happens while the peer hears nothing.
#[test]
fn the_peers_link_cut_for_a_second_across_the_switch() {
    let bed = Bed::new("pvm-cut");
    let gid = bed.vm_gid(1);
    let mut a = bed.vm_with(0, gid, "count=0", "", &["--keep-after-migrate"]);
    let peer = Peer::start(&bed, &a, &[PEER, &["--duration", "45"]].concat());
    let p0 = a.wait_progress(STEP, LONG).unwrap();
    let b = destination(&bed, 1, gid, "");
    bed.tb.link_down(2, 0).unwrap();
    let cut = Instant::now();
    start_migration(&bed, &a, 1, json!({"channels": 2}));
    let st = wait_end(&a);
    assert_eq!(st["status"], "completed", "{st:#}");
    let switched = cut.elapsed();
    std::thread::sleep(Duration::from_secs(1).saturating_sub(switched));
    bed.tb.link_up(2, 0).unwrap();
    eprintln!("switch {switched:?} after the cut; link down for {:?}", cut.elapsed());
    check_hop(&bed, &mut a, &b, (0, 1), gid, false);
    b.wait_progress(p0 + STEP, LONG).unwrap();
    let console = b.console();
    let rep = peer.report();
    assert_guest_clean(&console);
    assert_peer_clean(&rep);
}

/// The migration stops before its commit (`abort` does it): the VM and its
/// QPs run on the source again, the source kept its GID, and a second
/// migration succeeds.
fn fails_then_succeeds(tag: &str, abort: impl Fn(&Bed, &VmProcess, &mut VmProcess, usize)) {
    let bed = Bed::new(tag);
    let gid = bed.vm_gid(1);
    let mut a = bed.vm_with(0, gid, "count=0", "", &["--keep-after-migrate"]);
    let peer = Peer::start(&bed, &a, &[PEER, &["--duration", "60"]].concat());
    let mut p = a.wait_progress(STEP, LONG).unwrap();
    for attempt in 0..3 {
        let mut b = destination(&bed, 1, gid, "");
        // Slow and never converging: the failure lands in the rounds.
        start_migration(&bed, &a, 1, json!({"channels": 2, "max_bandwidth": 2_000_000, "downtime_ms": 1, "auto_converge": false}));
        abort(&bed, &a, &mut b, attempt);
        let st = wait_end(&a);
        assert_ne!(st["status"], "completed", "{st:#}");
        assert!(bed.holds(0, gid) && !bed.holds(1, gid), "the GID stays on the source");
        let d = pvrdma(&a);
        assert_eq!(d["tracing"], false, "traces end with the migration: {d:#}");
        assert_qps_running(&a);
        p = a.wait_progress(p + STEP, LONG).unwrap();
        drop(b);
    }
    let (mut b, _) = hop(&bed, &mut a, 1, gid, "64M", json!({"channels": 2}));
    check_hop(&bed, &mut a, &b, (0, 1), gid, true);
    b.wait_progress(p + STEP, LONG).unwrap();
    let consoles = [a.console(), b.console()];
    let rep = peer.report();
    for con in &consoles {
        assert_guest_clean(con);
    }
    assert_peer_clean(&rep);
    b.kill();
}

#[test]
fn cancel_resumes_the_qps_on_the_source() {
    fails_then_succeeds("pvm-cancel", |_, a, _, attempt| {
        std::thread::sleep(Duration::from_millis(300 + 700 * attempt as u64));
        a.exec("migrate-cancel", json!({})).unwrap();
    });
}

#[test]
fn a_killed_destination_leaves_the_vm_running_on_the_source() {
    fails_then_succeeds("pvm-kill", |_, a, b, attempt| {
        match attempt {
            // While the first pass runs, and in a later round.
            0 => std::thread::sleep(Duration::from_millis(200)),
            1 => std::thread::sleep(Duration::from_millis(1500)),
            // As soon as the source is past its first round.
            _ => wait_for("a second round", LONG, || migration(a)["rounds"].as_u64().unwrap_or(0) >= 2),
        }
        b.kill();
    });
}

/// A destination whose device cannot take the state (here: a device of
/// another GID) refuses it: the destination never runs, never claims the
/// GID, and the source resumes its QPs.
#[test]
fn a_device_state_the_destination_cannot_take_is_refused() {
    fails_then_succeeds("pvm-refuse", |bed, a, b, _| {
        // Replace the waiting destination by one with another GID.
        b.kill();
        *b = destination(bed, 1, bed.vm_gid(2), "");
        let _ = a.exec("migrate-cancel", json!({}));
        wait_end(a);
        start_migration(bed, a, 1, json!({"channels": 2}));
        let st = wait_end(a);
        assert_eq!(st["status"], "failed", "{st:#}");
        assert!(st["error"].as_str().unwrap_or("").contains("GID"), "{st:#}");
        assert!(b.wait_exit(Duration::from_secs(20)).unwrap() != Some(0), "the destination exits, never having run");
    });
}

/// Negative control: without write traces the pages the peer writes during
/// the rounds are not sent again, and the guest's checks on the
/// destination see the old contents.
#[test]
fn without_traces_the_guest_sees_the_peers_lost_writes() {
    let bed = Bed::new("pvm-notr");
    let gid = bed.vm_gid(1);
    let a = bed.vm_with(0, gid, "count=0", ",testing=no-traces", &["--keep-after-migrate"]);
    let peer = Peer::start(&bed, &a, &[PEER, &["--duration", "40"]].concat());
    let p0 = a.wait_progress(STEP, LONG).unwrap();
    let b = destination(&bed, 1, gid, "");
    start_migration(&bed, &a, 1, json!({"channels": 2}));
    let st = wait_end(&a);
    assert_eq!(st["status"], "completed", "{st:#}");
    let d = pvrdma(&a);
    assert_eq!(d["counters"]["traced_pages"], 0, "{d:#}");
    let t0 = Instant::now();
    let detected = loop {
        let c = b.console();
        if c.contains("VIOLATION") || c.contains("FAIL") {
            eprintln!(
                "the guest on the destination: {}",
                c.lines().filter(|l| l.contains("VIOLATION") || l.contains("FAIL")).take(3).collect::<Vec<_>>().join(" / ")
            );
            break true;
        }
        if t0.elapsed() > Duration::from_secs(30) || b.status().unwrap()["guest_progress"].as_u64().unwrap_or(0) > p0 + 20 * STEP {
            break false;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    drop(peer);
    assert!(detected, "the guest's checks should have seen lost writes; console:\n{}", b.console());
}

/// Negative control: a destination that gives the QPs and MRs other IDs
/// (as without identity namespaces) breaks the peer's operations.
#[test]
fn with_ids_that_change_the_peers_operations_fail() {
    let bed = Bed::new("pvm-ids");
    let gid = bed.vm_gid(1);
    let a = bed.vm_with(0, gid, "count=0", "", &["--keep-after-migrate"]);
    let peer = Peer::start(&bed, &a, &["--timeout", "14", "--duration", "40"]);
    a.wait_progress(STEP, LONG).unwrap();
    let b = destination(&bed, 1, gid, ",testing=shift-ids");
    start_migration(&bed, &a, 1, json!({"channels": 2}));
    let st = wait_end(&a);
    assert_eq!(st["status"], "completed", "{st:#}");
    let rep = peer.report();
    eprintln!("peer report: {rep}");
    assert_eq!(rep["ok"], false, "the peer should have failed: {rep:#}");
    drop(b);
}
