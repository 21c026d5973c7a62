//! One RDMA namespace of rnicd: the objects that live behind one GID, the
//! control requests that create them, and packet dispatch by destination QPN.
//!
//! The engine is pure logic: packets in, packets out (`tx`), no sockets, so
//! it runs the same inside the daemon and in a single-process loopback test.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::os::fd::OwnedFd;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, bail, Context as _};

use crate::async_events::AsyncSinks;
use crate::doorbell::{self, DoorbellPage};
use crate::keys::{AliasTarget, Export, Grant, IndirectKey, IndirectKind, Keys, MAX_INDIRECT, MAX_KLM};
use crate::mem::{Mapping, RegionMemory};
use crate::objects::{take_where, ClientId, Cq, IdMap, Mr, Stats, Tx};
use crate::proto::{self, Reply, Request};
use crate::qp::{Ctx, Qp, QpSnapshot, MAX_MSG};
use crate::ring::{ring_bytes, Cqe, RecvWqe, Ring, SendWqe, MAX_INLINE, MAX_SGE};
use crate::types::{access, DeviceAttr, Mtu, PortAttr, QpAttr, QpCap, QpState, QpType};
use crate::wire::{self, Flow, ROCE_PORT};

mod batch;
mod dump;
mod srq;

pub const MAX_QP: u32 = 1 << 16;
pub const MAX_WR: u32 = 1 << 14;
pub const MAX_CQE: u32 = 1 << 20;

pub struct Engine {
    pub gid: Ipv4Addr,
    pub stats: Stats,
    pub tx: Tx,
    pds: IdMap<ClientId>,
    keys: Keys,
    cqs: IdMap<Cq>,
    qps: IdMap<Qp>,
    srqs: IdMap<crate::srq::SharedSrq>,
    channels: IdMap<(ClientId, Arc<OwnedFd>)>,
    next_id: u32,
    next_key: u32,
    /// Round-robin start for transmit fairness.
    rr: usize,
    /// The QPs in transmit order. A destroyed QP's entry stays until the
    /// next compaction (`qpn_order_stale` counts them; transmit skips them):
    /// removing each at once made destroying n QPs cost n^2.
    qpn_order: Vec<u32>,
    qpn_order_stale: usize,
    asyncs: AsyncSinks,
    /// The port's active MTU: the path MTU the link under the GID carries
    /// whole, set by the daemon from the interface (`crate::link`) with
    /// `set_active_mtu`.
    pub active_mtu: Mtu,
    /// Flows of QPs made or loaded to resume later, for the daemon to
    /// prepare (`FlowAhead`); it takes them after each control request.
    pub ahead: Vec<FlowAhead>,
    /// Each client's QPs by doorbell slot (`doorbell::slot`): the QPs a
    /// bit of its doorbell page names.
    doorbell_slots: HashMap<(ClientId, u16), Vec<u32>>,
    /// QPs resumed since the last transmit round: the next round sends the
    /// queued ACKs and NAKs (their resume NAKs among them) alone, before
    /// any QP reads guest memory for the data it resends.
    acks_alone: bool,
    /// QPs that received requests without an ACK in this receive pass
    /// (`end_of_receive_pass`).
    acks_delayed: Vec<u32>,
}

/// A flow a QP made suspended (awaiting its state, or from one) will send
/// on once it resumes: its source port, and its peer when known. The
/// daemon opens the port's send socket and warms the host's neighbour
/// entry for the peer when the QP is made, so that at a migration's switch
/// the resumed QPs' first packets (one sequence NAK each, 256 at once at
/// 256 QPs) leave without a socket made and bound per QP on the way, and
/// without an ARP round trip first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlowAhead {
    pub sport: u16,
    pub peer: Option<Ipv4Addr>,
}

/// The objects of a client that went away, out of every table: dropping
/// them unmaps their rings and memory regions, at 256 QPs 11-34 ms that
/// the event loop, which serves every other client, must not spend
/// (`daemon`, `release_off_loop`).
#[must_use = "dropped here, its unmapping stalls the caller"]
pub struct Leftovers {
    _qps: Vec<Qp>,
    _cqs: Vec<Cq>,
    _mrs: Vec<Arc<Mr>>,
    _srqs: Vec<crate::srq::SharedSrq>,
}

impl Engine {
    pub fn new(gid: Ipv4Addr) -> Engine {
        Engine {
            gid,
            stats: Stats::default(),
            tx: Tx::default(),
            pds: IdMap::default(),
            keys: Keys::default(),
            cqs: IdMap::default(),
            qps: IdMap::default(),
            srqs: IdMap::default(),
            channels: IdMap::default(),
            next_id: 1,
            // Keys and QPNs start at a per-process pseudo-random point so
            // that stale peers of a restarted rnicd are unlikely to match.
            next_key: (std::process::id().wrapping_mul(2654435761) & 0xffff) << 8 | 0x11,
            rr: 0,
            qpn_order: Vec::new(),
            qpn_order_stale: 0,
            asyncs: AsyncSinks::default(),
            active_mtu: crate::link::UNKNOWN_LINK_PATH_MTU,
            ahead: Vec::new(),
            doorbell_slots: HashMap::new(),
            acks_alone: false,
            acks_delayed: Vec::new(),
        }
    }

    /// Sets the port's active MTU (the link under the GID changed, e.g. by
    /// a claim) and the message limit of every UD QP, which follows it.
    pub fn set_active_mtu(&mut self, mtu: Mtu) {
        self.active_mtu = mtu;
        for qp in self.qps.values_mut() {
            qp.ud_set_port_mtu(mtu);
        }
    }

    /// A handle for a PD, CQ, SRQ or channel that none of them holds.
    fn alloc_id(&mut self) -> u32 {
        let (pds, cqs, srqs, channels) = (&self.pds, &self.cqs, &self.srqs, &self.channels);
        next_free_id(&mut self.next_id, |id| {
            pds.contains_key(&id) || cqs.contains_key(&id) || srqs.contains_key(&id) || channels.contains_key(&id)
        })
    }

    fn alloc_qpn(&mut self) -> u32 {
        loop {
            self.next_key = self.next_key.wrapping_add(1) & wire::QPN_MASK;
            let q = self.next_key;
            if q > 1 && !self.qps.contains_key(&q) && !self.keys.contains(q) {
                return q;
            }
        }
    }

    fn ctx<'a>(
        gid: Ipv4Addr,
        keys: &'a mut Keys,
        cqs: &'a mut IdMap<Cq>,
        tx: &'a mut Tx,
        stats: &'a mut Stats,
        asyncs: &'a mut AsyncSinks,
    ) -> Ctx<'a> {
        {
            let now = Instant::now();
            Ctx { gid, keys, cqs, tx, stats, now, arrived: now, asyncs }
        }
    }

    pub fn device_attr(&self) -> DeviceAttr {
        DeviceAttr {
            fw_ver: env!("CARGO_PKG_VERSION").into(),
            node_guid: u64::from(u32::from(self.gid)) << 16 | 0x0200,
            vendor_id: 0x5452,
            vendor_part_id: 0x7272,
            max_mr_size: 1 << 40,
            max_qp: MAX_QP,
            max_qp_wr: MAX_WR,
            max_sge: MAX_SGE as u32,
            max_cq: 1 << 16,
            max_cqe: MAX_CQE,
            max_mr: 1 << 20,
            max_pd: 1 << 16,
            max_qp_rd_atom: 128,
            max_qp_init_rd_atom: 128,
            max_inline_data: MAX_INLINE as u32,
            atomic_cap: "ATOMIC_HCA".into(),
            max_msg_sz: MAX_MSG,
        }
    }

    /// Executes one control request of `client`: each verb has its handler,
    /// grouped below as device, memory, completion, QP and QP migration.
    pub fn control(&mut self, client: ClientId, req: Request, fds: Vec<OwnedFd>) -> anyhow::Result<Reply> {
        match req {
            Request::Hello { .. }
            | Request::ClaimGid
            | Request::ReleaseGid
            | Request::ClaimGidAndResumeQps { .. }
            | Request::JoinRamClient
            | Request::Spilled { .. }
            | Request::DumpQps => {
                bail!("handled by the daemon")
            }
            Request::QueryDevice => Ok(Reply::Device(self.device_attr())),
            Request::QueryPort { port } => self.query_port(port),
            Request::QueryGid { port, index } => self.query_gid(port, index),
            Request::Stats => Ok(Reply::Stats(serde_json::to_value(&self.stats)?)),
            Request::AllocPd => Ok(self.alloc_pd(client)),
            Request::DeallocPd { pd } => self.dealloc_pd(client, pd),
            Request::RegMr { pd, iova, len, access, fd_offset, key } => {
                let fd = fds.first().context("RegMr needs a memfd")?;
                self.reg_mr(client, MrRequest { pd, iova, len, access, runs: vec![(fd_offset, len)], key }, fd)
            }
            Request::RegMrRuns { pd, iova, access, runs, key } => {
                let fd = fds.first().context("RegMrRuns needs a memfd")?;
                self.reg_mr(client, MrRequest::over_runs(pd, iova, access, runs, key)?, fd)
            }
            Request::DeregMr { lkey } => self.dereg_mr(client, lkey),
            Request::TraceMr { lkey, granularity } => self.trace_mr(client, lkey, granularity),
            Request::FetchTrace { lkey } => self.fetch_trace(client, lkey),
            Request::CreateIndirectKey { pd, max_entries, key } => self.create_indirect_key(client, pd, max_entries, key),
            Request::DestroyKey { key } => self.destroy_key(client, key),
            Request::GrantKey { key, grantee } => self.grant_key(client, key, grantee, true),
            Request::RevokeKey { key, grantee } => self.grant_key(client, key, grantee, false),
            Request::CreateAlias { pd, owner, key, alias, owner_namespace } => match owner_namespace {
                // The daemon serves these: they need two namespaces' tables.
                Some(ns) if ns != self.gid => bail!("no namespace {ns} in this rnicd"),
                _ => self.create_alias(client, pd, owner, key, alias),
            },
            Request::QueryAlias { key } => {
                if self.keys.indirect.get(&key).is_none_or(|k| k.owner != client) {
                    bail!("no alias {key:#x}");
                }
                Ok(Reply::AliasState { live: self.keys.alias_live(key) })
            }
            Request::CreateCompChannel => self.create_comp_channel(client, fds),
            Request::DestroyCompChannel { channel } => self.destroy_comp_channel(client, channel),
            Request::CreateCq { cap, channel } => {
                let fd = fds.first().context("CQ needs a ring memfd")?;
                self.create_cq(client, cap, channel, (fd, 0))
            }
            Request::DestroyCq { cq } => self.destroy_cq(client, cq),
            Request::ResizeCq { cq, cap } => self.resize_cq(client, cq, cap, fds),
            Request::SettleCq { cq } => self.settle_cq(client, cq),
            Request::CreateQp { pd, send_cq, recv_cq, cap, sq_sig_all, sq_slots, rq_slots, qpn, restore, qp_type } => {
                let q =
                    QpRequest { pd, send_cq, recv_cq, cap, sq_sig_all, sq_slots, rq_slots, qpn, qp_type, await_state: false, peer: None };
                let [sq, rq] = &fds[..] else { bail!("CreateQp needs the SQ and RQ ring memfds") };
                self.create_qp(client, q, restore, (sq, 0), (rq, 0))
            }
            Request::CreateBatch { items } => self.create_batch(client, items, &fds),
            Request::FetchTraces { lkeys } => self.fetch_traces(client, &lkeys),
            Request::ModifyQp { qpn, attr, mask } => self.modify_qp(client, qpn, &attr, mask),
            Request::QueryQp { qpn } => {
                let qp = self.owned_qp(client, qpn)?;
                Ok(Reply::QpInfo { attr: qp.attr, cap: qp.cap })
            }
            Request::DestroyQp { qpn } => self.destroy_qp(client, qpn),
            Request::SuspendQp { qpn } => self.suspend_qps(client, &[qpn], 1),
            Request::SuspendQps { qpns } => self.suspend_qps(client, &qpns, proto::MAX_BATCH),
            Request::SuspendConnected { qpns } => Ok(Reply::Qpns(self.suspend_connected(client, &qpns)?)),
            Request::SuspendConnectedStates { qpns } => {
                let done = self.suspend_connected(client, &qpns)?;
                Ok(Reply::QpStates(self.qp_states(client, &done)?))
            }
            Request::SuspendAndFetchTraces { qpns, lkeys } => self.suspend_and_fetch_traces(client, &qpns, &lkeys),
            Request::QueryQpState { qpn } => {
                let s = self.owned_qp(client, qpn)?.snapshot().map_err(|e| anyhow!(e))?;
                Ok(Reply::QpState(Box::new(s)))
            }
            Request::QueryQpStates { qpns } => Ok(Reply::QpStates(self.qp_states(client, &qpns)?)),
            Request::ResumeQp { qpn } => self.resume_qps(client, &[qpn], 1),
            Request::ResumeQps { qpns } => self.resume_qps(client, &qpns, proto::MAX_BATCH),
            Request::RestoreQps { states } => self.give_qp_states(client, &states, StateTaker::Reset),
            Request::LoadQpStates { states } => self.give_qp_states(client, &states, StateTaker::Awaiting),
            Request::OpenAsync => {
                let fd = fds.into_iter().next().context("OpenAsync needs an eventfd")?;
                self.asyncs.open(client, fd);
                Ok(Reply::Ok)
            }
            Request::FetchAsync => Ok(Reply::AsyncEvents(self.asyncs.fetch(client))),
            Request::CreateSrq { pd, attr, slots, restore } => self.create_srq(client, pd, attr, slots, restore, &fds),
            Request::ModifySrq { srq, max_wr, srq_limit } => self.modify_srq(client, srq, max_wr, srq_limit),
            Request::QuerySrq { srq } => self.query_srq(client, srq),
            Request::DestroySrq { srq } => self.destroy_srq(client, srq),
            Request::AttachSrq { qpn, srq } => self.attach_srq(client, qpn, srq),
            Request::QuerySrqState { srq } => self.query_srq_state(client, srq),
        }
    }

    /// A caller-chosen QPN must be a valid, free QPN of this namespace
    /// (0 and 1 are the special QPs of IB).
    fn check_free_qpn(&self, q: u32) -> anyhow::Result<()> {
        if !(2..=wire::QPN_MASK).contains(&q) {
            bail!("QPN {q:#x} is outside 0x2..={:#x}", wire::QPN_MASK);
        }
        if self.qps.contains_key(&q) {
            bail!("QPN {q:#x} is already in use in namespace {}", self.gid);
        }
        Ok(())
    }

    /// Whether no client object is left (the namespace may go).
    pub fn is_empty(&self) -> bool {
        self.qps.is_empty()
            && self.srqs.is_empty()
            && self.keys.direct.is_empty()
            && self.keys.indirect.is_empty()
            && self.cqs.is_empty()
            && self.pds.is_empty()
    }

    /// A batch names at most `max` QPs, all the client's own.
    fn check_batch(&self, client: ClientId, qpns: &[u32], max: usize) -> anyhow::Result<()> {
        if qpns.len() > max {
            bail!("at most {max} QPs per request");
        }
        for q in qpns {
            if self.qps.get(q).is_none_or(|x| x.owner != client) {
                bail!("no QP {q:#x}");
            }
        }
        Ok(())
    }

    fn owned_qp(&mut self, client: ClientId, qpn: u32) -> anyhow::Result<&mut Qp> {
        self.qps.get_mut(&qpn).filter(|q| q.owner == client).ok_or_else(|| anyhow!("no QP {qpn:#x}"))
    }

    fn owned_pd(&self, client: ClientId, pd: u32) -> anyhow::Result<()> {
        match self.pds.get(&pd) {
            Some(c) if *c == client => Ok(()),
            _ => bail!("no PD {pd}"),
        }
    }

    fn owned_cq(&self, client: ClientId, cq: u32) -> anyhow::Result<()> {
        match self.cqs.get(&cq) {
            Some(c) if c.owner == client => Ok(()),
            _ => bail!("no CQ {cq}"),
        }
    }

    /// A client went away: everything it owned leaves the namespace now
    /// (its IDs are free at once), nothing else. What those objects hold
    /// (rings, memory mappings) comes back to be released where
    /// its unmapping stalls no one (`Leftovers`).
    pub fn client_gone(&mut self, client: ClientId) -> Leftovers {
        let qps = take_where(&mut self.qps, |q| q.owner == client);
        self.doorbell_slots.retain(|(c, _), _| *c != client);
        self.compact_qpn_order();
        let mrs = self.keys.client_gone(client);
        let srqs = take_where(&mut self.srqs, |s| crate::srq::lock(s).owner == client);
        let cqs = take_where(&mut self.cqs, |c| c.owner == client);
        self.pds.retain(|_, c| *c != client);
        self.channels.retain(|_, (c, _)| *c != client);
        self.asyncs.close(client);
        Leftovers { _qps: qps, _cqs: cqs, _mrs: mrs, _srqs: srqs }
    }

    /// The client rang its doorbell without a doorbell page: look at the
    /// rings of all its QPs.
    pub fn doorbell(&mut self, client: ClientId) {
        let Engine { gid, keys, cqs, tx, stats, asyncs, qps, .. } = self;
        let mut ctx = Self::ctx(*gid, keys, cqs, tx, stats, asyncs);
        ctx.stats.doorbells += 1;
        for qp in qps.values_mut().filter(|q| q.owner == client) {
            ctx.stats.doorbell_qp_looks += 1;
            qp.doorbell(&mut ctx);
        }
    }

    /// The client rang its doorbell: look at the rings of the QPs whose
    /// bits it set in its doorbell page (`crate::doorbell`), only those.
    pub fn doorbell_marked(&mut self, client: ClientId, page: &DoorbellPage) {
        let Engine { gid, keys, cqs, tx, stats, asyncs, qps, doorbell_slots, .. } = self;
        let mut ctx = Self::ctx(*gid, keys, cqs, tx, stats, asyncs);
        ctx.stats.doorbells += 1;
        page.take(|slot| {
            for qpn in doorbell_slots.get(&(client, slot as u16)).map(Vec::as_slice).unwrap_or_default() {
                if let Some(qp) = qps.get_mut(qpn) {
                    ctx.stats.doorbell_qp_looks += 1;
                    qp.doorbell(&mut ctx);
                }
            }
        });
    }

    /// While rnicd polls (after activity), it reads the rings of up to this
    /// many QPs itself each round and their clients skip the doorbell; with
    /// more QPs a round of ring reads would cost more than it saves.
    pub const RING_POLL_MAX_QPS: usize = 64;

    /// Starts or stops polling the QPs' rings; stopping returns, after
    /// one last look at the rings, how many QPs had new WQEs (a client that
    /// saw the flag still set did not ring).
    pub fn set_ring_polling(&mut self, on: bool) -> usize {
        let on = on && self.qps.len() <= Self::RING_POLL_MAX_QPS;
        for qp in self.qps.values() {
            qp.set_rings_polled(on);
        }
        if on {
            return 0;
        }
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        // Every QP: one may have been flagged before the count passed the limit.
        self.poll_all_rings()
    }

    /// Reads every QP's rings as a doorbell would (none past
    /// RING_POLL_MAX_QPS QPs); returns how many QPs had work.
    pub fn poll_rings(&mut self) -> usize {
        if self.qps.len() > Self::RING_POLL_MAX_QPS {
            return 0;
        }
        self.poll_all_rings()
    }

    fn poll_all_rings(&mut self) -> usize {
        let Engine { gid, keys, cqs, tx, stats, asyncs, qps, .. } = self;
        let mut ctx = Self::ctx(*gid, keys, cqs, tx, stats, asyncs);
        qps.values_mut().filter_map(|qp| qp.poll_rings(&mut ctx).then_some(())).count()
    }

    /// One received UDP payload from `src:sport`.
    pub fn on_packet(&mut self, buf: &[u8], src: Ipv4Addr, sport: u16, now: Instant) {
        self.on_packet_at(buf, src, sport, now, now)
    }

    /// [`on_packet`](Self::on_packet) of a packet that reached the kernel
    /// at `arrived` (its receive timestamp), handled at `now`.
    pub fn on_packet_at(&mut self, buf: &[u8], src: Ipv4Addr, sport: u16, now: Instant, arrived: Instant) {
        self.stats.rx_packets += 1;
        let waited = now.saturating_duration_since(arrived).as_micros() as u64;
        if waited > 10_000 {
            self.stats.rx_socket_waits_over_10ms += 1;
        }
        self.stats.rx_socket_wait_max_us = self.stats.rx_socket_wait_max_us.max(waited);
        self.stats.rx_socket_wait_us_total += waited;
        let flow = Flow { src, dst: self.gid, sport, dport: ROCE_PORT };
        let p = match wire::parse(buf, Some(&flow)) {
            Ok(p) => p,
            Err(wire::ParseError::Icrc) => {
                self.stats.rx_bad_icrc += 1;
                return;
            }
            Err(_) => {
                self.stats.rx_malformed += 1;
                return;
            }
        };
        let Engine { gid, keys, cqs, tx, stats, asyncs, qps, .. } = self;
        let Some(qp) = qps.get_mut(&p.bth.dest_qpn) else {
            stats.rx_unknown_qp += 1;
            return;
        };
        if qp.is_ud() || p.bth.opcode.is_ud() {
            let mut ctx = Ctx { gid: *gid, keys, cqs, tx, stats, now, arrived, asyncs };
            qp.ud_on_packet(&mut ctx, &p, src, buf.len());
            return;
        }
        // Only the connected peer may talk to an RC QP.
        if qp.attr.dest_gid != src {
            stats.rx_unknown_qp += 1;
            return;
        }
        let mut ctx = Ctx { gid: *gid, keys, cqs, tx, stats, now, arrived, asyncs };
        // A UC QP takes no responses: its responder drops them.
        if p.bth.opcode.is_response() && !qp.is_uc() {
            qp.on_response(&mut ctx, &p);
        } else {
            qp.on_request(&mut ctx, &p);
            if qp.ack_delayed() && self.acks_delayed.last() != Some(&p.bth.dest_qpn) {
                self.acks_delayed.push(p.bth.dest_qpn);
            }
        }
    }

    /// A receive pass ended: the QPs that received requests without an
    /// ACK decide whether their coalesced ACK goes now (`Qp::end_of_receive_pass`).
    pub fn end_of_receive_pass(&mut self, now: Instant) {
        let mut looks = std::mem::take(&mut self.acks_delayed);
        looks.sort_unstable();
        looks.dedup();
        for qpn in looks.drain(..) {
            if let Some(qp) = self.qps.get_mut(&qpn) {
                qp.end_of_receive_pass(now);
            }
        }
        self.acks_delayed = looks;
    }

    /// Runs timers and emits up to `budget` packets into `self.tx`.
    /// Returns whether more transmit work is pending.
    pub fn poll_tx(&mut self, budget: usize, now: Instant) -> bool {
        let Engine { gid, keys, cqs, tx, stats, asyncs, qps, qpn_order, rr, acks_alone, .. } = self;
        let mut ctx = Ctx { gid: *gid, keys, cqs, tx, stats, now, arrived: now, asyncs };
        let n = qpn_order.len();
        let mut budget = budget;
        // Every QP's queued ACKs and NAKs first: each is one small packet
        // that moves a peer's window or makes it resend, and behind the
        // fair shares below it could wait many rounds while other QPs send
        // bulk data (with 256 QPs, resumed QPs' sequence NAKs and their
        // answers to the peer's resends took hundreds of ms).
        for k in 0..n {
            if budget == 0 {
                break;
            }
            if let Some(qp) = qps.get_mut(&qpn_order[(*rr + k) % n]) {
                qp.transmit_acks(&mut ctx, &mut budget);
            }
        }
        // After a resume the NAKs leave in a round of their own: the data
        // of the round below reads guest memory, which on a postcopy
        // destination may wait for pages on the network (or on the vmm's
        // fault thread), and the peers' resends wait on the NAKs.
        if std::mem::take(acks_alone) && !ctx.tx.pkts.is_empty() {
            ctx.stats.ack_only_rounds += 1;
            return true;
        }
        let mut more = false;
        // The first QP with work that this round's budget did not reach:
        // the next round starts there (deficit round robin), so every busy
        // QP sends within one pass over them. Starting one QP further on
        // instead served the same few QPs round after round while the rest
        // waited (`tests/tx_fairness.rs`).
        let mut unserved = None;
        for k in 0..n {
            let at = (*rr + k) % n;
            let Some(qp) = qps.get_mut(&qpn_order[at]) else { continue };
            qp.on_timer(&mut ctx);
            let served = budget > 0;
            if served {
                // Fair share per QP per round, so one long message cannot starve others.
                let mut share = (budget / (n - k).max(1)).max(8).min(budget);
                let before = share;
                qp.transmit(&mut ctx, &mut share);
                budget -= before - share;
            }
            let work = qp.has_tx_work(now);
            if !served && work && unserved.is_none() {
                unserved = Some(at);
            }
            more |= work;
        }
        if n > 0 {
            *rr = unserved.unwrap_or((*rr + 1) % n);
        }
        more
    }

    /// The local qdisc refused a packet of flow `sport` to `dst` (ENOBUFS:
    /// its queue is full): the windows of the RC QPs of that flow shrink as
    /// on a loss, though the packet is kept and sent again.
    pub fn local_congestion(&mut self, sport: u16, dst: Ipv4Addr) {
        let Engine { gid, keys, cqs, tx, stats, asyncs, qps, .. } = self;
        stats.local_drops += 1;
        let mut ctx = Self::ctx(*gid, keys, cqs, tx, stats, asyncs);
        for qp in qps.values_mut().filter(|q| q.sport == sport && q.attr.dest_gid == dst) {
            qp.on_local_congestion(&mut ctx);
        }
    }

    /// Earliest timer of any QP.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.qps.values().filter_map(|q| q.next_deadline()).min()
    }

    pub fn qp(&self, qpn: u32) -> Option<&Qp> {
        self.qps.get(&qpn)
    }
}

/// The arguments of RegMr.
struct MrRequest {
    pd: u32,
    iova: u64,
    len: u64,
    access: u32,
    /// `(fd_offset, len)` runs of the memfd, `len` bytes in all.
    runs: Vec<(u64, u64)>,
    key: Option<u32>,
}

impl MrRequest {
    /// An MR over `runs` laid end to end (RegMrRuns, a batch's MR).
    fn over_runs(pd: u32, iova: u64, access: u32, runs: Vec<(u64, u64)>, key: Option<u32>) -> anyhow::Result<MrRequest> {
        let len = runs.iter().try_fold(0u64, |n, r| n.checked_add(r.1)).context("MR length overflows")?;
        Ok(MrRequest { pd, iova, len, access, runs, key })
    }
}

/// The arguments of CreateQp (but the state to restore).
struct QpRequest {
    pd: u32,
    send_cq: u32,
    recv_cq: u32,
    cap: QpCap,
    sq_sig_all: bool,
    sq_slots: u32,
    rq_slots: u32,
    qpn: Option<u32>,
    qp_type: QpType,
    /// Made suspended, in RESET, until LoadQpStates gives it a state.
    await_state: bool,
    /// The peer the state will name, if known (`FlowAhead`).
    peer: Option<Ipv4Addr>,
}

/// Device verbs.
impl Engine {
    fn query_port(&self, port: u8) -> anyhow::Result<Reply> {
        if port != 1 {
            bail!("no port {port}");
        }
        Ok(Reply::Port(PortAttr {
            state: "ACTIVE".into(),
            max_mtu: Mtu::M32768,
            active_mtu: self.active_mtu,
            gid_tbl_len: 1,
            link_layer: "Ethernet".into(),
            port_num: 1,
        }))
    }

    fn query_gid(&self, port: u8, index: u32) -> anyhow::Result<Reply> {
        if port != 1 || index != 0 {
            bail!("no GID {port}/{index}");
        }
        Ok(Reply::Gid(self.gid))
    }
}

/// Memory verbs: protection domains, memory regions, write traces.
impl Engine {
    fn alloc_pd(&mut self, client: ClientId) -> Reply {
        let id = self.alloc_id();
        self.pds.insert(id, client);
        Reply::Pd(id)
    }

    fn dealloc_pd(&mut self, client: ClientId, pd: u32) -> anyhow::Result<Reply> {
        self.owned_pd(client, pd)?;
        if self.keys.direct.values().any(|m| m.pd == pd)
            || self.keys.indirect.values().any(|k| k.pd == pd)
            || self.qps.values().any(|q| q.pd == pd)
            || self.pd_has_srq(pd)
        {
            bail!("PD {pd} still has memory regions or QPs");
        }
        self.pds.remove(&pd);
        Ok(Reply::Ok)
    }

    fn reg_mr(&mut self, client: ClientId, r: MrRequest, fd: &OwnedFd) -> anyhow::Result<Reply> {
        self.owned_pd(client, r.pd)?;
        if r.len == 0 || r.len > 1 << 40 || r.access & !(access::ALL | access::MW_BIND) != 0 {
            bail!("bad MR length or access flags");
        }
        if r.iova.checked_add(r.len).is_none() {
            bail!("MR range overflows");
        }
        let writes_remote = r.access & (access::REMOTE_WRITE | access::REMOTE_ATOMIC) != 0;
        if writes_remote && r.access & access::LOCAL_WRITE == 0 {
            bail!("remote write/atomic access needs local write (as in ibv_reg_mr)");
        }
        if let Some(k) = r.key {
            if self.keys.contains(k) {
                bail!("key {k:#x} is already in use in namespace {}", self.gid);
            }
        }
        let mem = RegionMemory::map(fd, r.iova, &r.runs)?;
        let key = match r.key {
            Some(k) => k,
            None => self.alloc_qpn(),
        };
        let mr = Mr {
            owner: client,
            pd: r.pd,
            key,
            iova: r.iova,
            len: r.len,
            access: r.access,
            mem,
            invalidated: AtomicBool::new(false),
            trace: Default::default(),
        };
        self.keys.direct.insert(key, Arc::new(mr));
        Ok(Reply::Mr { lkey: key, rkey: key })
    }

    fn owned_mr(&self, client: ClientId, lkey: u32) -> anyhow::Result<&Arc<Mr>> {
        self.keys.direct.get(&lkey).filter(|m| m.owner == client).ok_or_else(|| anyhow!("no MR {lkey:#x}"))
    }

    fn dereg_mr(&mut self, client: ClientId, lkey: u32) -> anyhow::Result<Reply> {
        self.owned_mr(client, lkey)?;
        self.keys.remove(lkey);
        Ok(Reply::Ok)
    }

    fn trace_mr(&mut self, client: ClientId, lkey: u32, granularity: u64) -> anyhow::Result<Reply> {
        let mr = self.owned_mr(client, lkey)?;
        match granularity {
            0 => mr.trace.stop(),
            g => mr.trace.start(mr.len, g).map_err(|e| anyhow!(e))?,
        }
        Ok(Reply::Ok)
    }

    fn fetch_trace(&mut self, client: ClientId, lkey: u32) -> anyhow::Result<Reply> {
        let mr = self.owned_mr(client, lkey)?;
        Ok(Reply::Trace(mr.trace.fetch_and_clear().map_err(|e| anyhow!(e))?))
    }

    /// The traces of many MRs in one round trip: all keys are checked
    /// first, so a bad one clears no trace.
    fn fetch_traces(&mut self, client: ClientId, lkeys: &[u32]) -> anyhow::Result<Reply> {
        let mrs = self.trace_batch(client, lkeys)?;
        let traces =
            mrs.iter().map(|m| m.trace.fetch_and_clear().map_err(|e| anyhow!("MR {:#x}: {e}", m.key))).collect::<anyhow::Result<_>>()?;
        Ok(Reply::Traces(traces))
    }

    /// The MRs a trace request names: at most MAX_TRACE_BATCH, every one
    /// the client's.
    fn trace_batch(&self, client: ClientId, lkeys: &[u32]) -> anyhow::Result<Vec<Arc<Mr>>> {
        if lkeys.len() > proto::MAX_TRACE_BATCH {
            bail!("at most {} MRs per FetchTraces", proto::MAX_TRACE_BATCH);
        }
        lkeys.iter().map(|k| self.owned_mr(client, *k).cloned()).collect()
    }

    /// A migration source's pause in one round trip: suspend the connected
    /// QPs, take their states, then the MRs' traces. The keys are checked
    /// before anything is suspended (the QPNs are checked by the suspend
    /// itself before any QP is), so a refused request changes nothing.
    fn suspend_and_fetch_traces(&mut self, client: ClientId, qpns: &[u32], lkeys: &[u32]) -> anyhow::Result<Reply> {
        let mrs = self.trace_batch(client, lkeys)?;
        let done = self.suspend_connected(client, qpns)?;
        let states = self.qp_states(client, &done)?;
        // The QPs are suspended now, and the caller must learn their
        // states: an MR without a trace (never started) reports every byte
        // written rather than failing the request, which is what a caller
        // of FetchTraces does with an error.
        let whole = || crate::trace::TraceReport { granularity: 1, all_dirty: true, runs: Vec::new() };
        let traces = mrs.iter().map(|m| m.trace.fetch_and_clear().unwrap_or_else(|_| whole())).collect();
        Ok(Reply::Suspended { states, traces })
    }
}

/// Indirect keys and aliases (crate::keys, docs/mkeys.md); binding and
/// invalidating are work requests (qp), not control calls.
impl Engine {
    /// A caller-chosen key, or a fresh one.
    fn pick_key(&mut self, key: Option<u32>) -> anyhow::Result<u32> {
        if self.keys.indirect.len() >= MAX_INDIRECT {
            bail!("this namespace already holds {MAX_INDIRECT} indirect keys and aliases");
        }
        match key {
            Some(k) if self.keys.contains(k) => bail!("key {k:#x} is already in use in namespace {}", self.gid),
            Some(k) => Ok(k),
            None => Ok(self.alloc_qpn()),
        }
    }

    fn create_indirect_key(&mut self, client: ClientId, pd: u32, max_entries: u32, key: Option<u32>) -> anyhow::Result<Reply> {
        self.owned_pd(client, pd)?;
        if max_entries == 0 || max_entries as usize > MAX_KLM {
            bail!("an indirect key holds 1..={MAX_KLM} ranges, not {max_entries}");
        }
        let key = self.pick_key(key)?;
        let generation = self.keys.new_generation();
        let kind = IndirectKind::Indirect { max_entries: max_entries as usize, binding: None };
        self.keys.indirect.insert(key, IndirectKey { owner: client, pd, generation, kind });
        Ok(Reply::Key(key))
    }

    fn destroy_key(&mut self, client: ClientId, key: u32) -> anyhow::Result<Reply> {
        if self.keys.indirect.get(&key).is_none_or(|k| k.owner != client) {
            bail!("no indirect key or alias {key:#x}");
        }
        self.keys.remove(key);
        Ok(Reply::Ok)
    }

    fn grant_key(&mut self, client: ClientId, key: u32, grantee: ClientId, grant: bool) -> anyhow::Result<Reply> {
        if self.keys.owner(key) != Some(client) {
            bail!("no key {key:#x}");
        }
        if self.keys.indirect.get(&key).is_some_and(|k| matches!(k.kind, IndirectKind::Alias { .. })) {
            bail!("key {key:#x} is an alias; only its owner's key can be granted");
        }
        let g = self.keys.grants.entry(key).or_default();
        if grant {
            if !g.iter().any(|x| x.grantee == grantee) {
                if g.len() >= 1024 {
                    bail!("key {key:#x} already has 1024 grantees");
                }
                g.push(Arc::new(Grant { grantee }));
            }
        } else {
            g.retain(|x| x.grantee != grantee);
        }
        Ok(Reply::Ok)
    }

    fn create_alias(&mut self, client: ClientId, pd: u32, owner: ClientId, key: u32, alias: Option<u32>) -> anyhow::Result<Reply> {
        self.owned_pd(client, pd)?;
        if self.keys.owner(key) != Some(owner) {
            bail!("client {owner} has no key {key:#x}");
        }
        if !self.keys.granted(key, client) {
            bail!("client {owner} did not grant key {key:#x} to this client");
        }
        let target = match (self.keys.direct.get(&key), self.keys.indirect.get(&key)) {
            (Some(mr), _) => AliasTarget::Direct(Arc::downgrade(mr)),
            (None, Some(k)) if matches!(k.kind, IndirectKind::Indirect { binding: Some(_), .. }) => {
                AliasTarget::Indirect { key, generation: k.generation }
            }
            _ => bail!("key {key:#x} is not bound to memory"),
        };
        let extent = self.keys.extent(key).context("key has no memory")?;
        self.insert_alias(client, pd, (owner, key), target, extent, alias)
    }

    /// Enters `alias` (or a key picked for it), in the caller's `pd`, for
    /// `target`, which reaches `(iova, len, access)` now.
    fn insert_alias(
        &mut self,
        client: ClientId,
        pd: u32,
        (owner, key): (ClientId, u32),
        target: AliasTarget,
        (iova, len, access): (u64, u64, u32),
        alias: Option<u32>,
    ) -> anyhow::Result<Reply> {
        let alias = self.pick_key(alias)?;
        let generation = self.keys.new_generation();
        let kind = IndirectKind::Alias { target_key: key, target_owner: owner, target };
        self.keys.indirect.insert(alias, IndirectKey { owner: client, pd, generation, kind });
        Ok(Reply::Alias { key: alias, iova, len, access })
    }

    /// What an alias in another namespace of `owner`'s `key` for client
    /// `grantee` holds (`Keys::export`), with the range it reaches now.
    pub fn export_key(&self, owner: ClientId, key: u32, grantee: ClientId) -> Result<(Export, (u64, u64, u32)), String> {
        self.keys.export(owner, key, grantee)
    }

    /// An alias, in the caller's `pd`, of a key of another namespace
    /// (`export` from that namespace's `export_key`).
    pub fn create_foreign_alias(
        &mut self,
        client: ClientId,
        pd: u32,
        target: (ClientId, u32),
        (export, extent): (Export, (u64, u64, u32)),
        alias: Option<u32>,
    ) -> anyhow::Result<Reply> {
        self.owned_pd(client, pd)?;
        self.insert_alias(client, pd, target, AliasTarget::Foreign(export), extent, alias)
    }
}

/// Completion verbs: completion channels and queues.
impl Engine {
    /// How many completion channels `client` holds.
    pub fn channels_of(&self, client: ClientId) -> usize {
        self.channels.values().filter(|(c, _)| *c == client).count()
    }

    fn create_comp_channel(&mut self, client: ClientId, mut fds: Vec<OwnedFd>) -> anyhow::Result<Reply> {
        let fd = fds.pop().context("channel needs an eventfd")?;
        let id = self.alloc_id();
        self.channels.insert(id, (client, Arc::new(fd)));
        Ok(Reply::Channel(id))
    }

    /// Frees the channel's handle. CQs still using it keep its eventfd
    /// (they hold it) until they go, as the kernel keeps a completion
    /// channel's file open while its CQs live after the program closes the
    /// fd: a context closed with CQs left over (perftest's ib_send_bw client
    /// leaves its receive CQ) is legal, and libibverbs' EBUSY for
    /// ibv_destroy_comp_channel is the library's check (the drop-in's too).
    fn destroy_comp_channel(&mut self, client: ClientId, channel: u32) -> anyhow::Result<Reply> {
        match self.channels.get(&channel) {
            Some((c, _)) if *c == client => {}
            _ => bail!("no channel {channel}"),
        }
        self.channels.remove(&channel);
        Ok(Reply::Ok)
    }

    /// A CQ whose ring lives at `ring.1` of the memfd `ring.0`.
    fn create_cq(&mut self, client: ClientId, cap: u32, channel: Option<u32>, ring: (&OwnedFd, u64)) -> anyhow::Result<Reply> {
        if cap == 0 || cap > MAX_CQE || !cap.is_power_of_two() {
            bail!("CQ size must be a power of two up to {MAX_CQE}");
        }
        let ch = match channel {
            None => None,
            Some(c) => match self.channels.get(&c) {
                Some((o, f)) if *o == client => Some(f.clone()),
                _ => bail!("no channel {c}"),
            },
        };
        let len = ring_bytes::<Cqe>(cap);
        let map = Mapping::map_sealed(ring.0, ring.1, len)?;
        // SAFETY: the mapping is `len` bytes and lives in the Cq beside the ring.
        let ring = unsafe { Ring::new(map.ptr(), len, cap) }.ok_or_else(|| anyhow!("bad CQ ring"))?;
        let id = self.alloc_id();
        self.cqs.insert(id, Cq { owner: client, ring, _map: map, channel: ch });
        Ok(Reply::Cq(id))
    }

    fn resize_cq(&mut self, client: ClientId, cq: u32, cap: u32, mut fds: Vec<OwnedFd>) -> anyhow::Result<Reply> {
        self.owned_cq(client, cq)?;
        let fd = fds.pop().context("ResizeCq needs a ring memfd")?;
        if cap == 0 || cap > MAX_CQE || !cap.is_power_of_two() {
            bail!("CQ size must be a power of two up to {MAX_CQE}");
        }
        let len = ring_bytes::<Cqe>(cap);
        let map = Mapping::map_sealed(&fd, 0, len)?;
        // SAFETY: the mapping is `len` bytes and replaces the old one beside the ring.
        let ring = unsafe { Ring::new(map.ptr(), len, cap) }.ok_or_else(|| anyhow!("bad CQ ring"))?;
        let c = self.cqs.get_mut(&cq).context("CQ vanished")?;
        let notify = c.ring.header().notify.load(std::sync::atomic::Ordering::Acquire);
        ring.header().notify.store(notify, std::sync::atomic::Ordering::Release);
        c.ring = ring;
        c._map = map;
        Ok(Reply::Ok)
    }

    /// Takes what the client's QPs on `cq` have posted (their rings may
    /// not have been read yet: no doorbell while rnicd polls them, or
    /// rnicd busy elsewhere) and completes now what needs no peer: a UD
    /// send completes as it leaves (its packet goes out with the next
    /// transmit round), a QP in ERR flushes. RC work waiting for the peer
    /// completes when the peer answers, as on a hardware NIC.
    fn settle_cq(&mut self, client: ClientId, cq: u32) -> anyhow::Result<Reply> {
        self.owned_cq(client, cq)?;
        let Engine { gid, keys, cqs, tx, stats, asyncs, qps, .. } = self;
        let mut ctx = Self::ctx(*gid, keys, cqs, tx, stats, asyncs);
        for qp in qps.values_mut().filter(|q| q.owner == client && (q.send_cq == cq || q.recv_cq == cq)) {
            qp.doorbell(&mut ctx);
            if qp.is_ud() || qp.is_uc() {
                let mut budget = usize::MAX;
                qp.transmit(&mut ctx, &mut budget);
            }
        }
        Ok(Reply::Ok)
    }

    fn destroy_cq(&mut self, client: ClientId, cq: u32) -> anyhow::Result<Reply> {
        self.owned_cq(client, cq)?;
        if self.qps.values().any(|q| q.send_cq == cq || q.recv_cq == cq) {
            bail!("CQ {cq} is still used by a QP");
        }
        self.cqs.remove(&cq);
        Ok(Reply::Ok)
    }
}

/// QP verbs.
impl Engine {
    fn create_qp(
        &mut self,
        client: ClientId,
        q: QpRequest,
        restore: Option<Box<QpSnapshot>>,
        sq_ring: (&OwnedFd, u64),
        rq_ring: (&OwnedFd, u64),
    ) -> anyhow::Result<Reply> {
        let qpn = q.qpn.or(restore.as_ref().map(|s| s.qpn));
        self.owned_pd(client, q.pd)?;
        self.owned_cq(client, q.send_cq)?;
        self.owned_cq(client, q.recv_cq)?;
        if self.qps.len() as u32 >= MAX_QP {
            bail!("too many QPs");
        }
        if let Some(q) = qpn {
            self.check_free_qpn(q)?;
        }
        if q.qp_type != QpType::Rc && (restore.is_some() || q.await_state) {
            bail!("only an RC QP can be created from a suspended state");
        }
        if q.await_state && restore.is_some() {
            bail!("a QP awaiting its state cannot also be created from one");
        }
        let cap = QpCap {
            max_send_wr: q.cap.max_send_wr.clamp(1, MAX_WR),
            max_recv_wr: q.cap.max_recv_wr.clamp(1, MAX_WR),
            max_send_sge: q.cap.max_send_sge.clamp(1, MAX_SGE as u32),
            max_recv_sge: q.cap.max_recv_sge.clamp(1, MAX_SGE as u32),
            max_inline_data: q.cap.max_inline_data.min(MAX_INLINE as u32),
        };
        for s in [q.sq_slots, q.rq_slots] {
            if s == 0 || !s.is_power_of_two() || s > MAX_WR * 2 {
                bail!("ring sizes must be powers of two");
            }
        }
        let sq = map_ring::<SendWqe>(sq_ring, q.sq_slots, "SQ")?;
        let rq = map_ring::<RecvWqe>(rq_ring, q.rq_slots, "RQ")?;
        let qpn = match qpn {
            Some(q) => q,
            None => self.alloc_qpn(),
        };
        let mut qp = Qp::new(qpn, client, q.pd, q.send_cq, q.recv_cq, q.sq_sig_all, cap, sq, rq);
        qp.qp_type = q.qp_type;
        qp.ud_set_port_mtu(self.active_mtu);
        if let Some(s) = &restore {
            qp.restore(s).map_err(|e| anyhow!("create suspended QP {qpn:#x}: {e}"))?;
        }
        // Suspended from the start: it reads neither its rings nor packets
        // until its state is loaded and it resumes.
        qp.suspended |= q.await_state;
        qp.awaiting_state = q.await_state;
        if let Some(s) = &restore {
            self.ahead.push(FlowAhead { sport: qp.sport, peer: Some(s.attr.dest_gid) });
        } else if q.await_state {
            self.ahead.push(FlowAhead { sport: qp.sport, peer: q.peer });
        }
        if self.qpn_order_stale > 0 {
            // The QPN may be a destroyed QP's, still listed.
            self.compact_qpn_order();
        }
        self.doorbell_slots.entry((client, doorbell::slot(qpn) as u16)).or_default().push(qpn);
        self.qps.insert(qpn, qp);
        self.qpn_order.push(qpn);
        Ok(Reply::Qp { qpn, cap })
    }

    fn modify_qp(&mut self, client: ClientId, qpn: u32, attr: &QpAttr, mask: u32) -> anyhow::Result<Reply> {
        let Engine { gid, keys, cqs, tx, stats, asyncs, qps, active_mtu, .. } = self;
        let qp = qps.get_mut(&qpn).filter(|q| q.owner == client).ok_or_else(|| anyhow!("no QP {qpn:#x}"))?;
        qp.modify(attr, mask, &mut Self::ctx(*gid, keys, cqs, tx, stats, asyncs)).map_err(|e| anyhow!(e))?;
        qp.ud_set_port_mtu(*active_mtu);
        Ok(Reply::Ok)
    }

    fn destroy_qp(&mut self, client: ClientId, qpn: u32) -> anyhow::Result<Reply> {
        self.owned_qp(client, qpn)?.give_back_srq_wqe();
        self.remove_qp(qpn);
        Ok(Reply::Ok)
    }

    /// Forgets QP `qpn`; its transmit-order entry goes at the next
    /// compaction, which runs once half the entries are stale.
    fn remove_qp(&mut self, qpn: u32) {
        if let Some(qp) = self.qps.remove(&qpn) {
            let key = (qp.owner, doorbell::slot(qpn) as u16);
            if let Some(v) = self.doorbell_slots.get_mut(&key) {
                v.retain(|&q| q != qpn);
                if v.is_empty() {
                    self.doorbell_slots.remove(&key);
                }
            }
            self.qpn_order_stale += 1;
            if self.qpn_order_stale * 2 > self.qpn_order.len() {
                self.compact_qpn_order();
            }
        }
    }

    fn compact_qpn_order(&mut self) {
        let qps = &self.qps;
        self.qpn_order.retain(|q| qps.contains_key(q));
        self.qpn_order_stale = 0;
    }
}

/// QP migration verbs (seed 000): suspend, query, restore and resume,
/// one QP or a batch (all checked first, then applied).
impl Engine {
    fn suspend_qps(&mut self, client: ClientId, qpns: &[u32], max: usize) -> anyhow::Result<Reply> {
        self.apply_to_qps(client, qpns, max, |_| true, Qp::check_suspend, Qp::suspend)?;
        Ok(Reply::Ok)
    }

    /// Suspends the connected QPs of `qpns`, skips the others; returns the
    /// QPNs suspended, each once, in the request's order.
    fn suspend_connected(&mut self, client: ClientId, qpns: &[u32]) -> anyhow::Result<Vec<u32>> {
        self.apply_to_qps(client, qpns, proto::MAX_BATCH, is_connected, Qp::check_suspend, Qp::suspend)
    }

    fn resume_qps(&mut self, client: ClientId, qpns: &[u32], max: usize) -> anyhow::Result<Reply> {
        let suspended = |qp: &Qp| if qp.suspended { Ok(()) } else { Err("QP is not suspended".to_string()) };
        self.apply_to_qps(client, qpns, max, |_| true, suspended, Qp::resume)?;
        self.acks_alone = true;
        Ok(Reply::Ok)
    }

    /// Suspend and resume: the QPs of `qpns` that `pick` chooses take
    /// `apply`, each once, in the request's order; the QPNs it applied
    /// to. The batch (at most `max`, all the client's) and every QP
    /// picked pass `check` before any QP takes `apply`, so a refused
    /// batch changes nothing.
    fn apply_to_qps(
        &mut self,
        client: ClientId,
        qpns: &[u32],
        max: usize,
        pick: impl Fn(&Qp) -> bool,
        check: impl Fn(&Qp) -> Result<(), String>,
        apply: impl Fn(&mut Qp, &mut Ctx) -> Result<(), String>,
    ) -> anyhow::Result<Vec<u32>> {
        self.check_batch(client, qpns, max)?;
        let mut seen = std::collections::HashSet::with_capacity(qpns.len());
        let mut picked = Vec::with_capacity(qpns.len());
        for &q in qpns {
            let qp = &self.qps[&q];
            if pick(qp) && seen.insert(q) {
                check(qp).map_err(|e| anyhow!("QP {q:#x}: {e}"))?;
                picked.push(q);
            }
        }
        let Engine { gid, keys, cqs, tx, stats, asyncs, qps, .. } = self;
        let mut ctx = Self::ctx(*gid, keys, cqs, tx, stats, asyncs);
        for q in &picked {
            let qp = qps.get_mut(q).expect("checked above");
            apply(qp, &mut ctx).map_err(|e| anyhow!("QP {q:#x}: {e}"))?;
        }
        Ok(picked)
    }

    fn qp_states(&mut self, client: ClientId, qpns: &[u32]) -> anyhow::Result<Vec<crate::qp_snapshot::QpSnapshot>> {
        self.check_batch(client, qpns, proto::MAX_QUERY_BATCH)?;
        let mut out = Vec::with_capacity(qpns.len());
        for &q in qpns {
            out.push(self.owned_qp(client, q)?.snapshot().map_err(|e| anyhow!("QP {q:#x}: {e}"))?);
        }
        Ok(out)
    }

    /// RestoreQps and LoadQpStates: every QP named is the client's, named
    /// once and one that `taker` admits, and every state is valid, before
    /// any QP takes its state: a refused batch changes nothing.
    fn give_qp_states(&mut self, client: ClientId, states: &[QpSnapshot], taker: StateTaker) -> anyhow::Result<Reply> {
        let qpns: Vec<u32> = states.iter().map(|s| s.qpn).collect();
        self.check_batch(client, &qpns, proto::MAX_QUERY_BATCH)?;
        let mut seen = std::collections::HashSet::with_capacity(states.len());
        let mut checked = Vec::with_capacity(states.len());
        for s in states {
            if !seen.insert(s.qpn) {
                bail!("QP {:#x} is named twice", s.qpn);
            }
            if let Some(why) = taker.refuses(&self.qps[&s.qpn]) {
                bail!("QP {:#x} {why}", s.qpn);
            }
            checked.push((s.qpn, Qp::check_snapshot(s).map_err(|e| anyhow!("QP {:#x}: {e}", s.qpn))?));
        }
        for (qpn, state) in checked {
            let qp = self.qps.get_mut(&qpn).expect("checked above");
            qp.take_state(state);
            self.ahead.push(FlowAhead { sport: qp.sport, peer: Some(qp.attr.dest_gid) });
        }
        Ok(Reply::Ok)
    }
}

/// Which QPs a request that hands out QP states gives them to.
#[derive(Clone, Copy)]
enum StateTaker {
    /// RestoreQps: a QP in RESET that is not suspended (made ahead with
    /// the state's QPN, or reset since; either way nothing of it is kept).
    Reset,
    /// LoadQpStates: a QP made to await its state (`Create::Qp {
    /// await_state }`) that has none yet. A QP that ran (suspended since
    /// or not) or that has its state never takes another: the state it
    /// has is the one its peer talks to, and one laid over it is a
    /// caller's mistake (a wrong QPN), never a migration's switch, which
    /// loads each QP it built ahead once.
    Awaiting,
}

impl StateTaker {
    /// Why `qp` may not take a state, if it may not.
    fn refuses(self, qp: &Qp) -> Option<&'static str> {
        let in_reset = qp.attr.qp_state == QpState::Reset;
        if qp.qp_type != QpType::Rc {
            // A state is an RC connection's (`QpSnapshot` names no type):
            // a UC or UD QP that took one would resume as RC on the wire.
            return Some("is not an RC QP: only RC QPs take a state");
        }
        match self {
            StateTaker::Reset if !in_reset || qp.suspended => Some("must be in RESET to take a state"),
            StateTaker::Awaiting if !qp.awaiting_state || !in_reset => {
                Some("is not awaiting a state: only a QP made to await its state takes one, once")
            }
            _ => None,
        }
    }
}

/// Maps a ring of `slots` entries at an offset of its memfd; the mapping
/// travels with it.
fn map_ring<T: Copy>(at: (&OwnedFd, u64), slots: u32, what: &str) -> anyhow::Result<(Ring<T>, Mapping)> {
    let len = ring_bytes::<T>(slots);
    let map = Mapping::map_sealed(at.0, at.1, len)?;
    map.populate_first(crate::ring::FIRST_USE_BYTES);
    // SAFETY: a mapping of the checked length, kept beside the ring.
    let ring = unsafe { Ring::new(map.ptr(), len, slots) }.ok_or_else(|| anyhow!("bad {what} ring"))?;
    Ok((ring, map))
}

/// Whether `qp` has a transport (RTR, RTS or SQD): the QPs a pause suspends.
pub(super) fn is_connected(qp: &Qp) -> bool {
    matches!(qp.attr.qp_state, QpState::Rtr | QpState::Rts | QpState::Sqd)
}

/// The next handle after `next` that is not 0 and not `taken`: the counter
/// wraps after 2^32 allocations (a client's failed batches burn handles
/// too), and a handle still in use is skipped, never given twice.
fn next_free_id(next: &mut u32, taken: impl Fn(u32) -> bool) -> u32 {
    loop {
        *next = next.wrapping_add(1);
        if *next != 0 && !taken(*next) {
            return *next;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::next_free_id;

    #[test]
    fn handles_wrap_past_those_in_use_and_zero() {
        let in_use = [u32::MAX, 1, 2];
        let mut next = u32::MAX - 2;
        let taken = |id| in_use.contains(&id);
        assert_eq!(next_free_id(&mut next, taken), u32::MAX - 1);
        assert_eq!(next_free_id(&mut next, taken), 3, "skips u32::MAX, 0, 1 and 2");
    }
}
