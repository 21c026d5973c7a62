// SPDX-License-Identifier: GPL-2.0-or-later
//! Two threads posting chains to one queue at once (an RC QP's receive
//! queue, an SRQ, a send queue): `tests/c/post_threads_check.c`, built
//! against the system's <infiniband/verbs.h>, checks that every failed
//! post names exactly the first WR not posted, that the queue never holds
//! more than its depth and that a chain's WRs stay together.
//! Needs root (network namespaces) and scripts/setup's packages.

mod common;

use common::c_check_passes_on_one_host;

#[test]
fn c_program_posts_from_two_threads() {
    c_check_passes_on_one_host("ibvpost", "post_threads_check");
}
