// SPDX-License-Identifier: GPL-2.0-or-later
//! Device memory on the drop-in (src/dm.rs): a C program built against the
//! system's <infiniband/verbs.h> allocates DMs, copies in and out, registers
//! zero-based DM MRs and moves data from, into and out of device memory
//! over two RC QPs on one rnicd, checking the errors of bad calls on the
//! way. Needs root (network namespaces) and scripts/setup's packages.

mod common;

use std::process::Stdio;

use common::{finish, lib_dir, CCheck, Nic};
use testbed::{HostChild, Testbed, TestbedOpts};

#[test]
fn c_program_device_memory_verbs_and_traffic() {
    let tb = Testbed::create(TestbedOpts::new("ibvdm", 1)).expect("testbed (needs root)");
    let nic = Nic::start(&tb, 0);
    let exe = CCheck::build("dm_check");
    let mut c = tb.host(0).command(exe.path());
    c.env("LD_LIBRARY_PATH", lib_dir()).env("TRANSIT_RNICD_SOCK", &nic.sock);
    c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let out = finish(HostChild::new(c.spawn().expect("run dm_check")));
    let t = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && t.contains("all ok"), "rnicd {}:\n{t}", nic.addr);
}
