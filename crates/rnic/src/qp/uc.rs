// SPDX-License-Identifier: GPL-2.0-or-later
//! Unreliable connected (UC) QPs, as IBTA vol. 1 (9.7, 9.8.3, 10.3.1)
//! defines them and Linux rxe implements them:
//!
//! - one peer, fixed at RTR as for RC (address, destination QPN, PSNs);
//! - SEND and RDMA WRITE, each with or without immediate data, split into
//!   path-MTU packets with RC's headers under UC opcodes (transport bits
//!   001); no READ, no atomics, no SEND with invalidate;
//! - no ACKs and no retransmission: the requester completes a WQE when its
//!   last packet has left, and the responder never answers;
//! - a PSN gap, a lost packet or a refused one drops the rest of the
//!   message under way; the responder starts again at the next FIRST or
//!   ONLY packet, whatever its PSN. A receive WQE a dropped SEND had begun
//!   to fill is filled again by the next SEND from its start (rxe keeps it
//!   at the head of the queue too). No receive WQE, no access or a bad
//!   R_Key drop the message silently; a message too long for its receive
//!   completes that receive with `LocLenErr` and the QP carries on.
//!
//! A UC QP is an RC QP's requester and responder with these hooks:
//! [`Qp::uc_headers`] (packet building), [`Qp::uc_sent`] (completion on
//! send), [`Qp::uc_in_sequence`] (the PSN check) and [`Qp::uc_refuse`]
//! (refusals drop instead of NAKing).

use super::responder::Refusal;
use super::{Ctx, Qp};
use crate::async_events::AsyncKind;
use crate::types::mask as m;
use crate::types::{QpState, QpType, WcOpcode, WcStatus, WrOpcode};
use crate::wire::{psn_diff, Headers, Packet};

/// The attributes a UC transition requires and those it may take, as in
/// Linux's `qp_state_table` (`ib_modify_qp_is_ok`) for IB_QPT_UC: RC's
/// without the retransmission, RNR and READ/atomic attributes; `None` for
/// no such transition.
pub(super) fn transition_attrs(cur: QpState, new: QpState) -> Option<(u32, u32)> {
    use QpState::{Err, Init, Reset, Rtr, Rts, Sqd, Sqe};
    Some(match (cur, new) {
        (_, Reset) | (_, Err) => (0, 0),
        (Reset, Init) => (m::PKEY_INDEX | m::PORT | m::ACCESS_FLAGS, 0),
        (Init, Init) => (0, m::PKEY_INDEX | m::PORT | m::ACCESS_FLAGS),
        (Init, Rtr) => (m::AV | m::PATH_MTU | m::DEST_QPN | m::RQ_PSN, m::ALT_PATH | m::ACCESS_FLAGS | m::PKEY_INDEX),
        (Rtr, Rts) => (m::SQ_PSN, m::CUR_STATE | m::ALT_PATH | m::ACCESS_FLAGS | m::PATH_MIG_STATE),
        (Rts, Rts) | (Sqd, Rts) => (0, m::CUR_STATE | m::ACCESS_FLAGS | m::ALT_PATH | m::PATH_MIG_STATE),
        (Rts, Sqd) => (0, m::EN_SQD_ASYNC_NOTIFY),
        (Sqd, Sqd) => (0, m::PKEY_INDEX | m::AV | m::ALT_PATH | m::ACCESS_FLAGS | m::PATH_MIG_STATE),
        (Sqe, Rts) => (0, m::CUR_STATE | m::ACCESS_FLAGS),
        _ => return None,
    })
}

/// Whether a UC QP carries this work request: SEND and RDMA WRITE (with or
/// without immediate data) and the local bind and invalidate WRs.
pub(super) fn carries(op: WrOpcode) -> bool {
    matches!(op, WrOpcode::Send | WrOpcode::SendImm | WrOpcode::RdmaWrite | WrOpcode::RdmaWriteImm) || op.is_local()
}

impl Qp {
    pub fn is_uc(&self) -> bool {
        self.qp_type == QpType::Uc
    }

    /// Packet building: the RC request headers become UC's (the same
    /// position and extension headers under the UC opcode) and never ask
    /// for an ACK.
    pub(super) fn uc_headers(&self, h: &mut Headers) {
        if let Some(op) = h.bth.opcode.to_uc() {
            h.bth.opcode = op;
        }
        h.bth.ack_req = false;
    }

    /// After a packet left: nothing will acknowledge it, so every PSN sent
    /// counts as acknowledged (the window never waits) and each WQE whose
    /// last packet has gone completes now, in order.
    pub(super) fn uc_sent(&mut self, ctx: &mut Ctx) {
        self.rt.una = self.rt.tx_psn;
        self.rtt_sample = None;
        while self.tx_idx > 0 {
            self.complete_front(ctx, WcStatus::Success);
        }
    }

    /// The PSN check of a UC responder: the expected PSN continues the
    /// message under way; any other PSN drops it. After a drop only a FIRST
    /// or ONLY packet is taken, at any PSN, and the expected PSN follows it.
    /// False if the packet is dropped.
    pub(super) fn uc_in_sequence(&mut self, ctx: &mut Ctx, p: &Packet) -> bool {
        if !self.uc_dropping && psn_diff(p.bth.psn, self.rt.epsn) == 0 {
            return true;
        }
        if p.bth.opcode.starts_message() {
            if self.rt.in_send || self.rt.write.is_some() {
                ctx.stats.uc_dropped_msgs += 1;
            }
            self.uc_drop_message();
            self.uc_dropping = false;
            self.rt.epsn = p.bth.psn;
            return true;
        }
        if !self.uc_dropping {
            ctx.stats.uc_dropped_msgs += 1;
        }
        self.uc_drop_message();
        self.uc_dropping = true;
        ctx.stats.uc_dropped_pkts += 1;
        false
    }

    /// A refused UC request: no NAK (UC has none). The message is dropped;
    /// a receive it overflowed completes with `LocLenErr` and the QP
    /// carries on; a receive WQE with bad buffers completes with
    /// `LocProtErr` and the QP goes to ERR, as on RC.
    pub(super) fn uc_refuse(&mut self, ctx: &mut Ctx, r: Refusal) {
        match r {
            Refusal::RecvLength => self.complete_recv(ctx, WcStatus::LocLenErr, WcOpcode::Recv, 0, None, None, false),
            Refusal::MalformedWqe => {
                self.complete_recv(ctx, WcStatus::LocProtErr, WcOpcode::Recv, 0, None, None, false);
                self.fail(ctx, AsyncKind::QpFatal);
                return;
            }
            _ => {}
        }
        ctx.stats.uc_dropped_msgs += 1;
        self.uc_drop_message();
        self.uc_dropping = true;
    }

    /// Forgets the message under way; its receive WQE, if it had one, stays
    /// at the head of the queue for the next SEND.
    fn uc_drop_message(&mut self) {
        self.rt.in_send = false;
        self.rt.write = None;
        self.rt.recv_offset = 0;
    }
}
