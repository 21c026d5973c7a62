//! The testbed's promises: hosts reach each other, removal leaves nothing behind.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::Command;
use testbed::{Testbed, TestbedOpts};

fn netns_names() -> String {
    String::from_utf8(Command::new("ip").args(["netns", "list"]).output().unwrap().stdout).unwrap()
}

fn pid_alive(pid: u32) -> bool {
    // A zombie (killed, not yet reaped) counts as gone.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => !s[s.rfind(')').unwrap() + 1..].trim_start().starts_with('Z'),
        Err(_) => false,
    }
}

#[test]
fn hosts_reach_each_other_over_tcp_on_every_nic() {
    let tb = Testbed::create(TestbedOpts::new("tb-reach", 3).nics(2)).unwrap();
    for k in 0..2 {
        let server = tb.host(2);
        let addr = server.addr(k);
        let listener = server.in_netns(|| TcpListener::bind((addr, 7000)).unwrap()).unwrap();
        for client in [tb.host(0), tb.host(1)] {
            let mut s = client.in_netns(|| TcpStream::connect((addr, 7000)).unwrap()).unwrap();
            let (mut conn, peer) = listener.accept().unwrap();
            assert_eq!(peer.ip(), client.addr(k), "source address is the client's own on NIC {k}");
            s.write_all(b"ping").unwrap();
            let mut buf = [0u8; 4];
            conn.read_exact(&mut buf).unwrap();
            assert_eq!(&buf, b"ping");
        }
    }
    // NICs are on separate subnets.
    assert_ne!(tb.subnet(0), tb.subnet(1));
}

#[test]
fn command_runs_inside_the_host() {
    let tb = Testbed::create(TestbedOpts::new("tb-cmd", 2)).unwrap();
    let out = tb.host(1).sh("ip -4 -o addr show dev eth0").unwrap();
    assert!(out.contains(&tb.host(1).addr(0).to_string()), "{out}");
    let out = tb.host(0).command("ip").args(["-o", "link"]).output().unwrap();
    let links = String::from_utf8_lossy(&out.stdout);
    assert!(links.contains("eth0") && links.contains("lo:"), "{links}");
    assert!(!links.contains("br0"), "the bridge lives in the fabric namespace, not the host: {links}");
    assert!(tb.host(0).sh("exit 3").is_err());
    assert!(tb.try_host(2).is_err());
}

#[test]
fn drop_removes_namespaces_links_and_processes() {
    let tb = Testbed::create(TestbedOpts::new("tb-drop", 2).nics(2)).unwrap();
    let name = tb.name().to_string();
    let fab = tb.fabric();
    // One process through the guard, one detached that nobody waits for.
    let guarded = tb.host(0).spawn("sleep", ["1000"]).unwrap();
    let guarded_pid = guarded.id();
    let mut detached = tb.host(1).command("sleep").arg("1001").spawn().unwrap();
    let detached_pid = detached.id();
    let listed = netns_names();
    assert!(listed.contains(&format!("{name}-h0")) && listed.contains(&fab), "{listed}");
    std::mem::forget(guarded); // leave it to the testbed's own removal
    drop(tb);
    let listed = netns_names();
    assert!(!listed.contains(&name), "namespaces left: {listed}");
    assert!(!pid_alive(guarded_pid) && !pid_alive(detached_pid), "processes survive the testbed");
    detached.wait().unwrap();
    let links = String::from_utf8(Command::new("ip").args(["-o", "link"]).output().unwrap().stdout).unwrap();
    assert!(!links.contains("h0e0") && !links.contains("h1e1"), "links left in the root namespace: {links}");
    assert!(!std::path::Path::new(&format!("{}/{name}.json", testbed::STATE_DIR)).exists());
    assert!(testbed::down(&name).is_err(), "a removed testbed is unknown");
}

#[test]
fn host_child_guard_kills_on_drop() {
    let tb = Testbed::create(TestbedOpts::new("tb-guard", 1)).unwrap();
    let child = tb.host(0).spawn("sleep", ["1000"]).unwrap();
    let pid = child.id();
    assert!(pid_alive(pid));
    drop(child);
    assert!(!pid_alive(pid));
}

#[test]
fn parallel_testbeds_do_not_collide() {
    let tbs: Vec<Testbed> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4).map(|_| s.spawn(|| Testbed::create(TestbedOpts::new("tb-par", 2)).unwrap())).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, a) in tbs.iter().enumerate() {
        for b in &tbs[i + 1..] {
            assert_ne!(a.name(), b.name());
            assert_ne!(a.subnet(0), b.subnet(0));
        }
    }
    // Each is whole and isolated: host 0 reaches its own host 1, not another testbed's.
    for tb in &tbs {
        let a = tb.host(1).addr(0);
        let l = tb.host(1).in_netns(|| TcpListener::bind((a, 7001)).unwrap()).unwrap();
        tb.host(0).in_netns(|| TcpStream::connect((a, 7001)).unwrap()).unwrap();
        l.accept().unwrap();
        let other = tbs.iter().find(|o| o.name() != tb.name()).unwrap();
        let r = tb.host(0).sh(&format!("ip route get {}", other.host(1).addr(0)));
        assert!(r.is_err(), "another testbed's subnet must be unreachable: {r:?}");
    }
}
