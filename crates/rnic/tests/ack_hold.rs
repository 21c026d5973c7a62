//! An rnicd responder reports in each ACK how long it held the requests
//! the ACK answers, from their arrival in the kernel (the receive
//! timestamp) to the ACK leaving: BTH byte 4's six reserved bits, which
//! the ICRC masks (`wire::encode_hold`). The requester leaves that hold
//! out of the round trip its delay signal takes, so a host too loaded to
//! run the responder's rnicd does not look like a queue on the path.
mod common;
use std::net::Ipv4Addr;
use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use common::direct::{self, dup, Path};
use rnic::engine::Engine;
use rnic::mem::sealed_memfd;
use rnic::proto::{Reply, Request};
use rnic::types::{access, Mtu};
use rnic::wire::{self, Flow, Headers, Opcode, Reth, Syndrome, ROCE_PORT};

const LOCAL: Ipv4Addr = Ipv4Addr::new(10, 9, 2, 1);
const PEER: Ipv4Addr = Ipv4Addr::new(10, 9, 2, 2);
const RQ_PSN: u32 = 100;
const LEN: usize = 4096;

/// An RC QP of client 1 in RTS talking to PEER's QP `dest`.
fn rts_qp(e: &mut Engine, pd: u32, cq: u32, dest: u32, keep: &mut Vec<OwnedFd>) -> u32 {
    let path = Path { peer: PEER, dest_qpn: dest, rq_psn: RQ_PSN, mtu: Mtu::M1024, max_dest_rd_atomic: 1, timeout: 0 };
    direct::rts_qp(e, pd, cq, &path, keep)
}

/// The ACK's reported hold of a WRITE that arrived `held` before it was
/// handled (ms), as the requester would read it, and the ms this thread
/// took from handling the WRITE to sending the ACK, rounded up: the
/// responder counts the hold to the ACK leaving, and a loaded host may
/// preempt the test between the two.
fn reported_hold_ms(held: Duration) -> (u64, u64) {
    let mut e = Engine::new(LOCAL);
    let mut keep = Vec::new();
    let Reply::Pd(pd) = e.control(1, Request::AllocPd, vec![]).unwrap() else { panic!() };
    let memfd = sealed_memfd("target", LEN).unwrap();
    let iova = 0x7000_0000_0000u64;
    let req = Request::RegMr { pd, iova, len: LEN as u64, access: access::ALL, fd_offset: 0, key: None };
    let Reply::Mr { rkey, .. } = e.control(1, req, vec![dup(&memfd)]).unwrap() else { panic!() };
    keep.push(memfd);
    let (cq, cqfd) = direct::cq(&mut e, 1, 16);
    keep.push(cqfd);
    let qpn = rts_qp(&mut e, pd, cq, 0x77, &mut keep);

    let flow = Flow { src: PEER, dst: LOCAL, sport: 0xc001, dport: ROCE_PORT };
    let mut h = Headers::new(Opcode::WriteOnly, qpn, RQ_PSN);
    h.bth.ack_req = true;
    h.reth = Some(Reth { va: iova, rkey, len: 512 });
    let now = Instant::now();
    e.on_packet_at(&wire::build(&flow, &h, &[7u8; 512]), PEER, flow.sport, now, now - held);
    e.poll_tx(64, Instant::now());
    let took_ms = now.elapsed().as_micros().div_ceil(1000) as u64;
    // Parsed with its ICRC checked: the hold leaves the ACK valid.
    let acks = direct::sent(&mut e, |ack| {
        assert_eq!(ack.bth.opcode, Opcode::Ack);
        assert_eq!(ack.aeth.map(|a| a.syndrome), Some(Syndrome::Ack(0x1f)), "{ack:?}");
        assert_eq!(ack.bth.psn, RQ_PSN);
        wire::decode_hold(ack.bth.resv6) / 1000
    });
    (acks[0], took_ms)
}

#[test]
fn an_ack_reports_how_long_the_responder_held_its_request() {
    let (h, took) = reported_hold_ms(Duration::ZERO);
    assert!(h <= took, "handled at once: no hold beyond the {took} ms to the ACK: reported {h} ms");
    let (h, took) = reported_hold_ms(Duration::from_millis(20));
    assert!((20..=20 + took).contains(&h), "held 20 ms before rnicd handled it, {took} ms to the ACK: reported {h} ms");
    assert_eq!(reported_hold_ms(Duration::from_millis(500)).0, 63, "at most 63 ms");
}
