//! The RDMA transport: each data channel is an RC queue pair between the
//! rnicd of the source's host and the destination's (`--transport rdma`).
//!
//! Both ends register their guest RAM's memfd with their rnicd at I/O
//! address 0, so a guest physical address is also the RDMA address. A page
//! batch leaves as RDMA WRITEs of its raw pages, from the source's guest RAM
//! straight into the destination's (neither vmm copies or touches the
//! bytes), then one SEND with the rest of the frame: head, table with the
//! page hashes, and the compressed pages. An RC queue pair executes its
//! work requests in order, so when the destination sees the SEND complete,
//! every WRITE before it has landed; only then are the pages checked
//! against their hashes and counted as arrived, exactly as the TCP
//! receiver does after reading a batch ([`crate::receiver::apply_batch`]).
//! A page the guest changed while rnicd read it fails the check and stays
//! suspect until a later round sends it again (it is dirty). Round
//! barriers and the end of stream are SENDs too.
//!
//! The control connection stays TCP: it carries the hello, the exchange of
//! queue pair numbers and of the destination RAM's key (RDMA needs that
//! exchange before any queue pair can talk, as rdma_cm does over its own
//! messages), the round acknowledgements, the device state and the commit.
//!
//! Several links: the queue pairs are spread over them round-robin as TCP
//! channels are, each in the rnicd namespace of the local address facing
//! its link (guest RAM registered once per namespace); see
//! [`crate::links`]. A queue pair on a dead link fails with retry exceeded
//! and its channel is failed over ([`crate::sender::ChannelSet`]).

use crate::control_conn::ControlConn;
use crate::links::{self, Links};
use crate::ratelimit::TokenBucket;
use crate::receiver::{apply_batch, count_batch, RxShared};
use crate::sender::{recv_reply, spawn_channels, ChannelSet, ReadRam};
use crate::stats::Control;
use crate::testing::Fault;
use crate::transport::DataSink;
use crate::vm::RamRegion;
use crate::wire::{self, BatchWriter, DataItem, DataReader, Entry, Msg, WireError, DATA_IDLE_TIMEOUT, PAGE};
use anyhow::{anyhow, bail, Context as _, Result};
use std::io;
use std::net::Ipv4Addr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use verbs::{access, CompChannel, ConnectOpts, Context, Cq, MemBuf, Mr, Pd, Qp, QpEndpoint, QpInitAttr, RecvWr, SendWr, Sge, Wc, WcStatus};

/// One message buffer: a batch frame without its raw pages (head, table,
/// checksum, compressed pages: at most the batch size plus a page) fits.
const SLOT: usize = 320 << 10;
/// Messages a sending channel has in flight.
const SEND_SLOTS: usize = 8;
/// Receives posted per channel, twice the sender's messages in flight: a
/// SEND that meets no posted receive is refused (RNR) and retried later.
const RECV_SLOTS: usize = 16;
/// Send queue depth: each message in flight may take one WRITE per run of
/// raw pages (64 at most) and its SEND.
const SQ_DEPTH: u32 = 1024;
/// How often a waiting channel looks at the migration's state.
const POLL: Duration = Duration::from_millis(50);
/// While a channel streams (most of its message buffers in flight), one
/// batch's SEND in this many is solicited; round ends, the end of the
/// stream and every batch sent with few messages in flight (the last
/// round, a postcopy push, a capped trickle) are too. The destination's
/// channel sleeps until a solicited SEND completes (or [`POLL`] passes)
/// and then takes in every message that came before it, so a stream
/// wakes it once per this many batches, not once per batch (each wake-up
/// is an eventfd write in rnicd and a context switch in the vmm), while
/// a batch that may be waited for is taken in at once. A quarter of
/// [`RECV_SLOTS`]: the receives the unprocessed messages hold never run
/// out.
const SOLICIT_EVERY: usize = RECV_SLOTS / 4;
/// The first packet sequence number of every queue pair (fresh ones).
const PSN: u32 = 0;

/// The protection domain and the guest RAM registered in it; the queue
/// pairs of one migration share it. Fields drop in order: the RAM's
/// registration before its domain.
struct Ram {
    mr: Mr,
    pd: Pd,
}

/// The rnicd at `rnicd`, or the one serving this network namespace, in
/// its own address's namespace.
fn open_rnicd(rnicd: &str) -> Result<Context> {
    let path = (!rnicd.is_empty()).then(|| Path::new(rnicd));
    Context::open(path).context("rdma transport: opening rnicd")
}

/// The same rnicd, in the RDMA namespace of `local` (this host's address
/// on one link; the rnicd's own address is its default namespace).
fn open_rnicd_for(rnicd: &str, local: Ipv4Addr) -> Result<Context> {
    let path = (!rnicd.is_empty()).then(|| Path::new(rnicd));
    Context::open_namespace(path, local).with_context(|| format!("rdma transport: opening rnicd for {local}"))
}

/// Source: the rnicd namespace of link `k`'s queue pairs. One address
/// given alone: the rnicd's own. Links of their own (several, or one left
/// of several after a recovery passed over a dead link, which may hold
/// the rnicd's own address): the local address facing link `k`.
fn open_for_link(rnicd: &str, links: &Links, k: usize) -> Result<Context> {
    if links.namespace_per_link() {
        open_rnicd_for(rnicd, links::local_addr_towards(links.addr(k))?)
    } else {
        open_rnicd(rnicd)
    }
}

/// Destination: the rnicd namespace that answers a source address (GID).
/// A source whose queue pairs are on links of their own (it names a GID
/// per queue pair, [`Links::namespace_per_link`]): the local address the
/// kernel routes that GID from, even when one link is left (the rnicd's
/// own address may be on a link that is cut). One that names one GID for
/// all uses its rnicd's own namespace, and so do we: two rnicds of one
/// host (tests on loopback addresses) would otherwise route to each
/// other's address.
fn open_rnicd_towards(rnicd: &str, source: Ipv4Addr, per_link: bool) -> Result<Context> {
    if per_link {
        open_rnicd_for(rnicd, links::local_addr_towards(&format!("{source}:4791"))?)
    } else {
        open_rnicd(rnicd)
    }
}

/// Queue pair options: with several links, a dead link fails its queue
/// pairs in about [`links::LINK_TIMEOUT`] so that their channels fail over.
fn connect_opts(access: u32, several_links: bool) -> ConnectOpts {
    let mut o = ConnectOpts { access, sq_psn: PSN, ..Default::default() };
    // An experiment's knob (docs/migration.md, "Per byte, not per
    // packet"): the queue pairs' path MTU, e.g. 8192 between two rnicds.
    if let Ok(v) = std::env::var("TRANSIT_MIGRATION_RDMA_MTU") {
        match v.parse().ok().and_then(verbs::Mtu::from_bytes) {
            Some(m) => o.mtu = m,
            None => tracing::warn!("TRANSIT_MIGRATION_RDMA_MTU={v:?} is no path MTU (256..4096, 8192, 16384, 32768); ignored"),
        }
    }
    if several_links {
        o.timeout = links::RDMA_LINK_TIMEOUT;
        o.retry_cnt = links::RDMA_LINK_RETRIES;
    }
    o
}

fn register_ram(ctx: &Context, ram: &RamRegion, access: u32) -> Result<Arc<Ram>> {
    let pd = ctx.alloc_pd()?;
    let mr = pd.reg_mr_fd(ram.memfd, 0, ram.len as usize, access, 0).context("registering guest RAM with rnicd")?;
    Ok(Arc::new(Ram { mr, pd }))
}

/// A queue pair, its completion queue and its message buffers. Fields
/// drop in order: the queue pair before its CQ, the buffers' registration
/// before the buffers, the shared RAM registration last.
struct Endpoint {
    qp: Qp,
    cq: Cq,
    chan: CompChannel,
    buf_mr: Mr,
    buf: MemBuf,
    ram: Arc<Ram>,
}

impl Endpoint {
    fn new(ram: &Arc<Ram>, slots: usize) -> Result<Endpoint> {
        let ctx = ram.pd.context();
        let chan = ctx.create_comp_channel()?;
        let cq = ctx.create_cq(SQ_DEPTH + RECV_SLOTS as u32, Some(&chan))?;
        let mut init = QpInitAttr::new(&cq, &cq);
        init.cap.max_send_wr = SQ_DEPTH;
        init.cap.max_recv_wr = RECV_SLOTS as u32;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        let qp = ram.pd.create_qp(&init)?;
        let buf = MemBuf::new(slots * SLOT)?;
        let buf_mr = ram.pd.reg_mr(&buf, 0, buf.len(), access::LOCAL_WRITE)?;
        Ok(Endpoint { qp, cq, chan, buf_mr, buf, ram: ram.clone() })
    }

    /// Connect to the peer's queue pair (at the path MTU our link carries
    /// whole: `connect` caps it at the port's active MTU, see links.rs).
    fn connect(&self, gid: Ipv4Addr, (qpn, psn): (u32, u32), o: &ConnectOpts) -> Result<()> {
        self.qp.connect(&QpEndpoint { gid, qpn, psn }, o).context("connecting a queue pair")
    }

    /// Message buffer `slot`.
    fn slot(&mut self, slot: usize) -> &mut [u8] {
        // SAFETY: inside the buffer; rnicd reads or writes a slot only
        // while its work request is posted, and the callers touch a slot
        // only while it is not.
        unsafe { std::slice::from_raw_parts_mut(self.buf.as_ptr().add(slot * SLOT), SLOT) }
    }

    /// Wait up to [`POLL`] for completions (woken by any, or by a
    /// solicited one only: [`SOLICIT_EVERY`]); an error completion is an
    /// error.
    fn completions<'a>(&self, wc: &'a mut [Wc], solicited_only: bool) -> io::Result<&'a [Wc]> {
        let n = if solicited_only {
            self.cq.poll_or_wait_solicited(wc, &self.chan, POLL)
        } else {
            self.cq.poll_or_wait(wc, &self.chan, Duration::ZERO, POLL)
        }
        .map_err(io::Error::other)?;
        if let Some(w) = wc[..n].iter().find(|w| w.status != WcStatus::Success) {
            return Err(io::Error::other(format!("RDMA {:?} failed: {:?}", w.opcode, w.status)));
        }
        Ok(&wc[..n])
    }
}

fn gid_of(s: &str) -> Result<Ipv4Addr> {
    s.parse().map_err(|_| anyhow!("bad GID {s:?} from the peer"))
}

/// Queue pair `i`'s entry of a per-queue-pair list, or `one` when the
/// peer sent none (one link); a list of another length is refused.
fn per_qp<T: Clone>(list: &[T], one: &T, n: usize, what: &str) -> Result<Vec<T>> {
    match list.len() {
        0 => Ok(vec![one.clone(); n]),
        l if l == n => Ok(list.to_vec()),
        l => bail!("the peer sent {l} {what} for {n} queue pairs"),
    }
}

// --- the source ---

/// Source: a queue pair per channel, connected through the control
/// connection's exchange, and a sender thread on each.
#[allow(clippy::too_many_arguments)]
pub(crate) fn open_channels(
    control: &mut ControlConn,
    rnicd: &str,
    links: &Links,
    n: u32,
    ram: RamRegion,
    compress: crate::compress::Compress,
    bucket: &Arc<TokenBucket>,
    ctl: &Arc<Control>,
    deadline: Option<Instant>,
) -> Result<ChannelSet> {
    // Guest RAM registered in each link's namespace, read by the local
    // rnicd only (the source of WRITEs): no remote access.
    let per_link = (0..links.len())
        .map(|k| {
            // One link: the rnicd's own namespace, whatever address the
            // control connection took (a loopback or proxied control
            // address names no namespace a peer can reach). Several: the
            // namespace of the local address facing each link.
            let ctx = open_for_link(rnicd, links, k)?;
            register_ram(&ctx, &ram, 0)
        })
        .collect::<Result<Vec<_>>>()?;
    let eps = (0..n as usize).map(|i| Endpoint::new(&per_link[links.of_channel(i)], SEND_SLOTS)).collect::<Result<Vec<_>>>()?;
    let qps = eps.iter().map(|e| (e.qp.qpn, PSN)).collect();
    let gids: Vec<String> = eps.iter().map(|e| e.ram.pd.context().gid().to_string()).collect();
    let gid = gids.first().cloned().unwrap_or_default();
    let gids = if links.namespace_per_link() { gids } else { Vec::new() };
    wire::send_msg(control, &Msg::RdmaConnect { gid, qps, gids })?;
    control.set_read_timeout(Some(Duration::from_secs(30)))?;
    let (gids, qps, rkeys) = match recv_reply(control)? {
        Msg::RdmaAccept { gid, qps, rkey, gids, rkeys } => {
            let n = qps.len();
            (per_qp(&gids, &gid, n, "GIDs")?, qps, per_qp(&rkeys, &rkey, n, "keys")?)
        }
        other => bail!("destination answered {other:?} to the queue pairs"),
    };
    control.set_read_timeout(None)?;
    if qps.len() != eps.len() {
        bail!("destination answered {} queue pairs for {} channels", qps.len(), eps.len());
    }
    let opts = connect_opts(access::LOCAL_WRITE, links.several());
    // The senders hand each sink pages where they read them.
    let read = ReadRam::new(ram);
    let mut sinks: Vec<Box<dyn DataSink>> = Vec::new();
    for (((ep, remote), gid), rkey) in eps.into_iter().zip(qps).zip(gids).zip(rkeys) {
        ep.connect(gid_of(&gid)?, remote, &opts)?;
        sinks.push(Box::new(RdmaSink {
            free: (0..SEND_SLOTS).collect(),
            ram_base: read.ram.host_addr as usize,
            ram_len: ram.len as usize,
            rkey,
            ctl: ctl.clone(),
            runs: Vec::new(),
            unsolicited: 0,
            ep,
        }));
    }
    spawn_channels(sinks, links, read, compress, bucket, ctl, deadline)
}

/// The sending end of a channel.
struct RdmaSink {
    ep: Endpoint,
    /// Message buffers not in flight.
    free: Vec<usize>,
    /// Guest RAM where this process's senders read it ([`ReadRam`]), to
    /// turn a page's address into its guest physical address (the RDMA
    /// address on both ends).
    ram_base: usize,
    ram_len: usize,
    /// The destination's key for its guest RAM.
    rkey: u32,
    ctl: Arc<Control>,
    /// The raw page runs of the batch being sent (guest physical, bytes).
    runs: Vec<(u64, u32)>,
    /// Batches sent since the last solicited SEND ([`SOLICIT_EVERY`]).
    unsolicited: usize,
}

impl RdmaSink {
    /// Take in the completions that arrived, waiting for at least one.
    /// Only SENDs are signalled: each frees its message buffer, and with
    /// it the WRITEs before it are done.
    fn reap(&mut self) -> io::Result<()> {
        let t = Instant::now();
        let mut wc = [Wc::default(); 16];
        loop {
            let done = self.ep.completions(&mut wc, false)?;
            if !done.is_empty() {
                self.free.extend(done.iter().map(|w| w.wr_id as usize));
                return Ok(());
            }
            if self.ctl.is_shut() || self.ctl.is_cancelled() {
                return Err(io::Error::other("the migration stopped"));
            }
            if t.elapsed() > DATA_IDLE_TIMEOUT {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "the destination acknowledged nothing for 30 s"));
            }
        }
    }

    fn take_slot(&mut self) -> io::Result<usize> {
        while self.free.is_empty() {
            self.reap()?;
        }
        Ok(self.free.pop().expect("a free slot"))
    }

    /// Post the WRITEs of `self.runs`, then the SEND of `len` bytes of
    /// buffer `slot` (taken from `free`), solicited if `solicit` or as
    /// [`SOLICIT_EVERY`] says.
    fn post(&mut self, slot: usize, len: usize, solicit: bool) -> io::Result<()> {
        let lkey = self.ep.ram.mr.lkey;
        // (local buffer, destination address) of each WRITE.
        let mut writes: Vec<(Sge, u64)> = self.runs.iter().map(|&(gpa, l)| (Sge { addr: gpa, length: l, lkey }, gpa)).collect();
        if !writes.is_empty() && len + PAGE <= SLOT && self.ctl.testing.fire(Fault::CorruptWrite) {
            self.damaged_write(slot, len, &mut writes);
        }
        let msg = [self.ep.buf_mr.sge(slot * SLOT, len)];
        let mut wrs: Vec<SendWr> =
            writes.iter().map(|(sge, gpa)| SendWr::write(0, std::slice::from_ref(sge), *gpa, self.rkey).unsignaled()).collect();
        self.unsolicited += 1;
        let mut send = SendWr::send(slot as u64, &msg);
        let streaming = self.free.len() < SEND_SLOTS / 2;
        if solicit || !streaming || self.unsolicited >= SOLICIT_EVERY {
            send = send.solicited();
            self.unsolicited = 0;
        }
        wrs.push(send);
        while (self.ep.qp.send_slots() as usize) < wrs.len() {
            if self.free.len() == SEND_SLOTS {
                return Err(io::Error::other("the send queue is full with nothing in flight"));
            }
            self.reap()?;
        }
        self.ep.qp.post_send(&wrs).map_err(io::Error::other)
    }

    /// The `corrupt-write` test fault: the first page of the first WRITE
    /// leaves from a copy with one byte flipped, placed in message buffer
    /// `slot` after the frame's `len` bytes (the SEND does not carry it);
    /// the rest of its run still goes from RAM. The source's RAM is
    /// untouched; its hash, in the table, no longer matches what lands.
    fn damaged_write(&mut self, slot: usize, len: usize, writes: &mut Vec<(Sge, u64)>) {
        let (first, gpa) = writes[0];
        // SAFETY: a raw page of this batch, inside guest RAM (checked when
        // the batch was split).
        let page = unsafe { std::slice::from_raw_parts((self.ram_base + gpa as usize) as *const u8, PAGE) };
        let copy = &mut self.ep.slot(slot)[len..len + PAGE];
        copy.copy_from_slice(page);
        copy[PAGE / 2] ^= 0x20;
        writes[0] = (self.ep.buf_mr.sge(slot * SLOT + len, PAGE), gpa);
        if first.length as usize > PAGE {
            let rest = Sge { addr: first.addr + PAGE as u64, length: first.length - PAGE as u32, lkey: first.lkey };
            writes.insert(1, (rest, gpa + PAGE as u64));
        }
    }

    /// Send a small frame (`write` fills it).
    fn send_small(&mut self, write: impl FnOnce(&mut &mut [u8]) -> io::Result<()>) -> io::Result<()> {
        let slot = self.take_slot()?;
        let buf = self.ep.slot(slot);
        let room = buf.len();
        let mut w: &mut [u8] = buf;
        write(&mut w)?;
        let len = room - w.len();
        self.runs.clear();
        self.post(slot, len, true)
    }
}

impl DataSink for RdmaSink {
    fn send_batch(&mut self, batch: &mut BatchWriter<'_>) -> io::Result<usize> {
        let slot = self.take_slot()?;
        let (base, end) = (self.ram_base, self.ram_base + self.ram_len);
        let mut runs = std::mem::take(&mut self.runs);
        runs.clear();
        let mut outside = false;
        let (len, wire) = batch.split_ram(self.ep.slot(slot), |p, l| {
            let p = p as usize;
            outside |= p < base || p + l > end;
            runs.push(((p.wrapping_sub(base)) as u64, l as u32));
        })?;
        self.runs = runs;
        if outside {
            self.free.push(slot);
            return Err(io::Error::other("a raw page outside guest RAM"));
        }
        if self.ctl.testing.fire(Fault::CorruptTable) {
            // The table's first byte (after the 13-byte head), its
            // checksum already taken.
            self.ep.slot(slot)[13] ^= 0x20;
        }
        self.post(slot, len, false)?;
        Ok(wire)
    }
    fn send_sync(&mut self, round: u64) -> io::Result<()> {
        self.send_small(|w| wire::write_sync(w, round))
    }
    fn send_eos(&mut self, pages: u64) -> io::Result<()> {
        self.send_small(|w| wire::write_eos(w, pages))?;
        while self.free.len() < SEND_SLOTS {
            self.reap()?;
        }
        Ok(())
    }
    fn raw_pages_in_ram(&self) -> bool {
        true
    }
    fn fails_over(&self) -> bool {
        true
    }
    /// An idle queue pair on a dead link fails only once its last posted
    /// work retried out: take in its completions without waiting.
    fn check_idle(&mut self) -> io::Result<()> {
        let mut wc = [Wc::default(); 16];
        loop {
            let n = self.ep.cq.poll(&mut wc).map_err(io::Error::other)?;
            if let Some(w) = wc[..n].iter().find(|w| w.status != WcStatus::Success) {
                return Err(io::Error::other(format!("RDMA {:?} failed: {:?}", w.opcode, w.status)));
            }
            self.free.extend(wc[..n].iter().map(|w| w.wr_id as usize));
            if n < wc.len() {
                return Ok(());
            }
        }
    }
}

// --- the destination ---

/// The receiving end of a channel: its queue pair, receives posted.
pub(crate) struct RdmaReceiver {
    ep: Endpoint,
    /// Pages received and checked.
    pages: u64,
}

/// Destination: answer the source's queue pairs with ours, connected and
/// with receives posted, and the key of our guest RAM.
pub(crate) fn accept_channels(control: &ControlConn, rnicd: &str, ram: &RamRegion, channels: usize) -> Result<Vec<RdmaReceiver>> {
    let mut c = control;
    c.set_read_timeout(Some(Duration::from_secs(30)))?;
    let (gids, qps, per_link) = match wire::recv_msg(&mut c)? {
        Msg::RdmaConnect { gid, qps, gids } => (per_qp(&gids, &gid, qps.len(), "GIDs")?, qps, !gids.is_empty()),
        other => bail!("expected the source's queue pairs, got {other:?}"),
    };
    if qps.len() != channels {
        bail!("{} queue pairs for {channels} channels", qps.len());
    }
    let gids = gids.iter().map(|g| gid_of(g)).collect::<Result<Vec<_>>>()?;
    // One namespace per source address (per link), guest RAM registered
    // in each ([`open_rnicd_towards`]).
    let mut spaces: Vec<(Ipv4Addr, Arc<Ram>)> = Vec::new();
    for g in &gids {
        if !spaces.iter().any(|(s, _)| s == g) {
            if spaces.len() == 8 {
                bail!("the source's queue pairs come from more than 8 addresses");
            }
            let ctx = open_rnicd_towards(rnicd, *g, per_link)?;
            spaces.push((*g, register_ram(&ctx, ram, access::LOCAL_WRITE | access::REMOTE_WRITE)?));
        }
    }
    let opts = connect_opts(access::LOCAL_WRITE | access::REMOTE_WRITE, spaces.len() > 1);
    let mut rxs = Vec::new();
    for (remote, g) in qps.into_iter().zip(&gids) {
        let shared = &spaces.iter().find(|(s, _)| s == g).expect("a namespace per source address").1;
        let mut ep = Endpoint::new(shared, RECV_SLOTS)?;
        ep.connect(*g, remote, &opts)?;
        for slot in 0..RECV_SLOTS {
            post_recv(&mut ep, slot)?;
        }
        rxs.push(RdmaReceiver { ep, pages: 0 });
    }
    let ours = rxs.iter().map(|r| (r.ep.qp.qpn, PSN)).collect();
    let gids: Vec<String> = rxs.iter().map(|r| r.ep.ram.pd.context().gid().to_string()).collect();
    let rkeys: Vec<u32> = rxs.iter().map(|r| r.ep.ram.mr.rkey).collect();
    let (gid, rkey) = (gids.first().cloned().unwrap_or_default(), rkeys.first().copied().unwrap_or_default());
    let (gids, rkeys) = if spaces.len() > 1 { (gids, rkeys) } else { (Vec::new(), Vec::new()) };
    wire::send_msg(&mut c, &Msg::RdmaAccept { gid, qps: ours, rkey, gids, rkeys })?;
    Ok(rxs)
}

fn post_recv(ep: &mut Endpoint, slot: usize) -> Result<()> {
    let sge = [ep.buf_mr.sge(slot * SLOT, SLOT)];
    ep.qp.post_recv(&[RecvWr { wr_id: slot as u64, sg_list: &sge }])
}

/// A receiving thread's work: messages in order, each batch checked and
/// applied once its SEND is in (its WRITEs landed before it). Returns the
/// pages received and the thread's CPU seconds.
pub(crate) fn receive_channel(index: usize, mut rx: RdmaReceiver, sh: Arc<RxShared>) -> Result<(u64, f64)> {
    let r = rx.run(index, &sh);
    if r.is_err() && sh.barrier.is_gone(index) {
        // Lost with its link: its queue pair is destroyed before the
        // channel leaves the round, so no late WRITE of it can land after
        // the copies the other channels send again.
        let pages = rx.pages;
        drop(rx);
        crate::receiver::lost_reader_stopped(&sh, index)?;
        return Ok((pages, crate::cputime::thread_cpu_s()));
    }
    if r.is_err() {
        sh.barrier.break_all();
        sh.ctl.shutdown_all();
    } else {
        // Tearing down the queue pair and the registrations takes rnicd
        // round trips; the VM need not wait for them to start (the source
        // sends nothing more).
        let _ = std::thread::Builder::new().name("migrate-rdma-down".into()).spawn(move || drop(rx));
        return r.map(|p| (p, crate::cputime::thread_cpu_s()));
    }
    r.map(|p| (p, crate::cputime::thread_cpu_s()))
}

impl RdmaReceiver {
    fn run(&mut self, index: usize, sh: &RxShared) -> Result<u64> {
        let mut rd = DataReader::default();
        let mut zstd = None;
        let mut scratch = Vec::new();
        let mut idle = Instant::now();
        let mut wc = [Wc::default(); 16];
        loop {
            if sh.barrier.is_gone(index) {
                bail!("channel {index} was dropped with its link");
            }
            let done = self.ep.completions(&mut wc, true)?.to_vec();
            if done.is_empty() {
                if sh.ctl.is_shut() {
                    bail!("stopped: another channel or the control connection failed");
                }
                if idle.elapsed() > DATA_IDLE_TIMEOUT {
                    bail!("nothing from the source for {DATA_IDLE_TIMEOUT:?}");
                }
                continue;
            }
            idle = Instant::now();
            for w in done {
                let slot = w.wr_id as usize;
                let len = w.byte_len as usize;
                if slot >= RECV_SLOTS || len > SLOT {
                    bail!("a receive completion for slot {slot} of {len} bytes");
                }
                let msg = &self.ep.slot(slot)[..len];
                let eos = handle_message(index, msg, &mut rd, sh, &mut scratch, &mut zstd, &mut self.pages)?;
                if let Some(claimed) = eos {
                    if claimed != self.pages {
                        bail!("channel ended claiming {claimed} pages, {} arrived", self.pages);
                    }
                    return Ok(self.pages);
                }
                post_recv(&mut self.ep, slot)?;
            }
        }
    }
}

/// One message: a batch (its raw pages are in RAM already), a round's end
/// (the barrier, then the acknowledgement), or the end of the stream
/// (returned).
fn handle_message(
    index: usize,
    msg: &[u8],
    rd: &mut DataReader,
    sh: &RxShared,
    scratch: &mut Vec<u8>,
    zstd: &mut Option<zstd::bulk::Decompressor<'static>>,
    pages: &mut u64,
) -> Result<Option<u64>> {
    let mut r = msg;
    match rd.next_head(&mut r)? {
        DataItem::Pages { data_len, .. } => {
            unpack_frame(rd, sh.total, data_len, r, scratch)?;
            let n = apply_batch(rd, sh, scratch, zstd)?;
            *pages += n;
            count_batch(&sh.ctl, n, rd.batch_wire_len(data_len));
        }
        DataItem::Sync(round) => {
            if !r.is_empty() {
                return Err(WireError::Corrupt("bytes after a round's end".into()).into());
            }
            if sh.barrier.wait(index, round)? {
                let mut c = sh.acks.lock().unwrap();
                wire::send_msg(&mut *c, &Msg::RoundDone { round })?;
            }
        }
        DataItem::Eos(claimed) => return Ok(Some(claimed)),
    }
    Ok(None)
}

/// Lay out a batch's data as the TCP stream would carry it, in `scratch`:
/// compressed bytes from the message at their offsets; the raw pages'
/// offsets stay unused (their bytes are in guest RAM). The records must
/// account for exactly `data_len` bytes and the message for exactly the
/// compressed ones.
fn unpack_frame(rd: &DataReader, total: u64, data_len: usize, mut rest: &[u8], scratch: &mut Vec<u8>) -> Result<()> {
    scratch.resize(data_len, 0);
    let (mut off, mut t) = (0usize, rd.entries(total));
    while let Some(e) = t.next_entry()? {
        let len = e.data_len();
        if let Entry::Compressed { .. } = e {
            if rest.len() < len || off + len > data_len {
                return Err(WireError::Corrupt("compressed page past the end of its message".into()).into());
            }
            scratch[off..off + len].copy_from_slice(&rest[..len]);
            rest = &rest[len..];
        }
        off += len;
    }
    if off != data_len || !rest.is_empty() {
        return Err(WireError::Corrupt(format!(
            "page batch with {data_len} data bytes for records of {off}, {} bytes left in its message",
            rest.len()
        ))
        .into());
    }
    Ok(())
}

// --- postcopy: the destination reads the pages it lacks ---

/// Queue pairs a postcopy destination reads through: [`READ_URGENT`] for
/// the pages threads fault on, [`READ_BULK`] for the rest. An RC queue pair
/// answers its READs in order, so a fault's READ on the bulk one would wait
/// behind every bulk READ before it (QEMU's postcopy-preempt keeps a
/// separate channel for the same reason).
pub(crate) const READ_QPS: usize = 2;
pub(crate) const READ_URGENT: usize = 0;
pub(crate) const READ_BULK: usize = 1;
/// READs one queue pair keeps outstanding: the responder's limit
/// (`max_rd_atomic` of the connection).
pub(crate) const READS_IN_FLIGHT: usize = 16;

/// Source, postcopy and hybrid: guest RAM registered with this host's
/// rnicd for remote reads, and the queue pairs the destination reads it
/// through, [`READ_QPS`] per link. After the switch this is all the source
/// does for a page: rnicd answers each READ from its own mapping of the
/// memfd, no vmm thread runs. Kept until the destination has every page or
/// the control connection breaks (a recovery offers new ones).
pub(crate) struct ReadableRam {
    _links: Vec<ReadableLink>,
}

/// One link's share of [`ReadableRam`]. Fields drop in order: the queue
/// pairs before their CQ, the registration last.
struct ReadableLink {
    qps: Vec<Qp>,
    _cq: Cq,
    _ram: Arc<Ram>,
}

/// Offer the destination our guest RAM to read (`RdmaReadOffer` on the
/// control connection), [`READ_QPS`] queue pairs on each link, and
/// connect the queue pairs it answers with.
pub(crate) fn offer_ram(control: &mut ControlConn, rnicd: &str, links: &Links, ram: &RamRegion) -> Result<ReadableRam> {
    let mut ours = Vec::new();
    let (mut gids, mut qpns, mut rkeys) = (Vec::new(), Vec::new(), Vec::new());
    for k in 0..links.len() {
        // As the data channels: one link, the rnicd's own namespace;
        // several, the namespace of the local address facing each.
        let ctx = open_for_link(rnicd, links, k)?;
        let shared = register_ram(&ctx, ram, access::REMOTE_READ)?;
        // The responder side never completes anything of its own.
        let cq = ctx.create_cq(READ_QPS as u32, None)?;
        let mut init = QpInitAttr::new(&cq, &cq);
        init.cap.max_send_wr = 1;
        init.cap.max_recv_wr = 1;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        let qps = (0..READ_QPS).map(|_| shared.pd.create_qp(&init)).collect::<Result<Vec<_>>>()?;
        for q in &qps {
            gids.push(ctx.gid().to_string());
            qpns.push(q.qpn);
            rkeys.push(shared.mr.rkey);
        }
        ours.push(ReadableLink { qps, _cq: cq, _ram: shared });
    }
    let (gid, rkey) = (gids[0].clone(), rkeys[0]);
    let (gids, rkeys) = if links.namespace_per_link() { (gids, rkeys) } else { (Vec::new(), Vec::new()) };
    wire::send_msg(control, &Msg::RdmaReadOffer { gid, qpns: qpns.clone(), rkey, gids, rkeys })?;
    control.set_read_timeout(Some(Duration::from_secs(30)))?;
    let (gids, theirs) = match recv_reply(control)? {
        Msg::RdmaReadAccept { gid, qpns: theirs, gids } => (per_qp(&gids, &gid, theirs.len(), "GIDs")?, theirs),
        other => bail!("destination answered {other:?} to the offer of guest RAM to read"),
    };
    control.set_read_timeout(None)?;
    if theirs.len() != qpns.len() {
        bail!("destination answered {} queue pairs to read through, not {}", theirs.len(), qpns.len());
    }
    let o = read_opts(access::REMOTE_READ, links.several());
    let qps = ours.iter().flat_map(|l| &l.qps);
    for ((qp, qpn), gid) in qps.zip(theirs).zip(gids) {
        qp.connect(&QpEndpoint { gid: gid_of(&gid)?, qpn, psn: PSN }, &o).context("connecting a queue pair to read through")?;
    }
    Ok(ReadableRam { _links: ours })
}

/// Options of a queue pair READs go through: with several links, a dead
/// link fails its READs in about [`links::LINK_TIMEOUT`], so that they are
/// read again on another.
fn read_opts(access: u32, several_links: bool) -> ConnectOpts {
    ConnectOpts { max_rd_atomic: READS_IN_FLIGHT as u8, ..connect_opts(access, several_links) }
}

/// Destination, postcopy and hybrid: queue pairs that READ pages from the
/// source's guest RAM straight into ours (rnicd writes them through its own
/// mapping of the memfd, which no userfaultfd of the vmm watches; the vmm
/// maps a page into the guest only once its READ completed), [`READ_QPS`]
/// on each link. A link whose READs fail is dropped
/// ([`drop_link`](Self::drop_link)); the others go on.
pub(crate) struct PageReader {
    links: Vec<Option<ReadLink>>,
    /// The source's address on each link (its GID there).
    addrs: Vec<String>,
}

/// One link's queue pairs, their CQ, and our guest RAM registered in the
/// link's namespace. Fields drop in order: the queue pairs first, so that
/// nothing of theirs lands once they are gone.
struct ReadLink {
    qps: Vec<Qp>,
    cq: Cq,
    chan: CompChannel,
    ram: Arc<Ram>,
    /// The source's key for its guest RAM in that link's namespace.
    rkey: u32,
}

/// Take the source's offer (`RdmaReadOffer`, next on the control
/// connection) and answer with our connected queue pairs.
pub(crate) fn accept_reader(control: &ControlConn, rnicd: &str, ram: &RamRegion) -> Result<PageReader> {
    let mut c = control;
    c.set_read_timeout(Some(Duration::from_secs(30)))?;
    let (gids, qpns, rkeys, per_link) = match wire::recv_msg(&mut c)? {
        Msg::RdmaReadOffer { gid, qpns, rkey, gids, rkeys } => {
            let n = qpns.len();
            (per_qp(&gids, &gid, n, "GIDs")?, qpns, per_qp(&rkeys, &rkey, n, "keys")?, !gids.is_empty())
        }
        other => bail!("expected the source's guest RAM to read, got {other:?}"),
    };
    c.set_read_timeout(None)?;
    if qpns.is_empty() || qpns.len() % READ_QPS != 0 || qpns.len() > 8 * READ_QPS {
        bail!("{} queue pairs to read through, not {READ_QPS} per link on at most 8 links", qpns.len());
    }
    let gids = gids.iter().map(|g| gid_of(g)).collect::<Result<Vec<_>>>()?;
    let one_link = gids.windows(2).all(|w| w[0] == w[1]);
    let mut links = Vec::new();
    let mut addrs = Vec::new();
    let mut answer = (Vec::new(), Vec::new());
    for (k, qpns) in qpns.chunks(READ_QPS).enumerate() {
        let (gid, rkey) = (gids[k * READ_QPS], rkeys[k * READ_QPS]);
        if gids[k * READ_QPS..(k + 1) * READ_QPS].iter().any(|g| *g != gid)
            || rkeys[k * READ_QPS..(k + 1) * READ_QPS].iter().any(|r| *r != rkey)
        {
            bail!("the queue pairs of one link to read through name different GIDs or keys");
        }
        // As the data channels ([`open_rnicd_towards`]).
        let ctx = open_rnicd_towards(rnicd, gid, per_link)?;
        // Written by the local rnicd only (READ responses): no remote access.
        let shared = register_ram(&ctx, ram, access::LOCAL_WRITE)?;
        let chan = ctx.create_comp_channel()?;
        let cq = ctx.create_cq((READ_QPS * READS_IN_FLIGHT) as u32, Some(&chan))?;
        let mut init = QpInitAttr::new(&cq, &cq);
        init.cap.max_send_wr = READS_IN_FLIGHT as u32;
        init.cap.max_recv_wr = 1;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        let o = read_opts(access::LOCAL_WRITE, !one_link);
        let mut qps = Vec::new();
        for &qpn in qpns {
            let qp = shared.pd.create_qp(&init)?;
            qp.connect(&QpEndpoint { gid, qpn, psn: PSN }, &o).context("connecting a queue pair to read through")?;
            answer.0.push(ctx.gid().to_string());
            answer.1.push(qp.qpn);
            qps.push(qp);
        }
        links.push(Some(ReadLink { qps, cq, chan, ram: shared, rkey }));
        addrs.push(gid.to_string());
    }
    let (gids, qpns) = answer;
    let gid = gids[0].clone();
    let gids = if one_link { Vec::new() } else { gids };
    wire::send_msg(&mut c, &Msg::RdmaReadAccept { gid, qpns, gids })?;
    Ok(PageReader { links, addrs })
}

impl PageReader {
    /// Links READs were offered on (dropped ones included).
    pub(crate) fn links(&self) -> usize {
        self.links.len()
    }

    /// The source's address on `link`.
    pub(crate) fn addr(&self, link: usize) -> &str {
        &self.addrs[link]
    }

    /// `link` was not dropped.
    pub(crate) fn is_live(&self, link: usize) -> bool {
        self.links[link].is_some()
    }

    /// READ pages `[first, first + count)` of the source's guest RAM into
    /// the same pages of ours, on queue pair `qp` ([`READ_URGENT`] or
    /// [`READ_BULK`]) of `link`; its completion carries `wr_id`. The caller
    /// keeps at most [`READS_IN_FLIGHT`] outstanding per queue pair and
    /// checked the range against guest RAM.
    pub(crate) fn read(&self, link: usize, qp: usize, wr_id: u64, first: u64, count: u64) -> Result<()> {
        let l = self.links[link].as_ref().ok_or_else(|| anyhow!("a READ on dropped link {link}"))?;
        let (addr, len) = (first * wire::PAGE as u64, count * wire::PAGE as u64);
        let len = u32::try_from(len).map_err(|_| anyhow!("a READ of {count} pages"))?;
        let sge = [Sge { addr, length: len, lkey: l.ram.mr.lkey }];
        l.qps[qp].post_send(&[SendWr::read(wr_id, &sge, addr, l.rkey)])
    }

    /// Completions of `link` that arrived, waiting up to `wait` for one,
    /// whatever their status: a failed READ (the link, the source's rnicd)
    /// means the link's queue pairs are dead.
    pub(crate) fn completions<'a>(&self, link: usize, wc: &'a mut [Wc], wait: Duration) -> io::Result<&'a [Wc]> {
        let Some(l) = self.links[link].as_ref() else { return Ok(&wc[..0]) };
        let n = l.cq.poll_or_wait(wc, &l.chan, Duration::ZERO, wait).map_err(io::Error::other)?;
        Ok(&wc[..n])
    }

    /// Destroy `link`'s queue pairs: once this returns, no READ of theirs
    /// writes into guest RAM, so their pages may be read again elsewhere.
    pub(crate) fn drop_link(&mut self, link: usize) {
        self.links[link] = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_split_batch_leaves_raw_pages_in_ram_and_keeps_the_rest() {
        let ram = vec![7u8; 4 * wire::PAGE];
        let mut b = BatchWriter::new();
        b.raw(1, &ram[wire::PAGE..2 * wire::PAGE]);
        b.raw(2, &ram[2 * wire::PAGE..3 * wire::PAGE]);
        b.compressed(3, wire::Enc::Lz4, &[1, 2, 3], 42);
        b.zero_run(4, 10);
        let mut out = vec![0u8; SLOT];
        let mut runs = Vec::new();
        let (len, wire_len) = b.split_ram(&mut out, |p, l| runs.push((p as usize - ram.as_ptr() as usize, l))).unwrap();
        assert_eq!(runs, vec![(wire::PAGE, 2 * wire::PAGE)], "one WRITE for the two adjacent pages");
        assert_eq!(wire_len, len + 2 * wire::PAGE, "the frame counts the pages it leaves out");
        let mut rd = DataReader::default();
        let mut r = &out[..len];
        let DataItem::Pages { data_len, .. } = rd.next_head(&mut r).unwrap() else { panic!("not a batch") };
        let mut scratch = Vec::new();
        unpack_frame(&rd, 100, data_len, r, &mut scratch).unwrap();
        assert_eq!(&scratch[2 * wire::PAGE..], &[1, 2, 3]);
        // A message cut short, or with bytes to spare, is damage.
        assert!(unpack_frame(&rd, 100, data_len, &r[..2], &mut scratch).is_err());
        let mut longer = r.to_vec();
        longer.push(0);
        assert!(unpack_frame(&rd, 100, data_len, &longer, &mut scratch).is_err());
    }

    #[test]
    fn a_batch_with_copied_raw_pages_is_not_split() {
        let mut b = BatchWriter::new();
        b.raw_copy(1, &[1u8; wire::PAGE]);
        let mut out = vec![0u8; SLOT];
        assert!(b.split_ram(&mut out, |_, _| {}).is_err());
    }
}
