// SPDX-License-Identifier: GPL-2.0-or-later
//! Shared receive queues on the drop-in: rdma-core's unmodified
//! ibv_srq_pingpong between two testbed hosts (each with a real rnicd), and
//! a C program built against the system's <infiniband/verbs.h> that checks
//! the SRQ verbs, the limit event and the errors of bad calls.
//! Needs root (network namespaces) and scripts/setup's packages.

mod common;

use common::{text, Bed, CCheck};

#[test]
fn srq_pingpong_between_hosts() {
    let bed = Bed::new("ibvsrq", 2);
    // 16 QPs share each side's SRQ; --chk verifies every buffer. Polling,
    // then completion events.
    for extra in [&[][..], &["-e"][..]] {
        let mut args = vec!["-d", "rnic0", "-g", "0", "-q", "16", "-n", "200", "-s", "4096", "-c"];
        args.extend_from_slice(extra);
        let (s, c) = bed.pair("ibv_srq_pingpong", &args, 18515);
        for out in [&s, &c] {
            // 200 exchanges of 4096 bytes each way (spread over the 16 QPs).
            assert!(out.contains("1638400 bytes in") && out.contains("200 iters in"), "{extra:?}:\n{out}");
        }
    }
}

#[test]
fn c_program_srq_verbs_and_bad_calls() {
    let bed = Bed::new("ibvsrqc", 1);
    let exe = CCheck::build("srq_check");
    let out = bed.run(0, exe.path(), &[]);
    let t = text(&out);
    assert!(out.status.success() && t.contains("all ok"), "{t}");
}
