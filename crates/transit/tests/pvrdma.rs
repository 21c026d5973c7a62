//! A VM with a PVRDMA device on testbed host 0 and `transit rdma peer` on
//! host 2, real rnicd processes on both: the guest firmware's workloads
//! (stream, ring, table, atomic) checked on both sides; two VMs with the
//! same QPNs and keys (different GIDs) against one peer host; 1% loss; a
//! save on host 0 and a restore on host 1 in the middle of everything. The
//! IDs go through the VM's mailbox once, as a guest agent would carry them;
//! the peer is never told about the move. rnicd serves its default socket
//! (`/run/transit/rnicd-ADDR.sock`), so a VM finds the rnicd of whatever
//! host it runs on.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read};
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};
use testbed::{HostChild, Testbed, TestbedOpts};
use vmm::testing::{transit_bin, unique_name, TempPath, VmProcess};

/// Fields drop in order: VMs and peers first, then rnicd, then the testbed.
struct Bed {
    nics: Vec<(HostChild, PathBuf)>,
    tb: Testbed,
}

impl Bed {
    fn new(prefix: &str) -> Bed {
        let tb = Testbed::create(TestbedOpts::new(prefix, 3)).expect("testbed (needs root)");
        let mut nics = Vec::new();
        for i in 0..3 {
            let h = tb.host(i);
            let sock = rnic::daemon::default_socket_path(h.addr(0));
            let _ = std::fs::remove_file(&sock);
            let child = h.spawn(transit_bin().to_str().unwrap(), ["rnicd", "--addr", &h.addr(0).to_string()]).unwrap();
            let t0 = Instant::now();
            while !sock.exists() {
                assert!(t0.elapsed() < Duration::from_secs(20), "rnicd did not start");
                std::thread::sleep(Duration::from_millis(10));
            }
            nics.push((child, sock));
        }
        Bed { nics, tb }
    }

    /// The address a VM's GID gets on host `h` (it moves with the VM).
    fn vm_gid(&self, h: usize, j: usize) -> Ipv4Addr {
        let gid = self.tb.spare_addr(0, j);
        self.tb.host(h).sh(&format!("sysctl -qw net.ipv4.conf.all.arp_announce=2; ip addr add {gid}/24 dev eth0")).unwrap();
        gid
    }

    fn vm(&self, h: usize, gid: Ipv4Addr, args: &str) -> VmProcess {
        self.vm_with_memory(h, gid, args, "64M")
    }

    fn vm_with_memory(&self, h: usize, gid: Ipv4Addr, args: &str, memory: &str) -> VmProcess {
        let name = unique_name("pvrdma");
        let spec = format!("gid={gid}");
        let fw_args = format!("gid={gid} {args}");
        VmProcess::start(
            self.tb.host(h).command(transit_bin()),
            &name,
            &["vm", "run", "--name", &name, "--memory", memory, "--workload", "pvrdma", "--args", &fw_args, "--pvrdma", &spec],
        )
        .unwrap()
    }
}

impl Drop for Bed {
    fn drop(&mut self) {
        for (_, s) in self.nics.drain(..) {
            let _ = std::fs::remove_file(s);
        }
    }
}

/// The guest's message once it has published one.
fn guest_ids(vm: &VmProcess) -> String {
    let t0 = Instant::now();
    loop {
        let r = vm.exec("mailbox-read", json!({})).unwrap();
        if r["seq"].as_u64().unwrap_or(0) > 0 {
            return r["data"].as_str().unwrap().to_string();
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "the guest published nothing; console:\n{}", vm.console());
        std::thread::sleep(Duration::from_millis(50));
    }
}

struct Peer {
    child: Child,
    /// The guest's IDs as the peer read them.
    ids: PathBuf,
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.ids);
    }
}

impl Peer {
    /// Starts the peer on host 2 with the guest's IDs and writes its own
    /// into the VM's mailbox.
    fn start(bed: &Bed, vm: &VmProcess, extra: &[&str]) -> Peer {
        let ids = guest_ids(vm);
        let f = std::env::temp_dir().join(format!("{}.guest-ids", vm.name));
        std::fs::write(&f, &ids).unwrap();
        let mut cmd = bed.tb.host(2).command(transit_bin());
        cmd.args(["rdma", "peer", "--guest", f.to_str().unwrap(), "--sock", bed.nics[2].1.to_str().unwrap(), "--stall", "60"])
            .args(extra)
            .stdout(Stdio::piped())
            .stdin(Stdio::null());
        let mut child = cmd.spawn().unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.as_mut().unwrap()).read_line(&mut line).unwrap();
        assert!(line.contains("gid="), "the peer did not start: {line:?}");
        vm.exec("mailbox-write", json!({"data": line.trim()})).unwrap();
        Peer { child, ids: f }
    }

    fn report(mut self) -> Value {
        let mut out = String::new();
        self.child.stdout.as_mut().unwrap().read_to_string(&mut out).unwrap();
        let _ = self.child.wait();
        let last = out.lines().last().unwrap_or("").to_string();
        serde_json::from_str(&last).unwrap_or_else(|e| panic!("bad peer report {last:?}: {e}"))
    }
}

/// The guest's result line once it is there.
fn guest_result(vm: &VmProcess) -> String {
    let t0 = Instant::now();
    loop {
        let r = vm.exec("mailbox-read", json!({})).unwrap();
        let d = r["data"].as_str().unwrap_or("");
        if d.starts_with("pvrdma: ") {
            return d.to_string();
        }
        assert!(t0.elapsed() < Duration::from_secs(300), "no result from the guest; console:\n{}", vm.console());
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn assert_all_verified(rep: &Value, count: u64) {
    eprintln!("peer report: {rep}");
    assert_eq!(rep["ok"], true, "{rep:#}");
    assert_eq!(
        (rep["lost"].as_u64(), rep["duplicated"].as_u64(), rep["error_completions"].as_u64()),
        (Some(0), Some(0), Some(0)),
        "{rep:#}"
    );
    assert_eq!(rep["workloads"]["stream"]["verified"], count, "{rep:#}");
    assert_eq!(rep["workloads"]["ring"]["verified"], count, "{rep:#}");
    assert_eq!(rep["workloads"]["atomic"]["detail"]["counter"], count, "{rep:#}");
    assert!(rep["workloads"]["table"]["verified"].as_u64().unwrap() > 0, "{rep:#}");
}

#[test]
fn every_workload_checked_by_guest_and_peer() {
    let bed = Bed::new("pvg-all");
    let gid = bed.vm_gid(0, 1);
    let vm = bed.vm(0, gid, "count=300");
    let peer = Peer::start(&bed, &vm, &[]);
    let rep = peer.report();
    let res = guest_result(&vm);
    assert!(res.starts_with("pvrdma: PASS"), "{res}\n{}", vm.console());
    assert_all_verified(&rep, 300);
}

/// Each workload on `qps / 4` QPs with `count` of each per QP: every QP's
/// checks hold on both sides.
fn many_qps(prefix: &str, qps: u64, count: u64) {
    let bed = Bed::new(prefix);
    let gid = bed.vm_gid(0, 1);
    let vm = bed.vm_with_memory(0, gid, &format!("count={count} qps={qps}"), "256M");
    let ids = guest_ids(&vm);
    assert!(ids.contains(&format!("qps={qps}")), "{ids}");
    let peer = Peer::start(&bed, &vm, &[]);
    let rep = peer.report();
    let res = guest_result(&vm);
    assert!(res.starts_with("pvrdma: PASS"), "{res}\n{}", vm.console());
    assert!(res.contains(&format!("qps={qps} ")), "{res}");
    assert_eq!(rep["qps"], qps, "{rep:#}");
    for w in ["stream", "ring", "table", "atomic"] {
        assert_eq!(rep["workloads"][w]["qps"], qps / 4, "{w}: {rep:#}");
        assert_eq!(rep["workloads"][w]["qps_done"], qps / 4, "{w}: {rep:#}");
    }
    assert_all_verified(&rep, count * qps / 4);
}

#[test]
fn sixteen_qps_each_checked() {
    many_qps("pvg-q16", 16, 100);
}

#[test]
fn two_hundred_fifty_six_qps_each_checked() {
    many_qps("pvg-q256", 256, 10);
}

#[test]
fn big_write_verified_whole_beside_every_workload() {
    let bed = Bed::new("pvg-big");
    let gid = bed.vm_gid(0, 1);
    let vm = bed.vm_with_memory(0, gid, "count=200 bigwrite=64M bigrounds=3", "256M");
    let peer = Peer::start(&bed, &vm, &[]);
    let rep = peer.report();
    let res = guest_result(&vm);
    assert!(res.starts_with("pvrdma: PASS") && res.contains(" big=3"), "{res}\n{}", vm.console());
    assert_all_verified(&rep, 200);
    assert_eq!(rep["workloads"]["big"]["verified"], 3, "{rep:#}");
    assert_eq!(rep["workloads"]["big"]["bytes_verified"], 3 * (64u64 << 20), "{rep:#}");
}

#[test]
fn two_vms_with_the_same_ids_on_one_host() {
    let bed = Bed::new("pvg-two");
    let (g1, g2) = (bed.vm_gid(0, 1), bed.vm_gid(0, 2));
    let (a, b) = (bed.vm(0, g1, "count=200"), bed.vm(0, g2, "count=200"));
    let (ia, ib) = (guest_ids(&a), guest_ids(&b));
    // Each VM's device numbers from its own namespace: the same QPNs and keys.
    let strip = |s: &str| s.split_whitespace().filter(|w| !w.starts_with("gid=")).collect::<Vec<_>>().join(" ");
    assert_eq!(strip(&ia), strip(&ib), "the two VMs should have identical IDs apart from the GID");
    let (pa, pb) = (Peer::start(&bed, &a, &[]), Peer::start(&bed, &b, &[]));
    let (ra, rb) = (pa.report(), pb.report());
    for (vm, rep) in [(&a, &ra), (&b, &rb)] {
        assert!(guest_result(vm).starts_with("pvrdma: PASS"), "{}", vm.console());
        assert_all_verified(rep, 200);
    }
}

#[test]
fn exactly_once_at_one_percent_loss() {
    let bed = Bed::new("pvg-loss");
    for h in [0, 2] {
        bed.tb.set_loss(h, 0, 1.0).unwrap();
    }
    let gid = bed.vm_gid(0, 1);
    let vm = bed.vm(0, gid, "count=300");
    let peer = Peer::start(&bed, &vm, &["--timeout", "12"]);
    let rep = peer.report();
    assert!(guest_result(&vm).starts_with("pvrdma: PASS"), "{}", vm.console());
    assert_all_verified(&rep, 300);
}

#[test]
fn save_on_one_host_restore_on_another_mid_stream() {
    let bed = Bed::new("pvg-move");
    let gid = bed.vm_gid(0, 1);
    let mut vm = bed.vm(0, gid, "count=0");
    // The peer waits out the move: 7 retries of a 4 s ACK timeout.
    let peer = Peer::start(&bed, &vm, &["--duration", "30", "--timeout", "20"]);
    let before = vm.wait_progress(300, Duration::from_secs(120)).unwrap();
    let save = TempPath::new(&format!("{}.save", vm.name));
    vm.exec("save", json!({"filename": save.path()})).unwrap();
    vm.kill();
    // The address moves with the VM, announced by the new host.
    bed.tb.host(1).sh(&format!("ip addr add {gid}/24 dev eth0")).unwrap();
    bed.tb.host(1).in_netns(move || rnic::announce::gratuitous_arp(gid, 2)).unwrap().unwrap();
    bed.tb.host(0).sh(&format!("ip addr del {gid}/24 dev eth0")).unwrap();
    let name = unique_name("pvrdma-moved");
    let moved = VmProcess::start(bed.tb.host(1).command(transit_bin()), &name, &["vm", "restore", save.path().to_str().unwrap()]).unwrap();
    let after = moved.wait_progress(before + 300, Duration::from_secs(120)).unwrap();
    // Read before the peer's run ends: once it is gone, the guest's next
    // operations fail, as they should.
    let console = moved.console();
    let rep = peer.report();
    assert!(!console.contains("VIOLATION") && !console.contains("FAIL"), "{console}");
    eprintln!("peer report: {rep}");
    assert!(after > before);
    assert_eq!(rep["ok"], true, "{rep:#}");
    assert_eq!(
        (rep["lost"].as_u64(), rep["duplicated"].as_u64(), rep["error_completions"].as_u64()),
        (Some(0), Some(0), Some(0)),
        "{rep:#}"
    );
    for w in ["stream", "ring", "table", "atomic"] {
        assert!(rep["workloads"][w]["verified"].as_u64().unwrap() > 0, "{w}: {rep:#}");
    }
}
