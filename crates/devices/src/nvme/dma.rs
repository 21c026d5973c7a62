//! Device access to guest memory: address checks, PRP walking, small copies.
//!
//! Every guest-supplied address is checked against guest RAM before the
//! device touches it; an address outside RAM becomes a status code, never a
//! host fault.

use super::spec::{Status, PAGE_SIZE};
use crate::GuestMemory;
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryRegion, MemoryRegionAddress};

/// A host view of one piece of a guest buffer.
#[derive(Clone, Copy, Debug)]
pub struct Seg {
    pub ptr: *mut u8,
    pub len: usize,
}

// Segments point into guest RAM, which lives as long as the VM and is shared
// with the guest by design (like DMA).
unsafe impl Send for Seg {}

/// Host address of `len` bytes at `gpa`, if they lie inside one RAM region.
pub fn host_range(mem: &GuestMemory, gpa: u64, len: usize) -> Option<*mut u8> {
    let region = mem.find_region(GuestAddress(gpa))?;
    let off = gpa - region.start_addr().0;
    if off.checked_add(len as u64)? > region.len() {
        return None;
    }
    region.get_host_address(MemoryRegionAddress(off)).ok()
}

pub fn read_guest(mem: &GuestMemory, gpa: u64, out: &mut [u8]) -> bool {
    match host_range(mem, gpa, out.len()) {
        Some(p) => {
            // SAFETY: the range was checked to lie inside a guest RAM mapping.
            unsafe { std::ptr::copy_nonoverlapping(p, out.as_mut_ptr(), out.len()) };
            true
        }
        None => false,
    }
}

/// Turn PRP1/PRP2 of a command moving `len` bytes into host segments
/// (appended to `out`, adjacent pieces merged). Memory page size is 4 KiB.
pub fn map_prps(mem: &GuestMemory, prp1: u64, prp2: u64, len: usize, out: &mut Vec<Seg>) -> Result<(), Status> {
    out.clear();
    if len == 0 {
        return Ok(());
    }
    // PRP1 may carry an offset, which must be dword aligned.
    if prp1 & 0x3 != 0 {
        return Err(Status::INVALID_PRP_OFFSET);
    }
    let first = (PAGE_SIZE - (prp1 & (PAGE_SIZE - 1))).min(len as u64) as usize;
    push(mem, out, prp1, first)?;
    let mut left = len - first;
    if left == 0 {
        return Ok(());
    }
    if left <= PAGE_SIZE as usize {
        // PRP2 is the second (and last) data page.
        if prp2 & (PAGE_SIZE - 1) != 0 {
            return Err(Status::INVALID_PRP_OFFSET);
        }
        return push(mem, out, prp2, left);
    }
    // PRP2 points at a PRP list; the last entry of a full list page chains
    // to the next list page.
    if prp2 & 0x7 != 0 {
        return Err(Status::INVALID_PRP_OFFSET);
    }
    let mut list = prp2;
    loop {
        let entries_in_page = ((PAGE_SIZE - (list & (PAGE_SIZE - 1))) / 8) as usize;
        let pages_left = left.div_ceil(PAGE_SIZE as usize);
        let (n, chained) = if pages_left > entries_in_page { (entries_in_page, true) } else { (pages_left, false) };
        let mut raw = [0u8; PAGE_SIZE as usize];
        let raw = &mut raw[..n * 8];
        if !read_guest(mem, list, raw) {
            return Err(Status::DATA_TRANSFER_ERROR);
        }
        let data_entries = if chained { n - 1 } else { n };
        if data_entries == 0 {
            // A list page holding only the chain pointer would let a guest
            // build a list that never ends.
            return Err(Status::INVALID_PRP_OFFSET);
        }
        for i in 0..data_entries {
            let e = u64::from_le_bytes(raw[i * 8..i * 8 + 8].try_into().unwrap());
            if e & (PAGE_SIZE - 1) != 0 {
                return Err(Status::INVALID_PRP_OFFSET);
            }
            let l = left.min(PAGE_SIZE as usize);
            push(mem, out, e, l)?;
            left -= l;
        }
        if !chained {
            return Ok(());
        }
        let next = u64::from_le_bytes(raw[(n - 1) * 8..n * 8].try_into().unwrap());
        if next & 0x7 != 0 {
            return Err(Status::INVALID_PRP_OFFSET);
        }
        list = next;
    }
}

fn push(mem: &GuestMemory, out: &mut Vec<Seg>, gpa: u64, len: usize) -> Result<(), Status> {
    let p = host_range(mem, gpa, len).ok_or(Status::DATA_TRANSFER_ERROR)?;
    if let Some(last) = out.last_mut() {
        if last.ptr.wrapping_add(last.len) == p {
            last.len += len;
            return Ok(());
        }
    }
    out.push(Seg { ptr: p, len });
    Ok(())
}

/// Copy `data` into the guest buffer described by `segs` (controller to host).
pub fn copy_to_segs(segs: &[Seg], data: &[u8]) {
    let mut at = 0;
    for s in segs {
        let n = s.len.min(data.len() - at);
        // SAFETY: segments come from map_prps, which checked them.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr().add(at), s.ptr, n) };
        at += n;
        if at == data.len() {
            break;
        }
    }
}

/// Copy the guest buffer described by `segs` into `out` (host to controller).
pub fn copy_from_segs(segs: &[Seg], out: &mut [u8]) {
    let mut at = 0;
    for s in segs {
        let n = s.len.min(out.len() - at);
        // SAFETY: as above.
        unsafe { std::ptr::copy_nonoverlapping(s.ptr, out.as_mut_ptr().add(at), n) };
        at += n;
        if at == out.len() {
            break;
        }
    }
}

/// Write a controller data structure (identify, log page) to PRP1/PRP2.
pub fn write_prp_data(mem: &GuestMemory, prp1: u64, prp2: u64, data: &[u8]) -> Result<(), Status> {
    let mut segs = Vec::with_capacity(2);
    map_prps(mem, prp1, prp2, data.len(), &mut segs)?;
    copy_to_segs(&segs, data);
    Ok(())
}
