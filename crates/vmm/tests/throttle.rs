//! The vCPU throttle of auto-converge: a throttled guest keeps running at
//! any level, and lifting the throttle gives it back all of its time.

use std::time::{Duration, Instant};
use vmm::config::VmConfig;
use vmm::vm::Vm;

/// Dirtier passes the guest completes within `d`.
fn passes_within(vm: &Vm, d: Duration) -> u64 {
    let before = vm.guest_progress();
    std::thread::sleep(d);
    vm.guest_progress() - before
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
        assert!(passes_within(&vm, Duration::from_secs(2)) > 0, "no dirtier pass in 2 s at {pct} % throttle");
    }
    vm.set_cpu_throttle(0);
    assert!(passes_within(&vm, Duration::from_millis(500)) > 0, "no dirtier pass after the throttle was lifted");
    vm.shutdown();
}
