//! Destination side of postcopy: pages are placed atomically with
//! `UFFDIO_COPY` (a thread never sees half a page), and every thread that
//! faulted on a page, in the vmm or in a helper process, is woken once it
//! is in.
//!
//! Guest RAM is a shared memfd, so a page placed through the vmm's mapping
//! is in the page cache for every other mapping too; a helper's fault only
//! needs a wake (or, for a page known to be zero, a zero page through its
//! own uffd).

use crate::pages::AtomicBitmap;
use crate::vm::RamRegion;
use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::Instant;
use userfaultfd::Uffd;

const PAGE: u64 = crate::dirty::PAGE_SIZE;

// linux/userfaultfd.h: the crate's copy() hides how much a failed copy
// placed, which a run with one page already there needs.
const UFFDIO_COPY: libc::c_ulong = 0xC028_AA03;
#[repr(C)]
struct UffdioCopy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copy: i64,
}

/// A process's missing-page userfaultfd over (part of) guest RAM.
pub struct FaultDomain {
    pub uffd: Uffd,
    /// (address in that process, guest RAM offset, bytes), page aligned.
    pub ranges: Vec<(u64, u64, u64)>,
    pub name: String,
    /// Its process is gone (the uffd hung up): stop polling it.
    pub gone: std::sync::atomic::AtomicBool,
}

impl FaultDomain {
    fn pfn_of(&self, addr: u64) -> Option<u64> {
        self.ranges.iter().find(|r| addr >= r.0 && addr < r.0 + r.2).map(|r| (r.1 + addr - r.0) / PAGE)
    }
    /// The page at `addr` is in (or known zero): let the faulting thread go.
    fn resolve(&self, addr: u64) {
        let a = (addr & !(PAGE - 1)) as *mut libc::c_void;
        // A zero page where nothing is (a page known to be zero), else
        // EEXIST: the page is there and the thread only needs waking.
        // SAFETY: `a` is one registered page of that process's mapping.
        if unsafe { self.uffd.zeropage(a, PAGE as usize, true) }.is_err() {
            if let Err(e) = self.uffd.wake(a, PAGE as usize) {
                tracing::warn!("{}: waking a fault at {addr:#x}: {e}", self.name);
            }
        }
    }
}

struct Waiter {
    since: Instant,
    who: Vec<(usize, u64)>, // (domain index, faulting address)
}

/// Who placed a page (for the pushed/requested statistics).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Via {
    Push,
    Request,
}

pub struct Placer {
    ram: RamRegion,
    /// Domain 0 is the vmm's own mapping; helpers follow.
    domains: RwLock<Vec<Arc<FaultDomain>>>,
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
}

impl Placer {
    /// Register the vmm's RAM mapping for missing-page faults. Pages in
    /// `seen` are already here; every other page must be a hole now.
    pub fn new(ram: RamRegion, seen: Arc<AtomicBitmap>) -> anyhow::Result<Placer> {
        let uffd = userfaultfd::UffdBuilder::new()
            .close_on_exec(true)
            .non_blocking(true)
            .user_mode_only(true)
            .create()
            .map_err(|e| anyhow::anyhow!("userfaultfd: {e}"))?;
        uffd.register(ram.host_addr as *mut libc::c_void, ram.len as usize)
            .map_err(|e| anyhow::anyhow!("registering guest RAM for missing-page faults: {e}"))?;
        let vmm = FaultDomain { uffd, ranges: vec![(ram.host_addr as u64, 0, ram.len)], name: "vmm".into(), gone: Default::default() };
        let present = seen.count_ones();
        Ok(Placer {
            ram,
            domains: RwLock::new(vec![Arc::new(vmm)]),
            seen,
            present: AtomicU64::new(present),
            total: ram.pages(),
            waiters: Mutex::new(HashMap::new()),
            latencies_us: Mutex::new(Vec::new()),
            faults: AtomicU64::new(0),
            pushed: AtomicU64::new(0),
            requested: AtomicU64::new(0),
            done: (Mutex::new(present == ram.pages()), Condvar::new()),
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

    /// Fds to poll for faults, with their domain index.
    pub fn fault_fds(&self) -> Vec<(usize, i32)> {
        let doms = self.domains.read().unwrap();
        doms.iter().enumerate().filter(|(_, d)| !d.gone.load(Ordering::Relaxed)).map(|(i, d)| (i, d.uffd.as_raw_fd())).collect()
    }

    pub fn domain(&self, i: usize) -> Option<Arc<FaultDomain>> {
        self.domains.read().unwrap().get(i).cloned()
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
    /// page already there is skipped.
    pub fn place(&self, pfn: u64, data: &[u8], via: Via) -> anyhow::Result<()> {
        let pages = data.len() as u64 / PAGE;
        let uffd = self.domain(0).expect("vmm domain").uffd.as_raw_fd();
        let mut done = 0u64;
        while done < pages {
            // Pages already here are skipped, not copied: once all are here
            // the range is unregistered and a copy would fail.
            if self.seen.get(pfn + done) {
                done += 1;
                continue;
            }
            let mut c = UffdioCopy {
                dst: self.ram.host_addr as u64 + (pfn + done) * PAGE,
                src: data.as_ptr() as u64 + done * PAGE,
                len: (pages - done) * PAGE,
                mode: 0,
                copy: 0,
            };
            // SAFETY: dst is inside the registered RAM mapping, src inside
            // `data`, both for `len` bytes.
            let r = unsafe { libc::ioctl(uffd, UFFDIO_COPY as _, &mut c as *mut UffdioCopy) };
            // Before anything else can overwrite errno (waking does ioctls).
            let err = std::io::Error::last_os_error();
            let copied = if c.copy > 0 { c.copy as u64 / PAGE } else { 0 };
            for p in pfn + done..pfn + done + copied {
                self.arrived(p, via);
            }
            done += copied;
            if r == 0 {
                // Everything asked was copied.
                for p in pfn + done..pfn + pages {
                    self.arrived(p, via);
                }
                break;
            }
            match err.raw_os_error() {
                // That page is there already: count it, go on after it.
                Some(libc::EEXIST) => {
                    self.arrived(pfn + done, via);
                    done += 1;
                }
                Some(libc::EAGAIN) => {}
                // Placed by someone else meanwhile (and maybe unregistered).
                _ if self.seen.get(pfn + done) => done += 1,
                _ => anyhow::bail!("placing pages {}..{}: {err}", pfn + done, pfn + pages),
            }
        }
        Ok(())
    }

    /// Pages known to be zero: they stay holes until touched, then a fault
    /// maps a zero page (no byte crosses the network or is written).
    pub fn place_zero(&self, first: u64, count: u64, via: Via) {
        for pfn in first..first + count {
            self.arrived(pfn, via);
        }
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
            for (d, addr) in &w.who {
                domains[*d].resolve(*addr);
            }
            self.latencies_us.lock().unwrap().push(w.since.elapsed().as_secs_f64() * 1e6);
        }
        if self.present.fetch_add(1, Ordering::AcqRel) + 1 == self.total {
            *self.done.0.lock().unwrap() = true;
            self.done.1.notify_all();
        }
    }

    /// A thread of domain `d` faulted at `addr`. Returns the page to
    /// request from the source if nobody asked for it yet.
    pub fn fault(&self, d: usize, addr: u64) -> Option<u64> {
        let dom = self.domain(d)?;
        let Some(pfn) = dom.pfn_of(addr).filter(|&p| p < self.total) else {
            tracing::warn!("{}: fault at {addr:#x} outside guest RAM", dom.name);
            return None;
        };
        let mut w = self.waiters.lock().unwrap();
        if self.seen.get(pfn) {
            drop(w);
            dom.resolve(addr);
            return None;
        }
        match w.entry(pfn) {
            std::collections::hash_map::Entry::Occupied(mut e) => {
                e.get_mut().who.push((d, addr));
                None
            }
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(Waiter { since: Instant::now(), who: vec![(d, addr)] });
                self.faults.fetch_add(1, Ordering::Relaxed);
                Some(pfn)
            }
        }
    }

    /// Pages threads wait for (asked again after a reconnection).
    pub fn waiting(&self) -> Vec<u64> {
        self.waiters.lock().unwrap().keys().copied().collect()
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

    /// Every page is in: stop catching faults on the vmm's mapping (holes
    /// left are zero pages, which a plain fault now maps by itself).
    pub fn unregister_vmm(&self) {
        let vmm = self.domain(0).expect("vmm domain");
        if let Err(e) = vmm.uffd.unregister(self.ram.host_addr as *mut libc::c_void, self.ram.len as usize) {
            tracing::warn!("unregistering guest RAM from userfaultfd: {e}");
        }
    }
}
