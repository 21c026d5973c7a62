//! Postcopy and hybrid migration of a VM with a PVRDMA device while
//! `transit rdma peer` on testbed host 2 runs every workload against it
//! (real rnicd, vmm and peer processes; VMs on hosts 0 and 1). The
//! destination runs before its pages are all there; its rnicd, joined as a
//! RAM client by the vmm itself, waits for missing pages instead of moving
//! zeros or stale bytes between guest RAM and the peer. Every workload is
//! checked on both sides across A -> B -> A: exactly once, in order, no
//! error completion, no atomic twice.

mod pvrdma_bed;

use pvrdma_bed::*;
use serde_json::{json, Value};
use std::net::Ipv4Addr;
use std::time::Duration;
use vmm::testing::{transit_bin, unique_name, VmProcess};

/// What runs in the VM and how the pages move.
struct Run {
    memory: &'static str,
    /// The firmware's workload arguments.
    args: &'static str,
    /// The migration's rate limit (0: none).
    max_bandwidth: u64,
}

/// Every workload, endless, in a 64 MiB VM; 4 MB/s: the pages come over
/// long enough for the workloads to run on missing ones.
const WORKLOADS: Run = Run { memory: "64M", args: "count=0", max_bandwidth: 4_000_000 };
/// The same beside a 64 MiB RDMA WRITE from the guest, round after round:
/// the WRITE's source pages are migrated while rnicd sends them.
const BIG_WRITE: Run = Run { memory: "256M", args: "count=0 bigwrite=64M", max_bandwidth: 0 };

/// A VM on host `h` for `run`, with `extra` on its command line.
fn vm(bed: &Bed, h: usize, gid: Ipv4Addr, run: &Run, extra: &[&str]) -> VmProcess {
    let name = unique_name("pvrdma");
    let (spec, fw_args) = (format!("gid={gid}"), format!("gid={gid} {}", run.args));
    let mut all = vec!["vm", "run", "--name", &name, "--memory", run.memory, "--workload", "pvrdma", "--args", &fw_args, "--pvrdma", &spec];
    all.extend_from_slice(extra);
    VmProcess::start(bed.tb.host(h).command(transit_bin()), &name, &all).unwrap()
}

/// Moves the VM from `src` to a new destination on host `to` in `mode`;
/// the destination and the source's final migration report.
fn hop(bed: &Bed, src: &mut VmProcess, to: usize, gid: Ipv4Addr, mode: &str, run: &Run) -> (VmProcess, Value) {
    let dst = vm(bed, to, gid, run, &["--incoming", "tcp:0.0.0.0:4444", "--keep-after-migrate"]);
    let uri = format!("tcp:{}:4444", bed.tb.host(to).addr(0));
    // A downtime target of 0 never fits: hybrid switches to postcopy after
    // its first pass instead of finishing in precopy.
    let mut params = json!({"uri": uri, "mode": mode, "channels": 2, "downtime_ms": 0});
    if run.max_bandwidth > 0 {
        params["max_bandwidth"] = json!(run.max_bandwidth);
    }
    src.exec("migrate", params).unwrap();
    let mut st = Value::Null;
    wait_for("the migration to end", LONG, || {
        st = migration(src);
        matches!(st["status"].as_str(), Some("completed" | "failed" | "cancelled"))
    });
    assert_eq!(st["status"], "completed", "{st:#}\nsource console:\n{}", src.console());
    assert_eq!(st["mode"], mode, "{st:#}");
    assert!(st["postcopy_ms"].as_f64().unwrap() > 0.0, "the VM ran on the destination before all pages were in: {st:#}");
    // The destination's rnicd served its faults as a RAM client.
    assert_eq!(st["ram_clients"], 1, "{st:#}");
    wait_for("the destination to run", LONG, || dst.status().unwrap()["running"] == true);
    (dst, st)
}

/// After a hop: the GID is on the destination's host only, the source's
/// device holds nothing, the destination's QPs run; the source quits.
fn check_hop(bed: &Bed, src: &mut VmProcess, dst: &VmProcess, from: usize, to: usize, gid: Ipv4Addr) {
    assert!(bed.holds(to, gid) && !bed.holds(from, gid), "the GID must be on host {to} only");
    // The source closes its namespace when its main loop sees the
    // migration completed, which may be just after query-migrate says so.
    wait_for("the source's namespace to hold nothing", LONG, || pvrdma(src)["objects"]["qps"] == 0);
    assert_qps_running(dst);
    src.exec("quit", json!({})).unwrap();
    src.wait_exit(Duration::from_secs(20)).unwrap();
}

fn there_and_back(tag: &str, mode: &str, run: &Run) {
    let bed = Bed::new(tag);
    let gid = bed.vm_gid(1);
    let mut a = vm(&bed, 0, gid, run, &["--keep-after-migrate"]);
    let peer = Peer::start(&bed, &a, &[PEER, &["--duration", "40"]].concat());
    let p0 = a.wait_progress(STEP, LONG).unwrap();
    let (mut b, st) = hop(&bed, &mut a, 1, gid, mode, run);
    eprintln!("A -> B ({mode}): downtime {} ms, postcopy {} ms, faults {}", st["downtime_ms"], st["postcopy_ms"], st["faults"]);
    check_hop(&bed, &mut a, &b, 0, 1, gid);
    let p1 = b.wait_progress(p0 + STEP, LONG).unwrap();
    let (c, st) = hop(&bed, &mut b, 0, gid, mode, run);
    eprintln!("B -> A ({mode}): downtime {} ms, postcopy {} ms, faults {}", st["downtime_ms"], st["postcopy_ms"], st["faults"]);
    check_hop(&bed, &mut b, &c, 1, 0, gid);
    c.wait_progress(p1 + STEP, LONG).unwrap();
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
    if run.args.contains("bigwrite") {
        assert!(rep["workloads"]["big"]["verified"].as_u64().unwrap() > 0, "{rep:#}");
    }
}

#[test]
fn every_workload_across_a_b_a_in_postcopy() {
    there_and_back("pvm-pc", "postcopy", &WORKLOADS);
}

#[test]
fn every_workload_across_a_b_a_in_hybrid() {
    there_and_back("pvm-hy", "hybrid", &WORKLOADS);
}

#[test]
fn a_big_write_across_a_b_a_in_postcopy() {
    there_and_back("pvm-pcbig", "postcopy", &BIG_WRITE);
}

#[test]
fn a_big_write_across_a_b_a_in_hybrid() {
    there_and_back("pvm-hybig", "hybrid", &BIG_WRITE);
}
