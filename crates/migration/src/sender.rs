//! The sending machinery precopy and postcopy share: connecting to the
//! destination, the page channels and their threads ([`ChannelSet`]),
//! cutting rounds into work chunks, and the control connection's answers.
//! [`crate::source`] (precopy, and the run until a postcopy switch) and
//! [`crate::postcopy::source`] (after it) drive it; it uses neither.

use crate::compress::{Compress, PageCompressor};
use crate::control_conn::ControlConn;
use crate::cputime::{thread_cpu_s, unix_ns};
use crate::dirty::{Armer, PAGE_SIZE};
use crate::links::{self, Links};
use crate::pages::PageRange;
use crate::place::Alias;
use crate::push::PushQueue;
use crate::ratelimit::TokenBucket;
use crate::stats::{Control, Status};
use crate::testing::Fault;
use crate::transport::DataSink;
use crate::vm::{MigratableVm, RamRegion};
use crate::wire::{self, BatchWriter, Enc, Msg};
use anyhow::{anyhow, bail, Context, Result};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Pages per work chunk: big enough to amortize, small enough to balance.
pub(crate) const CHUNK_PAGES: u64 = 256;
/// Zero ranges are cheap (one record per run), so their chunks are large.
pub(crate) const ZERO_CHUNK_PAGES: u64 = 1 << 20;

#[derive(Clone, Copy)]
pub(crate) struct WorkItem {
    pub first: u64,
    pub count: u64,
    /// A memfd hole: zero without reading it.
    pub known_zero: bool,
    /// Armed before the round (hybrid's rate sample, or by the scan that
    /// found it dirty): not armed again when sent. A sample item so keeps
    /// recording writes since it was armed.
    pub armed: bool,
}

struct RoundWork {
    round: u64,
    items: Vec<WorkItem>,
    next: AtomicUsize,
    /// First pass: write-protect each item just before reading it.
    arm: Option<Armer>,
    /// Where the round was cut short (hybrid: timeout or
    /// `migrate-start-postcopy`): no item from here on was sent.
    /// `usize::MAX` while uncut.
    cut: AtomicUsize,
    /// The channel that took each item: a channel lost with its link
    /// leaves its items to send again.
    owner: Vec<AtomicU32>,
}

impl RoundWork {
    /// No channel takes another item; those taken are sent.
    fn cut_off(&self) {
        if self.cut.load(Ordering::SeqCst) == usize::MAX {
            let n = self.next.swap(usize::MAX / 2, Ordering::SeqCst);
            self.cut.store(n.min(self.items.len()), Ordering::SeqCst);
        }
    }
}

#[derive(Default, Clone, Copy)]
struct Sent {
    pages: u64,
    zero: u64,
    raw: u64,
    compressed: u64,
    wire: u64,
}

impl Sent {
    fn add(&mut self, o: &Sent) {
        self.pages += o.pages;
        self.zero += o.zero;
        self.raw += o.raw;
        self.compressed += o.compressed;
        self.wire += o.wire;
    }
}

enum Job {
    Round(Arc<RoundWork>),
    /// Postcopy: send what the queue hands out until it is empty (on one
    /// of this many channels).
    Push(Arc<PushQueue>, usize),
    Finish,
}

enum Reply {
    RoundDone(usize, Result<Sent>),
    Finished(usize, Result<(u64, f64)>),
}

pub(crate) fn chunk(ranges: &[PageRange], size: u64, known_zero: bool, out: &mut Vec<WorkItem>) {
    for r in ranges {
        let mut f = r.first;
        while f < r.end() {
            let c = size.min(r.end() - f);
            out.push(WorkItem { first: f, count: c, known_zero, armed: false });
            f += c;
        }
    }
}

/// Hybrid's rest of the first pass, after a scan that looked at its holes:
/// the pages of hole items that the scan found `written` (sorted, disjoint)
/// go as data items, read like any other page. Sent as a zero run, such a
/// page would be lost: the scan took its record and the next scan has no
/// reason to report it. They are armed already: every hole was armed
/// before it was taken for a hole, and the scan armed the written ones
/// again. Items keep their order; data items are left as they are.
pub(crate) fn written_holes_as_data(items: Vec<WorkItem>, written: &[PageRange]) -> Vec<WorkItem> {
    let mut out = Vec::with_capacity(items.len());
    for item in items {
        if !item.known_zero {
            out.push(item);
            continue;
        }
        let end = item.first + item.count;
        let mut f = item.first;
        let from = written.partition_point(|r| r.end() <= f);
        for r in written[from..].iter().take_while(|r| r.first < end) {
            if r.first > f {
                out.push(WorkItem { first: f, count: r.first - f, ..item });
            }
            let e = r.end().min(end);
            let data = PageRange { first: r.first.max(f), count: e - r.first.max(f) };
            let at = out.len();
            chunk(&[data], CHUNK_PAGES, false, &mut out);
            out[at..].iter_mut().for_each(|w| w.armed = true);
            f = e;
        }
        if f < end {
            out.push(WorkItem { first: f, count: end - f, ..item });
        }
    }
    out
}

/// True if every byte is zero (the compiler vectorizes the OR-fold).
/// Checks 256-byte blocks so a non-zero page is usually rejected at once.
pub fn is_zero(p: &[u8]) -> bool {
    p.chunks(256).all(|c| {
        let (a, words, b) = unsafe { c.align_to::<u64>() };
        a.iter().all(|&x| x == 0) && b.iter().all(|&x| x == 0) && words.iter().fold(0u64, |acc, &w| acc | w) == 0
    })
}

/// A page's xxh3 (what it is sent with), or `None` if it is all zeros:
/// one pass over the page, the zeros checked only when the hash says so.
pub fn nonzero_xxh3(page: &[u8]) -> Option<u64> {
    let h = wire::xxh3(page);
    (h != wire::zero_page_xxh3() || !is_zero(page)).then_some(h)
}

struct Channel {
    index: usize,
    /// Which of the migration's links it runs over.
    link: usize,
    sink: Box<dyn DataSink>,
    /// Where the channel reads pages.
    ram: ReadRam,
    compress: Compress,
    bucket: Arc<TokenBucket>,
    ctl: Arc<Control>,
    total_pages_sent: u64,
    /// Set when the idle channel finds itself broken ([`DataSink::check_idle`]).
    broken: Arc<AtomicBool>,
}

/// How often an idle channel checks itself.
const IDLE_CHECK: Duration = Duration::from_millis(100);

impl Channel {
    fn run(mut self, jobs: mpsc::Receiver<Job>, replies: mpsc::Sender<Reply>) {
        let mut comp = match PageCompressor::new(self.compress) {
            Ok(c) => c,
            Err(e) => {
                let _ = replies.send(Reply::RoundDone(self.index, Err(e.into())));
                return;
            }
        };
        let mut batch = BatchWriter::new();
        let mut cbuf = Vec::with_capacity(2 * PAGE_SIZE as usize);
        loop {
            let job = match jobs.recv_timeout(IDLE_CHECK) {
                Ok(job) => job,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if !self.broken.load(Ordering::Relaxed) {
                        if let Err(e) = self.sink.check_idle() {
                            tracing::debug!("channel {} broke while idle: {e}", self.index);
                            self.broken.store(true, Ordering::Relaxed);
                        }
                    }
                    continue;
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            };
            match job {
                Job::Round(w) => {
                    let r = self.send_round(&w, &mut comp, &mut batch, &mut cbuf);
                    if replies.send(Reply::RoundDone(self.index, r)).is_err() {
                        return;
                    }
                }
                Job::Push(q, channels) => {
                    if let Some(s) = self.sink.tcp() {
                        crate::priority::bound_push_buffer(s, channels, true);
                    }
                    let r = self.push(&q, &mut comp, &mut batch, &mut cbuf);
                    if replies.send(Reply::RoundDone(self.index, r)).is_err() {
                        return;
                    }
                }
                Job::Finish => {
                    let r = self
                        .sink
                        .send_eos(self.total_pages_sent)
                        .map(|_| (self.total_pages_sent, thread_cpu_s()))
                        .map_err(|e| anyhow!("channel {}: {e}", self.index));
                    let _ = replies.send(Reply::Finished(self.index, r));
                    return;
                }
            }
        }
    }

    fn flush(&mut self, batch: &mut BatchWriter, sent: &mut Sent) -> Result<()> {
        if batch.is_empty() {
            return Ok(());
        }
        let pages = batch.pages;
        self.bucket.take(batch.wire_len());
        let w = self.sink.send_batch(batch).map_err(|e| anyhow!("channel {}: send failed: {e}", self.index))? as u64;
        sent.wire += w;
        self.total_pages_sent += pages;
        let link = self.link;
        self.ctl.update(|s| {
            s.wire_bytes += w;
            s.pages_sent += pages;
            if let Some(l) = s.links.get_mut(link) {
                l.wire_bytes += w;
            }
        });
        Ok(())
    }

    fn send_round(&mut self, w: &RoundWork, comp: &mut PageCompressor, batch: &mut BatchWriter, cbuf: &mut Vec<u8>) -> Result<Sent> {
        let mut sent = Sent::default();
        loop {
            if self.ctl.is_cancelled() {
                bail!("cancelled");
            }
            let i = w.next.fetch_add(1, Ordering::Relaxed);
            let Some(item) = w.items.get(i) else { break };
            w.owner[i].store(self.index as u32, Ordering::Relaxed);
            // Holes were armed before they were found to be holes,
            // hybrid's sample items before the first round, and pages a
            // scan found dirty by that scan (run_inner).
            if let (Some(a), false) = (&w.arm, item.known_zero || item.armed) {
                a.arm(PageRange { first: item.first, count: item.count }).map_err(|e| anyhow!("dirty tracking: {e}"))?;
            }
            self.send_item(item, comp, batch, cbuf, &mut sent)?;
        }
        self.flush(batch, &mut sent)?;
        self.sink.send_sync(w.round).map_err(|e| anyhow!("channel {}: send failed: {e}", self.index))?;
        Ok(sent)
    }

    fn push(&mut self, q: &PushQueue, comp: &mut PageCompressor, batch: &mut BatchWriter, cbuf: &mut Vec<u8>) -> Result<Sent> {
        let mut sent = Sent::default();
        let mut claims = Vec::new();
        // Background work: what the guest waits on goes by the fault path.
        crate::priority::push_priority();
        while q.claim(CHUNK_PAGES, &mut claims) {
            for c in &claims {
                let item = WorkItem { first: c.first, count: c.count, known_zero: c.known_zero, armed: false };
                self.send_item(&item, comp, batch, cbuf, &mut sent)?;
            }
            // Flush per chunk: the pages near a fault should not wait for
            // a full batch.
            self.flush(batch, &mut sent)?;
        }
        self.flush(batch, &mut sent)?;
        Ok(sent)
    }

    fn send_item(
        &mut self,
        item: &WorkItem,
        comp: &mut PageCompressor,
        batch: &mut BatchWriter,
        cbuf: &mut Vec<u8>,
        sent: &mut Sent,
    ) -> Result<()> {
        if item.known_zero {
            batch.zero_run(item.first, item.count as u32);
            sent.pages += item.count;
            sent.zero += item.count;
            if batch.is_full() {
                self.flush(batch, sent)?;
            }
            return Ok(());
        }
        let mut tmp = [0u8; PAGE_SIZE as usize];
        let mut run: Option<(u64, u32)> = None;
        for pfn in item.first..item.first + item.count {
            // SAFETY: pfn < pages of the live mapping (checked by the range
            // math), which outlives the migration. Guest writes may race
            // with these reads; such a page is dirty again and is resent
            // next round.
            let src = unsafe { std::slice::from_raw_parts(self.ram.ram.host_addr.add((pfn * PAGE_SIZE) as usize), PAGE_SIZE as usize) };
            sent.pages += 1;
            let Some(h) = nonzero_xxh3(src) else {
                sent.zero += 1;
                run = match run {
                    Some((f, c)) if f + c as u64 == pfn => Some((f, c + 1)),
                    Some((f, c)) => {
                        batch.zero_run(f, c);
                        Some((pfn, 1))
                    }
                    None => Some((pfn, 1)),
                };
                continue;
            };
            if let Some((f, c)) = run.take() {
                batch.zero_run(f, c);
            }
            if self.compress != Compress::None && comp.wants_to_try() {
                // Compress a private copy: the codec must not see bytes
                // change under it.
                tmp.copy_from_slice(src);
                if comp.compress(&tmp[..], cbuf) {
                    let enc = if self.compress == Compress::Lz4 { Enc::Lz4 } else { Enc::Zstd };
                    let hash = wire::page_hash(pfn, &tmp);
                    if self.ctl.testing.fire(Fault::CorruptCompressed) {
                        *cbuf.last_mut().expect("a compressed page has bytes") ^= 0x20;
                    }
                    batch.compressed(pfn, enc, cbuf, hash);
                    sent.compressed += 1;
                } else if self.sink.raw_pages_in_ram() {
                    // The transport reads the page in RAM itself; a change
                    // since the hash fails the destination's check, and
                    // the page is dirty anyway.
                    batch.raw_hashed(pfn, src, h);
                    sent.raw += 1;
                } else {
                    batch.raw_copy(pfn, &tmp[..]);
                    sent.raw += 1;
                }
            } else {
                batch.raw_hashed(pfn, src, h);
                sent.raw += 1;
            }
            if batch.is_full() {
                self.flush(batch, sent)?;
            }
        }
        if let Some((f, c)) = run {
            batch.zero_run(f, c);
        }
        Ok(())
    }
}

/// Open `n` data connections and their sender threads, spread over the
/// links round-robin.
#[allow(clippy::too_many_arguments)]
pub(crate) fn open_channels(
    links: &Links,
    session: u64,
    n: u32,
    ram: RamRegion,
    compress: Compress,
    bucket: &Arc<TokenBucket>,
    ctl: &Arc<Control>,
    deadline: Option<Instant>,
) -> Result<ChannelSet> {
    let mut sinks: Vec<Box<dyn DataSink>> = Vec::new();
    for i in 0..n as usize {
        let link = links.of_channel(i);
        let mut s = wire::connect(links.addr(link), ctl)?;
        if links.several() {
            links::shorten_timeout(&s);
        }
        wire::write_preamble(&mut s, wire::VERSION, wire::ROLE_DATA)?;
        wire::send_msg(&mut s, &Msg::Channel { session, index: i as u32 })?;
        s.set_write_timeout(Some(crate::wire::DATA_IDLE_TIMEOUT))?;
        sinks.push(Box::new(s));
    }
    spawn_channels(sinks, links, ReadRam::new(ram), compress, bucket, ctl, deadline)
}

/// Guest RAM as the senders read it: through a mapping of their own when
/// guest RAM is in huge pages, else through the vmm's. Dirty tracking
/// write-protects the vmm's mapping at 4 KiB (`dirty.rs`): on a 2 MiB page
/// that drops its one page-table entry and leaves a marker per 4 KiB, so
/// each page read there would take a fault of its own (262,144 per GiB,
/// as much CPU as sending the page over TCP). A mapping that nothing
/// watches maps each 2 MiB page with one fault; the guest's writes are
/// tracked all the same, in the vmm's mapping. With 4 KiB pages the vmm's
/// mapping, whose page tables the guest filled, is cheaper than a fresh
/// one.
#[derive(Clone)]
pub(crate) struct ReadRam {
    /// `host_addr` is where the senders read guest physical 0.
    pub ram: RamRegion,
    _alias: Option<Arc<Alias>>,
}

impl ReadRam {
    pub fn new(ram: RamRegion) -> ReadRam {
        let alias = crate::vm::shmem_huge_pages()
            .then(|| Alias::map(&ram).inspect_err(|e| tracing::debug!("no read alias of guest RAM ({e}); reading the vmm's mapping")).ok())
            .flatten()
            .map(Arc::new);
        let ram = alias.as_ref().map_or(ram, |a| RamRegion { host_addr: a.base, ..ram });
        ReadRam { ram, _alias: alias }
    }
}

/// A sender thread on each data channel; channel `i` runs over link
/// `links.of_channel(i)`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn spawn_channels(
    sinks: Vec<Box<dyn DataSink>>,
    links: &Links,
    ram: ReadRam,
    compress: Compress,
    bucket: &Arc<TokenBucket>,
    ctl: &Arc<Control>,
    deadline: Option<Instant>,
) -> Result<ChannelSet> {
    let (reply_tx, reply_rx) = mpsc::channel();
    let mut job_txs = Vec::new();
    let mut threads = Vec::new();
    let mut socks = Vec::new();
    let mut broken = Vec::new();
    let fails_over = sinks.iter().all(|s| s.fails_over());
    ctl.update(|s| s.links = links.stats(sinks.len() as u32));
    for (i, sink) in sinks.into_iter().enumerate() {
        // Failover watches and shuts a clone of a TCP channel's socket.
        socks.push(sink.tcp().map(TcpStream::try_clone).transpose()?);
        let link = links.of_channel(i);
        broken.push(Arc::new(AtomicBool::new(false)));
        let ch = Channel {
            index: i,
            link,
            sink,
            ram: ram.clone(),
            compress,
            bucket: bucket.clone(),
            ctl: ctl.clone(),
            total_pages_sent: 0,
            broken: broken[i].clone(),
        };
        let (tx, rx) = mpsc::channel();
        let rtx = reply_tx.clone();
        threads.push(std::thread::Builder::new().name(format!("migrate-tx{i}")).spawn(move || ch.run(rx, rtx))?);
        job_txs.push(Some(tx));
    }
    Ok(ChannelSet {
        job_txs,
        threads,
        replies: reply_rx,
        ctl: ctl.clone(),
        deadline,
        arm_next: None,
        current: None,
        failover: None,
        fails_over,
        socks,
        broken,
        links: links.clone(),
        unconfirmed: None,
        lost_items: Vec::new(),
    })
}

/// The postcopy urgent connections (page requests and their answers),
/// one per link: the destination asks on the first one left.
pub(crate) fn open_urgent(links: &Links, session: u64, ctl: &Control) -> Result<Vec<TcpStream>> {
    let mut out = Vec::new();
    for k in 0..links.len() {
        let mut s = wire::connect(links.addr(k), ctl)?;
        wire::write_preamble(&mut s, wire::VERSION, wire::ROLE_URGENT)?;
        wire::send_msg(&mut s, &Msg::Channel { session, index: k as u32 })?;
        s.set_write_timeout(Some(crate::wire::DATA_IDLE_TIMEOUT))?;
        if links.several() {
            links::shorten_timeout(&s);
        }
        out.push(s);
    }
    Ok(out)
}

pub(crate) fn parse_tcp_uri(uri: &str) -> Result<Links> {
    Links::parse(uri)
}

/// The source's pause, where downtime starts: its time and its steps.
pub(crate) struct Downtime {
    pub paused_at: u64,
    pub since: Instant,
    ctl: Arc<Control>,
}

impl Downtime {
    /// Pause the VM for the switch (stop-and-copy or postcopy).
    pub(crate) fn pause(guard: &mut Outgoing) -> Result<Downtime> {
        let d = Downtime { paused_at: unix_ns(), since: Instant::now(), ctl: guard.ctl.clone() };
        guard.vm.pause().context("pausing the VM")?;
        guard.paused_by_us = true;
        d.step("paused");
        d.ctl.update(|s| s.status = Status::Device);
        Ok(d)
    }
    /// Record that `name` ended now (ms since the pause).
    pub(crate) fn step(&self, name: &str) {
        let ms = self.since.elapsed().as_secs_f64() * 1e3;
        self.ctl.update(|s| s.downtime_steps.push((name.to_string(), ms)));
    }
}

/// Everything the engine holds that must be undone if the migration fails.
pub(crate) struct Outgoing {
    pub vm: Arc<dyn MigratableVm>,
    pub ctl: Arc<Control>,
    pub paused_by_us: bool,
    pub committed: bool,
    /// The devices' early sections went to the destination, which built
    /// them: the state at the switch may carry only what changed since.
    pub early_sent: bool,
}

impl Outgoing {
    /// The paused VM's state for the switch.
    pub fn save_state(&self) -> anyhow::Result<snapshot::StateSet> {
        if self.early_sent {
            self.vm.save_switch_state()
        } else {
            self.vm.save_state()
        }
    }

    /// The paused VM's state is on its way: what only one host may hold is
    /// let go now, while the destination loads the state, so that the
    /// release is not one more wait of the downtime after the destination
    /// answered. If it fails, so does the migration (the VM runs on here);
    /// a migration that fails after it, before the commit, resumes the VM
    /// here, and its resume takes back what was let go.
    pub fn let_go(&mut self) -> anyhow::Result<()> {
        self.vm.let_go().context("handing the VM's identity over")
    }

    /// The destination owns the VM from here: this side never runs it again.
    pub fn commit(&mut self) {
        self.committed = true;
        self.ctl.update(|s| s.committed = true);
    }
}

impl Drop for Outgoing {
    fn drop(&mut self) {
        // Failure or cancel before commit: the VM runs on here, full speed.
        self.vm.set_cpu_throttle(0);
        if !self.committed {
            self.ctl.shutdown_all();
            if self.paused_by_us {
                if let Err(e) = self.vm.resume() {
                    tracing::error!("migration failed and the VM could not be resumed: {e:#}");
                }
            }
        }
    }
}

/// The destination's answer to our hello: welcome, a refusal, or (when it
/// speaks another stream version) its own preamble.
/// The destination's answer to a hello: whether it builds the devices'
/// early sections.
pub(crate) fn recv_welcome(control: &mut impl std::io::Read, hello: &str) -> Result<bool> {
    match wire::recv_answer(control).map_err(|e| anyhow!("destination: {e}"))? {
        Msg::Welcome => Ok(false),
        Msg::WelcomeEarlyState => Ok(true),
        Msg::Abort { reason } => bail!("destination refused: {reason}"),
        other => bail!("destination answered {other:?} to the {hello}"),
    }
}

pub(crate) fn recv_reply(control: &mut ControlConn) -> Result<Msg> {
    loop {
        match wire::recv_msg(control).map_err(|e| anyhow!("destination: {e}"))? {
            Msg::Abort { reason } => bail!("destination refused: {reason}"),
            // The final round's acknowledgement; End's answer follows.
            Msg::RoundDone { .. } => continue,
            Msg::EarlyBuilt => continue,
            m => return Ok(m),
        }
    }
}

pub(crate) struct RoundResult {
    pub(crate) pages: u64,
    pub(crate) zero: u64,
    pub(crate) wire: u64,
    pub(crate) secs: f64,
    /// Cut off (hybrid's timeout or `migrate-start-postcopy`): not sent.
    pub(crate) unsent: Vec<WorkItem>,
}

impl RoundResult {
    /// Wire bytes per non-zero page.
    pub(crate) fn page_cost(&self) -> f64 {
        (self.wire as f64 / (self.pages - self.zero).max(1) as f64).clamp(16.0, PAGE_SIZE as f64 + 16.0)
    }
}

pub(crate) struct ChannelSet {
    /// One per channel; None once the channel was lost with its link.
    job_txs: Vec<Option<mpsc::Sender<Job>>>,
    threads: Vec<std::thread::JoinHandle<()>>,
    replies: mpsc::Receiver<Reply>,
    ctl: Arc<Control>,
    deadline: Option<Instant>,
    /// Given to the next round (the first pass).
    pub(crate) arm_next: Option<Armer>,
    /// The round in flight, and whether the deadline or the operator's
    /// request to switch may cut it short (hybrid's rounds before the
    /// switch: what they leave goes by postcopy) rather than cancel.
    current: Option<(Arc<RoundWork>, bool)>,
    /// Several links: the control connection, to tell the destination of a
    /// channel lost with its link. None: any channel's failure fails all.
    failover: Option<ControlConn>,
    /// Every channel's transport can fail over ([`DataSink::fails_over`]).
    fails_over: bool,
    /// A clone of each data connection, to see a dead link between rounds
    /// (None: a channel that is not a TCP connection).
    socks: Vec<Option<TcpStream>>,
    /// Each channel's own finding that it broke while idle.
    broken: Vec<Arc<AtomicBool>>,
    links: Links,
    /// The last round sent and not yet confirmed by the destination's
    /// `round_done`: a lost channel's items of it go again.
    unconfirmed: Option<Arc<RoundWork>>,
    /// Items of lost channels, sent first in the next round.
    lost_items: Vec<WorkItem>,
}

impl ChannelSet {
    fn wait(&self) -> Result<Reply> {
        loop {
            match self.replies.recv_timeout(Duration::from_millis(50)) {
                Ok(r) => return Ok(r),
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    let now = Instant::now();
                    let cuttable = self.current.as_ref().filter(|c| c.1).map(|c| &c.0);
                    if give_up_at(self.deadline, cuttable.is_some()).is_some_and(|d| now >= d) {
                        if !self.ctl.is_cancelled() {
                            self.ctl.cancel();
                        }
                    } else if let Some(w) = cuttable {
                        if self.deadline.is_some_and(|d| now >= d) || self.ctl.postcopy_requested() {
                            w.cut_off();
                        }
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => bail!("a channel thread died"),
            }
        }
    }

    pub(crate) fn round(&mut self, round: u64, mut items: Vec<WorkItem>, cuttable: bool) -> Result<RoundResult> {
        let t = Instant::now();
        if !self.lost_items.is_empty() {
            // Pages a lost channel may not have delivered go first; they
            // are read again now, so they carry the newest bytes.
            let mut lost = std::mem::take(&mut self.lost_items);
            lost.append(&mut items);
            items = lost;
        }
        let owner = (0..items.len()).map(|_| AtomicU32::new(u32::MAX)).collect();
        let work = Arc::new(RoundWork {
            round,
            items,
            next: AtomicUsize::new(0),
            arm: self.arm_next.take(),
            cut: AtomicUsize::new(usize::MAX),
            owner,
        });
        self.current = Some((work.clone(), cuttable));
        let total = self.run_job(|| Job::Round(work.clone()), true);
        self.current = None;
        self.unconfirmed = Some(work.clone());
        let total = total.map_err(|e| {
            if self.ctl.is_cancelled() {
                if self.deadline.is_some_and(|d| Instant::now() >= d) {
                    return anyhow!("timed out while sending round {round}");
                }
                return anyhow!("cancelled");
            }
            e
        })?;
        let unsent = match work.cut.load(Ordering::SeqCst) {
            usize::MAX => Vec::new(),
            c => work.items[c..].to_vec(),
        };
        Ok(RoundResult { pages: total.pages, zero: total.zero, wire: total.wire, secs: t.elapsed().as_secs_f64(), unsent })
    }

    /// From now on nothing times out (postcopy's push).
    pub(crate) fn clear_deadline(&mut self) {
        self.deadline = None;
    }

    /// Postcopy: every channel pushes from `q` until it is empty; returns
    /// the pages sent. With several links a channel that fails is lost
    /// with its link ([`ChannelSet::lose`]) and the others go on; what it
    /// did not deliver is the destination's to report (`pages_held`).
    pub(crate) fn push(&mut self, q: &Arc<PushQueue>) -> Result<u64> {
        let channels = self.live();
        let total = self.run_job(|| Job::Push(q.clone(), channels), true)?;
        self.ctl.update(|s| s.pages_pushed += total.pages);
        Ok(total.pages)
    }

    /// Channels not lost.
    fn live(&self) -> usize {
        self.job_txs.iter().flatten().count()
    }

    /// Several links: a failing channel is lost with its link (see
    /// [`ChannelSet::lose`]) rather than failing the migration, if every
    /// channel's transport can fail over.
    pub(crate) fn enable_failover(&mut self, control: &ControlConn) -> Result<()> {
        if self.links.several() && self.fails_over {
            self.failover = Some(control.try_clone()?);
        }
        Ok(())
    }

    pub(crate) fn failover_enabled(&self) -> bool {
        self.failover.is_some()
    }

    /// The destination applied every round sent so far.
    pub(crate) fn confirmed(&mut self) {
        self.unconfirmed = None;
    }

    /// Items of lost channels not sent again yet (a switch to postcopy
    /// counts them as missing).
    pub(crate) fn take_lost(&mut self) -> Vec<WorkItem> {
        std::mem::take(&mut self.lost_items)
    }

    /// Between rounds: drop every channel whose link died meanwhile (TCP
    /// gave up on its unacknowledged bytes, or an idle queue pair's last
    /// work retried out). Without failover, a broken channel shows at its
    /// next write instead.
    pub(crate) fn check_links(&mut self) -> Result<()> {
        if self.failover.is_none() {
            return Ok(());
        }
        for i in 0..self.job_txs.len() {
            let broken = self.socks[i].as_ref().is_some_and(links::socket_broken) || self.broken[i].load(Ordering::Relaxed);
            if self.job_txs[i].is_some() && broken {
                self.lose(i, &anyhow!("channel {i}: its connection broke"))?;
            }
        }
        Ok(())
    }

    /// Channel `i` is lost with its link: its thread ends, its items of the
    /// rounds not confirmed go again first in the next round, and the
    /// destination is told to stop reading it (and to leave it out of the
    /// round barrier, which it does only once its reader stopped, so no
    /// late copy from it can land after a newer one). Fails when no
    /// channel is left.
    fn lose(&mut self, i: usize, why: &anyhow::Error) -> Result<()> {
        tracing::warn!("migration: {why:#}; its pages go again on the other links");
        self.job_txs[i] = None;
        if let Some(s) = &self.socks[i] {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        let rounds = self.unconfirmed.iter().chain(self.current.as_ref().map(|c| &c.0));
        for w in rounds {
            let mine = (0..w.items.len()).filter(|&k| w.owner[k].load(Ordering::Relaxed) == i as u32);
            self.lost_items.extend(mine.map(|k| w.items[k]));
        }
        let link = self.links.of_channel(i);
        self.ctl.update(|s| {
            if let Some(l) = s.links.get_mut(link) {
                l.channel_lost(why);
            }
        });
        if self.live() == 0 {
            bail!("every link is lost (last: {why:#})");
        }
        let control = self.failover.as_mut().expect("failover enabled");
        wire::send_msg(control, &Msg::ChannelLost { index: i as u32 }).map_err(|e| anyhow!("control connection: {e}"))?;
        Ok(())
    }

    /// Give every live channel the job, wait for all, account what they
    /// sent. The first failure stops the other channels at once, unless
    /// `failover` (a round, with several links): then a failing channel
    /// is lost and the others go on.
    fn run_job(&mut self, job: impl Fn() -> Job, failover: bool) -> Result<Sent> {
        let failover = failover && self.failover.is_some();
        let mut expected = 0;
        for tx in self.job_txs.iter().flatten() {
            tx.send(job()).map_err(|_| anyhow!("a channel thread died"))?;
            expected += 1;
        }
        let mut total = Sent::default();
        let mut first_err = None;
        for _ in 0..expected {
            match self.wait()? {
                Reply::RoundDone(_, Ok(s)) => total.add(&s),
                Reply::RoundDone(i, Err(e)) if failover && !self.ctl.is_cancelled() && first_err.is_none() => {
                    if let Err(e) = self.lose(i, &e) {
                        self.ctl.shutdown_all();
                        first_err = Some(e);
                    }
                }
                Reply::RoundDone(i, Err(e)) | Reply::Finished(i, Err(e)) => {
                    tracing::debug!("channel {i} failed: {e:#}");
                    if first_err.is_none() {
                        self.ctl.shutdown_all();
                        first_err = Some(e);
                    }
                }
                Reply::Finished(..) => {}
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        self.ctl.update(|s| {
            s.zero_pages += total.zero;
            s.raw_pages += total.raw;
            s.compressed_pages += total.compressed;
            s.ram_transferred_bytes += (total.raw + total.compressed) * PAGE_SIZE;
        });
        Ok(total)
    }

    /// End every data stream; returns pages per channel and their CPU time.
    /// A lost channel counts 0 pages (the destination leaves it out).
    pub(crate) fn finish(&mut self) -> Result<(Vec<u64>, f64)> {
        for tx in self.job_txs.iter().flatten() {
            let _ = tx.send(Job::Finish);
        }
        let mut per = vec![0u64; self.job_txs.len()];
        let mut cpu = 0.0;
        for _ in 0..self.live() {
            match self.wait()? {
                Reply::Finished(i, Ok((p, c))) => {
                    per[i] = p;
                    cpu += c;
                }
                Reply::Finished(_, Err(e)) | Reply::RoundDone(_, Err(e)) => return Err(e),
                Reply::RoundDone(..) => {}
            }
        }
        Ok((per, cpu))
    }
}

impl Drop for ChannelSet {
    fn drop(&mut self) {
        self.job_txs.clear();
        self.ctl.shutdown_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// How long a round cut at the deadline (hybrid's, before its switch) may
/// take to finish the batches it has in flight and be confirmed: longer
/// means the destination or the link hangs, and the migration is cancelled.
const CUT_GRACE: Duration = Duration::from_secs(10);

/// When waiting on a round (its channels, then its confirmation) cancels
/// the migration: at the deadline, or [`CUT_GRACE`] after it for a round
/// the deadline only cuts short.
pub(crate) fn give_up_at(deadline: Option<Instant>, cuttable: bool) -> Option<Instant> {
    deadline.map(|d| if cuttable { d + CUT_GRACE } else { d })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(first: u64, count: u64, known_zero: bool) -> WorkItem {
        WorkItem { first, count, known_zero, armed: false }
    }

    fn shape(items: &[WorkItem]) -> Vec<(u64, u64, bool, bool)> {
        items.iter().map(|w| (w.first, w.count, w.known_zero, w.armed)).collect()
    }

    #[test]
    fn written_holes_go_as_armed_data_and_the_rest_stays_zero() {
        let r = |first, count| PageRange { first, count };
        let items = vec![item(0, 100, false), item(100, 1000, true), item(1100, 50, false), item(1150, 100, true)];
        // A run inside the first hole, one across its end into a data item,
        // and one covering the last hole's head.
        let written = [r(200, 10), r(1090, 20), r(1150, 5)];
        let out = written_holes_as_data(items, &written);
        assert_eq!(
            shape(&out),
            vec![
                (0, 100, false, false),
                (100, 100, true, false),
                (200, 10, false, true),
                (210, 880, true, false),
                (1090, 10, false, true),
                (1100, 50, false, false),
                (1150, 5, false, true),
                (1155, 95, true, false),
            ]
        );
        // Every page is still sent once, in order.
        assert!(out.windows(2).all(|w| w[0].first + w[0].count == w[1].first));
    }

    #[test]
    fn a_long_written_hole_is_cut_into_data_chunks() {
        let out = written_holes_as_data(vec![item(0, 1 << 20, true)], &[PageRange { first: 0, count: 3 * CHUNK_PAGES + 1 }]);
        assert_eq!(out.len(), 5);
        assert!(out[..4].iter().all(|w| !w.known_zero && w.armed && w.count <= CHUNK_PAGES));
        assert_eq!((out[4].first, out[4].known_zero), (3 * CHUNK_PAGES + 1, true));
        assert!(written_holes_as_data(vec![item(5, 5, true)], &[]).iter().all(|w| w.known_zero), "nothing written");
    }
}
