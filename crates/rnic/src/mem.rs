//! Shared memory: sealed memfds and their mappings ("DMA" windows of rnicd).
//!
//! A client could shrink a memfd under rnicd and make its next access fault
//! (SIGBUS). rnicd therefore maps only memfds sealed against shrinking and
//! checks the size first.
//!
//! A memfd sealed against growing too (guest RAM is one) is mapped once,
//! whole: its *window*, shared by every memory region on it, whichever
//! client or namespace registered them. A process that must watch its
//! accesses to that memory (rnicd as a postcopy RAM client, `ramclient`)
//! then has one mapping to register, which covers the regions registered
//! later as well as those already there.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, LazyLock, Mutex, Weak};

use anyhow::{bail, Context as _};

/// A MAP_SHARED mapping, unmapped on drop; or a view into a window, which
/// keeps the window mapped while it lives.
pub struct Mapping {
    ptr: *mut u8,
    len: usize,
    window: Option<Arc<Mapping>>,
    /// Made by [`Mapping::map_at`] over memory its caller owns: dropping it
    /// puts private anonymous pages over the range in one step instead of
    /// unmapping, so that no other mapping can land in a gap meanwhile
    /// and the caller gets its range back mapped.
    placed: bool,
}

/// A file: (device, inode).
type FileId = (u64, u64);

/// The windows mapped now, by file. Only the control path (registering a
/// memory region) takes this lock.
static WINDOWS: LazyLock<Mutex<HashMap<FileId, Weak<Mapping>>>> = LazyLock::new(Default::default);

/// The window of `fd`, a memfd sealed against shrinking and growing and
/// open for reading and writing: all of it, mapped once per process.
pub fn window(fd: &OwnedFd) -> anyhow::Result<Arc<Mapping>> {
    // SAFETY: fcntl/fstat on an owned fd.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 || seals & (libc::F_SEAL_SHRINK | libc::F_SEAL_GROW) != libc::F_SEAL_SHRINK | libc::F_SEAL_GROW {
        bail!("a shared window needs a memfd sealed with F_SEAL_SHRINK and F_SEAL_GROW");
    }
    // The window is mapped read-write for every region on the file: a
    // descriptor that could not map it so itself gets nothing from it.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    if flags < 0 || flags & libc::O_ACCMODE != libc::O_RDWR {
        bail!("memory must be open for reading and writing");
    }
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } < 0 {
        bail!("fstat failed");
    }
    let id = (st.st_dev, st.st_ino);
    let mut windows = WINDOWS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(w) = windows.get(&id).and_then(Weak::upgrade) {
        return Ok(w);
    }
    let w = Arc::new(Mapping::map(fd, 0, st.st_size as usize)?);
    w.advise_huge_pages();
    windows.retain(|_, w| w.strong_count() > 0);
    windows.insert(id, Arc::downgrade(&w));
    prefault_present(&w);
    Ok(w)
}

// SAFETY: the mapping is plain shared memory; users synchronise as DMA would.
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `fd` at `offset` (page aligned), read-write.
    pub fn map(fd: &OwnedFd, offset: u64, len: usize) -> anyhow::Result<Mapping> {
        if len == 0 {
            return Ok(Mapping { ptr: std::ptr::NonNull::<u64>::dangling().as_ptr() as *mut u8, len: 0, window: None, placed: false });
        }
        if !offset.is_multiple_of(4096) {
            bail!("mapping offset {offset} is not page aligned");
        }
        // SAFETY: mmap of a file descriptor we own; result checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                offset as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error()).context("mmap");
        }
        Ok(Mapping { ptr: p as *mut u8, len, window: None, placed: false })
    }

    /// Maps `len` bytes of `fd` at `offset` read-write over the caller's
    /// memory at `addr` (both page aligned; MAP_FIXED replaces the pages
    /// there): a queue placed in memory a program allocated (a parent
    /// domain's allocator in the ibverbs drop-in). Dropping it unmaps the
    /// range, leaving a hole the owner of the memory must map again.
    ///
    /// # Safety
    /// `[addr, addr + len)` must be memory the caller owns and nothing else
    /// uses while this mapping lives.
    pub unsafe fn map_at(fd: &OwnedFd, offset: u64, len: usize, addr: *mut u8) -> anyhow::Result<Mapping> {
        if !offset.is_multiple_of(4096) || !(addr as usize).is_multiple_of(4096) || len == 0 {
            bail!("mapping at {addr:?} (offset {offset}, {len} bytes) is not page aligned");
        }
        let prot = libc::PROT_READ | libc::PROT_WRITE;
        let p = libc::mmap(addr as *mut libc::c_void, len, prot, libc::MAP_SHARED | libc::MAP_FIXED, fd.as_raw_fd(), offset as libc::off_t);
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error()).context("mmap");
        }
        Ok(Mapping { ptr: p as *mut u8, len, window: None, placed: true })
    }

    /// Maps a memory region's `len` bytes at `offset` of a memfd from a
    /// client: a view of the file's window when it has one (sealed against
    /// growing too), else a mapping of its own ([`Mapping::map_sealed`]).
    pub fn map_region(fd: &OwnedFd, offset: u64, len: usize) -> anyhow::Result<Mapping> {
        let Ok(w) = window(fd) else { return Mapping::map_sealed(fd, offset, len) };
        let end = offset.checked_add(len as u64).context("range overflows")?;
        if end > w.len as u64 {
            bail!("range {offset}+{len} is beyond the memfd size {}", w.len);
        }
        // SAFETY: inside the window, which the view keeps mapped.
        let ptr = unsafe { w.ptr.add(offset as usize) };
        Ok(Mapping { ptr, len, window: Some(w), placed: false })
    }

    /// Maps a memfd received from a client after checking it cannot shrink.
    pub fn map_sealed(fd: &OwnedFd, offset: u64, len: usize) -> anyhow::Result<Mapping> {
        // SAFETY: fcntl/fstat on an owned fd.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            bail!("memory must be a memfd sealed with F_SEAL_SHRINK");
        }
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } < 0 {
            bail!("fstat failed");
        }
        let end = offset.checked_add(len as u64).context("range overflows")?;
        if end > st.st_size as u64 {
            bail!("range {offset}+{len} is beyond the memfd size {}", st.st_size);
        }
        let page_off = offset & !4095;
        let m = Mapping::map(fd, page_off, len + (offset - page_off) as usize)?;
        // SAFETY: the offset is inside the fresh mapping; Drop re-derives the page base.
        let ptr = unsafe { m.ptr.add((offset - page_off) as usize) };
        std::mem::forget(m);
        Ok(Mapping { ptr, len, window: None, placed: false })
    }

    /// Faults the mapping's first `bytes` in now (MADV_POPULATE_WRITE), for
    /// queue rings: see [`crate::ring::FIRST_USE_BYTES`]. Best effort: an
    /// older kernel without it just faults later.
    pub fn populate_first(&self, bytes: usize) {
        const MADV_POPULATE_WRITE: libc::c_int = 23;
        let base = self.ptr as usize & !4095;
        let len = (self.len + (self.ptr as usize - base)).min(bytes);
        if self.len > 0 && len > 0 {
            // SAFETY: advice on our own mapping's pages.
            unsafe { libc::madvise(base as *mut libc::c_void, len, MADV_POPULATE_WRITE) };
        }
    }

    /// Asks for transparent huge pages (MADV_HUGEPAGE) on the mapping: a
    /// page rnicd's WRITE allocates comes as a 2 MiB folio (where the
    /// host's shmem_enabled allows it), and a 2 MiB folio already in the
    /// file maps with one page-table entry, so that mapping guest RAM in
    /// ([`prefault_present`]) and unmapping it when its last region goes
    /// cost 1/512 of what 4 KiB pages do (with those, the unmap alone was
    /// the largest item of rnicd's profile in a migration). Best effort,
    /// like [`Mapping::populate_first`].
    pub fn advise_huge_pages(&self) {
        if self.len > 0 && self.window.is_none() {
            // SAFETY: advice on our own mapping; it changes no contents.
            unsafe { libc::madvise(self.ptr as *mut libc::c_void, self.len, libc::MADV_HUGEPAGE) };
        }
    }

    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // A view: the window unmaps itself when its last view is gone.
        if self.len > 0 && self.window.is_none() {
            let base = self.ptr as usize & !4095;
            let len = self.len + (self.ptr as usize - base);
            if self.placed {
                // SAFETY: replacing, in one call, the pages this value
                // mapped over its caller's range with fresh private ones.
                // Should that fail, the file's pages stay: leaked, but
                // still memory.
                unsafe {
                    libc::mmap(
                        base as *mut libc::c_void,
                        len,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                        -1,
                        0,
                    )
                };
                return;
            }
            // SAFETY: unmapping the pages this value mapped.
            unsafe { libc::munmap(base as *mut libc::c_void, len) };
        }
    }
}

/// Host memory of one resolved range: one piece, or one per run of a
/// scattered region or binding entry it crosses.
pub enum Span {
    One(*mut u8),
    Many(Vec<(*mut u8, usize)>),
}

impl Span {
    /// Copies `data` into the span (which is exactly `data.len()` bytes).
    ///
    /// # Safety
    /// The span must come from `Keys::resolve` for `data.len()` bytes, in
    /// this packet's handling (no table change in between).
    pub unsafe fn write(&self, data: &[u8]) {
        match self {
            Span::One(p) => std::ptr::copy_nonoverlapping(data.as_ptr(), *p, data.len()),
            Span::Many(v) => {
                let mut off = 0;
                for (p, n) in v {
                    std::ptr::copy_nonoverlapping(data[off..].as_ptr(), *p, *n);
                    off += n;
                }
            }
        }
    }

    /// Copies `data` into the span as `write` does, with streaming
    /// (non-temporal) stores for pieces of [`STREAM_MIN`] bytes or more
    /// when [`streaming_enabled`]: the incoming WRITE payloads of a
    /// migration land in guest RAM that is not in any cache, and a plain
    /// copy first reads every destination line from memory, then evicts
    /// the cached packets the next ICRC check reads (see "Data path
    /// costs" in docs/rnic.md). Streaming stores are weakly ordered: the
    /// caller must call [`fence_streamed`] before anything that tells
    /// another process the bytes are there (a CQE, an ACK). Fencing after
    /// every packet instead stalled the loop until each packet's lines
    /// had reached memory.
    ///
    /// # Safety
    /// As `write`.
    pub unsafe fn write_streaming(&self, data: &[u8]) {
        if !streaming_enabled() {
            return self.write(data);
        }
        match self {
            Span::One(p) => stream_copy(*p, data.as_ptr(), data.len()),
            Span::Many(v) => {
                let mut off = 0;
                for (p, n) in v {
                    stream_copy(*p, data[off..].as_ptr(), *n);
                    off += n;
                }
            }
        }
        if data.len() >= STREAM_MIN {
            UNFENCED.with(|u| u.set(true));
        }
    }

    /// Copies the span into `out` (same conditions as `write`).
    ///
    /// # Safety
    /// As `write`.
    pub unsafe fn read(&self, out: &mut [u8]) {
        match self {
            Span::One(p) => std::ptr::copy_nonoverlapping(*p, out.as_mut_ptr(), out.len()),
            Span::Many(v) => {
                let mut off = 0;
                for (p, n) in v {
                    std::ptr::copy_nonoverlapping(*p, out[off..].as_mut_ptr(), *n);
                    off += n;
                }
            }
        }
    }

    /// Appends the span's pieces (it covers `len` bytes) to `out`.
    pub fn push_to(self, len: usize, out: &mut Vec<(*mut u8, usize)>) {
        match self {
            Span::One(p) => out.push((p, len)),
            Span::Many(v) => out.extend(v),
        }
    }

    /// The span as one pointer, if it is contiguous (atomics need that).
    pub fn contiguous(&self) -> Option<*mut u8> {
        match self {
            Span::One(p) => Some(*p),
            Span::Many(v) if v.len() == 1 => Some(v[0].0),
            Span::Many(_) => None,
        }
    }
}

/// Smallest piece [`Span::write_streaming`] writes with streaming stores:
/// below it a plain copy costs less than a store that bypasses the cache
/// line by line.
pub const STREAM_MIN: usize = 1024;

/// Whether WRITE payloads are placed with streaming stores
/// (`RNICD_STREAM_WRITES=0` turns them off, for A/B runs).
pub fn streaming_enabled() -> bool {
    static ON: LazyLock<bool> = LazyLock::new(|| std::env::var("RNICD_STREAM_WRITES").map_or(true, |v| v != "0"));
    *ON
}

thread_local! {
    /// Whether this thread made streaming stores since its last fence.
    static UNFENCED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Orders the streaming stores this thread made ([`Span::write_streaming`])
/// before its later stores and sends: called before a CQE is published and
/// after each receive batch, before the ACKs it produced leave. A no-op
/// when there were none.
pub fn fence_streamed() {
    UNFENCED.with(|u| {
        if u.replace(false) {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: a store fence has no preconditions.
            unsafe {
                std::arch::x86_64::_mm_sfence()
            };
        }
    });
}

/// Copies `n` bytes from `src` to `dst` (not overlapping); from `STREAM_MIN`
/// bytes on, the whole 64-byte lines of `dst` are written with SSE2
/// non-temporal stores (baseline on x86-64), the ragged head and tail
/// with a plain copy. The caller fences.
///
/// # Safety
/// As `std::ptr::copy_nonoverlapping`.
unsafe fn stream_copy(dst: *mut u8, src: *const u8, n: usize) {
    #[cfg(target_arch = "x86_64")]
    if n >= STREAM_MIN {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        let head = dst.align_offset(64).min(n);
        std::ptr::copy_nonoverlapping(src, dst, head);
        let lines = (n - head) / 64;
        let (mut d, mut s) = (dst.add(head), src.add(head));
        for _ in 0..lines {
            // SAFETY: d is 64-byte aligned (so 16-byte aligned, as
            // _mm_stream_si128 needs) and both lines are in bounds.
            let a = _mm_loadu_si128(s as *const __m128i);
            let b = _mm_loadu_si128(s.add(16) as *const __m128i);
            let c = _mm_loadu_si128(s.add(32) as *const __m128i);
            let e = _mm_loadu_si128(s.add(48) as *const __m128i);
            _mm_stream_si128(d as *mut __m128i, a);
            _mm_stream_si128(d.add(16) as *mut __m128i, b);
            _mm_stream_si128(d.add(32) as *mut __m128i, c);
            _mm_stream_si128(d.add(48) as *mut __m128i, e);
            d = d.add(64);
            s = s.add(64);
        }
        std::ptr::copy_nonoverlapping(s, d, n - head - lines * 64);
        return;
    }
    std::ptr::copy_nonoverlapping(src, dst, n);
}

/// Most runs one memory region may have: the run list travels in one
/// control message (`fdmsg::MAX_MSG`, 64 KiB), at most ~30 bytes a run.
pub const MAX_REGION_RUNS: usize = 2048;

/// Page size of the boundaries between a scattered region's runs.
pub const RUN_PAGE: u64 = 4096;

/// The memory of a memory region: runs `(fd_offset, len)` of one memfd laid
/// end to end in the region's address space, as a guest's scattered pages
/// are. One run is the common case and costs one addition per access, as a
/// single mapping did; several cost a binary search over the run starts.
pub struct RegionMemory {
    /// Region offset where each run starts (0 first), ascending.
    starts: Vec<u64>,
    maps: Vec<Mapping>,
    len: u64,
}

impl RegionMemory {
    /// Maps `runs` of `fd` (adjacent runs merged) for a region whose byte 0
    /// is at `iova`. With several runs, every boundary between two runs
    /// is a page boundary of the memfd and of the region's address space
    /// (like a page list), so an aligned atomic never straddles two runs.
    pub fn map(fd: &OwnedFd, iova: u64, runs: &[(u64, u64)]) -> anyhow::Result<RegionMemory> {
        if runs.is_empty() || runs.len() > MAX_REGION_RUNS {
            bail!("a region needs 1 to {MAX_REGION_RUNS} runs, not {}", runs.len());
        }
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(runs.len());
        for &(off, len) in runs {
            if len == 0 || off.checked_add(len).is_none() {
                bail!("bad run {off}+{len}");
            }
            match merged.last_mut() {
                Some(last) if last.0 + last.1 == off => last.1 += len,
                _ => merged.push((off, len)),
            }
        }
        if merged.len() > 1 {
            if iova % RUN_PAGE != merged[0].0 % RUN_PAGE {
                bail!("a scattered region's iova {iova:#x} must have the page offset of its first run ({:#x})", merged[0].0);
            }
            let last = merged.len() - 1;
            for (i, &(off, len)) in merged.iter().enumerate() {
                if (i > 0 && off % RUN_PAGE != 0) || (i < last && (off + len) % RUN_PAGE != 0) {
                    bail!("run {i} ({off:#x}+{len:#x}) does not start and end on page boundaries between runs");
                }
            }
        }
        let mut starts = Vec::with_capacity(merged.len());
        let mut maps = Vec::with_capacity(merged.len());
        let mut total = 0u64;
        for &(off, len) in &merged {
            let n = usize::try_from(len).context("run too long")?;
            maps.push(Mapping::map_region(fd, off, n)?);
            starts.push(total);
            total = total.checked_add(len).context("region too long")?;
        }
        Ok(RegionMemory { starts, maps, len: total })
    }

    /// Bytes the region covers.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Runs after merging.
    pub fn runs(&self) -> usize {
        self.maps.len()
    }

    /// Host memory of bytes [off, off+len) of the region, which the caller
    /// checked to lie inside it.
    pub fn span(&self, off: u64, len: u64) -> Span {
        debug_assert!(off + len <= self.len);
        if self.maps.len() == 1 {
            // SAFETY: off + len <= the mapping's length (checked by the caller).
            return Span::One(unsafe { self.maps[0].ptr().add(off as usize) });
        }
        let mut i = self.starts.partition_point(|&s| s <= off).saturating_sub(1);
        let end = off + len;
        let run_end = |i: usize| self.starts[i] + self.maps[i].len() as u64;
        // SAFETY (both): `at` lies in run i, and `n` bytes from it too.
        let at_ptr = |i: usize, at: u64| unsafe { self.maps[i].ptr().add((at - self.starts[i]) as usize) };
        if end <= run_end(i) {
            return Span::One(at_ptr(i, off));
        }
        let mut pieces = Vec::new();
        let mut at = off;
        while at < end {
            let n = run_end(i).min(end) - at;
            pieces.push((at_ptr(i, at), n as usize));
            at += n;
            i += 1;
        }
        Span::Many(pieces)
    }
}

/// Creates a memfd of `len` bytes sealed against shrinking and growing.
pub fn sealed_memfd(name: &str, len: usize) -> anyhow::Result<OwnedFd> {
    let cname = std::ffi::CString::new(name)?;
    // SAFETY: plain syscalls; results checked.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("memfd_create");
    }
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } < 0 {
        return Err(std::io::Error::last_os_error()).context("ftruncate");
    }
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL) } < 0 {
        return Err(std::io::Error::last_os_error()).context("seal memfd");
    }
    Ok(fd)
}

/// Pages a prefault pass looks at (mincore) at a time.
const PREFAULT_CHUNK_PAGES: usize = 512;
/// Pages one read fault maps (the kernel's fault-around, 64 KiB by default).
const FAULT_AROUND_PAGES: usize = 16;

/// Maps in the pages of window `w` that its file holds already, on a
/// thread of its own, as a NIC pins a region when it is registered.
/// Otherwise the first WRITE into each page of guest RAM takes a write
/// fault in rnicd, one page at a time (a quarter of the destination
/// rnicd's CPU in a migration). A read of one present page per 64 KiB
/// does it: the read fault maps the 16 pages around it that the file
/// holds (fault-around), writable, as the window is a shared mapping of
/// memory without dirty tracking; MADV_POPULATE_READ/WRITE cost 3-5 times
/// more, walking every page. A 2 MiB folio is mapped whole by its first
/// read (one PMD); the reads after it in the same 2 MiB fault no more. A page the file does not hold (mincore,
/// looked at just before each chunk) is never touched: reading it would
/// allocate it, and a postcopy destination's missing pages must stay
/// missing so that touching them faults to the vmm.
fn prefault_present(w: &Arc<Mapping>) {
    let w = w.clone();
    let run = move || {
        let pages = w.len.div_ceil(4096);
        let mut resident = vec![0u8; PREFAULT_CHUNK_PAGES];
        for first in (0..pages).step_by(PREFAULT_CHUNK_PAGES) {
            let n = PREFAULT_CHUNK_PAGES.min(pages - first);
            // SAFETY: the window is page aligned and stays mapped while `w` lives.
            let base = unsafe { w.ptr.add(first * 4096) };
            if unsafe { libc::mincore(base as *mut libc::c_void, n * 4096, resident.as_mut_ptr()) } < 0 {
                return;
            }
            let mut mapped_to = 0;
            for k in (0..n).filter(|&k| resident[k] & 1 == 1) {
                if k >= mapped_to {
                    // SAFETY: a byte of a page of our mapping that the file holds.
                    unsafe { std::ptr::read_volatile(base.add(k * 4096)) };
                    mapped_to = (k / FAULT_AROUND_PAGES + 1) * FAULT_AROUND_PAGES;
                }
            }
        }
    };
    if let Err(e) = crate::loop_priority::spawn("prefault", run) {
        tracing::warn!("no thread to prefault guest memory ({e}); its pages fault in on first use");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A streamed write lands exactly the bytes a plain one does, for
    /// destinations at every offset within a cache line, lengths below
    /// and above STREAM_MIN with ragged tails, one piece or several.
    #[test]
    fn streamed_writes_land_exactly_the_payload() {
        let data: Vec<u8> = (0..9000u32).map(|i| (i * 13 + i / 7) as u8).collect();
        for len in [0usize, 1, 63, 64, 65, STREAM_MIN - 1, STREAM_MIN, STREAM_MIN + 3, 4096, 4099, 8191] {
            for at in [0usize, 1, 8, 15, 16, 33, 63] {
                let mut dst = vec![0xeeu8; 8192 + 256];
                let base = dst.as_mut_ptr().wrapping_add(dst.as_ptr().align_offset(64) + at);
                // SAFETY: base + len stays inside dst (64 + 63 + 8191 < its length).
                unsafe { Span::One(base).write_streaming(&data[..len]) };
                let off = base as usize - dst.as_ptr() as usize;
                assert_eq!(&dst[off..off + len], &data[..len], "len {len} at {at}");
                assert!(dst[..off].iter().chain(&dst[off + len..]).all(|&b| b == 0xee), "len {len} at {at}: bytes outside");
                let split = len / 3;
                let mut two = vec![0xeeu8; 2 * 8192 + 256];
                let p = two.as_mut_ptr().wrapping_add(at);
                let q = two.as_mut_ptr().wrapping_add(8192 + 128);
                // SAFETY: both pieces lie inside `two`.
                unsafe { Span::Many(vec![(p, split), (q, len - split)]).write_streaming(&data[..len]) };
                assert_eq!(&two[at..at + split], &data[..split]);
                assert_eq!(&two[8192 + 128..8192 + 128 + len - split], &data[split..len]);
            }
        }
    }

    /// Pieces of a span as (memfd offset, len), given the window's base.
    fn pieces(m: &RegionMemory, base: *mut u8, off: u64, len: u64) -> Vec<(u64, usize)> {
        let mut v = Vec::new();
        m.span(off, len).push_to(len as usize, &mut v);
        v.into_iter().map(|(p, n)| (p as u64 - base as u64, n)).collect()
    }

    #[test]
    fn runs_resolve_to_their_pieces() {
        let fd = sealed_memfd("runs", 16 * 4096).unwrap();
        let w = window(&fd).unwrap();
        // Byte 0 at 0x100 of page 3, then pages 1, 7-8 (given as two runs, merged).
        let runs = [(3 * 4096 + 0x100, 4096 - 0x100), (4096, 4096), (7 * 4096, 4096), (8 * 4096, 4096)];
        let m = RegionMemory::map(&fd, 0x5100, &runs).unwrap();
        assert_eq!((m.runs(), m.len()), (3, 4 * 4096 - 0x100));
        let base = w.ptr();
        assert_eq!(pieces(&m, base, 0, 8), [(3 * 4096 + 0x100, 8)]);
        assert_eq!(pieces(&m, base, 0xf00 - 8, 16), [(4 * 4096 - 8, 8), (4096, 8)]);
        assert_eq!(pieces(&m, base, 0xf00, 4096 + 4096 + 10), [(4096, 4096), (7 * 4096, 4096 + 10)]);
        assert_eq!(pieces(&m, base, m.len() - 1, 1), [(9 * 4096 - 1, 1)]);
        // One run: the plain pointer, as a single mapping gave.
        let one = RegionMemory::map(&fd, 0, &[(4096, 3 * 4096)]).unwrap();
        assert_eq!(pieces(&one, base, 5000, 8000), [(4096 + 5000, 8000)]);
    }
}
