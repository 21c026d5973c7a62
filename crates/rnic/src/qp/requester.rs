//! The requester: turns send WQEs into request packets within its window
//! (packets, bytes, READ/atomic credits, fences), and recovers lost ones by
//! go-back-N, driven by the IB retransmission timer and a faster loss probe.
//!
//! Its congestion window ([`super::window`]) halves on a sequence NAK or a
//! loss probe (once per window of packets), shrinks in proportion to the
//! excess on a round trip longer than a quarter of the IB timeout (a queue
//! that may soon fire the timer for packets only waiting in it), and halves
//! at every packet of its flow the local
//! qdisc refuses (ENOBUFS); a retransmission timeout drops it to its
//! minimum. Without this, a rate-capped link's queue overflows at every
//! window and each overflow costs a resend.

use std::time::{Duration, Instant};

use super::window::{self, MIN_CWND};
use super::{Ctx, Qp, RECOVERY_FIRST};
use crate::keys::{gather, in_place};
use crate::objects::IN_PLACE_MIN;
use crate::types::{send_flags, QpState, WcStatus, WrOpcode};
use crate::wire::{self, psn_add, psn_diff, AtomicEth, Headers, Opcode, Reth};

/// Most request packets in flight per QP (a PSN window, well under 2^23).
pub const WINDOW: i32 = 4096;
/// Most request bytes in flight per QP: more only overruns the peer's socket
/// buffer and IP reassembly, and go-back-N then resends all of it.
pub const WINDOW_BYTES: usize = 2 << 20;
/// Set the AckReq bit at least every this many packets of a long message.
const ACK_EVERY: u32 = 64;
/// Shortest loss-probe time (µs), and the one used before any RTT sample.
/// Not shorter: with 1,000 QPs a busy responder answers late, and spurious
/// probes (each a resend) then add to its load.
const MIN_PROBE_US: f64 = 4000.0;
const FIRST_PROBE_US: f64 = 20_000.0;
/// The retransmission timer armed after progress waits at most this many
/// IB timeouts for an answer however late the measured ones came; the
/// timers after it count from the IB timeout, so a peer that is gone is
/// given up on about as soon as with the IB timer alone.
const MAX_TIMEOUT_STRETCH: u64 = 4;

impl Qp {
    /// Whether the next request is new and may not go yet (window, READ/atomic
    /// credits, fence, SQD): then only a response or a timer moves the QP, and
    /// the daemon may sleep instead of spinning.
    pub(super) fn blocked(&self) -> bool {
        let psn = self.rt.tx_psn;
        if psn_diff(psn, self.rt.max_sent) < 0 {
            return self.recovery.is_some_and(|n| psn_diff(psn, self.rt.una) >= n as i32);
        }
        let Some(e) = self.sq.get(self.tx_idx) else { return true };
        self.attr.qp_state == QpState::Sqd
            || psn_diff(psn, self.rt.una) >= self.window()
            || (e.op.is_read_or_atomic() && self.rd_outstanding >= self.attr.max_rd_atomic.max(1) as usize)
            || (e.wqe.flags & send_flags::FENCE != 0 && self.rd_outstanding > 0)
    }

    pub(super) fn requester_tx(&mut self, ctx: &mut Ctx, budget: &mut usize) {
        let st = self.attr.qp_state;
        if !matches!(st, QpState::Rts | QpState::Sqd) {
            return;
        }
        if let Some(t) = self.rnr_until {
            if ctx.now < t {
                return;
            }
            self.rnr_until = None;
        }
        while *budget > 0 && self.tx_idx < self.sq.len() {
            let psn = self.rt.tx_psn;
            let new = psn_diff(psn, self.rt.max_sent) >= 0;
            let e = &self.sq[self.tx_idx];
            if !new && self.recovery.is_some_and(|n| psn_diff(psn, self.rt.una) >= n as i32) {
                break;
            }
            if new {
                if st == QpState::Sqd || psn_diff(psn, self.rt.una) >= self.window() {
                    break;
                }
                if e.op.is_read_or_atomic() && self.rd_outstanding >= self.attr.max_rd_atomic.max(1) as usize {
                    break;
                }
                if e.wqe.flags & send_flags::FENCE != 0 && self.rd_outstanding > 0 {
                    break;
                }
            }
            let ask = self.asks_ack(new);
            if let Err(status) = self.build_request(ctx, self.tx_idx, psn, ask, new) {
                // Local protection/length error: fail this WQE, QP to error.
                self.fail_wqe_at(ctx, self.tx_idx, status);
                return;
            }
            *budget -= 1;
            let e = &self.sq[self.tx_idx];
            if new && !e.op.is_read_or_atomic() && psn == e.last_psn() {
                self.unasked_msgs = if ask { 0 } else { self.unasked_msgs + 1 };
            }
            if e.op.is_read_or_atomic() {
                self.rt.tx_psn = psn_add(e.last_psn(), 1);
                self.rd_outstanding += 1;
                self.tx_idx += 1;
            } else {
                self.rt.tx_psn = psn_add(psn, 1);
                if self.rt.tx_psn == psn_add(e.last_psn(), 1) {
                    self.tx_idx += 1;
                }
            }
            if psn_diff(self.rt.tx_psn, self.rt.max_sent) > 0 {
                self.rt.max_sent = self.rt.tx_psn;
                if new && self.rtt_sample.is_none() {
                    self.rtt_sample = Some((psn, ctx.now));
                }
            }
            if self.is_uc() {
                self.uc_sent(ctx);
            } else if self.retrans_deadline.is_none() {
                self.arm_timer(ctx.now);
            }
        }
    }

    /// Whether the last packet of the WQE at `tx_idx` asks for an ACK
    /// (AckReq). A signaled WQE completes on its ACK, so it always asks;
    /// so does a resend, and every ack_every()-th message (several times per
    /// window, so the window never waits for the responder's ACK timer), and
    /// any message once half the send queue waits for ACKs. The others are
    /// acknowledged with a later one (ACK coalescing) or by the responder's
    /// ACK timer: in a ping-pong of unsignaled messages most ACK packets,
    /// each a send and a receive through the kernel, are not needed.
    fn asks_ack(&self, new: bool) -> bool {
        let Some(e) = self.sq.get(self.tx_idx) else { return true };
        !new || e.signaled
            || self.unasked_msgs + 1 >= self.ack_every()
            || self.sq.len() * 2 >= self.cap.max_send_wr as usize
            || self.attr.qp_state == QpState::Sqd
    }

    pub(super) fn max_window(&self) -> i32 {
        (WINDOW_BYTES / self.attr.path_mtu.bytes()).clamp(MIN_CWND as usize, WINDOW as usize) as i32
    }

    pub(super) fn window(&self) -> i32 {
        window::effective(self.rt.cwnd, self.max_window() as u32) as i32
    }

    /// The window after `restart_send_psns` or a restore: full, with no
    /// loss remembered.
    pub(super) fn restart_congestion(&mut self) {
        self.cc.restart(self.rt.una);
    }

    /// `una` moved: the window grows by the packets it acknowledged.
    pub(super) fn grow_window(&mut self) {
        let max = self.max_window() as u32;
        self.cc.on_ack(&mut self.rt.cwnd, self.rt.una, max);
    }

    /// Congestion: the window halves, unless this loss is of a packet sent
    /// before the last cut (the same event). Go-back-N and the PSNs are
    /// untouched: the loss is still resent.
    pub(super) fn cut_window(&mut self, ctx: &mut Ctx) {
        let max = self.max_window() as u32;
        if self.cc.cut(&mut self.rt.cwnd, self.rt.una, self.rt.max_sent, max) {
            ctx.stats.window_cuts += 1;
        }
    }

    /// A round trip of `us` µs: one longer than a quarter of the IB timeout
    /// means a queue on the path (a rate-capped link's qdisc holds 100 ms)
    /// that may soon make the timer fire for packets that are only waiting
    /// (the queue grows for a round trip before the next sample can tell),
    /// and each such timeout resends the whole window. The window shrinks
    /// in proportion to the excess (the delay signal of RDMA's TIMELY,
    /// with one threshold): the queue stays near the threshold and the
    /// link busy, where halving drained it. `us` is the path's part of the
    /// round trip: neither this rnicd's lateness in reading the ACK (the
    /// kernel's receive timestamp) nor the responder's in answering (the
    /// hold its ACK reports) counts. The delay is the smaller of this
    /// sample and the one before, so that one stalled round trip is not
    /// taken for a queue.
    pub(super) fn on_rtt_sample(&mut self, ctx: &mut Ctx, us: f64) {
        let Some(t) = wire::ack_timeout_us(self.attr.timeout) else { return };
        let max = self.max_window() as u32;
        if self.cc.delay_cut(&mut self.rt.cwnd, self.rt.una, self.rt.max_sent, max, us, t as f64 / 4.0) {
            ctx.stats.window_cuts += 1;
        }
    }

    /// A packet of this QP's flow was refused by the local qdisc. Each
    /// refusal halves the window again, not once per window as a loss does:
    /// a full qdisc holds its whole queue (100 ms under the testbed's cap),
    /// longer than the IB timeout, and waiting a round trip between cuts
    /// lets the timer fire for packets that are only queued. The daemon
    /// tries a refused send again only after 0.5 ms, which bounds the rate
    /// of cuts. A QP with less than the smallest window in flight is not
    /// what fills the queue (the refused packet may be its ACK or READ
    /// response): its window stays.
    pub fn on_local_congestion(&mut self, ctx: &mut Ctx) {
        let flight = psn_diff(self.rt.max_sent, self.rt.una);
        if !self.is_ud() && flight >= MIN_CWND as i32 && matches!(self.attr.qp_state, QpState::Rts | QpState::Sqd) {
            self.cc.forget_cut();
            self.cut_window(ctx);
        }
    }

    fn ack_every(&self) -> u32 {
        ((self.window() / 4) as u32).clamp(1, ACK_EVERY)
    }

    pub(super) fn arm_timer(&mut self, now: Instant) {
        self.retrans_deadline = self.retrans_timeout_us().map(|us| now + Duration::from_micros(us << self.timeout_backoff.min(6)));
        self.probe_deadline = self.probe_rto().map(|d| now + d);
    }

    /// The retransmission timer: the IB timeout, or longer when the
    /// answers measured take longer (`measured_rto_us`, over whole round
    /// trips), at most `MAX_TIMEOUT_STRETCH` times the IB timeout.
    /// The verbs' timeout is the least time a QP waits for an answer. A
    /// responder whose host is behind answers late but answers: with 256
    /// QPs on a peer whose rnicd read its socket 45-98 ms late, a timer
    /// of 67 ms (timeout 14) fired 300-1,300 times a second, and each
    /// firing resent a whole window into that socket. None with timeout 0
    /// (the owner asked for no timer).
    fn retrans_timeout_us(&self) -> Option<u64> {
        let ib = wire::ack_timeout_us(self.attr.timeout)?;
        let measured = self.measured_rto_us().unwrap_or(0.0);
        Some((measured as u64).clamp(ib, ib * MAX_TIMEOUT_STRETCH))
    }

    /// When to probe for a lost packet: a few smoothed round trips (at least
    /// MIN_PROBE), never later than the IB timeout, never with timeout 0
    /// (infinite: the owner asked for no retransmission timer).
    fn probe_rto(&self) -> Option<Duration> {
        let ib = wire::ack_timeout_us(self.attr.timeout)?;
        let us = self.round_trips_us() << self.probe_backoff.min(6);
        (us < ib).then(|| Duration::from_micros(us))
    }

    /// A few smoothed round trips, at least MIN_PROBE (FIRST_PROBE before
    /// any sample): the loss probe's time before its backoff.
    fn round_trips_us(&self) -> u64 {
        self.measured_rto_us().unwrap_or(FIRST_PROBE_US).max(MIN_PROBE_US) as u64
    }

    /// SRTT + 4 RTTVAR (RFC 6298), at least two smoothed round trips (a
    /// steady round trip drives RTTVAR towards 0); None before any sample.
    fn measured_rto_us(&self) -> Option<f64> {
        (self.srtt_us > 0.0).then(|| (self.srtt_us + 4.0 * self.rttvar_us).max(2.0 * self.srtt_us))
    }

    pub(super) fn rtt_update(&mut self, sample_us: f64) {
        if self.srtt_us == 0.0 {
            self.srtt_us = sample_us;
            self.rttvar_us = sample_us / 2.0;
        } else {
            self.rttvar_us = 0.75 * self.rttvar_us + 0.25 * (self.srtt_us - sample_us).abs();
            self.srtt_us = 0.875 * self.srtt_us + 0.125 * sample_us;
        }
    }

    /// Builds the request packet at `psn` of the WQE at `idx`; `new` when it
    /// has never been sent (a WRITE's payload may then leave in place).
    fn build_request(&self, ctx: &mut Ctx, idx: usize, psn: u32, ask_ack: bool, new: bool) -> Result<(), WcStatus> {
        let e = &self.sq[idx];
        let flow = self.flow(ctx.gid);
        let dq = self.attr.dest_qp_num;
        let i = psn_diff(psn, e.first_psn).max(0) as u32;
        // A restored state whose PSNs do not fit the WQEs reposted for it
        // (a client's bad snapshot) names a packet beyond the WQE: the WQE
        // fails, never an index past its end.
        if i >= e.npkts {
            return Err(WcStatus::LocQpOpErr);
        }
        let mtu = self.mtu();
        let w = &e.wqe;
        match e.op {
            WrOpcode::RdmaRead => {
                let off = (i as u64 * mtu).min(e.len);
                let mut h = Headers::new(Opcode::ReadRequest, dq, psn);
                h.reth = Some(Reth { va: w.remote_addr.wrapping_add(off), rkey: w.rkey, len: (e.len - off) as u32 });
                ctx.tx.emit(&flow, &h, 0, |_| Ok::<(), WcStatus>(()))
            }
            WrOpcode::AtomicCmpSwp | WrOpcode::AtomicFetchAdd => {
                let op = if e.op == WrOpcode::AtomicCmpSwp { Opcode::CompareSwap } else { Opcode::FetchAdd };
                let mut h = Headers::new(op, dq, psn);
                h.atomic = Some(if e.op == WrOpcode::AtomicCmpSwp {
                    AtomicEth { va: w.remote_addr, rkey: w.rkey, swap_add: w.swap, compare: w.compare_add }
                } else {
                    AtomicEth { va: w.remote_addr, rkey: w.rkey, swap_add: w.compare_add, compare: 0 }
                });
                ctx.tx.emit(&flow, &h, 0, |_| Ok::<(), WcStatus>(()))
            }
            op => {
                let first = i == 0;
                let last = i + 1 == e.npkts;
                let off = i as u64 * mtu;
                let plen = (e.len - off).min(mtu) as usize;
                let is_write = matches!(op, WrOpcode::RdmaWrite | WrOpcode::RdmaWriteImm | WrOpcode::AtomicWrite);
                let imm = matches!(op, WrOpcode::RdmaWriteImm | WrOpcode::SendImm);
                use Opcode::*;
                let opc = match (is_write, first, last) {
                    (true, true, true) => {
                        if op == WrOpcode::AtomicWrite {
                            AtomicWrite
                        } else if imm {
                            WriteOnlyImm
                        } else {
                            WriteOnly
                        }
                    }
                    (true, true, false) => WriteFirst,
                    (true, false, false) => WriteMiddle,
                    (true, false, true) => {
                        if imm {
                            WriteLastImm
                        } else {
                            WriteLast
                        }
                    }
                    (false, true, true) => match op {
                        WrOpcode::SendImm => SendOnlyImm,
                        WrOpcode::SendInv => SendOnlyInv,
                        _ => SendOnly,
                    },
                    (false, true, false) => SendFirst,
                    (false, false, false) => SendMiddle,
                    (false, false, true) => match op {
                        WrOpcode::SendImm => SendLastImm,
                        WrOpcode::SendInv => SendLastInv,
                        _ => SendLast,
                    },
                };
                let mut h = Headers::new(opc, dq, psn);
                // Ask for ACKs often enough that the window never stalls.
                h.bth.ack_req = (last && ask_ack) || (i + 1).is_multiple_of(self.ack_every());
                h.bth.solicited = last && w.flags & send_flags::SOLICITED != 0;
                if self.is_uc() {
                    self.uc_headers(&mut h);
                }
                if is_write && first {
                    h.reth = Some(Reth { va: w.remote_addr, rkey: w.rkey, len: e.len as u32 });
                }
                if imm && last {
                    h.imm = Some(w.imm);
                }
                if op == WrOpcode::SendInv && last {
                    h.ieth = Some(w.imm);
                }
                let inline = w.flags & send_flags::INLINE != 0;
                // A first transmission of a WRITE payload leaves from the
                // region itself (objects::InPlace: a payload changed before
                // it left costs one resend, and resends are copies). Not
                // on UC, which never resends: a race would lose the message.
                if is_write && new && !inline && !self.is_uc() && ctx.tx.in_place && plen >= IN_PLACE_MIN {
                    if let Some((mr, ptr)) = in_place(ctx.keys, self.pd, e.sges(), off, plen) {
                        // SAFETY: `in_place` resolved plen bytes at ptr inside mr.
                        unsafe { ctx.tx.emit_in_place(&flow, &h, mr, ptr, plen) };
                        return Ok(());
                    }
                }
                let (keys, pd) = (&*ctx.keys, self.pd);
                ctx.tx.emit(&flow, &h, plen, |out| {
                    if inline {
                        out.copy_from_slice(&w.inline[off as usize..off as usize + plen]);
                        Ok(())
                    } else {
                        gather(keys, pd, e.sges(), off, out)
                    }
                })
            }
        }
    }

    /// Go-back-N: the next packet sent is `una` again.
    ///
    /// A rewind of the RNR wait, the retransmission timer or the loss probe
    /// says nothing about what the responder saw, so it does not make a
    /// later NAK for the same PSN a duplicate: a sequence NAK that follows
    /// it (a resumed QP, maybe on another host, names the PSN it expects
    /// after the resends to its old host were lost) rewinds again at once.
    pub(super) fn rewind(&mut self, ctx: &mut Ctx) {
        ctx.stats.retransmit_rewinds += 1;
        ctx.tx.rewound.push((self.attr.dest_gid, self.attr.dest_qp_num));
        // Karn: a resent packet's ACK says nothing about the round trip.
        self.rtt_sample = None;
        self.recovery = None;
        self.tx_idx = 0;
        self.rd_outstanding = 0;
        self.rt.tx_psn = self.rt.una;
        self.last_rewind = None;
    }

    /// A rewind because a response showed a gap at `una`: later responses
    /// that show the same gap within a round trip of the last rewind for
    /// it (sent before the resend reached the responder) do not rewind
    /// again. One that comes later says the resend was lost too, and
    /// rewinds. Sequence NAKs always rewind (`on_seq_nak`).
    pub(super) fn rewind_once(&mut self, ctx: &mut Ctx) {
        if !self.rewound_lately(ctx.now) {
            self.rewind_for_gap(ctx);
        }
    }

    /// A rewind for a gap at `una`, always taken, and remembered so that
    /// responses showing the same gap within a round trip do not rewind
    /// again (`rewind_once`).
    pub(super) fn rewind_for_gap(&mut self, ctx: &mut Ctx) {
        self.rewind(ctx);
        self.last_rewind = Some((self.rt.una, ctx.now));
    }

    /// Whether the last rewind for a gap went back to `una` within a
    /// probe's time without its backoff (`round_trips_us`).
    fn rewound_lately(&self, now: Instant) -> bool {
        let Some((psn, at)) = self.last_rewind else { return false };
        psn == self.rt.una && now.saturating_duration_since(at) < Duration::from_micros(self.round_trips_us())
    }

    /// Retransmission timer.
    pub fn on_timer(&mut self, ctx: &mut Ctx) {
        if self.suspended {
            return;
        }
        if self.ack_due.is_some_and(|t| ctx.now >= t) {
            self.ack_last_executed();
        }
        self.on_probe(ctx);
        let Some(d) = self.retrans_deadline else { return };
        if ctx.now < d {
            return;
        }
        if psn_diff(self.rt.max_sent, self.rt.una) <= 0 {
            self.retrans_deadline = None;
            self.probe_deadline = None;
            return;
        }
        if self.rnr_until.is_some() {
            self.retrans_deadline = None;
            self.probe_deadline = None;
            return;
        }
        ctx.stats.timeouts += 1;
        if self.rt.retry_left == 0 {
            self.fail_wqe_at(ctx, 0, WcStatus::RetryExcErr);
            return;
        }
        self.rt.retry_left -= 1;
        // Nothing came back for a whole timeout: start again from the
        // smallest window, slow start up to half of what was in flight.
        let max = self.max_window() as u32;
        self.cc.timeout(&mut self.rt.cwnd, self.rt.una, self.rt.max_sent, max);
        ctx.stats.window_cuts += 1;
        self.rewind(ctx);
        // Back off on consecutive timeouts so that a slow (not dead) peer
        // is not buried under go-back-N retransmissions of whole windows.
        // These timers count from the IB timeout, not the stretched one:
        // nothing came back for the round trips measured, so the peer may
        // be gone, and the owner's timeout and retry_cnt say how soon to
        // give up (a cut link fails a migration's channel as fast as with
        // the IB timer alone, plus the first, stretched wait). The next
        // timer armed after progress stays backed off until a round trip
        // is timed (`timeout_backoff`).
        self.timeout_backoff += 1;
        let consecutive = self.attr.retry_cnt.saturating_sub(self.rt.retry_left).min(6);
        self.retrans_deadline = wire::ack_timeout_us(self.attr.timeout).map(|us| ctx.now + Duration::from_micros(us << consecutive));
    }

    /// The loss probe: no progress for a few round trips means a lost packet
    /// that no later one will reveal (the last ones of a burst, a lost NAK, a
    /// lost retransmission: the responder NAKs a gap once). Go back N now
    /// instead of stalling until the IB timeout; retry_cnt is left alone, as
    /// only the IB timeout is a retry. A probe is a loss: the window halves.
    fn on_probe(&mut self, ctx: &mut Ctx) {
        let Some(d) = self.probe_deadline else { return };
        if ctx.now < d {
            return;
        }
        let outstanding = psn_diff(self.rt.max_sent, self.rt.una) > 0;
        if !outstanding || self.rnr_until.is_some() || !matches!(self.attr.qp_state, QpState::Rts | QpState::Sqd) {
            self.probe_deadline = None;
            return;
        }
        ctx.stats.loss_probes += 1;
        self.cut_window(ctx);
        self.rewind(ctx);
        self.recovery = Some(RECOVERY_FIRST);
        self.probe_backoff += 1;
        self.probe_deadline = self.probe_rto().map(|d| ctx.now + d);
    }
}
