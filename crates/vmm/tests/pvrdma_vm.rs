//! `transit vm run --pvrdma gid=...`: a VM with a PVRDMA device in its
//! host's rnicd namespace, `query-pvrdma` on the control socket (errors as
//! JSON errors), save with the device's state and restore, a save file of
//! the old BAR layout (64-bit BARs above 4 GiB) refused, and a bad spec
//! refused.
//! Needs root (a testbed host) and the transit binary.

use serde_json::json;
use testbed::rnicd::Rnicd;
use testbed::{Testbed, TestbedOpts};
use vmm::testing::{transit_bin, unique_name, TempPath, VmProcess};

#[test]
fn a_vm_with_a_pvrdma_device_answers_query_pvrdma() {
    let tb = Testbed::create(TestbedOpts::new("pvvm", 1)).expect("testbed (needs root)");
    let h = tb.host(0);
    let rnicd = Rnicd::start_cmd(&tb, 0, &[transit_bin().to_str().unwrap(), "rnicd"], None, &[]).expect("start rnicd");
    let sock = rnicd.sock.clone();
    let gid = tb.spare_addr(0, 7);
    h.sh(&format!("ip addr add {gid}/24 dev eth0")).unwrap();

    let name = unique_name("pvrdma");
    let spec = format!("gid={gid},rnicd={}", sock.display());
    let vm =
        VmProcess::start(h.command(transit_bin()), &name, &["vm", "run", "--name", &name, "--memory", "64M", "--pvrdma", &spec]).unwrap();
    let all = vm.exec("query-pvrdma", json!({})).unwrap();
    let d = &all[0];
    assert_eq!(d["name"], "pvrdma0", "{all}");
    assert_eq!(d["gid"], gid.to_string());
    assert_eq!(d["state"], "reset", "the firmware did not bring it up");
    assert_eq!(d["objects"], json!({"contexts": 0, "pds": 0, "mrs": 0, "cqs": 0, "qps": 0, "srqs": 0}));
    assert_eq!(vm.exec("query-pvrdma", json!({"device": "pvrdma0"})).unwrap()["gid"], gid.to_string());
    let e = vm.exec("query-pvrdma", json!({"device": "nope"})).unwrap_err().to_string();
    assert!(e.contains("DeviceNotFound"), "{e}");

    // The device's state goes into a save file with the rest of the VM.
    let file = TempPath::new(&format!("{name}.save"));
    vm.exec("stop", json!({})).unwrap();
    vm.exec("save", json!({"filename": file.path()})).unwrap();
    assert!(std::fs::metadata(file.path()).unwrap().len() > 0);
    drop(vm);

    // It restores, its BARs where they were (32-bit, in the PCI hole).
    let again = VmProcess::start(h.command(transit_bin()), &name, &["vm", "restore", file.path().to_str().unwrap(), "--paused"]).unwrap();
    assert_eq!(again.exec("query-pvrdma", json!({})).unwrap()[0]["gid"], gid.to_string());
    drop(again);

    // A save file that does not say where its BARs were comes from a vmm
    // that put them above 4 GiB: refused, with the reason.
    let old = TempPath::new(&format!("{name}-old.save"));
    let reader = vmm::savefile::open(file.path()).unwrap();
    let config = reader.header.config.clone();
    let mut state = reader.state.clone();
    let before = state.sections.len();
    state.sections.retain(|s| s.name != "layout:pci");
    assert_eq!(state.sections.len(), before - 1, "the save file records the PCI BARs");
    let ram = vmm::memory::GuestRam::new(&name, config.memory).unwrap();
    reader.read_ram(&ram).unwrap();
    vmm::savefile::write(old.path(), &config, &state, &ram).unwrap();
    let out = h.command(transit_bin()).args(["vm", "restore", old.path().to_str().unwrap(), "--paused"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("above 4 GiB") && err.contains("PCI hole"), "{err}");

    // A spec without a GID is refused before the VM runs.
    let out = h
        .command(transit_bin())
        .args(["vm", "run", "--name", &unique_name("pvbad"), "--memory", "64M", "--pvrdma", "rnicd=/nonexistent"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("gid= is required"), "{}", String::from_utf8_lossy(&out.stderr));
    drop(rnicd);
}
