// SPDX-License-Identifier: GPL-2.0-or-later
//! Device memory on the drop-in (src/dm.rs): a C program built against the
//! system's <infiniband/verbs.h> allocates DMs, copies in and out, registers
//! zero-based DM MRs and moves data from, into and out of device memory
//! over two RC QPs on one rnicd, checking the errors of bad calls on the
//! way. Needs root (network namespaces) and scripts/setup's packages.

mod common;

use common::c_check_passes_on_one_host;

#[test]
fn c_program_device_memory_verbs_and_traffic() {
    c_check_passes_on_one_host("ibvdm", "dm_check");
}
