//! Device access to guest memory for the PVRDMA device: typed reads and
//! writes of interface structures, ring indices, and page lists resolved
//! from page directories. Every guest-supplied address is checked against
//! guest RAM first; an address outside it becomes an error, never a fault.

use std::sync::atomic::Ordering;

use pvrdma_abi::{pdir_dir_entry_offset, pdir_ntables, pdir_table, pdir_table_entry_offset, Pod, PAGE_DIR_MAX_PAGES, PAGE_SIZE};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use super::Errno;
use crate::GuestMemory;

const PAGE: u64 = PAGE_SIZE as u64;

/// Guest RAM as the device sees it.
#[derive(Clone)]
pub(crate) struct Guest {
    pub mem: GuestMemory,
}

impl Guest {
    pub fn read<T: Pod>(&self, gpa: u64) -> Result<T, Errno> {
        let mut v = T::zeroed();
        self.mem.read_slice(v.as_bytes_mut(), GuestAddress(gpa)).map_err(|_| Errno::EFAULT)?;
        Ok(v)
    }

    pub fn write<T: Pod>(&self, gpa: u64, v: &T) -> Result<(), Errno> {
        self.mem.write_slice(v.as_bytes(), GuestAddress(gpa)).map_err(|_| Errno::EFAULT)
    }

    pub fn mem_write(&self, gpa: u64, bytes: &[u8]) -> Result<(), Errno> {
        self.mem.write_slice(bytes, GuestAddress(gpa)).map_err(|_| Errno::EFAULT)
    }

    /// A ring index the other side updates concurrently.
    pub fn load_u32(&self, gpa: u64) -> Result<u32, Errno> {
        if !gpa.is_multiple_of(4) {
            return Err(Errno::EFAULT);
        }
        self.mem.load::<u32>(GuestAddress(gpa), Ordering::Acquire).map_err(|_| Errno::EFAULT)
    }

    /// Publishes a ring index after the entries it covers.
    pub fn store_u32(&self, gpa: u64, v: u32) -> Result<(), Errno> {
        if !gpa.is_multiple_of(4) {
            return Err(Errno::EFAULT);
        }
        self.mem.store(v, GuestAddress(gpa), Ordering::Release).map_err(|_| Errno::EFAULT)
    }

    /// Whether the page at `gpa` is page aligned and inside guest RAM.
    pub(crate) fn page_ok(&self, gpa: u64) -> bool {
        gpa.is_multiple_of(PAGE) && self.mem.check_range(GuestAddress(gpa), PAGE as usize)
    }

    /// The `npages` guest pages a page directory at `pdir_dma` lists, each
    /// checked to be a whole page of guest RAM.
    pub fn resolve_pdir(&self, pdir_dma: u64, npages: u32) -> Result<PageList, Errno> {
        if npages == 0 || npages > PAGE_DIR_MAX_PAGES || !self.page_ok(pdir_dma) {
            return Err(Errno::EINVAL);
        }
        let mut pages = Vec::with_capacity(npages as usize);
        let mut table = u64::MAX;
        for i in 0..npages {
            if i == 0 || pdir_table(i) != pdir_table(i - 1) {
                debug_assert!(pdir_table(i) < pdir_ntables(npages));
                table = self.read::<u64>(pdir_dma + pdir_dir_entry_offset(pdir_table(i)))?;
                if !self.page_ok(table) {
                    return Err(Errno::EFAULT);
                }
            }
            let page = self.read::<u64>(table + pdir_table_entry_offset(i))?;
            if !self.page_ok(page) {
                return Err(Errno::EFAULT);
            }
            pages.push(page);
        }
        Ok(PageList { pages })
    }
}

/// The guest pages of a ring or region, in order.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub(crate) struct PageList {
    pub pages: Vec<u64>,
}

impl PageList {
    /// Bytes the list covers.
    pub fn len(&self) -> u64 {
        self.pages.len() as u64 * PAGE
    }

    /// The guest-physical address of byte `off` of the list, when `len`
    /// bytes from there stay inside one page.
    pub fn gpa(&self, off: u64, len: u64) -> Result<u64, Errno> {
        let page = self.pages.get((off / PAGE) as usize).ok_or(Errno::EFAULT)?;
        if off % PAGE + len > PAGE {
            return Err(Errno::EFAULT);
        }
        Ok(page + off % PAGE)
    }

    /// Where bytes [off, off+len) of the list are in guest RAM: `(gpa, len)`
    /// runs in order, consecutive pages merged into one run. None if the
    /// range is empty or runs past the list.
    pub fn runs(&self, off: u64, len: u64) -> Option<Vec<(u64, u64)>> {
        let end = off.checked_add(len).filter(|&e| len > 0 && e <= self.len())?;
        let mut runs: Vec<(u64, u64)> = Vec::new();
        let mut at = off;
        while at < end {
            let n = (PAGE - at % PAGE).min(end - at);
            let gpa = self.pages[(at / PAGE) as usize] + at % PAGE;
            match runs.last_mut() {
                Some(r) if r.0 + r.1 == gpa => r.1 += n,
                _ => runs.push((gpa, n)),
            }
            at += n;
        }
        Some(runs)
    }
}
