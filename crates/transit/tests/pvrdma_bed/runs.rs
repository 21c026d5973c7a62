//! Test bodies that `pvrdma_migrate` and `pvrdma_postcopy` run in their
//! own modes: the peer's link cut across the switch, migrations that
//! fail before their commit then one that succeeds, and objects changed
//! after the early device section.

use super::*;
use serde_json::json;
use std::time::{Duration, Instant};
use vmm::testing::VmProcess;

/// Hops between hosts 0 and 1, one per mode in `modes`; before each the
/// peer's link goes down, and it comes back one second later, or once the
/// VM runs on the destination if that is later: the switch happens while
/// the peer hears nothing.
pub fn link_cut_across_the_switch(tag: &str, modes: &[Mode]) {
    let bed = Bed::new(tag);
    let gid = bed.vm_gid(1);
    let load = PLAIN;
    let mut src = bed.vm_sized(0, gid, load.memory, load.args, "", &["--keep-after-migrate"]);
    let mut peer = Peer::start(&bed, &src, PEER);
    let mut p = src.wait_progress(STEP, LONG).unwrap();
    let mut consoles = Vec::new();
    let mut from = 0;
    for &mode in modes {
        let to = 1 - from;
        let dst = destination(&bed, to, gid, &load, "");
        bed.tb.link_down(2, 0).unwrap();
        let cut = Instant::now();
        start_migration(&bed, &src, to, params(mode, &load));
        wait_switched(&src);
        let switched = cut.elapsed();
        std::thread::sleep(Duration::from_secs(1).saturating_sub(switched));
        bed.tb.link_up(2, 0).unwrap();
        eprintln!("{}: switch {switched:?} after the cut; link down for {:?}", mode.name(), cut.elapsed());
        finish_hop(&src, &dst, mode);
        check_hop(&bed, &mut src, &dst, (from, to), gid, false);
        p = dst.wait_progress(p + STEP, LONG).unwrap();
        consoles.push(src.console());
        (src, from) = (dst, to);
    }
    peer.wait_progress(PEER_STEP, LONG);
    consoles.push(src.console());
    let rep = peer.stop();
    for con in &consoles {
        assert_guest_clean(con);
    }
    assert_peer_clean(&rep);
}

/// Starts a migration in `mode` that stays before its switch for a long
/// while: a precopy at 2 MB/s that never converges (downtime target 1 ms);
/// a hybrid at 50 kB/s, whose first pass then takes about 10 s (the 64 MiB
/// VM is mostly zero pages, about 30 bytes each on the wire) and whose
/// dirty-rate check after the first eighth sees a guest far slower than
/// the link, so it goes on with the pass rather than switch.
pub fn start_slow(bed: &Bed, src: &VmProcess, to: usize, mode: Mode) {
    let mut p = params(mode, &PLAIN);
    if mode == Mode::Precopy {
        p["max_bandwidth"] = json!(2_000_000);
        p["downtime_ms"] = json!(1);
        p["auto_converge"] = json!(false);
    } else {
        p["max_bandwidth"] = json!(50_000);
    }
    start_migration(bed, src, to, p);
}

/// `attempts` migrations from host 0 that fail before their commit
/// (`attempt(bed, source, destination, i)` starts and ends each; the
/// source's device has `spec` added to its spec): after each the VM and its QPs
/// run on the source again, the source kept its GID and stopped its traces.
/// Then a migration in `mode` succeeds, and neither the guest nor the peer
/// saw anything wrong.
pub fn fails_then_succeeds(tag: &str, mode: Mode, spec: &str, attempts: usize, attempt: impl Fn(&Bed, &VmProcess, &mut VmProcess, usize)) {
    let bed = Bed::new(tag);
    let gid = bed.vm_gid(1);
    let mut a = bed.vm_with(0, gid, "count=0", spec, &["--keep-after-migrate"]);
    let mut peer = Peer::start(&bed, &a, PEER);
    let mut p = a.wait_progress(STEP, LONG).unwrap();
    for i in 0..attempts {
        let mut b = destination(&bed, 1, gid, &PLAIN, "");
        attempt(&bed, &a, &mut b, i);
        let st = wait_end(&a);
        assert_ne!(st["status"], "completed", "{st:#}");
        assert!(bed.holds(0, gid) && !bed.holds(1, gid), "the GID stays on the source");
        let d = pvrdma(&a);
        assert_eq!(d["tracing"], false, "traces end with the migration: {d:#}");
        assert_qps_running(&a);
        p = a.wait_progress(p + STEP, LONG).unwrap();
        drop(b);
    }
    let (mut b, _) = hop(&bed, &a, 1, gid, &PLAIN, mode);
    check_hop(&bed, &mut a, &b, (0, 1), gid, mode == Mode::Precopy);
    b.wait_progress(p + STEP, LONG).unwrap();
    peer.wait_progress(PEER_STEP, LONG);
    let consoles = [a.console(), b.console()];
    let rep = peer.stop();
    for con in &consoles {
        assert_guest_clean(con);
    }
    assert_peer_clean(&rep);
    b.kill();
}

/// Objects the source changes after its early section: with
/// `testing=churn-early` the source's device makes a spare MR and QP just
/// before the early section is taken and replaces them just after (same
/// handles, another key and QPN), so one MR and one QP the destination
/// built ahead are stale at the switch. The destination must end with
/// exactly the source's final set: every guest object kept from the
/// early section with its IDs, the stale spares dropped, the new ones made;
/// and the workloads carry on. In every mode the early section goes
/// before the switch (in postcopy while the VM still runs on the source,
/// which waits for the destination to have built it).
pub fn objects_changed_after_the_early_section(tag: &str, mode: Mode) {
    let bed = Bed::new(tag);
    let gid = bed.vm_gid(1);
    let mut a = bed.vm_with(0, gid, "count=0", ",testing=churn-early", &["--keep-after-migrate"]);
    let mut peer = Peer::start(&bed, &a, PEER);
    let p0 = a.wait_progress(STEP, LONG).unwrap();
    let before = pvrdma(&a);
    let b = destination(&bed, 1, gid, &PLAIN, "");
    match mode {
        // Rounds until the peer's writes were traced (check_hop asks).
        Mode::Precopy => start_traced_precopy(&bed, &a, 1, &PLAIN),
        _ => start_migration(&bed, &a, 1, params(mode, &PLAIN)),
    }
    let st = finish_hop(&a, &b, mode);
    assert!(st["early_state_bytes"].as_u64().unwrap() > 0, "the early section went ahead: {st:#}");
    let after = pvrdma(&b);
    let ids = |v: &serde_json::Value, what: &str, id: &str| -> std::collections::BTreeMap<u64, u64> {
        v[what].as_array().unwrap().iter().map(|o| (o["handle"].as_u64().unwrap(), o[id].as_u64().unwrap())).collect()
    };
    for (what, id) in [("qps", "qpn"), ("mrs", "key")] {
        let (was, now) = (ids(&before, what, id), ids(&after, what, id));
        for (h, v) in &was {
            assert_eq!(now.get(h), Some(v), "{what} {h} keeps its {id}: before {was:?}, after {now:?}");
        }
        let spares: Vec<_> = now.iter().filter(|(h, _)| !was.contains_key(h)).collect();
        assert_eq!(spares.len(), 1, "the guest's {what} and the last spare, nothing else: before {was:?}, after {now:?}");
        assert!(!was.values().any(|v| v == spares[0].1), "the spare's {id} is its own");
    }
    // Built ahead: the guest's objects and the first spares; kept: all
    // but the first spare MR and QP.
    let sw = &after["switch"];
    let n = |v: &serde_json::Value, i: usize| v.as_array().unwrap()[i].as_u64().unwrap();
    let (built, kept) = (&sw["early_built"], &sw["early_kept"]);
    assert_eq!(sw["delta"], true, "the state at the switch named only what changed since the early section: {sw:#}");
    eprintln!("built ahead (PDs, MRs, CQs, QPs) {built}, kept {kept}; phases {}", sw["phases"]);
    assert_eq!(n(built, 1), before["mrs"].as_array().unwrap().len() as u64 + 1, "{sw:#}");
    assert_eq!(n(built, 3), before["qps"].as_array().unwrap().len() as u64 + 1, "{sw:#}");
    assert_eq!([n(built, 0), n(built, 1) - 1, n(built, 2), n(built, 3) - 1], [0, 1, 2, 3].map(|i| n(kept, i)), "{sw:#}");
    check_hop(&bed, &mut a, &b, (0, 1), gid, mode != Mode::Postcopy);
    b.wait_progress(p0 + STEP, LONG).unwrap();
    peer.wait_progress(PEER_STEP, LONG);
    let consoles = [a.console(), b.console()];
    assert_qps_running(&b);
    let rep = peer.stop();
    assert_run_clean(&consoles, &rep);
}
