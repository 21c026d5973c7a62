// SPDX-License-Identifier: GPL-2.0-or-later
//! UC QPs on the drop-in: `tests/c/uc_check.c`, built against the system's
//! <infiniband/verbs.h>, connects two UC QPs on one rnicd and checks SEND
//! and WRITE with immediate (ibv_post_send and the ibv_wr_* builders),
//! UC's attribute masks and the operations UC refuses. Needs root (network
//! namespaces) and scripts/setup's packages; rnicd's own UC tests (loss,
//! no ACKs) are `cargo test -p rnic --test uc`.

mod common;

use std::process::Stdio;

use common::{finish, lib_dir, CCheck, Nic};
use testbed::{HostChild, Testbed, TestbedOpts};

#[test]
fn c_program_uc_traffic_and_refusals() {
    let tb = Testbed::create(TestbedOpts::new("ibvuc", 1)).expect("testbed (needs root)");
    let nic = Nic::start(&tb, 0);
    let exe = CCheck::build("uc_check");
    let mut c = tb.host(0).command(exe.path());
    c.env("LD_LIBRARY_PATH", lib_dir()).env("TRANSIT_RNICD_SOCK", &nic.sock);
    c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let out = finish(HostChild::new(c.spawn().expect("run uc_check")));
    let t = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && t.contains("all ok"), "rnicd {}:\n{t}", nic.addr);
}
