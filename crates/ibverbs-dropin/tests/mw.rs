// SPDX-License-Identifier: GPL-2.0-or-later
//! Memory windows on the drop-in (src/mw.rs): a C program built against the
//! system's <infiniband/verbs.h> binds type 1 and type 2 windows, writes
//! through them from a second QP on the same rnicd and ends them in every
//! way the verbs offer, checking the errors of bad calls on the way.
//! Needs root (network namespaces) and scripts/setup's packages.

mod common;

use std::process::Stdio;

use common::{finish, lib_dir, CCheck, Nic};
use testbed::{HostChild, Testbed, TestbedOpts};

#[test]
fn c_program_memory_windows() {
    let tb = Testbed::create(TestbedOpts::new("ibvmw", 1)).expect("testbed (needs root)");
    let nic = Nic::start(&tb, 0);
    let exe = CCheck::build("mw_check");
    let mut c = tb.host(0).command(exe.path());
    c.env("LD_LIBRARY_PATH", lib_dir()).env("TRANSIT_RNICD_SOCK", &nic.sock);
    c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let out = finish(HostChild::new(c.spawn().expect("run mw_check")));
    let t = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && t.contains("all ok"), "rnicd {}:\n{t}", nic.addr);
}
