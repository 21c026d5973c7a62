//! ibv_modify_qp's attribute rules, per transition, as the IBTA transition
//! table and Linux's `ib_modify_qp_is_ok` give them: a transition refuses
//! attributes it does not take, and a refused modify changes nothing.
//! Runs one engine in this process (no network needed).
mod common;
use std::net::Ipv4Addr;
use std::os::fd::OwnedFd;

use common::direct;
use rnic::engine::Engine;
use rnic::objects::ClientId;
use rnic::proto::{Reply, Request};
use rnic::types::{access, mask, Mtu, QpAttr, QpState};

const LOCAL: Ipv4Addr = Ipv4Addr::new(10, 9, 1, 1);
const PEER: Ipv4Addr = Ipv4Addr::new(10, 9, 1, 2);
const CLIENT: ClientId = 1;

const TO_INIT: u32 = mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::ACCESS_FLAGS;
const TO_RTR: u32 =
    mask::STATE | mask::AV | mask::PATH_MTU | mask::DEST_QPN | mask::RQ_PSN | mask::MAX_DEST_RD_ATOMIC | mask::MIN_RNR_TIMER;
const TO_RTS: u32 = mask::STATE | mask::SQ_PSN | mask::TIMEOUT | mask::RETRY_CNT | mask::RNR_RETRY | mask::MAX_QP_RD_ATOMIC;

struct Rig {
    engine: Engine,
    qpn: u32,
    _fds: Vec<OwnedFd>,
}

impl Rig {
    /// One QP in RESET.
    fn new() -> Rig {
        let mut e = Engine::new(LOCAL);
        let Reply::Pd(pd) = e.control(CLIENT, Request::AllocPd, vec![]).unwrap() else { panic!() };
        let (cq, cqfd) = direct::cq(&mut e, CLIENT, 64);
        let (qpn, [sq, rq]) = direct::rc_qp(&mut e, CLIENT, pd, cq, 4, 64);
        Rig { engine: e, qpn, _fds: vec![cqfd, sq, rq] }
    }

    /// One QP in RTS, connected to PEER.
    fn rts() -> Rig {
        let mut r = Rig::new();
        r.modify(&r.connected(QpState::Init), TO_INIT).unwrap();
        r.modify(&r.connected(QpState::Rtr), TO_RTR).unwrap();
        r.modify(&r.connected(QpState::Rts), TO_RTS).unwrap();
        r
    }

    fn connected(&self, state: QpState) -> QpAttr {
        QpAttr {
            qp_state: state,
            qp_access_flags: access::ALL,
            path_mtu: Mtu::M1024,
            dest_gid: PEER,
            dest_qp_num: 0x77,
            rq_psn: 100,
            sq_psn: 200,
            ..Default::default()
        }
    }

    fn modify(&mut self, attr: &QpAttr, mask: u32) -> Result<(), String> {
        let req = Request::ModifyQp { qpn: self.qpn, attr: *attr, mask };
        self.engine.control(CLIENT, req, vec![]).map(|_| ()).map_err(|e| format!("{e:#}"))
    }

    fn attr(&mut self) -> QpAttr {
        let Reply::QpInfo { attr, .. } = self.engine.control(CLIENT, Request::QueryQp { qpn: self.qpn }, vec![]).unwrap() else { panic!() };
        attr
    }

    /// Asserts that `mask` is refused in the current state and changed nothing.
    fn refused(&mut self, attr: &QpAttr, mask: u32, why: &str) {
        let before = self.attr();
        let e = self.modify(attr, mask).expect_err(why);
        assert!(e.contains("does not take") || e.contains("needs") || e.contains("invalid"), "{why}: {e}");
        assert_eq!(self.attr(), before, "{why}: a refused modify changes nothing");
    }
}

#[test]
fn rts_to_rts_refuses_a_new_destination_address_or_path() {
    let mut r = Rig::rts();
    let mut a = r.connected(QpState::Rts);
    a.dest_qp_num = 0x99;
    r.refused(&a, mask::STATE | mask::DEST_QPN, "RTS -> RTS with a new destination QPN");
    r.refused(&a, mask::DEST_QPN, "the same without STATE (RTS -> RTS implied)");
    a.dest_gid = Ipv4Addr::new(10, 9, 1, 3);
    r.refused(&a, mask::STATE | mask::AV, "RTS -> RTS with a new address");
    a.path_mtu = Mtu::M4096;
    r.refused(&a, mask::STATE | mask::PATH_MTU, "RTS -> RTS with a new path MTU");
    r.refused(&a, mask::STATE | mask::RQ_PSN, "RTS -> RTS with a new receive PSN");
    r.refused(&a, mask::STATE | mask::SQ_PSN, "RTS -> RTS with a new send PSN");
    r.refused(&a, mask::STATE | mask::MAX_DEST_RD_ATOMIC, "RTS -> RTS with new responder resources");
    r.refused(&a, mask::STATE | mask::TIMEOUT, "RTS -> RTS with a new timeout (not suspended)");
    r.refused(&a, mask::STATE | mask::QKEY, "a Q_Key on an RC QP");
    r.refused(&a, mask::STATE | mask::CAP, "new capabilities");
    assert_eq!(r.attr().dest_qp_num, 0x77);
    assert_eq!(r.attr().qp_state, QpState::Rts);
}

#[test]
fn rts_to_rts_takes_its_optional_attributes() {
    let mut r = Rig::rts();
    let a = QpAttr { qp_state: QpState::Rts, qp_access_flags: access::LOCAL_WRITE, min_rnr_timer: 12, ..Default::default() };
    r.modify(&a, mask::STATE | mask::ACCESS_FLAGS | mask::MIN_RNR_TIMER | mask::CUR_STATE).unwrap();
    let got = r.attr();
    assert_eq!((got.qp_access_flags, got.min_rnr_timer, got.dest_qp_num), (access::LOCAL_WRITE, 12, 0x77));
}

#[test]
fn each_transition_refuses_what_it_does_not_take() {
    let mut r = Rig::new();
    let a = r.connected(QpState::Init);
    r.refused(&a, TO_INIT | mask::AV, "RESET -> INIT with an address");
    r.refused(&a, TO_INIT | mask::SQ_PSN, "RESET -> INIT with a send PSN");
    r.refused(&a, mask::STATE | mask::ACCESS_FLAGS, "RESET -> INIT without PKEY_INDEX and PORT");
    r.modify(&a, TO_INIT).unwrap();
    // INIT -> INIT takes PKEY_INDEX, PORT and ACCESS_FLAGS only.
    r.modify(&QpAttr { qp_access_flags: access::LOCAL_WRITE, ..a }, mask::ACCESS_FLAGS).unwrap();
    assert_eq!(r.attr().qp_access_flags, access::LOCAL_WRITE);
    r.refused(&a, mask::PATH_MTU, "INIT -> INIT with a path MTU");
    // A bad value among good attributes: nothing is applied.
    let bad_port = QpAttr { port_num: 2, qp_access_flags: access::ALL, ..a };
    assert!(r.modify(&bad_port, mask::ACCESS_FLAGS | mask::PORT).is_err());
    assert_eq!(r.attr().qp_access_flags, access::LOCAL_WRITE, "the access flags of a refused modify are not taken");
    let rtr = r.connected(QpState::Rtr);
    r.refused(&rtr, TO_RTR | mask::SQ_PSN, "INIT -> RTR with a send PSN");
    r.refused(&rtr, TO_RTR | mask::TIMEOUT, "INIT -> RTR with a timeout");
    r.modify(&rtr, TO_RTR | mask::PKEY_INDEX | mask::ACCESS_FLAGS).unwrap();
    let rts = r.connected(QpState::Rts);
    r.refused(&rts, TO_RTS | mask::DEST_QPN, "RTR -> RTS with a destination QPN");
    r.refused(&rts, TO_RTS | mask::PATH_MTU, "RTR -> RTS with a path MTU");
    r.modify(&rts, TO_RTS | mask::MIN_RNR_TIMER | mask::ACCESS_FLAGS).unwrap();
    // RTS -> SQD takes nothing rnicd implements; SQD -> SQD takes the path.
    let sqd = QpAttr { qp_state: QpState::Sqd, ..rts };
    r.refused(&sqd, mask::STATE | mask::AV, "RTS -> SQD with an address");
    assert!(r.modify(&sqd, mask::STATE | mask::EN_SQD_ASYNC_NOTIFY).unwrap_err().contains("does not support"));
    r.modify(&sqd, mask::STATE).unwrap();
    let moved = QpAttr { timeout: 18, retry_cnt: 3, ..sqd };
    r.modify(&moved, mask::STATE | mask::AV | mask::TIMEOUT | mask::RETRY_CNT | mask::MAX_QP_RD_ATOMIC).unwrap();
    assert_eq!((r.attr().timeout, r.attr().retry_cnt), (18, 3));
    r.refused(&moved, mask::STATE | mask::DEST_QPN, "SQD -> SQD with a destination QPN");
    let back = QpAttr { qp_state: QpState::Rts, ..moved };
    r.refused(&back, mask::STATE | mask::AV, "SQD -> RTS with an address");
    r.modify(&back, mask::STATE | mask::SQ_PSN).unwrap();
    assert_eq!(r.attr().qp_state, QpState::Rts);
    // Any state -> ERR and -> RESET take no attributes.
    r.refused(&QpAttr { qp_state: QpState::Err, ..back }, mask::STATE | mask::TIMEOUT, "RTS -> ERR with a timeout");
    r.modify(&QpAttr { qp_state: QpState::Err, ..back }, mask::STATE).unwrap();
    r.refused(&QpAttr { qp_state: QpState::Rts, ..back }, mask::STATE, "ERR -> RTS");
    r.modify(&QpAttr { qp_state: QpState::Reset, ..back }, mask::STATE).unwrap();
    assert_eq!(r.attr().qp_state, QpState::Reset);
}

#[test]
fn a_suspended_qp_takes_new_retransmission_attributes() {
    let mut r = Rig::rts();
    let a = QpAttr { timeout: 20, retry_cnt: 5, rnr_retry: 6, ..r.connected(QpState::Rts) };
    let m = mask::TIMEOUT | mask::RETRY_CNT | mask::RNR_RETRY;
    r.refused(&a, m, "a running QP keeps its retransmission attributes");
    r.engine.control(CLIENT, Request::SuspendQp { qpn: r.qpn }, vec![]).unwrap();
    r.modify(&a, m).unwrap();
    let got = r.attr();
    assert_eq!((got.timeout, got.retry_cnt, got.rnr_retry), (20, 5, 6));
    r.refused(&a, mask::DEST_QPN, "not its destination, suspended or not");
}

#[test]
fn unsupported_attributes_are_named() {
    let mut r = Rig::rts();
    let a = r.connected(QpState::Rts);
    let e = r.modify(&a, mask::STATE | mask::ALT_PATH).unwrap_err();
    assert!(e.contains("ALT_PATH"), "{e}");
    let e = r.modify(&a, mask::STATE | mask::DEST_QPN | mask::PATH_MTU).unwrap_err();
    assert!(e.contains("PATH_MTU") && e.contains("DEST_QPN"), "{e}");
}
