// SPDX-License-Identifier: GPL-2.0-or-later
//! Thread and parent domains on the drop-in (src/parent_domain.rs):
//! `tests/c/parent_domain_check.c`, built against the system's
//! <infiniband/verbs.h>, makes QPs on a parent domain whose allocator gives
//! their rings memory, runs RC traffic over them, and checks the memory
//! goes back to its `free`, the references the parent domain holds and bad
//! calls. Needs root (network namespaces) and scripts/setup's packages.

mod common;

use std::process::Stdio;

use common::{finish, lib_dir, CCheck, Nic};
use testbed::{HostChild, Testbed, TestbedOpts};

#[test]
fn c_program_parent_domain_allocators_and_traffic() {
    let tb = Testbed::create(TestbedOpts::new("ibvpd", 1)).expect("testbed (needs root)");
    let nic = Nic::start(&tb, 0);
    let exe = CCheck::build("parent_domain_check");
    let mut c = tb.host(0).command(exe.path());
    c.env("LD_LIBRARY_PATH", lib_dir()).env("TRANSIT_RNICD_SOCK", &nic.sock);
    c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let out = finish(HostChild::new(c.spawn().expect("run parent_domain_check")));
    let t = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && t.contains("all ok"), "rnicd {}:\n{t}", nic.addr);
}
