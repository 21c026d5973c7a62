//! Shared memory: sealed memfds and their mappings ("DMA" windows of rnicd).
//!
//! A client could shrink a memfd under rnicd and make its next access fault
//! (SIGBUS). rnicd therefore maps only memfds sealed against shrinking and
//! checks the size first.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use anyhow::{bail, Context as _};

/// A MAP_SHARED mapping, unmapped on drop.
pub struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; users synchronise as DMA would.
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `fd` at `offset` (page aligned), read-write.
    pub fn map(fd: &OwnedFd, offset: u64, len: usize) -> anyhow::Result<Mapping> {
        if len == 0 {
            return Ok(Mapping { ptr: std::ptr::NonNull::<u64>::dangling().as_ptr() as *mut u8, len: 0 });
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
        Ok(Mapping { ptr: p as *mut u8, len })
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
        Ok(Mapping { ptr, len })
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
        if self.len > 0 {
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
