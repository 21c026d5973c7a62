// SPDX-License-Identifier: GPL-2.0-or-later
//! Protection domains and memory regions over ordinary memory (see mem.rs).

use std::ffi::{c_int, c_uint, c_void};

use crate::device::ctx;
use crate::sys::*;
use crate::{mem, set_errno};

pub mod parent_domain;

#[repr(C)]
pub struct Pd {
    pub pd: ibv_pd,
    /// rnicd's PD (shared by a parent domain with its protection domain).
    pub inner: std::sync::Arc<verbs::Pd>,
    /// MRs, QPs and parent domains made in this PD and not yet destroyed.
    pub users: std::sync::atomic::AtomicUsize,
    /// Set if this is a parent domain (pdmr/parent_domain.rs).
    pub parent: Option<parent_domain::Parent>,
}

#[repr(C)]
pub struct Mr {
    pub mr: ibv_mr,
    pub inner: Option<verbs::Mr>,
    /// The process range that was shared with rnicd (addr, length).
    shared: (u64, u64),
    pd: *const Pd,
    /// What ibv_rereg_mr keeps when told to change something else.
    iova: u64,
    access: c_uint,
    /// The MR count of the device memory it registers (dm.rs), if any.
    dm_users: *const std::sync::atomic::AtomicUsize,
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
            let inner = std::sync::Arc::new(inner);
            let b = Box::into_raw(Box::new(Pd { pd: ibv_pd { context: c, handle: 0 }, inner, users: 0.into(), parent: None }));
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
    if let Some(parent) = &pd.parent {
        parent_domain::release(parent);
    }
    drop(Box::from_raw(p as *mut Pd));
    0
}

/// IBV_ACCESS_OPTIONAL_RANGE of verbs.h (a macro bindgen cannot evaluate):
/// bits 20 to 29, flags a device may ignore.
const ACCESS_OPTIONAL_RANGE: c_uint = ((1 << 30) - 1) & !((1 << 20) - 1);
const KNOWN_ACCESS: c_uint =
    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC | IBV_ACCESS_MW_BIND;

/// The access flags rnicd is given, or the errno a kernel driver returns
/// for them. Optional flags (relaxed ordering and the rest of the optional
/// range) may be ignored by a device; memory windows may be bound to an MR
/// with MW_BIND (qp/mw.rs); zero-based (but for device memory, dm.rs), ODP and
/// the others are not supported here.
fn check_access(access: c_uint) -> Result<c_uint, c_int> {
    let access = access & !ACCESS_OPTIONAL_RANGE;
    if access & !KNOWN_ACCESS != 0 {
        return Err(libc::EOPNOTSUPP);
    }
    if access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC) != 0 && access & IBV_ACCESS_LOCAL_WRITE == 0 {
        return Err(libc::EINVAL);
    }
    Ok(access)
}

/// Shares `len` bytes at `addr` with rnicd and registers them in `pdr`
/// (with the key `key` when given); on failure nothing stays shared.
unsafe fn share_and_register(pdr: &Pd, addr: u64, len: usize, iova: u64, access: c_uint, key: Option<u32>) -> Result<verbs::Mr, c_int> {
    mem::share(addr, len as u64)?;
    let fd = match mem::memfd() {
        Ok(fd) => fd,
        Err(e) => {
            mem::unshare(addr, len as u64);
            return Err(e);
        }
    };
    pdr.inner.reg_mr_fd_keyed(fd, addr, len, access, iova, key).map_err(|_| {
        mem::unshare(addr, len as u64);
        libc::EINVAL
    })
}

unsafe fn reg(p: *mut ibv_pd, addr: *mut c_void, len: usize, iova: u64, access: c_uint) -> *mut ibv_mr {
    // As the kernel's ib_umem_get: no empty ranges of process memory.
    if len == 0 {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    reg_range(p, addr, len, iova, access, std::ptr::null())
}

/// Registers `len` bytes of device memory at `addr` (dm.rs) as a zero-based
/// MR whose `addr` is NULL, as a kernel driver reports it; the DM's MR
/// count `dm_users` holds it until ibv_dereg_mr.
pub(crate) unsafe fn register_dm_range(
    p: *mut ibv_pd,
    addr: u64,
    len: usize,
    access: c_uint,
    dm_users: &std::sync::atomic::AtomicUsize,
) -> *mut ibv_mr {
    // Counted first, so that the DM cannot be freed during registration.
    dm_users.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    let m = if len == 0 { empty_mr(p, access, dm_users) } else { reg_range(p, addr as *mut c_void, len, 0, access, dm_users) };
    if m.is_null() {
        dm_users.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    } else {
        (*m).addr = std::ptr::null_mut();
    }
    m
}

/// An empty DM MR, which mlx5 allows: it grants no access, so rnicd (which
/// registers no empty range) holds nothing for it. Its keys are above the
/// 24 bits rnicd issues keys from, so every use of them fails as an access
/// outside an MR does (local protection or remote access error).
unsafe fn empty_mr(p: *mut ibv_pd, access: c_uint, dm_users: *const std::sync::atomic::AtomicUsize) -> *mut ibv_mr {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let Some(pdr) = pd(p) else {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    };
    let access = match check_access(access) {
        Ok(a) => a,
        Err(e) => {
            set_errno(e);
            return std::ptr::null_mut();
        }
    };
    let key = 0xff00_0000 | (NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) & 0x00ff_ffff);
    let mr = ibv_mr { context: pdr.pd.context, pd: p, addr: std::ptr::null_mut(), length: 0, handle: key, lkey: key, rkey: key };
    pdr.users.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    let b = Box::into_raw(Box::new(Mr { mr, inner: None, shared: (0, 0), pd: pdr, iova: 0, access, dm_users }));
    &mut (*b).mr
}

unsafe fn reg_range(
    p: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: c_uint,
    dm_users: *const std::sync::atomic::AtomicUsize,
) -> *mut ibv_mr {
    let fail = |e: i32| {
        set_errno(e);
        std::ptr::null_mut()
    };
    let Some(pdr) = pd(p) else { return fail(libc::EINVAL) };
    let access = match check_access(access) {
        Ok(a) => a,
        Err(e) => return fail(e),
    };
    let a = addr as u64;
    match share_and_register(pdr, a, len, iova, access, None) {
        Ok(m) => {
            let mr = ibv_mr { context: pdr.pd.context, pd: p, addr, length: len, handle: m.lkey, lkey: m.lkey, rkey: m.rkey };
            pdr.users.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            let b = Box::into_raw(Box::new(Mr { mr, inner: Some(m), shared: (a, len as u64), pd: pdr, iova, access, dm_users }));
            &mut (*b).mr
        }
        Err(e) => fail(e),
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
    if !b.dm_users.is_null() {
        (*b.dm_users).fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
    0
}

/// Re-registers an MR with another range, PD or access, keeping its lkey
/// and rkey (rnicd registers with a chosen key): rnicd drops the old
/// registration and makes the new one under the same key. As on a kernel
/// driver, an MR whose re-registration failed in the command
/// (IBV_REREG_MR_ERR_CMD) can only be deregistered.
#[no_mangle]
pub unsafe extern "C" fn ibv_rereg_mr(m: *mut ibv_mr, flags: c_int, p: *mut ibv_pd, addr: *mut c_void, len: usize, access: c_int) -> c_int {
    let input = |e: i32| {
        set_errno(e);
        IBV_REREG_MR_ERR_INPUT
    };
    if m.is_null() || flags < 0 || flags as c_uint & !IBV_REREG_MR_FLAGS_SUPPORTED != 0 {
        return input(libc::EINVAL);
    }
    let flags = flags as c_uint;
    let translation = flags & IBV_REREG_MR_CHANGE_TRANSLATION != 0;
    if translation && (len == 0 || addr.is_null()) {
        return input(libc::EINVAL);
    }
    if access != 0 && flags & IBV_REREG_MR_CHANGE_ACCESS == 0 {
        return input(libc::EINVAL);
    }
    let b = &mut *(m as *mut Mr);
    // Device memory MRs are registered only by ibv_reg_dm_mr, at an
    // address of the library's (dm.rs), not the program's.
    if !b.dm_users.is_null() {
        return input(libc::EINVAL);
    }
    let new_pd = if flags & IBV_REREG_MR_CHANGE_PD != 0 { p } else { b.mr.pd };
    let Some(pdr) = pd(new_pd) else { return input(libc::EINVAL) };
    let new_access = if flags & IBV_REREG_MR_CHANGE_ACCESS != 0 {
        match check_access(access as c_uint) {
            Ok(a) => a,
            Err(e) => return input(e),
        }
    } else {
        b.access
    };
    let (new_addr, new_len, new_iova) =
        if translation { (addr as u64, len, addr as u64) } else { (b.shared.0, b.shared.1 as usize, b.iova) };
    let Some(key) = b.inner.as_ref().map(|i| i.lkey) else {
        // An earlier re-registration failed: the MR is only deregistrable.
        return input(libc::EINVAL);
    };
    // The new pages are shared before the old ones are let go, so that
    // pages of both ranges stay on the memfd throughout.
    if translation {
        if let Err(e) = mem::share(new_addr, new_len as u64) {
            return input(e);
        }
    }
    drop(b.inner.take());
    let r = share_and_register(pdr, new_addr, new_len, new_iova, new_access, Some(key));
    if translation {
        // Drop the extra share taken above and the old range's.
        mem::unshare(new_addr, new_len as u64);
        mem::unshare(b.shared.0, b.shared.1);
    }
    let old_pd = b.pd;
    match r {
        Ok(mr) => {
            if !translation {
                // share_and_register shared the same range once more.
                mem::unshare(new_addr, new_len as u64);
            }
            b.inner = Some(mr);
            b.shared = (new_addr, new_len as u64);
            b.iova = new_iova;
            b.access = new_access;
            if !std::ptr::eq(old_pd, pdr) {
                (*old_pd).users.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
                pdr.users.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
                b.pd = pdr;
                b.mr.pd = new_pd;
            }
            b.mr.addr = new_addr as *mut c_void;
            b.mr.length = new_len;
            0
        }
        Err(e) => {
            // Nothing is registered any more; what the MR still shares is
            // let go by ibv_dereg_mr.
            if translation {
                b.shared = (0, 0);
            }
            set_errno(e);
            IBV_REREG_MR_ERR_CMD
        }
    }
}
