// SPDX-License-Identifier: GPL-2.0-or-later
//! Thread domains and parent domains (`ibv_alloc_td`, `ibv_alloc_parent_domain`),
//! as mlx5 provides them:
//!
//! - a thread domain promises that one thread uses the objects made with
//!   it; rnicd's rings are lock-free already, so it changes nothing but is
//!   counted (`ibv_dealloc_td` of one a parent domain holds is `EBUSY`);
//! - a parent domain is an `ibv_pd` standing for a protection domain (it
//!   holds it: `ibv_dealloc_pd` of that PD is `EBUSY` meanwhile), with an
//!   optional thread domain, `pd_context`, and allocators. Objects made on
//!   it are made in its protection domain (rnicd sees the same PD);
//!   `ibv_dealloc_pd` frees it once nothing made on it is left;
//! - its `alloc` callback gives a QP's send and receive queues their memory:
//!   the library asks for each ring (`alignment` the page size,
//!   `resource_type` [`RES_TYPE_QP`]) and maps the ring's shared memory over
//!   what it got; `IBV_ALLOCATOR_USE_DEFAULT` means the library's own
//!   memory, NULL fails the create `ENOMEM`. When the QP is destroyed the
//!   range gets fresh private pages back and `free` is called with it. A
//!   CQ made on a parent domain (`ibv_create_cq_ex` with
//!   `IBV_CQ_INIT_ATTR_MASK_PD`) and SRQs keep the library's memory.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};

use super::{pd, Pd};
use crate::device::ctx;
use crate::set_errno;
use crate::sys::*;

/// The `resource_type` the allocators see for a QP's queues. rdma-core
/// numbers resource types per driver (`driver_id << 32 | n`, mlx5dv's
/// `MLX5DV_RES_TYPE_QP` is 1 of driver 1); this device is driver 0
/// (`RDMA_DRIVER_UNKNOWN`).
pub const RES_TYPE_QP: u64 = 1;

/// `IBV_ALLOCATOR_USE_DEFAULT` of verbs.h (a macro bindgen cannot evaluate).
const USE_DEFAULT: *mut c_void = usize::MAX as *mut c_void;

#[repr(C)]
pub struct Td {
    td: ibv_td,
    /// Parent domains holding it.
    users: AtomicUsize,
}

/// What makes a `Pd` a parent domain.
pub struct Parent {
    /// The protection domain it stands for (held: its `users` counts us).
    protection: *const Pd,
    td: *const Td,
    alloc: Option<unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, usize, u64) -> *mut c_void>,
    free: Option<unsafe extern "C" fn(*mut ibv_pd, *mut c_void, *mut c_void, u64)>,
    pd_context: *mut c_void,
}

pub unsafe extern "C" fn alloc_td(c: *mut ibv_context, attr: *mut ibv_td_init_attr) -> *mut ibv_td {
    if ctx(c).is_none() || attr.is_null() || (*attr).comp_mask != 0 {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    let t = Box::into_raw(Box::new(Td { td: ibv_td { context: c }, users: 0.into() }));
    &mut (*t).td
}

pub unsafe extern "C" fn dealloc_td(t: *mut ibv_td) -> c_int {
    if t.is_null() {
        return libc::EINVAL;
    }
    if (*(t as *const Td)).users.load(Ordering::Acquire) > 0 {
        return libc::EBUSY;
    }
    drop(Box::from_raw(t as *mut Td));
    0
}

pub unsafe extern "C" fn alloc_parent_domain(c: *mut ibv_context, attr: *mut ibv_parent_domain_init_attr) -> *mut ibv_pd {
    let fail = |e| {
        set_errno(e);
        std::ptr::null_mut()
    };
    if ctx(c).is_none() || attr.is_null() {
        return fail(libc::EINVAL);
    }
    let a = &*attr;
    let known = IBV_PARENT_DOMAIN_INIT_ATTR_ALLOCATORS | IBV_PARENT_DOMAIN_INIT_ATTR_PD_CONTEXT;
    // A parent domain stands for a protection domain, never for another
    // parent domain (as mlx5).
    let Some(protection) = pd(a.pd).filter(|p| p.parent.is_none() && p.pd.context == c) else { return fail(libc::EINVAL) };
    if a.comp_mask & !known != 0 {
        return fail(libc::EINVAL);
    }
    let allocators = a.comp_mask & IBV_PARENT_DOMAIN_INIT_ATTR_ALLOCATORS != 0;
    if allocators && (a.alloc.is_none() || a.free.is_none()) {
        return fail(libc::EINVAL);
    }
    let td = a.td as *const Td;
    if !td.is_null() {
        if (*td).td.context != c {
            return fail(libc::EINVAL);
        }
        (*td).users.fetch_add(1, Ordering::AcqRel);
    }
    protection.users.fetch_add(1, Ordering::AcqRel);
    let parent = Parent {
        protection,
        td,
        alloc: if allocators { a.alloc } else { None },
        free: if allocators { a.free } else { None },
        pd_context: if a.comp_mask & IBV_PARENT_DOMAIN_INIT_ATTR_PD_CONTEXT != 0 { a.pd_context } else { std::ptr::null_mut() },
    };
    let b = Box::into_raw(Box::new(Pd {
        pd: ibv_pd { context: c, handle: protection.pd.handle },
        inner: protection.inner.clone(),
        users: 0.into(),
        parent: Some(parent),
    }));
    &mut (*b).pd
}

/// `ibv_dealloc_pd` of a parent domain (nothing made on it is left): lets
/// go of its protection and thread domains.
pub unsafe fn release(p: &Parent) {
    (*p.protection).users.fetch_sub(1, Ordering::AcqRel);
    if !p.td.is_null() {
        (*p.td).users.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Memory from a parent domain's allocator for a QP's queues.
pub struct QueueMemory {
    pd: *mut ibv_pd,
    free: unsafe extern "C" fn(*mut ibv_pd, *mut c_void, *mut c_void, u64),
    pd_context: *mut c_void,
    /// (address, bytes) of each ring.
    ranges: Vec<(usize, usize)>,
}

impl QueueMemory {
    /// Asks `p`'s allocator (if it has one) for a QP's rings of `lens`
    /// bytes; None to use the library's own memory, Err(errno) if the
    /// allocator failed or gave memory the rings cannot be mapped over.
    pub unsafe fn for_qp(p: *mut ibv_pd, lens: (usize, usize)) -> Result<Option<QueueMemory>, c_int> {
        let Some(pdr) = pd(p) else { return Ok(None) };
        let Some(parent) = &pdr.parent else { return Ok(None) };
        let (Some(alloc), Some(free)) = (parent.alloc, parent.free) else { return Ok(None) };
        let mut m = QueueMemory { pd: p, free, pd_context: parent.pd_context, ranges: Vec::new() };
        let page = 4096;
        for len in [lens.0, lens.1] {
            let ptr = alloc(p, parent.pd_context, len, page, RES_TYPE_QP);
            if ptr == USE_DEFAULT && m.ranges.is_empty() {
                return Ok(None);
            }
            if ptr.is_null() || ptr == USE_DEFAULT {
                // The first ring's memory goes back untouched by `m`'s drop.
                return Err(libc::ENOMEM);
            }
            m.ranges.push((ptr as usize, len));
            if !(ptr as usize).is_multiple_of(page) {
                return Err(libc::EINVAL);
            }
        }
        Ok(Some(m))
    }

    pub fn rings_at(&self) -> (usize, usize) {
        (self.ranges[0].0, self.ranges[1].0)
    }
}

impl Drop for QueueMemory {
    /// After the QP's rings were dropped: a ring mapped over a range
    /// (`Mapping::map_at`) put private pages back over it in the same
    /// step, and a range never mapped over was never touched, so the
    /// memory goes back to its allocator as it is.
    fn drop(&mut self) {
        for &(addr, _) in &self.ranges {
            // SAFETY: the range is the allocator's memory, given back once.
            unsafe { (self.free)(self.pd, self.pd_context, addr as *mut c_void, RES_TYPE_QP) };
        }
    }
}
