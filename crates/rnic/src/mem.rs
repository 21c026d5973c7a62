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
            return Ok(Mapping { ptr: std::ptr::NonNull::<u64>::dangling().as_ptr() as *mut u8, len: 0, window: None });
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
        Ok(Mapping { ptr: p as *mut u8, len, window: None })
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
        Ok(Mapping { ptr, len, window: Some(w) })
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
        Ok(Mapping { ptr, len, window: None })
    }

    /// Faults the whole mapping in now (MADV_POPULATE_WRITE). For queue
    /// rings, made ahead of a QP move: their first use is then not 1-2 page
    /// faults per ring on the move's critical path (~10 ms for 1,000 QPs).
    /// Best effort: an older kernel without it just faults later.
    pub fn populate(&self) {
        const MADV_POPULATE_WRITE: libc::c_int = 23;
        let base = self.ptr as usize & !4095;
        let len = self.len + (self.ptr as usize - base);
        if self.len > 0 {
            // SAFETY: advice on our own mapping's pages.
            unsafe { libc::madvise(base as *mut libc::c_void, len, MADV_POPULATE_WRITE) };
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
            // SAFETY: unmapping the pages this value mapped.
            unsafe { libc::munmap(base as *mut libc::c_void, len) };
        }
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
/// more, walking every page. A page the file does not hold (mincore,
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
    if let Err(e) = std::thread::Builder::new().name("prefault".into()).spawn(run) {
        tracing::warn!("no thread to prefault guest memory ({e}); its pages fault in on first use");
    }
}
