//! The responder: checks incoming requests, executes them strictly in PSN
//! order, and queues its responses in PSN order.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::{Ctx, Qp, ReadExec, RespJob, WriteCtx, ATOMIC_REPLAY, MAX_MSG, MAX_RESP_QUEUE};
use crate::async_events::AsyncKind;
use crate::keys::{scatter, Resolved};
use crate::ring::{Cqe, MAX_SGE};
use crate::types::{access, wc_flags, QpState, WcOpcode, WcStatus};
use crate::wire::{self, psn_add, psn_diff, Aeth, Headers, NakCode, Opcode, Packet, Syndrome};

/// A responder acknowledges requests that did not ask for it (AckReq clear)
/// within this time (µs): it coalesces their ACKs, and a requester that
/// stops sending still hears about its last messages long before its loss
/// probe (`requester::MIN_PROBE_US`).
const ACK_DELAY_US: u64 = 100;
/// A stream's coalesced ACK (`Qp::end_of_receive_pass`): at the end of a
/// receive pass once this many requests wait for it, and while a message
/// is mid-way no later than STREAM_ACK_DELAY after the first of them.
/// 16 packets are 64 KiB at path MTU 4096; a requester whose window is
/// smaller asks for ACKs itself more often (AckReq, `requester::ack_every`).
const STREAM_ACK_BATCH: u32 = 16;
/// Far below the requester's loss probe (4 ms at least) and its IB
/// timeout: the rest of the message comes long before, and its ACK with it.
const STREAM_ACK_DELAY: Duration = Duration::from_micros(500);
/// Requests a responder keeps when they arrive ahead of a gap (see `Qp::hold`).
const HOLD_MAX_PKTS: usize = 2048;
const HOLD_MAX_BYTES: usize = 4 << 20;
/// The shortest RNR wait a suspended QP asks of its peers: 0.96 ms (IBTA
/// RNR timer code 13).
const SUSPENDED_RNR_TIMER: u8 = 13;

/// What the PSN check found.
enum PsnCheck {
    Expected,
    /// This many PSNs ahead of the expected one.
    Ahead(i32),
    Duplicate,
}

/// Why the responder refuses a request, named after the responder's checks
/// (IBTA vol. 1 9.7.5.1; Linux rxe's `RESPST_ERR_*` states).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Refusal {
    /// Opcode sequence: the middle or last packet of a message that never began.
    MissingOpcodeFirst,
    /// Opcode sequence: a new message before the one under way ended.
    MissingOpcodeLast,
    /// Opcode valid: the QP's access flags do not enable the operation.
    OpNotEnabled,
    /// Resources: no receive WQE yet (receiver not ready).
    Rnr,
    /// Resources: more READ/atomic responses pending than the QP keeps.
    TooManyRdmaAtomic,
    /// Length: payload or DMA length does not match the packet or message.
    Length,
    /// Length: the message does not fit in the receive WQE's buffers.
    RecvLength,
    /// R_Key: an atomic's target is not 8-byte aligned.
    MisalignedAtomic,
    /// R_Key: no such region in the QP's PD, out of its range, or without the access.
    RkeyViolation,
    /// Execute: the receive WQE's own buffers are not valid local memory.
    MalformedWqe,
}

impl Refusal {
    /// The NAK that answers it; none for an RNR (an RNR NAK, not an error).
    fn nak_code(self) -> Option<NakCode> {
        Some(match self {
            Refusal::Rnr => return None,
            Refusal::OpNotEnabled | Refusal::RkeyViolation => NakCode::RemoteAccessError,
            Refusal::MalformedWqe => NakCode::RemoteOpError,
            Refusal::MissingOpcodeFirst
            | Refusal::MissingOpcodeLast
            | Refusal::TooManyRdmaAtomic
            | Refusal::Length
            | Refusal::RecvLength
            | Refusal::MisalignedAtomic => NakCode::InvalidRequest,
        })
    }
}

/// Where the R_Key check found the data of a packet to go.
enum Target {
    None,
    /// Host memory of this WRITE packet's payload.
    Write(Resolved),
    /// Host address of the atomic's 8-byte word, and what keeps it mapped.
    Atomic(*mut u8, Resolved),
}

impl Qp {
    /// Acknowledge everything executed so far (the PSN before the next
    /// expected one).
    pub(super) fn ack_last_executed(&mut self) {
        self.queue_ack(psn_add(self.rt.epsn, wire::PSN_MASK));
    }

    fn queue_ack(&mut self, psn: u32) {
        // Acknowledges everything before it, the coalesced ones too.
        self.ack_due = None;
        self.unacked = 0;
        if let Some(RespJob::Ack { psn: p, syndrome }) = self.rt.resp_queue.back_mut() {
            if Syndrome::from_u8(*syndrome) == Syndrome::Ack(0x1f) {
                *p = psn;
                return;
            }
        }
        self.rt.resp_queue.push_back(RespJob::Ack { psn, syndrome: Syndrome::Ack(0x1f).to_u8() });
    }

    pub(super) fn queue_nak(&mut self, psn: u32, s: Syndrome) {
        self.ack_due = None;
        self.rt.resp_queue.push_back(RespJob::Ack { psn, syndrome: s.to_u8() });
    }

    /// Fatal responder error: NAK it and move the QP to ERR (after the NAK goes out).
    fn responder_error(&mut self, ctx: &mut Ctx, psn: u32, code: NakCode) {
        ctx.stats.error_naks_sent += 1;
        let flow = self.flow(ctx.gid);
        let mut h = Headers::new(Opcode::Ack, self.attr.dest_qp_num, psn);
        h.aeth = Some(Aeth { syndrome: Syndrome::Nak(code), msn: self.rt.msn });
        let _ = ctx.tx.emit(&flow, &h, 0, |_| Ok::<(), ()>(()));
        let kind = match code {
            NakCode::RemoteAccessError => AsyncKind::QpAccessErr,
            NakCode::InvalidRequest | NakCode::InvalidRdRequest => AsyncKind::QpReqErr,
            _ => AsyncKind::QpFatal,
        };
        self.fail(ctx, kind);
    }

    fn rq_head(&mut self, ctx: &mut Ctx) -> bool {
        if self.rq.is_empty() {
            match self.srq {
                Some(_) => self.take_srq_wqe(ctx),
                // One at a time: the others stay in the ring, which
                // is then the queue of receives not yet used.
                None => self.pull_rq_up_to(ctx, 1),
            }
        }
        !self.rq.is_empty()
    }

    // One argument per field of the receive CQE it writes.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn complete_recv(
        &mut self,
        ctx: &mut Ctx,
        status: WcStatus,
        opcode: WcOpcode,
        byte_len: u32,
        imm: Option<u32>,
        inv: Option<u32>,
        solicited: bool,
    ) {
        let Some(r) = self.rq.pop_front() else { return };
        self.rt.rq_retired += 1;
        let mut flags = 0;
        let mut immv = 0;
        if let Some(i) = imm {
            flags |= wc_flags::WITH_IMM;
            immv = i;
        }
        if let Some(k) = inv {
            flags |= wc_flags::WITH_INV;
            immv = k;
        }
        let cqe = Cqe {
            wr_id: r.wr_id,
            byte_len,
            imm: immv,
            qp_num: self.qpn,
            src_qp: self.attr.dest_qp_num,
            status: status as u8,
            opcode: opcode as u8,
            wc_flags: flags,
            ..Default::default()
        };
        ctx.complete(self.recv_cq, cqe, solicited);
    }

    /// Suspended answer to any request: RNR NAK for its PSN (or for the
    /// expected one if it is ahead), sent at once and touching no memory.
    /// The RNR timer a suspended QP's NAKs ask for: its own
    /// `min_rnr_timer`, but at least SUSPENDED_RNR_TIMER. A move takes
    /// milliseconds; peers told to retry every 10 us (a common
    /// `min_rnr_timer`) flood the host of the suspended QPs with retries
    /// that delay the move's own control requests. The resume's sequence
    /// NAK tells the peer to resend at once, before this timer ends.
    pub(super) fn suspended_rnr_timer(&self) -> u8 {
        let own = self.attr.min_rnr_timer;
        if wire::rnr_timer_us(own) >= wire::rnr_timer_us(SUSPENDED_RNR_TIMER) {
            own
        } else {
            SUSPENDED_RNR_TIMER
        }
    }

    pub(super) fn suspended_nak(&mut self, ctx: &mut Ctx, psn: u32) {
        let nak_psn = if psn_diff(psn, self.rt.epsn) <= 0 { psn } else { self.rt.epsn };
        ctx.stats.rnr_naks_sent += 1;
        let flow = self.flow(ctx.gid);
        let mut h = Headers::new(Opcode::Ack, self.attr.dest_qp_num, nak_psn);
        h.aeth = Some(Aeth { syndrome: Syndrome::RnrNak(self.suspended_rnr_timer()), msn: self.rt.msn });
        let _ = ctx.tx.emit(&flow, &h, 0, |_| Ok::<(), ()>(()));
    }

    pub fn on_request(&mut self, ctx: &mut Ctx, p: &Packet) {
        if self.is_uc() != p.bth.opcode.is_uc() {
            ctx.stats.rx_unknown_qp += 1; // no QP of this transport
            return;
        }
        let epsn = self.rt.epsn;
        self.handle_request(ctx, p);
        if !self.held.is_empty() && self.rt.epsn != epsn {
            self.release_held(ctx);
        }
    }

    /// Keeps a request that arrived ahead of the expected PSN (the one at
    /// the gap was lost): when the requester's go-back-N resend fills the
    /// gap, these are executed at once and one ACK covers them all, which
    /// cuts that resend short (its requester stops at the ACKed PSN). The
    /// order in which requests execute is unchanged: strictly by PSN.
    fn hold(&mut self, ctx: &mut Ctx, p: &Packet, d: i32) {
        if d as usize >= HOLD_MAX_PKTS || self.held_bytes + p.payload.len() > HOLD_MAX_BYTES {
            return;
        }
        let psn = p.bth.psn;
        let at = self.held.iter().rposition(|(q, _, _)| psn_diff(*q, psn) <= 0).map_or(0, |i| i + 1);
        if at > 0 && self.held[at - 1].0 == psn {
            return;
        }
        ctx.stats.held_out_of_order += 1;
        self.held_bytes += p.payload.len();
        self.held.insert(at, (psn, Packet { payload: &[], ..*p }, p.payload.to_vec()));
    }

    /// Executes the held requests that are now in sequence.
    fn release_held(&mut self, ctx: &mut Ctx) {
        while let Some((psn, _, _)) = self.held.front() {
            let d = psn_diff(*psn, self.rt.epsn);
            if d > 0 {
                break;
            }
            let (_, hdr, data) = self.held.pop_front().unwrap();
            self.held_bytes -= data.len();
            if d == 0 {
                let epsn = self.rt.epsn;
                self.handle_request(ctx, &Packet { payload: &data, ..hdr });
                if self.rt.epsn == epsn {
                    break; // RNR or error: the requester resends from here
                }
            }
        }
    }

    pub(super) fn drop_held(&mut self) {
        self.held.clear();
        self.held_bytes = 0;
    }

    /// One request, through the responder's checks in the order of IBTA
    /// vol. 1 9.7.5.1 (and of Linux rxe's responder states): PSN, opcode
    /// sequence, opcode valid, resources, length, R_Key, then execute and
    /// acknowledge. The first check that fails decides the answer.
    fn handle_request(&mut self, ctx: &mut Ctx, p: &Packet) {
        if !matches!(self.attr.qp_state, QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe) {
            ctx.stats.rx_wrong_state += 1;
            return;
        }
        if self.suspended {
            self.suspended_request(ctx, p.bth.psn);
            return;
        }
        match self.check_psn(p.bth.psn) {
            _ if self.is_uc() => {
                if !self.uc_in_sequence(ctx, p) {
                    return;
                }
            }
            PsnCheck::Expected => {}
            PsnCheck::Ahead(d) => {
                if !self.rt.nak_sent {
                    ctx.stats.seq_naks_sent += 1;
                    self.rt.nak_sent = true;
                    self.queue_nak(self.rt.epsn, Syndrome::Nak(NakCode::PsnSeqError));
                }
                self.hold(ctx, p, d);
                return;
            }
            PsnCheck::Duplicate => {
                self.duplicate(ctx, p);
                return;
            }
        }
        let op = p.bth.opcode;
        let checked = self
            .check_op_seq(op)
            .and_then(|()| self.check_op_valid(op))
            .and_then(|()| self.check_resources(ctx, p))
            .and_then(|()| self.check_length(p))
            .and_then(|()| self.check_rkey(ctx, p))
            .and_then(|target| self.execute(ctx, p, target));
        match checked {
            Ok(()) => {}
            Err(refusal) => self.refuse(ctx, p.bth.psn, refusal),
        }
    }

    /// A suspended QP answers any request with an RNR NAK, one per RNR
    /// period: the rest of a burst is resent by the peer after its RNR wait
    /// anyway; NAKing every packet restarts its wait and rewinds it again and
    /// again (a storm of retransmissions that takes the CPU while the QP moves).
    fn suspended_request(&mut self, ctx: &mut Ctx, psn: u32) {
        ctx.stats.rx_while_suspended += 1;
        let period = Duration::from_micros(wire::rnr_timer_us(self.suspended_rnr_timer()));
        if self.suspended_nak_at.is_some_and(|t| ctx.now < t + period) {
            return;
        }
        self.suspended_nak_at = Some(ctx.now);
        self.suspended_nak(ctx, psn);
    }

    /// PSN check: the expected request, one ahead of it (an earlier one was
    /// lost) or a duplicate (the requester resends).
    fn check_psn(&self, psn: u32) -> PsnCheck {
        match psn_diff(psn, self.rt.epsn) {
            0 => PsnCheck::Expected,
            d if d > 0 => PsnCheck::Ahead(d),
            _ => PsnCheck::Duplicate,
        }
    }

    /// Opcode sequence: the middle or end of a SEND or WRITE continues the
    /// message under way, and nothing else comes until it ends.
    fn check_op_seq(&self, op: Opcode) -> Result<(), Refusal> {
        let continues = if self.rt.in_send {
            op.is_send()
        } else if self.rt.write.is_some() {
            op.is_write()
        } else {
            return if op.starts_message() { Ok(()) } else { Err(Refusal::MissingOpcodeFirst) };
        };
        if continues && !op.starts_message() {
            Ok(())
        } else {
            Err(Refusal::MissingOpcodeLast)
        }
    }

    /// Opcode valid: the QP's access flags enable the operation.
    fn check_op_valid(&self, op: Opcode) -> Result<(), Refusal> {
        let need = Self::remote_access_for(op);
        if self.attr.qp_access_flags & need == need {
            Ok(())
        } else {
            Err(Refusal::OpNotEnabled)
        }
    }

    /// The remote access a request opcode needs of the QP and of the region.
    fn remote_access_for(op: Opcode) -> u32 {
        if op.is_write() {
            access::REMOTE_WRITE
        } else if op == Opcode::ReadRequest {
            access::REMOTE_READ
        } else if op.is_atomic() {
            access::REMOTE_ATOMIC
        } else {
            0
        }
    }

    /// Resources: a receive WQE for a message that consumes one (a SEND, a
    /// WRITE with immediate), room for the responses of a READ or atomic.
    fn check_resources(&mut self, ctx: &mut Ctx, p: &Packet) -> Result<(), Refusal> {
        let op = p.bth.opcode;
        let needs_recv = (op.is_send() && op.starts_message()) || (op.is_write() && op.has_imm());
        if needs_recv && !self.rq_head(ctx) {
            return Err(Refusal::Rnr);
        }
        if op == Opcode::ReadRequest {
            // A compliant requester keeps at most max_rd_atomic READs/atomics
            // outstanding (<= our max_dest_rd_atomic); the slack covers
            // duplicates. Bounds what a hostile peer can make us stream out
            // of client memory.
            let reads = self.rt.resp_queue.iter().filter(|j| matches!(j, RespJob::Read { .. })).count();
            let limit = (self.attr.max_dest_rd_atomic.max(1) as usize * 2 + 8).min(MAX_RESP_QUEUE);
            if reads >= limit {
                return Err(Refusal::TooManyRdmaAtomic);
            }
        }
        if (op == Opcode::ReadRequest || op.is_atomic()) && self.rt.resp_queue.len() >= MAX_RESP_QUEUE {
            return Err(Refusal::TooManyRdmaAtomic);
        }
        Ok(())
    }

    /// Length: a packet that does not end its message fills the path MTU,
    /// one that does is no longer; a WRITE's data adds up to its RETH
    /// length; a SEND fits in the receive WQE's buffers.
    fn check_length(&self, p: &Packet) -> Result<(), Refusal> {
        let op = p.bth.opcode;
        let n = p.payload.len() as u64;
        let mtu = self.mtu();
        if (op.ends_message() && n > mtu) || (!op.ends_message() && n != mtu) {
            return Err(Refusal::Length);
        }
        if op.is_write() {
            let remaining = match (p.reth, self.rt.write) {
                (Some(reth), _) => {
                    let len = reth.len as u64;
                    if len > MAX_MSG || (op.ends_message() && len != n) || (!op.ends_message() && len <= n) {
                        return Err(Refusal::Length);
                    }
                    len
                }
                (None, Some(w)) => w.remaining,
                (None, None) => return Err(Refusal::MissingOpcodeFirst),
            };
            if n > remaining || (op.ends_message() && n != remaining) {
                return Err(Refusal::Length);
            }
        } else if op == Opcode::ReadRequest {
            if p.reth.is_some_and(|r| r.len as u64 > MAX_MSG) {
                return Err(Refusal::Length);
            }
        } else if op.is_send() {
            let Some(r) = self.rq.front() else { return Err(Refusal::Rnr) };
            let room: u64 = r.sge[..(r.num_sge as usize).min(MAX_SGE)].iter().map(|s| s.length as u64).sum();
            let offset = if op.starts_message() { 0 } else { self.rt.recv_offset };
            if offset + n > room {
                return Err(Refusal::RecvLength);
            }
        }
        Ok(())
    }

    /// R_Key: the target region exists in the QP's PD, covers the range and
    /// grants the access; an atomic's target is 8-byte aligned. Returns
    /// where this packet's data goes (WRITE) or the atomic's word.
    fn check_rkey(&self, ctx: &Ctx, p: &Packet) -> Result<Target, Refusal> {
        let op = p.bth.opcode;
        let need = Self::remote_access_for(op);
        if op.is_write() {
            if let Some(reth) = p.reth.filter(|r| r.len > 0) {
                self.region(ctx, reth.rkey, reth.va, reth.len as u64, need).ok_or(Refusal::RkeyViolation)?;
            }
            let n = p.payload.len() as u64;
            if n == 0 {
                return Ok(Target::None);
            }
            let (va, rkey) = match (p.reth, self.rt.write) {
                (Some(r), _) => (r.va, r.rkey),
                (None, Some(w)) => (w.va, w.rkey),
                (None, None) => return Err(Refusal::MissingOpcodeFirst),
            };
            // A message keeps the binding its first packet saw, or is refused.
            if p.reth.is_none() && self.rt.write.is_some_and(|w| w.key_gen != ctx.keys.generation(rkey)) {
                return Err(Refusal::RkeyViolation);
            }
            let dst = ctx.keys.resolve(rkey, self.pd, va, n, need).ok_or(Refusal::RkeyViolation)?;
            if op == Opcode::AtomicWrite {
                return Self::atomic_write_target(dst, va, n);
            }
            Ok(Target::Write(dst))
        } else if op == Opcode::ReadRequest {
            if let Some(reth) = p.reth.filter(|r| r.len > 0) {
                self.region(ctx, reth.rkey, reth.va, reth.len as u64, need).ok_or(Refusal::RkeyViolation)?;
            }
            Ok(Target::None)
        } else if let (true, Some(a)) = (op.is_atomic(), p.atomic) {
            if a.va % 8 != 0 {
                return Err(Refusal::MisalignedAtomic);
            }
            let span = ctx.keys.resolve(a.rkey, self.pd, a.va, 8, need).ok_or(Refusal::RkeyViolation)?;
            let ptr = span.contiguous().ok_or(Refusal::RkeyViolation)?;
            // The iova is aligned; the host address need not be (a region
            // may start anywhere in its memfd).
            if !(ptr as usize).is_multiple_of(8) {
                return Err(Refusal::MisalignedAtomic);
            }
            Ok(Target::Atomic(ptr, span))
        } else {
            Ok(Target::None)
        }
    }

    /// An atomic write's target: 8 bytes at an 8-byte aligned address (IBTA
    /// 1.5 o9-28.2), in host memory aligned too, so one store writes them.
    fn atomic_write_target(dst: Resolved, va: u64, n: u64) -> Result<Target, Refusal> {
        if n != 8 {
            return Err(Refusal::Length);
        }
        let ptr = dst.contiguous().ok_or(Refusal::RkeyViolation)?;
        if !va.is_multiple_of(8) || !(ptr as usize).is_multiple_of(8) {
            return Err(Refusal::MisalignedAtomic);
        }
        Ok(Target::Atomic(ptr, dst))
    }

    /// The region `rkey` if it lies in the QP's PD and grants `need` on
    /// [va, va + len).
    fn region(&self, ctx: &Ctx, rkey: u32, va: u64, len: u64, need: u32) -> Option<()> {
        ctx.keys.resolve(rkey, self.pd, va, len, need).map(|_| ())
    }

    /// Execute: every check passed; place the data or run the operation,
    /// complete a receive WQE where the message ends, and acknowledge.
    fn execute(&mut self, ctx: &mut Ctx, p: &Packet, target: Target) -> Result<(), Refusal> {
        let op = p.bth.opcode;
        if op.is_send() {
            self.execute_send(ctx, p)?;
        } else if op.is_write() {
            self.execute_write(ctx, p, target)?;
        } else if op == Opcode::ReadRequest {
            self.execute_read(p);
            return Ok(());
        } else if op.is_atomic() {
            if let Target::Atomic(ptr, _mapped) = target {
                self.execute_atomic(p, ptr);
            }
            return Ok(());
        }
        self.acknowledge(ctx, p);
        Ok(())
    }

    fn execute_send(&mut self, ctx: &mut Ctx, p: &Packet) -> Result<(), Refusal> {
        let op = p.bth.opcode;
        if op.starts_message() {
            self.rt.recv_offset = 0;
            self.rt.in_send = true;
        }
        let r = self.rq[0];
        let sges = &r.sge[..(r.num_sge as usize).min(MAX_SGE)];
        match scatter(ctx.keys, self.pd, sges, self.rt.recv_offset, p.payload) {
            Ok(()) => {}
            Err(WcStatus::LocLenErr) => return Err(Refusal::RecvLength),
            Err(_) => return Err(Refusal::MalformedWqe),
        }
        self.rt.recv_offset += p.payload.len() as u64;
        if op.ends_message() {
            self.rt.in_send = false;
            self.rt.msn = psn_add(self.rt.msn, 1);
            if let Some(k) = p.ieth {
                ctx.keys.remote_invalidate(k, self.pd);
            }
            let len = self.rt.recv_offset as u32;
            self.complete_recv(ctx, WcStatus::Success, WcOpcode::Recv, len, p.imm, p.ieth, p.bth.solicited);
        }
        Ok(())
    }

    fn execute_write(&mut self, ctx: &mut Ctx, p: &Packet, target: Target) -> Result<(), Refusal> {
        if let Some(reth) = p.reth {
            let key_gen = ctx.keys.generation(reth.rkey);
            self.rt.write = Some(WriteCtx { va: reth.va, rkey: reth.rkey, remaining: reth.len as u64, total: reth.len as u64, key_gen });
        }
        let Some(mut w) = self.rt.write else { return Err(Refusal::MissingOpcodeFirst) };
        let n = p.payload.len() as u64;
        match (target, <[u8; 8]>::try_from(p.payload)) {
            // The message's last packet: programs poll a WRITE's last byte
            // (ib_write_lat, eager buffers), so the earlier packets'
            // streaming stores are fenced first and this one is a plain
            // copy, which cannot become visible before them.
            (Target::Write(dst), _) if p.bth.opcode.ends_message() => {
                crate::mem::fence_streamed();
                // SAFETY: the R_Key check resolved [va, va+n) in this packet's handling.
                unsafe { dst.write(p.payload) }
            }
            // SAFETY: the R_Key check resolved [va, va+n) in this packet's handling.
            (Target::Write(dst), _) => unsafe { dst.write_streaming(p.payload) },
            // SAFETY: an atomic write's 8 aligned bytes, resolved just now.
            (Target::Atomic(ptr, _mapped), Ok(v)) => {
                unsafe { AtomicU64::from_ptr(ptr as *mut u64) }.store(u64::from_ne_bytes(v), Ordering::SeqCst)
            }
            _ => {}
        }
        w.va += n;
        w.remaining -= n;
        self.rt.write = Some(w);
        if p.bth.opcode.ends_message() {
            self.rt.write = None;
            self.rt.msn = psn_add(self.rt.msn, 1);
            if p.imm.is_some() {
                self.complete_recv(ctx, WcStatus::Success, WcOpcode::RecvRdmaWithImm, w.total as u32, p.imm, None, p.bth.solicited);
            }
        }
        Ok(())
    }

    /// A READ is answered from client memory as its responses go out
    /// (`responder_tx`); its PSNs are those of the responses.
    fn execute_read(&mut self, p: &Packet) {
        let Some(reth) = p.reth else { return };
        let psn = p.bth.psn;
        let n = (reth.len as u64).div_ceil(self.mtu()).max(1) as u32;
        self.rt.msn = psn_add(self.rt.msn, 1);
        self.rt.resp_queue.push_back(RespJob::Read {
            psn,
            va: reth.va,
            rkey: reth.rkey,
            remaining: reth.len as u64,
            first: true,
            key_gen: None,
            resent: false,
        });
        self.rt.read_history.push_back(ReadExec { psn, last: psn_add(psn, n - 1), rkey: reth.rkey, key_gen: None });
        while self.rt.read_history.len() > ATOMIC_REPLAY.max(self.attr.max_dest_rd_atomic as usize) {
            self.rt.read_history.pop_front();
        }
        self.rt.epsn = psn_add(psn, n);
        self.rt.nak_sent = false;
    }

    /// Runs the atomic on the host word and keeps its result for replays.
    fn execute_atomic(&mut self, p: &Packet, ptr: *mut u8) {
        let Some(a) = p.atomic else { return };
        let psn = p.bth.psn;
        // SAFETY: the R_Key check found the 8 bytes inside the region's
        // mapping and 8-byte aligned.
        let cell = unsafe { AtomicU64::from_ptr(ptr as *mut u64) };
        let orig = if p.bth.opcode == Opcode::CompareSwap {
            match cell.compare_exchange(a.compare, a.swap_add, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(v) | Err(v) => v,
            }
        } else {
            cell.fetch_add(a.swap_add, Ordering::SeqCst)
        };
        self.rt.atomic_results.push_back((psn, orig));
        while self.rt.atomic_results.len() > ATOMIC_REPLAY.max(self.attr.max_dest_rd_atomic as usize) {
            self.rt.atomic_results.pop_front();
        }
        self.rt.msn = psn_add(self.rt.msn, 1);
        self.rt.resp_queue.push_back(RespJob::AtomicAck { psn, orig });
        self.rt.epsn = psn_add(psn, 1);
        self.rt.nak_sent = false;
    }

    /// Acknowledge: an ACK at once if the request asked for one, else
    /// within ACK_DELAY_US, coalesced with the requests that follow.
    fn acknowledge(&mut self, ctx: &mut Ctx, p: &Packet) {
        self.rt.epsn = psn_add(p.bth.psn, 1);
        self.rt.nak_sent = false;
        if self.is_uc() {
            return;
        }
        // The newest request's arrival: the requester times one PSN of the
        // batch this ACK answers, and a hold counted from an older one
        // would be more than that packet was held (wire::encode_hold).
        self.ack_since = Some(ctx.arrived);
        if p.bth.ack_req {
            self.queue_ack(p.bth.psn);
        } else {
            if self.ack_due.is_none() {
                self.ack_due = Some(ctx.now + Duration::from_micros(ACK_DELAY_US));
                self.unacked_since = Some(ctx.now);
                self.unacked = 0;
            }
            self.unacked += 1;
        }
    }

    /// Whether executed requests wait for a delayed ACK.
    pub fn ack_delayed(&self) -> bool {
        self.ack_due.is_some()
    }

    /// ACK coalescing of a stream, at the end of a receive pass (all the
    /// packets the socket held, what a GRO batch gathered): once
    /// STREAM_ACK_BATCH requests wait, one ACK covers them all now, before
    /// the ACK timer would wake rnicd for it. Fewer wait, and a message is
    /// mid-way: its next packets come without this ACK, and the ACK waits
    /// for them, up to STREAM_ACK_DELAY after the first request it covers
    /// (so a paced stream is not woken for by the ACK timer between its
    /// packets). Otherwise (a message ended) the ACK timer stands: a
    /// ping-pong's lone messages are acknowledged within ACK_DELAY_US.
    pub fn end_of_receive_pass(&mut self, now: Instant) {
        let (Some(due), Some(first)) = (self.ack_due, self.unacked_since) else { return };
        if self.suspended {
            return;
        }
        if self.unacked >= STREAM_ACK_BATCH {
            self.ack_last_executed();
        } else if self.receiving_message() {
            self.ack_due = Some(due.max(first + STREAM_ACK_DELAY).max(now));
        }
    }

    /// A message this QP receives is mid-way: the rest of it is in the
    /// peer's window and comes without waiting for this end.
    fn receiving_message(&self) -> bool {
        self.rt.write.is_some() || self.rt.in_send
    }

    /// Answers a refused request: an RNR NAK leaves the QP as it is (the
    /// requester resends after its RNR wait); every other refusal NAKs and
    /// moves the QP to ERR, after completing the receive WQE that the
    /// message consumed in error.
    fn refuse(&mut self, ctx: &mut Ctx, psn: u32, r: Refusal) {
        if self.is_uc() {
            return self.uc_refuse(ctx, r);
        }
        match r {
            Refusal::Rnr => self.rnr(ctx, psn),
            Refusal::RecvLength => self.complete_recv(ctx, WcStatus::LocLenErr, WcOpcode::Recv, 0, None, None, false),
            Refusal::MalformedWqe => self.complete_recv(ctx, WcStatus::LocProtErr, WcOpcode::Recv, 0, None, None, false),
            _ => {}
        }
        if let Some(code) = r.nak_code() {
            self.responder_error(ctx, psn, code);
        }
    }

    fn rnr(&mut self, ctx: &mut Ctx, psn: u32) {
        ctx.stats.rnr_naks_sent += 1;
        self.rt.nak_sent = true;
        self.queue_nak(psn, Syndrome::RnrNak(self.attr.min_rnr_timer));
    }

    fn duplicate(&mut self, ctx: &mut Ctx, p: &Packet) {
        ctx.stats.dup_requests += 1;
        let psn = p.bth.psn;
        match p.bth.opcode {
            Opcode::ReadRequest => {
                let Some(reth) = p.reth else { return };
                // A duplicate whose key no longer grants the range is not
                // answered (the requester may have its data already; one
                // that does not fails after its retries).
                let readable = self.check_op_valid(Opcode::ReadRequest).is_ok()
                    && (reth.len == 0 || self.region(ctx, reth.rkey, reth.va, reth.len as u64, access::REMOTE_READ).is_some());
                if !readable {
                    return;
                }
                // The requester went back to `psn` and resends everything from
                // there: responses queued for `psn` onwards are stale. Earlier
                // ones (an atomic replay just before this READ) must stay.
                let mtu = self.mtu();
                self.rt.resp_queue.retain(|j| match *j {
                    RespJob::Ack { psn: p, .. } | RespJob::AtomicAck { psn: p, .. } => psn_diff(p, psn) < 0,
                    RespJob::Read { psn: p, remaining, .. } => {
                        let last = psn_add(p, (remaining.div_ceil(mtu).max(1) - 1) as u32);
                        psn_diff(last, psn) < 0
                    }
                });
                // A duplicate is executed again, but from the binding its
                // first answer read: if the key was rebound or invalidated
                // since, it is not answered (as a duplicate whose key no
                // longer resolves), rather than mixing the old binding's
                // data with the new one's; the new memory is never read for
                // a request made before the rebind. Not a NAK: the requester
                // may have had all the first answer meanwhile and would
                // drop the NAK while this QP went to ERR. A READ older than
                // the history (not one a conforming requester can still
                // resend) reads the current binding.
                let key_gen = self
                    .rt
                    .read_history
                    .iter()
                    .rev()
                    .find(|r| r.rkey == reth.rkey && psn_diff(psn, r.psn) >= 0 && psn_diff(r.last, psn) >= 0)
                    .and_then(|r| r.key_gen);
                if key_gen.is_some_and(|g| g != ctx.keys.generation(reth.rkey)) {
                    return;
                }
                self.rt.resp_queue.push_back(RespJob::Read {
                    psn,
                    va: reth.va,
                    rkey: reth.rkey,
                    remaining: reth.len as u64,
                    first: true,
                    key_gen,
                    resent: true,
                });
            }
            Opcode::CompareSwap | Opcode::FetchAdd => {
                if let Some(&(_, orig)) = self.rt.atomic_results.iter().find(|(q, _)| *q == psn) {
                    self.rt.resp_queue.push_back(RespJob::AtomicAck { psn, orig });
                }
            }
            _ => {
                // C9-105: acknowledge again, with the last PSN we executed.
                if p.bth.ack_req || p.bth.opcode.ends_message() {
                    self.ack_last_executed();
                }
            }
        }
    }

    pub(super) fn responder_tx(&mut self, ctx: &mut Ctx, budget: &mut usize) {
        self.responses_tx(ctx, budget, false);
    }

    /// Sends the ACKs, NAKs and atomic ACKs at the head of the response
    /// queue, and stops at the first READ response (the order holds).
    pub(super) fn responder_acks_tx(&mut self, ctx: &mut Ctx, budget: &mut usize) {
        self.responses_tx(ctx, budget, true);
    }

    fn responses_tx(&mut self, ctx: &mut Ctx, budget: &mut usize, acks_only: bool) {
        let flow = self.flow(ctx.gid);
        let dq = self.attr.dest_qp_num;
        let mtu = self.mtu();
        while *budget > 0 {
            let Some(job) = self.rt.resp_queue.front_mut() else { break };
            if acks_only && matches!(job, RespJob::Read { .. }) {
                break;
            }
            match *job {
                RespJob::Ack { psn, syndrome } => {
                    let mut h = Headers::new(Opcode::Ack, dq, psn);
                    h.aeth = Some(Aeth { syndrome: Syndrome::from_u8(syndrome), msn: self.rt.msn });
                    // How long the requests it answers waited here (for
                    // rnicd, or its host's scheduler): the requester's
                    // delay signal leaves it out.
                    if let Some(t) = self.ack_since.take() {
                        h.bth.resv6 = wire::encode_hold(Instant::now().saturating_duration_since(t).as_micros() as u64);
                    }
                    let _ = ctx.tx.emit(&flow, &h, 0, |_| Ok::<(), ()>(()));
                    ctx.stats.ack_packets_sent += 1;
                    self.rt.resp_queue.pop_front();
                }
                RespJob::AtomicAck { psn, orig } => {
                    let mut h = Headers::new(Opcode::AtomicAck, dq, psn);
                    h.aeth = Some(Aeth { syndrome: Syndrome::Ack(0x1f), msn: self.rt.msn });
                    h.atomic_ack = Some(orig);
                    let _ = ctx.tx.emit(&flow, &h, 0, |_| Ok::<(), ()>(()));
                    self.rt.resp_queue.pop_front();
                }
                RespJob::Read { psn, va, rkey, remaining, first, key_gen, resent } => {
                    let n = remaining.min(mtu);
                    let last = remaining <= mtu;
                    use Opcode::*;
                    let opc = match (first, last) {
                        (true, true) => ReadRespOnly,
                        (true, false) => ReadRespFirst,
                        (false, false) => ReadRespMiddle,
                        (false, true) => ReadRespLast,
                    };
                    let mut h = Headers::new(opc, dq, psn);
                    if opc != ReadRespMiddle {
                        h.aeth = Some(Aeth { syndrome: Syndrome::Ack(0x1f), msn: self.rt.msn });
                    }
                    let (keys, pd) = (&*ctx.keys, self.pd);
                    // A READ reads the binding current at its first response
                    // packet; its other packets, and any resent ones, must
                    // find the same one.
                    let key_gen = match key_gen {
                        Some(g) => g,
                        None => {
                            let g = keys.generation(rkey);
                            if let Some(h) = self.rt.read_history.iter_mut().rev().find(|h| h.psn == psn && h.key_gen.is_none()) {
                                h.key_gen = Some(g);
                            }
                            g
                        }
                    };
                    let r = ctx.tx.emit(&flow, &h, n as usize, |out| -> Result<(), ()> {
                        if n == 0 {
                            return Ok(());
                        }
                        // Re-read memory on every (re)transmission; the MR may be gone.
                        if keys.generation(rkey) != key_gen {
                            return Err(());
                        }
                        let src = keys.resolve(rkey, pd, va, n, access::REMOTE_READ).ok_or(())?;
                        // SAFETY: resolved for n bytes just now.
                        unsafe { src.read(out) };
                        Ok(())
                    });
                    if r.is_err() && resent {
                        // Rebound while answering a duplicate: stop (above).
                        self.rt.resp_queue.pop_front();
                        continue;
                    }
                    if r.is_err() {
                        self.rt.resp_queue.clear();
                        self.responder_error(ctx, psn, NakCode::RemoteAccessError);
                        return;
                    }
                    if last {
                        self.rt.resp_queue.pop_front();
                    } else {
                        *job = RespJob::Read {
                            psn: psn_add(psn, 1),
                            va: va + n,
                            rkey,
                            remaining: remaining - n,
                            first: false,
                            key_gen: Some(key_gen),
                            resent,
                        };
                    }
                }
            }
            *budget -= 1;
        }
    }
}
