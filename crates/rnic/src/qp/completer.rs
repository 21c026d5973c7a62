//! The completer: consumes ACKs, NAKs, READ responses and atomic ACKs,
//! places response data, and completes send WQEs in order.

use std::time::Duration;

use super::{Ctx, Qp, RECOVERY_FIRST};
use crate::async_events::AsyncKind;
use crate::keys::scatter;
use crate::ring::Cqe;
use crate::types::{QpState, WcOpcode, WcStatus, WrOpcode};
use crate::wire::{self, psn_add, psn_diff, NakCode, OpKind, Opcode, Packet, Syndrome};

impl Qp {
    pub(super) fn complete_front(&mut self, ctx: &mut Ctx, status: WcStatus) {
        let Some(e) = self.sq.pop_front() else { return };
        self.rt.sq_retired += 1;
        self.publish_done();
        if self.tx_idx > 0 {
            self.tx_idx -= 1;
            if e.op.is_read_or_atomic() {
                self.rd_outstanding = self.rd_outstanding.saturating_sub(1);
            }
        } else if psn_diff(self.rt.tx_psn, psn_add(e.last_psn(), 1)) < 0 {
            self.rt.tx_psn = psn_add(e.last_psn(), 1);
        }
        if e.signaled || status != WcStatus::Success {
            let byte_len = if e.op.is_read_or_atomic() { e.len as u32 } else { 0 };
            let cqe = Cqe {
                wr_id: e.wqe.wr_id,
                byte_len: if e.op == WrOpcode::RdmaRead || e.op.is_atomic() { byte_len } else { e.len as u32 },
                qp_num: self.qpn,
                status: status as u8,
                opcode: WcOpcode::for_wr(e.op) as u8,
                ..Default::default()
            };
            ctx.complete(self.send_cq, cqe, false);
        }
    }

    /// Completes WQE `idx` (and its predecessors, successfully) with an error,
    /// then moves the QP to ERR.
    pub(super) fn fail_wqe_at(&mut self, ctx: &mut Ctx, idx: usize, status: WcStatus) {
        for _ in 0..idx {
            self.complete_front(ctx, WcStatus::Success);
        }
        self.complete_front(ctx, status);
        self.fail(ctx, AsyncKind::QpFatal);
    }

    fn progress(&mut self, ctx: &mut Ctx) {
        if let Some((p, t)) = self.rtt_sample {
            if psn_diff(self.rt.una, p) > 0 {
                // The timers wait for answers as they come, late ones
                // included; the delay signal takes the path's part only:
                // from the send to the ACK's arrival in the kernel, less
                // what the responder reports it held the requests.
                let us = ctx.now.saturating_duration_since(t).as_secs_f64() * 1e6;
                self.rtt_update(us);
                self.rtt_sample = None;
                let path_us = ctx.arrived.saturating_duration_since(t).as_secs_f64() * 1e6 - self.peer_hold_us as f64;
                self.on_rtt_sample(ctx, path_us.max(0.0));
                // Karn: a backed-off probe stays backed off until a packet
                // sent once is answered. Clearing the backoff on any
                // progress kept a QP whose answers came later than its
                // first probe (20 ms before any sample) probing at that
                // pace for ever: each probe resent the window and voided
                // the sample that would have lengthened it. With 256 QPs
                // most never had a sample, and the resends filled the
                // responders' sockets.
                self.probe_backoff = 0;
                self.timeout_backoff = 0;
            }
        }
        self.grow_window();
        self.rt.retry_left = self.attr.retry_cnt;
        self.rt.rnr_left = self.attr.rnr_retry;
        self.last_rewind = None;
        if psn_diff(self.rt.max_sent, self.rt.una) > 0 {
            self.arm_timer(ctx.now);
        } else {
            self.retrans_deadline = None;
            self.probe_deadline = None;
        }
        // A late ACK can overtake a rewind: never resend what is acknowledged.
        if psn_diff(self.rt.tx_psn, self.rt.una) < 0 {
            match self.sq.front() {
                Some(e) if e.op.is_read_or_atomic() => {
                    // Its responses are flowing: the request counts as sent.
                    self.rt.tx_psn = psn_add(e.last_psn(), 1);
                    self.tx_idx = 1;
                    self.rd_outstanding = 1;
                }
                _ => {
                    self.rt.tx_psn = self.rt.una;
                    self.tx_idx = 0;
                    self.rd_outstanding = 0;
                }
            }
        }
        // Loss recovery resends a span that doubles with every ACK, until it
        // reaches what was sent before the loss.
        if let Some(n) = self.recovery {
            let done = psn_diff(psn_add(self.rt.una, n.saturating_mul(2)), self.rt.max_sent) >= 0;
            self.recovery = if done { None } else { Some(n.saturating_mul(2)) };
        }
    }

    /// ACK semantics for everything up to and including `psn`. Returns false
    /// if that skips an unfinished READ/atomic (its response was lost).
    fn ack_through(&mut self, ctx: &mut Ctx, psn: u32) -> bool {
        if psn_diff(psn, self.rt.una) < 0 {
            return true;
        }
        let mut moved = false;
        let mut ok = true;
        while let Some(e) = self.sq.front() {
            if psn_diff(psn, e.first_psn) < 0 {
                break;
            }
            if e.op.is_read_or_atomic() {
                ok = false;
                break;
            }
            if psn_diff(psn, e.last_psn()) >= 0 {
                self.rt.una = psn_add(e.last_psn(), 1);
                self.complete_front(ctx, WcStatus::Success);
                moved = true;
            } else {
                self.rt.una = psn_add(psn, 1);
                moved = true;
                break;
            }
        }
        if moved {
            self.progress(ctx);
        }
        ok
    }

    /// A response: ACK/NAK, atomic ACK or READ response, for a PSN in the
    /// window [una, max_sent); anything else is dropped and counted.
    pub fn on_response(&mut self, ctx: &mut Ctx, p: &Packet) {
        if self.suspended {
            // Dropped: the requests go out again from `una` on resume.
            ctx.stats.rx_while_suspended += 1;
            return;
        }
        if !matches!(self.attr.qp_state, QpState::Rts | QpState::Sqd | QpState::Sqe) {
            ctx.stats.rx_wrong_state += 1;
            return;
        }
        let psn = p.bth.psn;
        if psn_diff(psn, self.rt.una) < 0 || psn_diff(psn, self.rt.max_sent) >= 0 {
            ctx.stats.rx_resp_out_of_window += 1;
            return;
        }
        match p.bth.opcode.info().kind {
            OpKind::Ack => self.on_ack(ctx, p),
            OpKind::AtomicAck => self.on_atomic_ack(ctx, p),
            OpKind::ReadResponse => self.on_read_response(ctx, p),
            _ => ctx.stats.rx_bad_response += 1,
        }
        self.attr.sq_draining = self.attr.qp_state == QpState::Sqd && psn_diff(self.rt.max_sent, self.rt.una) > 0;
    }

    /// ACK, RNR NAK or NAK.
    fn on_ack(&mut self, ctx: &mut Ctx, p: &Packet) {
        ctx.stats.ack_packets_received += 1;
        self.peer_hold_us = wire::decode_hold(p.bth.resv6);
        self.on_ack_held(ctx, p);
        self.peer_hold_us = 0;
    }

    fn on_ack_held(&mut self, ctx: &mut Ctx, p: &Packet) {
        let psn = p.bth.psn;
        let prev = psn_add(psn, wire::PSN_MASK);
        let Some(aeth) = p.aeth else { return };
        match aeth.syndrome {
            Syndrome::Ack(_) => {
                if !self.ack_through(ctx, psn) {
                    self.rewind_once(ctx);
                }
            }
            Syndrome::RnrNak(code) => {
                ctx.stats.rnr_naks_received += 1;
                if !self.ack_through(ctx, prev) {
                    self.rewind_once(ctx);
                    return;
                }
                if self.attr.rnr_retry != 7 {
                    if self.rt.rnr_left == 0 {
                        self.fail_wqe_at(ctx, 0, WcStatus::RnrRetryExcErr);
                        return;
                    }
                    self.rt.rnr_left -= 1;
                }
                self.rnr_until = Some(ctx.now + Duration::from_micros(wire::rnr_timer_us(code)));
                self.retrans_deadline = None;
                self.probe_deadline = None;
                self.rewind(ctx);
                // The responder keeps what arrived after the NAKed
                // request: resend a span, not the whole window.
                self.recovery = Some(RECOVERY_FIRST);
            }
            Syndrome::Nak(NakCode::PsnSeqError) => self.on_seq_nak(ctx, prev),
            Syndrome::Nak(code) => {
                self.ack_through(ctx, prev);
                let status = match code {
                    NakCode::RemoteAccessError => WcStatus::RemAccessErr,
                    NakCode::RemoteOpError => WcStatus::RemOpErr,
                    _ => WcStatus::RemInvReqErr,
                };
                self.fail_wqe_at(ctx, 0, status);
            }
            Syndrome::Reserved(_) => ctx.stats.rx_bad_response += 1,
        }
    }

    /// A sequence NAK naming `prev + 1` as the PSN the responder expects.
    /// It always rewinds. A responder NAKs a gap once (rnicd, Linux rxe),
    /// so another NAK for the PSN the requester went back to says that the
    /// resend was lost too, or that the responder resumed, maybe on
    /// another host, and names what it expects. Taking such a NAK as a
    /// duplicate within a round trip of the rewind ignored 6-49 of the 256
    /// resume NAKs of each move at 256 QPs, where round trips are 50-90
    /// ms, and none in runs without a move: those QPs waited for their
    /// loss probe, backed off over the move.
    fn on_seq_nak(&mut self, ctx: &mut Ctx, prev: u32) {
        // The responder is ready, so an RNR wait (a suspended QP that
        // resumed) ends now and the resend starts at once.
        self.rnr_until = None;
        if !self.ack_through(ctx, prev) {
            self.rewind_for_gap(ctx);
            return;
        }
        // A packet was lost: most often a full queue on the way (the
        // window is cut once per window of losses).
        self.cut_window(ctx);
        self.rewind_for_gap(ctx);
        self.recovery = Some(RECOVERY_FIRST);
    }

    /// The result of the atomic at the head of the send queue.
    fn on_atomic_ack(&mut self, ctx: &mut Ctx, p: &Packet) {
        let psn = p.bth.psn;
        let prev = psn_add(psn, wire::PSN_MASK);
        if !self.ack_through(ctx, prev) {
            self.rewind_once(ctx);
            return;
        }
        let (Some(e), Some(orig)) = (self.sq.front(), p.atomic_ack) else { return };
        if !e.op.is_atomic() || e.first_psn != psn {
            ctx.stats.rx_bad_response += 1;
            return;
        }
        let r = scatter(ctx.keys, self.pd, e.sges(), 0, &orig.to_ne_bytes());
        self.rt.una = psn_add(psn, 1);
        match r {
            Ok(()) => {
                self.complete_front(ctx, WcStatus::Success);
                self.progress(ctx);
            }
            Err(s) => self.fail_wqe_at(ctx, 0, s),
        }
    }

    /// One packet of the READ at the head of the send queue, in order.
    fn on_read_response(&mut self, ctx: &mut Ctx, p: &Packet) {
        let psn = p.bth.psn;
        let prev = psn_add(psn, wire::PSN_MASK);
        if !self.ack_through(ctx, prev) {
            self.rewind_once(ctx);
            return;
        }
        if psn != self.rt.una {
            // An earlier response (or an ACK) went missing.
            self.rewind_once(ctx);
            return;
        }
        let Some(e) = self.sq.front() else { return };
        if e.op != WrOpcode::RdmaRead {
            ctx.stats.rx_bad_response += 1;
            return;
        }
        let i = psn_diff(psn, e.first_psn) as u32;
        let mtu = self.mtu();
        let off = i as u64 * mtu;
        let last = i + 1 == e.npkts;
        let want = (e.len - off).min(mtu) as usize;
        use Opcode::*;
        let op_ok = match (i == 0, last) {
            (true, true) => p.bth.opcode == ReadRespOnly,
            (true, false) => p.bth.opcode == ReadRespFirst,
            (false, false) => p.bth.opcode == ReadRespMiddle,
            (false, true) => p.bth.opcode == ReadRespLast,
        };
        // A re-requested READ restarts with FIRST/ONLY at a middle PSN.
        let restart_ok = i > 0 && matches!(p.bth.opcode, ReadRespFirst | ReadRespOnly) && (p.bth.opcode == ReadRespOnly) == last;
        if !(op_ok || restart_ok) || p.payload.len() != want {
            ctx.stats.rx_bad_response += 1;
            self.fail_wqe_at(ctx, 0, WcStatus::BadRespErr);
            return;
        }
        if let Err(s) = scatter(ctx.keys, self.pd, e.sges(), off, p.payload) {
            self.fail_wqe_at(ctx, 0, s);
            return;
        }
        self.rt.una = psn_add(psn, 1);
        if last {
            self.complete_front(ctx, WcStatus::Success);
        }
        self.progress(ctx);
    }
}
