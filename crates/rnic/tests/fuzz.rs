//! Property tests: random and malformed packets never crash the parser or the
//! engine, and the responder never touches memory outside a registered region.
mod common;
use std::net::Ipv4Addr;
use std::os::fd::OwnedFd;
use std::time::Instant;

use common::direct::{self, dup};
use proptest::prelude::*;
use rnic::engine::Engine;
use rnic::mem::{sealed_memfd, Mapping};
use rnic::proto::{Reply, Request};
use rnic::types::{access, mask, Mtu, QpAttr, QpState};
use rnic::wire::{self, AtomicEth, Flow, Headers, Opcode, Reth, ROCE_PORT};

const LOCAL: Ipv4Addr = Ipv4Addr::new(10, 9, 0, 1);
const PEER: Ipv4Addr = Ipv4Addr::new(10, 9, 0, 2);
const PAGE: usize = 4096;

struct Rig {
    engine: Engine,
    qpn: u32,
    rkey: u32,
    mem: Mapping,
    iova: u64,
    _keep: Vec<OwnedFd>,
}

/// An engine with one QP in RTS talking to PEER, and a 3-page memfd whose middle
/// page is the only registered memory (the outer pages are guards).
fn rig() -> Rig {
    let mut e = Engine::new(LOCAL);
    let c = 1;
    let Reply::Pd(pd) = e.control(c, Request::AllocPd, vec![]).unwrap() else { panic!() };
    let memfd = sealed_memfd("fuzz", 3 * PAGE).unwrap();
    let mem = Mapping::map(&memfd, 0, 3 * PAGE).unwrap();
    unsafe { std::ptr::write_bytes(mem.ptr(), 0xaa, 3 * PAGE) };
    let iova = 0x7000_0000_0000u64;
    let Reply::Mr { rkey, .. } = e
        .control(
            c,
            Request::RegMr { pd, iova, len: PAGE as u64, access: access::ALL, fd_offset: PAGE as u64, key: None },
            vec![dup(&memfd)],
        )
        .unwrap()
    else {
        panic!()
    };
    let (cq, cqfd) = direct::cq(&mut e, c, 64);
    let (qpn, [sq, rq]) = direct::rc_qp(&mut e, c, pd, cq, 4, 64);
    let mut a = QpAttr { qp_state: QpState::Init, qp_access_flags: access::ALL, port_num: 1, ..Default::default() };
    e.control(c, Request::ModifyQp { qpn, attr: a, mask: mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::ACCESS_FLAGS }, vec![])
        .unwrap();
    a.qp_state = QpState::Rtr;
    a.path_mtu = Mtu::M256;
    a.dest_gid = PEER;
    a.dest_qp_num = 0x77;
    a.rq_psn = 100;
    a.max_dest_rd_atomic = 4;
    let m = mask::STATE | mask::AV | mask::PATH_MTU | mask::DEST_QPN | mask::RQ_PSN | mask::MAX_DEST_RD_ATOMIC | mask::MIN_RNR_TIMER;
    e.control(c, Request::ModifyQp { qpn, attr: a, mask: m }, vec![]).unwrap();
    a.qp_state = QpState::Rts;
    a.sq_psn = 5;
    let m = mask::STATE | mask::SQ_PSN | mask::TIMEOUT | mask::RETRY_CNT | mask::RNR_RETRY | mask::MAX_QP_RD_ATOMIC;
    e.control(c, Request::ModifyQp { qpn, attr: a, mask: m }, vec![]).unwrap();
    Rig { engine: e, qpn, rkey, mem, iova, _keep: vec![memfd, cqfd, sq, rq] }
}

impl Rig {
    fn guards_intact(&self) -> bool {
        let all = unsafe { std::slice::from_raw_parts(self.mem.ptr(), 3 * PAGE) };
        all[..PAGE].iter().all(|&b| b == 0xaa) && all[2 * PAGE..].iter().all(|&b| b == 0xaa)
    }
    fn feed(&mut self, pkt: &[u8]) {
        self.engine.on_packet(pkt, PEER, 0xc001, Instant::now());
        self.engine.poll_tx(64, Instant::now());
        let out = std::mem::take(&mut self.engine.tx.pkts);
        for p in out {
            // Whatever rnicd answers must itself parse, with a valid ICRC.
            let flow = Flow { src: LOCAL, dst: PEER, sport: p.sport, dport: ROCE_PORT };
            assert!(wire::parse(&p.buf[..p.len], Some(&flow)).is_ok());
            self.engine.tx.recycle(p);
        }
    }
}

fn flow() -> Flow {
    Flow { src: PEER, dst: LOCAL, sport: 0xc001, dport: ROCE_PORT }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, .. ProptestConfig::default() })]

    #[test]
    fn parser_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
        let _ = wire::parse(&bytes, None);
        let _ = wire::parse(&bytes, Some(&flow()));
    }

    #[test]
    fn build_parse_roundtrip(op in 0u8..0x18, qpn in 0u32..0xff_ffff, psn in 0u32..0xff_ffff,
                             va in any::<u64>(), rkey in any::<u32>(), len in any::<u32>(),
                             imm in any::<u32>(), payload in proptest::collection::vec(any::<u8>(), 0..300)) {
        let Some(op) = Opcode::from_u8(op) else { return Ok(()) };
        let mut h = Headers::new(op, qpn, psn);
        if op.has_reth() { h.reth = Some(Reth { va, rkey, len }); }
        if op.has_imm() { h.imm = Some(imm); }
        if op.has_ieth() { h.ieth = Some(rkey); }
        if op.is_atomic() { h.atomic = Some(AtomicEth { va, rkey, swap_add: va ^ 1, compare: va ^ 2 }); }
        if op.has_aeth() { h.aeth = Some(wire::Aeth { syndrome: wire::Syndrome::from_u8(imm as u8), msn: len & 0xff_ffff }); }
        if op == Opcode::AtomicAck { h.atomic_ack = Some(va); }
        let pl: &[u8] = if op.has_payload() { &payload } else { &[] };
        let b = wire::build(&flow(), &h, pl);
        let p = wire::parse(&b, Some(&flow())).unwrap();
        prop_assert_eq!(p.bth.opcode, op);
        prop_assert_eq!(p.bth.dest_qpn, qpn);
        prop_assert_eq!(p.bth.psn, psn);
        prop_assert_eq!(p.reth, h.reth);
        prop_assert_eq!(p.payload, pl);
    }
}

/// Random requests and responses with valid ICRCs aimed at a live QP: the
/// engine survives, answers with well-formed packets, and never writes outside
/// the registered page.
#[test]
fn responder_and_completer_survive_hostile_packets() {
    use proptest::test_runner::{Config, TestRunner};
    let state = std::cell::RefCell::new((rig(), 100u32));
    let mut runner = TestRunner::new(Config { cases: 3000, ..Config::default() });
    let strat = (
        0u8..0x18,
        any::<bool>(),
        0u32..8,
        -3i64..(PAGE as i64 + 300),
        0u32..600,
        any::<bool>(),
        proptest::collection::vec(any::<u8>(), 0..300),
        any::<u8>(),
    );
    runner
        .run(&strat, |(op, good_qpn, psn_jitter, off, len, good_rkey, payload, syn)| {
            let mut st = state.borrow_mut();
            let (rig, psn) = &mut *st;
            let Some(op) = Opcode::from_u8(op) else { return Ok(()) };
            let qpn = if good_qpn { rig.qpn } else { rig.qpn ^ 0x10 };
            let p = wire::psn_add(*psn, psn_jitter).wrapping_sub(2) & wire::PSN_MASK;
            let mut h = Headers::new(op, qpn, p);
            h.bth.ack_req = syn & 1 != 0;
            let va = (rig.iova as i64 + off) as u64;
            let rkey = if good_rkey { rig.rkey } else { rig.rkey ^ 4 };
            if op.has_reth() {
                h.reth = Some(Reth { va, rkey, len });
            }
            if op.has_imm() {
                h.imm = Some(len);
            }
            if op.has_ieth() {
                h.ieth = Some(rkey ^ 1);
            }
            if op.is_atomic() {
                h.atomic = Some(AtomicEth { va: va & !7, rkey, swap_add: 1, compare: 0 });
            }
            if op.has_aeth() {
                h.aeth = Some(wire::Aeth { syndrome: wire::Syndrome::from_u8(syn), msn: 0 });
            }
            if op == Opcode::AtomicAck {
                h.atomic_ack = Some(9);
            }
            let pl: &[u8] = if op.has_payload() { &payload } else { &[] };
            let b = wire::build(&flow(), &h, pl);
            rig.feed(&b);
            // Also a truncated and a bit-flipped copy.
            rig.feed(&b[..b.len() / 2]);
            let mut c = b.clone();
            let i = (syn as usize) % c.len();
            c[i] ^= 0x10;
            rig.feed(&c);
            if rig.engine.qp(rig.qpn).is_some_and(|q| q.attr.qp_state == QpState::Err) {
                // An error NAK moved the QP to ERR (as IB requires): start over.
                RX_BEFORE.with(|n| n.set(n.get() + rig.engine.stats.rx_packets));
                *rig = self::rig();
                *psn = 100;
            } else if let Some(q) = rig.engine.qp(rig.qpn) {
                *psn = q.rt.epsn;
            }
            prop_assert!(rig.guards_intact(), "memory outside the MR was written");
            Ok(())
        })
        .unwrap();
    // (Counted over every rig: the last case may have started a fresh one.)
    assert!(state.borrow().0.engine.stats.rx_packets + RX_BEFORE.with(|n| n.get()) > 0);
}

thread_local! {
    /// Packets received by rigs that were replaced after an error.
    static RX_BEFORE: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}
