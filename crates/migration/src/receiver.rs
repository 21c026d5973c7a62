//! The receiving machinery both destination modes share: accepting the
//! source's connections, the state every channel thread shares
//! ([`RxShared`]), reading batches into guest RAM and checking them, and
//! placing them through userfaultfd once postcopy runs. [`crate::dest`]
//! (precopy, and the run until a postcopy switch) and
//! [`crate::postcopy::dest`] (after it) drive it; it uses neither.

use crate::acceptor::Acceptor;
use crate::compress::{decompress, Compress};
use crate::cputime::thread_cpu_s;
use crate::dirty::PAGE_SIZE;
use crate::pages::{AtomicBitmap, PageRange};
use crate::place::{Alias, Placer, Via};
use crate::stats::{Control, CpuTally};
use crate::vm::RamRegion;
use crate::wire::{self, DataItem, DataReader, Entry, Msg, Record, WireError, DATA_IDLE_TIMEOUT};
use anyhow::{bail, Context, Result};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Instant;

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct IncomingParams {
    /// Start the vCPUs once the state is in (false: stay paused, e.g. to
    /// compare RAM hashes first; the vmm's `cont` starts it later).
    pub resume: bool,
    /// Give up if no source connects within this many seconds (0 = wait).
    pub accept_timeout_s: u64,
    /// Allocate all of guest RAM while waiting for the source (see
    /// [`Prealloc`]).
    pub prealloc: bool,
    /// rnicd's control socket, if the source picks the rdma transport
    /// ("": the rnicd serving an address of this network namespace).
    pub rnicd: String,
}

impl Default for IncomingParams {
    fn default() -> Self {
        IncomingParams { resume: true, accept_timeout_s: 0, prealloc: false, rnicd: String::new() }
    }
}

/// A barrier that a failing channel can break, so the others stop waiting,
/// and that a channel lost with its link leaves (see [`RoundBarrier::leave`]).
pub(crate) struct RoundBarrier {
    /// Channels at the start.
    pub(crate) n: usize,
    st: Mutex<BarrierState>,
    cv: Condvar,
}

/// Channels as bits (at most 64, as the hello allows).
struct BarrierState {
    /// Channels the round waits for.
    members: u64,
    /// Members that reached this round's sync.
    arrived: u64,
    generation: u64,
    broken: bool,
    /// Channels the source lost with their link: their readers stop.
    gone: u64,
    /// The round being synced (what a completing [`RoundBarrier::leave`] acknowledges).
    round: u64,
}

impl RoundBarrier {
    pub(crate) fn new(n: usize) -> RoundBarrier {
        let members = if n >= 64 { u64::MAX } else { (1u64 << n) - 1 };
        let st = BarrierState { members, arrived: 0, generation: 0, broken: false, gone: 0, round: 0 };
        RoundBarrier { n, st: Mutex::new(st), cv: Condvar::new() }
    }
    /// Channel `i` reached the sync of `round`. Returns true for the last
    /// channel to arrive (it speaks for all).
    pub(crate) fn wait(&self, i: usize, round: u64) -> Result<bool> {
        let bit = 1u64 << i;
        let mut g = self.st.lock().unwrap();
        if g.broken {
            bail!("another channel failed");
        }
        if g.gone & bit != 0 {
            bail!("channel {i} was dropped");
        }
        g.arrived |= bit;
        g.round = round;
        if g.arrived & g.members == g.members {
            g.arrived = 0;
            g.generation += 1;
            self.cv.notify_all();
            return Ok(true);
        }
        let gen = g.generation;
        while g.generation == gen && !g.broken && g.gone & bit == 0 {
            g = self.cv.wait(g).unwrap();
        }
        if g.broken {
            bail!("another channel failed");
        }
        if g.generation == gen {
            bail!("channel {i} was dropped");
        }
        Ok(false)
    }
    pub(crate) fn break_all(&self) {
        self.st.lock().unwrap().broken = true;
        self.cv.notify_all();
    }
    /// The source lost channel `i`: its reader stops (a wait returns).
    pub(crate) fn mark_gone(&self, i: usize) {
        self.st.lock().unwrap().gone |= 1u64 << i;
        self.cv.notify_all();
    }
    pub(crate) fn is_gone(&self, i: usize) -> bool {
        self.st.lock().unwrap().gone & (1u64 << i) != 0
    }
    /// Channels the source lost.
    pub(crate) fn gone(&self) -> u64 {
        self.st.lock().unwrap().gone
    }
    /// The reader of a lost channel `i` stopped: rounds no longer wait for
    /// it. Called by that reader as it ends, so that a round completes
    /// only once the lost channel can write nothing more (the source sends
    /// its pages again in the next round, which must land after). Returns
    /// the round its leaving completed, if it did.
    fn leave(&self, i: usize) -> Option<u64> {
        let bit = 1u64 << i;
        let mut g = self.st.lock().unwrap();
        g.members &= !bit;
        g.arrived &= !bit;
        if g.arrived != 0 && g.arrived & g.members == g.members {
            g.arrived = 0;
            g.generation += 1;
            self.cv.notify_all();
            return Some(g.round);
        }
        None
    }
}

pub(crate) struct RxShared {
    pub ram: RamRegion,
    pub total: u64,
    /// Pages that may hold non-zero bytes here (memfd data, or we wrote them).
    pub maybe_nonzero: Arc<AtomicBitmap>,
    /// Where received pages are written, if not the vmm's mapping: for a
    /// migration that may switch to postcopy, an alias the vmm's page
    /// tables never see, so that at the switch a stale page only needs
    /// forgetting (no unmapping or punching while the VM is paused); for a
    /// preallocated destination, the alias its page tables were filled in.
    pub alias: Option<Arc<Alias>>,
    /// A hybrid: pages may arrive before a postcopy switch (through the
    /// alias, so not mapped into the vmm).
    pub precopy_rounds: bool,
    /// Pages received at least once.
    pub seen: Arc<AtomicBitmap>,
    /// Pages received torn or damaged, waiting to come again.
    pub suspect: Suspects,
    pub(crate) barrier: RoundBarrier,
    /// The control connection's write side, for round acknowledgements.
    pub(crate) acks: Mutex<crate::control_conn::ControlConn>,
    /// A clone of each data connection, by channel index: a channel lost
    /// with its link is shut so that its reader stops.
    pub(crate) data_socks: Vec<TcpStream>,
    pub ctl: Arc<Control>,
    /// Set at a postcopy switch: pages are placed through userfaultfd from
    /// then on (the VM may be running and faulting on them).
    pub placer: OnceLock<Arc<Placer>>,
}

impl RxShared {
    fn write_at(&self) -> *mut u8 {
        self.alias.as_ref().map_or(self.ram.host_addr, |a| a.base)
    }
}

/// Page `pfn` of guest RAM where this migration writes it (the vmm's
/// mapping or the alias). Guest RAM is shared memory reached through a raw
/// mapping, like DMA, so the borrow checker cannot see who else holds it.
///
/// # Safety
///
/// - `pfn < sh.total` (page numbers from a batch table are checked so);
/// - while the slice lives, nothing else reads or writes that page: during
///   a round only the channel that received the page touches it (the
///   source sends a page on one channel per round, and rounds are
///   [`RoundBarrier`]s apart), and the guest does not run on it (it is
///   paused, or the page is in the alias its page tables do not map).
#[expect(clippy::mut_from_ref, reason = "an unsafe fn: exclusive access is the caller's contract, above")]
unsafe fn page_mut(sh: &RxShared, pfn: u64) -> &mut [u8] {
    debug_assert!(pfn < sh.total, "page {pfn} outside guest RAM");
    // SAFETY: in bounds by the caller's contract; exclusive likewise.
    unsafe { std::slice::from_raw_parts_mut(sh.write_at().add((pfn * PAGE_SIZE) as usize), PAGE_SIZE as usize) }
}

/// Allocate, in one call per run, the pages of this batch that arrive for
/// the first time: one MADV_POPULATE_WRITE instead of a page fault per page
/// (the destination's memfd starts empty). Errors are ignored: the copy
/// faults the pages in anyway.
fn populate_new_pages(sh: &RxShared, rd: &DataReader) {
    let mut t = rd.entries(sh.total);
    while let Ok(Some(e)) = t.next_entry() {
        let (pfn, count) = match e {
            Entry::Raw { pfn, count, .. } if !(pfn..pfn + count).all(|p| sh.maybe_nonzero.get(p)) => (pfn, count),
            Entry::Compressed { pfn, .. } if !sh.maybe_nonzero.get(pfn) => (pfn, 1),
            _ => continue,
        };
        // SAFETY: the range lies inside guest RAM (Table checked it).
        unsafe {
            libc::madvise(
                sh.write_at().add((pfn * PAGE_SIZE) as usize) as *mut libc::c_void,
                (count * PAGE_SIZE) as usize,
                libc::MADV_POPULATE_WRITE,
            )
        };
    }
}

/// Where each byte of a batch's data goes, in wire order, as buffers to
/// read into: raw page `p` where `raw_target(p, its hash)` says, or (None)
/// into `scratch` at its data offset, to be dropped; compressed bytes into
/// `scratch` at their data offset. Checks that the records account for
/// exactly `data_len` bytes.
fn plan_batch(
    rd: &DataReader,
    total: u64,
    data_len: usize,
    scratch: &mut Vec<u8>,
    mut raw_target: impl FnMut(u64, u64) -> Option<*mut u8>,
) -> Result<Vec<(*mut u8, usize)>> {
    scratch.resize(data_len, 0);
    let mut pieces: Vec<(*mut u8, usize)> = Vec::new();
    let mut add = |at: *mut u8, len: usize| match pieces.last_mut() {
        Some((p, l)) if p.wrapping_add(*l) == at => *l += len,
        _ => pieces.push((at, len)),
    };
    let (mut off, mut t) = (0, rd.entries(total));
    while let Some(e) = t.next_entry()? {
        let len = e.data_len();
        // Past `data_len` nothing is planned: an error below.
        if off + len <= data_len {
            if let Entry::Raw { pfn, count, hashes } = e {
                for i in 0..count {
                    let o = off + (i * PAGE_SIZE) as usize;
                    add(raw_target(pfn + i, wire::run_hash(hashes, i as usize)).unwrap_or(scratch[o..].as_mut_ptr()), PAGE_SIZE as usize);
                }
            } else if len > 0 {
                add(scratch[off..].as_mut_ptr(), len);
            }
        }
        off += len;
    }
    if off != data_len {
        return Err(WireError::Corrupt(format!("page batch with {data_len} data bytes for records of {off}")).into());
    }
    Ok(pieces)
}

/// Read a batch's data straight into guest RAM: raw pages land where they
/// belong (the kernel's copy is the only one), compressed bytes in
/// `scratch`. Nothing is trusted yet: [`apply_batch`] checks every page.
fn read_batch_into_ram(s: &mut TcpStream, rd: &DataReader, sh: &RxShared, data_len: usize, scratch: &mut Vec<u8>) -> Result<()> {
    // Disjoint ranges of guest RAM (checked page numbers; this channel
    // alone writes them this round) and of `scratch`.
    // SAFETY: plan_batch passes only page numbers it checked against
    // `sh.total`; this channel alone receives them this round, and the
    // slice ends at once (only its address is kept, for the read).
    let pieces = plan_batch(rd, sh.total, data_len, scratch, |p, _| Some(unsafe { page_mut(sh, p) }.as_mut_ptr()))?;
    wait_for_bytes(s, data_len);
    read_pieces(s, &pieces)?;
    Ok(())
}

/// Postcopy: a pushed batch whose raw pages go straight into the alias.
/// The whole batch must be queued on the socket already: the pages nobody
/// claimed yet are claimed and read into place (the others into
/// `scratch`, to be dropped), checked, and mapped, at real-time priority:
/// a fault on a claimed page waits for this thread, which must neither
/// wait for the network nor lose its CPU meanwhile. Claims are given back
/// if the bytes do not arrive or fail their check.
#[allow(clippy::too_many_arguments)]
fn place_batch_direct(
    s: &mut TcpStream,
    rd: &DataReader,
    data_len: usize,
    placer: &Placer,
    sh: &RxShared,
    scratch: &mut Vec<u8>,
    zstd: &mut Option<zstd::bulk::Decompressor<'static>>,
) -> Result<u64> {
    let _rt = crate::priority::RealtimeSection::enter();
    // The pages claimed here, as runs, and the hash each must have.
    let (mut mine, mut checks): (Vec<PageRange>, Vec<(u64, u64)>) = (Vec::new(), Vec::new());
    let read = plan_batch(rd, sh.total, data_len, scratch, |p, hash| {
        placer.claim(p).then(|| {
            match mine.last_mut() {
                Some(r) if r.end() == p => r.count += 1,
                _ => mine.push(PageRange { first: p, count: 1 }),
            }
            checks.push((p, hash));
            placer.alias_page(p)
        })
    })
    .and_then(|pieces| Ok(read_pieces(s, &pieces)?))
    .and_then(|_| {
        // Only claimed pages are checked: the others are dropped.
        checks.iter().try_for_each(|&(p, hash)| {
            // SAFETY: a claimed page inside the alias.
            let page = unsafe { std::slice::from_raw_parts(placer.alias_page(p), PAGE_SIZE as usize) };
            Ok(wire::check_page(p, page, hash)?)
        })
    });
    if let Err(e) = read {
        mine.iter().for_each(|r| placer.unclaim(*r));
        return Err(e);
    }
    for r in &mine {
        placer.map_claimed(*r, Via::Push)?;
    }
    // Zero and compressed records through the placer as usual: `scratch`
    // holds the data as laid out on the wire, but for the raw pages placed
    // above.
    let n = place_records(placer, rd.records_in(scratch, sh.total), Via::Push, zstd, true)?;
    count_batch(&sh.ctl, n, rd.batch_wire_len(data_len));
    Ok(n)
}

/// Read exactly the bytes of `pieces` (disjoint buffers), in order.
fn read_pieces(s: &mut TcpStream, pieces: &[(*mut u8, usize)]) -> Result<(), WireError> {
    // SAFETY: the callers' pieces are disjoint, writable and live.
    let mut bufs: Vec<std::io::IoSliceMut> =
        pieces.iter().map(|&(p, l)| std::io::IoSliceMut::new(unsafe { std::slice::from_raw_parts_mut(p, l) })).collect();
    let mut bufs = &mut bufs[..];
    while !bufs.is_empty() {
        match std::io::Read::read_vectored(s, bufs) {
            Ok(0) => return Err(WireError::Io(std::io::ErrorKind::UnexpectedEof.into())),
            Ok(n) => std::io::IoSliceMut::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(WireError::Io(e)),
        }
    }
    Ok(())
}

/// Bytes queued for reading on `s` (0 if unknown).
fn queued_bytes(s: &TcpStream) -> usize {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int.
    match unsafe { libc::ioctl(s.as_raw_fd(), libc::FIONREAD, &mut n) } {
        0 => n.max(0) as usize,
        _ => 0,
    }
}

/// Sleep until `n` bytes (at most half the receive buffer) are queued on
/// `s`: the sender's kernel then wakes this thread once per batch instead
/// of once per segment (a cross-CPU wakeup costs the sender more than the
/// segment's copy on this VM). The low-water mark goes back to one byte
/// before reading, so that no read can wait for bytes that never come.
/// Errors only cost the optimisation.
fn wait_for_bytes(s: &TcpStream, n: usize) {
    let fd = s.as_raw_fd();
    // libc directly: nix has no SO_RCVLOWAT option.
    let set = |v: i32| {
        // SAFETY: an int option on our own socket.
        unsafe { libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_RCVLOWAT, &v as *const i32 as *const libc::c_void, 4) }
    };
    if n < 64 << 10 || set(n as i32) != 0 {
        return;
    }
    let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one pollfd on the stack. The socket's read timeout bounds
    // the wait for a silent peer.
    unsafe { libc::poll(&mut pfd, 1, DATA_IDLE_TIMEOUT.as_millis() as i32) };
    set(1);
}

/// Check and account the pages of a batch that [`read_batch_into_ram`]
/// read: decompress, zero, and mark each page good or suspect. Returns the
/// pages it held.
pub(crate) fn apply_batch(
    rd: &DataReader,
    sh: &RxShared,
    scratch: &[u8],
    zstd: &mut Option<zstd::bulk::Decompressor<'static>>,
) -> Result<u64> {
    let mut t = rd.entries(sh.total);
    let (mut n, mut off) = (0u64, 0);
    // Bitmap updates go per run of pages, after the copies: an atomic per
    // page would stall on each page's stores.
    let mut written = Runs::default();
    while let Some(e) = t.next_entry()? {
        let at = off;
        off += e.data_len();
        match e {
            Entry::Zero { pfn, count } => {
                for p in pfn..pfn + count {
                    if sh.maybe_nonzero.get(p) {
                        // SAFETY: checked entry (p < total) of this channel's batch.
                        unsafe { page_mut(sh, p) }.fill(0);
                    }
                }
                sh.seen.set_range(PageRange { first: pfn, count });
                sh.suspect.clear_range(pfn, count);
                n += count;
            }
            Entry::Raw { pfn, count, hashes } => {
                for i in 0..count {
                    let p = pfn + i;
                    // SAFETY: checked entry (p < total) of this channel's batch.
                    let page = unsafe { page_mut(sh, p) };
                    sh.suspect.check(p, wire::page_hash(p, page) == wire::run_hash(hashes, i as usize));
                    written.add(p, sh);
                }
                n += count;
            }
            Entry::Compressed { pfn, kind, len, hash } => {
                // SAFETY: checked entry (pfn < total) of this channel's batch.
                let page = unsafe { page_mut(sh, pfn) };
                unpack(pfn, kind, &scratch[at..at + len], page, zstd)?;
                sh.suspect.check(pfn, wire::page_hash(pfn, page) == hash);
                written.add(pfn, sh);
                n += 1;
            }
        }
    }
    written.flush(sh);
    Ok(n)
}

/// Pages whose bytes did not match their hash. During precopy rounds the
/// source sends pages straight from the running guest's RAM, so a page the
/// guest wrote while it was sent arrives torn; it is dirty, so a later
/// round (or the postcopy switch's stale list) replaces it. A page still
/// suspect when the stream ends was damaged on the way: the migration
/// fails and the VM never runs here.
pub(crate) struct Suspects {
    pages: AtomicBitmap,
    count: std::sync::atomic::AtomicU64,
}

impl Suspects {
    pub(crate) fn new(total: u64) -> Self {
        Suspects { pages: AtomicBitmap::new(total), count: Default::default() }
    }
    /// Record the outcome of page `p`'s hash check.
    fn check(&self, p: u64, ok: bool) {
        if !ok {
            if self.pages.test_and_set(p) {
                self.count.fetch_add(1, Ordering::Relaxed);
            }
        } else if self.count.load(Ordering::Relaxed) > 0 && self.pages.get(p) {
            self.clear_range(p, 1);
        }
    }
    /// These pages were replaced (or dropped as stale): no longer suspect.
    pub fn clear_range(&self, first: u64, count: u64) {
        if self.count.load(Ordering::Relaxed) == 0 {
            return;
        }
        for p in first..first + count {
            if self.pages.test_and_clear(p) {
                self.count.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
    /// An error if any page is still suspect.
    pub fn verify(&self) -> Result<()> {
        match self.count.load(Ordering::Relaxed) {
            0 => Ok(()),
            n => Err(WireError::Corrupt(format!("{n} pages arrived damaged (checksum mismatch) and were not sent again")).into()),
        }
    }
}

/// Allocates the destination's guest RAM in a background thread, from the
/// moment it starts listening: the first write to a fresh memfd page costs
/// a fault, zeroing and, on a virtualized host, the host's own first-touch
/// fault (measured here: 1 to 5 s of CPU per GiB, 5x the cost of receiving
/// the page). It populates an alias mapping of the memfd ([`Alias`]) that
/// the receivers then write through: page tables filled here in one call
/// per chunk spare the receive path a write fault per page (a third of the
/// destination's CPU on an idle 4 GiB VM). The vmm's own mapping stays
/// empty, so postcopy still catches every first touch (as a minor fault).
/// Pages it allocates stay zero, so the receiver's zero handling is
/// unchanged. Dropping it stops the thread within one chunk.
pub struct Prealloc {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    alias: Arc<Alias>,
}

impl Prealloc {
    /// Populated a chunk at a time, so that stopping is quick.
    const CHUNK: u64 = 2 << 20;

    pub fn start(ram: RamRegion) -> std::io::Result<Prealloc> {
        let len = ram.len;
        let alias = Arc::new(Alias::map(&ram)?);
        let stop = Arc::new(AtomicBool::new(false));
        let (st, a) = (stop.clone(), alias.clone());
        let thread = std::thread::Builder::new().name("migrate-prealloc".into()).spawn(move || {
            let t = Instant::now();
            let mut off = 0;
            while off < len && !st.load(Ordering::Relaxed) {
                let n = Self::CHUNK.min(len - off) as usize;
                // SAFETY: inside the alias mapping; populating never
                // changes page contents (receivers may write meanwhile).
                if unsafe { libc::madvise(a.base.add(off as usize) as *mut libc::c_void, n, libc::MADV_POPULATE_WRITE) } != 0 {
                    tracing::debug!("prealloc stopped at {off}: {}", std::io::Error::last_os_error());
                    break;
                }
                off += n as u64;
            }
            tracing::debug!("prealloc: {off} bytes in {:?}", t.elapsed());
        })?;
        Ok(Prealloc { stop, thread: Some(thread), alias })
    }

    /// The mapping it populates (receive through it).
    pub fn alias(&self) -> Arc<Alias> {
        self.alias.clone()
    }
}

impl Drop for Prealloc {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A run of consecutive pages written with data, marked in the bitmaps
/// at once.
#[derive(Default)]
struct Runs(Option<PageRange>);

impl Runs {
    fn add(&mut self, pfn: u64, sh: &RxShared) {
        match &mut self.0 {
            Some(r) if r.end() == pfn => r.count += 1,
            _ => {
                self.flush(sh);
                self.0 = Some(PageRange { first: pfn, count: 1 });
            }
        }
    }
    fn flush(&mut self, sh: &RxShared) {
        if let Some(r) = self.0.take() {
            sh.maybe_nonzero.set_range(r);
            sh.seen.set_range(r);
        }
    }
}

/// Postcopy: place a batch's pages (read whole by `rd.next`) through the
/// placer and count them (and the batch's wire bytes) in the stats. The
/// source is paused by now, so a page that fails its hash is damage.
pub(crate) fn place_batch(
    placer: &Placer,
    ctl: &Control,
    rd: &DataReader,
    total: u64,
    via: Via,
    zstd: &mut Option<zstd::bulk::Decompressor<'static>>,
) -> Result<u64> {
    let n = place_records(placer, rd.records(total), via, zstd, false)?;
    count_batch(ctl, n, rd.batch_wire_len(rd.data.len()));
    Ok(n)
}

/// Place the records of a batch; `raw_placed`: its raw pages were placed
/// already (only counted here).
fn place_records(
    placer: &Placer,
    mut it: wire::Records,
    via: Via,
    zstd: &mut Option<zstd::bulk::Decompressor<'static>>,
    raw_placed: bool,
) -> Result<u64> {
    let mut n = 0;
    let mut page = [0u8; PAGE_SIZE as usize];
    while let Some(rec) = it.next_record()? {
        match rec {
            Record::Zero { pfn, count } => {
                placer.place_zero(pfn, count, via);
                n += count;
            }
            Record::Raw { pfn, data, hashes } => {
                if !raw_placed {
                    wire::check_run(pfn, data, hashes)?;
                    placer.place(pfn, data, via)?;
                }
                n += (data.len() as u64) / PAGE_SIZE;
            }
            Record::Compressed { pfn, kind, data, hash } => {
                unpack(pfn, kind, data, &mut page, zstd)?;
                wire::check_page(pfn, &page, hash)?;
                placer.place(pfn, &page, via)?;
                n += 1;
            }
        }
    }
    Ok(n)
}

/// Decompress page `pfn` into `page`; a failure is damage.
fn unpack(
    pfn: u64,
    kind: Compress,
    data: &[u8],
    page: &mut [u8],
    zstd: &mut Option<zstd::bulk::Decompressor<'static>>,
) -> Result<(), WireError> {
    decompress(kind, data, page, zstd).map_err(|e| WireError::Corrupt(format!("page {pfn}: {e}")))
}

/// A batch arrived: its pages and wire bytes count in the stats.
pub(crate) fn count_batch(ctl: &Control, pages: u64, wire: u64) {
    ctl.update(|st| {
        st.pages_sent += pages;
        st.wire_bytes += wire;
    });
}

/// The source lost channel `i` with its link (`channel_lost`): stop its
/// reader. The reader leaves the round barrier as it ends.
pub(crate) fn drop_channel(sh: &RxShared, i: usize) -> Result<()> {
    if i >= sh.barrier.n {
        bail!("the source lost channel {i}, but there are {}", sh.barrier.n);
    }
    tracing::warn!("migration: the source lost data channel {i} with its link");
    sh.barrier.mark_gone(i);
    // A TCP reader stops at once; an rdma one sees the mark within its
    // poll period (crate::rdma::receive_channel).
    if let Some(sock) = sh.data_socks.get(i) {
        let _ = sock.shutdown(std::net::Shutdown::Both);
    }
    Ok(())
}

/// The reader of lost channel `index` stopped and can place nothing more:
/// it leaves the round barrier, and if that completes the round, the
/// source hears so.
pub(crate) fn lost_reader_stopped(sh: &RxShared, index: usize) -> Result<()> {
    if let Some(round) = sh.barrier.leave(index) {
        let mut c = sh.acks.lock().unwrap();
        wire::send_msg(&mut *c, &Msg::RoundDone { round })?;
    }
    Ok(())
}

pub(crate) fn receive_channel(index: usize, mut s: TcpStream, sh: Arc<RxShared>) -> Result<(u64, f64)> {
    let mut rd = DataReader::default();
    let mut zstd = None;
    let mut scratch = Vec::new();
    let mut pages = 0u64;
    // Postcopy drops channel results: from the switch on, this thread
    // counts its CPU itself (all of it, precopy rounds included).
    let mut postcopy: Option<CpuTally> = None;
    let r = (|| -> Result<u64> {
        loop {
            match rd.next_head(&mut s)? {
                DataItem::Pages { data_len, .. } if sh.placer.get().is_some() => {
                    let placer = sh.placer.get().expect("checked");
                    if postcopy.is_none() {
                        // Background work beside the VM it serves (a fault
                        // on a page this thread claimed waits only for a
                        // real-time section, see `place_batch_direct`).
                        crate::priority::push_priority();
                        postcopy = Some(CpuTally::new(&sh.ctl, true));
                        crate::priority::bound_push_buffer(&s, sh.barrier.n, false);
                    }
                    wait_for_bytes(&s, data_len);
                    if queued_bytes(&s) >= data_len {
                        pages += place_batch_direct(&mut s, &rd, data_len, placer, &sh, &mut scratch, &mut zstd)?;
                    } else {
                        // Claims must never wait on the network: read the
                        // batch first, then place it.
                        rd.read_data(&mut s, data_len)?;
                        pages += place_batch(placer, &sh.ctl, &rd, sh.total, Via::Push, &mut zstd)?;
                    }
                }
                DataItem::Pages { data_len, .. } => {
                    populate_new_pages(&sh, &rd);
                    read_batch_into_ram(&mut s, &rd, &sh, data_len, &mut scratch)?;
                    let n = apply_batch(&rd, &sh, &scratch, &mut zstd)?;
                    pages += n;
                    count_batch(&sh.ctl, n, rd.batch_wire_len(data_len));
                }
                DataItem::Sync(round) => {
                    // Every channel applied the round: tell the source, so
                    // it measures what really arrived and never pauses the
                    // VM with a backlog still in flight.
                    if sh.barrier.wait(index, round)? {
                        let mut c = sh.acks.lock().unwrap();
                        wire::send_msg(&mut *c, &Msg::RoundDone { round })?;
                    }
                }
                DataItem::Eos(claimed) => {
                    if claimed != pages {
                        bail!("channel ended claiming {claimed} pages, {pages} arrived");
                    }
                    return Ok(pages);
                }
            }
        }
    })();
    if r.is_err() && sh.barrier.is_gone(index) {
        // Lost with its link: what it applied is as good as any copy of
        // its round, and the rest comes again on the other channels.
        drop(postcopy);
        lost_reader_stopped(&sh, index)?;
        return Ok((pages, thread_cpu_s()));
    }
    if r.is_err() {
        sh.barrier.break_all();
        sh.ctl.shutdown_all();
    }
    drop(postcopy);
    r.map(|p| (p, thread_cpu_s()))
}

/// Accept the data connections (and, for postcopy, the urgent ones, one
/// per link) of `session`, each once, in any order.
pub(crate) fn accept_channels(
    acceptor: &Acceptor,
    ctl: &Control,
    session: u64,
    channels: usize,
    urgents: usize,
) -> Result<(Vec<TcpStream>, Vec<TcpStream>)> {
    let mut kinds = acceptor.take(ctl, session, &[(wire::ROLE_DATA, 0, channels), (wire::ROLE_URGENT, 0, urgents)])?;
    let (streams, urgent) = (std::mem::take(&mut kinds[0]), std::mem::take(&mut kinds[1]));
    for s in &streams {
        // A source that vanishes without a FIN (link cut) must not leave
        // us waiting forever.
        s.set_read_timeout(Some(DATA_IDLE_TIMEOUT))?;
    }
    for s in &urgent {
        // Requests may be rare: the urgent connection may idle.
        s.set_read_timeout(None)?;
        // With several links, requests asked on a dead one are asked again
        // on another once it is found dead.
        if urgents > 1 {
            crate::links::shorten_timeout(s);
        }
    }
    Ok((streams, urgent))
}

/// Bind the listening socket for `uri` ("tcp:ADDR:PORT"; port 0 picks
/// one). "rdma:ADDR:PORT" is the same: the control connection is TCP with
/// either transport, and the source's hello picks the transport.
pub fn listen(uri: &str) -> Result<TcpListener> {
    let a = uri.strip_prefix("tcp:").or_else(|| uri.strip_prefix("rdma:")).unwrap_or(uri);
    TcpListener::bind(a).with_context(|| format!("listening on {a}"))
}

#[cfg(test)]
mod tests {
    use super::RoundBarrier;
    use std::sync::Arc;

    #[test]
    fn a_lost_channel_leaves_the_round_once_its_reader_stopped() {
        let b = Arc::new(RoundBarrier::new(3));
        let waiters: Vec<_> = (0..2)
            .map(|i| {
                let b = b.clone();
                std::thread::spawn(move || b.wait(i, 7))
            })
            .collect();
        // Channel 2 is lost: marking it alone completes nothing.
        b.mark_gone(2);
        // Both others must have arrived before channel 2 leaves, or the
        // leave completes nothing and a late waiter is the last (a loaded
        // host can start a thread well after any fixed sleep).
        while b.st.lock().unwrap().arrived != 0b11 {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert!(waiters.iter().all(|w| !w.is_finished()), "the round waits for the lost reader to stop");
        // Its reader stops and leaves: the round completes, and the leave
        // reports it (the last of the others to arrive was not the last).
        assert_eq!(b.leave(2), Some(7));
        let lasts: Vec<bool> = waiters.into_iter().map(|w| w.join().unwrap().unwrap()).collect();
        assert_eq!(lasts, vec![false, false]);
        // The next round waits for the two left only.
        let other = {
            let b = b.clone();
            std::thread::spawn(move || b.wait(1, 8))
        };
        let last_here = b.wait(0, 8).unwrap();
        assert!(last_here ^ other.join().unwrap().unwrap(), "exactly one speaks for the round");
    }

    #[test]
    fn a_lost_reader_waiting_in_the_barrier_is_released() {
        let b = Arc::new(RoundBarrier::new(2));
        let lost = {
            let b = b.clone();
            std::thread::spawn(move || b.wait(1, 3))
        };
        std::thread::sleep(std::time::Duration::from_millis(20));
        b.mark_gone(1);
        assert!(lost.join().unwrap().is_err(), "the lost reader stops waiting");
        assert!(b.is_gone(1));
        // It had arrived; leaving takes its arrival back: nothing completes
        // until channel 0 arrives, which then is the last.
        assert_eq!(b.leave(1), None);
        assert!(b.wait(0, 3).unwrap());
    }
}
