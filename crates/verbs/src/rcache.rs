//! A registration cache for ordinary process memory, as UCX's rcache
//! (docs/mkeys.md): registering a range already registered is a hit;
//! overlapping ranges merge into one region; the cache is bounded (regions
//! and bytes) with least-recently-used eviction of regions nobody holds; and
//! unmapping, remapping or `madvise(MADV_DONTNEED)` of a registered range
//! invalidates its region, so a reused address never reaches stale memory.
//!
//! rnicd reaches client memory only through memfds, so a registered range
//! moves onto the cache's memfd at the file offset equal to its address
//! (its content is copied in, then the memfd is mapped MAP_SHARED|MAP_FIXED
//! over it); the program keeps its pointers. Regions are whole pages.
//!
//! Invalidation uses userfaultfd's non-cooperative events: every moved range
//! is registered with the cache's userfaultfd, and the kernel reports
//! UNMAP (munmap, or an mmap/mremap over it), REMOVE (MADV_DONTNEED /
//! MADV_REMOVE) and REMAP (mremap), making the caller wait until the event
//! was read. A thread reads the events (holding only the `pending` lock)
//! and applies them; `register` takes the same lock and applies whatever was
//! read before it looks anything up. So a register after munmap returned
//! always sees the munmap: its region is deregistered and its file pages
//! punched out before the new memory moves onto the memfd, and data a peer
//! writes through the old key lands in the punched pages, never in the new
//! buffer.

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context as _};
use rnic::proto::{Reply, Request};
use userfaultfd::{Event, FeatureFlags, Uffd, UffdBuilder};

use crate::proc_maps::vmas;
use crate::{Context, Mr, Pd, Sge};

const PAGE: u64 = 4096;
/// The memfd's size: the whole x86-64 user address space (sparse).
const SPAN: u64 = 1 << 47;

/// Counters of a cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct RcacheStats {
    pub hits: u64,
    pub misses: u64,
    /// Misses that absorbed overlapping regions.
    pub merges: u64,
    pub evictions: u64,
    /// Regions dropped because their memory was unmapped, remapped or discarded.
    pub invalidations: u64,
    pub regions: u64,
    pub bytes: u64,
}

/// What the kernel told us about registered memory.
#[derive(Clone, Copy, Debug)]
enum Change {
    /// munmap: the region goes and its file pages are punched.
    Unmapped { start: u64, end: u64 },
    /// MADV_DONTNEED/REMOVE or mremap: the region goes.
    Dropped { start: u64, end: u64 },
    /// A missing-page fault (should not happen: moved pages are all
    /// present); answered with a zero page so the thread never hangs.
    Fault { addr: u64 },
}

struct Region {
    start: u64,
    end: u64,
    mr: Mr,
    /// Registrations handed out and not dropped: never evicted while > 0.
    refs: u32,
    last_use: u64,
}

#[derive(Default)]
struct State {
    /// Live regions by start address (non-overlapping).
    live: BTreeMap<u64, u64>,
    /// Every region by ID, live or retired (merged away while still held).
    regions: HashMap<u64, Region>,
    next_id: u64,
    tick: u64,
    bytes: u64,
    stats: RcacheStats,
}

struct Shared {
    ctx: Context,
    pd: u32,
    access: u32,
    max_regions: usize,
    max_bytes: u64,
    memfd: OwnedFd,
    memfd_name: String,
    uffd: Uffd,
    state: Mutex<State>,
    pending: Mutex<Vec<Change>>,
}

/// The cache; see the module documentation.
pub struct Rcache {
    shared: Arc<Shared>,
    stop: OwnedFd,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// A registered range handed out by [`Rcache::register`]: its keys work for
/// the region that holds it (at least the range asked for) until the memory
/// is unmapped, remapped or discarded.
pub struct Registration<'a> {
    cache: &'a Rcache,
    id: u64,
    pub lkey: u32,
    pub rkey: u32,
    /// The region (page aligned, possibly larger than asked for).
    pub addr: u64,
    pub len: u64,
}

impl Registration<'_> {
    /// An SGE of `len` bytes at address `addr` (inside the region).
    pub fn sge(&self, addr: u64, len: u32) -> Sge {
        Sge { addr, length: len, lkey: self.lkey }
    }
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        let mut guard = self.cache.shared.state.lock().unwrap_or_else(|e| e.into_inner());
        let st = &mut *guard;
        let retired = match st.regions.get_mut(&self.id) {
            Some(r) => {
                r.refs = r.refs.saturating_sub(1);
                r.refs == 0 && st.live.get(&r.start) != Some(&self.id)
            }
            None => false,
        };
        if retired {
            st.regions.remove(&self.id);
        }
    }
}

static NEXT_CACHE: AtomicU64 = AtomicU64::new(0);

impl Rcache {
    /// A cache registering with `access` in `pd`, holding at most
    /// `max_regions` regions and `max_bytes` bytes.
    pub fn new(pd: &Pd, access: u32, max_regions: usize, max_bytes: u64) -> anyhow::Result<Rcache> {
        let memfd_name = format!("transit-rcache-{}-{}", std::process::id(), NEXT_CACHE.fetch_add(1, Ordering::Relaxed));
        let cname = std::ffi::CString::new(memfd_name.clone())?;
        // SAFETY: plain syscalls; results checked.
        let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error()).context("memfd_create");
        }
        let memfd = unsafe { OwnedFd::from_raw_fd(fd) };
        if unsafe { libc::ftruncate(memfd.as_raw_fd(), SPAN as libc::off_t) } < 0 {
            return Err(std::io::Error::last_os_error()).context("ftruncate");
        }
        // rnicd maps only memfds that cannot shrink under it.
        if unsafe { libc::fcntl(memfd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW) } < 0 {
            return Err(std::io::Error::last_os_error()).context("seal memfd");
        }
        let uffd = UffdBuilder::new()
            .close_on_exec(true)
            .non_blocking(true)
            .user_mode_only(true)
            .require_features(FeatureFlags::EVENT_UNMAP | FeatureFlags::EVENT_REMOVE | FeatureFlags::EVENT_REMAP)
            .create()
            .context("userfaultfd with UNMAP/REMOVE/REMAP events (root, or vm.unprivileged_userfaultfd=1)")?;
        let shared = Arc::new(Shared {
            ctx: pd.ctx.clone(),
            pd: pd.handle,
            access,
            max_regions: max_regions.max(1),
            max_bytes,
            memfd,
            memfd_name,
            uffd,
            state: Mutex::new(State::default()),
            pending: Mutex::new(Vec::new()),
        });
        let stop = rnic::eventfd::create(true)?;
        let (s2, stopfd) = (shared.clone(), stop.as_raw_fd());
        let thread = std::thread::Builder::new().name("rcache-events".into()).spawn(move || s2.event_loop(stopfd))?;
        Ok(Rcache { shared, stop, thread: Some(thread) })
    }

    /// A registration covering [addr, addr+len): a hit if a region holds it,
    /// else a new region (merging the regions it overlaps) registered now.
    pub fn register(&self, addr: u64, len: u64) -> anyhow::Result<Registration<'_>> {
        if len == 0 {
            bail!("empty range");
        }
        let s = addr & !(PAGE - 1);
        let e = addr.checked_add(len).context("range overflows")?.div_ceil(PAGE) * PAGE;
        if e > SPAN {
            bail!("range beyond the user address space");
        }
        let sh = &*self.shared;
        let mut st = sh.state.lock().unwrap_or_else(|e| e.into_inner());
        // Anything unmapped before this call is applied before the lookup.
        sh.collect_events();
        sh.apply_pending(&mut st);
        st.tick += 1;
        let tick = st.tick;
        if let Some((_, &id)) = st.live.range(..=s).next_back() {
            let r = st.regions.get_mut(&id).expect("live regions exist");
            if r.end >= e {
                r.refs += 1;
                r.last_use = tick;
                let (lkey, rkey, start, end) = (r.mr.lkey, r.mr.rkey, r.start, r.end);
                st.stats.hits += 1;
                return Ok(Registration { cache: self, id, lkey, rkey, addr: start, len: end - start });
            }
        }
        // Miss: the union with every overlapping live region.
        let overlapping: Vec<u64> = st.live.range(..e).rev().map(|(_, &id)| id).take_while(|id| st.regions[id].end > s).collect();
        let (mut us, mut ue) = (s, e);
        for id in &overlapping {
            us = us.min(st.regions[id].start);
            ue = ue.max(st.regions[id].end);
        }
        move_to_memfd(sh.memfd.as_raw_fd(), &sh.memfd_name, us, ue)?;
        sh.uffd.register(us as *mut libc::c_void, (ue - us) as usize).context("userfaultfd register")?;
        // Moving may have replaced a mapping registered earlier (one that
        // mremap moved here): that unmap is ours, not the program's.
        sh.collect_events();
        sh.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|c| !matches!(*c, Change::Unmapped { start, end } if start >= us && end <= ue));
        sh.apply_pending(&mut st);
        let req = Request::RegMr { pd: sh.pd, iova: us, len: ue - us, access: sh.access, fd_offset: us, key: None };
        let mr = match sh.ctx.inner.call(&req, &[sh.memfd.as_raw_fd()])? {
            Reply::Mr { lkey, rkey } => Mr { ctx: sh.ctx.clone(), lkey, rkey, addr: us, len: (ue - us) as usize },
            r => bail!("unexpected reply {r:?}"),
        };
        st.stats.misses += 1;
        if !overlapping.is_empty() {
            st.stats.merges += 1;
        }
        for id in overlapping {
            // Retired: out of the lookup; freed once nobody holds it (its
            // pages are the same file pages as the new region's).
            let r = &st.regions[&id];
            let (start, len, held) = (r.start, r.end - r.start, r.refs > 0);
            st.live.remove(&start);
            st.bytes -= len;
            if !held {
                st.regions.remove(&id);
            }
        }
        st.next_id += 1;
        let id = st.next_id;
        let (lkey, rkey) = (mr.lkey, mr.rkey);
        st.regions.insert(id, Region { start: us, end: ue, mr, refs: 1, last_use: tick });
        st.live.insert(us, id);
        st.bytes += ue - us;
        sh.evict(&mut st, id);
        Ok(Registration { cache: self, id, lkey, rkey, addr: us, len: ue - us })
    }

    pub fn stats(&self) -> RcacheStats {
        let st = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
        RcacheStats { regions: st.live.len() as u64, bytes: st.bytes, ..st.stats }
    }

    /// Applies the kernel's events read so far (tests call this to observe
    /// an invalidation without registering).
    pub fn sync(&self) {
        let sh = &*self.shared;
        let mut st = sh.state.lock().unwrap_or_else(|e| e.into_inner());
        sh.collect_events();
        sh.apply_pending(&mut st);
    }

    /// Drops every region nobody holds.
    pub fn flush(&self) {
        let sh = &*self.shared;
        let mut st = sh.state.lock().unwrap_or_else(|e| e.into_inner());
        let idle: Vec<u64> = st.live.values().copied().filter(|id| st.regions[id].refs == 0).collect();
        for id in idle {
            sh.drop_region(&mut st, id);
        }
    }
}

impl Drop for Rcache {
    fn drop(&mut self) {
        rnic::eventfd::signal(&self.stop);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let mut st = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
        st.live.clear();
        st.regions.clear();
    }
}

impl Shared {
    /// Reads the events the kernel queued (munmap and friends wait for this).
    fn collect_events(&self) {
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        while let Ok(Some(ev)) = self.uffd.read_event() {
            let c = match ev {
                Event::Unmap { start, end } => Change::Unmapped { start: start as u64, end: end as u64 },
                Event::Remove { start, end } => Change::Dropped { start: start as u64, end: end as u64 },
                Event::Remap { from, len, .. } => Change::Dropped { start: from as u64, end: from as u64 + len as u64 },
                Event::Pagefault { addr, .. } => Change::Fault { addr: addr as u64 },
                Event::Fork { .. } => continue,
            };
            p.push(c);
        }
    }

    fn apply_pending(&self, st: &mut State) {
        let changes = std::mem::take(&mut *self.pending.lock().unwrap_or_else(|e| e.into_inner()));
        for c in changes {
            match c {
                Change::Unmapped { start, end } => {
                    self.invalidate(st, start, end);
                    // SAFETY: frees the file pages of the unmapped range (file offset = address).
                    unsafe {
                        libc::fallocate(
                            self.memfd.as_raw_fd(),
                            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                            start as libc::off_t,
                            (end - start) as libc::off_t,
                        )
                    };
                }
                Change::Dropped { start, end } => self.invalidate(st, start, end),
                Change::Fault { addr } => {
                    // SAFETY: resolves a fault in a range we registered.
                    let _ = unsafe { self.uffd.zeropage((addr & !(PAGE - 1)) as *mut libc::c_void, PAGE as usize, true) };
                }
            }
        }
    }

    /// Every region (live or retired) touching [start, end) goes, held or not:
    /// its memory is gone.
    fn invalidate(&self, st: &mut State, start: u64, end: u64) {
        let hit: Vec<u64> = st.regions.iter().filter(|(_, r)| r.start < end && r.end > start).map(|(id, _)| *id).collect();
        for id in hit {
            st.stats.invalidations += 1;
            self.drop_region(st, id);
        }
    }

    /// Removes a region (deregistering its MR); a held registration then
    /// finds it gone.
    fn drop_region(&self, st: &mut State, id: u64) {
        if let Some(r) = st.regions.remove(&id) {
            if st.live.get(&r.start) == Some(&id) {
                st.live.remove(&r.start);
                st.bytes -= r.end - r.start;
            }
        }
    }

    /// Least recently used regions nobody holds go until the cache fits.
    fn evict(&self, st: &mut State, keep: u64) {
        while st.live.len() > self.max_regions || st.bytes > self.max_bytes {
            let victim =
                st.live.values().copied().filter(|id| *id != keep && st.regions[id].refs == 0).min_by_key(|id| st.regions[id].last_use);
            let Some(id) = victim else { break };
            st.stats.evictions += 1;
            self.drop_region(st, id);
        }
    }

    fn event_loop(&self, stop: libc::c_int) {
        loop {
            let mut fds = [
                libc::pollfd { fd: self.uffd.as_raw_fd(), events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: stop, events: libc::POLLIN, revents: 0 },
            ];
            // SAFETY: two valid pollfds.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
            if n < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                return;
            }
            if fds[1].revents != 0 {
                return;
            }
            if fds[0].revents != 0 {
                // Reading releases the waiting munmap; applying needs the
                // state lock, which a register may hold meanwhile.
                self.collect_events();
                let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
                self.apply_pending(&mut st);
            }
        }
    }
}

/// Moves the pages of [s, e) that are not on the memfd yet onto it, at
/// file offset = address, keeping their content and protection.
fn move_to_memfd(fd: libc::c_int, name: &str, s: u64, e: u64) -> anyhow::Result<()> {
    let vs = vmas(s, e, name).context("read /proc/self/maps")?;
    let mut at = s;
    for v in &vs {
        if v.start > at {
            bail!("{at:#x}..{:#x} is not mapped", v.start);
        }
        let (a, b) = (v.start.max(s), v.end.min(e));
        at = b;
        if v.on_memfd {
            continue;
        }
        if v.prot & libc::PROT_READ == 0 {
            bail!("{a:#x}..{b:#x} is not readable");
        }
        let mut done = 0u64;
        while done < b - a {
            // SAFETY: reads mapped, readable memory of ours into the file.
            let n = unsafe { libc::pwrite(fd, (a + done) as *const libc::c_void, (b - a - done) as usize, (a + done) as libc::off_t) };
            if n <= 0 {
                return Err(std::io::Error::last_os_error()).context("copy into the memfd");
            }
            done += n as u64;
        }
        // SAFETY: replaces the pages just copied with the same content, shared.
        let p = unsafe {
            libc::mmap(a as *mut libc::c_void, (b - a) as usize, v.prot, libc::MAP_SHARED | libc::MAP_FIXED, fd, a as libc::off_t)
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error()).context("map the memfd over the range");
        }
    }
    if at < e {
        bail!("{at:#x}..{e:#x} is not mapped");
    }
    Ok(())
}
