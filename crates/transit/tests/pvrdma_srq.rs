//! A VM whose stream QPs share one SRQ (`workload=pvrdma srq=1`) against
//! `transit rdma peer` on another host, real rnicd and vmm processes: the
//! peer sends each QP its sequence-numbered stream, the guest takes the
//! receives from the SRQ and checks every message byte for byte against
//! the QP it arrived at; beside the ring, table and atomic workloads; and
//! the same saved on host 0 and restored on host 1 mid-stream, and live
//! migrated there and back in precopy and postcopy (the SRQ and its posted
//! receives move with the VM; the peer is never told).

mod pvrdma_bed;

use pvrdma_bed::*;
use serde_json::json;
use std::time::Duration;
use vmm::testing::{transit_bin, unique_name, TempPath, VmProcess};

/// 12 QPs, 3 of each workload: the 3 stream QPs on one SRQ.
const ARGS: &str = "qps=12 srq=1";

fn srq_in_use(vm: &VmProcess) {
    let q = vm.exec("query-pvrdma", json!({})).unwrap();
    let srqs = &q[0]["srqs"];
    assert_eq!(srqs.as_array().map(|a| a.len()), Some(1), "{q:#}");
    assert_eq!(srqs[0]["qps"].as_array().map(|a| a.len()), Some(3), "the 3 stream QPs on the SRQ: {q:#}");
}

#[test]
fn stream_qps_share_one_srq_checked_by_guest_and_peer() {
    let bed = Bed::new("pvg-srq");
    let gid = bed.vm_gid(1);
    let vm = bed.vm_sized(0, gid, "128M", &format!("count=200 {ARGS}"), "", &[]);
    let peer = Peer::start(&bed, &vm, &[]);
    srq_in_use(&vm);
    let rep = peer.report();
    let res = guest_result(&bed, &vm);
    assert!(res.starts_with("pvrdma: PASS"), "{res}\n{}", vm.console());
    assert!(vm.console().contains("3 stream QPs share SRQ"), "{}", vm.console());
    assert_peer_clean(&rep);
    assert_eq!(rep["workloads"]["stream"]["qps"], 3, "{rep:#}");
    assert_eq!(rep["workloads"]["stream"]["verified"], 3 * 200, "{rep:#}");
    assert_eq!(rep["workloads"]["ring"]["verified"], 3 * 200, "{rep:#}");
}

#[test]
fn srq_saved_on_one_host_restored_on_another_mid_stream() {
    let bed = Bed::new("pvg-srqmv");
    let gid = bed.vm_gid(1);
    let mut vm = bed.vm_sized(0, gid, "128M", &format!("count=0 {ARGS}"), "", &[]);
    let mut peer = Peer::start(&bed, &vm, PEER);
    let before = vm.wait_progress(300, Duration::from_secs(120)).unwrap();
    srq_in_use(&vm);
    let save = TempPath::new(&format!("{}.save", vm.name));
    vm.exec("save", json!({"filename": save.path()})).unwrap();
    vm.kill();
    bed.wait_released(0, gid);
    let name = unique_name("pvrdma-srq-moved");
    let moved = VmProcess::start(bed.tb.host(1).command(transit_bin()), &name, &["vm", "restore", save.path().to_str().unwrap()]).unwrap();
    srq_in_use(&moved);
    let after = moved.wait_progress(before + 300, Duration::from_secs(120)).unwrap();
    peer.wait_progress(PEER_STEP, Duration::from_secs(120));
    let console = moved.console();
    let rep = peer.stop();
    assert_guest_clean(&console);
    assert!(after > before);
    assert_peer_clean(&rep);
    for w in ["stream", "ring", "table", "atomic"] {
        assert!(rep["workloads"][w]["verified"].as_u64().unwrap() > 0, "{w}: {rep:#}");
    }
}

#[test]
fn srq_moves_with_live_migration_there_and_back() {
    let load = Load { args: "count=0 qps=12 srq=1", memory: "128M", max_bandwidth: 0 };
    let rep = there_and_back("pvg-srqlm", load, [Mode::Precopy, Mode::Postcopy], |_, _| {});
    for w in ["stream", "ring", "table", "atomic"] {
        assert!(rep["workloads"][w]["verified"].as_u64().unwrap() > 0, "{w}: {rep:#}");
    }
}
