//! The mailbox end to end: a real vmm process whose firmware answers each
//! host message (`workload=mailbox`), through `mailbox-read` /
//! `mailbox-write` on the control socket; both messages survive a save
//! file and a restore in a new process; bad requests get errors.

use serde_json::{json, Value};
use std::process::Command;
use std::time::{Duration, Instant};
use vmm::testing::{transit_bin, unique_name, TempPath, VmProcess};

/// Polls `mailbox-read` until the guest's message is `want`.
fn wait_guest(vm: &VmProcess, want: &str) -> Value {
    let t0 = Instant::now();
    loop {
        let r = vm.exec("mailbox-read", json!({})).unwrap();
        if r["data"] == want {
            return r;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "guest message {r} is not {want:?}; console:\n{}", vm.console());
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn messages_both_ways_survive_save_and_restore() {
    let mut vm = VmProcess::run_local(&unique_name("mbox"), &["--memory", "32M", "--workload", "mailbox"]).unwrap();
    let r = wait_guest(&vm, "hello");
    assert_eq!((r["seq"].as_u64(), r["host_seq"].as_u64()), (Some(1), Some(0)), "{r}");
    let w = vm.exec("mailbox-write", json!({"data": "gid=10.200.0.9 stream.qpn=17"})).unwrap();
    assert_eq!(w["seq"], 1);
    wait_guest(&vm, "echo 1 gid=10.200.0.9 stream.qpn=17");
    vm.wait_progress(1, Duration::from_secs(10)).unwrap();

    // Bad requests: errors, and the mailbox is unchanged.
    assert!(vm.exec("mailbox-write", json!({})).unwrap_err().to_string().contains("\"data\""));
    assert!(vm.exec("mailbox-write", json!({"data": 5})).is_err());
    let big = "x".repeat(devices::mailbox::MSG_MAX + 1);
    assert!(vm.exec("mailbox-write", json!({"data": big})).unwrap_err().to_string().contains("at most"));
    let r = vm.exec("mailbox-read", json!({})).unwrap();
    assert_eq!((r["host_seq"].as_u64(), r["host_data"].as_str()), (Some(1), Some("gid=10.200.0.9 stream.qpn=17")));

    let save = TempPath::new(&format!("{}.save", vm.name));
    vm.exec("save", json!({"filename": save.path()})).unwrap();
    vm.kill();
    let name = unique_name("mbox-restored");
    let vm = VmProcess::start(Command::new(transit_bin()), &name, &["vm", "restore", save.path().to_str().unwrap()]).unwrap();
    let r = vm.exec("mailbox-read", json!({})).unwrap();
    assert_eq!(r["data"], "echo 1 gid=10.200.0.9 stream.qpn=17", "{r}");
    assert_eq!((r["seq"].as_u64(), r["host_seq"].as_u64()), (Some(2), Some(1)), "{r}");
    // The guest carries on where it was: the next host message is its second.
    let w = vm.exec("mailbox-write", json!({"data": "after the move"})).unwrap();
    assert_eq!(w["seq"], 2);
    wait_guest(&vm, "echo 2 after the move");
}
