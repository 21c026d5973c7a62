//! End to end: real vmm processes (`transit vm run`) in two testbed hosts,
//! migrated through their control sockets. Every migration runs with
//! `verify_ram`, so the destination compares a hash of every page with the
//! source's at stop time and refuses to run on any difference; the dirtier
//! oracle is then checked on the running destination.
//!
//! Skipped (with a message) while the vmm has no `--incoming`.

use migrate_transit::*;
use serde_json::json;
use std::time::Duration;
use testbed::{Testbed, TestbedOpts};

const MEM: &str = "64M";

fn setup() -> std::path::PathBuf {
    let bin = transit_bin().expect("building transit");
    // A TRANSIT_BIN too old to take migrations fails rather than passing
    // untested.
    assert!(vmm_supports_migration(&bin), "{} has no `vm run --incoming`", bin.display());
    bin
}

struct Pair {
    tb: Testbed,
    src: VmProcess,
    dst: VmProcess,
}

fn pair(bin: &std::path::Path, workload: &str, args: &str) -> Pair {
    pair_with(bin, workload, args, Incoming::Uri("tcp:0.0.0.0:4444"))
}

fn pair_with(bin: &std::path::Path, workload: &str, args: &str, incoming: Incoming) -> Pair {
    let tb = Testbed::create(TestbedOpts::new("mige2e", 2)).unwrap();
    let spec = VmSpec { name: "e2e", memory: MEM, workload, args };
    let src = start_vm(bin, &tb, 0, &spec, None).unwrap();
    let dst = start_vm(bin, &tb, 1, &spec, Some(incoming)).unwrap();
    wait_guest_progress(&src, 1, Duration::from_secs(120)).unwrap();
    Pair { tb, src, dst }
}

impl Pair {
    fn uri(&self) -> String {
        format!("tcp:{}:4444", self.tb.host(1).addr(0))
    }
    /// The destination runs, and after a while the dirtier oracle holds.
    fn check_destination_runs(&self, dirtier: bool) {
        let mut q = self.dst.client().unwrap();
        let p0 = q.execute("query-status", json!({})).unwrap()["guest_progress"].as_u64().unwrap_or(0);
        assert_eq!(q.execute("query-status", json!({})).unwrap()["status"], "running");
        if dirtier {
            let t = std::time::Instant::now();
            while q.execute("query-status", json!({})).unwrap()["guest_progress"].as_u64().unwrap_or(0) < p0 + 2 {
                assert!(t.elapsed() < Duration::from_secs(60), "the guest makes no progress on the destination");
                std::thread::sleep(Duration::from_millis(50));
            }
            q.execute("stop", json!({})).unwrap();
            let r = q.execute("check-dirtier", json!({})).unwrap();
            assert_eq!(r["bad_pages"], 0, "dirtier oracle on the destination: {r}");
            q.execute("cont", json!({})).unwrap();
        }
    }
}

fn migrate_ok(bin: &std::path::Path, workload: &str, args: &str, params: serde_json::Value, cap_mbit: Option<u32>) {
    let p = pair(bin, workload, args);
    if let Some(m) = cap_mbit {
        p.tb.set_rate(0, 0, Some(m)).unwrap();
    }
    let mut params = params;
    params["uri"] = json!(p.uri());
    params["verify_ram"] = json!(true);
    params["timeout_s"] = json!(300);
    p.src.exec("migrate", params.clone()).unwrap();
    let d = wait_migration(&p.dst, Duration::from_secs(400)).unwrap();
    assert_eq!(d["status"], "completed", "{params}: destination {d:#}");
    assert_eq!(d["verified_pages"], d["total_pages"], "every page hash compared");
    p.check_destination_runs(workload == "dirtier");
}

#[test]
fn idle_and_dirtier_vms_every_channel_and_compression_mode() {
    let bin = setup();
    for (wl, params, cap) in [
        ("fill", json!({"channels": 1}), None),
        ("fill", json!({"channels": 4, "compress": "lz4"}), None),
        ("fill", json!({"channels": 4, "compress": "zstd"}), Some(200)),
        ("dirtier", json!({"channels": 1}), None),
        ("dirtier", json!({"channels": 4, "compress": "zstd:3"}), None),
        // A cap that the full-speed dirtier can converge under: at 20 MB/s
        // it rewrites all 64 MiB within every round even at 99 % throttle,
        // and no throttle makes that converge (postcopy does).
        ("dirtier", json!({"channels": 4, "max_bandwidth": 200_000_000u64}), None),
    ] {
        eprintln!("e2e: {wl} {params} cap={cap:?}");
        migrate_ok(&bin, wl, "", params, cap);
    }
}

/// The benchmark's destination: started paused, `migrate-incoming` with
/// `prealloc` (RAM allocated while waiting); RAM byte-exact and the dirtier
/// oracle holds on the destination.
#[test]
fn preallocated_destination_vmm() {
    let bin = setup();
    let p = pair_with(&bin, "dirtier", "", Incoming::Prealloc("tcp:0.0.0.0:4444"));
    p.src.exec("migrate", json!({"uri": p.uri(), "channels": 2, "verify_ram": true, "timeout_s": 300})).unwrap();
    let d = wait_migration(&p.dst, Duration::from_secs(400)).unwrap();
    assert_eq!(d["status"], "completed", "destination {d:#}");
    assert_eq!(d["verified_pages"], d["total_pages"], "every page hash compared");
    p.check_destination_runs(true);
}

/// After a failure: the source still runs and its dirtier oracle holds; the
/// destination never ran.
fn assert_source_survived(p: &mut Pair) {
    let s = wait_migration(&p.src, Duration::from_secs(120)).unwrap();
    assert!(matches!(s["status"].as_str(), Some("failed" | "cancelled")), "{s:#}");
    let mut q = p.src.client().unwrap();
    assert_eq!(q.execute("query-status", json!({})).unwrap()["status"], "running");
    q.execute("stop", json!({})).unwrap();
    assert_eq!(q.execute("check-dirtier", json!({})).unwrap()["bad_pages"], 0);
    q.execute("cont", json!({})).unwrap();
    check_destination_never_ran(&mut p.dst, Duration::from_secs(60)).unwrap();
}

#[test]
fn link_cut_mid_migration() {
    let bin = setup();
    let mut p = pair(&bin, "dirtier", "");
    p.tb.set_rate(0, 0, Some(50)).unwrap(); // slow enough to cut in the middle
    p.src.exec("migrate", json!({"uri": p.uri(), "channels": 2})).unwrap();
    // At 50 Mbit/s the 64 MiB the dirtier writes take seconds more.
    wait_wire_bytes(&p.src, 1 << 20, Duration::from_secs(120)).unwrap();
    p.tb.link_down(0, 0).unwrap();
    assert_source_survived(&mut p);
}

#[test]
fn destination_killed_mid_migration() {
    let bin = setup();
    let mut p = pair(&bin, "dirtier", "");
    p.tb.set_rate(0, 0, Some(50)).unwrap();
    p.src.exec("migrate", json!({"uri": p.uri(), "channels": 4})).unwrap();
    // At 50 Mbit/s the 64 MiB the dirtier writes take seconds more.
    wait_wire_bytes(&p.src, 1 << 20, Duration::from_secs(120)).unwrap();
    p.dst.kill();
    assert_source_survived(&mut p);
}

#[test]
fn timeout_keeps_the_vm_on_the_source() {
    let bin = setup();
    let mut p = pair(&bin, "dirtier", "");
    p.src.exec("migrate", json!({"uri": p.uri(), "max_bandwidth": 1_000_000u64, "timeout_s": 3})).unwrap();
    assert_source_survived(&mut p);
}
