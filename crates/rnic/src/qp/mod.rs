//! RC queue pairs, split as IBTA and Linux rxe split them:
//!
//! - [`state`](self::state): the state machine (`modify`, reset, error and flush);
//! - [`requester`](self::requester): turns send WQEs into request packets
//!   (regenerated from client memory on every retransmission, as a NIC
//!   re-DMAs), its window, retransmission timer and loss probe;
//! - [`completer`](self::completer): consumes ACKs, NAKs and READ/atomic
//!   responses and completes send WQEs in order;
//! - [`responder`](self::responder): checks and executes incoming requests in
//!   the spec's order and queues its responses (ACKs, READ responses, atomic
//!   ACKs, NAKs) in PSN order, so that a coalesced ACK never overtakes a READ
//!   response;
//! - [`snapshot`](self::snapshot): suspend, query, restore and resume (seed 000);
//! - [`ud`](self::ud): unreliable datagram QPs, which share the QP, its
//!   rings and its state machine but none of the RC transport;
//! - [`uc`](self::uc): unreliable connected QPs, RC's requester and
//!   responder without ACKs, retransmission, READs or atomics.
//!
//! This module holds the QP itself, its queues and the rings it pulls WQEs
//! from. Everything the transport needs to carry on lives in [`QpRuntime`],
//! one plain serialisable struct, so that a QP can be suspended, exported
//! and recreated elsewhere.

mod completer;
mod debug;
mod requester;
mod responder;
mod snapshot;
mod srq;
mod state;
mod uc;
pub mod ud;
mod window;

use std::collections::VecDeque;
use std::net::Ipv4Addr;
use std::time::Instant;

use crate::async_events::{AsyncEvent, AsyncKind, AsyncSinks};
use crate::keys::{BindError, Keys, MAX_KLM};
use crate::mem::Mapping;
use crate::objects::{ClientId, Cq, IdMap, Stats, Tx};
use crate::ring::{Cqe, RecvWqe, Ring, SendWqe, Sge, MAX_INLINE, MAX_SGE};
use crate::types::{send_flags, QpAttr, QpCap, QpState, QpType, WcOpcode, WcStatus, WrOpcode};
use crate::wire::{self, psn_add, Flow, Packet, ROCE_PORT};

pub use crate::qp_snapshot::{QpRuntime, QpSnapshot, ReadExec, RespJob, WriteCtx, QP_SNAPSHOT_VERSION};
pub use requester::{WINDOW, WINDOW_BYTES};

/// Largest message (bytes) a WQE or a request may describe.
pub const MAX_MSG: u64 = 1 << 30;
/// Atomic results kept for replaying duplicates.
const ATOMIC_REPLAY: usize = 16;
/// Queued responses per QP before we stop accepting READs (bounded memory).
const MAX_RESP_QUEUE: usize = 256;
/// First span of a loss recovery (packets): a lost UDP GSO batch is up to ~60.
const RECOVERY_FIRST: u32 = 64;

/// The ranges of a bind WR: (address, length, MR key) from its SGEs, then
/// from 16-byte `Sge`s in its inline area; None if it names more than fit.
fn bind_entries(w: &SendWqe) -> Option<Vec<(u64, u64, u32)>> {
    let n = w.num_sge as usize;
    if n > MAX_KLM {
        return None;
    }
    let mut out: Vec<(u64, u64, u32)> = w.sge[..n.min(MAX_SGE)].iter().map(|s| (s.addr, s.length as u64, s.lkey)).collect();
    for c in w.inline.chunks_exact(16).take(n.saturating_sub(MAX_SGE)) {
        let addr = u64::from_le_bytes(c[..8].try_into().ok()?);
        let len = u32::from_le_bytes(c[8..12].try_into().ok()?);
        let key = u32::from_le_bytes(c[12..16].try_into().ok()?);
        out.push((addr, len as u64, key));
    }
    Some(out)
}

/// A send WQE the QP has taken from its ring.
struct SqEntry {
    wqe: SendWqe,
    op: WrOpcode,
    len: u64,
    first_psn: u32,
    npkts: u32,
    signaled: bool,
}

impl SqEntry {
    fn last_psn(&self) -> u32 {
        psn_add(self.first_psn, self.npkts - 1)
    }
    fn sges(&self) -> &[Sge] {
        &self.wqe.sge[..self.wqe.num_sge as usize]
    }
}

pub struct Ctx<'a> {
    pub gid: Ipv4Addr,
    pub keys: &'a mut Keys,
    pub cqs: &'a mut IdMap<Cq>,
    pub tx: &'a mut Tx,
    pub stats: &'a mut Stats,
    pub now: Instant,
    /// When the packet being handled reached this host's kernel (its
    /// receive timestamp; `now` elsewhere): a round trip measured to it
    /// leaves out how late rnicd got to the packet.
    pub arrived: Instant,
    pub asyncs: &'a mut AsyncSinks,
}

impl Ctx<'_> {
    pub(crate) fn complete(&mut self, cq: u32, cqe: Cqe, solicited: bool) {
        if let Some(c) = self.cqs.get_mut(&cq) {
            let overflows = self.stats.cq_overflows;
            c.push(&cqe, solicited, self.stats);
            if self.stats.cq_overflows != overflows {
                self.asyncs.raise(c.owner, AsyncEvent { kind: AsyncKind::CqErr, object: cq });
            }
        }
    }
}

pub struct Qp {
    pub qpn: u32,
    pub owner: ClientId,
    pub pd: u32,
    pub send_cq: u32,
    pub recv_cq: u32,
    pub sq_sig_all: bool,
    pub cap: QpCap,
    pub qp_type: QpType,
    pub attr: QpAttr,
    pub sport: u16,
    pub rt: QpRuntime,
    sq_ring: Ring<SendWqe>,
    rq_ring: Ring<RecvWqe>,
    _maps: (Mapping, Mapping),
    sq: VecDeque<SqEntry>,
    rq: VecDeque<RecvWqe>,
    /// Index in `sq` of the WQE holding `tx_psn`.
    tx_idx: usize,
    /// READ/atomic WQEs in sq[..tx_idx] (against max_rd_atomic).
    rd_outstanding: usize,
    retrans_deadline: Option<Instant>,
    /// Loss probe: go back N after a few round trips without progress,
    /// long before the IB timeout, without counting a retry (below).
    probe_deadline: Option<Instant>,
    probe_backoff: u32,
    /// Timeouts since the last round trip timed: a timer armed after
    /// progress or a new send is doubled this many times, at most 64x
    /// (Karn, as for the probe): a timeout voids the pending sample, so a
    /// timer that always fires before the answer would never learn to
    /// wait longer.
    timeout_backoff: u32,
    /// Smoothed round trip and its variation (µs), from ACKed new packets.
    srtt_us: f64,
    rttvar_us: f64,
    /// A new packet being timed: (PSN, sent at).
    rtt_sample: Option<(u32, Instant)>,
    /// Requester: how long the responder held the requests the ACK being
    /// handled answers (µs, [`wire::decode_hold`]; 0 from other devices).
    peer_hold_us: u64,
    /// Responder: when the oldest request the next ACK answers reached
    /// the kernel; the ACK reports how long it was held since.
    ack_since: Option<Instant>,
    rnr_until: Option<Instant>,
    /// The PSN the last rewind for a gap went back to, and when: see
    /// `Qp::rewind_once`.
    last_rewind: Option<(u32, Instant)>,
    /// What the congestion window (`rt.cwnd`) remembers between ACKs.
    cc: window::Window,
    /// After a sequence NAK or a loss probe: resend at most this many
    /// packets past `una` until an ACK comes. A peer that kept what arrived
    /// after the gap (as rnicd does) then acknowledges it all at once and the
    /// rest of the go-back-N resend is never sent; any other peer gets the
    /// resend in spans doubling per round trip.
    recovery: Option<u32>,
    /// Suspended (seed 000): no host memory access, no transmission, every
    /// incoming request answered with an RNR NAK so the peer keeps retrying.
    pub suspended: bool,
    /// Created suspended with no state (a migration's destination builds
    /// it ahead): LoadQpStates fills it, once, and only such a QP, so that
    /// no QP that ran ever takes a state over what it did.
    pub awaiting_state: bool,
    /// When the last RNR NAK of a suspended QP went out.
    suspended_nak_at: Option<Instant>,
    /// Requests received ahead of the expected PSN, by PSN (see `hold`).
    held: VecDeque<(u32, Packet<'static>, Vec<u8>)>,
    held_bytes: usize,
    /// Requester: messages sent since the last one that asked for an ACK.
    unasked_msgs: u32,
    /// Responder: requests were executed without an ACK; one goes out by then.
    ack_due: Option<Instant>,
    /// Responder: how many requests wait for that ACK, and since when
    /// (ACK coalescing of a stream, `end_of_receive_pass`).
    unacked: u32,
    unacked_since: Option<Instant>,
    /// A bind or invalidate WR waiting for every earlier WR to complete
    /// (an implicit fence: no earlier message, resent or not, sees a binding
    /// it was not posted under); later WRs wait behind it in the ring.
    held_local: Option<SendWqe>,
    /// The shared receive queue (its ID) the responder takes receive WQEs
    /// from instead of `rq_ring` (`qp::srq`).
    srq: Option<(u32, crate::srq::SharedSrq)>,
    /// UC responder: the message under way was dropped; packets are
    /// dropped until the next one begins (`qp::uc`).
    uc_dropping: bool,
}

impl Qp {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        qpn: u32,
        owner: ClientId,
        pd: u32,
        send_cq: u32,
        recv_cq: u32,
        sq_sig_all: bool,
        cap: QpCap,
        sq: (Ring<SendWqe>, Mapping),
        rq: (Ring<RecvWqe>, Mapping),
    ) -> Qp {
        let qp = Qp {
            qpn,
            owner,
            pd,
            send_cq,
            recv_cq,
            sq_sig_all,
            cap,
            qp_type: QpType::Rc,
            attr: QpAttr::default(),
            sport: wire::source_port_for_qpn(qpn),
            rt: QpRuntime::default(),
            sq_ring: sq.0,
            rq_ring: rq.0,
            _maps: (sq.1, rq.1),
            sq: VecDeque::new(),
            rq: VecDeque::new(),
            tx_idx: 0,
            rd_outstanding: 0,
            retrans_deadline: None,
            probe_deadline: None,
            probe_backoff: 0,
            timeout_backoff: 0,
            srtt_us: 0.0,
            rttvar_us: 0.0,
            rtt_sample: None,
            rnr_until: None,
            last_rewind: None,
            cc: window::Window::default(),
            recovery: None,
            suspended: false,
            awaiting_state: false,
            suspended_nak_at: None,
            held: VecDeque::new(),
            held_bytes: 0,
            unasked_msgs: 0,
            ack_due: None,
            unacked: 0,
            unacked_since: None,
            peer_hold_us: 0,
            ack_since: None,
            held_local: None,
            srq: None,
            uc_dropping: false,
        };
        qp.set_rings_polled(false);
        qp
    }

    fn flow(&self, gid: Ipv4Addr) -> Flow {
        Flow { src: gid, dst: self.attr.dest_gid, sport: self.sport, dport: ROCE_PORT }
    }

    fn mtu(&self) -> u64 {
        self.attr.path_mtu.bytes() as u64
    }

    /// Sends up to `budget` packets: responses first, then requests.
    pub fn transmit(&mut self, ctx: &mut Ctx, budget: &mut usize) {
        if self.suspended {
            return;
        }
        if self.is_ud() {
            self.ud_pull_sq(ctx);
            return self.ud_transmit(ctx, budget);
        }
        // WQEs left in the ring while the queue was full get no new doorbell.
        if self.sq.len() < self.cap.max_send_wr as usize && (self.sq_ring.ready() > 0 || self.local_ready()) {
            self.pull_sq(ctx);
        }
        self.responder_tx(ctx, budget);
        self.requester_tx(ctx, budget);
    }

    /// Sends only the responder's queued ACKs and NAKs (one small packet
    /// each, up to the first READ response): see `Engine::poll_tx`.
    pub fn transmit_acks(&mut self, ctx: &mut Ctx, budget: &mut usize) {
        if self.suspended || self.is_ud() {
            return;
        }
        self.responder_acks_tx(ctx, budget);
    }

    /// Tells the client how many of the send WQEs taken from its ring rnicd
    /// is done with ([`crate::ring::RingHeader::done`]): after every
    /// change, before the completion it makes, so that a program that
    /// polled a completion finds its slot free. (Receives need no such
    /// count: they stay in their ring until a message takes them.)
    pub(super) fn publish_done(&self) {
        self.sq_ring.set_done(self.sq.len() as u32 + u32::from(self.held_local.is_some()));
    }

    /// Takes new send WQEs from the shared ring (bounded by max_send_wr).
    pub fn pull_sq(&mut self, ctx: &mut Ctx) {
        if self.suspended {
            return;
        }
        if self.is_ud() {
            return self.ud_pull_sq(ctx);
        }
        let st = self.attr.qp_state;
        if !matches!(st, QpState::Rts | QpState::Sqd | QpState::Err) {
            return;
        }
        if let Some(w) = self.held_local {
            if st != QpState::Err && !self.sq.is_empty() {
                return;
            }
            self.held_local = None;
            if !self.execute_local(ctx, &w, st) {
                return;
            }
        }
        // In ERR every WQE is flushed as it is taken; at most what the ring
        // holds now, so that a client refilling it cannot keep rnicd here.
        let mut left = self.sq_ring.ready();
        while st == QpState::Err || self.sq.len() < self.cap.max_send_wr as usize {
            if left == 0 {
                break;
            }
            left -= 1;
            let Some(w) = self.sq_ring.pop() else { break };
            if WrOpcode::from_u8(w.opcode).is_some_and(|o| o.is_local()) {
                if st != QpState::Err && !self.sq.is_empty() {
                    self.held_local = Some(w);
                    return;
                }
                if !self.execute_local(ctx, &w, st) {
                    return;
                }
                continue;
            }
            match self.validate_send(&w) {
                Ok((op, len)) if st != QpState::Err => {
                    let mtu = self.mtu();
                    let npkts = if op.is_atomic() { 1 } else { len.div_ceil(mtu).max(1) as u32 };
                    let e = SqEntry {
                        wqe: w,
                        op,
                        len,
                        first_psn: self.rt.next_psn,
                        npkts,
                        signaled: self.sq_sig_all || w.flags & send_flags::SIGNALED != 0,
                    };
                    self.rt.next_psn = psn_add(self.rt.next_psn, npkts);
                    self.sq.push_back(e);
                }
                r => {
                    let status = if st == QpState::Err { WcStatus::WrFlushErr } else { WcStatus::LocQpOpErr };
                    if r.is_err() {
                        ctx.stats.bad_wqes += 1;
                    }
                    self.publish_done();
                    let cqe = Cqe {
                        wr_id: w.wr_id,
                        qp_num: self.qpn,
                        status: status as u8,
                        opcode: WcOpcode::for_wr(WrOpcode::from_u8(w.opcode).unwrap_or(WrOpcode::Send)) as u8,
                        ..Default::default()
                    };
                    ctx.complete(self.send_cq, cqe, false);
                    if st != QpState::Err {
                        self.fail(ctx, AsyncKind::QpFatal);
                        return;
                    }
                }
            }
        }
    }

    /// A held bind/invalidate WR may run: every earlier WR completed.
    fn local_ready(&self) -> bool {
        self.held_local.is_some() && self.sq.is_empty()
    }

    /// Runs a bind or invalidate WR (flushes it in ERR) and completes it;
    /// false if it failed and moved the QP to ERR.
    fn execute_local(&mut self, ctx: &mut Ctx, w: &SendWqe, st: QpState) -> bool {
        let op = WrOpcode::from_u8(w.opcode).unwrap_or(WrOpcode::LocalInv);
        let status = if st == QpState::Err {
            WcStatus::WrFlushErr
        } else {
            // A memory window's bind renames its key first (`swap`).
            let window = op == WrOpcode::BindKey && w.swap != 0;
            let renamed = match (op, w.swap) {
                (WrOpcode::BindKey, new) if new != 0 => {
                    let r = u32::try_from(new).map_err(|_| BindError::BadRange);
                    let r = r.and_then(|new| ctx.keys.rename(self.owner, self.pd, w.rkey, new).map(|()| new));
                    if r.is_err() {
                        // The consumer now names the window by its new key:
                        // the old one must not keep granting what it did.
                        let _ = ctx.keys.invalidate(self.owner, self.pd, w.rkey);
                    }
                    r
                }
                _ => Ok(w.rkey),
            };
            let r = match (op, &renamed) {
                (_, Err(e)) => Err(*e),
                // A window bound to nothing (type 1's zero-length bind).
                (WrOpcode::BindKey, &Ok(key)) if window && w.num_sge == 0 => ctx.keys.invalidate(self.owner, self.pd, key),
                (WrOpcode::BindKey, &Ok(key)) => match bind_entries(w) {
                    Some(entries) if w.compare_add <= u32::MAX as u64 => {
                        let (iova, acc) = (w.remote_addr, w.compare_add as u32);
                        if window {
                            ctx.keys.bind_window(self.owner, self.pd, key, iova, acc, &entries)
                        } else {
                            ctx.keys.bind(self.owner, self.pd, key, iova, acc, &entries)
                        }
                    }
                    Some(_) => Err(BindError::BadRange),
                    None => Err(BindError::TooLong),
                },
                (_, &Ok(key)) => ctx.keys.invalidate(self.owner, self.pd, key),
            };
            if let (true, Err(_), Ok(key)) = (window, &r, renamed) {
                // Renamed but not bound: the consumer names the window by
                // its new key, which must not grant what the old binding did.
                let _ = ctx.keys.invalidate(self.owner, self.pd, key);
            }
            match r {
                Ok(()) => {
                    ctx.stats.key_binds += 1;
                    WcStatus::Success
                }
                Err(e) => {
                    ctx.stats.key_bind_errors += 1;
                    // A window's bind fails as rxe's does, whatever the cause.
                    if window {
                        WcStatus::MwBindErr
                    } else if e == BindError::TooLong {
                        WcStatus::LocLenErr
                    } else {
                        WcStatus::LocProtErr
                    }
                }
            }
        };
        self.rt.sq_retired += 1;
        self.publish_done();
        if status != WcStatus::Success || self.sq_sig_all || w.flags & send_flags::SIGNALED != 0 {
            let cqe =
                Cqe { wr_id: w.wr_id, qp_num: self.qpn, status: status as u8, opcode: WcOpcode::for_wr(op) as u8, ..Default::default() };
            ctx.complete(self.send_cq, cqe, false);
        }
        if status != WcStatus::Success && st != QpState::Err {
            self.to_error(ctx);
            return false;
        }
        true
    }

    fn validate_send(&self, w: &SendWqe) -> Result<(WrOpcode, u64), ()> {
        let op = WrOpcode::from_u8(w.opcode).ok_or(())?;
        if self.is_uc() && !uc::carries(op) {
            return Err(());
        }
        let len = if w.flags & send_flags::INLINE != 0 {
            // An atomic write's 8 bytes are its operand, inline whatever the
            // QP's inline size.
            let over = w.inline_len > self.cap.max_inline_data && op != WrOpcode::AtomicWrite;
            if w.inline_len as usize > MAX_INLINE || over || op.is_read_or_atomic() {
                return Err(());
            }
            w.inline_len as u64
        } else {
            if w.num_sge as usize > MAX_SGE || w.num_sge as u32 > self.cap.max_send_sge.max(1) {
                return Err(());
            }
            w.sge[..w.num_sge as usize].iter().map(|s| s.length as u64).sum()
        };
        if len > MAX_MSG || ((op.is_atomic() || op == WrOpcode::AtomicWrite) && len != 8) {
            return Err(());
        }
        Ok((op, len))
    }

    /// Takes new receive WQEs from the shared ring.
    pub fn pull_rq(&mut self, ctx: &mut Ctx) {
        self.pull_rq_up_to(ctx, self.cap.max_recv_wr as usize);
    }

    /// Takes receive WQEs from the shared ring until `want` are queued
    /// here (all of them in ERR, to flush them).
    pub(crate) fn pull_rq_up_to(&mut self, ctx: &mut Ctx, want: usize) {
        if self.suspended || self.srq.is_some() {
            return;
        }
        let st = self.attr.qp_state;
        if st == QpState::Reset || (self.is_ud() && st != QpState::Err) {
            // A UD QP takes its receive WQE from the ring when a datagram
            // comes (qp::ud), so that the ring holds exactly its receives.
            return;
        }
        let mut left = self.rq_ring.ready();
        while self.rq.len() < want.min(self.cap.max_recv_wr as usize) || st == QpState::Err {
            if left == 0 {
                break;
            }
            left -= 1;
            let Some(r) = self.rq_ring.pop() else { break };
            if st == QpState::Err || r.num_sge as usize > MAX_SGE {
                if st != QpState::Err {
                    ctx.stats.bad_wqes += 1;
                }
                let cqe = Cqe {
                    wr_id: r.wr_id,
                    qp_num: self.qpn,
                    status: if st == QpState::Err { WcStatus::WrFlushErr } else { WcStatus::LocQpOpErr } as u8,
                    opcode: WcOpcode::Recv as u8,
                    ..Default::default()
                };
                ctx.complete(self.recv_cq, cqe, false);
                continue;
            }
            self.rq.push_back(r);
        }
    }

    /// Whether the requester or responder has packets to send now.
    pub fn has_tx_work(&self, now: Instant) -> bool {
        if self.suspended {
            return false;
        }
        if self.is_ud() {
            return self.ud_has_tx_work();
        }
        let pullable = (self.sq_ring.ready() > 0 || self.local_ready())
            && self.sq.len() < self.cap.max_send_wr as usize
            && matches!(self.attr.qp_state, QpState::Rts | QpState::Err);
        if !self.rt.resp_queue.is_empty() || pullable {
            return true;
        }
        matches!(self.attr.qp_state, QpState::Rts | QpState::Sqd)
            && self.tx_idx < self.sq.len()
            && self.rnr_until.is_none_or(|t| now >= t)
            && !self.blocked()
    }

    pub fn next_deadline(&self) -> Option<Instant> {
        if self.suspended {
            return None;
        }
        [self.retrans_deadline, self.rnr_until, self.probe_deadline, self.ack_due].into_iter().flatten().min()
    }
    /// Flushes completions if the QP is in ERR; called after ring doorbells.
    /// Receives stay in their ring until a message takes them (`rq_on_demand`).
    pub fn doorbell(&mut self, ctx: &mut Ctx) {
        self.pull_sq(ctx);
        if !self.rq_on_demand() {
            self.pull_rq(ctx);
        }
    }

    /// Tells the client whether rnicd polls this QP's rings (no doorbell
    /// needed). The receive ring needs none outside ERR either (see
    /// `rq_on_demand`).
    pub fn set_rings_polled(&self, on: bool) {
        self.sq_ring.set_polled(on);
        self.rq_ring.set_polled(on || self.rq_on_demand());
    }

    /// Whether rnicd reads the receive ring only when it needs a WQE: a
    /// message arriving takes one (the responder's `rq_head`, a UD
    /// datagram), so a receive posted in the meantime needs no doorbell and
    /// the client skips it (`Ring::needs_doorbell`), and the ring holds
    /// exactly the receives not yet used: a queue of `max_recv_wr`, as on a
    /// device. A receive doorbell per posted WQE woke
    /// rnicd for nothing: once per message for a receiver that reposts
    /// each completion (perftest's `ib_send_bw`), and a real-time rnicd's
    /// wake-up preempts the receiving program. In ERR a posted receive must
    /// be flushed at once, which takes the doorbell.
    pub(crate) fn rq_on_demand(&self) -> bool {
        self.attr.qp_state != QpState::Err
    }

    /// After a state change: the receive ring's doorbell flag follows
    /// `rq_on_demand`. On entering ERR the flag drops before the flush
    /// reads the ring (the fence pairs with the client's between its index
    /// store and its flag load), so a receive is either flushed or rung.
    pub(crate) fn sync_rq_doorbell(&self) {
        self.rq_ring.set_polled(self.rq_on_demand());
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }

    /// Reads the rings as a doorbell would; true if it took any WQE
    /// (receives waiting for a message do not count: see `rq_on_demand`).
    pub fn poll_rings(&mut self, ctx: &mut Ctx) -> bool {
        if self.is_ud() {
            // Its sends leave from the ring in the transmit round (and its
            // receive ring holds posted receives until datagrams come).
            return self.ud_has_tx_work();
        }
        let rq_pulled = !self.rq_on_demand();
        let ready = |q: &Qp| q.sq_ring.ready() + if rq_pulled { q.rq_ring.ready() } else { 0 };
        let before = ready(self);
        if before == 0 {
            return false;
        }
        self.pull_sq(ctx);
        if rq_pulled {
            self.pull_rq(ctx);
        }
        ready(self) < before
    }

    pub fn outstanding_sends(&self) -> usize {
        self.sq.len()
    }
}
