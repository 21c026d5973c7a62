// SPDX-License-Identifier: GPL-2.0-or-later
//! Destroying a CQ, QP or SRQ waits until the events handed out about it
//! are acknowledged, as libibverbs' destroy calls do: `tests/c/event_ack_check.c`,
//! built against the system's <infiniband/verbs.h>, acks each event from
//! a second thread 200 ms after another destroyed the object it names.
//! Needs root (network namespaces) and scripts/setup's packages.

mod common;

use common::c_check_passes_on_one_host;

#[test]
fn c_program_destroy_waits_for_event_acks() {
    c_check_passes_on_one_host("ibvack", "event_ack_check");
}
