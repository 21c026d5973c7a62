//! Postcopy and hybrid migration of a VM with a PVRDMA device while
//! `transit rdma peer` on testbed host 2 runs every workload against it
//! (real rnicd, vmm and peer processes; VMs on hosts 0 and 1). The
//! destination runs before its pages are all there; its rnicd, joined as a
//! RAM client by the vmm itself, waits for missing pages instead of moving
//! zeros or stale bytes between guest RAM and the peer. Every workload is
//! checked on both sides across A -> B -> A: exactly once, in order, no
//! error completion, no atomic twice.
//!
//! The bodies are the precopy tests' (`pvrdma_bed`), run in these modes;
//! where a test moves the VM twice, the first hop is in one mode and the
//! second in the other, so both are shown without running everything twice.

mod pvrdma_bed;

use pvrdma_bed::*;
use serde_json::json;
use std::time::Duration;
use Mode::*;

/// Every workload, endless, in a 64 MiB VM; 4 MB/s: the pages come over
/// long enough for the workloads to run on missing ones.
const WORKLOADS: Load = Load { args: "count=0", memory: "64M", max_bandwidth: 4_000_000 };
/// The same beside a 64 MiB RDMA WRITE from the guest, round after round:
/// the WRITE's source pages are migrated while rnicd sends them.
const BIG_WRITE: Load = Load { args: "count=0 bigwrite=64M", memory: "256M", max_bandwidth: 0 };

#[test]
fn every_workload_across_a_b_a_in_postcopy() {
    there_and_back("pvm-pc", WORKLOADS, [Postcopy, Postcopy], |_, _| {});
}

#[test]
fn every_workload_across_a_b_a_in_hybrid() {
    there_and_back("pvm-hy", WORKLOADS, [Hybrid, Hybrid], |_, _| {});
}

#[test]
fn a_big_write_across_a_b_a_in_postcopy() {
    let rep = there_and_back("pvm-pcbig", BIG_WRITE, [Postcopy, Postcopy], |_, _| {});
    assert!(rep["workloads"]["big"]["verified"].as_u64().unwrap() > 0, "{rep:#}");
}

#[test]
fn a_big_write_across_a_b_a_in_hybrid() {
    let rep = there_and_back("pvm-hybig", BIG_WRITE, [Hybrid, Hybrid], |_, _| {});
    assert!(rep["workloads"]["big"]["verified"].as_u64().unwrap() > 0, "{rep:#}");
}

/// 16 QPs (4 of each workload) and the endless 64 MiB WRITE: A -> B in
/// hybrid, B -> A in postcopy.
#[test]
fn sixteen_qps_and_a_64_mib_write_in_hybrid_then_postcopy() {
    let load = Load { args: "count=0 qps=16 bigwrite=64M", memory: "256M", max_bandwidth: 0 };
    let rep = there_and_back("pvm-pc16", load, [Hybrid, Postcopy], |_, _| {});
    assert_eq!(rep["qps"], 17, "16 and the big WRITE's: {rep:#}");
    assert!(rep["workloads"]["big"]["verified"].as_u64().unwrap() > 0, "{rep:#}");
}

/// 256 QPs (64 of each workload): A -> B in postcopy, B -> A in hybrid.
#[test]
fn two_hundred_fifty_six_qps_in_postcopy_then_hybrid() {
    let load = Load { args: "count=0 qps=256", memory: "256M", max_bandwidth: 0 };
    let rep = there_and_back("pvm-pc256", load, [Postcopy, Hybrid], |_, _| {});
    assert_eq!(rep["qps"], 256, "{rep:#}");
}

/// 1% loss on all three links (the urgent page requests too): A -> B in
/// postcopy, B -> A in hybrid, the pages at 16 MB/s.
#[test]
fn across_a_b_a_at_one_percent_loss_in_postcopy_then_hybrid() {
    let load = Load { max_bandwidth: 16_000_000, ..PLAIN };
    there_and_back("pvm-pcloss", load, [Postcopy, Hybrid], |bed, _| {
        for h in 0..3 {
            bed.tb.set_loss(h, 0, 1.0).unwrap();
        }
    });
}

/// The peer's link is down from each migration's start for a second, or
/// until the VM runs on the destination: A -> B in postcopy, B -> A in
/// hybrid.
#[test]
fn the_peers_link_cut_across_the_switch_in_postcopy_then_hybrid() {
    link_cut_across_the_switch("pvm-pccut", &[Postcopy, Hybrid]);
}

/// Before hybrid's switch (during its first pass) a migration cancelled,
/// then one whose destination is killed early, then one whose destination
/// is killed after the dirty-rate check: after each the VM and its QPs run
/// on the source again; then a hybrid migration succeeds. (Pure postcopy
/// switches as soon as the destination is ready: its only time before the
/// switch is the set-up. The precopy tests run each failure three times.)
#[test]
fn cancel_and_killed_destinations_before_the_hybrid_switch_leave_the_vm_on_the_source() {
    fails_then_succeeds("pvm-hyfail", Hybrid, "", 3, |bed, a, b, i| {
        start_slow(bed, a, 1, Hybrid);
        std::thread::sleep(Duration::from_millis([700, 1500, 5000][i]));
        let st = migration(a);
        assert!(matches!(st["status"].as_str(), Some("setup" | "active")), "still before the switch: {st:#}");
        match i {
            0 => drop(a.exec("migrate-cancel", json!({})).unwrap()),
            _ => b.kill(),
        }
    });
}

/// The destination killed after the postcopy switch: the VM ran there, so
/// it died with it (docs/migration.md, "When postcopy breaks"). What is
/// promised: the source says so (`postcopy-paused`, committed, still
/// holding the missing pages) and never runs the VM again (`cont` is
/// refused), its device stays paused (its QPs never resume on a host that
/// gave the VM away), and no host answers for the GID: the source gave it
/// up at the commit, and the destination's rnicd let it go with the dead
/// vmm's namespace. The peer's operations then time out, as for any dead
/// host.
#[test]
fn a_destination_killed_after_the_postcopy_switch_leaves_the_source_paused() {
    let bed = Bed::new("pvm-pckill");
    let gid = bed.vm_gid(1);
    let mut a = bed.vm_sized(0, gid, WORKLOADS.memory, WORKLOADS.args, "", &["--keep-after-migrate"]);
    let peer = Peer::start(&bed, &a, PEER);
    a.wait_progress(STEP, LONG).unwrap();
    // 50 kB/s: about 10 s of pages (mostly zero pages, ~30 bytes each on
    // the wire) still to come when the destination dies.
    let load = Load { max_bandwidth: 50_000, ..WORKLOADS };
    let mut b = destination(&bed, 1, gid, &load, "");
    start_migration(&bed, &a, 1, params(Postcopy, &load));
    let st = wait_switched(&a);
    assert_eq!(st["status"], "postcopy-active", "{st:#}");
    wait_for("the destination to run", LONG, || b.status().unwrap()["running"] == true);
    wait_for("the GID on the destination's host only", LONG, || bed.holds(1, gid) && !bed.holds(0, gid));
    b.kill();
    let mut st = serde_json::Value::Null;
    wait_for("the source to see the destination gone", LONG, || {
        st = migration(&a);
        assert_ne!(st["status"], "completed", "every page was in before the destination died: {st:#}");
        st["status"] == "postcopy-paused"
    });
    eprintln!("the source after the destination died: {st}");
    assert_eq!(st["committed"], true, "{st:#}");
    assert!(st["error"].as_str().unwrap_or("").contains("pages"), "it says it holds the missing pages: {st:#}");
    assert_eq!(a.status().unwrap()["running"], false);
    assert!(a.exec("cont", json!({})).is_err(), "the source never runs the VM again");
    let d = pvrdma(&a);
    assert_eq!(d["paused"], true, "the source's QPs stay suspended: {d:#}");
    wait_for("no host to answer for the GID", LONG, || !bed.holds(0, gid) && !bed.holds(1, gid));
    drop(peer);
    a.exec("quit", json!({})).unwrap();
    a.wait_exit(Duration::from_secs(20)).unwrap();
}

/// Postcopy has an early device section too: sent while the VM still runs
/// on the source, built by the destination before the switch, so that
/// its PDs, MRs, CQs and QPs are not made inside the downtime. Objects
/// the source replaces after it (`testing=churn-early`) are rebuilt
/// exactly at the switch, as in precopy.
#[test]
fn objects_changed_after_the_early_section_are_rebuilt_exactly_in_postcopy() {
    objects_changed_after_the_early_section("pvm-pcchurn", Postcopy);
}
