// SPDX-License-Identifier: GPL-2.0-or-later
//! Protection domains and memory regions over ordinary memory (see mem.rs).

use std::ffi::{c_int, c_uint, c_void};

use crate::device::ctx;
use crate::sys::*;
use crate::{mem, set_errno};

#[repr(C)]
pub struct Pd {
    pub pd: ibv_pd,
    pub inner: verbs::Pd,
    /// MRs and QPs made in this PD and not yet destroyed.
    pub users: std::sync::atomic::AtomicUsize,
}

#[repr(C)]
pub struct Mr {
    pub mr: ibv_mr,
    pub inner: Option<verbs::Mr>,
    /// The process range that was shared with rnicd (addr, length).
    shared: (u64, u64),
    pd: *const Pd,
}

pub unsafe fn pd<'a>(p: *mut ibv_pd) -> Option<&'a Pd> {
    (!p.is_null()).then(|| &*(p as *const Pd))
}

#[no_mangle]
pub unsafe extern "C" fn ibv_alloc_pd(c: *mut ibv_context) -> *mut ibv_pd {
    let Some(cx) = ctx(c) else {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    };
    match cx.inner.alloc_pd() {
        Ok(inner) => {
            let b = Box::into_raw(Box::new(Pd { pd: ibv_pd { context: c, handle: 0 }, inner, users: 0.into() }));
            &mut (*b).pd
        }
        Err(_) => {
            set_errno(libc::ENOMEM);
            std::ptr::null_mut()
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_dealloc_pd(p: *mut ibv_pd) -> c_int {
    let Some(pd) = pd(p) else { return libc::EINVAL };
    // As a kernel driver: a PD still used by MRs or QPs stays.
    if pd.users.load(std::sync::atomic::Ordering::Acquire) > 0 {
        return libc::EBUSY;
    }
    drop(Box::from_raw(p as *mut Pd));
    0
}

/// IBV_ACCESS_OPTIONAL_RANGE of verbs.h (a macro bindgen cannot evaluate):
/// bits 20 to 29, flags a device may ignore.
const ACCESS_OPTIONAL_RANGE: c_uint = ((1 << 30) - 1) & !((1 << 20) - 1);
const KNOWN_ACCESS: c_uint = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;

unsafe fn reg(p: *mut ibv_pd, addr: *mut c_void, len: usize, iova: u64, access: c_uint) -> *mut ibv_mr {
    let fail = |e: i32| {
        set_errno(e);
        std::ptr::null_mut()
    };
    let Some(pdr) = pd(p) else { return fail(libc::EINVAL) };
    // Optional flags (relaxed ordering and the rest of the optional range)
    // may be ignored by a device; MW binding, zero-based, ODP and the others
    // are not supported here.
    let access = access & !ACCESS_OPTIONAL_RANGE;
    if access & !KNOWN_ACCESS != 0 {
        return fail(libc::EOPNOTSUPP);
    }
    if len == 0 {
        return fail(libc::EINVAL);
    }
    if access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC) != 0 && access & IBV_ACCESS_LOCAL_WRITE == 0 {
        return fail(libc::EINVAL);
    }
    let a = addr as u64;
    if let Err(e) = mem::share(a, len as u64) {
        return fail(e);
    }
    let fd = match mem::memfd() {
        Ok(fd) => fd,
        Err(e) => return fail(e),
    };
    match pdr.inner.reg_mr_fd(fd, a, len, access, iova) {
        Ok(m) => {
            let mr = ibv_mr { context: pdr.pd.context, pd: p, addr, length: len, handle: m.lkey, lkey: m.lkey, rkey: m.rkey };
            pdr.users.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            let b = Box::into_raw(Box::new(Mr { mr, inner: Some(m), shared: (a, len as u64), pd: pdr }));
            &mut (*b).mr
        }
        Err(_) => {
            mem::unshare(a, len as u64);
            fail(libc::EINVAL)
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr(p: *mut ibv_pd, addr: *mut c_void, len: usize, access: c_int) -> *mut ibv_mr {
    reg(p, addr, len, addr as u64, access as c_uint)
}

#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr_iova(p: *mut ibv_pd, addr: *mut c_void, len: usize, iova: u64, access: c_int) -> *mut ibv_mr {
    reg(p, addr, len, iova, access as c_uint)
}

#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr_iova2(p: *mut ibv_pd, addr: *mut c_void, len: usize, iova: u64, access: c_uint) -> *mut ibv_mr {
    reg(p, addr, len, iova, access)
}

#[no_mangle]
pub unsafe extern "C" fn ibv_dereg_mr(m: *mut ibv_mr) -> c_int {
    if m.is_null() {
        return libc::EINVAL;
    }
    let mut b = Box::from_raw(m as *mut Mr);
    // rnicd unmaps the MR first, then the pages may leave the memfd.
    drop(b.inner.take());
    mem::unshare(b.shared.0, b.shared.1);
    (*b.pd).users.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    0
}

#[no_mangle]
pub unsafe extern "C" fn ibv_rereg_mr(
    _m: *mut ibv_mr,
    _flags: c_int,
    _pd: *mut ibv_pd,
    _addr: *mut c_void,
    _len: usize,
    _access: c_int,
) -> c_int {
    // IBV_REREG_MR_ERR_INPUT: "the input is invalid, the MR is unchanged".
    set_errno(libc::EOPNOTSUPP);
    IBV_REREG_MR_ERR_INPUT as c_int
}
