//! The rdma transport end to end: real vmm processes and a real rnicd on
//! each of two testbed hosts; pages go as RDMA WRITEs between the two
//! rnicds. Every successful migration runs with `verify_ram` (the
//! destination compares a hash of every page with the source's at stop
//! time and refuses to run on any difference), then the dirtier oracle is
//! checked on the running destination. Failures (a cut link, a killed
//! destination) leave the source running with its oracle intact and the
//! destination never running.

use migrate_transit::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use testbed::{Testbed, TestbedOpts};

const MEM: &str = "64M";

/// Fields drop in order: the VMs first, then the rnicds, then the testbed.
struct Pair {
    src: VmProcess,
    dst: VmProcess,
    nics: Vec<Rnicd>,
    tb: Testbed,
}

/// rnicd on each host, serving its default socket (the vmm finds it).
fn start_rnicds(bin: &std::path::Path, tb: &Testbed) -> Vec<Rnicd> {
    (0..2).map(|i| Rnicd::start(bin, tb, i, &[]).expect("start rnicd")).collect()
}

fn pair(workload: &str) -> Pair {
    let bin = transit_bin().expect("building transit");
    let tb = Testbed::create(TestbedOpts::new("migrdma", 2)).unwrap();
    let nics = start_rnicds(&bin, &tb);
    let spec = VmSpec { name: "rdma", memory: MEM, workload, args: "" };
    let src = start_vm(&bin, &tb, 0, &spec, None).unwrap();
    let dst = start_vm(&bin, &tb, 1, &spec, Some(Incoming::Uri("rdma:0.0.0.0:4444"))).unwrap();
    wait_guest_progress(&src, 1, Duration::from_secs(120)).unwrap();
    Pair { src, dst, nics, tb }
}

impl Pair {
    fn uri(&self) -> String {
        format!("rdma:{}:4444", self.tb.host(1).addr(0))
    }

    /// Both rnicds' counters (`Stats`), source first.
    fn rnicd_stats(&self) -> Vec<Value> {
        (0..2)
            .map(|h| {
                let ctx = verbs::Context::open_namespace(Some(self.nics[h].socket()), self.tb.host(h).addr(0)).unwrap();
                ctx.stats().unwrap()
            })
            .collect()
    }

    /// The destination runs, and after a while the dirtier oracle holds.
    fn check_destination_runs(&self, dirtier: bool) {
        let mut q = self.dst.client().unwrap();
        assert_eq!(q.execute("query-status", json!({})).unwrap()["status"], "running");
        if dirtier {
            let p0 = q.execute("query-status", json!({})).unwrap()["guest_progress"].as_u64().unwrap_or(0);
            let t = Instant::now();
            while q.execute("query-status", json!({})).unwrap()["guest_progress"].as_u64().unwrap_or(0) < p0 + 2 {
                assert!(t.elapsed() < Duration::from_secs(60), "the guest makes no progress on the destination");
                std::thread::sleep(Duration::from_millis(50));
            }
            q.execute("stop", json!({})).unwrap();
            let r = q.execute("check-dirtier", json!({})).unwrap();
            assert_eq!(r["bad_pages"], 0, "dirtier oracle on the destination: {r}");
        }
    }

    /// After a failure: the source still runs and its dirtier oracle
    /// holds; the destination never ran.
    fn assert_source_survived(&mut self) -> Value {
        let s = wait_migration(&self.src, Duration::from_secs(120)).unwrap();
        assert!(matches!(s["status"].as_str(), Some("failed" | "cancelled")), "{s:#}");
        let mut q = self.src.client().unwrap();
        assert_eq!(q.execute("query-status", json!({})).unwrap()["status"], "running");
        q.execute("stop", json!({})).unwrap();
        assert_eq!(q.execute("check-dirtier", json!({})).unwrap()["bad_pages"], 0);
        q.execute("cont", json!({})).unwrap();
        check_destination_never_ran(&mut self.dst, Duration::from_secs(60)).unwrap();
        s
    }
}

fn migrate_ok(workload: &str, params: Value, cap_mbit: Option<u32>) {
    let p = pair(workload);
    if let Some(m) = cap_mbit {
        p.tb.set_rate(0, 0, Some(m)).unwrap();
    }
    let mut params = params;
    params["uri"] = json!(p.uri());
    params["verify_ram"] = json!(true);
    params["timeout_s"] = json!(300);
    let before = p.rnicd_stats();
    p.src.exec("migrate", params.clone()).unwrap();
    let d = wait_migration(&p.dst, Duration::from_secs(400)).unwrap();
    assert_eq!(d["status"], "completed", "{params}: destination {d:#}");
    assert_eq!(d["transport"], "rdma", "{d:#}");
    assert_eq!(d["verified_pages"], d["total_pages"], "every page hash compared");
    // The source finishes after the destination (it waits for the
    // destination's word, then tears its channels down), and only then
    // fills in `total_ms`: wait for it too, or the cap check below divides
    // by a time of zero.
    let s = wait_migration(&p.src, Duration::from_secs(60)).unwrap();
    assert_eq!(s["status"], "completed", "{params}: source {s:#}");
    assert_eq!(s["transport"], "rdma");
    assert_eq!(s["pages_sent"], d["pages_sent"], "every page sent was received and checked");
    // WRITE payloads leave from guest RAM on their first transmission
    // (docs/rnic.md): a page the guest rewrote before the kernel copied it
    // is dropped for its ICRC and resent. How often, for the docs' figures.
    let after = p.rnicd_stats();
    let delta = |h: usize, k: &str| after[h][k].as_u64().unwrap_or(0) - before[h][k].as_u64().unwrap_or(0);
    eprintln!(
        "{workload} {params}: source sent {} packets ({} go-back-N rewinds); destination dropped {} for a bad ICRC",
        delta(0, "tx_packets"),
        delta(0, "retransmit_rewinds"),
        delta(1, "rx_bad_icrc")
    );
    if let Some(cap) = params["max_bandwidth"].as_u64() {
        let secs = s["total_ms"].as_f64().unwrap() / 1e3;
        let rate = s["wire_bytes"].as_f64().unwrap() / secs;
        assert!(rate <= cap as f64 * 1.2, "{rate} B/s over a cap of {cap}");
    }
    p.check_destination_runs(workload == "dirtier");
}

#[test]
fn idle_and_dirtier_vms_over_rdma_every_channel_and_compression_mode() {
    for (wl, params, cap) in [
        ("fill", json!({"channels": 1}), None),
        ("fill", json!({"channels": 4, "compress": "lz4"}), None),
        ("dirtier", json!({"channels": 1}), None),
        ("dirtier", json!({"channels": 4, "compress": "zstd:3", "downtime_ms": 100}), None),
        // The cap (and auto-converge under it) work as over TCP.
        ("dirtier", json!({"channels": 2, "max_bandwidth": 200_000_000u64}), None),
    ] {
        eprintln!("rdma e2e: {wl} {params} cap={cap:?}");
        migrate_ok(wl, params, cap);
    }
}

#[test]
fn link_cut_mid_migration_over_rdma() {
    let mut p = pair("dirtier");
    p.tb.set_rate(0, 0, Some(50)).unwrap(); // slow enough to cut in the middle
    p.src.exec("migrate", json!({"uri": p.uri(), "channels": 2})).unwrap();
    // At 50 Mbit/s the 64 MiB the dirtier writes take seconds more.
    wait_wire_bytes(&p.src, 1 << 20, Duration::from_secs(120)).unwrap();
    p.tb.link_down(0, 0).unwrap();
    let s = p.assert_source_survived();
    eprintln!("source: {}", s["error"]);
}

#[test]
fn destination_killed_mid_migration_over_rdma() {
    let mut p = pair("dirtier");
    p.tb.set_rate(0, 0, Some(50)).unwrap();
    p.src.exec("migrate", json!({"uri": p.uri(), "channels": 4})).unwrap();
    // At 50 Mbit/s the 64 MiB the dirtier writes take seconds more.
    wait_wire_bytes(&p.src, 1 << 20, Duration::from_secs(120)).unwrap();
    p.dst.kill();
    let s = p.assert_source_survived();
    eprintln!("source: {}", s["error"]);
}
