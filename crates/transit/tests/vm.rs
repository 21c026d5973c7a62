//! The VM platform end to end: real vmm processes, real namespaces.

use serde_json::{json, Value};
use std::process::Command;
use std::time::Duration;
use vmm::testing::{transit_bin, unique_name, TempPath, VmProcess};

fn dirtier_ok(vm: &VmProcess) -> Value {
    let r = vm.exec("check-dirtier", json!({})).unwrap();
    assert_eq!(r["bad_pages"], 0, "dirtier oracle failed: {r}");
    r
}

#[test]
fn boots_runs_dirtier_and_stop_cont_work() {
    let name = unique_name("boot");
    let vm = VmProcess::run_local(&name, &["--memory", "64M", "--workload", "dirtier"]).unwrap();
    vm.wait_progress(3, Duration::from_secs(60)).unwrap();
    assert!(vm.console().contains("dirtier: start=0x400000"), "console: {}", vm.console());
    vm.exec("stop", json!({})).unwrap();
    let s1 = vm.status().unwrap();
    assert_eq!(s1["status"], "paused");
    dirtier_ok(&vm);
    std::thread::sleep(Duration::from_millis(300));
    let s2 = vm.status().unwrap();
    // Stopped means stopped: no guest progress, guest clock frozen.
    assert_eq!(s1["guest_progress"], s2["guest_progress"]);
    assert_eq!(s1["guest_time_ns"], s2["guest_time_ns"]);
    vm.exec("cont", json!({})).unwrap();
    let p = s2["guest_progress"].as_u64().unwrap();
    vm.wait_progress(p + 2, Duration::from_secs(60)).unwrap();
    vm.exec("stop", json!({})).unwrap();
    dirtier_ok(&vm);
}

#[test]
fn selftest_exits_with_guest_code() {
    let name = unique_name("self");
    let mut vm = VmProcess::run_local(&name, &["--memory", "16M", "--workload", "selftest"]);
    // The guest may exit before the socket is polled; both are fine.
    if let Ok(vm) = vm.as_mut() {
        assert_eq!(vm.wait_exit(Duration::from_secs(30)).unwrap(), Some(0));
        assert!(vm.console().contains("selftest: sum="));
    }
}

#[test]
fn save_on_host_a_restore_on_host_b_continues() {
    let tb = testbed::Testbed::create(testbed::TestbedOpts::new("vmsave", 2)).unwrap();
    let name = unique_name("save");
    let mut a = VmProcess::start(
        tb.host(0).command(transit_bin()),
        &name,
        &["vm", "run", "--name", &name, "--memory", "128M", "--vcpus", "2", "--workload", "dirtier"],
    )
    .unwrap();
    a.wait_progress(2, Duration::from_secs(60)).unwrap();
    let file = TempPath::new(&format!("{name}.snap"));
    a.exec("save", json!({"filename": file.path()})).unwrap();
    let digest_a = a.exec("query-ram-digest", json!({})).unwrap();
    let cpus_a = a.exec("query-vcpus", json!({})).unwrap();
    let status_a = a.status().unwrap();
    a.kill();

    let bname = format!("{name}-b");
    let b =
        VmProcess::start(tb.host(1).command(transit_bin()), &bname, &["vm", "restore", file.path().to_str().unwrap(), "--paused"]).unwrap();
    assert_eq!(b.exec("query-ram-digest", json!({})).unwrap(), digest_a, "RAM differs after restore");
    assert_eq!(b.exec("query-vcpus", json!({})).unwrap(), cpus_a, "vCPU state differs after restore");
    let status_b = b.status().unwrap();
    assert_eq!(status_b["guest_time_ns"], status_a["guest_time_ns"]);
    assert_eq!(status_b["guest_progress"], status_a["guest_progress"]);
    dirtier_ok(&b);

    // The guest continues: let it run for two minutes of guest time and
    // check the oracle along the way.
    b.exec("cont", json!({})).unwrap();
    let mut last = 0;
    for _ in 0..4 {
        std::thread::sleep(Duration::from_secs(30));
        b.exec("stop", json!({})).unwrap();
        dirtier_ok(&b);
        let s = b.status().unwrap();
        let p = s["guest_progress"].as_u64().unwrap();
        assert!(p > last, "guest made no progress");
        last = p;
        b.exec("cont", json!({})).unwrap();
    }
    let t = b.status().unwrap()["guest_time_ns"].as_u64().unwrap();
    assert!(t >= 120_000_000_000, "only {t} ns of guest time");
}

#[test]
fn bad_control_input_gets_json_errors() {
    let name = unique_name("ctl");
    let vm = VmProcess::run_local(&name, &["--memory", "16M"]).unwrap();
    let mut c = vm.client().unwrap();
    let r = c.raw("this is not json").unwrap();
    assert_eq!(r["error"]["class"], "GenericError");
    let r = c.raw(r#"{"execute": "no-such-command", "id": 7}"#).unwrap();
    assert_eq!(r["error"]["class"], "CommandNotFound");
    assert_eq!(r["id"], 7);
    let r = c.raw(r#"{"execute": "stop", "arguments": [1]}"#).unwrap();
    assert_eq!(r["error"]["class"], "GenericError");
    let r = c.raw(r#"{"arguments": {}}"#).unwrap();
    assert_eq!(r["error"]["class"], "GenericError");
    let r = c.raw(r#"{"execute": "pmemsave", "arguments": {"val": 0, "size": 4096}}"#).unwrap();
    assert!(r["error"]["desc"].as_str().unwrap().contains("stopped") || r["error"]["desc"].as_str().unwrap().contains("filename"));
    // Still alive and answering.
    assert!(c.execute("query-status", json!({})).is_ok());
}

/// A running VM cannot receive a migration, and a VM receiving one cannot
/// be started before it has all of its state.
#[test]
fn migrate_incoming_and_cont_refused_where_they_would_mix_two_vms() {
    let running = VmProcess::run_local(&unique_name("inrun"), &["--memory", "16M"]).unwrap();
    let e = running.client().unwrap().execute("migrate-incoming", json!({"uri": "tcp:127.0.0.1:0"})).unwrap_err();
    assert!(e.to_string().contains("the VM is running"), "{e}");

    let waiting = VmProcess::run_local(&unique_name("inwait"), &["--memory", "16M", "--incoming", "tcp:127.0.0.1:0"]).unwrap();
    let mut c = waiting.client().unwrap();
    let e = c.execute("cont", json!({})).unwrap_err();
    assert!(e.to_string().contains("receiving a migration"), "{e}");
    assert!(c.execute("query-status", json!({})).is_ok());
}

fn run_fails(args: &[&str]) -> String {
    let out = Command::new(transit_bin()).args(args).output().unwrap();
    assert!(!out.status.success(), "expected failure for {args:?}");
    String::from_utf8_lossy(&out.stderr).to_string()
}

#[test]
fn bad_configs_and_files_fail_clearly_and_leave_nothing() {
    let name = unique_name("bad");
    let sock = format!("/run/transit/test/{name}.sock");
    let e = run_fails(&["vm", "run", "--name", &name, "--memory", "100T", "--control", &sock]);
    assert!(e.contains("more than this machine has"), "{e}");
    let e = run_fails(&["vm", "run", "--name", &name, "--firmware", "/nonexistent/fw.elf", "--control", &sock]);
    assert!(e.contains("does not exist"), "{e}");
    let e = run_fails(&["vm", "run", "--name", &name, "--memory", "lots", "--control", &sock]);
    assert!(e.contains("not a size"), "{e}");

    // A real save file, then truncated and damaged copies of it.
    let vm = VmProcess::run_local(&name, &["--memory", "32M", "--workload", "dirtier"]).unwrap();
    vm.wait_progress(1, Duration::from_secs(60)).unwrap();
    let good = TempPath::new(&format!("{name}.snap"));
    vm.exec("save", json!({"filename": good.path()})).unwrap();
    drop(vm);
    let bytes = std::fs::read(good.path()).unwrap();
    let trunc = TempPath::new(&format!("{name}-trunc.snap"));
    std::fs::write(trunc.path(), &bytes[..bytes.len() / 2]).unwrap();
    let e = run_fails(&["vm", "restore", trunc.path().to_str().unwrap(), "--control", &sock]);
    assert!(e.contains("truncated"), "{e}");
    let damaged = TempPath::new(&format!("{name}-dmg.snap"));
    let mut d = bytes.clone();
    let i = d.len() - 5000;
    d[i] ^= 0xff;
    std::fs::write(damaged.path(), &d).unwrap();
    let e = run_fails(&["vm", "restore", damaged.path().to_str().unwrap(), "--control", &sock]);
    assert!(e.contains("damaged"), "{e}");
    let notsave = TempPath::new(&format!("{name}-x.snap"));
    std::fs::write(notsave.path(), b"hello world, not a save file").unwrap();
    let e = run_fails(&["vm", "restore", notsave.path().to_str().unwrap(), "--control", &sock]);
    assert!(e.contains("not a Transit save file"), "{e}");
    // Nothing left behind: no socket, no process with this name.
    assert!(!std::path::Path::new(&sock).exists());
    let ps = Command::new("pgrep").args(["-f", &name]).output().unwrap();
    assert!(ps.stdout.is_empty(), "left a process: {}", String::from_utf8_lossy(&ps.stdout));
}

#[test]
fn nvme_controller_from_the_command_line_and_control_socket() {
    let name = unique_name("nvme");
    let vm = VmProcess::run_local(
        &name,
        &["--memory", "128M", "--workload", "nvme-verify", "--args", "qd=32", "--nvme", "name=nvme0,ns=mem:32M"],
    )
    .unwrap();
    vm.wait_progress(100, Duration::from_secs(120)).unwrap();
    let r = vm.exec("nvme-ns-add", json!({"spec": "mem:8M"})).unwrap();
    let nsid = r["nsid"].as_u64().unwrap();
    let t = std::time::Instant::now();
    while !vm.console().contains("namespaces changed") {
        assert!(t.elapsed() < Duration::from_secs(60), "the guest never saw the namespace event:\n{}", vm.console());
        std::thread::sleep(Duration::from_millis(50));
    }
    vm.exec("nvme-ns-remove", json!({"nsid": nsid})).unwrap();
    let e = vm.exec("nvme-ns-remove", json!({"nsid": 99})).unwrap_err().to_string();
    assert!(e.contains("not attached"), "{e}");
    let e = vm.exec("nvme-ns-add", json!({"controller": "nope", "spec": "mem:8M"})).unwrap_err().to_string();
    assert!(e.contains("DeviceNotFound"), "{e}");
    let q = vm.exec("query-nvme", json!({})).unwrap();
    assert_eq!(q[0]["name"], "nvme0");
    // Save mid-verify, restore, and the verifier keeps passing.
    let file = TempPath::new(&format!("{name}.snap"));
    vm.exec("save", json!({"filename": file.path()})).unwrap();
    let p = vm.status().unwrap()["guest_progress"].as_u64().unwrap();
    drop(vm);
    let b = VmProcess::start(Command::new(transit_bin()), &format!("{name}-r"), &["vm", "restore", file.path().to_str().unwrap()]).unwrap();
    b.wait_progress(p + 100, Duration::from_secs(120)).unwrap();
    assert!(!b.console().contains("FAIL"), "{}", b.console());
}

/// The clock the guest reads (a 64-bit MMIO load, which the unicorn vCPU
/// splits into two 32-bit halves) is whole, monotonic across the 4.3 s carry
/// into its high half, and the same clock query-status reports.
#[test]
fn guest_clock_is_whole_monotonic_and_matches_guest_time() {
    let name = unique_name("clock");
    let vm = VmProcess::run_local(&name, &["--memory", "16M", "--workload", "clock"]).unwrap();
    let t1 = vm.status().unwrap()["guest_time_ns"].as_u64().unwrap();
    // The guest publishes every clock read as progress: it must catch up with
    // what the host saw earlier and get past the first carry (2^32 ns).
    let target = t1.max(5_000_000_000);
    // The VM exits if the guest sees the clock go backwards: show its console.
    let failed = |e: anyhow::Error| -> ! { panic!("{e:#}; console:\n{}", vm.console()) };
    vm.wait_progress(target, Duration::from_secs(120)).unwrap_or_else(|e| failed(e));
    let s = vm.status().unwrap_or_else(|e| failed(e));
    assert!(s["guest_exit_code"].is_null(), "guest saw the clock go backwards: {}", vm.console());
    let seen = s["guest_progress"].as_u64().unwrap();
    let host = s["guest_time_ns"].as_u64().unwrap();
    assert!(seen >= target && seen <= host, "guest read {seen} ns, host says {host} ns (target {target})");
}

fn console_range(console: &str) -> (u64, u64) {
    let line = console.lines().find(|l| l.starts_with("dirtier: start=")).expect("dirtier banner");
    let hex = |key: &str| {
        let v = line.split_whitespace().find_map(|w| w.strip_prefix(key)).unwrap();
        u64::from_str_radix(v.trim_start_matches("0x"), 16).unwrap()
    };
    (hex("start="), hex("end="))
}

/// `rate=N` holds over many seconds of guest time: never more than N pages
/// per guest second, and not far less (the guest can do ~100x this rate, so
/// a busy host only delays it briefly). Runs past the clock's 4.3 s carry,
/// where a clock with a broken high half would cut the rate in half.
#[test]
fn dirtier_rate_limit_holds_over_guest_time() {
    const RATE: u64 = 76_800; // 5 passes/s over 60 MiB
    let name = unique_name("rate");
    let args = format!("rate={RATE}");
    let vm = VmProcess::run_local(&name, &["--memory", "64M", "--workload", "dirtier", "--args", &args]).unwrap();
    let t0 = std::time::Instant::now();
    let s = loop {
        let s = vm.status().unwrap();
        if s["guest_time_ns"].as_u64().unwrap() >= 9_000_000_000 {
            break s;
        }
        assert!(t0.elapsed() < Duration::from_secs(120), "guest time stuck: {s}");
        std::thread::sleep(Duration::from_millis(200));
    };
    let (start, end) = console_range(&vm.console());
    let pages_per_pass = (end - start) / 4096;
    let passes = s["guest_progress"].as_u64().unwrap() as f64;
    let expected = RATE as f64 * s["guest_time_ns"].as_u64().unwrap() as f64 / 1e9 / pages_per_pass as f64;
    assert!(passes <= expected + 1.0, "{passes} passes, the rate allows {expected:.1}");
    assert!(passes >= 0.8 * expected - 1.0, "{passes} passes, expected about {expected:.1}");
    vm.exec("stop", json!({})).unwrap();
    dirtier_ok(&vm);
}
