//! The guest firmware waits for completions by interrupt: a VM running
//! `workload=pvrdma-bench` against `transit rdma peer` (as bench/pvrdma
//! does), ordered to ping-pong SENDs with `wait=1`, where `Cq::wait` arms
//! the CQ and halts until the CQ notification's MSI-X interrupt. Every
//! round trip needs one, so the run ends only if each arrives; the device
//! counts the messages it sent and none lost, and no WAIT doorbell slept.
//! Then a save on host 0 and a restore on host 1 (the vCPU's GDT, TSS and
//! IDT, its local APIC and the device's MSI-X state travel) and the same
//! order again on the restored VM.

mod pvrdma_bed;

use pvrdma_bed::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use vmm::testing::{transit_bin, unique_name, TempPath, VmProcess};

/// The guest's next mailbox message after sequence `after`.
fn next_message(vm: &VmProcess, after: u64) -> (u64, String) {
    let t0 = Instant::now();
    loop {
        let r = vm.exec("mailbox-read", json!({})).unwrap();
        let seq = r["seq"].as_u64().unwrap_or(0);
        if seq > after {
            return (seq, r["data"].as_str().unwrap_or("").to_string());
        }
        assert!(t0.elapsed() < Duration::from_secs(120), "no guest message after {after}; console:\n{}", vm.console());
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn counters(vm: &VmProcess) -> Value {
    let all = vm.exec("query-pvrdma", json!({})).unwrap();
    all[0]["counters"].clone()
}

/// Orders `iters` SEND round trips waited for by interrupt; returns the
/// guest's message sequence after its answer.
fn latency_by_interrupt(vm: &VmProcess, seq: u64, iters: u64) -> u64 {
    let before = counters(vm);
    vm.exec("mailbox-write", json!({"data": format!("lat size=2 iters={iters} wait=1")})).unwrap();
    let (seq, msg) = next_message(vm, seq);
    assert!(msg.starts_with("result test=lat") && msg.contains(&format!("iters={iters}")), "{msg}\n{}", vm.console());
    let after = counters(vm);
    let n = |c: &Value, k: &str| c[k].as_u64().unwrap_or(0);
    // A round trip whose completion lands between the guest's check and
    // its ARM doorbell is found by the poll after the arm and needs no
    // interrupt; every halt does, and the guest wakes only by one.
    let halts: u64 = msg.split_whitespace().find_map(|w| w.strip_prefix("irq_waits=")).and_then(|v| v.parse().ok()).unwrap_or(0);
    assert!(halts > 0, "the guest never halted for an interrupt: {msg}");
    assert!(n(&after, "interrupts") - n(&before, "interrupts") >= halts, "one CQ interrupt per halt at least: {msg} {after}");
    assert_eq!(n(&after, "lost_interrupts"), 0, "{after}");
    // No count of WAIT doorbells here: between orders the firmware idles
    // in an idle CQ's WAIT doorbell (so that it leaves the core to others),
    // and those sleeps fall inside any window the test can read.
    seq
}

#[test]
fn guest_waits_for_completions_by_interrupt_before_and_after_a_move() {
    let bed = Bed::new("pvg-irq");
    let gid = bed.vm_gid(1);
    let name = unique_name("pvirq");
    let (spec, args) = (format!("gid={gid}"), format!("gid={gid}"));
    let all = ["vm", "run", "--name", &name, "--memory", "64M", "--workload", "pvrdma-bench", "--args", &args, "--pvrdma", &spec];
    let mut vm = VmProcess::start(bed.tb.host(0).command(transit_bin()), &name, &all).unwrap();
    let _peer = Peer::start(&bed, &vm, &["--duration", "300"]);
    let (seq, msg) = next_message(&vm, 1);
    assert_eq!(msg, "ready", "{}", vm.console());
    let seq = latency_by_interrupt(&vm, seq, 300);

    let save = TempPath::new(&format!("{}.save", vm.name));
    vm.exec("save", json!({"filename": save.path()})).unwrap();
    vm.kill();
    bed.wait_released(0, gid);
    let name = unique_name("pvirq-moved");
    let moved = VmProcess::start(bed.tb.host(1).command(transit_bin()), &name, &["vm", "restore", save.path().to_str().unwrap()]).unwrap();
    latency_by_interrupt(&moved, seq, 300);
}
