// SPDX-License-Identifier: GPL-2.0-or-later
//! Unmodified libibverbs programs on the drop-in: Debian's ibv_devinfo,
//! ibv_rc_pingpong and perftest between two testbed hosts (each with a real
//! rnicd process, both programs loading target/.../ibverbs/libibverbs.so.1
//! through LD_LIBRARY_PATH), a C program built against the system's
//! <infiniband/verbs.h>, and the exported symbol set against rdma-core's.
//! Needs root (network namespaces) and scripts/setup's packages.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{finish, lib_dir, profile_dir, rnicd, Bed, CCheck};
use testbed::{HostChild, Testbed, TestbedOpts};

#[test]
fn devinfo_shows_rnic0() {
    let bed = Bed::new("ibvdi", 1);
    let out = bed.run(0, "ibv_devinfo", &["-v"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "ibv_devinfo failed: {text}{}", String::from_utf8_lossy(&out.stderr));
    for want in [
        "hca_id:\trnic0".to_string(),
        "state:\t\t\tPORT_ACTIVE (4)".into(),
        "link_layer:\t\tEthernet".into(),
        "atomic_cap:\t\t\tATOMIC_HCA (1)".into(),
        format!("GID[  0]:\t\t::ffff:{}, RoCE v2", bed.nics[0].addr),
    ] {
        assert!(text.contains(&want), "ibv_devinfo lacks {want:?}:\n{text}");
    }
    // In an RDMA namespace of rnicd's (TRANSIT_IBV_NAMESPACE): its GID.
    let out = bed.command(0, "ibv_devinfo", &["-v"]).env("TRANSIT_IBV_NAMESPACE", "10.99.0.7").output().expect("ibv_devinfo");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("GID[  0]:\t\t::ffff:10.99.0.7, RoCE v2"), "{text}");
    // The same through `transit rdma exec` (here its standalone binary),
    // which sets LD_LIBRARY_PATH itself.
    lib_dir();
    let out = bed
        .tb
        .host(0)
        .command(profile_dir().join("transit-rdma"))
        .args(["exec", "--sock", bed.nics[0].sock.to_str().unwrap(), "--", "ibv_devinfo", "-l"])
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .expect("transit-rdma exec");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("1 HCA found") && text.contains("rnic0"), "{text}");
}

#[test]
fn rc_pingpong_between_hosts() {
    let bed = Bed::new("ibvpp", 2);
    // Busy polling, then completion events; --chk verifies every buffer.
    for extra in [&[][..], &["-e"][..]] {
        let mut args = vec!["-d", "rnic0", "-g", "0", "-n", "500", "-s", "4096", "--chk"];
        args.extend_from_slice(extra);
        let (s, c) = bed.pair("ibv_rc_pingpong", &args, 18515);
        for out in [&s, &c] {
            assert!(out.contains("4096000 bytes in") && out.contains("500 iters in"), "{extra:?}:\n{out}");
            assert!(out.contains(&format!("GID ::ffff:{}", bed.nics[0].addr)), "{out}");
        }
    }
}

/// rnicd's clients still connected (the stats query's own connection included).
fn live_clients(bed: &Bed, i: usize) -> i64 {
    let ctx = verbs::Context::open(Some(&bed.nics[i].sock)).expect("open rnicd");
    let st = ctx.stats().expect("stats");
    st["clients_connected"].as_i64().unwrap() - st["clients_gone"].as_i64().unwrap()
}

#[test]
fn a_killed_program_loses_only_its_own_objects() {
    let bed = Bed::new("ibvkill", 2);
    // A pingpong server holds a PD, an MR, a CQ and a QP while it waits for
    // its client; SIGKILL it there.
    let args = ["-d", "rnic0", "-g", "0", "-n", "100", "--chk"];
    let mut server = HostChild::new(bed.command(0, "ibv_rc_pingpong", &args).spawn().expect("server"));
    bed.wait_listen(0, 18515, &mut server);
    assert_eq!(live_clients(&bed, 0), 2, "the server and this query");
    drop(server);
    let t0 = Instant::now();
    while live_clients(&bed, 0) != 1 {
        assert!(t0.elapsed() < Duration::from_secs(10), "rnicd kept the killed program's connection");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The device serves the next programs as before.
    let (s, c) = bed.pair("ibv_rc_pingpong", &args, 18515);
    assert!(s.contains("100 iters in") && c.contains("100 iters in"), "{s}\n{c}");
}

/// The result row of a perftest report: the numbers after the "#bytes" header.
fn perftest_row(out: &str) -> Vec<f64> {
    let mut lines = out.lines().skip_while(|l| !l.trim_start().starts_with("#bytes"));
    lines.next();
    let row = lines.next().unwrap_or_else(|| panic!("no result row:\n{out}"));
    row.split_whitespace().map(|x| x.parse().unwrap_or_else(|_| panic!("bad row {row:?}"))).collect()
}

#[test]
fn perftest_between_hosts() {
    let bed = Bed::new("ibvpt", 2);
    let common = ["-d", "rnic0", "-x", "0", "-F"];
    for (tool, iters, size) in [
        ("ib_write_bw", "2000", "65536"),
        ("ib_read_bw", "2000", "65536"),
        ("ib_send_bw", "2000", "65536"),
        ("ib_atomic_bw", "2000", "8"),
        ("ib_send_lat", "500", "2"),
        ("ib_write_lat", "200", "2"),
    ] {
        let mut args = common.to_vec();
        args.extend_from_slice(&["-n", iters]);
        if tool != "ib_atomic_bw" {
            args.extend_from_slice(&["-s", size]);
        }
        let (s, c) = bed.pair(tool, &args, 18515);
        // Bandwidth tests report on both sides, latency tests on the client.
        let report = if tool.ends_with("_lat") { &c } else { &s };
        let row = perftest_row(report);
        assert_eq!(row[0], size.parse::<f64>().unwrap(), "{tool}: size\n{report}");
        assert_eq!(row[1], iters.parse::<f64>().unwrap(), "{tool}: iterations\n{report}");
        // bw: BW peak, BW average (MB/s, two decimals), MsgRate (Mpps, six
        // decimals: 2,000 8-byte atomics on a loaded host can take long
        // enough for their MB/s to print 0.00); lat: t_min, t_max,
        // typical, avg...
        let value = row[4];
        assert!(value > 0.0, "{tool}: no result\n{report}");
        eprintln!("{tool}: {}", report.lines().find(|l| l.trim_start().starts_with(size)).unwrap_or(""));
    }
}

/// An idle CQ made without a channel: beside an rnicd under ordinary
/// scheduling `ibv_poll_cq` naps on the context's idle channel (the program
/// sleeps, leaving rnicd the CPU); beside a real-time rnicd, which preempts
/// the program anyway, it only yields (docs/ibverbs.md, "What works").
#[test]
fn poll_cq_naps_only_beside_an_ordinary_rnicd() {
    let tb = Testbed::create(TestbedOpts::new("ibvnap", 2)).expect("testbed (needs root)");
    let nics = [rnicd(&tb, 0, &[]), rnicd(&tb, 1, &["--sched-fifo", "1"])];
    let exe = CCheck::build("idle_poll");
    let sleeps = |i: usize| {
        let mut c = tb.host(i).command(exe.path());
        c.env("LD_LIBRARY_PATH", lib_dir()).env("TRANSIT_RNICD_SOCK", &nics[i].sock);
        c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let out = finish(HostChild::new(c.spawn().expect("run idle_poll")));
        let t = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() && t.contains("all ok"), "idle_poll on host {i}:\n{t}");
        let n = t.lines().find_map(|l| l.strip_prefix("voluntary ")).unwrap_or_else(|| panic!("no count:\n{t}"));
        n.trim().parse::<i64>().unwrap()
    };
    // 200 empty polls: all but the first few nap, each a sleep of its own.
    let ordinary = sleeps(0);
    assert!(ordinary >= 100, "beside an ordinary rnicd, 200 empty polls slept only {ordinary} times");
    // Yields are no voluntary switches; a handful may come from elsewhere
    // (page faults on first touch, the kernel's own work).
    let realtime = sleeps(1);
    assert!(realtime <= 10, "beside a real-time rnicd, 200 empty polls slept {realtime} times");
}

#[test]
fn c_program_loopback_memory_and_bad_calls() {
    let bed = Bed::new("ibvc", 1);
    let exe = CCheck::build("verbs_check");
    let out = bed.run(0, exe.path(), &[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("all ok"), "{text}{}", String::from_utf8_lossy(&out.stderr));
}

fn exports(lib: &Path) -> Vec<String> {
    let out = Command::new("objdump").arg("-T").arg(lib).output().expect("objdump");
    let mut v: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| (l.contains(" DF ") || l.contains(" DO ")) && !l.contains("*UND*"))
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (ver, name) = (f[f.len() - 2], f[f.len() - 1]);
            // Default versions only; compat aliases are in parentheses.
            (!ver.starts_with('(') && ver != name).then(|| format!("{name}@{ver}"))
        })
        .collect();
    v.sort();
    v
}

#[test]
fn exports_match_rdma_core() {
    let system = Path::new("/usr/lib/x86_64-linux-gnu/libibverbs.so.1");
    assert!(system.exists(), "rdma-core's libibverbs.so.1 is missing (scripts/setup installs it)");
    let ours = exports(&lib_dir().join("libibverbs.so.1"));
    let theirs = exports(system);
    assert_eq!(theirs.len(), 146, "rdma-core 44 exports 146 names");
    assert_eq!(ours, theirs);
}

/// Passed, skipped and failed (or errored) cases per module, from the
/// runner's -v output ("name (tests.MODULE.Class.name)", then possibly a
/// docstring line, then "... RESULT"). A warning Python prints while a case
/// runs comes between the "... " and the result, which then starts a line
/// of its own.
fn per_module(text: &str) -> std::collections::BTreeMap<String, [usize; 3]> {
    let mut out = std::collections::BTreeMap::<String, [usize; 3]>::new();
    let mut module = String::new();
    let mut running = false;
    for l in text.lines() {
        if let Some(m) = l.split(" (tests.").nth(1).and_then(|r| r.split('.').next()) {
            module = m.to_string();
            running = false;
        }
        let result = match l.rsplit_once(" ... ") {
            Some((_, r)) => {
                running = true;
                r
            }
            None if running => l,
            None => continue,
        };
        let slot = match result.split_whitespace().next() {
            Some("ok") => 0,
            Some("skipped") => 1,
            Some("FAIL" | "ERROR" | "expected" | "unexpected") => 2,
            _ => continue,
        };
        if module.is_empty() {
            continue;
        }
        out.entry(module.clone()).or_default()[slot] += 1;
        module.clear();
        running = false;
    }
    out
}

/// Passed cases of rdma-core's pyverbs suite on rnic0 (Debian's copy, all
/// 273 cases; the rest skip: mlx5/EFA, ODP, XRC, raw packets...). A run
/// passing fewer, or failing any, fails this test.
const PYVERBS_PASSED: usize = 108;

#[test]
fn pyverbs_suite() {
    let tests = Path::new("/usr/share/doc/rdma-core/tests");
    assert!(tests.join("run_tests.py").exists(), "python3-pyverbs is missing (scripts/setup installs it)");
    let bed = Bed::new("ibvpy", 1);
    // The package gzips most modules: work on an unpacked copy.
    let dir = std::env::temp_dir().join(format!("pyverbs-tests-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let st = Command::new("sh")
        .arg("-c")
        .arg(format!("mkdir -p {d} && cp -r {t}/. {d}/ && gunzip -f {d}/*.gz", d = dir.display(), t = tests.display()))
        .status()
        .unwrap();
    assert!(st.success(), "copying the pyverbs tests");
    let runner = dir.join("run_tests.py");
    let out = bed.run(0, "/usr/bin/python3", &[runner.to_str().unwrap(), "--dev", "rnic0", "--port", "1", "--gid", "0", "-v"]);
    let _ = std::fs::remove_dir_all(&dir);
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    let ran: usize = text
        .lines()
        .find_map(|l| l.strip_prefix("Ran ").and_then(|r| r.split_whitespace().next()).and_then(|n| n.parse().ok()))
        .unwrap_or_else(|| panic!("no summary:\n{text}"));
    let count = |key: &str| -> usize {
        let last = text.lines().rev().find(|l| l.starts_with("OK") || l.starts_with("FAILED")).unwrap_or("");
        last.split(&format!("{key}="))
            .nth(1)
            .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    let (failed, errors, skipped) = (count("failures"), count("errors"), count("skipped"));
    let passed = ran - failed - errors - skipped;
    eprintln!("pyverbs: ran {ran}, passed {passed}, failed {failed}, errors {errors}, skipped {skipped}");
    // PYVERBS_LOG=FILE keeps the runner's whole output (skip reasons).
    if let Ok(f) = std::env::var("PYVERBS_LOG") {
        let _ = std::fs::write(f, &text);
    }
    for (module, [ok, skip, bad]) in per_module(&text) {
        eprintln!("pyverbs {module}: passed {ok}, skipped {skip}, failed {bad}");
    }
    assert!(
        failed == 0 && errors == 0 && passed >= PYVERBS_PASSED,
        "pyverbs: passed {passed} (want >= {PYVERBS_PASSED}), failed {failed}, errors {errors}\n{text}"
    );
}
