//! The vCPU throttle of auto-converge: a throttled guest keeps running at
//! any level, and runs on once the throttle is lifted.

use std::time::{Duration, Instant};
use vmm::config::VmConfig;
use vmm::vm::Vm;

/// Waits until the guest completes another dirtier pass; fails if none
/// comes within a minute (a vCPU the throttle stopped for good). How fast
/// it runs is the bench's business (`bench/vm/run` measures the share a
/// throttled vCPU keeps); a test on a loaded host can only ask that it runs.
fn another_pass(vm: &Vm, what: &str) {
    let (before, t) = (vm.guest_progress(), Instant::now());
    while vm.guest_progress() == before {
        assert!(t.elapsed() < Duration::from_secs(60), "no dirtier pass in 60 s {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn throttled_guest_keeps_running_at_every_level() {
    let config = VmConfig {
        name: "throttle".into(),
        // Small, so that a pass fits the few ms a 99 % throttle leaves.
        memory: 16 << 20,
        vcpus: 1,
        firmware: guest_image::default_path(),
        cmdline: "workload=dirtier".into(),
        nvme: vec![],
        pvrdma: vec![],
    };
    let vm = Vm::build(config, Box::new(|_line: &str| {})).expect("build VM");
    vm.boot().expect("boot");
    vm.resume().expect("run");
    let t = Instant::now();
    while vm.guest_progress() < 2 {
        assert!(t.elapsed() < Duration::from_secs(30), "the dirtier never completed a pass");
        std::thread::sleep(Duration::from_millis(10));
    }
    // The time the guest ran before the throttle is not a share to sleep
    // off: let it run a while unthrottled first.
    std::thread::sleep(Duration::from_secs(3).saturating_sub(t.elapsed()));
    // A fixed sleep per tick would stop the vCPU for good from 50 % on:
    // the tick that lands during the sleep would end the next run at once.
    for pct in [50, 80, 99] {
        vm.set_cpu_throttle(pct);
        assert_eq!(vm.cpu_throttle(), pct);
        another_pass(&vm, &format!("at {pct} % throttle"));
    }
    vm.set_cpu_throttle(0);
    assert_eq!(vm.cpu_throttle(), 0);
    another_pass(&vm, "after the throttle was lifted");
    vm.shutdown();
}
