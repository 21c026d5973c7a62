//! A resumed QP's sequence NAK leaves in the first transmit round, even
//! while many other QPs of its namespace have bulk responses to send: ACKs
//! and NAKs do not wait for the QP's turn in the fair shares of data (with
//! 256 QPs resuming after a move, they once waited hundreds of ms, and the
//! peer's resends went unanswered meanwhile). The first round after a
//! resume carries the ACKs and NAKs alone: the data of a round reads guest
//! memory, which on a postcopy destination may wait for pages.
mod common;
use std::net::Ipv4Addr;
use std::os::fd::OwnedFd;
use std::time::Instant;

use common::direct::{self, Path};
use rnic::engine::Engine;
use rnic::proto::Request;
use rnic::types::Mtu;
use rnic::wire::{NakCode, Opcode, Syndrome};

const LOCAL: Ipv4Addr = Ipv4Addr::new(10, 9, 1, 1);
const PEER: Ipv4Addr = Ipv4Addr::new(10, 9, 1, 2);
const READ_LEN: u32 = 64 * 1024;
const RQ_PSN: u32 = 100;
/// QPs with READ responses to send, besides the one that resumes.
const BUSY_QPS: u32 = 32;

/// An RC QP of client 1 in RTS talking to PEER's QP `dest`.
fn rts_qp(e: &mut Engine, pd: u32, cq: u32, dest: u32, keep: &mut Vec<OwnedFd>) -> u32 {
    let path = Path { peer: PEER, dest_qpn: dest, rq_psn: RQ_PSN, mtu: Mtu::M256, max_dest_rd_atomic: 4, timeout: 0 };
    direct::rts_qp(e, pd, cq, &path, keep)
}

#[test]
fn a_resumed_qps_nak_goes_out_before_other_qps_bulk_responses() {
    let mut e = Engine::new(LOCAL);
    let mut keep = Vec::new();
    let direct::Readable { pd, rkey, cq } = direct::readable(&mut e, READ_LEN, &mut keep);

    // The busy QPs come first in the transmit order; the one that resumes last.
    let busy: Vec<u32> = (0..BUSY_QPS).map(|k| rts_qp(&mut e, pd, cq, 0x100 + k, &mut keep)).collect();
    let resumed = rts_qp(&mut e, pd, cq, 0x999, &mut keep);
    e.control(1, Request::SuspendQps { qpns: vec![resumed] }, vec![]).unwrap();

    // Each busy QP has a 64 KiB READ to answer: 256 response packets.
    direct::ask_reads(&mut e, PEER, &busy, RQ_PSN, rkey, READ_LEN);
    e.control(1, Request::ResumeQps { qpns: vec![resumed] }, vec![]).unwrap();

    // One round with a budget far below the READ responses queued.
    e.poll_tx(64, Instant::now());
    let out = direct::sent(&mut e, |w| (w.bth.dest_qpn == 0x999).then(|| (w.bth.opcode, w.bth.psn, w.aeth.map(|a| a.syndrome))));
    let naks: Vec<_> = out.iter().flatten().copied().collect();
    assert_eq!(
        naks,
        vec![(Opcode::Ack, RQ_PSN, Some(Syndrome::Nak(NakCode::PsnSeqError)))],
        "the resumed QP's sequence NAK is in the first round ({} packets sent)",
        out.len()
    );
    assert_eq!(out.len(), 1, "the NAK leaves in a round of its own");
    assert_eq!(e.stats.ack_only_rounds, 1);
    e.poll_tx(64, Instant::now());
    assert!(!e.tx.pkts.is_empty(), "the busy QPs' READ responses go in the next round");
}
