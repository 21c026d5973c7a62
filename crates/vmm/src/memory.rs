//! Guest RAM: one memfd, mapped shared at a single host address.
//!
//! A memfd (not anonymous memory) so that other processes (rnicd, a
//! vhost-user style backend, the migration destination's helpers) can map the
//! very same pages, and so that userfaultfd and dirty tracking see one VMA.

use anyhow::{bail, Context, Result};
use devices::GuestMemory;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use vm_memory::{FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryRegion, GuestRegionMmap};

pub const PAGE_SIZE: u64 = 4096;

pub struct GuestRam {
    memfd: File,
    mem: GuestMemory,
    size: u64,
}

/// Physical memory of this machine, from /proc/meminfo.
pub fn host_memory_bytes() -> Result<u64> {
    let s = std::fs::read_to_string("/proc/meminfo")?;
    let kb = s
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .context("no MemTotal in /proc/meminfo")?;
    Ok(kb * 1024)
}

impl GuestRam {
    pub fn new(name: &str, size: u64) -> Result<Self> {
        if size < devices::layout::MIN_RAM {
            bail!("guest RAM of {size} bytes is below the minimum of 16 MiB");
        }
        if !size.is_multiple_of(2 << 20) {
            bail!("guest RAM size must be a multiple of 2 MiB (got {size} bytes)");
        }
        let host = host_memory_bytes()?;
        if size > host {
            bail!("guest RAM of {} MiB is more than this machine has ({} MiB)", size >> 20, host >> 20);
        }
        let cname = std::ffi::CString::new(format!("transit-ram-{name}"))?;
        // SAFETY: plain syscall; the fd is owned by the File below.
        let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error()).context("memfd_create for guest RAM");
        }
        let memfd = unsafe { File::from_raw_fd(fd) };
        memfd.set_len(size).context("sizing the guest RAM memfd")?;
        // rnicd maps guest RAM for a PVRDMA device's memory regions and maps
        // only memfds that cannot shrink under it (a shrink would SIGBUS it).
        // Hole punching (postcopy) stays allowed: only a write seal forbids it.
        // SAFETY: fcntl on the fd owned above.
        if unsafe { libc::fcntl(memfd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW) } < 0 {
            return Err(std::io::Error::last_os_error()).context("sealing the guest RAM memfd");
        }
        let region = GuestRegionMmap::from_range(GuestAddress(0), size as usize, Some(FileOffset::new(memfd.try_clone()?, 0)))
            .map_err(|e| anyhow::anyhow!("mapping guest RAM: {e}"))?;
        let mem = GuestMemory::from_regions(vec![region]).map_err(|e| anyhow::anyhow!("guest memory: {e}"))?;
        let ram = GuestRam { memfd, mem, size };
        // The guest's first touch allocates RAM through this mapping.
        migration::vm::advise_huge_pages(ram.host_addr(), size as usize);
        Ok(ram)
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn memory(&self) -> &GuestMemory {
        &self.mem
    }

    pub fn memfd(&self) -> &File {
        &self.memfd
    }

    pub fn memfd_raw(&self) -> i32 {
        self.memfd.as_raw_fd()
    }

    /// Host address of guest physical 0.
    pub fn host_addr(&self) -> *mut u8 {
        let r = self.mem.iter().next().expect("one region");
        r.get_host_address(vm_memory::MemoryRegionAddress(0)).expect("mapped")
    }

    /// The whole RAM as a byte slice. Only for a stopped VM (no vCPU or
    /// device writes), e.g. to save, digest or check it.
    ///
    /// # Safety
    /// The caller makes sure nothing writes guest RAM while the slice lives.
    pub unsafe fn as_slice(&self) -> &[u8] {
        std::slice::from_raw_parts(self.host_addr(), self.size as usize)
    }

    /// # Safety
    /// As [`Self::as_slice`], and no other reference to RAM is alive.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice(&self) -> &mut [u8] {
        std::slice::from_raw_parts_mut(self.host_addr(), self.size as usize)
    }
}
