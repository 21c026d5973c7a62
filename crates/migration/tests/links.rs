//! Migration over two links between two hosts: real vmm processes
//! (`transit vm run`) in testbed hosts with two NICs, the channels spread
//! over both destination addresses. Every migration that must complete runs
//! with `verify_ram` (the destination compares a hash of every page with the
//! source's at stop time and refuses to run on any difference).
//!
//! The tests run as `tcp::NAME` and, where listed, `rdma::NAME`: for
//! rdma, one rnicd per host serves both of its addresses, and the channels
//! are queue pairs between them.

mod common;

use migrate_transit::*;
use serde_json::{json, Value};
use std::time::Duration;
use testbed::{Testbed, TestbedOpts};

/// Fields drop in order: the VMs, then the rnicds, then the testbed.
struct Pair {
    src: VmProcess,
    dst: VmProcess,
    _rnicds: Vec<Rnicd>,
    tb: Testbed,
    transport: &'static str,
}

fn pair(transport: &'static str, workload: &str, memory: &str) -> Pair {
    let bin = transit_bin().expect("building transit");
    let tb = Testbed::create(TestbedOpts::new("miglinks", 2).nics(2)).unwrap();
    let rnicds = if transport == "rdma" { (0..2).map(|h| Rnicd::start(&bin, &tb, h, &[]).unwrap()).collect() } else { Vec::new() };
    let spec = VmSpec { name: "links", memory, workload, args: "" };
    let src = start_vm(&bin, &tb, 0, &spec, None).unwrap();
    let incoming = format!("{transport}:0.0.0.0:4444");
    let dst = start_vm(&bin, &tb, 1, &spec, Some(Incoming::Uri(&incoming))).unwrap();
    wait_guest_progress(&src, 1, Duration::from_secs(120)).unwrap();
    Pair { src, dst, _rnicds: rnicds, tb, transport }
}

impl Pair {
    /// Both of the destination's addresses, one per link.
    fn uri(&self) -> String {
        let d = self.tb.host(1);
        format!("{}:{}:4444,{}:4444", self.transport, d.addr(0), d.addr(1))
    }
    /// Waits until the source's channels wrote `bytes` (so a cut lands
    /// in the middle of the migration, whatever the machine's load).
    fn wait_sent(&self, bytes: u64) {
        let mut q = self.src.client().unwrap();
        let t = std::time::Instant::now();
        loop {
            let s = q.execute("query-migrate", json!({})).unwrap();
            let status = s["status"].as_str().unwrap_or("none");
            assert!(matches!(status, "none" | "setup" | "active"), "the migration ended before the cut: {s:#}");
            if s["wire_bytes"].as_u64().unwrap_or(0) >= bytes {
                return;
            }
            assert!(t.elapsed() < Duration::from_secs(60), "the migration does not progress: {s:#}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    /// Waits until the source switched to postcopy and then wrote `bytes`
    /// in all (so a cut lands while the push runs).
    fn wait_postcopy_sent(&self, bytes: u64) {
        let mut q = self.src.client().unwrap();
        let t = std::time::Instant::now();
        loop {
            let s = q.execute("query-migrate", json!({})).unwrap();
            let status = s["status"].as_str().unwrap_or("none");
            assert!(
                matches!(status, "none" | "setup" | "active" | "device" | "postcopy-active"),
                "the migration ended before the cut: {s:#}"
            );
            if status == "postcopy-active" && s["wire_bytes"].as_u64().unwrap_or(0) >= bytes {
                return;
            }
            assert!(t.elapsed() < Duration::from_secs(120), "the migration does not reach postcopy: {s:#}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    /// Waits until the source dropped both channels of link 1.
    fn wait_link_lost(&self) {
        let mut q = self.src.client().unwrap();
        let t = std::time::Instant::now();
        while q.execute("query-migrate", json!({})).unwrap()["links"][1]["channels_lost"] != 2 {
            assert!(t.elapsed() < Duration::from_secs(30), "the cut link's channels are not dropped");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    /// Over rdma after the switch: waits until the destination's READs
    /// on link `k` carried something; returns its `links` figures then.
    fn wait_read_on_link(&self, k: usize) -> Value {
        let mut q = self.dst.client().unwrap();
        let t = std::time::Instant::now();
        loop {
            let s = q.execute("query-migrate", json!({})).unwrap();
            if s["links"][k]["wire_bytes"].as_u64().unwrap_or(0) > 0 {
                return s["links"].clone();
            }
            assert!(t.elapsed() < Duration::from_secs(120), "no READ on link {k}: {s:#}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    /// Cuts the source host's link `k`: `Cut::Pulled` takes the cable
    /// out, `Cut::Silent` drops every IPv4 packet on it, both ways
    /// (nftables): no reset, no carrier change, and a socket that neither
    /// end writes to hears nothing of it. `Cut::Tcp` drops only TCP
    /// segments so: the link's RoCE traffic goes on.
    fn cut(&self, k: usize, how: Cut) {
        match how {
            Cut::Pulled => self.tb.link_down(0, k).unwrap(),
            // (`Testbed::set_loss` takes at most 99.9999 %.)
            Cut::Silent | Cut::Tcp => {
                let dev = format!("eth{k}");
                let rule = if how == Cut::Tcp { "ip protocol tcp counter drop" } else { "meta protocol ip counter drop" };
                let script = format!(
                    "nft -f - <<'EOF'\ntable netdev silent_cut_{dev} {{\n\
                     chain rx {{ type filter hook ingress device \"{dev}\" priority -200; {rule}; }}\n\
                     chain tx {{ type filter hook egress device \"{dev}\" priority -200; {rule}; }}\n}}\nEOF"
                );
                self.tb.host(0).sh(&script).unwrap();
            }
        }
    }
    fn cap_both(&self, mbit: u32) {
        for k in 0..2 {
            self.tb.set_rate(0, k, Some(mbit)).unwrap();
        }
    }
    /// The source's figures once it ended (it exits 2 s after completing).
    fn source_result(&self) -> Value {
        wait_migration(&self.src, Duration::from_secs(400)).unwrap()
    }
    /// A postcopy or hybrid after a cut: both ends completed with no
    /// recovery (the migration never paused) and no fault left waiting.
    /// Returns the source's and the destination's results.
    fn completed_without_a_pause(&self) -> (Value, Value) {
        let s = self.source_result();
        assert_eq!(s["status"], "completed", "{s:#}");
        assert_eq!(s["recoveries"], 0, "the migration went on without a pause: {s:#}");
        let d = wait_migration(&self.dst, Duration::from_secs(60)).unwrap();
        assert_eq!(d["status"], "completed", "destination {d:#}");
        assert_eq!(d["recoveries"], 0, "{d:#}");
        assert_eq!(d["remaining_pages"], 0, "no fault is left waiting: {d:#}");
        (s, d)
    }
    fn destination_completed(&self) -> Value {
        let d = wait_migration(&self.dst, Duration::from_secs(60)).unwrap();
        assert_eq!(d["status"], "completed", "destination {d:#}");
        assert_eq!(d["transport"], self.transport, "{d:#}");
        assert_eq!(d["verified_pages"], d["total_pages"], "every page hash compared");
        d
    }
    /// The destination runs, and after a while the dirtier oracle holds.
    fn check_dirtier_on_destination(&self) {
        let mut q = self.dst.client().unwrap();
        let p0 = q.execute("query-status", json!({})).unwrap()["guest_progress"].as_u64().unwrap_or(0);
        let t = std::time::Instant::now();
        while q.execute("query-status", json!({})).unwrap()["guest_progress"].as_u64().unwrap_or(0) < p0 + 2 {
            assert!(t.elapsed() < Duration::from_secs(60), "the guest makes no progress on the destination");
            std::thread::sleep(Duration::from_millis(50));
        }
        q.execute("stop", json!({})).unwrap();
        let r = q.execute("check-dirtier", json!({})).unwrap();
        assert_eq!(r["bad_pages"], 0, "dirtier oracle on the destination: {r}");
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Cut {
    Pulled,
    Silent,
    Tcp,
}

/// Bytes each link carried, from the source's `links` statistics.
fn link_bytes(s: &Value) -> Vec<u64> {
    s["links"].as_array().expect("links in the statistics").iter().map(|l| l["wire_bytes"].as_u64().unwrap()).collect()
}

/// Each test of the list as `TRANSPORT::NAME`.
macro_rules! over_transport {
    ($transport:ident: $($name:ident),* $(,)?) => {
        mod $transport {
            $(#[test]
            fn $name() {
                super::$name(stringify!($transport))
            })*
        }
    };
}

over_transport!(tcp:
    two_links_byte_exact_and_dirtier_oracle,
    clean_two_link_migration_keeps_the_control_connection,
    one_link_cut_mid_migration_completes_on_the_other,
    one_link_cut_under_a_dirtier_completes_with_the_oracle,
    both_links_cut_fails_and_the_source_runs_on,
    postcopy_over_two_links_is_byte_exact,
    postcopy_link_cut_after_the_switch_completes_on_the_other,
    hybrid_link_cut_under_heavy_faulting_completes_on_the_other,
);

over_transport!(rdma:
    two_links_byte_exact_and_dirtier_oracle,
    clean_two_link_migration_keeps_the_control_connection,
    one_link_cut_mid_migration_completes_on_the_other,
    one_link_cut_under_a_dirtier_completes_with_the_oracle,
    both_links_cut_fails_and_the_source_runs_on,
    postcopy_over_two_links_is_byte_exact,
    postcopy_link_cut_after_the_switch_completes_on_the_other,
    hybrid_link_cut_under_heavy_faulting_completes_on_the_other,
);

/// A filled idle VM and a dirtier over two links: byte-exact, both links
/// carry pages, and the dirtier's oracle holds on the destination.
fn two_links_byte_exact_and_dirtier_oracle(transport: &'static str) {
    for (wl, channels) in [("fill", 4), ("dirtier", 3)] {
        eprintln!("links: {wl} over 2 {transport} links, {channels} channels");
        let p = pair(transport, wl, "64M");
        p.src.exec("migrate", json!({"uri": p.uri(), "channels": channels, "verify_ram": true, "timeout_s": 300})).unwrap();
        let s = p.source_result();
        assert_eq!(s["status"], "completed", "{s:#}");
        p.destination_completed();
        let bytes = link_bytes(&s);
        assert_eq!(bytes.len(), 2, "{s:#}");
        assert!(bytes.iter().all(|&b| b > 1 << 20), "both links carry pages: {bytes:?}");
        assert_eq!(bytes.iter().sum::<u64>(), s["wire_bytes"].as_u64().unwrap(), "the links account for every byte");
        if wl == "dirtier" {
            p.check_dirtier_on_destination();
        }
    }
}

/// A clean migration over two links ends with the control stream where
/// it began: neither end's teardown (the source shuts every connection of
/// the migration, the destination closes its own) is taken for a failed
/// link, so no end moves it (`control_moves`), and the source's mark stays
/// on the first link. Both ends are asked a while after the end, when a
/// move at the teardown would have happened.
fn clean_two_link_migration_keeps_the_control_connection(transport: &'static str) {
    let p = pair(transport, "fill", "64M");
    p.src.exec("migrate", json!({"uri": p.uri(), "channels": 4, "verify_ram": true, "timeout_s": 300})).unwrap();
    let s = p.source_result();
    assert_eq!(s["status"], "completed", "{s:#}");
    p.destination_completed();
    // The source exits 2 s after it completed: ask it again within that.
    std::thread::sleep(Duration::from_secs(1));
    let s = p.src.client().and_then(|mut c| c.execute("query-migrate", json!({}))).unwrap_or(s);
    let d = p.dst.client().unwrap().execute("query-migrate", json!({})).unwrap();
    assert_eq!(s["control_moves"], 0, "source: {s:#}");
    assert_eq!(d["control_moves"], 0, "destination: {d:#}");
    assert_eq!(s["links"][0]["control"], true, "the control connection stayed on the first link: {s:#}");
}

/// The second link is cut in the middle of the first pass: its channels
/// are dropped, what they may not have delivered goes again on the first
/// link, and the migration completes byte-exact. (Over rdma the cut
/// link's queue pairs fail with retry exceeded.) `query-migrate` reports
/// the cut link failed, and what each link carried.
fn one_link_cut_mid_migration_completes_on_the_other(transport: &'static str) {
    let p = pair(transport, "fill", "128M");
    // 128 MiB at 2 x 100 Mbit/s: about 5 s, so the cut lands mid-pass.
    p.cap_both(100);
    p.src.exec("migrate", json!({"uri": p.uri(), "channels": 4, "verify_ram": true, "timeout_s": 300})).unwrap();
    p.wait_sent(32 << 20);
    p.tb.link_down(0, 1).unwrap();
    let s = p.source_result();
    assert_eq!(s["status"], "completed", "{s:#}");
    p.destination_completed();
    let links = s["links"].as_array().unwrap();
    assert_eq!(links[1]["channels_lost"], 2, "both channels of the cut link are lost: {s:#}");
    assert_eq!(links[1]["failed"], true, "the cut link is reported failed: {s:#}");
    assert!(links[1]["error"].is_string(), "with why: {s:#}");
    assert_eq!(links[0]["channels_lost"], 0, "{s:#}");
    assert_eq!(links[0]["failed"], false, "{s:#}");
    let bytes = link_bytes(&s);
    assert!(bytes[0] > bytes[1], "the rest went on the first link: {bytes:?}");
    assert_eq!(bytes.iter().sum::<u64>(), s["wire_bytes"].as_u64().unwrap(), "the links account for every byte");
}

/// The same cut while a dirtier runs (rounds and stop-and-copy after the
/// loss), and the link comes back once its channels were dropped (anything
/// still queued on them must not land late): byte-exact, and the oracle
/// holds on the destination.
fn one_link_cut_under_a_dirtier_completes_with_the_oracle(transport: &'static str) {
    let p = pair(transport, "dirtier", "64M");
    // The one link left must carry more than the dirtier rewrites at the
    // throttle's 99 %: 3.4-5.4 k pages/s (14-22 MB/s) on an otherwise idle
    // 2-CPU host, more than 150 Mbit/s (18.75 MB/s), at which the rounds
    // never converged. At 500 Mbit/s a round sends what the last one
    // dirtied in well under half its time.
    p.cap_both(500);
    p.src.exec("migrate", json!({"uri": p.uri(), "channels": 4, "verify_ram": true, "timeout_s": 300})).unwrap();
    p.wait_sent(16 << 20);
    p.tb.link_down(0, 1).unwrap();
    p.wait_link_lost();
    p.tb.link_up(0, 1).unwrap();
    let s = p.source_result();
    assert_eq!(s["status"], "completed", "{s:#}");
    assert_eq!(s["links"][1]["channels_lost"], 2, "{s:#}");
    assert_eq!(s["links"][1]["failed"], true, "a link back up is not taken again: {s:#}");
    p.destination_completed();
    p.check_dirtier_on_destination();
}

/// Both links cut: the migration fails as with one link, the source runs
/// on with its oracle holding, and the destination never ran.
fn both_links_cut_fails_and_the_source_runs_on(transport: &'static str) {
    let p = pair(transport, "dirtier", "64M");
    p.cap_both(50);
    p.src.exec("migrate", json!({"uri": p.uri(), "channels": 2})).unwrap();
    p.wait_sent(4 << 20);
    p.tb.link_down(0, 0).unwrap();
    p.tb.link_down(0, 1).unwrap();
    let s = wait_migration(&p.src, Duration::from_secs(120)).unwrap();
    assert!(matches!(s["status"].as_str(), Some("failed" | "cancelled")), "{s:#}");
    let mut q = p.src.client().unwrap();
    assert_eq!(q.execute("query-status", json!({})).unwrap()["status"], "running");
    q.execute("stop", json!({})).unwrap();
    assert_eq!(q.execute("check-dirtier", json!({})).unwrap()["bad_pages"], 0);
    let st = p.dst.exec("query-status", json!({}));
    if let Ok(st) = st {
        assert_ne!(st["status"], "running", "a destination with incomplete state must never run");
    }
}

/// Postcopy with two links: RAM arrives byte-exact and the dirtier's
/// oracle holds. Over tcp the push spreads over both links and faulting
/// pages come on the urgent connection, on the first. Over rdma the
/// destination READs every page (faults and the rest) through the queue
/// pairs of both links (the destination's `links` figures), and the data
/// channels carry nothing.
fn postcopy_over_two_links_is_byte_exact(transport: &'static str) {
    let p = pair(transport, "dirtier", "64M");
    p.src.exec("migrate", json!({"uri": p.uri(), "channels": 2, "mode": "postcopy", "timeout_s": 300})).unwrap();
    let s = p.source_result();
    assert_eq!(s["status"], "completed", "{s:#}");
    let d = wait_migration(&p.dst, Duration::from_secs(60)).unwrap();
    assert_eq!(d["status"], "completed", "destination {d:#}");
    if transport == "tcp" {
        assert!(link_bytes(&s).iter().all(|&b| b > 0), "both links carry pages: {s:#}");
    } else {
        let read = link_bytes(&d);
        assert_eq!(read.len(), 2, "{d:#}");
        assert!(read.iter().all(|&b| b > 0), "both links carry READs: {d:#}");
    }
    p.check_dirtier_on_destination();
}

/// Postcopy with two links, the second cut while the push runs: over tcp
/// its push channels are dropped, the destination reports the pages it
/// holds and the rest goes on the first link; the migration never pauses
/// (no recovery), and the dirtier's oracle holds on the destination. Over
/// rdma the cut lands once the destination's READs went over both links:
/// the cut link's queue pairs fail with retry exceeded, the destination
/// drops them and reads their pages again on the first link.
fn postcopy_link_cut_after_the_switch_completes_on_the_other(transport: &'static str) {
    link_cut_after_the_switch(transport, "postcopy", 8 << 20);
}

/// The same with a hybrid, cut at once after its switch, while the
/// dirtier (at full speed on the destination) faults on nearly every page
/// it touches.
fn hybrid_link_cut_under_heavy_faulting_completes_on_the_other(transport: &'static str) {
    link_cut_after_the_switch(transport, "hybrid", 0);
}

fn link_cut_after_the_switch(transport: &'static str, mode: &str, after: u64) {
    let p = pair(transport, "dirtier", "64M");
    // 64 MiB at 2 x 100 Mbit/s: the push takes seconds after the switch.
    p.cap_both(100);
    p.src.exec("migrate", json!({"uri": p.uri(), "channels": 4, "mode": mode, "timeout_s": 300})).unwrap();
    // Over rdma the destination READs the pages: the source's wire bytes
    // do not grow after the switch; the cut waits for READs on link 1.
    p.wait_postcopy_sent(if transport == "rdma" { 0 } else { after });
    let read_before = (transport == "rdma").then(|| p.wait_read_on_link(1));
    p.tb.link_down(0, 1).unwrap();
    let (s, d) = p.completed_without_a_pause();
    if transport == "tcp" {
        assert_eq!(s["links"][1]["channels_lost"], 2, "the cut link's push channels are dropped: {s:#}");
        assert_eq!(s["links"][1]["failed"], true, "{s:#}");
        assert_eq!(s["links"][0]["channels_lost"], 0, "{s:#}");
    }
    if let Some(before) = read_before {
        let l = &d["links"];
        assert_eq!(l[1]["failed"], true, "the cut link's READ queue pairs are dropped: {d:#}");
        assert_eq!(l[1]["channels_lost"], 2, "{d:#}");
        assert_eq!(l[0]["failed"], false, "{d:#}");
        let b0 = before[0]["wire_bytes"].as_u64().unwrap();
        assert!(l[0]["wire_bytes"].as_u64().unwrap() > b0, "the first link READ on after the cut: {before} then {l}");
    }
    p.check_dirtier_on_destination();
}

/// The first link cut: it carries the control connection (and, after a
/// postcopy switch over tcp, the first urgent connection), which move to
/// the second link with nothing lost; the rest is as for any cut link.
mod first_link {
    use super::*;

    over_transport!(tcp:
        first_link_cut_mid_migration_completes_on_the_other,
        first_link_silent_cut_mid_migration_completes_on_the_other,
        postcopy_first_link_cut_after_the_switch_completes_on_the_other,
        postcopy_first_link_silent_cut_after_the_switch_completes_on_the_other,
        hybrid_first_link_cut_under_heavy_faulting_completes_on_the_other,
        postcopy_every_link_cut_pauses_and_recovers,
        postcopy_recovery_with_the_first_link_still_cut_rides_the_second,
        postcopy_second_cut_after_a_recovery_completes_without_a_pause,
    );

    over_transport!(rdma:
        first_link_cut_mid_migration_completes_on_the_other,
        first_link_silent_cut_mid_migration_completes_on_the_other,
        postcopy_first_link_cut_after_the_switch_completes_on_the_other,
        postcopy_first_link_silent_cut_after_the_switch_completes_on_the_other,
        hybrid_first_link_cut_under_heavy_faulting_completes_on_the_other,
        postcopy_every_link_cut_pauses_and_recovers,
        postcopy_recovery_with_the_first_link_still_cut_rides_the_second,
        postcopy_second_cut_after_a_recovery_completes_without_a_pause,
    );
}

/// Precopy, the first link cut in the middle of the first pass: the
/// control connection goes on on the second link, the first link's
/// channels are dropped and their pages go again on the second, and the
/// migration completes byte-exact (`verify_ram`: the page hashes travel
/// on the control connection after the cut).
fn first_link_cut_mid_migration_completes_on_the_other(transport: &'static str) {
    first_link_cut_mid_migration(transport, Cut::Pulled);
}

/// The same with the first link cut silently (every packet dropped, no
/// reset, the carrier up): the sockets on it fail once their bytes or
/// their idle probes go unacknowledged for the link timeout, and the
/// control connection moves as after a pulled cable.
fn first_link_silent_cut_mid_migration_completes_on_the_other(transport: &'static str) {
    first_link_cut_mid_migration(transport, Cut::Silent);
}

fn first_link_cut_mid_migration(transport: &'static str, how: Cut) {
    let p = pair(transport, "fill", "128M");
    // 128 MiB at 2 x 100 Mbit/s: about 5 s, so the cut lands mid-pass.
    p.cap_both(100);
    p.src.exec("migrate", json!({"uri": p.uri(), "channels": 4, "verify_ram": true, "timeout_s": 300})).unwrap();
    p.wait_sent(32 << 20);
    p.cut(0, how);
    let s = p.source_result();
    assert_eq!(s["status"], "completed", "{s:#}");
    p.destination_completed();
    let links = s["links"].as_array().unwrap();
    assert_eq!(links[0]["channels_lost"], 2, "both channels of the cut link are lost: {s:#}");
    assert_eq!(links[0]["failed"], true, "{s:#}");
    assert_eq!(links[1]["channels_lost"], 0, "{s:#}");
    assert_eq!(links[1]["failed"], false, "{s:#}");
    assert_eq!(links[1]["control"], true, "the control connection moved to the second link: {s:#}");
    assert!(links[0].get("control").is_none(), "{s:#}");
    let bytes = link_bytes(&s);
    assert!(bytes[1] > bytes[0], "the rest went on the second link: {bytes:?}");
}

/// Postcopy, the first link cut while the push runs and the dirtier
/// faults on the destination: the control connection moves to the second
/// link, and over tcp the destination's page requests go on the second
/// link's urgent connection (those asked on the first are asked again).
/// The migration completes with no pause and no page left missing, and
/// the dirtier's oracle holds on the destination.
fn postcopy_first_link_cut_after_the_switch_completes_on_the_other(transport: &'static str) {
    first_link_cut_after_the_switch(transport, "postcopy", 8 << 20, Cut::Pulled);
}

/// The same with the first link cut silently: the control connection is
/// quiet while the push runs (nothing unacknowledged on it), and its idle
/// probes find the link dead, so it moves all the same.
fn postcopy_first_link_silent_cut_after_the_switch_completes_on_the_other(transport: &'static str) {
    first_link_cut_after_the_switch(transport, "postcopy", 8 << 20, Cut::Silent);
}

/// The same with a hybrid, cut at once after its switch, while the
/// dirtier (at full speed on the destination) faults on nearly every page
/// it touches: requests asked on the first link's urgent connection, and
/// never answered, are asked again on the second.
fn hybrid_first_link_cut_under_heavy_faulting_completes_on_the_other(transport: &'static str) {
    first_link_cut_after_the_switch(transport, "hybrid", 0, Cut::Pulled);
}

fn first_link_cut_after_the_switch(transport: &'static str, mode: &str, after: u64, how: Cut) {
    let p = pair(transport, "dirtier", "64M");
    // 64 MiB at 2 x 100 Mbit/s: the push takes seconds after the switch.
    // A hybrid sent part of RAM before it: at 2 x 40 Mbit/s its push
    // still outlasts the 4 s in which the cut link is found dead.
    p.cap_both(if mode == "hybrid" { 40 } else { 100 });
    // A postcopy's push is capped at 3 MB/s (faults are not): the dirtier
    // waits on its faults, not on the push, long after the cut link is
    // found dead, so the requests asked on it must be asked again.
    let cap = if mode == "postcopy" { 3_000_000u64 } else { 0 };
    p.src.exec("migrate", json!({"uri": p.uri(), "channels": 4, "mode": mode, "timeout_s": 300, "max_bandwidth": cap})).unwrap();
    p.wait_postcopy_sent(if transport == "rdma" { 0 } else { after });
    if transport == "rdma" {
        p.wait_read_on_link(0);
    }
    p.cut(0, how);
    let (s, d) = p.completed_without_a_pause();
    assert_eq!(s["links"][1]["control"], true, "the control connection moved to the second link: {s:#}");
    if transport == "tcp" {
        assert_eq!(s["links"][0]["channels_lost"], 2, "the cut link's push channels are dropped: {s:#}");
        assert_eq!(s["links"][1]["channels_lost"], 0, "{s:#}");
    } else {
        assert_eq!(d["links"][0]["failed"], true, "the cut link's READ queue pairs are dropped: {d:#}");
        assert_eq!(d["links"][1]["failed"], false, "{d:#}");
    }
    p.check_dirtier_on_destination();
}

/// Postcopy over rdma, the control connection's link cut (TCP only: the
/// READs go on over both links) just before the destination has every
/// page, so that its last message, `Complete`, goes into the cut link
/// before either end can find it dead (an idle connection's probes go
/// unanswered for the 4 s link timeout first). The destination waits for
/// the source's close; once the link is found dead, `Complete` goes again
/// on the second link. Both ends complete with no pause.
#[test]
fn postcopy_control_link_cut_after_the_last_message_completes() {
    let p = pair("rdma", "fill", "64M");
    // 64 MiB READ at 8 MB/s: 8 s after the switch.
    let cap = 8_000_000u64;
    p.src.exec("migrate", json!({"uri": p.uri(), "channels": 4, "mode": "postcopy", "timeout_s": 300, "max_bandwidth": cap})).unwrap();
    let mut q = p.dst.client().unwrap();
    let t = std::time::Instant::now();
    // The cut when a second of READs or less is left: well inside the 4 s
    // link timeout, and wide enough that a poll delayed by a loaded host
    // does not miss it.
    let last = cap / 4096;
    loop {
        let d = q.execute("query-migrate", json!({})).unwrap();
        let left = d["remaining_pages"].as_u64().unwrap_or(0);
        if d["status"] == "postcopy-active" && left > 0 && left <= last {
            break;
        }
        assert!(d["postcopy_ms"].as_f64().unwrap_or(0.0) == 0.0, "every page came before the cut: {d:#}");
        assert!(t.elapsed() < Duration::from_secs(120), "the postcopy does not get near its end: {d:#}");
        std::thread::sleep(Duration::from_millis(10));
    }
    p.cut(0, Cut::Tcp);
    let s = wait_migration(&p.src, Duration::from_secs(60)).unwrap();
    assert_eq!(s["status"], "completed", "{s:#}");
    assert_eq!(s["recoveries"], 0, "{s:#}");
    assert_eq!(s["links"][1]["control"], true, "the control connection moved to the second link: {s:#}");
    let d = wait_migration(&p.dst, Duration::from_secs(60)).unwrap();
    assert_eq!(d["status"], "completed", "destination {d:#}");
    assert_eq!(d["recoveries"], 0, "{d:#}");
    assert_eq!(d["remaining_pages"], 0, "{d:#}");
}

/// Every link cut while a postcopy's push runs: the control connection
/// finds no link to move to, and both ends pause as with one link. The
/// links come back; `migrate-recover` gives the destination a new port
/// and `migrate` with `resume` reconnects: the migration completes with
/// one recovery, no page missing, and the oracle holding.
fn postcopy_every_link_cut_pauses_and_recovers(transport: &'static str) {
    every_link_cut_then_recovery(transport, &[0, 1], false);
}

/// The same, but only the second link comes back: the recovery's control
/// connection, given both addresses, passes over the first (still cut)
/// and rides the second, and so do its channels and, over tcp, its
/// urgent connection.
fn postcopy_recovery_with_the_first_link_still_cut_rides_the_second(transport: &'static str) {
    every_link_cut_then_recovery(transport, &[1], false);
}

/// The recovery over both links gives the control connection its spare
/// on the second again: the first link cut once more after the recovery
/// moves the control stream there, and the migration completes without
/// a second pause.
fn postcopy_second_cut_after_a_recovery_completes_without_a_pause(transport: &'static str) {
    every_link_cut_then_recovery(transport, &[0, 1], true);
}

/// `back`: the links that come back before the recovery; `cut_again`:
/// the first link is cut once more while the recovered postcopy runs.
fn every_link_cut_then_recovery(transport: &'static str, back: &[usize], cut_again: bool) {
    let p = pair(transport, "dirtier", "64M");
    // 64 MiB at 2 x 20 Mbit/s: the push runs for many seconds.
    p.cap_both(20);
    p.src.exec("migrate", json!({"uri": p.uri(), "channels": 2, "mode": "postcopy", "timeout_s": 300})).unwrap();
    p.wait_postcopy_sent(if transport == "rdma" { 0 } else { 2 << 20 });
    if transport == "rdma" {
        p.wait_read_on_link(0);
    }
    p.tb.link_down(0, 0).unwrap();
    p.tb.link_down(0, 1).unwrap();
    let paused = |vm: &VmProcess| {
        let t = std::time::Instant::now();
        let mut q = vm.client().unwrap();
        loop {
            let s = q.execute("query-migrate", json!({})).unwrap();
            if s["status"] == "postcopy-paused" {
                return s;
            }
            assert!(t.elapsed() < Duration::from_secs(90), "no pause: {s:#}");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let d = paused(&p.dst);
    assert!(d["remaining_pages"].as_u64().unwrap() > 0, "the cut came after the last page: {d:#}");
    paused(&p.src);
    for &k in back {
        p.tb.link_up(0, k).unwrap();
    }
    p.dst.exec("migrate-recover", json!({"uri": format!("{transport}:0.0.0.0:4445")})).unwrap();
    let h = p.tb.host(1);
    let uri = format!("{}:{}:4445,{}:4445", transport, h.addr(0), h.addr(1));
    p.src.exec("migrate", json!({"uri": uri, "resume": true})).unwrap();
    if cut_again {
        second_cut_after_the_recovery(&p);
    }
    let s = p.source_result();
    assert_eq!(s["status"], "completed", "{s:#}");
    assert_eq!(s["recoveries"], 1, "{s:#}");
    if transport == "tcp" {
        // The links of the recovery, from the first that took its control
        // connection on.
        let links = s["links"].as_array().unwrap();
        assert_eq!(links.len(), 2 - back[0], "{s:#}");
        assert_eq!(links[0]["addr"], format!("{}:4445", h.addr(back[0])), "{s:#}");
        // After a second cut of the first link the control stream rides
        // the second.
        // (`control` is left out where false.)
        assert_eq!(links[0]["control"].as_bool().unwrap_or(false), !cut_again, "{s:#}");
        if cut_again {
            assert_eq!(links[1]["control"], true, "{s:#}");
        }
    }
    let d = wait_migration(&p.dst, Duration::from_secs(60)).unwrap();
    assert_eq!(d["status"], "completed", "destination {d:#}");
    assert_eq!(d["recoveries"], 1, "{d:#}");
    assert_eq!(d["remaining_pages"], 0, "{d:#}");
    p.check_dirtier_on_destination();
}

/// Once the recovered postcopy runs again on both ends with pages still
/// missing, cuts the first link (the recovery's control link) and waits
/// until the destination completes: it must never pause again.
fn second_cut_after_the_recovery(p: &Pair) {
    let active = |vm: &VmProcess| {
        let t = std::time::Instant::now();
        let mut q = vm.client().unwrap();
        loop {
            let s = q.execute("query-migrate", json!({})).unwrap();
            if s["status"] == "postcopy-active" && s["recoveries"] == 1 {
                return s;
            }
            assert!(t.elapsed() < Duration::from_secs(90), "the recovery does not resume the postcopy: {s:#}");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    active(&p.src);
    active(&p.dst);
    // Both ends run on the recovered connections for a while first.
    std::thread::sleep(Duration::from_secs(1));
    let mut q = p.dst.client().unwrap();
    let d = q.execute("query-migrate", json!({})).unwrap();
    assert!(d["remaining_pages"].as_u64().unwrap_or(0) > 0, "the recovered postcopy ended before the second cut: {d:#}");
    p.tb.link_down(0, 0).unwrap();
    let t = std::time::Instant::now();
    loop {
        let d = q.execute("query-migrate", json!({})).unwrap();
        assert_ne!(d["status"], "postcopy-paused", "the second cut paused the migration again: {d:#}");
        if d["status"] == "completed" {
            return;
        }
        assert!(t.elapsed() < Duration::from_secs(180), "the migration does not complete after the second cut: {d:#}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Postcopy over tcp with two links (two loopback proxies in front of one
/// destination, engines in this process), the dirtier faulting at full
/// speed on the destination: the first link's urgent connection is cut in
/// the middle of its answers, while pages asked for and the pages
/// prefetched after them are on their way. Every page asked or prefetched
/// and not arrived is asked again on the second link's urgent connection
/// (a prefetched page no thread waits on too: the push left it to the
/// prefetch and would never send it), so the migration completes with no
/// pause and nothing missing. The destination then holds what the source
/// stopped with in every byte the dirtier did not change since, and its
/// oracle holds: a page that came twice was placed once.
#[test]
fn postcopy_urgent_connection_cut_mid_answer_asks_again_on_the_other_link() {
    use common::{wait_until, whole_pass_done, Fault, Proxy, Side, MIB};
    use migration::vm::MigratableVm;
    let src = Side::new(64 * MIB, 2);
    src.vm.resume().unwrap();
    // All data, no holes (which would go as zero runs in no time).
    wait_until("a whole pass of every dirtier", || whole_pass_done(&src));
    let dst = Side::new(64 * MIB, 2);
    let port = dst.incoming_with(true, false);
    // The first link's connections in the order the source opens them:
    // control, data channel 0, urgent.
    let first = Proxy::start(port, Fault { conn: 2, cut_after: Some(512 << 10), ..Default::default() });
    let second = Proxy::start(port, Fault { conn: usize::MAX, ..Default::default() });
    let uri = format!("tcp:127.0.0.1:{},127.0.0.1:{}", first.port, second.port);
    // 64 MiB pushed at 10 MB/s: the faults' answers pass 512 KiB long
    // before the push ends.
    src.cmd("migrate", json!({"uri": uri, "mode": "postcopy", "channels": 2, "max_bandwidth": 10_000_000u64})).unwrap();
    let (o_src, o_dst) = (src.slot.wait(), dst.slot.wait());
    let s = src.cmd("query-migrate", json!({})).unwrap();
    let d = dst.cmd("query-migrate", json!({})).unwrap();
    assert_eq!(o_src, Some(migration::qmp::Outcome::OutgoingCompleted), "source: {s:#}\ndestination: {d:#}");
    assert!(matches!(o_dst, Some(migration::qmp::Outcome::IncomingCompleted { .. })), "destination: {d:#}");
    assert!(first.fired.load(std::sync::atomic::Ordering::SeqCst), "the urgent connection was cut mid-answer: {d:#}");
    assert_eq!(s["recoveries"], 0, "the migration went on without a pause: {s:#}");
    assert_eq!(d["recoveries"], 0, "{d:#}");
    assert_eq!(d["remaining_pages"], 0, "{d:#}");
    assert_eq!(s["links"][0]["channels_lost"], 0, "only the urgent connection was cut: {s:#}");
    // Every byte but the dirtier's counter (byte 0, which the oracle checks).
    dst.vm.pause().unwrap();
    let tails = |side: &Side| -> Vec<u64> {
        let ram = side.dynvm.ram();
        (0..ram.pages())
            .map(|p| {
                // SAFETY: a page of the VM's mapped guest RAM, the VM paused.
                let page = unsafe { std::slice::from_raw_parts(ram.host_addr.add((p * 4096) as usize), 4096) };
                migration::wire::xxh3(&page[1..])
            })
            .collect()
    };
    let (a, b) = (tails(&src), tails(&dst));
    let differ = (0..a.len()).filter(|&i| a[i] != b[i]).count();
    assert_eq!(differ, 0, "pages differ from what the source stopped with");
    dst.vm.check_oracle().unwrap();
    common::run_and_check_oracle(&dst.vm, Duration::from_millis(200));
}
