// SPDX-License-Identifier: GPL-2.0-or-later
//! Thread and parent domains on the drop-in (src/parent_domain.rs):
//! `tests/c/parent_domain_check.c`, built against the system's
//! <infiniband/verbs.h>, makes QPs on a parent domain whose allocator gives
//! their rings memory, runs RC traffic over them, and checks the memory
//! goes back to its `free`, the references the parent domain holds and bad
//! calls. Needs root (network namespaces) and scripts/setup's packages.

mod common;

use common::c_check_passes_on_one_host;

#[test]
fn c_program_parent_domain_allocators_and_traffic() {
    c_check_passes_on_one_host("ibvpd", "parent_domain_check");
}
