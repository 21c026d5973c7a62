// SPDX-License-Identifier: GPL-2.0-or-later
//! Device memory (ibv_alloc_dm, ibv_memcpy_to_dm/from_dm, ibv_reg_dm_mr).
//!
//! A hardware NIC's device memory is on-chip memory the program reaches
//! only by copies and registers as a zero-based MR. rnicd's memory is host
//! memory, so a DM here is an anonymous mapping the library keeps for the
//! device and never hands to the program: the program writes and reads it
//! only through `ibv_memcpy_to_dm`/`ibv_memcpy_from_dm`, and
//! `ibv_reg_dm_mr` registers a part of it with rnicd as a zero-based MR
//! (the pages move onto the shared memfd as any registered memory, mem.rs).
//! It is no faster than ordinary memory; it exists so that programs written
//! for device memory run.
//!
//! The rules are those of the devices rdma-core's tests are written for:
//! copies start and end on 4-byte boundaries, inside the DM; a context has
//! `MAX_DM_SIZE` bytes of device memory in all; a DM with MRs on it cannot
//! be freed (EBUSY), as with the kernel's use counts.

use std::ffi::{c_int, c_uint, c_void};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use crate::device::{ctx, MAX_DM_SIZE};
use crate::pdmr::{pd, register_dm_range};
use crate::set_errno;
use crate::sys::*;

/// Copies start and end on this boundary.
const DM_ALIGN: u64 = 4;
const PAGE: u64 = 4096;

#[repr(C)]
pub struct Dm {
    pub dm: ibv_dm,
    /// The memory: an anonymous mapping of `map_len` bytes.
    base: *mut u8,
    map_len: usize,
    /// The length the program asked for (copies and MRs stay inside).
    len: u64,
    /// MRs registered on this DM and not yet deregistered.
    pub users: AtomicUsize,
    /// The context's count of allocated device memory.
    allocated: Arc<AtomicU64>,
}

unsafe fn dm<'a>(d: *mut ibv_dm) -> Option<&'a Dm> {
    (!d.is_null()).then(|| &*(d as *const Dm))
}

/// Whether [off, off+len) is inside the DM and on the copy boundary.
fn copy_range_ok(d: &Dm, off: u64, len: usize) -> Result<(), c_int> {
    let len = len as u64;
    if !off.is_multiple_of(DM_ALIGN) || !len.is_multiple_of(DM_ALIGN) {
        return Err(libc::EINVAL);
    }
    match off.checked_add(len) {
        Some(end) if end <= d.len => Ok(()),
        _ => Err(libc::EFAULT),
    }
}

unsafe extern "C" fn memcpy_to_dm(d: *mut ibv_dm, off: u64, src: *const c_void, len: usize) -> c_int {
    let Some(d) = dm(d) else { return libc::EINVAL };
    if let Err(e) = copy_range_ok(d, off, len) {
        return e;
    }
    if len > 0 {
        std::ptr::copy(src as *const u8, d.base.add(off as usize), len);
    }
    0
}

unsafe extern "C" fn memcpy_from_dm(dst: *mut c_void, d: *mut ibv_dm, off: u64, len: usize) -> c_int {
    let Some(d) = dm(d) else { return libc::EINVAL };
    if let Err(e) = copy_range_ok(d, off, len) {
        return e;
    }
    if len > 0 {
        std::ptr::copy(d.base.add(off as usize), dst as *mut u8, len);
    }
    0
}

pub unsafe extern "C" fn alloc_dm(c: *mut ibv_context, attr: *mut ibv_alloc_dm_attr) -> *mut ibv_dm {
    let fail = |e: i32| {
        set_errno(e);
        std::ptr::null_mut()
    };
    let (Some(cx), false) = (ctx(c), attr.is_null()) else { return fail(libc::EINVAL) };
    let a = &*attr;
    // No extension of the attributes is known; the mapping is page-aligned,
    // so any alignment up to a page is met.
    if a.comp_mask != 0 || a.length == 0 || 1u64.checked_shl(a.log_align_req).is_none_or(|al| al > PAGE) {
        return fail(libc::EINVAL);
    }
    let len = a.length as u64;
    if len > MAX_DM_SIZE {
        return fail(libc::ENOMEM);
    }
    // Reserve from the context's device memory.
    let reserved = cx.dm_allocated.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_add(len).filter(|t| *t <= MAX_DM_SIZE));
    if reserved.is_err() {
        return fail(libc::ENOMEM);
    }
    let map_len = len.div_ceil(PAGE) * PAGE;
    let base = libc::mmap(
        std::ptr::null_mut(),
        map_len as usize,
        libc::PROT_READ | libc::PROT_WRITE,
        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
        -1,
        0,
    );
    if base == libc::MAP_FAILED {
        cx.dm_allocated.fetch_sub(len, Ordering::AcqRel);
        return fail(libc::ENOMEM);
    }
    let b = Box::into_raw(Box::new(Dm {
        dm: ibv_dm { context: c, memcpy_to_dm: Some(memcpy_to_dm), memcpy_from_dm: Some(memcpy_from_dm), comp_mask: 0, handle: 0 },
        base: base as *mut u8,
        map_len: map_len as usize,
        len,
        users: AtomicUsize::new(0),
        allocated: cx.dm_allocated.clone(),
    }));
    &mut (*b).dm
}

pub unsafe extern "C" fn free_dm(d: *mut ibv_dm) -> c_int {
    let Some(r) = dm(d) else { return libc::EINVAL };
    if r.users.load(Ordering::Acquire) > 0 {
        return libc::EBUSY;
    }
    let b = Box::from_raw(d as *mut Dm);
    libc::munmap(b.base as *mut c_void, b.map_len);
    b.allocated.fetch_sub(b.len, Ordering::AcqRel);
    0
}

/// IBV_ACCESS_OPTIONAL_RANGE of verbs.h (bits 20 to 29).
const ACCESS_OPTIONAL_RANGE: c_uint = ((1 << 30) - 1) & !((1 << 20) - 1);

pub unsafe extern "C" fn reg_dm_mr(p: *mut ibv_pd, d: *mut ibv_dm, off: u64, len: usize, access: c_uint) -> *mut ibv_mr {
    let fail = |e: i32| {
        set_errno(e);
        std::ptr::null_mut()
    };
    let (Some(_), Some(r)) = (pd(p), dm(d)) else { return fail(libc::EINVAL) };
    // A DM MR is zero-based: its first byte is address 0 in SGEs and for
    // the peer (ibv_alloc_dm(3)); without the flag the request is invalid.
    if access & IBV_ACCESS_ZERO_BASED == 0 {
        return fail(libc::EINVAL);
    }
    if off.checked_add(len as u64).is_none_or(|end| end > r.len) {
        return fail(libc::EINVAL);
    }
    let access = access & !(IBV_ACCESS_ZERO_BASED | ACCESS_OPTIONAL_RANGE);
    register_dm_range(p, r.base as u64 + off, len, access, &r.users)
}
