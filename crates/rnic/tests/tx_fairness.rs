//! Transmit fairness among many busy QPs: each transmit round gives the QPs
//! in turn a share of its packet budget, and the next round starts with
//! the first QP the budget did not reach. Every QP with work sends within
//! (QPs x share / budget) rounds. A round that started only one QP further
//! on served the same few QPs again and again, and a QP at the end of the
//! order waited up to (QPs - served) rounds.
mod common;
use std::collections::HashSet;
use std::net::Ipv4Addr;
use std::time::Instant;

use common::direct::{self, Path};
use rnic::engine::Engine;
use rnic::types::Mtu;

const LOCAL: Ipv4Addr = Ipv4Addr::new(10, 9, 2, 1);
const PEER: Ipv4Addr = Ipv4Addr::new(10, 9, 2, 2);
const READ_LEN: u32 = 64 * 1024;
const RQ_PSN: u32 = 100;
const QPS: u32 = 64;
/// Packets per transmit round: 8 QPs' shares (8 packets at least each).
const BUDGET: usize = 64;

#[test]
fn every_busy_qp_sends_within_one_pass_over_the_qps() {
    let mut e = Engine::new(LOCAL);
    let mut keep = Vec::new();
    let direct::Readable { pd, rkey, cq } = direct::readable(&mut e, READ_LEN, &mut keep);
    let qps: Vec<u32> = (0..QPS)
        .map(|k| {
            let path = Path { peer: PEER, dest_qpn: 0x100 + k, rq_psn: RQ_PSN, mtu: Mtu::M256, max_dest_rd_atomic: 4, timeout: 0 };
            direct::rts_qp(&mut e, pd, cq, &path, &mut keep)
        })
        .collect();
    // Each QP has a 64 KiB READ to answer: 256 response packets, far more
    // than a round's share.
    direct::ask_reads(&mut e, PEER, &qps, RQ_PSN, rkey, READ_LEN);

    let rounds = QPS as usize * 8 / BUDGET;
    let mut served = HashSet::new();
    for _ in 0..rounds {
        assert!(e.poll_tx(BUDGET, Instant::now()), "more to send");
        served.extend(direct::sent(&mut e, |w| w.bth.dest_qpn));
    }
    let waiting: Vec<u32> = (0..QPS).map(|k| 0x100 + k).filter(|q| !served.contains(q)).collect();
    assert!(waiting.is_empty(), "after {rounds} rounds of {BUDGET} packets, {} of {QPS} QPs sent nothing: {waiting:x?}", waiting.len());
}
