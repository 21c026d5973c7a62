//! RC queue pairs: state machine, requester, completer and responder.
//!
//! Split as in IBTA / Linux rxe. The requester turns WQEs into request
//! packets (regenerated from client memory on every retransmission, like a
//! NIC re-DMAs); the completer consumes ACKs, NAKs and READ/atomic responses
//! and completes WQEs in order; the responder executes incoming requests and
//! queues its responses (ACKs, READ responses, atomic ACKs, NAKs) in PSN
//! order so that a coalesced ACK never overtakes a READ response.
//!
//! Everything the transport needs to carry on lives in [`QpRuntime`], one
//! plain serialisable struct, so that a QP can later be suspended, exported
//! and recreated elsewhere.

use std::collections::VecDeque;
use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::mem::Mapping;
use crate::objects::{gather, scatter, ClientId, Cq, Mr, MrTable, Stats, Tx};
use crate::ring::{Cqe, RecvWqe, Ring, SendWqe, MAX_INLINE, MAX_SGE};
use crate::types::{access, send_flags, wc_flags, QpAttr, QpCap, QpState, WcOpcode, WcStatus, WrOpcode};
use crate::wire::{self, psn_add, psn_diff, Aeth, AtomicEth, Flow, Headers, NakCode, Opcode, Packet, Reth, Syndrome, ROCE_PORT};

/// Most request packets in flight per QP (a PSN window, well under 2^23).
pub const WINDOW: i32 = 4096;
/// Most request bytes in flight per QP: more only overruns the peer's socket
/// buffer and IP reassembly, and go-back-N then resends all of it.
pub const WINDOW_BYTES: usize = 2 << 20;
/// Smallest congestion window (packets).
const MIN_CWND: u32 = 16;
/// Set the AckReq bit at least every this many packets of a long message.
const ACK_EVERY: u32 = 64;
/// A responder acknowledges requests that did not ask for it (AckReq clear)
/// within this time (µs): it coalesces their ACKs, and a requester that
/// stops sending still hears about its last messages long before its loss
/// probe (MIN_PROBE_US).
const ACK_DELAY_US: u64 = 100;
/// Shortest loss-probe time (µs), and the one used before any RTT sample.
/// Not shorter: with 1,000 QPs a busy responder answers late, and spurious
/// probes (each a resend) then add to its load.
const MIN_PROBE_US: f64 = 4000.0;
const FIRST_PROBE_US: f64 = 20_000.0;
/// First span of a loss recovery (packets): a lost UDP GSO batch is up to ~60.
const RECOVERY_FIRST: u32 = 64;
/// Requests a responder keeps when they arrive ahead of a gap (see `Qp::hold`).
const HOLD_MAX_PKTS: usize = 2048;
const HOLD_MAX_BYTES: usize = 4 << 20;
/// Atomic results kept for replaying duplicates.
const ATOMIC_REPLAY: usize = 16;
/// Queued responses per QP before we stop accepting READs (bounded memory).
const MAX_RESP_QUEUE: usize = 256;
pub const MAX_MSG: u64 = 1 << 30;

/// Responder's write in progress (between WRITE_FIRST and WRITE_LAST).
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct WriteCtx {
    pub va: u64,
    pub rkey: u32,
    pub remaining: u64,
    pub total: u64,
}

/// A response the responder still has to send, in PSN order.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub enum RespJob {
    Ack { psn: u32, syndrome: u8 },
    AtomicAck { psn: u32, orig: u64 },
    Read { psn: u32, va: u64, rkey: u32, remaining: u64, first: bool },
}

/// The transport state of a QP: everything but its queues and timers.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct QpRuntime {
    // requester
    /// PSN the next pulled WQE starts at.
    pub next_psn: u32,
    /// Oldest unacknowledged PSN.
    pub una: u32,
    /// Next PSN to (re)transmit.
    pub tx_psn: u32,
    /// One past the highest PSN ever transmitted.
    pub max_sent: u32,
    pub retry_left: u8,
    pub rnr_left: u8,
    /// Packets the requester may have unacknowledged now (<= the window):
    /// cut after a timeout, grown by every ACKed packet, so
    /// that a go-back-N retransmission after a stall is not a full window.
    #[serde(default)]
    pub cwnd: u32,
    // responder
    pub epsn: u32,
    pub msn: u32,
    /// Bytes already placed into the head receive WQE by a multi-packet SEND.
    pub recv_offset: u64,
    pub in_send: bool,
    pub write: Option<WriteCtx>,
    pub atomic_results: VecDeque<(u32, u64)>,
    pub nak_sent: bool,
    pub resp_queue: VecDeque<RespJob>,
    /// Send WQEs retired (completed, signaled or not) since the QP was
    /// created: the owner reposts its WRs from this index on after a move.
    #[serde(default)]
    pub sq_retired: u64,
    /// Receive WQEs retired since the QP was created (the same for RECVs).
    #[serde(default)]
    pub rq_retired: u64,
}

/// Version of [`QpSnapshot`]; bump on any change of its meaning.
pub const QP_SNAPSHOT_VERSION: u32 = 1;

/// The runtime state of a suspended RC QP, as query-suspended returns it and
/// create-suspended takes it (docs/rdma-migration.md). Posted WRs are not in
/// it: the owner reposts those from `runtime.sq_retired` / `rq_retired` on.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct QpSnapshot {
    pub version: u32,
    pub qpn: u32,
    pub attr: QpAttr,
    pub runtime: QpRuntime,
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
    fn sges(&self) -> &[crate::ring::Sge] {
        &self.wqe.sge[..self.wqe.num_sge as usize]
    }
}

pub struct Ctx<'a> {
    pub gid: Ipv4Addr,
    pub mrs: &'a MrTable,
    pub cqs: &'a mut crate::objects::IdMap<Cq>,
    pub tx: &'a mut Tx,
    pub stats: &'a mut Stats,
    pub now: Instant,
}

impl Ctx<'_> {
    fn complete(&mut self, cq: u32, cqe: Cqe, solicited: bool) {
        if let Some(c) = self.cqs.get_mut(&cq) {
            c.push(&cqe, solicited, self.stats);
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
    /// Smoothed round trip and its variation (µs), from ACKed new packets.
    srtt_us: f64,
    rttvar_us: f64,
    /// A new packet being timed: (PSN, sent at).
    rtt_sample: Option<(u32, Instant)>,
    rnr_until: Option<Instant>,
    /// Avoids rewinding again for the same gap while a rewind is under way.
    last_rewind: Option<u32>,
    /// `una` when the congestion window last grew.
    cwnd_una: u32,
    /// After a sequence NAK or a loss probe: resend at most this many
    /// packets past `una` until an ACK comes. A peer that kept what arrived
    /// after the gap (as rnicd does) then acknowledges it all at once and the
    /// rest of the go-back-N resend is never sent; any other peer gets the
    /// resend in spans doubling per round trip.
    recovery: Option<u32>,
    /// Suspended (seed 000): no host memory access, no transmission, every
    /// incoming request answered with an RNR NAK so the peer keeps retrying.
    pub suspended: bool,
    /// When the last RNR NAK of a suspended QP went out.
    suspended_nak_at: Option<Instant>,
    /// Requests received ahead of the expected PSN, by PSN (see `hold`).
    held: VecDeque<(u32, Packet<'static>, Vec<u8>)>,
    held_bytes: usize,
    /// Requester: messages sent since the last one that asked for an ACK.
    unasked_msgs: u32,
    /// Responder: requests were executed without an ACK; one goes out by then.
    ack_due: Option<Instant>,
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
        Qp {
            qpn,
            owner,
            pd,
            send_cq,
            recv_cq,
            sq_sig_all,
            cap,
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
            srtt_us: 0.0,
            rttvar_us: 0.0,
            rtt_sample: None,
            rnr_until: None,
            last_rewind: None,
            cwnd_una: 0,
            recovery: None,
            suspended: false,
            suspended_nak_at: None,
            held: VecDeque::new(),
            held_bytes: 0,
            unasked_msgs: 0,
            ack_due: None,
        }
    }

    // ------------------------------------------------------------ migration

    /// Suspends processing: from now on the QP touches neither host memory
    /// nor its rings, and its peer sees only RNR NAKs.
    ///
    /// Responses already due that need no memory (ACKs, atomic ACKs) go out
    /// now, and a READ response that cannot is replaced by an RNR NAK for
    /// its PSN: a peer whose requests were all executed would otherwise hear
    /// nothing until the resume and count retransmission timeouts (retry_cnt)
    /// during a long move.
    pub fn suspend(&mut self, ctx: &mut Ctx) -> Result<(), String> {
        if !matches!(self.attr.qp_state, QpState::Rtr | QpState::Rts | QpState::Sqd) {
            return Err(format!("only an RTR/RTS/SQD QP can be suspended, not {:?}", self.attr.qp_state));
        }
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
        self.suspended = true;
        self.retrans_deadline = None;
        self.probe_deadline = None;
        self.rnr_until = None;
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
        Ok(QpSnapshot { version: QP_SNAPSHOT_VERSION, qpn: self.qpn, attr: self.attr, runtime: rt })
    }

    /// Create-suspended: takes the transport state of `s` (checked, since it
    /// comes from a client). The QP stays suspended until [`Qp::resume`].
    pub fn restore(&mut self, s: &QpSnapshot) -> Result<(), String> {
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
        if r.resp_queue.len() > MAX_RESP_QUEUE || r.atomic_results.len() > 2 * ATOMIC_REPLAY.max(256) || r.recv_offset > MAX_MSG {
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
        self.attr = *a;
        self.attr.dest_qp_num &= wire::QPN_MASK;
        self.attr.sq_draining = false;
        self.cwnd_una = rt.una;
        self.rt = rt;
        self.sq.clear();
        self.rq.clear();
        self.tx_idx = 0;
        self.rd_outstanding = 0;
        self.suspended = true;
        Ok(())
    }

    /// Resumes a suspended (or created-suspended) QP: unacknowledged requests
    /// go out again from `una` (the peer's responses were dropped meanwhile).
    pub fn resume(&mut self, ctx: &mut Ctx) -> Result<(), String> {
        if !self.suspended {
            return Err("QP is not suspended".into());
        }
        self.suspended = false;
        self.rt.retry_left = self.attr.retry_cnt;
        self.rt.rnr_left = self.attr.rnr_retry;
        self.rewind(ctx);
        self.last_rewind = None;
        self.pull_sq(ctx);
        self.pull_rq(ctx);
        // Kick the peer: a PSN sequence NAK for the PSN we expect makes it
        // resend from there now instead of at its next RNR or retry timer
        // (a peer with nothing outstanding drops it as out of window).
        if matches!(self.attr.qp_state, QpState::Rts | QpState::Sqd | QpState::Rtr) {
            self.queue_nak(self.rt.epsn, Syndrome::Nak(NakCode::PsnSeqError));
        }
        Ok(())
    }

    /// Suspended answer to any request: RNR NAK for its PSN (or for the
    /// expected one if it is ahead), sent at once and touching no memory.
    fn suspended_nak(&mut self, ctx: &mut Ctx, psn: u32) {
        let nak_psn = if psn_diff(psn, self.rt.epsn) <= 0 { psn } else { self.rt.epsn };
        ctx.stats.rnr_naks_sent += 1;
        let flow = self.flow(ctx.gid);
        let mut h = Headers::new(Opcode::Ack, self.attr.dest_qp_num, nak_psn);
        h.aeth = Some(Aeth { syndrome: Syndrome::RnrNak(self.attr.min_rnr_timer), msn: self.rt.msn });
        let _ = ctx.tx.emit(&flow, &h, 0, |_| Ok::<(), ()>(()));
    }

    fn flow(&self, gid: Ipv4Addr) -> Flow {
        Flow { src: gid, dst: self.attr.dest_gid, sport: self.sport, dport: ROCE_PORT }
    }

    fn mtu(&self) -> u64 {
        self.attr.path_mtu.bytes() as u64
    }

    // ---------------------------------------------------------------- state

    /// ibv_modify_qp: validates the transition and the attribute mask.
    pub fn modify(&mut self, attr: &QpAttr, mask: u32, ctx: &mut Ctx) -> Result<(), String> {
        use crate::types::mask as m;
        use QpState::{Init, Reset, Rtr, Rts, Sqd, Sqe};
        let cur = self.attr.qp_state;
        let new = if mask & m::STATE != 0 { attr.qp_state } else { cur };
        let required = match (cur, new) {
            (_, Reset) | (_, QpState::Err) => 0,
            (Reset, Init) => m::PKEY_INDEX | m::PORT | m::ACCESS_FLAGS,
            (Init, Init) => 0,
            (Init, Rtr) => m::AV | m::PATH_MTU | m::DEST_QPN | m::RQ_PSN | m::MAX_DEST_RD_ATOMIC | m::MIN_RNR_TIMER,
            (Rtr, Rts) => m::SQ_PSN | m::TIMEOUT | m::RETRY_CNT | m::RNR_RETRY | m::MAX_QP_RD_ATOMIC,
            (Rts, Rts) | (Rts, Sqd) | (Sqd, Sqd) | (Sqd, Rts) | (Sqe, Rts) => 0,
            _ => return Err(format!("invalid QP state transition {cur:?} -> {new:?}")),
        };
        if mask & required != required {
            return Err(format!("{cur:?} -> {new:?} needs attribute mask {required:#x}, got {mask:#x}"));
        }
        if attr.retry_cnt > 7 || attr.rnr_retry > 7 || attr.min_rnr_timer > 31 || attr.timeout > 31 {
            return Err("retry_cnt/rnr_retry are 3 bits, min_rnr_timer/timeout 5 bits".into());
        }
        if mask & m::AV != 0 && attr.dest_gid.is_unspecified() {
            return Err("destination GID must be an IPv4 address".into());
        }
        let a = &mut self.attr;
        if mask & m::ACCESS_FLAGS != 0 {
            a.qp_access_flags = attr.qp_access_flags;
        }
        if mask & m::PKEY_INDEX != 0 {
            a.pkey_index = attr.pkey_index;
        }
        if mask & m::PORT != 0 {
            if attr.port_num != 1 {
                return Err("only port 1 exists".into());
            }
            a.port_num = 1;
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
        match (cur, new) {
            (_, Reset) => self.reset(),
            (_, QpState::Err) if cur != QpState::Err => self.to_error(ctx),
            (Init, Rtr) => {
                self.rt.epsn = self.attr.rq_psn;
                self.attr.qp_state = Rtr;
            }
            (Rtr, Rts) => {
                let p = self.attr.sq_psn;
                self.rt.next_psn = p;
                self.rt.una = p;
                self.rt.tx_psn = p;
                self.rt.max_sent = p;
                self.rt.retry_left = self.attr.retry_cnt;
                self.rt.rnr_left = self.attr.rnr_retry;
                self.rt.cwnd = self.max_window() as u32;
                self.cwnd_una = p;
                self.attr.qp_state = Rts;
            }
            (Sqd, Rts) | (Sqe, Rts) if mask & m::SQ_PSN != 0 && self.sq.is_empty() => {
                let p = self.attr.sq_psn;
                self.rt.cwnd = self.max_window() as u32;
                self.cwnd_una = p;
                self.rt.next_psn = p;
                self.rt.una = p;
                self.rt.tx_psn = p;
                self.rt.max_sent = p;
                self.attr.qp_state = Rts;
            }
            _ => self.attr.qp_state = new,
        }
        self.attr.sq_draining = self.attr.qp_state == Sqd && psn_diff(self.rt.max_sent, self.rt.una) > 0;
        Ok(())
    }

    fn reset(&mut self) {
        self.drop_held();
        self.sq.clear();
        self.rq.clear();
        while self.sq_ring.pop().is_some() {}
        while self.rq_ring.pop().is_some() {}
        self.rt = QpRuntime::default();
        self.tx_idx = 0;
        self.rd_outstanding = 0;
        self.retrans_deadline = None;
        self.probe_deadline = None;
        self.rnr_until = None;
        self.last_rewind = None;
        self.unasked_msgs = 0;
        self.ack_due = None;
        let keep = (self.attr.port_num, self.attr.path_mtu);
        self.attr = QpAttr::default();
        (self.attr.port_num, self.attr.path_mtu) = keep;
    }

    /// Moves to ERR and flushes every outstanding and queued WQE.
    pub fn to_error(&mut self, ctx: &mut Ctx) {
        self.drop_held();
        self.attr.qp_state = QpState::Err;
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
        for e in self.sq.drain(..) {
            let cqe = Cqe {
                wr_id: e.wqe.wr_id,
                qp_num: self.qpn,
                status: WcStatus::WrFlushErr as u8,
                opcode: WcOpcode::for_wr(e.op) as u8,
                ..Default::default()
            };
            ctx.complete(self.send_cq, cqe, false);
        }
        for r in self.rq.drain(..) {
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

    // ---------------------------------------------------------- rings

    /// Takes new send WQEs from the shared ring (bounded by max_send_wr).
    pub fn pull_sq(&mut self, ctx: &mut Ctx) {
        if self.suspended {
            return;
        }
        let st = self.attr.qp_state;
        if !matches!(st, QpState::Rts | QpState::Sqd | QpState::Err) {
            return;
        }
        while st == QpState::Err || self.sq.len() < self.cap.max_send_wr as usize {
            let Some(w) = self.sq_ring.pop() else { break };
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
                    let cqe = Cqe {
                        wr_id: w.wr_id,
                        qp_num: self.qpn,
                        status: status as u8,
                        opcode: WcOpcode::for_wr(WrOpcode::from_u8(w.opcode).unwrap_or(WrOpcode::Send)) as u8,
                        ..Default::default()
                    };
                    ctx.complete(self.send_cq, cqe, false);
                    if st != QpState::Err {
                        self.to_error(ctx);
                        return;
                    }
                }
            }
        }
    }

    fn validate_send(&self, w: &SendWqe) -> Result<(WrOpcode, u64), ()> {
        let op = WrOpcode::from_u8(w.opcode).ok_or(())?;
        let len = if w.flags & send_flags::INLINE != 0 {
            if w.inline_len as usize > MAX_INLINE || w.inline_len > self.cap.max_inline_data || op.is_read_or_atomic() {
                return Err(());
            }
            w.inline_len as u64
        } else {
            if w.num_sge as usize > MAX_SGE || w.num_sge as u32 > self.cap.max_send_sge.max(1) {
                return Err(());
            }
            w.sge[..w.num_sge as usize].iter().map(|s| s.length as u64).sum()
        };
        if len > MAX_MSG || (op.is_atomic() && len != 8) {
            return Err(());
        }
        Ok((op, len))
    }

    /// Takes new receive WQEs from the shared ring.
    pub fn pull_rq(&mut self, ctx: &mut Ctx) {
        if self.suspended {
            return;
        }
        let st = self.attr.qp_state;
        if st == QpState::Reset {
            return;
        }
        while self.rq.len() < self.cap.max_recv_wr as usize || st == QpState::Err {
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
        let pullable = self.sq_ring.ready() > 0
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

    /// Whether the next request is new and may not go yet (window, READ/atomic
    /// credits, fence, SQD): then only a response or a timer moves the QP, and
    /// the daemon may sleep instead of spinning.
    fn blocked(&self) -> bool {
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

    pub fn next_deadline(&self) -> Option<Instant> {
        if self.suspended {
            return None;
        }
        [self.retrans_deadline, self.rnr_until, self.probe_deadline, self.ack_due].into_iter().flatten().min()
    }

    // ---------------------------------------------------------- requester

    /// Sends up to `budget` packets: responses first, then requests.
    pub fn transmit(&mut self, ctx: &mut Ctx, budget: &mut usize) {
        if self.suspended {
            return;
        }
        // WQEs left in the ring while the queue was full get no new doorbell.
        if self.sq.len() < self.cap.max_send_wr as usize && self.sq_ring.ready() > 0 {
            self.pull_sq(ctx);
        }
        self.responder_tx(ctx, budget);
        self.requester_tx(ctx, budget);
    }

    fn requester_tx(&mut self, ctx: &mut Ctx, budget: &mut usize) {
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
            if let Err(status) = self.build_request(ctx, self.tx_idx, psn, ask) {
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
            if self.retrans_deadline.is_none() {
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

    fn max_window(&self) -> i32 {
        (WINDOW_BYTES / self.attr.path_mtu.bytes()).clamp(MIN_CWND as usize, WINDOW as usize) as i32
    }

    fn window(&self) -> i32 {
        self.max_window().min(self.rt.cwnd.max(MIN_CWND) as i32)
    }

    fn ack_every(&self) -> u32 {
        ((self.window() / 4) as u32).clamp(1, ACK_EVERY)
    }

    fn arm_timer(&mut self, now: Instant) {
        self.retrans_deadline = wire::ack_timeout_us(self.attr.timeout).map(|us| now + Duration::from_micros(us));
        self.probe_deadline = self.probe_rto().map(|d| now + d);
    }

    /// When to probe for a lost packet: a few smoothed round trips (at least
    /// MIN_PROBE), never later than the IB timeout, never with timeout 0
    /// (infinite: the owner asked for no retransmission timer).
    fn probe_rto(&self) -> Option<Duration> {
        let ib = wire::ack_timeout_us(self.attr.timeout)?;
        let us = if self.srtt_us == 0.0 { FIRST_PROBE_US } else { (self.srtt_us + 4.0 * self.rttvar_us).max(2.0 * self.srtt_us) };
        let us = (us.max(MIN_PROBE_US) as u64) << self.probe_backoff.min(6);
        (us < ib).then(|| Duration::from_micros(us))
    }

    fn rtt_update(&mut self, sample_us: f64) {
        if self.srtt_us == 0.0 {
            self.srtt_us = sample_us;
            self.rttvar_us = sample_us / 2.0;
        } else {
            self.rttvar_us = 0.75 * self.rttvar_us + 0.25 * (self.srtt_us - sample_us).abs();
            self.srtt_us = 0.875 * self.srtt_us + 0.125 * sample_us;
        }
    }

    fn build_request(&self, ctx: &mut Ctx, idx: usize, psn: u32, ask_ack: bool) -> Result<(), WcStatus> {
        let e = &self.sq[idx];
        let flow = self.flow(ctx.gid);
        let dq = self.attr.dest_qp_num;
        let i = psn_diff(psn, e.first_psn).max(0) as u32;
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
                let is_write = matches!(op, WrOpcode::RdmaWrite | WrOpcode::RdmaWriteImm);
                let imm = matches!(op, WrOpcode::RdmaWriteImm | WrOpcode::SendImm);
                use Opcode::*;
                let opc = match (is_write, first, last) {
                    (true, true, true) => {
                        if imm {
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
                let (mrs, pd) = (ctx.mrs, self.pd);
                ctx.tx.emit(&flow, &h, plen, |out| {
                    if inline {
                        out.copy_from_slice(&w.inline[off as usize..off as usize + plen]);
                        Ok(())
                    } else {
                        gather(mrs, pd, e.sges(), off, out)
                    }
                })
            }
        }
    }

    /// Go-back-N: the next packet sent is `una` again.
    fn rewind(&mut self, ctx: &mut Ctx) {
        ctx.stats.retransmit_rewinds += 1;
        // Karn: a resent packet's ACK says nothing about the round trip.
        self.rtt_sample = None;
        self.recovery = None;
        self.tx_idx = 0;
        self.rd_outstanding = 0;
        self.rt.tx_psn = self.rt.una;
        self.last_rewind = Some(self.rt.una);
    }

    fn rewind_once(&mut self, ctx: &mut Ctx) {
        if self.last_rewind != Some(self.rt.una) {
            self.rewind(ctx);
        }
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
        self.rt.cwnd = MIN_CWND;
        self.rewind(ctx);
        // Back off on consecutive timeouts so that a slow (not dead) peer
        // is not buried under go-back-N retransmissions of whole windows.
        let backoff = self.attr.retry_cnt.saturating_sub(self.rt.retry_left).min(6);
        self.retrans_deadline = wire::ack_timeout_us(self.attr.timeout).map(|us| ctx.now + Duration::from_micros(us << backoff));
    }

    /// The loss probe: no progress for a few round trips means a lost packet
    /// that no later one will reveal (the last ones of a burst, a lost NAK, a
    /// lost retransmission: the responder NAKs a gap once). Go back N now
    /// instead of stalling until the IB timeout; retry_cnt and cwnd are left
    /// alone, as only the IB timeout is a retry.
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
        self.rewind(ctx);
        self.recovery = Some(RECOVERY_FIRST);
        self.probe_backoff += 1;
        self.probe_deadline = self.probe_rto().map(|d| ctx.now + d);
    }

    // ---------------------------------------------------------- completer

    fn complete_front(&mut self, ctx: &mut Ctx, status: WcStatus) {
        let Some(e) = self.sq.pop_front() else { return };
        self.rt.sq_retired += 1;
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
    fn fail_wqe_at(&mut self, ctx: &mut Ctx, idx: usize, status: WcStatus) {
        for _ in 0..idx {
            self.complete_front(ctx, WcStatus::Success);
        }
        self.complete_front(ctx, status);
        self.to_error(ctx);
    }

    fn progress(&mut self, ctx: &mut Ctx) {
        if let Some((p, t)) = self.rtt_sample {
            if psn_diff(self.rt.una, p) > 0 {
                self.rtt_update(ctx.now.saturating_duration_since(t).as_secs_f64() * 1e6);
                self.rtt_sample = None;
            }
        }
        self.probe_backoff = 0;
        let acked = psn_diff(self.rt.una, self.cwnd_una).max(0) as u32;
        self.cwnd_una = self.rt.una;
        self.rt.cwnd = (self.rt.cwnd + acked).min(self.max_window() as u32);
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
        let prev = psn_add(psn, wire::PSN_MASK);
        match p.bth.opcode {
            Opcode::Ack => {
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
                    Syndrome::Nak(NakCode::PsnSeqError) => {
                        if !self.ack_through(ctx, prev) {
                            self.rewind_once(ctx);
                            return;
                        }
                        if self.last_rewind != Some(self.rt.una) {
                            self.rewind(ctx);
                            self.recovery = Some(RECOVERY_FIRST);
                        }
                    }
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
            Opcode::AtomicAck => {
                if !self.ack_through(ctx, prev) {
                    self.rewind_once(ctx);
                    return;
                }
                let (Some(e), Some(orig)) = (self.sq.front(), p.atomic_ack) else { return };
                if !e.op.is_atomic() || e.first_psn != psn {
                    ctx.stats.rx_bad_response += 1;
                    return;
                }
                let r = scatter(ctx.mrs, self.pd, e.sges(), 0, &orig.to_ne_bytes());
                self.rt.una = psn_add(psn, 1);
                match r {
                    Ok(()) => {
                        self.complete_front(ctx, WcStatus::Success);
                        self.progress(ctx);
                    }
                    Err(s) => self.fail_wqe_at(ctx, 0, s),
                }
            }
            Opcode::ReadRespFirst | Opcode::ReadRespMiddle | Opcode::ReadRespLast | Opcode::ReadRespOnly => {
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
                if let Err(s) = scatter(ctx.mrs, self.pd, e.sges(), off, p.payload) {
                    self.fail_wqe_at(ctx, 0, s);
                    return;
                }
                self.rt.una = psn_add(psn, 1);
                if last {
                    self.complete_front(ctx, WcStatus::Success);
                }
                self.progress(ctx);
            }
            _ => ctx.stats.rx_bad_response += 1,
        }
        self.attr.sq_draining = self.attr.qp_state == QpState::Sqd && psn_diff(self.rt.max_sent, self.rt.una) > 0;
    }

    // ---------------------------------------------------------- responder

    /// Acknowledge everything executed so far (the PSN before the next
    /// expected one).
    fn ack_last_executed(&mut self) {
        self.queue_ack(psn_add(self.rt.epsn, wire::PSN_MASK));
    }

    fn queue_ack(&mut self, psn: u32) {
        // Acknowledges everything before it, the coalesced ones too.
        self.ack_due = None;
        if let Some(RespJob::Ack { psn: p, syndrome }) = self.rt.resp_queue.back_mut() {
            if Syndrome::from_u8(*syndrome) == Syndrome::Ack(0x1f) {
                *p = psn;
                return;
            }
        }
        self.rt.resp_queue.push_back(RespJob::Ack { psn, syndrome: Syndrome::Ack(0x1f).to_u8() });
    }

    fn queue_nak(&mut self, psn: u32, s: Syndrome) {
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
        self.to_error(ctx);
    }

    fn rq_head(&mut self, ctx: &mut Ctx) -> bool {
        if self.rq.is_empty() {
            self.pull_rq(ctx);
        }
        !self.rq.is_empty()
    }

    // One argument per field of the receive CQE it writes.
    #[allow(clippy::too_many_arguments)]
    fn complete_recv(
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

    fn check_rkey(&self, ctx: &Ctx, rkey: u32, va: u64, len: u64, need: u32) -> Option<Arc<Mr>> {
        if self.attr.qp_access_flags & need != need {
            return None;
        }
        let mr = ctx.mrs.get(&rkey)?;
        mr.translate(self.pd, va, len, need)?;
        Some(mr.clone())
    }

    pub fn on_request(&mut self, ctx: &mut Ctx, p: &Packet) {
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

    fn drop_held(&mut self) {
        self.held.clear();
        self.held_bytes = 0;
    }

    fn handle_request(&mut self, ctx: &mut Ctx, p: &Packet) {
        if !matches!(self.attr.qp_state, QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe) {
            ctx.stats.rx_wrong_state += 1;
            return;
        }
        let psn = p.bth.psn;
        if self.suspended {
            ctx.stats.rx_while_suspended += 1;
            // One RNR NAK per RNR period: the rest of a burst is resent by the
            // peer after its RNR wait anyway; NAKing every packet restarts its
            // wait and rewinds it again and again (a storm of retransmissions
            // that takes the CPU while the QP moves).
            let period = Duration::from_micros(wire::rnr_timer_us(self.attr.min_rnr_timer));
            if self.suspended_nak_at.is_some_and(|t| ctx.now < t + period) {
                return;
            }
            self.suspended_nak_at = Some(ctx.now);
            self.suspended_nak(ctx, psn);
            return;
        }
        let d = psn_diff(psn, self.rt.epsn);
        if d > 0 {
            if !self.rt.nak_sent {
                ctx.stats.seq_naks_sent += 1;
                self.rt.nak_sent = true;
                self.queue_nak(self.rt.epsn, Syndrome::Nak(NakCode::PsnSeqError));
            }
            self.hold(ctx, p, d);
            return;
        }
        if d < 0 {
            self.duplicate(ctx, p);
            return;
        }
        let op = p.bth.opcode;
        let mtu = self.mtu() as usize;
        // Opcode sequence: the middle of a message must continue it.
        let seq_ok = if self.rt.in_send {
            op.is_send() && !op.starts_message()
        } else if self.rt.write.is_some() {
            op.is_write() && !op.starts_message()
        } else {
            op.starts_message()
        };
        let size_ok = if op.ends_message() { p.payload.len() <= mtu } else { p.payload.len() == mtu };
        if !seq_ok || !size_ok {
            self.responder_error(ctx, psn, NakCode::InvalidRequest);
            return;
        }
        if op.is_send() {
            if op.starts_message() {
                if !self.rq_head(ctx) {
                    self.rnr(ctx, psn);
                    return;
                }
                self.rt.recv_offset = 0;
                self.rt.in_send = true;
            }
            let r = self.rq[0];
            let sges = &r.sge[..(r.num_sge as usize).min(MAX_SGE)];
            if let Err(s) = scatter(ctx.mrs, self.pd, sges, self.rt.recv_offset, p.payload) {
                let code = if s == WcStatus::LocLenErr { NakCode::InvalidRequest } else { NakCode::RemoteOpError };
                self.complete_recv(ctx, s, WcOpcode::Recv, 0, None, None, false);
                self.responder_error(ctx, psn, code);
                return;
            }
            self.rt.recv_offset += p.payload.len() as u64;
            if op.ends_message() {
                self.rt.in_send = false;
                self.rt.msn = psn_add(self.rt.msn, 1);
                if let Some(k) = p.ieth {
                    if let Some(mr) = ctx.mrs.get(&k) {
                        if mr.pd == self.pd {
                            mr.invalidated.store(true, Ordering::Relaxed);
                        }
                    }
                }
                let len = self.rt.recv_offset as u32;
                self.complete_recv(ctx, WcStatus::Success, WcOpcode::Recv, len, p.imm, p.ieth, p.bth.solicited);
            }
        } else if op.is_write() {
            if let Some(reth) = p.reth {
                if reth.len as usize > MAX_MSG as usize
                    || (op.ends_message() && reth.len as usize != p.payload.len())
                    || (!op.ends_message() && (reth.len as usize) <= p.payload.len())
                {
                    self.responder_error(ctx, psn, NakCode::InvalidRequest);
                    return;
                }
                if reth.len > 0 && self.check_rkey(ctx, reth.rkey, reth.va, reth.len as u64, access::REMOTE_WRITE).is_none() {
                    self.responder_error(ctx, psn, NakCode::RemoteAccessError);
                    return;
                }
                if op == Opcode::WriteOnlyImm && !self.rq_head(ctx) {
                    self.rnr(ctx, psn);
                    return;
                }
                self.rt.write = Some(WriteCtx { va: reth.va, rkey: reth.rkey, remaining: reth.len as u64, total: reth.len as u64 });
            }
            if op == Opcode::WriteLastImm && !self.rq_head(ctx) {
                self.rnr(ctx, psn);
                return;
            }
            let Some(mut w) = self.rt.write else { return };
            let n = p.payload.len() as u64;
            if n > w.remaining || (op.ends_message() && n != w.remaining) {
                self.responder_error(ctx, psn, NakCode::InvalidRequest);
                return;
            }
            if n > 0 {
                let Some(dst) = ctx.mrs.get(&w.rkey).and_then(|m| m.translate(self.pd, w.va, n, access::REMOTE_WRITE)) else {
                    self.responder_error(ctx, psn, NakCode::RemoteAccessError);
                    return;
                };
                // SAFETY: translate() checked [va, va+n) lies in the mapping.
                unsafe { std::ptr::copy_nonoverlapping(p.payload.as_ptr(), dst, n as usize) };
            }
            w.va += n;
            w.remaining -= n;
            self.rt.write = Some(w);
            if op.ends_message() {
                self.rt.write = None;
                self.rt.msn = psn_add(self.rt.msn, 1);
                if p.imm.is_some() {
                    self.complete_recv(ctx, WcStatus::Success, WcOpcode::RecvRdmaWithImm, w.total as u32, p.imm, None, p.bth.solicited);
                }
            }
        } else if op == Opcode::ReadRequest {
            let Some(reth) = p.reth else { return };
            if reth.len > 0 && self.check_rkey(ctx, reth.rkey, reth.va, reth.len as u64, access::REMOTE_READ).is_none() {
                self.responder_error(ctx, psn, NakCode::RemoteAccessError);
                return;
            }
            // Responder resources: a compliant requester keeps at most
            // max_rd_atomic READs/atomics outstanding (<= our max_dest_rd_atomic);
            // the slack covers duplicates. Bounds what a hostile peer can make
            // us stream out of client memory.
            let reads = self.rt.resp_queue.iter().filter(|j| matches!(j, RespJob::Read { .. })).count();
            let limit = (self.attr.max_dest_rd_atomic.max(1) as usize * 2 + 8).min(MAX_RESP_QUEUE);
            if reads >= limit || self.rt.resp_queue.len() >= MAX_RESP_QUEUE {
                self.responder_error(ctx, psn, NakCode::InvalidRequest);
                return;
            }
            let n = (reth.len as u64).div_ceil(mtu as u64).max(1) as u32;
            self.rt.msn = psn_add(self.rt.msn, 1);
            self.rt.resp_queue.push_back(RespJob::Read { psn, va: reth.va, rkey: reth.rkey, remaining: reth.len as u64, first: true });
            self.rt.epsn = psn_add(psn, n);
            self.rt.nak_sent = false;
            return;
        } else if op.is_atomic() {
            let Some(a) = p.atomic else { return };
            if a.va % 8 != 0 {
                self.responder_error(ctx, psn, NakCode::InvalidRequest);
                return;
            }
            let Some(mr) = self.check_rkey(ctx, a.rkey, a.va, 8, access::REMOTE_ATOMIC) else {
                self.responder_error(ctx, psn, NakCode::RemoteAccessError);
                return;
            };
            let ptr = mr.translate(self.pd, a.va, 8, access::REMOTE_ATOMIC).unwrap_or(std::ptr::null_mut());
            if ptr.is_null() || self.rt.resp_queue.len() >= MAX_RESP_QUEUE {
                self.responder_error(ctx, psn, NakCode::RemoteOpError);
                return;
            }
            // SAFETY: 8-byte aligned (iova and mapping are page aligned alike is
            // not guaranteed, so check the host pointer too) and inside the MR.
            if !(ptr as usize).is_multiple_of(8) {
                self.responder_error(ctx, psn, NakCode::InvalidRequest);
                return;
            }
            let cell = unsafe { AtomicU64::from_ptr(ptr as *mut u64) };
            let orig = if op == Opcode::CompareSwap {
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
            return;
        }
        self.rt.epsn = psn_add(psn, 1);
        self.rt.nak_sent = false;
        if p.bth.ack_req {
            self.queue_ack(psn);
        } else if self.ack_due.is_none() {
            self.ack_due = Some(ctx.now + Duration::from_micros(ACK_DELAY_US));
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
                if reth.len > 0 && self.check_rkey(ctx, reth.rkey, reth.va, reth.len as u64, access::REMOTE_READ).is_none() {
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
                self.rt.resp_queue.push_back(RespJob::Read { psn, va: reth.va, rkey: reth.rkey, remaining: reth.len as u64, first: true });
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

    fn responder_tx(&mut self, ctx: &mut Ctx, budget: &mut usize) {
        let flow = self.flow(ctx.gid);
        let dq = self.attr.dest_qp_num;
        let mtu = self.mtu();
        while *budget > 0 {
            let Some(job) = self.rt.resp_queue.front_mut() else { break };
            match *job {
                RespJob::Ack { psn, syndrome } => {
                    let mut h = Headers::new(Opcode::Ack, dq, psn);
                    h.aeth = Some(Aeth { syndrome: Syndrome::from_u8(syndrome), msn: self.rt.msn });
                    let _ = ctx.tx.emit(&flow, &h, 0, |_| Ok::<(), ()>(()));
                    self.rt.resp_queue.pop_front();
                }
                RespJob::AtomicAck { psn, orig } => {
                    let mut h = Headers::new(Opcode::AtomicAck, dq, psn);
                    h.aeth = Some(Aeth { syndrome: Syndrome::Ack(0x1f), msn: self.rt.msn });
                    h.atomic_ack = Some(orig);
                    let _ = ctx.tx.emit(&flow, &h, 0, |_| Ok::<(), ()>(()));
                    self.rt.resp_queue.pop_front();
                }
                RespJob::Read { psn, va, rkey, remaining, first } => {
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
                    let (mrs, pd) = (ctx.mrs, self.pd);
                    let r = ctx.tx.emit(&flow, &h, n as usize, |out| -> Result<(), ()> {
                        if n == 0 {
                            return Ok(());
                        }
                        // Re-read memory on every (re)transmission; the MR may be gone.
                        let src = mrs.get(&rkey).and_then(|m| m.translate(pd, va, n, access::REMOTE_READ)).ok_or(())?;
                        // SAFETY: translate() checked the range.
                        unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), n as usize) };
                        Ok(())
                    });
                    if r.is_err() {
                        self.rt.resp_queue.clear();
                        self.responder_error(ctx, psn, NakCode::RemoteAccessError);
                        return;
                    }
                    if last {
                        self.rt.resp_queue.pop_front();
                    } else {
                        *job = RespJob::Read { psn: psn_add(psn, 1), va: va + n, rkey, remaining: remaining - n, first: false };
                    }
                }
            }
            *budget -= 1;
        }
    }

    /// Flushes completions if the QP is in ERR; called after ring doorbells.
    pub fn doorbell(&mut self, ctx: &mut Ctx) {
        self.pull_sq(ctx);
        self.pull_rq(ctx);
    }

    /// Tells the client whether rnicd polls this QP's rings (no doorbell needed).
    pub fn set_rings_polled(&self, on: bool) {
        self.sq_ring.set_polled(on);
        self.rq_ring.set_polled(on);
    }

    /// Reads the rings as a doorbell would; true if it took any WQE.
    pub fn poll_rings(&mut self, ctx: &mut Ctx) -> bool {
        let before = self.sq_ring.ready() + self.rq_ring.ready();
        if before == 0 {
            return false;
        }
        self.doorbell(ctx);
        self.sq_ring.ready() + self.rq_ring.ready() < before
    }

    pub fn outstanding_sends(&self) -> usize {
        self.sq.len()
    }
}
