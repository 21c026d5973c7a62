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
use serde_json::json;
use std::time::{Duration, Instant};
use Mode::*;

#[test]
fn every_workload_across_a_b_a_in_precopy() {
    there_and_back("pvm-aba", PLAIN, [Precopy, Precopy], |_, _| {});
}

/// 16 QPs (4 of each workload) and a 64 MiB RDMA WRITE the guest repeats
/// without end: the switches land in the middle of WRITEs, partly
/// acknowledged, which the restored QP finishes from its oldest
/// unacknowledged PSN; the peer verifies every WRITE whole.
#[test]
fn sixteen_qps_and_a_64_mib_write_across_a_b_a() {
    let load = Load { args: "count=0 qps=16 bigwrite=64M", memory: "256M", max_bandwidth: 0 };
    let rep = there_and_back("pvm-big", load, [Precopy, Precopy], |_, _| {});
    assert_eq!(rep["qps"], 17, "16 and the big WRITE's: {rep:#}");
    let big = &rep["workloads"]["big"];
    eprintln!("64 MiB WRITEs verified whole: {}", big["verified"]);
    assert!(big["verified"].as_u64().unwrap() > 0, "{rep:#}");
}

#[test]
fn two_hundred_fifty_six_qps_across_a_b_a() {
    let load = Load { args: "count=0 qps=256", memory: "256M", max_bandwidth: 0 };
    let rep = there_and_back("pvm-q256", load, [Precopy, Precopy], |_, _| {});
    assert_eq!(rep["qps"], 256, "{rep:#}");
}

#[test]
fn across_a_b_a_at_one_percent_loss() {
    there_and_back("pvm-loss", PLAIN, [Precopy, Precopy], |bed, _| {
        for h in 0..3 {
            bed.tb.set_loss(h, 0, 1.0).unwrap();
        }
    });
}

/// The peer's link goes down as the migration starts and comes back a
/// second later: the switch happens while the peer hears nothing.
#[test]
fn the_peers_link_cut_for_a_second_across_the_switch() {
    link_cut_across_the_switch("pvm-cut", &[Precopy]);
}

/// Three migrations cancelled at different times in their rounds, then one
/// that succeeds.
#[test]
fn cancel_resumes_the_qps_on_the_source() {
    fails_then_succeeds("pvm-cancel", Precopy, "", 3, |bed, a, _, i| {
        start_slow(bed, a, 1, Precopy);
        std::thread::sleep(Duration::from_millis(300 + 700 * i as u64));
        a.exec("migrate-cancel", json!({})).unwrap();
    });
}

/// The destination killed while the first pass runs, later, and after the
/// second round; then a migration that succeeds.
#[test]
fn a_killed_destination_leaves_the_vm_running_on_the_source() {
    fails_then_succeeds("pvm-kill", Precopy, "", 3, |bed, a, b, i| {
        start_slow(bed, a, 1, Precopy);
        match i {
            0 => std::thread::sleep(Duration::from_millis(200)),
            1 => std::thread::sleep(Duration::from_millis(1500)),
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
    fails_then_succeeds("pvm-refuse", Precopy, "", 3, |bed, a, b, _| {
        // Replace the waiting destination by one with another GID.
        b.kill();
        *b = destination(bed, 1, bed.vm_gid(2), &PLAIN, "");
        start_migration(bed, a, 1, params(Precopy, &PLAIN));
        let st = wait_end(a);
        assert_eq!(st["status"], "failed", "{st:#}");
        assert!(st["error"].as_str().unwrap_or("").contains("GID"), "{st:#}");
        assert!(b.wait_exit(Duration::from_secs(20)).unwrap() != Some(0), "the destination exits, never having run");
    });
}

/// A device state with damaged bytes (`testing=corrupt-state` on the
/// source flips bytes of the next state it saves, under the section's
/// checksum, so they reach the destination's device): the destination
/// refuses it and exits without running, the source resumes its QPs, the
/// peer sees no error, and the next migration (a sound state) succeeds.
#[test]
fn a_device_state_with_damaged_bytes_is_refused() {
    fails_then_succeeds("pvm-damage", Precopy, ",testing=corrupt-state", 1, |bed, a, b, _| {
        start_migration(bed, a, 1, params(Precopy, &PLAIN));
        let st = wait_end(a);
        assert_eq!(st["status"], "failed", "{st:#}");
        eprintln!("the source's report: {}", st["error"]);
        assert!(st["error"].as_str().unwrap_or("").contains("pvrdma0"), "the device's state is what was refused: {st:#}");
        assert!(b.wait_exit(Duration::from_secs(20)).unwrap() != Some(0), "the destination exits, never having run");
    });
}

/// Objects the source changes after its early section are rebuilt exactly
/// (`pvrdma_bed::runs::objects_changed_after_the_early_section`).
#[test]
fn objects_changed_after_the_early_section_are_rebuilt_exactly() {
    objects_changed_after_the_early_section("pvm-churn", Precopy);
}

/// A destination that does not build early device sections (an older
/// build; here `TRANSIT_NO_EARLY_STATE=1`, which makes it answer the
/// source's hello as such a build does) still takes the VM: the source
/// sends no early section and the whole device state at the switch, and
/// every workload goes on.
#[test]
fn a_destination_without_early_sections_gets_the_whole_state() {
    let bed = Bed::new("pvm-noearly");
    let gid = bed.vm_gid(1);
    let mut a = bed.vm_with(0, gid, PLAIN.args, "", &["--keep-after-migrate"]);
    let mut peer = Peer::start(&bed, &a, PEER);
    let p0 = a.wait_progress(STEP, LONG).unwrap();
    let incoming = ["--incoming", "tcp:0.0.0.0:4444", "--keep-after-migrate"];
    let b = bed.vm_env(1, gid, PLAIN.memory, PLAIN.args, "", &incoming, &[("TRANSIT_NO_EARLY_STATE", "1")]);
    start_traced_precopy(&bed, &a, 1, &PLAIN);
    let st = finish_hop(&a, &b, Precopy);
    assert_eq!(st["early_state_bytes"], 0, "no early section went: {st:#}");
    let sw = &pvrdma(&b)["switch"];
    eprintln!("the destination's switch: {sw}");
    assert_eq!(sw["delta"], false, "the whole state came: {sw:#}");
    assert_eq!(sw["early_built"], json!([0, 0, 0, 0]), "nothing was built ahead: {sw:#}");
    check_hop(&bed, &mut a, &b, (0, 1), gid, true);
    b.wait_progress(p0 + STEP, LONG).unwrap();
    peer.wait_progress(PEER_STEP, LONG);
    let consoles = [a.console(), b.console()];
    assert_qps_running(&b);
    let rep = peer.stop();
    assert_run_clean(&consoles, &rep);
}

/// Negative control: without write traces the pages the peer writes during
/// the rounds are not sent again, and the guest's checks on the
/// destination see the old contents. `testing=no-traces` also makes the
/// source's pause wait, vCPUs stopped, until the peer filled a receive
/// queue: messages written after every RAM round that the guest reads only
/// on the destination, so a loss is there to be seen on every run.
#[test]
fn without_traces_the_guest_sees_the_peers_lost_writes() {
    let bed = Bed::new("pvm-notr");
    let gid = bed.vm_gid(1);
    let a = bed.vm_with(0, gid, "count=0", ",testing=no-traces", &["--keep-after-migrate"]);
    let peer = Peer::start(&bed, &a, PEER);
    let p0 = a.wait_progress(STEP, LONG).unwrap();
    let b = destination(&bed, 1, gid, &PLAIN, "");
    start_migration(&bed, &a, 1, params(Precopy, &PLAIN));
    let st = wait_end(&a);
    if st["status"] == "failed" {
        // An untraced write can also land in a page while RAM sends it:
        // its checksum then fails on the destination and nothing marks it
        // dirty to send again, so the destination refuses the stream. The
        // loss is detected then too, by the migration; the source runs on.
        let err = st["error"].as_str().unwrap_or("");
        assert!(err.contains("arrived damaged"), "only a damaged page may fail it: {st:#}");
        eprintln!("the destination saw the lost write itself: {err}");
        wait_for("the source's device running again", Duration::from_secs(30), || pvrdma(&a)["paused"] == false);
        assert_qps_running(&a);
        drop(peer);
        return;
    }
    assert_eq!(st["status"], "completed", "{st:#}");
    let d = pvrdma(&a);
    assert_eq!(d["counters"]["traced_pages"], 0, "{d:#}");
    // The loss is made, not waited for: the source's pause held until the
    // peer had filled a receive queue the guest could no longer read
    // (devices/src/pvrdma/negative.rs).
    let held =
        d["switch"]["phases"].as_array().is_some_and(|p| p.iter().any(|x| x[0] == "negative control: a peer filled a receive queue"));
    assert!(held, "the pause did not see the peer fill a receive queue: {d:#}");
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
    // The peer runs until its first error completion (or 60 s without
    // progress), not for a set time: a set time could end before a slow
    // guest gets to the move, and the peer would report success.
    let peer = Peer::start(&bed, &a, &["--timeout", "14", "--duration", "300"]);
    a.wait_progress(STEP, LONG).unwrap();
    let b = destination(&bed, 1, gid, &PLAIN, ",testing=shift-ids");
    start_migration(&bed, &a, 1, params(Precopy, &PLAIN));
    let st = wait_end(&a);
    assert_eq!(st["status"], "completed", "{st:#}");
    let rep = peer.report();
    eprintln!("peer report: {rep}");
    assert_eq!(rep["ok"], false, "the peer should have failed: {rep:#}");
    drop(b);
}

/// nftables rules in table `inet pvhalf` of host `h`, replacing earlier
/// ones (and their counters) in one transaction.
fn nft_rules(h: &testbed::Host, chains: &str) {
    h.sh(&format!("nft -f - <<'EOF'\nadd table inet pvhalf\ndelete table inet pvhalf\ntable inet pvhalf {{\n{chains}\n}}\nEOF")).unwrap();
}

fn nft_counter(h: &testbed::Host, name: &str) -> u64 {
    let out = h.sh(&format!("nft list counter inet pvhalf {name}")).unwrap();
    let w: Vec<&str> = out.split_whitespace().collect();
    w.iter().position(|x| *x == "packets").and_then(|i| w[i + 1].parse().ok()).unwrap_or_else(|| panic!("counter {name}: {out}"))
}

/// The number after `key=` in a line of IDs.
fn id(line: &str, key: &str) -> u32 {
    let v = line.split_whitespace().find_map(|w| w.strip_prefix(&format!("{key}="))).unwrap_or_else(|| panic!("no {key} in {line:?}"));
    match v.strip_prefix("0x") {
        Some(h) => u32::from_str_radix(h, 16).unwrap(),
        None => v.parse().unwrap(),
    }
}

/// A hop in every mode, each starting at the moment the guest's 64 MiB
/// RDMA WRITE is exactly half acknowledged, made with nftables on the
/// peer's host (rnicd without GSO, so the rules see each packet's own BTH):
///
/// 1. a rule counts the peer's SEND that ends a round (it verified the
///    whole WRITE); once it moves, the next WRITE has not passed its half;
/// 2. then the guest's WRITE packets of the second half of every round
///    (PSN ranges from the guest's `big.psn`) are dropped before the
///    peer's rnicd, whose ACK timer acknowledges the last packet of the
///    first half; a counter sees that ACK leave. The guest's QP then holds
///    exactly half the WRITE unacknowledged and resends it in vain;
/// 3. the migration starts; once the VM runs on the destination the drop
///    goes, the restored QP resends from the WRITE's middle, and the peer
///    verifies the whole WRITE (every word: a missing part reads as the
///    zeros it cleared) and SENDs the round back.
///
/// The peer's report then shows every big WRITE once and in order, no
/// error completion; the guest's checks hold on every VM.
#[test]
fn a_64_mib_write_half_acknowledged_at_each_switch() {
    let bed = Bed::with_rnicd_args("pvm-half", &["--no-gso"]);
    let h = bed.tb.host(2);
    let gid = bed.vm_gid(1);
    let load = Load { args: "count=0 bigwrite=64M", memory: "256M", max_bandwidth: 0 };
    let mut src = bed.vm_sized(0, gid, load.memory, load.args, "", &["--keep-after-migrate"]);
    let ids = guest_ids(&src);
    let mut peer = Peer::start(&bed, &src, PEER);
    let (vm_qpn, first_psn, peer_qpn) = (id(&ids, "big.qpn"), id(&ids, "big.psn") & 0xff_ffff, id(&peer.line, "big.qpn"));
    // Packets per WRITE at the guest's path MTU (1024 bytes).
    let per_round = id(&ids, "big.len") / 1024;
    assert_eq!((1 << 24) % per_round, 0, "rounds tile the PSN space");
    let half = per_round / 2;
    let (mut second_halves, mut half_acks) = (Vec::new(), Vec::new());
    for r in 0..(1 << 24) / per_round {
        let mid = (first_psn + r * per_round + half) & 0xff_ffff;
        let end = mid + (per_round - half) - 1;
        if end > 0xff_ffff {
            second_halves.push(format!("{mid:#x}-0xffffff"));
            second_halves.push(format!("0x0-{:#x}", end & 0xff_ffff));
        } else {
            second_halves.push(format!("{mid:#x}-{end:#x}"));
        }
        half_acks.push(format!("{:#x}", (mid + 0xff_ffff) & 0xff_ffff));
    }
    let (udp, bth_qpn, bth_psn, opcode) = ("udp dport 4791", "@th,104,24", "@th,136,24", "@th,64,8");
    // The peer's SEND of a round's number (SEND only: 0x04) to the guest.
    let round_end = format!(
        "counter round_end {{ }}\nchain out {{ type filter hook output priority -10; policy accept;\n\
           {udp} {bth_qpn} {vm_qpn:#x} {opcode} 0x04 counter name \"round_end\"\n}}"
    );
    let hold = format!(
        "counter held {{ }}\ncounter half_ack {{ }}\n\
         chain in {{ type filter hook input priority -10; policy accept;\n\
           {udp} {bth_qpn} {peer_qpn:#x} {opcode} 0x06-0x0b {bth_psn} {{ {} }} counter name \"held\" drop\n}}\n\
         chain out {{ type filter hook output priority -10; policy accept;\n\
           {udp} {bth_qpn} {vm_qpn:#x} {opcode} 0x11 @th,160,8 & 0xe0 == 0x00 {bth_psn} {{ {} }} counter name \"half_ack\"\n}}",
        second_halves.join(", "),
        half_acks.join(", ")
    );
    let mut p = src.wait_progress(STEP, LONG).unwrap();
    let (mut consoles, mut from) = (Vec::new(), 0);
    for mode in [Precopy, Postcopy, Hybrid] {
        let to = 1 - from;
        let dst = destination(&bed, to, gid, &load, "");
        nft_rules(h, &round_end);
        wait_for("a big WRITE verified by the peer", LONG, || nft_counter(h, "round_end") > 0);
        nft_rules(h, &hold);
        // Rules that land after this WRITE's half hold the next one's.
        wait_for("the big WRITE half acknowledged", LONG, || nft_counter(h, "half_ack") > 0);
        let held = nft_counter(h, "held");
        start_migration(&bed, &src, to, params(mode, &load));
        let st = wait_switched(&src);
        let held_then = nft_counter(h, "held");
        // Keep counting the peer's verified rounds, now from the new host.
        nft_rules(h, &round_end);
        eprintln!("{}: switched ({}) with the WRITE half acknowledged; second-half packets dropped: {held} before the migration, {held_then} at the switch", mode.name(), st["status"]);
        assert_ne!(st["status"], "failed", "{st:#}");
        finish_hop(&src, &dst, mode);
        check_hop(&bed, &mut src, &dst, (from, to), gid, mode == Precopy);
        wait_for("the held WRITE finished from the new host", LONG, || nft_counter(h, "round_end") > 0);
        p = dst.wait_progress(p + STEP, LONG).unwrap();
        consoles.push(src.console());
        (src, from) = (dst, to);
    }
    peer.wait_progress(PEER_STEP, LONG);
    consoles.push(src.console());
    assert_qps_running(&src);
    let rep = peer.stop();
    assert_run_clean(&consoles, &rep);
    let big = &rep["workloads"]["big"];
    eprintln!("64 MiB WRITEs verified whole: {}", big["verified"]);
    assert!(big["verified"].as_u64().unwrap() >= 3, "{rep:#}");
}
