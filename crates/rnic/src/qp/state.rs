//! The QP state machine: `modify` (ibv_modify_qp) checks a transition and
//! its attributes, then applies it; reset, error and flush.

use super::{Ctx, Qp, QpRuntime};
use crate::async_events::{AsyncEvent, AsyncKind};
use crate::ring::Cqe;
use crate::types::mask as m;
use crate::types::{QpAttr, QpState, QpType, WcOpcode, WcStatus};
use crate::wire::{self, psn_diff};

/// The attributes an RC transition requires and those it may take, as in
/// IBTA vol. 1 10.3.1 (QP state transition table) and Linux's
/// `qp_state_table` (`ib_modify_qp_is_ok`); `None` for no such transition.
fn transition_attrs(cur: QpState, new: QpState) -> Option<(u32, u32)> {
    use QpState::{Err, Init, Reset, Rtr, Rts, Sqd, Sqe};
    Some(match (cur, new) {
        (_, Reset) | (_, Err) => (0, 0),
        (Reset, Init) => (m::PKEY_INDEX | m::PORT | m::ACCESS_FLAGS, 0),
        (Init, Init) => (0, m::PKEY_INDEX | m::PORT | m::ACCESS_FLAGS),
        (Init, Rtr) => (
            m::AV | m::PATH_MTU | m::DEST_QPN | m::RQ_PSN | m::MAX_DEST_RD_ATOMIC | m::MIN_RNR_TIMER,
            m::ALT_PATH | m::ACCESS_FLAGS | m::PKEY_INDEX,
        ),
        (Rtr, Rts) => (
            m::SQ_PSN | m::TIMEOUT | m::RETRY_CNT | m::RNR_RETRY | m::MAX_QP_RD_ATOMIC,
            m::CUR_STATE | m::ALT_PATH | m::ACCESS_FLAGS | m::MIN_RNR_TIMER | m::PATH_MIG_STATE,
        ),
        (Rts, Rts) => (0, m::CUR_STATE | m::ACCESS_FLAGS | m::ALT_PATH | m::PATH_MIG_STATE | m::MIN_RNR_TIMER),
        (Rts, Sqd) => (0, m::EN_SQD_ASYNC_NOTIFY),
        (Sqd, Sqd) => (
            0,
            m::PORT
                | m::AV
                | m::TIMEOUT
                | m::RETRY_CNT
                | m::RNR_RETRY
                | m::MAX_QP_RD_ATOMIC
                | m::MAX_DEST_RD_ATOMIC
                | m::ALT_PATH
                | m::ACCESS_FLAGS
                | m::PKEY_INDEX
                | m::MIN_RNR_TIMER
                | m::PATH_MIG_STATE,
        ),
        (Sqd, Rts) => (0, m::CUR_STATE | m::ALT_PATH | m::ACCESS_FLAGS | m::MIN_RNR_TIMER | m::PATH_MIG_STATE),
        (Sqe, Rts) => (0, m::CUR_STATE),
        _ => return None,
    })
}

/// What rnicd takes beyond the tables:
/// - SQ_PSN when an idle QP goes from SQD (or SQE) back to RTS: its send
///   PSNs start there again;
/// - the retransmission attributes (TIMEOUT, RETRY_CNT, RNR_RETRY) in RTS->RTS
///   of a suspended QP: a QP created suspended on another host retries as
///   its new owner says (docs/rdma-migration.md).
fn extension_attrs(cur: QpState, new: QpState, suspended: bool) -> u32 {
    match (cur, new) {
        (QpState::Sqd | QpState::Sqe, QpState::Rts) => m::SQ_PSN,
        (QpState::Rts, QpState::Rts) if suspended => m::TIMEOUT | m::RETRY_CNT | m::RNR_RETRY,
        _ => 0,
    }
}

/// Attributes the tables allow that rnicd does not implement: refused, so
/// that a caller never waits for something that will not happen (an
/// alternate path, an "SQ drained" event).
const UNSUPPORTED: u32 = m::ALT_PATH | m::PATH_MIG_STATE | m::EN_SQD_ASYNC_NOTIFY;

/// The names of the attribute mask bits in `bits`, for error messages.
fn mask_names(bits: u32) -> String {
    const NAMES: [&str; 21] = [
        "STATE",
        "CUR_STATE",
        "EN_SQD_ASYNC_NOTIFY",
        "ACCESS_FLAGS",
        "PKEY_INDEX",
        "PORT",
        "QKEY",
        "AV",
        "PATH_MTU",
        "TIMEOUT",
        "RETRY_CNT",
        "RNR_RETRY",
        "RQ_PSN",
        "MAX_QP_RD_ATOMIC",
        "ALT_PATH",
        "MIN_RNR_TIMER",
        "SQ_PSN",
        "MAX_DEST_RD_ATOMIC",
        "PATH_MIG_STATE",
        "CAP",
        "DEST_QPN",
    ];
    let mut v: Vec<String> = NAMES.iter().enumerate().filter(|(i, _)| bits & (1 << i) != 0).map(|(_, n)| n.to_string()).collect();
    if bits >> NAMES.len() != 0 {
        v.push(format!("{:#x}", bits >> NAMES.len() << NAMES.len()));
    }
    v.join("|")
}

impl Qp {
    /// ibv_modify_qp: checks the transition, the attributes it requires and
    /// those it may take, and their values; then applies them all (or, on
    /// any error, none) and enters the new state.
    pub fn modify(&mut self, attr: &QpAttr, mask: u32, ctx: &mut Ctx) -> Result<(), String> {
        let cur = self.attr.qp_state;
        let new = if mask & m::STATE != 0 { attr.qp_state } else { cur };
        self.check_modify(attr, mask, cur, new)?;
        self.apply_attrs(attr, mask);
        self.enter_state(cur, new, mask, ctx);
        self.attr.sq_draining = self.attr.qp_state == QpState::Sqd && psn_diff(self.rt.max_sent, self.rt.una) > 0;
        Ok(())
    }

    fn check_modify(&self, attr: &QpAttr, mask: u32, cur: QpState, new: QpState) -> Result<(), String> {
        let table = match self.qp_type {
            QpType::Rc => transition_attrs,
            QpType::Ud => super::ud::transition_attrs,
            QpType::Uc => super::uc::transition_attrs,
        };
        let (required, optional) = table(cur, new).ok_or_else(|| format!("invalid QP state transition {cur:?} -> {new:?}"))?;
        let given = mask & !m::STATE;
        if given & required != required {
            return Err(format!("{cur:?} -> {new:?} needs attributes {}", mask_names(required & !given)));
        }
        let allowed = required | optional | extension_attrs(cur, new, self.suspended);
        if given & !allowed != 0 {
            return Err(format!("{cur:?} -> {new:?} does not take attributes {}", mask_names(given & !allowed)));
        }
        if given & UNSUPPORTED != 0 {
            return Err(format!("rnicd does not support {}", mask_names(given & UNSUPPORTED)));
        }
        if attr.retry_cnt > 7 || attr.rnr_retry > 7 || attr.min_rnr_timer > 31 || attr.timeout > 31 {
            return Err("retry_cnt/rnr_retry are 3 bits, min_rnr_timer/timeout 5 bits".into());
        }
        if mask & m::AV != 0 && attr.dest_gid.is_unspecified() {
            return Err("destination GID must be an IPv4 address".into());
        }
        if mask & m::PORT != 0 && attr.port_num != 1 {
            return Err("only port 1 exists".into());
        }
        Ok(())
    }

    /// Takes the attributes `mask` names (already checked).
    fn apply_attrs(&mut self, attr: &QpAttr, mask: u32) {
        let a = &mut self.attr;
        if mask & m::ACCESS_FLAGS != 0 {
            a.qp_access_flags = attr.qp_access_flags;
        }
        if mask & m::PKEY_INDEX != 0 {
            a.pkey_index = attr.pkey_index;
        }
        if mask & m::PORT != 0 {
            a.port_num = attr.port_num;
        }
        if mask & m::AV != 0 {
            a.dest_gid = attr.dest_gid;
        }
        if mask & m::PATH_MTU != 0 {
            a.path_mtu = attr.path_mtu;
        }
        if mask & m::DEST_QPN != 0 {
            a.dest_qp_num = attr.dest_qp_num & wire::QPN_MASK;
        }
        if mask & m::RQ_PSN != 0 {
            a.rq_psn = attr.rq_psn & wire::PSN_MASK;
        }
        if mask & m::SQ_PSN != 0 {
            a.sq_psn = attr.sq_psn & wire::PSN_MASK;
        }
        if mask & m::MAX_DEST_RD_ATOMIC != 0 {
            a.max_dest_rd_atomic = attr.max_dest_rd_atomic;
        }
        if mask & m::MAX_QP_RD_ATOMIC != 0 {
            a.max_rd_atomic = attr.max_rd_atomic;
        }
        if mask & m::MIN_RNR_TIMER != 0 {
            a.min_rnr_timer = attr.min_rnr_timer;
        }
        if mask & m::TIMEOUT != 0 {
            a.timeout = attr.timeout;
        }
        if mask & m::RETRY_CNT != 0 {
            a.retry_cnt = attr.retry_cnt;
        }
        if mask & m::RNR_RETRY != 0 {
            a.rnr_retry = attr.rnr_retry;
        }
        if mask & m::QKEY != 0 {
            a.qkey = attr.qkey;
        }
    }

    /// Enters `new`: what each transition starts or clears.
    fn enter_state(&mut self, cur: QpState, new: QpState, mask: u32, ctx: &mut Ctx) {
        use QpState::{Init, Reset, Rtr, Rts, Sqd, Sqe};
        match (cur, new) {
            (_, Reset) => self.reset(),
            (_, QpState::Err) if cur != QpState::Err => self.to_error(ctx),
            (Init, Rtr) => {
                self.rt.epsn = self.attr.rq_psn;
                self.attr.qp_state = Rtr;
            }
            (Rtr, Rts) => {
                self.restart_send_psns();
                self.rt.retry_left = self.attr.retry_cnt;
                self.rt.rnr_left = self.attr.rnr_retry;
                self.attr.qp_state = Rts;
            }
            (Sqd, Rts) | (Sqe, Rts) if mask & m::SQ_PSN != 0 && self.sq.is_empty() => {
                self.restart_send_psns();
                self.attr.qp_state = Rts;
            }
            _ => self.attr.qp_state = new,
        }
        self.sync_rq_doorbell();
    }

    /// The requester's PSNs start at `sq_psn`, with a full window.
    fn restart_send_psns(&mut self) {
        let p = self.attr.sq_psn;
        self.rt.next_psn = p;
        self.rt.una = p;
        self.rt.tx_psn = p;
        self.rt.max_sent = p;
        self.rt.cwnd = self.max_window() as u32;
        self.restart_congestion();
    }

    fn reset(&mut self) {
        self.clear_transport();
        // What the rings hold now, not what a client keeps adding while
        // rnicd drains them (its producer index is the client's to write).
        for _ in 0..self.sq_ring.ready() {
            self.sq_ring.pop();
        }
        for _ in 0..self.rq_ring.ready() {
            self.rq_ring.pop();
        }
        // The sends dropped from the ring are done too: their slots are free.
        self.publish_done();
        let keep = (self.attr.port_num, self.attr.path_mtu);
        self.attr = QpAttr::default();
        (self.attr.port_num, self.attr.path_mtu) = keep;
    }

    /// Forgets everything the transport did: the runtime state, the WQEs
    /// taken from the rings (an SRQ's go back to it), held requests and
    /// binds, timers, the round-trip estimate and the congestion window.
    /// What is left is the QP as created (but its attributes, its rings'
    /// contents and `suspended`): RESET starts from here, and so does a QP
    /// that takes a state (`Qp::take_state`).
    pub(super) fn clear_transport(&mut self) {
        self.drop_held();
        self.give_back_srq_wqe();
        self.held_local = None;
        self.sq.clear();
        self.rq.clear();
        self.rt = QpRuntime::default();
        self.tx_idx = 0;
        self.rd_outstanding = 0;
        self.retrans_deadline = None;
        self.probe_deadline = None;
        self.probe_backoff = 0;
        self.timeout_backoff = 0;
        self.srtt_us = 0.0;
        self.rttvar_us = 0.0;
        self.uc_dropping = false;
        self.publish_done();
        self.rtt_sample = None;
        self.rnr_until = None;
        self.last_rewind = None;
        self.recovery = None;
        self.suspended_nak_at = None;
        self.unasked_msgs = 0;
        self.ack_due = None;
        self.ack_since = None;
        self.peer_hold_us = 0;
        self.restart_congestion();
    }

    /// Moves to ERR on an error the QP found itself (not a modify), and
    /// raises the asynchronous event that says why.
    pub fn fail(&mut self, ctx: &mut Ctx, kind: AsyncKind) {
        if self.attr.qp_state != QpState::Err {
            ctx.asyncs.raise(self.owner, AsyncEvent { kind, object: self.qpn });
        }
        self.to_error(ctx);
    }

    /// Moves to ERR and flushes every outstanding and queued WQE.
    pub fn to_error(&mut self, ctx: &mut Ctx) {
        self.drop_held();
        self.attr.qp_state = QpState::Err;
        self.sync_rq_doorbell();
        self.retrans_deadline = None;
        self.probe_deadline = None;
        self.rnr_until = None;
        self.ack_due = None;
        self.rt.resp_queue.clear();
        self.flush(ctx);
    }

    fn flush(&mut self, ctx: &mut Ctx) {
        self.pull_sq(ctx);
        self.pull_rq(ctx);
        let (sq, rq) = (std::mem::take(&mut self.sq), std::mem::take(&mut self.rq));
        self.publish_done();
        for e in sq {
            let cqe = Cqe {
                wr_id: e.wqe.wr_id,
                qp_num: self.qpn,
                status: WcStatus::WrFlushErr as u8,
                opcode: WcOpcode::for_wr(e.op) as u8,
                ..Default::default()
            };
            ctx.complete(self.send_cq, cqe, false);
        }
        for r in rq {
            let cqe = Cqe {
                wr_id: r.wr_id,
                qp_num: self.qpn,
                status: WcStatus::WrFlushErr as u8,
                opcode: WcOpcode::Recv as u8,
                ..Default::default()
            };
            ctx.complete(self.recv_cq, cqe, false);
        }
        self.tx_idx = 0;
        self.rd_outstanding = 0;
    }
}
