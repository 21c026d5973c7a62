//! The command line (`transit testbed ...`, here as `testbed-cli testbed ...`).

use std::process::{Command, Output};

fn cli(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_testbed-cli")).arg("testbed").args(args).output().unwrap()
}

fn ok(args: &[&str]) -> String {
    let out = cli(args);
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn err(args: &[&str]) -> String {
    let out = cli(args);
    assert!(!out.status.success(), "{args:?} should fail");
    String::from_utf8(out.stderr).unwrap()
}

/// Removes the CLI testbed even if an assertion fails.
struct Down(String);
impl Drop for Down {
    fn drop(&mut self) {
        let _ = cli(&["down", &self.0]);
    }
}

#[test]
fn up_exec_shape_list_down() {
    let name = format!("tbcli-{}", std::process::id());
    let _guard = Down(name.clone());
    let up = ok(&["up", &name, "--hosts", "3", "--nics", "2", "--rate-mbit", "100", "--loss", "1"]);
    assert!(up.contains(&format!("{name}-h2")), "{up}");
    assert!(ok(&["list"]).contains(&name));

    let addrs = ok(&["exec", &name, "h1", "--", "ip", "-o", "-4", "addr"]);
    assert!(addrs.contains("eth0") && addrs.contains("eth1") && addrs.contains(".2/24"), "{addrs}");
    assert_eq!(ok(&["exec", &name, "2", "--", "cat", "/proc/self/comm"]).trim(), "cat");
    assert_eq!(cli(&["exec", &name, "0", "--", "sh", "-c", "exit 7"]).status.code(), Some(7));

    assert!(err(&["exec", &name, "h9", "--", "true"]).contains("no host 9"));
    assert!(err(&["exec", "tbcli-no-such", "h0", "--", "true"]).contains("no testbed named"));
    assert!(err(&["up", &name, "--hosts", "1"]).contains("already exists"));
    assert!(err(&["shape", &name, "h0", "--nic", "2", "--loss", "1"]).contains("no NIC 2"));

    ok(&["shape", &name, "h0", "--rate-mbit", "20", "--dup", "5", "--reorder", "10", "--reorder-delay-ms", "5"]);
    let tc = Command::new("tc").args(["-n", &format!("{name}-h0"), "qdisc", "show", "dev", "eth0"]).output().unwrap();
    assert!(String::from_utf8_lossy(&tc.stdout).contains("rate 20Mbit"));
    let nft = ok(&["exec", &name, "h0", "--", "nft", "list", "ruleset"]);
    assert!(nft.contains("tb_loss_eth0") && nft.contains("tb_dup_eth0") && nft.contains("tb_reorder_eth0"), "{nft}");
    let daemons = Command::new("ip").args(["netns", "pids", &format!("{name}-h0")]).output().unwrap();
    assert!(!daemons.stdout.is_empty(), "the reorder daemon runs inside the host");
    // Traffic still flows through all of it.
    let tb = testbed::Testbed::open(&name).unwrap();
    let a = tb.host(1).addr(0);
    let l = tb.host(1).in_netns(|| std::net::TcpListener::bind((a, 7003)).unwrap()).unwrap();
    let mut s = tb.host(0).in_netns(|| std::net::TcpStream::connect((a, 7003)).unwrap()).unwrap();
    let (mut c, _) = l.accept().unwrap();
    std::io::Write::write_all(&mut s, &[7u8; 100_000]).unwrap();
    let mut got = vec![0u8; 100_000];
    std::io::Read::read_exact(&mut c, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 7));
    drop(tb); // a handle from open() removes nothing
    ok(&["shape", &name, "h0", "--link", "down"]);
    ok(&["shape", &name, "h0", "--link", "up", "--reorder", "0", "--dup", "0", "--rate-mbit", "0"]);
    let nft = ok(&["exec", &name, "h0", "--", "nft", "list", "ruleset"]);
    assert!(!nft.contains("tb_dup_eth0") && !nft.contains("tb_reorder_eth0") && nft.contains("tb_loss_eth0"));

    ok(&["exec", &name, "h1", "--", "sh", "-c", "sleep 1000 >/dev/null 2>&1 &"]);
    assert!(ok(&["down", &name]).contains("removed"));
    let netns = String::from_utf8(Command::new("ip").args(["netns", "list"]).output().unwrap().stdout).unwrap();
    assert!(!netns.contains(&name), "{netns}");
    assert!(!ok(&["list"]).contains(&name));
    let ps = String::from_utf8(Command::new("ps").args(["-eo", "args"]).output().unwrap().stdout).unwrap();
    assert!(!ps.contains(&format!("reorder-daemon {name}")), "the daemon is gone");
    assert!(err(&["down", &name]).contains("no testbed named"));
}

#[test]
fn help_explains_every_command() {
    let help = ok(&["--help"]);
    for cmd in ["up", "exec", "down", "list", "shape", "cpu-rtt"] {
        assert!(help.contains(cmd), "{help}");
    }
    assert!(!help.contains("reorder-daemon"), "internal commands stay hidden");
    assert!(ok(&["shape", "--help"]).contains("--reorder-delay-ms"));
}

#[test]
fn non_root_gets_a_clear_error() {
    // Drop to user "nobody" (skip where setpriv is missing).
    let Ok(out) = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", env!("CARGO_BIN_EXE_testbed-cli")])
        .args(["testbed", "up", "tbcli-nonroot", "--hosts", "1"])
        .output()
    else {
        return;
    };
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("needs root"), "{stderr}");
}

#[test]
fn cpu_rtt_measures_two_cpus_and_refuses_bad_ones() {
    // SAFETY: sysconf has no preconditions.
    if unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) } < 2 {
        return;
    }
    let out = ok(&["cpu-rtt", "--iters", "2000", "--json"]);
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert!(v["cpu_rtt_ns"].as_u64().unwrap() > 0, "{out}");
    assert_eq!(v["cpus"], serde_json::json!([0, 1]));
    assert!(v["shared_cache"].is_boolean(), "{out}");
    assert!(ok(&["cpu-rtt", "--cpus", "1,0", "--iters", "100"]).contains("from CPU 1 to CPU 0"));
    assert!(err(&["cpu-rtt", "--cpus", "0,0"]).contains("two different CPUs"));
    assert!(err(&["cpu-rtt", "--cpus", "0"]).contains("two CPUs"));
    assert!(err(&["cpu-rtt", "--cpus", "0,4096"]).contains("two different CPUs"));
    assert!(err(&["cpu-rtt", "--iters", "0"]).contains("at least one round trip"));
}
