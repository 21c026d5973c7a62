//! Verbs objects inside rnicd: memory regions, completion queues, stats, and
//! the outgoing packet batch.

use std::net::Ipv4Addr;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use serde::Serialize;

use crate::eventfd;
use crate::mem::{Mapping, RegionMemory, Span};
use crate::ring::{Cqe, Ring, CQ_ERR_OVERFLOW, NOTIFY_NEXT, NOTIFY_NONE, NOTIFY_SOLICITED};
use crate::types::access;
use crate::wire::{self, Flow, Headers, MAX_HDR_LEN};

/// Largest packet we build: headers + largest MTU + pad + ICRC.
pub const MAX_PKT: usize = MAX_HDR_LEN + crate::types::Mtu::MAX_BYTES + 8;

pub type ClientId = u64;

pub struct Mr {
    pub owner: ClientId,
    pub pd: u32,
    pub key: u32,
    pub iova: u64,
    pub len: u64,
    pub access: u32,
    /// Its runs of the memfd, `len` bytes in all.
    pub mem: RegionMemory,
    /// Set by SEND with invalidate; the rkey stops working.
    pub invalidated: AtomicBool,
    /// Write trace (pre-copy dirty tracking), off unless the owner starts it.
    pub trace: crate::trace::TraceSlot,
}

impl Mr {
    /// Host memory of [va, va+len) if inside the region with `need` access:
    /// one piece, or one per run of a scattered region it crosses.
    pub fn translate(&self, pd: u32, va: u64, len: u64, need: u32) -> Option<Span> {
        if self.pd != pd || self.access & need != need || self.invalidated.load(Ordering::Relaxed) {
            return None;
        }
        let off = va.checked_sub(self.iova)?;
        if off.checked_add(len)? > self.len {
            return None;
        }
        // Every write into the MR passes here: the trace cannot miss one
        // (a range only validated, never written, is merely over-reported).
        if need & (access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_ATOMIC) != 0 {
            self.trace.mark(off, len);
        }
        Some(self.mem.span(off, len))
    }
}

/// Tables keyed by QPN / key / ID, looked up for every packet: a fast hash.
pub type IdMap<V> = rustc_hash::FxHashMap<u32, V>;

/// Takes the entries `f` picks out of `map` (`HashMap::extract_if`, which
/// needs a newer Rust than this crate's minimum).
pub fn take_where<V>(map: &mut IdMap<V>, mut f: impl FnMut(&V) -> bool) -> Vec<V> {
    let ids: Vec<u32> = map.iter().filter(|(_, v)| f(v)).map(|(k, _)| *k).collect();
    ids.iter().filter_map(|k| map.remove(k)).collect()
}

pub struct Cq {
    pub owner: ClientId,
    pub ring: Ring<Cqe>,
    pub _map: Mapping,
    pub channel: Option<Arc<OwnedFd>>,
}

impl Cq {
    pub fn push(&mut self, cqe: &Cqe, solicited: bool, stats: &mut Stats) {
        // The data this completion announces is in memory before it is.
        crate::mem::fence_streamed();
        if !self.ring.push(cqe) {
            stats.cq_overflows += 1;
            self.ring.header().error.fetch_or(CQ_ERR_OVERFLOW, Ordering::Release);
        }
        let h = self.ring.header();
        // Pairs with the fence in the client's arm (store flag, then poll).
        std::sync::atomic::fence(Ordering::SeqCst);
        let n = h.notify.load(Ordering::Acquire);
        let fire = n == NOTIFY_NEXT || (n == NOTIFY_SOLICITED && (solicited || cqe.status != 0));
        if fire && h.notify.compare_exchange(n, NOTIFY_NONE, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
            if let Some(ch) = &self.channel {
                eventfd::signal(&**ch);
                stats.cq_events += 1;
            }
        }
    }
}

/// Counters of everything rnicd drops or retries; exported over the control socket.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Stats {
    pub rx_packets: u64,
    pub tx_packets: u64,
    pub rx_bad_icrc: u64,
    pub rx_malformed: u64,
    pub rx_unknown_qp: u64,
    pub rx_wrong_state: u64,
    pub rx_resp_out_of_window: u64,
    pub rx_bad_response: u64,
    pub dup_requests: u64,
    pub seq_naks_sent: u64,
    /// Requests kept because they arrived ahead of a lost one.
    pub held_out_of_order: u64,
    /// UC messages dropped by the responder (a PSN gap, a refused packet).
    pub uc_dropped_msgs: u64,
    /// UC packets dropped because their message had been.
    pub uc_dropped_pkts: u64,
    pub rnr_naks_sent: u64,
    pub rnr_naks_received: u64,
    pub error_naks_sent: u64,
    pub retransmit_rewinds: u64,
    /// Go-back-N rewinds by the loss probe (a few RTTs without progress).
    pub loss_probes: u64,
    pub timeouts: u64,
    /// Congestion windows halved on loss (a sequence NAK, a loss probe, a
    /// timeout or a send the local qdisc refused), once per window.
    pub window_cuts: u64,
    /// Sends the local qdisc refused (ENOBUFS: its queue was full); the
    /// packets were kept and sent again, not lost.
    pub local_drops: u64,
    pub cq_overflows: u64,
    /// Completion channel events raised (each may wake a sleeping client).
    pub cq_events: u64,
    pub bad_client_requests: u64,
    /// Requests refused because rnicd was short of descriptors, or their
    /// client held its most completion channels (`daemon::descriptors`).
    pub descriptor_refusals: u64,
    /// Control requests served (each one round trip; a spilled one too).
    pub control_requests: u64,
    pub bad_wqes: u64,
    pub send_errors: u64,
    pub clients_connected: u64,
    pub clients_gone: u64,
    /// QPs whose rings held new WQEs when rnicd woke on a timer (no
    /// doorbell, no packet): a doorbell the client skipped but should have
    /// rung. Expected to stay 0 (a diagnostic of ring polling).
    pub late_ring_wqes: u64,
    /// Doorbells rung, and the QPs whose rings they made rnicd look at:
    /// with a doorbell page those whose bits were set, without one every
    /// QP of the client (`crate::doorbell`).
    pub doorbells: u64,
    pub doorbell_qp_looks: u64,
    /// The clients' eventfd writes those doorbells drained: more than
    /// `doorbells` when a client wrote again before rnicd woke.
    pub doorbell_writes: u64,
    /// Transmit rounds that sent only ACKs and NAKs: the first after a
    /// resume, so that the resume NAKs wait for no QP's data.
    pub ack_only_rounds: u64,
    /// Indirect keys bound or invalidated by work requests, and such
    /// requests refused (bad key, owner, range or list length).
    pub key_binds: u64,
    pub key_bind_errors: u64,
    /// Packets that reached a suspended QP (requests get an RNR NAK).
    pub rx_while_suspended: u64,
    /// UD (qp::ud): datagrams sent and delivered; received ones dropped
    /// for a wrong Q_Key, for want of a posted receive, or because the QP
    /// or its opcode does not take them; sends refused as larger than the
    /// port MTU (IBV_WC_LOC_LEN_ERR).
    pub ud_sent: u64,
    pub ud_delivered: u64,
    pub ud_qkey_drops: u64,
    pub ud_no_recv_drops: u64,
    pub ud_other_drops: u64,
    pub ud_oversize_sends: u64,
    /// ACK, NAK and RNR NAK packets the responders sent, and those the
    /// requesters received (their ratio to `rx_packets`/`tx_packets`
    /// shows ACK coalescing).
    pub ack_packets_sent: u64,
    pub ack_packets_received: u64,
    /// How long packets lay in the UDP socket before rnicd read them (from
    /// the kernel's receive timestamp): the longest wait, the packets that
    /// waited over 10 ms. A NIC's receive queue, where a packet can
    /// wait behind the bulk of other QPs however fast each is handled.
    pub rx_socket_wait_max_us: u64,
    pub rx_socket_waits_over_10ms: u64,
    /// The waits of all packets read, summed (µs): over `rx_packets`, the
    /// mean wait.
    pub rx_socket_wait_us_total: u64,
    /// Receive batches ended early because a control request (or a new
    /// client, or a doorbell) was waiting (`daemon::ControlWatch`).
    pub rx_passes_cut_for_control: u64,
    /// How long control requests lay in their sockets before rnicd read
    /// them (from the kernel's receive timestamp): the longest, the sum
    /// (over `control_requests`, the mean), and those over 1 ms (each
    /// logged at info with its name).
    pub control_wait_max_us: u64,
    pub control_wait_us_total: u64,
    pub control_waits_over_1ms: u64,
}

pub struct OutPkt {
    pub buf: Vec<u8>,
    /// Bytes on the wire (UDP payload), whether or not all are in `buf`.
    pub len: usize,
    pub dst: Ipv4Addr,
    pub sport: u16,
    /// A payload that leaves from where it lies (see `InPlace`); then
    /// `buf` holds the headers, then pad and ICRC.
    pub in_place: Option<InPlace>,
}

/// A payload sent from its memory region as an iovec of its own instead of
/// being copied into the packet buffer: the first transmission of a WRITE.
/// The ICRC covers the bytes as they were when the packet was built; if
/// the owner changes them before the kernel copies them (a guest rewriting
/// a page under migration), the packet arrives with a bad ICRC, is dropped
/// and resent, and resends are copied (`Tx::emit`), so each such race
/// costs one resend at most. Verbs leave memory changed under an
/// outstanding WR undefined; here it still arrives as it was at the resend.
pub struct InPlace {
    /// Keeps the region's memory mapped while the packet waits (a packet
    /// the qdisc refused is held and sent later).
    _mr: Arc<Mr>,
    ptr: *const u8,
    payload: usize,
    /// Headers are `buf[..hdr_len]`; pad and ICRC follow them in `buf`.
    hdr_len: usize,
}

// SAFETY: the pointer is into memory `_mr` keeps mapped, read only by the
// thread that owns the packet.
unsafe impl Send for InPlace {}

impl OutPkt {
    /// The packet's first bytes (its headers, at least the BTH).
    pub fn head(&self) -> &[u8] {
        &self.buf[..self.in_place.as_ref().map_or(self.len, |z| z.hdr_len)]
    }

    /// The 4 ICRC bytes, wherever they are.
    pub fn icrc_mut(&mut self) -> &mut [u8] {
        let end = match &self.in_place {
            Some(z) => self.len - z.payload,
            None => self.len,
        };
        &mut self.buf[end - 4..end]
    }

    /// The iovecs that send the packet: one, or three for a payload in place.
    pub fn push_iovecs(&self, out: &mut Vec<libc::iovec>) {
        let iov = |p: *const u8, n: usize| libc::iovec { iov_base: p as *mut libc::c_void, iov_len: n };
        match &self.in_place {
            None => out.push(iov(self.buf.as_ptr(), self.len)),
            Some(z) => {
                let tail = self.len - z.payload - z.hdr_len;
                out.push(iov(self.buf.as_ptr(), z.hdr_len));
                out.push(iov(z.ptr, z.payload));
                // SAFETY: hdr_len + tail <= buf.len().
                out.push(iov(unsafe { self.buf.as_ptr().add(z.hdr_len) }, tail));
            }
        }
    }

    /// Copies a payload in place into the buffer, so that the whole packet
    /// is `buf[..len]` (its ICRC as it was: the caller reseals it).
    pub fn gather_in_place(&mut self) {
        let Some(z) = self.in_place.take() else { return };
        let tail = self.len - z.payload - z.hdr_len;
        self.buf.resize(MAX_PKT, 0);
        self.buf.copy_within(z.hdr_len..z.hdr_len + tail, z.hdr_len + z.payload);
        // SAFETY: `_mr` keeps `payload` bytes at ptr mapped; buf has room (MAX_PKT).
        unsafe { std::ptr::copy_nonoverlapping(z.ptr, self.buf[z.hdr_len..].as_mut_ptr(), z.payload) };
    }
}

/// Outgoing packets of one loop iteration, with a buffer pool so the hot
/// path does not allocate.
#[derive(Default)]
pub struct Tx {
    pub pkts: Vec<OutPkt>,
    /// (peer, peer's QPN) of QPs that went back N since the daemon last
    /// looked: copies of their requests it still holds are now duplicates.
    pub rewound: Vec<(Ipv4Addr, u32)>,
    /// Whether first transmissions of WRITE payloads may leave in place
    /// (`InPlace`); rnicd turns it on (RNICD_IN_PLACE_TX=0 keeps it off).
    pub in_place: bool,
    pool: Vec<Vec<u8>>,
    /// Buffers of packets whose payload is in place: headers, pad and
    /// ICRC only. Small, so that a batch's headers stay in the cache
    /// (headers written into full-size buffers, 256 of them 8 MiB apart
    /// in all, missed it at every packet).
    head_pool: Vec<Vec<u8>>,
}

/// Size of a buffer for headers, pad and ICRC.
const HEAD_BUF: usize = MAX_HDR_LEN + 8;

/// Smallest payload sent in place: below it, copying costs less than the
/// kernel's two extra iovecs.
pub const IN_PLACE_MIN: usize = 1024;

impl Tx {
    /// Builds a packet: headers, then `fill` writes `payload_len` bytes (it may
    /// fail, and then nothing is sent), then pad and ICRC.
    pub fn emit<E>(
        &mut self,
        flow: &Flow,
        h: &Headers,
        payload_len: usize,
        fill: impl FnOnce(&mut [u8]) -> Result<(), E>,
    ) -> Result<(), E> {
        let mut buf = self.pool.pop().unwrap_or_else(|| vec![0u8; MAX_PKT]);
        let n = h.write(payload_len, &mut buf);
        if let Err(e) = fill(&mut buf[n..n + payload_len]) {
            self.pool.push(buf);
            return Err(e);
        }
        let len = wire::finish(flow, &mut buf, n + payload_len, payload_len);
        self.pkts.push(OutPkt { buf, len, dst: flow.dst, sport: flow.sport, in_place: None });
        Ok(())
    }

    /// Builds a packet whose payload, `payload` bytes at `ptr` inside `mr`
    /// (resolved by the caller in this packet's handling), is sent from
    /// there; its ICRC covers those bytes as they are now.
    ///
    /// # Safety
    /// `ptr..ptr + payload` must lie inside `mr`'s memory.
    pub unsafe fn emit_in_place(&mut self, flow: &Flow, h: &Headers, mr: Arc<Mr>, ptr: *const u8, payload: usize) {
        let mut buf = self.head_pool.pop().unwrap_or_else(|| vec![0u8; HEAD_BUF]);
        let hdr_len = h.write(payload, &mut buf);
        // SAFETY: the range is inside `mr` (the caller's promise), which
        // keeps it mapped. The owner may be
        // writing it meanwhile (see InPlace): the CRC then reads some mix,
        // which the receiver's check rejects.
        let data = unsafe { std::slice::from_raw_parts(ptr, payload) };
        let tail = wire::finish_apart(flow, &mut buf, hdr_len, data);
        let len = hdr_len + payload + tail;
        self.pkts.push(OutPkt { buf, len, dst: flow.dst, sport: flow.sport, in_place: Some(InPlace { _mr: mr, ptr, payload, hdr_len }) });
    }

    pub fn recycle(&mut self, p: OutPkt) {
        let pool = if p.buf.len() == HEAD_BUF { &mut self.head_pool } else { &mut self.pool };
        if pool.len() < 512 {
            pool.push(p.buf);
        }
    }
}
