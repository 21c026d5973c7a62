// SPDX-License-Identifier: GPL-2.0-or-later
//! UC QPs on the drop-in: `tests/c/uc_check.c`, built against the system's
//! <infiniband/verbs.h>, connects two UC QPs on one rnicd and checks SEND
//! and WRITE with immediate (ibv_post_send and the ibv_wr_* builders),
//! UC's attribute masks and the operations UC refuses. Needs root (network
//! namespaces) and scripts/setup's packages; rnicd's own UC tests (loss,
//! no ACKs) are `cargo test -p rnic --test uc`.

mod common;

use common::c_check_passes_on_one_host;

#[test]
fn c_program_uc_traffic_and_refusals() {
    c_check_passes_on_one_host("ibvuc", "uc_check");
}
