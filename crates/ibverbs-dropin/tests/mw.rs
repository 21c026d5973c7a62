// SPDX-License-Identifier: GPL-2.0-or-later
//! Memory windows on the drop-in (src/mw.rs): a C program built against the
//! system's <infiniband/verbs.h> binds type 1 and type 2 windows, writes
//! through them from a second QP on the same rnicd and ends them in every
//! way the verbs offer, checking the errors of bad calls on the way.
//! Needs root (network namespaces) and scripts/setup's packages.

mod common;

use common::c_check_passes_on_one_host;

#[test]
fn c_program_memory_windows() {
    c_check_passes_on_one_host("ibvmw", "mw_check");
}
