//! A VM with a PVRDMA device on testbed host 0 and `transit rdma peer` on
//! host 2, real rnicd processes on both: the guest firmware's workloads
//! (stream, ring, table, atomic) checked on both sides; two VMs with the
//! same QPNs and keys (different GIDs) against one peer host; 1% loss; a
//! save on host 0 and a restore on host 1 in the middle of everything (the
//! restored device claims the GID on its new host). The peer is never told
//! about the move.

mod pvrdma_bed;

use pvrdma_bed::*;
use serde_json::json;
use std::time::Duration;
use vmm::testing::{transit_bin, unique_name, TempPath, VmProcess};

#[test]
fn every_workload_checked_by_guest_and_peer() {
    let bed = Bed::new("pvg-all");
    let gid = bed.vm_gid(1);
    let vm = bed.vm(0, gid, "count=300");
    let peer = Peer::start(&bed, &vm, &[]);
    let rep = peer.report();
    let res = guest_result(&bed, &vm);
    assert!(res.starts_with("pvrdma: PASS"), "{res}\n{}", vm.console());
    assert_all_verified(&rep, 300);
}

/// A VM on host `h` running the workloads with firmware `args` in `memory`
/// of RAM (the big WRITE's buffer and 256 QPs need more than the default).
fn vm_with_memory(bed: &Bed, h: usize, gid: std::net::Ipv4Addr, args: &str, memory: &str) -> VmProcess {
    let name = unique_name("pvrdma");
    let (spec, fw_args) = (format!("gid={gid}"), format!("gid={gid} {args}"));
    let all = ["vm", "run", "--name", &name, "--memory", memory, "--workload", "pvrdma", "--args", &fw_args, "--pvrdma", &spec];
    VmProcess::start(bed.tb.host(h).command(transit_bin()), &name, &all).unwrap()
}

/// Each workload on `qps / 4` QPs with `count` of each per QP: every QP's
/// checks hold on both sides.
fn many_qps(prefix: &str, qps: u64, count: u64) {
    let bed = Bed::new(prefix);
    let gid = bed.vm_gid(1);
    let vm = vm_with_memory(&bed, 0, gid, &format!("count={count} qps={qps}"), "256M");
    let ids = guest_ids(&vm);
    assert!(ids.contains(&format!("qps={qps}")), "{ids}");
    let peer = Peer::start(&bed, &vm, &[]);
    let rep = peer.report();
    let res = guest_result(&bed, &vm);
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
    let gid = bed.vm_gid(1);
    let vm = vm_with_memory(&bed, 0, gid, "count=200 bigwrite=64M bigrounds=3", "256M");
    let peer = Peer::start(&bed, &vm, &[]);
    let rep = peer.report();
    let res = guest_result(&bed, &vm);
    assert!(res.starts_with("pvrdma: PASS") && res.contains(" big=3"), "{res}\n{}", vm.console());
    assert_all_verified(&rep, 200);
    assert_eq!(rep["workloads"]["big"]["verified"], 3, "{rep:#}");
    assert_eq!(rep["workloads"]["big"]["bytes_verified"], 3 * (64u64 << 20), "{rep:#}");
}

#[test]
fn two_vms_with_the_same_ids_on_one_host() {
    let bed = Bed::new("pvg-two");
    let (g1, g2) = (bed.vm_gid(1), bed.vm_gid(2));
    let (a, b) = (bed.vm(0, g1, "count=200"), bed.vm(0, g2, "count=200"));
    let (ia, ib) = (guest_ids(&a), guest_ids(&b));
    // Each VM's device numbers from its own namespace: the same QPNs and keys.
    let strip = |s: &str| s.split_whitespace().filter(|w| !w.starts_with("gid=")).collect::<Vec<_>>().join(" ");
    assert_eq!(strip(&ia), strip(&ib), "the two VMs should have identical IDs apart from the GID");
    let (pa, pb) = (Peer::start(&bed, &a, &[]), Peer::start(&bed, &b, &[]));
    let (ra, rb) = (pa.report(), pb.report());
    for (vm, rep) in [(&a, &ra), (&b, &rb)] {
        assert!(guest_result(&bed, vm).starts_with("pvrdma: PASS"), "{}", vm.console());
        assert_all_verified(rep, 200);
    }
}

#[test]
fn exactly_once_at_one_percent_loss() {
    let bed = Bed::new("pvg-loss");
    for h in [0, 2] {
        bed.tb.set_loss(h, 0, 1.0).unwrap();
    }
    let gid = bed.vm_gid(1);
    let vm = bed.vm(0, gid, "count=300");
    let peer = Peer::start(&bed, &vm, &["--timeout", "12"]);
    let rep = peer.report();
    assert!(guest_result(&bed, &vm).starts_with("pvrdma: PASS"), "{}", vm.console());
    assert_all_verified(&rep, 300);
}

#[test]
fn save_on_one_host_restore_on_another_mid_stream() {
    let bed = Bed::new("pvg-move");
    let gid = bed.vm_gid(1);
    let mut vm = bed.vm(0, gid, "count=0");
    let mut peer = Peer::start(&bed, &vm, PEER);
    let before = vm.wait_progress(300, Duration::from_secs(120)).unwrap();
    let save = TempPath::new(&format!("{}.save", vm.name));
    vm.exec("save", json!({"filename": save.path()})).unwrap();
    assert!(bed.holds(0, gid), "the VM's device claims its GID on host 0");
    vm.kill();
    // Its namespace closed with the process: host 0 released the GID, and
    // the restored device claims it on host 1.
    bed.wait_released(0, gid);
    let name = unique_name("pvrdma-moved");
    let moved = VmProcess::start(bed.tb.host(1).command(transit_bin()), &name, &["vm", "restore", save.path().to_str().unwrap()]).unwrap();
    let after = moved.wait_progress(before + 300, Duration::from_secs(120)).unwrap();
    assert!(bed.holds(1, gid) && !bed.holds(0, gid));
    peer.wait_progress(PEER_STEP, Duration::from_secs(120));
    // Read before the peer's run ends: once it is gone, the guest's next
    // operations fail, as they should.
    let console = moved.console();
    let rep = peer.stop();
    assert_guest_clean(&console);
    assert!(after > before);
    assert_peer_clean(&rep);
    for w in ["stream", "ring", "table", "atomic"] {
        assert!(rep["workloads"][w]["verified"].as_u64().unwrap() > 0, "{w}: {rep:#}");
    }
}
