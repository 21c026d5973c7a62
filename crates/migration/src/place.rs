//! Destination side of postcopy: where pages go and who is woken.
//!
//! Guest RAM is a shared memfd. Every process that maps it (the vmm, RAM
//! clients) registers its mapping for missing *and* minor faults, so that a
//! thread touching a page that is not here yet blocks, whether the memfd
//! has no page there (missing) or a stale or preallocated one (minor). A
//! page is placed by writing it through a private alias mapping of the
//! memfd, which no uffd watches, and then mapping it into the vmm with
//! `UFFDIO_CONTINUE`, which also wakes whoever waits on it: a thread never
//! sees half a page. With the memfd preallocated (the destination's
//! `prealloc`), placing a page is one copy into memory that is already
//! there; `UFFDIO_COPY` allocated and first-touched every page on the
//! critical path, which on this virtualized host cost most of the time.
//!
//! A page is written by one thread only (the one that claims it first):
//! once placed, the guest may change it, and a late duplicate must not
//! overwrite that.

use crate::pages::{AtomicBitmap, PageRange};
use crate::vm::RamRegion;
use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::Instant;
use userfaultfd::Uffd;

const PAGE: u64 = crate::dirty::PAGE_SIZE;

/// Most pages claimed, written and mapped in one step (a whole raw run:
/// the step runs real-time, so a fault on one of them waits for a 256 KiB
/// copy at most, and each step costs two scheduler calls and an ioctl).
const CLAIM_RUN: u64 = crate::wire::MAX_RAW_RUN as u64;

/// Pages asked for per fault: the faulting one and those after it.
pub const FAULT_WINDOW: u64 = 32;

/// What faults make the fault thread ask for.
#[derive(Default)]
pub struct Asks {
    /// Threads wait on these: ask now.
    pub now: Vec<u64>,
    /// Prefetch.
    pub soon: Vec<u64>,
    /// Threads wait on these prefetched pages: ask if they do not come
    /// within [`PUSH_GRACE`].
    pub later: Vec<u64>,
}

/// How long a fault on a prefetched page waits for the push before the
/// page is asked for: a prefetched page the source left to its push is
/// usually on the wire already, and asking again would send it twice.
pub const PUSH_GRACE: std::time::Duration = std::time::Duration::from_micros(200);

// linux/userfaultfd.h: the crate's continue() hides how much a failed
// call mapped, which a run with one page already mapped needs.
const UFFDIO_CONTINUE: libc::c_ulong = 0xC020_AA07;
#[repr(C)]
struct UffdioContinue {
    start: u64,
    len: u64,
    mode: u64,
    mapped: i64,
}

/// Map pages `[addr, addr + len)` of a minor-registered range from the page
/// cache and wake their waiters. Ok(bytes mapped) or Err(errno, bytes mapped
/// before the failing page).
fn uffd_continue(uffd: i32, addr: u64, len: u64) -> Result<u64, (i32, u64)> {
    let mut c = UffdioContinue { start: addr, len, mode: 0, mapped: 0 };
    // SAFETY: the ioctl only reads and writes `c`; the range is checked by
    // the kernel against the uffd's registrations.
    let r = unsafe { libc::ioctl(uffd, UFFDIO_CONTINUE as _, &mut c as *mut UffdioContinue) };
    let mapped = c.mapped.max(0) as u64;
    if r == 0 {
        Ok(len)
    } else {
        Err((std::io::Error::last_os_error().raw_os_error().unwrap_or(0), mapped))
    }
}

/// A mapping of guest RAM's memfd that no userfaultfd watches: pages are
/// written here, where the guest cannot see them, before they are mapped
/// into the vmm; a source's senders read pages here (`sender.rs`).
/// Unmapped on drop.
pub struct Alias {
    pub base: *mut u8,
    len: usize,
}

impl Alias {
    pub fn map(ram: &RamRegion) -> std::io::Result<Alias> {
        // SAFETY: a new shared mapping of the VM's own memfd.
        let a = unsafe {
            libc::mmap(std::ptr::null_mut(), ram.len as usize, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, ram.memfd, 0)
        };
        if a == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        // The receivers and prealloc allocate guest RAM through it.
        crate::vm::advise_huge_pages(a as *mut u8, ram.len as usize);
        Ok(Alias { base: a as *mut u8, len: ram.len as usize })
    }
}

impl Drop for Alias {
    fn drop(&mut self) {
        // Tearing down the page tables of a populated whole-RAM mapping
        // takes ~90 ms per GiB: do it off the caller's path (the end of a
        // migration), 2 MiB per munmap so that the mm lock is never held
        // for long.
        let (base, len) = (self.base as usize, self.len);
        let unmap = move || {
            let mut off = 0;
            while off < len {
                let n = (2usize << 20).min(len - off);
                // SAFETY: our own mapping; nothing uses it after its last owner.
                unsafe { libc::munmap((base + off) as *mut libc::c_void, n) };
                off += n;
            }
        };
        if let Err(e) = std::thread::Builder::new().name("alias-unmap".into()).spawn(unmap) {
            tracing::debug!("unmapping the alias in place: {e}");
            unmap();
        }
    }
}

// Written only through claimed pages (see `Placer::place`) or, before a
// switch, by the receive channels (one writer per page per round).
unsafe impl Send for Alias {}
unsafe impl Sync for Alias {}

pub use ram_client::{register_ram, zap};

/// A process's userfaultfd over (part of) guest RAM (missing and minor
/// faults).
pub struct FaultDomain {
    pub uffd: Uffd,
    /// (address in that process, guest RAM offset, bytes), page aligned.
    pub ranges: Vec<(u64, u64, u64)>,
    pub name: String,
    /// Its process is gone (the uffd hung up): stop polling it.
    pub gone: std::sync::atomic::AtomicBool,
    /// How long its threads waited for pages.
    pub waits: Mutex<crate::stats::FaultWaits>,
}

impl FaultDomain {
    pub fn new(name: &str, uffd: Uffd, ranges: Vec<(u64, u64, u64)>) -> FaultDomain {
        let waits = crate::stats::FaultWaits { name: name.to_string(), ..Default::default() };
        FaultDomain { uffd, ranges, name: name.to_string(), gone: Default::default(), waits: Mutex::new(waits) }
    }

    /// A thread of this process blocked on a page not here yet (`device`:
    /// one of the devices' pages).
    fn note_fault(&self, device: bool) {
        let mut w = self.waits.lock().unwrap();
        w.faults += 1;
        w.device_faults += device as u64;
        if w.first_fault_unix_ms.is_none() {
            w.first_fault_unix_ms = Some(crate::cputime::unix_ns() as f64 / 1e6);
        }
    }

    /// A thread of this process that blocked `waited` ago goes on.
    fn note_wake(&self, waited: std::time::Duration) {
        let us = waited.as_secs_f64() * 1e6;
        let mut w = self.waits.lock().unwrap();
        w.wait_ms += us / 1e3;
        w.wait_max_us = w.wait_max_us.max(us);
        w.last_wake_unix_ms = Some(crate::cputime::unix_ns() as f64 / 1e6);
    }

    fn pfn_of(&self, addr: u64) -> Option<u64> {
        self.ranges.iter().find(|r| addr >= r.0 && addr < r.0 + r.2).map(|r| (r.1 + addr - r.0) / PAGE)
    }
    /// The page at `addr` is in (or known zero): let the faulting thread go.
    fn resolve(&self, addr: u64) {
        let a = addr & !(PAGE - 1);
        match uffd_continue(self.uffd.as_raw_fd(), a, PAGE) {
            Ok(_) => {}
            // No page in the memfd: a page known to be zero, left a hole.
            Err((libc::EFAULT, _)) => {
                // SAFETY: `a` is one registered page of that process's mapping.
                if unsafe { self.uffd.zeropage(a as *mut libc::c_void, PAGE as usize, true) }.is_err() {
                    let _ = self.uffd.wake(a as *mut libc::c_void, PAGE as usize);
                }
            }
            // Mapped already (a race with another fault): only wake.
            Err(_) => {
                if let Err(e) = self.uffd.wake(a as *mut libc::c_void, PAGE as usize) {
                    tracing::warn!("{}: waking a fault at {addr:#x}: {e}", self.name);
                }
            }
        }
    }
}

struct Waiter {
    since: Instant,
    /// (domain index, faulting address, when it faulted)
    who: Vec<(usize, u64, Instant)>,
}

/// Who placed a page (for the pushed/requested statistics).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Via {
    Push,
    Request,
}

pub struct Placer {
    ram: RamRegion,
    /// Pages are written here before they are mapped into the guest.
    alias: Arc<Alias>,
    /// Pages whose memfd copy may hold non-zero bytes (written before the
    /// switch, perhaps stale): a zero record must clear them.
    maybe_nonzero: Arc<AtomicBitmap>,
    /// Pages some thread writes or wrote (a superset of `seen`).
    claimed: AtomicBitmap,
    /// Pages asked for on the urgent connection (a fault there waits for
    /// the answer instead of asking again).
    asked: AtomicBitmap,
    /// Pages prefetched (the source may have left them to its push: a
    /// fault there still asks).
    prefetched: AtomicBitmap,
    /// The memfd held every page at the switch (preallocated): pages known
    /// to be zero are mapped as they are announced, not on a fault.
    prefilled: bool,
    /// Domain 0 is the vmm's own mapping; helpers follow.
    domains: RwLock<Vec<Arc<FaultDomain>>>,
    /// Pages that devices reach without the vCPU (`MigratableVm::
    /// device_pages`): mapped into the RAM clients as soon as they are
    /// here (`map_for_clients`), not on each client's first access.
    device: AtomicBitmap,
    /// Pages that are here (placed, or known zero and left as a hole).
    pub seen: Arc<AtomicBitmap>,
    present: AtomicU64,
    total: u64,
    waiters: Mutex<HashMap<u64, Waiter>>,
    latencies_us: Mutex<Vec<f64>>,
    pub faults: AtomicU64,
    pub pushed: AtomicU64,
    pub requested: AtomicU64,
    done: (Mutex<bool>, Condvar),
    /// Threads in [`wait_present`](Self::wait_present): `arrived` wakes
    /// them (and takes the lock only then).
    watchers: AtomicU64,
    arrivals: (Mutex<()>, Condvar),
}

impl Placer {
    /// Register the vmm's RAM mapping for missing and minor faults. Pages
    /// in `seen` are already here (in the memfd, not necessarily mapped);
    /// the vmm's mapping must not have been written through.
    pub fn new(ram: RamRegion, seen: Arc<AtomicBitmap>, alias: Arc<Alias>, maybe_nonzero: Arc<AtomicBitmap>) -> anyhow::Result<Placer> {
        let total = ram.pages();
        // Nothing here was written through the vmm's mapping (precopy
        // rounds of a hybrid write through the alias), so it has nothing
        // worth keeping mapped; what it maps must fault: drop it all (one
        // call, cheap on empty page tables). A stale page keeps its old
        // bytes in the memfd until replaced, unmapped everywhere.
        // SAFETY: the vmm's shared mapping of guest RAM.
        unsafe { zap(ram.host_addr as *mut libc::c_void, ram.len as usize) }.map_err(|e| anyhow::anyhow!("unmapping guest RAM: {e}"))?;
        let uffd = userfaultfd::UffdBuilder::new()
            .close_on_exec(true)
            .non_blocking(true)
            .user_mode_only(true)
            .create()
            .map_err(|e| anyhow::anyhow!("userfaultfd: {e}"))?;
        register_ram(&uffd, ram.host_addr as *mut libc::c_void, ram.len as usize)?;
        let claimed = seen.snapshot();
        // SAFETY: fstat of our memfd.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        let prefilled = unsafe { libc::fstat(ram.memfd, &mut st) } == 0 && st.st_blocks as u64 * 512 >= ram.len;
        let vmm = FaultDomain::new("vmm", uffd, vec![(ram.host_addr as u64, 0, ram.len)]);
        let present = seen.count_ones();
        Ok(Placer {
            ram,
            alias,
            maybe_nonzero,
            claimed,
            asked: AtomicBitmap::new(total),
            prefetched: AtomicBitmap::new(total),
            prefilled,
            domains: RwLock::new(vec![Arc::new(vmm)]),
            device: AtomicBitmap::new(total),
            seen,
            present: AtomicU64::new(present),
            total,
            waiters: Mutex::new(HashMap::new()),
            latencies_us: Mutex::new(Vec::new()),
            faults: AtomicU64::new(0),
            pushed: AtomicU64::new(0),
            requested: AtomicU64::new(0),
            done: (Mutex::new(present == total), Condvar::new()),
            watchers: AtomicU64::new(0),
            arrivals: (Mutex::new(()), Condvar::new()),
        })
    }

    /// A helper process's uffd joins (before the VM resumes).
    pub fn add_domain(&self, d: FaultDomain) -> anyhow::Result<()> {
        for r in &d.ranges {
            anyhow::ensure!(
                r.0 % PAGE == 0 && r.1 % PAGE == 0 && r.2 % PAGE == 0 && r.2 > 0 && r.1.checked_add(r.2).is_some_and(|e| e <= self.ram.len),
                "{}: range {r:?} is not page aligned inside guest RAM",
                d.name
            );
        }
        self.domains.write().unwrap().push(Arc::new(d));
        Ok(())
    }

    /// The pages of `ranges` are the devices' (`MigratableVm::
    /// device_pages`): map those here now into every RAM client, and the
    /// others as they arrive. A RAM client (rnicd) dropped its mappings
    /// when postcopy began, and each page it touched after the restart
    /// cost it a fault and a round trip through the fault thread, even a
    /// page that was here (with 256 QPs, 80-200 such faults, while every
    /// QP of its host waited).
    pub fn map_for_clients(&self, ranges: &[PageRange]) {
        self.mark_device(ranges);
        for r in ranges {
            let r = r.clipped(self.total);
            self.continue_in_clients(r.first, r.count);
        }
    }

    /// Map the pages of `[first, first + count)` that are here into every
    /// RAM client (best effort: a page mapped already, or a known-zero
    /// hole, is skipped; a fault maps what this misses).
    fn continue_in_clients(&self, first: u64, count: u64) {
        let doms = self.domains.read().unwrap();
        for d in doms.iter().skip(1).filter(|d| !d.gone.load(Ordering::Relaxed)) {
            for &(addr, off, len) in &d.ranges {
                let (lo, hi) = ((off / PAGE).max(first), ((off + len) / PAGE).min(first + count));
                let mut p = lo;
                while p < hi {
                    if !self.seen.get(p) {
                        p += 1;
                        continue;
                    }
                    let run = p;
                    while p < hi && self.seen.get(p) {
                        p += 1;
                    }
                    let at = |q: u64| addr + q * PAGE - off;
                    let mut q = run;
                    while q < p {
                        match uffd_continue(d.uffd.as_raw_fd(), at(q), (p - q) * PAGE) {
                            Ok(_) => break,
                            Err((libc::EAGAIN, n)) if n > 0 => q += n / PAGE,
                            // Mapped already, or a hole: skip that page.
                            Err((_, n)) => q += n / PAGE + 1,
                        }
                    }
                }
            }
        }
    }

    /// Fds to poll for faults, with their domain index.
    pub fn fault_fds(&self) -> Vec<(usize, i32)> {
        let doms = self.domains.read().unwrap();
        doms.iter().enumerate().filter(|(_, d)| !d.gone.load(Ordering::Relaxed)).map(|(i, d)| (i, d.uffd.as_raw_fd())).collect()
    }

    pub fn domain(&self, i: usize) -> Option<Arc<FaultDomain>> {
        self.domains.read().unwrap().get(i).cloned()
    }

    /// Pages of guest RAM.
    pub fn total(&self) -> u64 {
        self.total
    }

    pub fn is_complete(&self) -> bool {
        self.present.load(Ordering::Acquire) == self.total
    }

    pub fn missing(&self) -> u64 {
        self.total - self.present.load(Ordering::Acquire)
    }

    /// Wait up to `d` for the last page; true once all are here.
    pub fn wait_complete(&self, d: std::time::Duration) -> bool {
        let g = self.done.0.lock().unwrap();
        let (g, _) = self.done.1.wait_timeout_while(g, d, |done| !*done).unwrap();
        *g
    }

    /// Place whole pages from `pfn` on (`data` is one or more pages).
    /// Duplicates (the push and a request both answered) are harmless: a
    /// page someone else claimed is skipped.
    pub fn place(&self, pfn: u64, data: &[u8], via: Via) -> anyhow::Result<()> {
        let pages = data.len() as u64 / PAGE;
        self.for_claimed_runs(pfn, pages, |first, count| {
            let off = ((first - pfn) * PAGE) as usize;
            // SAFETY: [first, first + count) is inside guest RAM (callers
            // checked pfn + pages), and this thread alone claimed it.
            unsafe {
                std::ptr::copy_nonoverlapping(data.as_ptr().add(off), self.alias_page(first), (count * PAGE) as usize);
            }
            self.map(first, count, via, false)
        })
    }

    /// Claim page `pfn` if nobody has yet: the caller then writes it
    /// through [`alias_page`](Self::alias_page) and maps it ([`map_claimed`]
    /// (Self::map_claimed)) or gives it back ([`unclaim`](Self::unclaim)).
    pub fn claim(&self, pfn: u64) -> bool {
        self.claimed.test_and_set(pfn)
    }

    /// Claimed pages that were not written after all (their bytes did not
    /// arrive, or failed their check): someone else may place them.
    pub fn unclaim(&self, r: PageRange) {
        for p in r.first..r.end() {
            self.claimed.clear(p);
        }
    }

    /// Where claimed page `pfn` is written (never mapped into the guest
    /// until [`map_claimed`](Self::map_claimed)).
    pub fn alias_page(&self, pfn: u64) -> *mut u8 {
        debug_assert!(pfn < self.total);
        // SAFETY: pfn < total pages of the alias mapping (callers checked).
        unsafe { self.alias.base.add((pfn * PAGE) as usize) }
    }

    /// Map claimed pages written through the alias (and wake their waiters).
    pub fn map_claimed(&self, r: PageRange, via: Via) -> anyhow::Result<()> {
        self.map(r.first, r.count, via, false)
    }

    /// Pages known to be zero: nothing crosses the network or is written.
    /// In a preallocated memfd they are zero pages already and are mapped
    /// now; otherwise they stay holes and a fault maps a zero page.
    pub fn place_zero(&self, first: u64, count: u64, via: Via) {
        let _ = self.for_claimed_runs(first, count, |f, c| {
            let mut written = false;
            for p in f..f + c {
                if self.maybe_nonzero.get(p) {
                    // SAFETY: a claimed page inside guest RAM.
                    unsafe { std::ptr::write_bytes(self.alias_page(p), 0, PAGE as usize) };
                    written = true;
                }
            }
            if self.prefilled || written {
                self.map(f, c, via, true)
            } else {
                (f..f + c).for_each(|p| self.arrived(p, via));
                Ok(())
            }
        });
    }

    /// Call `f` on each run of pages in `[first, first + count)` that this
    /// thread claims (nobody else wrote or writes them).
    fn for_claimed_runs(&self, first: u64, count: u64, mut f: impl FnMut(u64, u64) -> anyhow::Result<()>) -> anyhow::Result<()> {
        let end = first + count;
        let mut p = first;
        while p < end {
            if !self.claimed.test_and_set(p) {
                p += 1;
                continue;
            }
            let run = p;
            p += 1;
            // Short runs: a fault on a page claimed here waits until the run
            // is mapped.
            while p < end && p - run < CLAIM_RUN && self.claimed.test_and_set(p) {
                p += 1;
            }
            // Nor may this thread lose its CPU to ordinary work meanwhile.
            let _rt = crate::priority::RealtimeSection::enter();
            f(run, p - run)?;
        }
        Ok(())
    }

    /// Map pages `[first, first + count)` into the vmm with
    /// `UFFDIO_CONTINUE` (waking its waiters), run by run. `each` hears of
    /// every page: `None` once mapped, `Some(errno)` for a page the kernel
    /// refused (`EAGAIN` is retried); that page is skipped unless `each`
    /// returns an error, which ends the walk.
    fn continue_pages(&self, first: u64, count: u64, mut each: impl FnMut(u64, Option<i32>) -> anyhow::Result<()>) -> anyhow::Result<()> {
        let uffd = self.domain(0).expect("vmm domain").uffd.as_raw_fd();
        let base = self.ram.host_addr as u64;
        let mut done = 0;
        while done < count {
            let r = uffd_continue(uffd, base + (first + done) * PAGE, (count - done) * PAGE);
            let mapped = match r {
                Ok(n) | Err((_, n)) => n / PAGE,
            };
            for p in first + done..first + done + mapped {
                each(p, None)?;
            }
            done += mapped;
            match r {
                Ok(_) | Err((libc::EAGAIN, _)) => {}
                Err((e, _)) => {
                    each(first + done, Some(e))?;
                    done += 1;
                }
            }
        }
        Ok(())
    }

    /// Map claimed, written pages into the vmm (waking its waiters) and mark
    /// them here. `zero_ok`: a page missing from the memfd is a known-zero
    /// hole, left for a fault to map.
    fn map(&self, first: u64, count: u64, via: Via, zero_ok: bool) -> anyhow::Result<()> {
        self.continue_pages(first, count, |p, err| match err {
            // Mapped now, or already (a fault resolved it first), or a
            // hole that is known zero.
            None | Some(libc::EEXIST) => {
                self.arrived(p, via);
                Ok(())
            }
            Some(libc::EFAULT) if zero_ok => {
                self.arrived(p, via);
                Ok(())
            }
            Some(e) => anyhow::bail!("mapping page {p} (of {first}..{}): {}", first + count, std::io::Error::from_raw_os_error(e)),
        })?;
        if (first..first + count).any(|p| self.device.get(p)) {
            self.continue_in_clients(first, count);
        }
        Ok(())
    }

    fn arrived(&self, pfn: u64, via: Via) {
        if !self.seen.test_and_set(pfn) {
            return;
        }
        match via {
            Via::Push => self.pushed.fetch_add(1, Ordering::Relaxed),
            Via::Request => self.requested.fetch_add(1, Ordering::Relaxed),
        };
        // Under the lock: a fault that checked `seen` before we set it has
        // registered its waiter by now, one that checks after sees the bit.
        let w = self.waiters.lock().unwrap().remove(&pfn);
        if let Some(w) = w {
            let domains = self.domains.read().unwrap();
            // Counted before the wake: a thread that goes on and asks for
            // the status at once finds its wait in it.
            self.latencies_us.lock().unwrap().push(w.since.elapsed().as_secs_f64() * 1e6);
            for (d, addr, since) in &w.who {
                domains[*d].note_wake(since.elapsed());
                domains[*d].resolve(*addr);
            }
        }
        if self.present.fetch_add(1, Ordering::AcqRel) + 1 == self.total {
            *self.done.0.lock().unwrap() = true;
            self.done.1.notify_all();
        }
        if self.watchers.load(Ordering::Acquire) > 0 {
            // Under the lock: a watcher checks `seen` holding it, so it
            // either saw this page or waits by now and hears this.
            let _g = self.arrivals.0.lock().unwrap();
            self.arrivals.1.notify_all();
        }
    }

    /// Wait until every page of `pages` is here, looking at `broken` every
    /// few milliseconds (a reason to give up). Ok(true) once they are all
    /// here, Ok(false) at `deadline`.
    pub fn wait_present(&self, pages: &[PageRange], deadline: Instant, mut broken: impl FnMut() -> Option<String>) -> Result<bool, String> {
        let mut left = pages.iter().flat_map(|r| r.first..r.end().min(self.total)).peekable();
        self.watchers.fetch_add(1, Ordering::AcqRel);
        let mut g = self.arrivals.0.lock().unwrap();
        let r = loop {
            while left.next_if(|&p| self.seen.get(p)).is_some() {}
            if left.peek().is_none() {
                break Ok(true);
            }
            let now = Instant::now();
            if now >= deadline {
                break Ok(false);
            }
            let slice = (deadline - now).min(std::time::Duration::from_millis(5));
            g = self.arrivals.1.wait_timeout(g, slice).unwrap().0;
            if let Some(why) = broken() {
                break Err(why);
            }
        };
        drop(g);
        self.watchers.fetch_sub(1, Ordering::AcqRel);
        r
    }

    /// The devices' pages (`MigratableVm::device_pages`): faults on them
    /// are counted apart (`FaultWaits::device_faults`), and once the RAM
    /// clients joined they are mapped into them as they are here
    /// ([`map_for_clients`](Self::map_for_clients)).
    pub fn mark_device(&self, ranges: &[PageRange]) {
        for r in ranges {
            self.device.set_range(r.clipped(self.total));
        }
    }

    /// The source sends `pages` unasked (the devices' pages of the
    /// switch): a fault on one of them waits for it rather than asking.
    pub fn expect(&self, pages: &[PageRange]) {
        for r in pages {
            self.asked.set_range(r.clipped(self.total));
        }
    }

    /// A thread of domain `d` faulted at `addr`: remember who waits, and
    /// say what to ask the source for. A guest that touched page p touches
    /// p+1 next more often than not, and would otherwise fault on nearly
    /// every page right behind the push, one round trip each: so the
    /// [`FAULT_WINDOW`] - 1 pages after a faulting page are prefetched
    /// (`soon`; the source sends those its push has not sent yet). A fault
    /// on a page being placed or asked for waits; on a prefetched page it
    /// waits a little for the push to deliver it (`later`: the fault
    /// thread asks for it if it has not come by then); else the page goes
    /// to `ask`.
    pub fn fault(&self, d: usize, addr: u64, out: &mut Asks) {
        let Some(dom) = self.domain(d) else { return };
        let Some(pfn) = dom.pfn_of(addr).filter(|&p| p < self.total) else {
            tracing::warn!("{}: fault at {addr:#x} outside guest RAM", dom.name);
            return;
        };
        let mut w = self.waiters.lock().unwrap();
        if self.seen.get(pfn) {
            drop(w);
            dom.waits.lock().unwrap().faults_present += 1;
            self.resolve_around(&dom, addr, pfn);
            return;
        }
        let now = Instant::now();
        dom.note_fault(self.device.get(pfn));
        match w.entry(pfn) {
            std::collections::hash_map::Entry::Occupied(mut e) => {
                e.get_mut().who.push((d, addr, now));
                return;
            }
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(Waiter { since: now, who: vec![(d, addr, now)] });
                self.faults.fetch_add(1, Ordering::Relaxed);
            }
        }
        drop(w);
        if self.claimed.get(pfn) || self.asked.get(pfn) {
            return;
        }
        if self.prefetched.get(pfn) {
            out.later.push(pfn);
            return;
        }
        self.ask_now(pfn, out);
        for p in pfn + 1..(pfn + FAULT_WINDOW).min(self.total) {
            if !self.claimed.get(p) && !self.asked.get(p) && self.prefetched.test_and_set(p) {
                out.soon.push(p);
            }
        }
    }

    /// A thread of `dom` faulted at `addr` on page `pfn`, which is here but
    /// not mapped in that process (a RAM client dropped its mappings when
    /// postcopy began; pages are placed into the vmm's mapping only). Map
    /// it with the pages after it that are here too, up to
    /// [`FAULT_WINDOW`], in one call, as the kernel's fault-around would:
    /// rnicd reading a 64 MiB WRITE's source faulted once per page, each a
    /// round trip through this thread.
    fn resolve_around(&self, dom: &FaultDomain, addr: u64, pfn: u64) {
        let a = addr & !(PAGE - 1);
        let Some(r) = dom.ranges.iter().find(|r| addr >= r.0 && addr < r.0 + r.2) else { return dom.resolve(addr) };
        let in_range = (r.0 + r.2 - a) / PAGE;
        let mut n = 1;
        while n < FAULT_WINDOW.min(in_range) && pfn + n < self.total && self.seen.get(pfn + n) {
            n += 1;
        }
        // Done if every page went in (which wakes the thread); else (a
        // known-zero hole, a page the process mapped meanwhile) the
        // faulting page on its own, which wakes it in every case.
        if n == 1 || uffd_continue(dom.uffd.as_raw_fd(), a, n * PAGE).is_err() {
            dom.resolve(addr);
        }
    }

    /// A page deferred by [`fault`](Self::fault) is still not here: ask.
    pub fn ask_now(&self, pfn: u64, out: &mut Asks) {
        if !self.seen.get(pfn) && !self.claimed.get(pfn) && self.asked.test_and_set(pfn) {
            out.now.push(pfn);
        }
    }

    /// After a reconnection, requests in flight are lost: ask again.
    pub fn forget_asked(&self) {
        self.asked.clear_all();
        self.prefetched.clear_all();
    }

    /// An urgent connection died with requests on it: forget what was
    /// asked and prefetched, and return every such page not here yet,
    /// marked asked again. The caller asks for each with a request, never
    /// a prefetch: the source answers a prefetch only with pages still in
    /// its push queue, and it took the lost ones out of it when it
    /// answered on the dead connection, so a prefetched page no thread
    /// waits on would otherwise never come.
    pub fn take_unanswered(&self) -> Vec<u64> {
        let mut out = Vec::new();
        for p in 0..self.total {
            let asked = self.asked.test_and_clear(p);
            let prefetched = self.prefetched.test_and_clear(p);
            if (asked || prefetched) && !self.seen.get(p) {
                self.asked.set(p);
                out.push(p);
            }
        }
        out
    }

    /// Pages threads wait for (asked again after a reconnection).
    pub fn waiting(&self) -> Vec<u64> {
        self.waiters.lock().unwrap().keys().copied().collect()
    }

    /// How long each fault domain's threads waited for pages so far (the
    /// vmm's first, then each RAM client's).
    pub fn fault_waits(&self) -> Vec<crate::stats::FaultWaits> {
        self.domains.read().unwrap().iter().map(|d| d.waits.lock().unwrap().clone()).collect()
    }

    /// (p50, p99, max) of fault-to-wake latency in microseconds.
    pub fn latency_percentiles(&self) -> (Option<f64>, Option<f64>, Option<f64>) {
        let mut v = self.latencies_us.lock().unwrap().clone();
        if v.is_empty() {
            return (None, None, None);
        }
        v.sort_by(|a, b| a.total_cmp(b));
        let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
        (Some(at(0.5)), Some(at(0.99)), v.last().copied())
    }

    /// Map into the vmm the pages that arrived before the switch (written
    /// through the alias, so not mapped yet): a background job after the
    /// VM runs, so that the guest does not fault on each of them. Pages
    /// without data stay for the fault path.
    pub fn premap(&self) {
        let wanted = |p: u64| self.seen.get(p) && self.maybe_nonzero.get(p);
        let mut p = 0;
        while p < self.total && !self.is_complete() {
            if !wanted(p) {
                p += 1;
                continue;
            }
            let first = p;
            while p < self.total && p - first < 512 && wanted(p) {
                p += 1;
            }
            let r = self.continue_pages(first, p - first, |at, err| match err {
                // Mapped now, or already (placed, or a fault came first).
                None | Some(libc::EEXIST) => Ok(()),
                Some(e) => anyhow::bail!("premapping page {at}: {}", std::io::Error::from_raw_os_error(e)),
            });
            if let Err(e) = r {
                tracing::debug!("{e:#}");
                return;
            }
        }
    }

    /// Every page is in: stop catching faults on the vmm's mapping (pages
    /// not mapped yet are in the memfd or are zero holes, which a plain
    /// fault now maps by itself).
    pub fn unregister_vmm(&self) {
        let vmm = self.domain(0).expect("vmm domain");
        if let Err(e) = vmm.uffd.unregister(self.ram.host_addr as *mut libc::c_void, self.ram.len as usize) {
            tracing::warn!("unregistering guest RAM from userfaultfd: {e}");
        }
    }
}

// RamRegion's raw pointer: the mapping lives as long as the VM.
unsafe impl Send for Placer {}
unsafe impl Sync for Placer {}
