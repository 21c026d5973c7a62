//! Postcopy and hybrid with real vmm processes in two testbed hosts: the
//! guest's dirtier oracle on the destination, byte-exact RAM, a cut link
//! that pauses and recovers, and killed processes reported as what they are.

use serde_json::{json, Value};
use std::time::{Duration, Instant};
use vmm::testing::{transit_bin, unique_name, VmProcess};

struct Pair {
    tb: testbed::Testbed,
    src: VmProcess,
    dst: VmProcess,
}

fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn status(vm: &VmProcess) -> Value {
    vm.exec("query-migrate", json!({})).unwrap()
}

/// A source VM on host 0 running `workload`, a destination on host 1
/// waiting with --incoming (paused after arrival if `paused`).
fn pair(tag: &str, workload: &str, memory: &str, paused: bool) -> Pair {
    let tb = testbed::Testbed::create(testbed::TestbedOpts::new(tag, 2)).unwrap();
    let name = unique_name(tag);
    let src = VmProcess::start(
        tb.host(0).command(transit_bin()),
        &name,
        &["vm", "run", "--name", &name, "--memory", memory, "--vcpus", "2", "--workload", workload, "--keep-after-migrate"],
    )
    .unwrap();
    let dname = format!("{name}-d");
    let mut args =
        vec!["vm", "run", "--name", &dname, "--memory", memory, "--vcpus", "2", "--workload", workload, "--incoming", "tcp:0.0.0.0:4444"];
    if paused {
        args.push("--paused");
    }
    let dst = VmProcess::start(tb.host(1).command(transit_bin()), &dname, &args).unwrap();
    Pair { tb, src, dst }
}

impl Pair {
    fn uri(&self) -> String {
        format!("tcp:{}:4444", self.tb.host(1).addr(0))
    }
    fn migrate(&self, args: Value) {
        let mut a = args;
        a["uri"] = json!(self.uri());
        self.src.exec("migrate", a).unwrap();
    }
    fn wait_done(&self) -> (Value, Value) {
        let t = Duration::from_secs(240);
        wait_for("the source to complete", t, || {
            let s = status(&self.src);
            assert_ne!(s["status"], "failed", "{s:#}");
            s["status"] == "completed"
        });
        wait_for("the destination to complete", t, || status(&self.dst)["status"] == "completed");
        (status(&self.src), status(&self.dst))
    }
}

fn dirtier_ok(vm: &VmProcess) {
    vm.exec("stop", json!({})).unwrap();
    let r = vm.exec("check-dirtier", json!({})).unwrap();
    assert_eq!(r["bad_pages"], 0, "dirtier oracle failed: {r}");
    vm.exec("cont", json!({})).unwrap();
}

#[test]
fn postcopy_and_hybrid_dirtier_vms_hold_the_oracle() {
    for mode in ["postcopy", "hybrid"] {
        let p = pair(&format!("pc{}", &mode[..3]), "dirtier", "256M", false);
        p.src.wait_progress(2, Duration::from_secs(60)).unwrap();
        p.migrate(json!({"mode": mode, "channels": 2, "downtime_ms": 0}));
        let (s, d) = p.wait_done();
        assert_eq!(s["mode"], mode);
        assert!(s["postcopy_ms"].as_f64().unwrap() > 0.0, "{s:#}");
        assert!(d["faults"].as_u64().unwrap() > 0, "{d:#}");
        // `cont` on the source is refused: it handed the VM over.
        assert!(p.src.exec("cont", json!({})).is_err());
        let g = p.dst.status().unwrap()["guest_progress"].as_u64().unwrap();
        p.dst.wait_progress(g + 2, Duration::from_secs(120)).unwrap();
        dirtier_ok(&p.dst);
    }
}

#[test]
fn postcopy_to_a_paused_destination_is_byte_exact() {
    let p = pair("pcfill", "fill", "128M", true);
    p.src.wait_progress(1, Duration::from_secs(60)).unwrap();
    p.migrate(json!({"mode": "postcopy", "channels": 4}));
    p.wait_done();
    let a = p.src.exec("query-ram-digest", json!({})).unwrap();
    let b = p.dst.exec("query-ram-digest", json!({})).unwrap();
    assert_eq!(a, b, "RAM differs");
}

#[test]
fn postcopy_survives_a_cut_link() {
    let p = pair("pccut", "dirtier", "256M", false);
    p.src.wait_progress(2, Duration::from_secs(60)).unwrap();
    // 40 MB/s: 256 MiB take seconds, the cut lands in the middle.
    p.migrate(json!({"mode": "postcopy", "channels": 2, "max_bandwidth": 40_000_000u64}));
    wait_for("postcopy", Duration::from_secs(60), || status(&p.dst)["status"] == "postcopy-active");
    std::thread::sleep(Duration::from_millis(500));
    p.tb.link_down(1, 0).unwrap();
    wait_for("the source to pause", Duration::from_secs(60), || status(&p.src)["status"] == "postcopy-paused");
    wait_for("the destination to pause", Duration::from_secs(60), || status(&p.dst)["status"] == "postcopy-paused");
    p.tb.link_up(1, 0).unwrap();
    p.src.exec("migrate", json!({"uri": p.uri(), "resume": true})).unwrap();
    let (s, d) = p.wait_done();
    assert!(s["recoveries"].as_u64().unwrap() >= 1, "{s:#}");
    assert!(d["paused_ms"].as_f64().unwrap() > 0.0, "{d:#}");
    let g = p.dst.status().unwrap()["guest_progress"].as_u64().unwrap();
    p.dst.wait_progress(g + 2, Duration::from_secs(120)).unwrap();
    dirtier_ok(&p.dst);
}

/// A dirtier VM in a slow (20 MB/s) postcopy between two testbed hosts,
/// returned once the destination runs it.
fn slow_postcopy(name: &str) -> Pair {
    let p = pair(name, "dirtier", "128M", false);
    p.src.wait_progress(1, Duration::from_secs(60)).unwrap();
    p.migrate(json!({"mode": "postcopy", "max_bandwidth": 20_000_000u64}));
    wait_for("postcopy", Duration::from_secs(60), || status(&p.dst)["status"] == "postcopy-active");
    p
}

#[test]
fn killed_processes_during_postcopy_are_reported() {
    // Destination killed: the source says so and keeps its memory (alive,
    // paused, refusing to run).
    let mut p = slow_postcopy("pckd");
    p.dst.kill();
    wait_for("the source to pause", Duration::from_secs(60), || status(&p.src)["status"] == "postcopy-paused");
    let s = status(&p.src);
    assert!(s["error"].as_str().unwrap().contains("still holds its missing pages"), "{s:#}");
    assert_eq!(s["committed"], true, "{s:#}");
    assert!(p.src.exec("cont", json!({})).is_err(), "the source must not run again");
    assert_eq!(p.src.status().unwrap()["status"], "paused");

    // Source killed: the destination reports the pages that are lost.
    let mut p = slow_postcopy("pcks");
    p.src.kill();
    wait_for("the destination to pause", Duration::from_secs(60), || status(&p.dst)["status"] == "postcopy-paused");
    let d = status(&p.dst);
    let e = d["error"].as_str().unwrap();
    assert!(e.contains("pages are still on the source") && e.contains("lost"), "{d:#}");
    assert!(d["remaining_pages"].as_u64().unwrap() > 0);
}
