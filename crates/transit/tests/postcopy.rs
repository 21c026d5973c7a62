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
        // Capped until the destination's guest has waited for a page:
        // uncapped, the push can bring what is missing before a starved
        // vCPU touches one. A hybrid (which never converges with a
        // downtime of 0) switches once the guest's writes outpace a quarter
        // of the link, after the first eighth of RAM.
        p.migrate(json!({"mode": mode, "channels": 2, "downtime_ms": 0, "max_bandwidth": 32 << 20}));
        wait_for("a fault on the destination", Duration::from_secs(120), || {
            let d = status(&p.dst);
            assert_ne!(d["status"], "completed", "every page came before the guest touched one: {d:#}");
            d["faults"].as_u64().unwrap_or(0) > 0
        });
        p.src.exec("migrate-set-parameters", json!({"max_bandwidth": 0})).unwrap();
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

/// `transit vm migrate-set-parameters --max-bandwidth 0` lifts the cap of
/// a running postcopy's push: started at 256 KiB/s, its 128 MiB would take
/// over eight minutes (a paused destination fetches nothing itself); it
/// completes long before, byte-exact.
#[test]
fn a_cap_lifted_from_the_command_line_frees_a_running_push() {
    let p = pair("pcsetbw", "fill", "128M", true);
    p.src.wait_progress(1, Duration::from_secs(60)).unwrap();
    p.migrate(json!({"mode": "postcopy", "max_bandwidth": 256 * 1024}));
    wait_for("postcopy", Duration::from_secs(60), || status(&p.dst)["status"] == "postcopy-active");
    let set = |args: &[&str]| {
        let mut c = std::process::Command::new(transit_bin());
        c.args(["vm", "migrate-set-parameters", "--control"]).arg(&p.src.socket).args(args);
        c.output().unwrap()
    };
    let refused = set(&[]);
    assert!(!refused.status.success() && String::from_utf8_lossy(&refused.stderr).contains("nothing to set"));
    let out = set(&["--max-bandwidth", "0"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let params: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(params["max_bandwidth"], 0, "{params}");
    p.wait_done();
    let a = p.src.exec("query-ram-digest", json!({})).unwrap();
    let b = p.dst.exec("query-ram-digest", json!({})).unwrap();
    assert_eq!(a, b, "RAM differs");
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
    // 40 MB/s: 256 MiB take seconds, the cut lands in the middle. The
    // command-line client is asked to wait through the pause.
    let mut client = migrate_client(&p, &["--mode", "postcopy", "--channels", "2", "--max-bandwidth", "40M", "--wait-recovery"]);
    wait_for("postcopy", Duration::from_secs(60), || status(&p.dst)["status"] == "postcopy-active");
    std::thread::sleep(Duration::from_millis(500));
    p.tb.link_down(1, 0).unwrap();
    wait_for("the source to pause", Duration::from_secs(60), || status(&p.src)["status"] == "postcopy-paused");
    wait_for("the destination to pause", Duration::from_secs(60), || status(&p.dst)["status"] == "postcopy-paused");
    assert!(client.try_wait().unwrap().is_none(), "with --wait-recovery the client waits through the pause");
    p.tb.link_up(1, 0).unwrap();
    p.src.exec("migrate", json!({"uri": p.uri(), "resume": true})).unwrap();
    let (s, d) = p.wait_done();
    assert_eq!(client_exit(client, Duration::from_secs(30)).0, Some(0), "the client ends well once recovered");
    assert!(s["recoveries"].as_u64().unwrap() >= 1, "{s:#}");
    assert!(d["paused_ms"].as_f64().unwrap() > 0.0, "{d:#}");
    let g = p.dst.status().unwrap()["guest_progress"].as_u64().unwrap();
    p.dst.wait_progress(g + 2, Duration::from_secs(120)).unwrap();
    dirtier_ok(&p.dst);
}

/// `transit vm migrate` of `p.src` to `p.dst` with `args`, as a user runs it.
fn migrate_client(p: &Pair, args: &[&str]) -> std::process::Child {
    let to = format!("{}:4444", p.tb.host(1).addr(0));
    let mut c = std::process::Command::new(transit_bin());
    c.args(["vm", "migrate", "--control"]).arg(&p.src.socket).args(["--to", &to, "--json"]).args(args);
    c.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
    vmm::testing::die_with_parent(&mut c);
    c.spawn().unwrap()
}

/// Waits at most `bound` for a client to exit; its exit code and stderr.
fn client_exit(mut c: std::process::Child, bound: Duration) -> (Option<i32>, String) {
    let t = Instant::now();
    while c.try_wait().unwrap().is_none() {
        if t.elapsed() > bound {
            let _ = c.kill();
            let out = c.wait_with_output().unwrap();
            panic!("`transit vm migrate` still runs after {bound:?}: {}", String::from_utf8_lossy(&out.stderr));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = c.wait_with_output().unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
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

/// Longest a control command may take to answer on a loaded machine: the
/// vmm waits at most 2 s for vCPUs, everything else answers at once.
const ANSWER_BOUND: Duration = Duration::from_secs(6);

/// Runs `cmd` on `vm` and returns its result, asserting it answered within
/// [`ANSWER_BOUND`].
fn answers(vm: &VmProcess, cmd: &str, args: Value) -> Result<Value, String> {
    let t = Instant::now();
    let r = vm.exec(cmd, args).map_err(|e| format!("{e:#}"));
    assert!(t.elapsed() < ANSWER_BOUND, "{cmd} took {:?} to answer: {r:?}", t.elapsed());
    r
}

#[test]
fn a_destination_whose_source_died_answers_every_command() {
    let mut p = slow_postcopy("pcdead");
    p.src.kill();
    wait_for("the destination to pause", Duration::from_secs(60), || status(&p.dst)["status"] == "postcopy-paused");
    // The dirtier soon touches a page that will never come.
    wait_for("a vCPU to wait for a page", Duration::from_secs(60), || {
        p.dst.status().unwrap()["vcpus"].as_array().unwrap().iter().any(|v| v["waiting_for_page"] == true)
    });

    let s = answers(&p.dst, "query-status", json!({})).unwrap();
    assert_eq!(s["status"], "postcopy-paused", "{s:#}");
    assert_eq!(s["running"], false, "{s:#}");
    assert!(s["postcopy"]["pages_missing"].as_u64().unwrap() > 0, "{s:#}");
    assert!(s["postcopy"]["error"].as_str().unwrap().contains("lost"), "{s:#}");

    // `stop` cannot stop a vCPU blocked on a page: it says so and stops nothing.
    let e = answers(&p.dst, "stop", json!({})).unwrap_err();
    assert!(e.contains("waits for a page") && e.contains("pages still on the source") && e.contains("quit"), "{e}");
    assert_eq!(answers(&p.dst, "query-status", json!({})).unwrap()["status"], "postcopy-paused");
    // Reading guest RAM would wait for those pages too.
    for (cmd, args) in [
        ("check-dirtier", json!({})),
        ("save", json!({"filename": "/tmp/never-written.save"})),
        ("pmemsave", json!({"val": 0, "size": 4096, "filename": "/tmp/never-written.mem"})),
        ("query-ram-digest", json!({})),
    ] {
        let e = answers(&p.dst, cmd, args).unwrap_err();
        assert!(e.contains("not all here"), "{cmd}: {e}");
    }
    assert!(!std::path::Path::new("/tmp/never-written.save").exists());
    for cmd in ["query-migrate", "query-vm", "query-console", "query-commands"] {
        answers(&p.dst, cmd, json!({})).unwrap();
    }
    answers(&p.dst, "query-vcpus", json!({})).unwrap_err();

    // `quit` always works.
    answers(&p.dst, "quit", json!({})).unwrap();
    p.dst.wait_exit(Duration::from_secs(20)).unwrap();
}

#[test]
fn migrate_returns_when_postcopy_pauses() {
    let mut p = pair("pcret", "dirtier", "128M", false);
    p.src.wait_progress(1, Duration::from_secs(60)).unwrap();
    let client = migrate_client(&p, &["--mode", "postcopy", "--max-bandwidth", "20M"]);
    wait_for("postcopy", Duration::from_secs(60), || status(&p.dst)["status"] == "postcopy-active");
    p.dst.kill();
    // The source sees the dead peer at once (its sockets close).
    let (code, err) = client_exit(client, Duration::from_secs(30));
    assert_eq!(code, Some(3), "exit status of a paused postcopy; stderr: {err}");
    assert!(err.contains("postcopy migration paused") && err.contains("migrate-recover") && err.contains("--resume"), "{err}");
    assert_eq!(status(&p.src)["status"], "postcopy-paused");
}
