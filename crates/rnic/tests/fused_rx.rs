//! A WRITE's middle packets have their ICRC checked while their payload is
//! copied into place (`Qp::places_unverified`): a damaged one is dropped as
//! if it never came (no answer, no change of the QP's state), and the
//! intact resend of it leaves every byte of the message in place.
mod common;
use std::net::Ipv4Addr;
use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use common::direct::{self, dup};
use rnic::engine::Engine;
use rnic::mem::{sealed_memfd, Mapping};
use rnic::proto::{Reply, Request};
use rnic::types::{access, mask, Mtu, QpAttr, QpState};
use rnic::wire::{self, Flow, Headers, Opcode, Reth, Syndrome, ROCE_PORT};

const LOCAL: Ipv4Addr = Ipv4Addr::new(10, 9, 1, 1);
const PEER: Ipv4Addr = Ipv4Addr::new(10, 9, 1, 2);
const MTU: usize = 1024;
const MSG: usize = 4 * MTU;
const IOVA: u64 = 0x10_0000;
const FIRST_PSN: u32 = 100;

struct Rig {
    engine: Engine,
    qpn: u32,
    rkey: u32,
    mem: Mapping,
    _keep: Vec<OwnedFd>,
}

/// An engine with one RC QP in RTS (path MTU 1024) talking to PEER and a
/// registered region of one message's size.
fn rig() -> Rig {
    let mut e = Engine::new(LOCAL);
    let Reply::Pd(pd) = e.control(1, Request::AllocPd, vec![]).unwrap() else { panic!() };
    let memfd = sealed_memfd("fused", MSG).unwrap();
    let mem = Mapping::map(&memfd, 0, MSG).unwrap();
    let req = Request::RegMr { pd, iova: IOVA, len: MSG as u64, access: access::ALL, fd_offset: 0, key: None };
    let Reply::Mr { rkey, .. } = e.control(1, req, vec![dup(&memfd)]).unwrap() else { panic!() };
    let (cq, cqfd) = direct::cq(&mut e, 1, 64);
    let (qpn, [sq, rq]) = direct::rc_qp(&mut e, 1, pd, cq, 1, 0);
    let mut a = QpAttr { qp_state: QpState::Init, qp_access_flags: access::ALL, port_num: 1, ..Default::default() };
    e.control(1, Request::ModifyQp { qpn, attr: a, mask: mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::ACCESS_FLAGS }, vec![])
        .unwrap();
    a.qp_state = QpState::Rtr;
    a.path_mtu = Mtu::M1024;
    a.dest_gid = PEER;
    a.dest_qp_num = 0x77;
    a.rq_psn = FIRST_PSN;
    let m = mask::STATE | mask::AV | mask::PATH_MTU | mask::DEST_QPN | mask::RQ_PSN | mask::MAX_DEST_RD_ATOMIC | mask::MIN_RNR_TIMER;
    e.control(1, Request::ModifyQp { qpn, attr: a, mask: m }, vec![]).unwrap();
    a.qp_state = QpState::Rts;
    let m = mask::STATE | mask::SQ_PSN | mask::TIMEOUT | mask::RETRY_CNT | mask::RNR_RETRY | mask::MAX_QP_RD_ATOMIC;
    e.control(1, Request::ModifyQp { qpn, attr: a, mask: m }, vec![]).unwrap();
    Rig { engine: e, qpn, rkey, mem, _keep: vec![memfd, cqfd, sq, rq] }
}

fn flow() -> Flow {
    Flow { src: PEER, dst: LOCAL, sport: 0xc001, dport: ROCE_PORT }
}

impl Rig {
    /// Packet `k` of the 4-packet WRITE of `data`.
    fn packet(&self, k: usize, data: &[u8]) -> Vec<u8> {
        let op = [Opcode::WriteFirst, Opcode::WriteMiddle, Opcode::WriteMiddle, Opcode::WriteLast][k];
        let mut h = Headers::new(op, self.qpn, FIRST_PSN + k as u32);
        if k == 0 {
            h.reth = Some(Reth { va: IOVA, rkey: self.rkey, len: MSG as u32 });
        }
        h.bth.ack_req = k == 3;
        wire::build(&flow(), &h, &data[k * MTU..(k + 1) * MTU])
    }

    /// Feeds one packet; returns the AETH syndromes (and PSNs) of what the
    /// engine answers by `later` after it.
    fn feed(&mut self, pkt: &[u8], later: Duration) -> Vec<(Syndrome, u32)> {
        let now = Instant::now();
        self.engine.on_packet(pkt, PEER, 0xc001, now);
        self.engine.poll_tx(64, now + later);
        let mut answers = Vec::new();
        for p in std::mem::take(&mut self.engine.tx.pkts) {
            let f = Flow { src: LOCAL, dst: PEER, sport: p.sport, dport: ROCE_PORT };
            let q = wire::parse(&p.buf[..p.len], Some(&f)).unwrap();
            answers.push((q.aeth.unwrap().syndrome, q.bth.psn));
            self.engine.tx.recycle(p);
        }
        answers
    }

    fn memory(&self) -> &[u8] {
        // SAFETY: the mapping is MSG bytes and lives as long as self.
        unsafe { std::slice::from_raw_parts(self.mem.ptr(), MSG) }
    }
}

fn is_nak(s: &Syndrome) -> bool {
    matches!(s, Syndrome::Nak(_) | Syndrome::RnrNak(_))
}

#[test]
fn a_damaged_middle_packet_is_dropped_and_its_resend_places_every_byte() {
    let mut r = rig();
    let data: Vec<u8> = (0..MSG).map(|i| (i * 7 + i / 1000) as u8).collect();
    assert!(r.feed(&r.packet(0, &data), Duration::ZERO).iter().all(|a| !is_nak(&a.0)));

    // A payload byte flipped on the way: its ICRC no longer matches.
    let mut damaged = r.packet(1, &data);
    damaged[12 + 500] ^= 0x01;
    assert!(wire::may_defer_icrc(&damaged, MTU));
    assert!(r.feed(&damaged, Duration::ZERO).is_empty(), "a damaged packet gets no answer");
    assert_eq!(r.engine.stats.rx_bad_icrc, 1);

    // Damaged so that it would be refused (too short for a middle
    // packet): dropped as damaged, not answered with a NAK.
    let mut short = r.packet(1, &data);
    short.truncate(short.len() - 8 - wire::ICRC_LEN);
    let keep = short.len();
    short.extend_from_slice(&r.packet(1, &data)[keep..keep + wire::ICRC_LEN]);
    assert!(r.feed(&short, Duration::ZERO).is_empty(), "a damaged packet gets no answer");
    assert_eq!(r.engine.stats.rx_bad_icrc, 2);

    // The resend of PSN 101 onwards: every byte lands, one ACK for the end.
    let mut answers = Vec::new();
    for k in 1..4 {
        answers.extend(r.feed(&r.packet(k, &data), Duration::from_millis(50)));
    }
    assert!(answers.iter().all(|a| !is_nak(&a.0)), "{answers:?}");
    assert!(answers.iter().any(|a| a.1 == FIRST_PSN + 3), "the message's end is acknowledged: {answers:?}");
    assert_eq!(r.engine.stats.rx_bad_icrc, 2);
    assert!(r.memory() == &data[..], "every byte of the WRITE is in place");
}

/// A damaged middle packet that is not the expected one (ahead of a gap)
/// is checked before it is held, and never placed.
#[test]
fn a_damaged_packet_ahead_of_a_gap_is_not_held() {
    let mut r = rig();
    let data: Vec<u8> = (0..MSG).map(|i| (i * 11 + 3) as u8).collect();
    r.feed(&r.packet(0, &data), Duration::ZERO);
    let mut damaged = r.packet(2, &data);
    damaged[12 + 7] ^= 0x80;
    r.feed(&damaged, Duration::ZERO);
    assert_eq!(r.engine.stats.rx_bad_icrc, 1);
    assert_eq!(r.engine.stats.held_out_of_order, 0);
    for k in 1..4 {
        r.feed(&r.packet(k, &data), Duration::from_millis(50));
    }
    assert!(r.memory() == &data[..]);
}
