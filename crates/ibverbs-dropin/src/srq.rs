// SPDX-License-Identifier: GPL-2.0-or-later
//! Shared receive queues: ibv_create_srq(_ex), ibv_modify_srq,
//! ibv_query_srq, ibv_destroy_srq and ibv_post_srq_recv.
//!
//! An SRQ is rnicd's (rnic::srq): ibv_post_srq_recv writes its ring in
//! shared memory and makes no system call (rnicd reads the ring when a
//! message arrives at an attached QP, so there is no doorbell either). Only
//! the basic SRQ type exists; XRC and tag-matching SRQs fail with
//! EOPNOTSUPP, resizing with EINVAL (as on mlx5), destroying an SRQ that a
//! QP still uses with EBUSY.

use std::ffi::c_int;
use std::ptr::addr_of_mut;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

use crate::chain::{name_bad, post_recv_chain};
use crate::device::async_events::{init_sync, wait_acked};
use crate::pdmr::{pd, Pd};
use crate::set_errno;
use crate::sys::*;

#[repr(C)]
pub struct Srq {
    /// The program's ibv_srq (first, so the pointers are the same).
    pub srq: ibv_srq,
    pub inner: verbs::Srq,
    pd: *const Pd,
    /// QPs attached and not yet destroyed.
    pub users: AtomicUsize,
    /// Asynchronous events ibv_get_async_event handed out about the SRQ:
    /// ibv_destroy_srq waits until the program has acked as many
    /// (`events_completed`).
    pub(crate) events_reported: AtomicU32,
}

pub unsafe fn srq<'a>(s: *mut ibv_srq) -> Option<&'a Srq> {
    (!s.is_null()).then(|| &*(s as *const Srq))
}

#[no_mangle]
pub unsafe extern "C" fn ibv_create_srq(p: *mut ibv_pd, attr: *mut ibv_srq_init_attr) -> *mut ibv_srq {
    let fail = |e: i32| {
        set_errno(e);
        std::ptr::null_mut()
    };
    let (Some(pdr), false) = (pd(p), attr.is_null()) else { return fail(libc::EINVAL) };
    let a = &mut (*attr).attr;
    if a.max_wr == 0 || a.max_wr > verbs::MAX_SRQ_WR || a.max_sge as usize > verbs::MAX_SRQ_SGE || a.srq_limit > a.max_wr {
        return fail(libc::EINVAL);
    }
    let want = verbs::SrqAttr { max_wr: a.max_wr, max_sge: a.max_sge.max(1), srq_limit: a.srq_limit };
    let inner = match pdr.inner.create_srq(&want) {
        Ok(s) => s,
        Err(_) => return fail(libc::ENOMEM),
    };
    // What the SRQ really holds, as drivers report back.
    a.max_wr = want.max_wr;
    a.max_sge = want.max_sge;
    let s = ibv_srq { context: (*p).context, srq_context: (*attr).srq_context, pd: p, handle: inner.handle(), ..Default::default() };
    pdr.users.fetch_add(1, Ordering::AcqRel);
    let b = Box::into_raw(Box::new(Srq { srq: s, inner, pd: pdr, users: AtomicUsize::new(0), events_reported: AtomicU32::new(0) }));
    let base = &mut (*b).srq;
    init_sync(&mut base.mutex, &mut base.cond);
    if let Some(cx) = crate::device::ctx((*p).context) {
        cx.events.add_srq(base.handle, b as *mut ibv_srq, &(*b).events_reported);
    }
    b as *mut ibv_srq
}

/// verbs_context.create_srq_ex: what ibv_create_srq_ex does not route to
/// ibv_create_srq itself (XRC, tag matching, a CQ) is not supported.
pub unsafe extern "C" fn create_srq_ex(_c: *mut ibv_context, attr: *mut ibv_srq_init_attr_ex) -> *mut ibv_srq {
    if attr.is_null() {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    let a = &mut *attr;
    let basic = a.comp_mask & IBV_SRQ_INIT_ATTR_TYPE == 0 || a.srq_type == IBV_SRQT_BASIC;
    let known = IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_PD;
    if !basic || a.comp_mask & !known != 0 {
        set_errno(libc::EOPNOTSUPP);
        return std::ptr::null_mut();
    }
    if a.comp_mask & IBV_SRQ_INIT_ATTR_PD == 0 {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    ibv_create_srq(a.pd, attr as *mut ibv_srq_init_attr)
}

#[no_mangle]
pub unsafe extern "C" fn ibv_modify_srq(s: *mut ibv_srq, attr: *mut ibv_srq_attr, mask: c_int) -> c_int {
    let (Some(x), false) = (srq(s), attr.is_null()) else { return libc::EINVAL };
    let mask = mask as u32;
    if mask & !(IBV_SRQ_MAX_WR | IBV_SRQ_LIMIT) != 0 || mask & IBV_SRQ_MAX_WR != 0 {
        return libc::EINVAL;
    }
    if mask & IBV_SRQ_LIMIT != 0 && x.inner.set_limit((*attr).srq_limit).is_err() {
        return libc::EINVAL;
    }
    0
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_srq(s: *mut ibv_srq, attr: *mut ibv_srq_attr) -> c_int {
    let (Some(x), false) = (srq(s), attr.is_null()) else { return libc::EINVAL };
    match x.inner.query() {
        Ok(a) => {
            *attr = ibv_srq_attr { max_wr: a.max_wr, max_sge: a.max_sge, srq_limit: a.srq_limit };
            0
        }
        Err(_) => libc::EIO,
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_srq(s: *mut ibv_srq) -> c_int {
    let Some(x) = srq(s) else { return libc::EINVAL };
    if x.users.load(Ordering::Acquire) != 0 {
        return libc::EBUSY;
    }
    if let Some(cx) = crate::device::ctx((*s).context) {
        cx.events.remove(s as usize);
    }
    // No more events name the SRQ; those handed out must be acked first
    // (their thread may still use the SRQ), as libibverbs' destroy waits.
    let x = s as *mut Srq;
    wait_acked(addr_of_mut!((*s).mutex), addr_of_mut!((*s).cond), || (*s).events_completed == (*x).events_reported.load(Ordering::Acquire));
    let b = Box::from_raw(x);
    (*b.pd).users.fetch_sub(1, Ordering::AcqRel);
    drop(b);
    0
}

/// ibv_post_srq_recv (context ops): checks the chain, then writes the WRs
/// into the shared ring; `bad` names the first WR not posted.
pub unsafe extern "C" fn post_srq_recv(s: *mut ibv_srq, wr: *mut ibv_recv_wr, bad: *mut *mut ibv_recv_wr) -> c_int {
    let Some(x) = srq(s) else {
        name_bad(bad, wr);
        return libc::EINVAL;
    };
    let (max_sge, depth) = (x.inner.max_sge() as usize, x.inner.max_wr() as usize);
    post_recv_chain(wr, bad, max_sge, depth, |wrs| x.inner.try_post_recv(wrs))
}
