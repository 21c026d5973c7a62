//! Suspend, query, restore and resume (seed 000): a suspended QP touches
//! neither host memory nor its rings, its peer sees only RNR NAKs, and its
//! transport state ([`QpSnapshot`]) can be taken out and put into a QP
//! created elsewhere.

use super::RespJob;
use super::{Ctx, Qp, QpRuntime, QpSnapshot, ATOMIC_REPLAY, MAX_MSG, MAX_RESP_QUEUE, QP_SNAPSHOT_VERSION};
use crate::ring::RecvWqe;
use crate::types::{QpAttr, QpState};
use crate::wire::{self, psn_diff, NakCode, Syndrome};

/// A client's QP state that [`Qp::check_snapshot`] accepted, in the form
/// the QP takes it.
pub struct CheckedState {
    attr: QpAttr,
    runtime: QpRuntime,
    /// The SRQ receive WQE a SEND in progress was landing in.
    srq_wqe: Option<RecvWqe>,
}

impl Qp {
    /// Suspends processing: from now on the QP touches neither host memory
    /// nor its rings, and its peer sees only RNR NAKs.
    ///
    /// Responses already due that need no memory (ACKs, atomic ACKs) go out
    /// now, and a READ response that cannot is replaced by an RNR NAK for
    /// its PSN: a peer whose requests were all executed would otherwise hear
    /// nothing until the resume and count retransmission timeouts (retry_cnt)
    /// during a long move.
    pub fn suspend(&mut self, ctx: &mut Ctx) -> Result<(), String> {
        self.check_suspend()?;
        if !self.suspended {
            if self.ack_due.is_some() {
                self.ack_last_executed();
            }
            while matches!(self.rt.resp_queue.front(), Some(RespJob::Ack { .. } | RespJob::AtomicAck { .. })) {
                let mut one = 1;
                self.responder_tx(ctx, &mut one);
            }
            if let Some(RespJob::Read { psn, .. }) = self.rt.resp_queue.front() {
                let psn = *psn;
                self.suspended_nak_at = Some(ctx.now);
                self.suspended_nak(ctx, psn);
            }
        }
        // Held requests are not state: the peer resends them.
        self.drop_held();
        self.give_back_srq_wqe();
        self.suspended = true;
        self.retrans_deadline = None;
        self.probe_deadline = None;
        self.rnr_until = None;
        Ok(())
    }

    /// Whether [`Qp::suspend`] takes this QP: a connected RC QP (a batch
    /// checks every QP before any is suspended).
    pub fn check_suspend(&self) -> Result<(), String> {
        if self.qp_type != crate::types::QpType::Rc {
            return Err(format!("{:?} QPs cannot be suspended", self.qp_type));
        }
        if !matches!(self.attr.qp_state, QpState::Rtr | QpState::Rts | QpState::Sqd) {
            return Err(format!("only an RTR/RTS/SQD QP can be suspended, not {:?}", self.attr.qp_state));
        }
        Ok(())
    }

    /// The runtime state of a suspended QP. WQEs already taken from the ring
    /// but not retired are described by PSNs only: `next_psn` goes back to the
    /// first of them, so that reposting them in order gives each its old PSNs.
    pub fn snapshot(&self) -> Result<QpSnapshot, String> {
        if !self.suspended {
            return Err("query-suspended needs a suspended QP".into());
        }
        let mut rt = self.rt.clone();
        if let Some(e) = self.sq.front() {
            rt.next_psn = e.first_psn;
        }
        rt.tx_psn = rt.una;
        rt.srq_wqe = if self.srq.is_some() && rt.in_send { self.rq.front().map(crate::srq::save_recv) } else { None };
        Ok(QpSnapshot { version: QP_SNAPSHOT_VERSION, qpn: self.qpn, attr: self.attr, runtime: rt })
    }

    /// Create-suspended: takes the transport state of `s` (checked, since it
    /// comes from a client). The QP stays suspended until [`Qp::resume`].
    pub fn restore(&mut self, s: &QpSnapshot) -> Result<(), String> {
        self.take_state(Self::check_snapshot(s)?);
        Ok(())
    }

    /// Takes a state checked by [`Qp::check_snapshot`] and stays (or
    /// becomes) suspended. Nothing of what the transport did before is
    /// kept, so the QP is as if created from the state.
    pub fn take_state(&mut self, state: CheckedState) {
        self.clear_transport();
        self.attr = state.attr;
        self.attr.dest_qp_num &= wire::QPN_MASK;
        self.attr.sq_draining = false;
        self.rt = state.runtime;
        self.rt.srq_wqe = None;
        self.restart_congestion();
        self.rq.extend(state.srq_wqe);
        self.suspended = true;
        self.awaiting_state = false;
    }

    /// Whether a client's state `s` can be taken; what the QP would take
    /// (PSNs masked). A batch checks every QP's state before any takes its
    /// own.
    pub fn check_snapshot(s: &QpSnapshot) -> Result<CheckedState, String> {
        if s.version != QP_SNAPSHOT_VERSION {
            return Err(format!("QP state version {} (this rnicd reads {QP_SNAPSHOT_VERSION})", s.version));
        }
        let a = &s.attr;
        if !matches!(a.qp_state, QpState::Rtr | QpState::Rts | QpState::Sqd) {
            return Err(format!("a QP can be created suspended in RTR/RTS/SQD, not {:?}", a.qp_state));
        }
        if a.retry_cnt > 7 || a.rnr_retry > 7 || a.min_rnr_timer > 31 || a.timeout > 31 || a.dest_gid.is_unspecified() {
            return Err("bad QP attributes in the state".into());
        }
        let r = &s.runtime;
        if r.resp_queue.len() > MAX_RESP_QUEUE
            || r.atomic_results.len() > 2 * ATOMIC_REPLAY.max(256)
            || r.read_history.len() > 2 * ATOMIC_REPLAY.max(256)
            || r.recv_offset > MAX_MSG
        {
            return Err("QP state queues too long".into());
        }
        if r.write.is_some_and(|w| w.remaining > MAX_MSG || w.total > MAX_MSG) {
            return Err("bad WRITE in progress".into());
        }
        let m = wire::PSN_MASK;
        let mut rt = r.clone();
        for p in [&mut rt.next_psn, &mut rt.una, &mut rt.tx_psn, &mut rt.max_sent, &mut rt.epsn, &mut rt.msn] {
            *p &= m;
        }
        // next_psn is the first PSN of the oldest WQE not retired, so
        // next_psn <= una <= max_sent.
        if psn_diff(rt.max_sent, rt.una) < 0 || psn_diff(rt.una, rt.next_psn) < 0 {
            return Err("inconsistent requester PSNs".into());
        }
        rt.tx_psn = rt.una;
        let srq_wqe = r.srq_wqe.as_ref().map(|w| crate::srq::load_recv(w, crate::ring::MAX_SGE as u32)).transpose()?;
        Ok(CheckedState { attr: s.attr, runtime: rt, srq_wqe })
    }

    /// Resumes a suspended (or created-suspended) QP: unacknowledged requests
    /// go out again from `una` (the peer's responses were dropped meanwhile).
    pub fn resume(&mut self, ctx: &mut Ctx) -> Result<(), String> {
        if !self.suspended {
            return Err("QP is not suspended".into());
        }
        self.suspended = false;
        self.awaiting_state = false;
        self.rt.retry_left = self.attr.retry_cnt;
        self.rt.rnr_left = self.attr.rnr_retry;
        self.rewind(ctx);
        self.last_rewind = None;
        self.pull_sq(ctx);
        // Receives stay in their ring until a message takes them (outside
        // ERR, see `rq_on_demand`): pulling them all here would let the
        // client post a second queue's worth behind them.
        if !self.rq_on_demand() {
            self.pull_rq(ctx);
        }
        // Kick the peer: a PSN sequence NAK for the PSN we expect makes it
        // resend from there now instead of at its next RNR or retry timer
        // (a peer with nothing outstanding drops it as out of window).
        if matches!(self.attr.qp_state, QpState::Rts | QpState::Sqd | QpState::Rtr) {
            self.queue_nak(self.rt.epsn, Syndrome::Nak(NakCode::PsnSeqError));
        }
        Ok(())
    }
}
