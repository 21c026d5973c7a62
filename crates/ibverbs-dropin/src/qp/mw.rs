// SPDX-License-Identifier: GPL-2.0-or-later
//! Memory windows (ibv_alloc_mw, ibv_bind_mw, IBV_WR_BIND_MW, ibv_wr_bind_mw).
//!
//! A window is one of rnicd's indirect keys (crate `verbs`' mkeys, rnicd's
//! `keys`): created with room for one range, bound to a range of an MR
//! registered with IBV_ACCESS_MW_BIND by a bind WR on a QP's send queue, in
//! order with the QP's other WRs, and invalidated by a LOCAL_INV WR, by a
//! peer's SEND with invalidate, or by a bind of zero length. As on a
//! hardware NIC, every bind gives the window a new rkey that differs in its
//! low byte (the consumer's `ibv_inc_rkey`); rnicd renames the key, so the
//! old rkey stops working. Window keys are taken above the 24 bits rnicd
//! numbers its own objects with, in families of 256 (one per window), so
//! that a new rkey never meets another object's key.
//!
//! A bind names the window by the key it holds when the bind runs, as an
//! mlx5 names it by its index: a second bind of the same window in one
//! post_send chain (or one ibv_wr_start batch) renames the key the first
//! one gave it. A bind that rnicd cannot do (an MR registered without
//! IBV_ACCESS_MW_BIND, a range outside the MR) completes with
//! IBV_WC_MW_BIND_ERR and moves the QP to the error state, as in rxe; the
//! window then carries its new rkey and is bound to nothing.
//!
//! Limits: a type 2 window is not tied to the QP that bound it (any QP of
//! its PD may use its rkey), and type 1 windows may also be invalidated by
//! LOCAL_INV; a bind WR is refused by post_send on a UD QP.

use std::ffi::{c_int, c_uint};
use std::sync::Mutex;

use verbs::mkeys::KeyOp;

use crate::pdmr::pd;
use crate::set_errno;
use crate::sys::*;

/// The first window key family; families run up to the empty DM MR keys
/// (pdmr.rs), which start at 0xff00_0000.
const FIRST_WINDOW_KEY: u32 = 0x0100_0000;
const WINDOW_FAMILIES: u32 = (0xff00_0000 - FIRST_WINDOW_KEY) >> 8;
/// Access a window may grant (IBV_ACCESS_LOCAL_WRITE to REMOTE_ATOMIC).
const WINDOW_ACCESS: c_uint = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;

#[repr(C)]
pub struct Mw {
    pub mw: ibv_mw,
    /// rnicd's indirect key, renamed along with `mw.rkey`.
    key: Mutex<verbs::mkeys::IndirectKey>,
}

pub unsafe extern "C" fn alloc_mw(p: *mut ibv_pd, t: ibv_mw_type) -> *mut ibv_mw {
    let fail = |e: i32| {
        set_errno(e);
        std::ptr::null_mut()
    };
    let Some(pdr) = pd(p) else { return fail(libc::EINVAL) };
    if t != IBV_MW_TYPE_1 && t != IBV_MW_TYPE_2 {
        return fail(libc::EINVAL);
    }
    // A random family; another process's window may hold it, then another.
    let mut seed = [0u8; 4];
    let mut key = None;
    for _ in 0..8 {
        if libc::getrandom(seed.as_mut_ptr() as *mut libc::c_void, 4, 0) != 4 {
            return fail(libc::EIO);
        }
        let family = u32::from_ne_bytes(seed) % WINDOW_FAMILIES;
        if let Ok(k) = pdr.inner.create_indirect_key(1, Some(FIRST_WINDOW_KEY + (family << 8))) {
            key = Some(k);
            break;
        }
    }
    let Some(key) = key else { return fail(libc::ENOMEM) };
    let rkey = key.key();
    pdr.users.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    let mw = ibv_mw { context: pdr.pd.context, pd: p, rkey, handle: rkey, type_: t };
    &mut (*Box::into_raw(Box::new(Mw { mw, key: Mutex::new(key) }))).mw
}

pub unsafe extern "C" fn dealloc_mw(m: *mut ibv_mw) -> c_int {
    if m.is_null() {
        return libc::EINVAL;
    }
    let b = Box::from_raw(m as *mut Mw);
    if let Some(pdr) = pd(b.mw.pd) {
        pdr.users.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
    // Dropping the key destroys it in rnicd: its rkey grants nothing more.
    drop(b);
    0
}

/// A bind WR's content for rnicd (the BindKey WQE of `rnic::types::WrOpcode`).
pub(crate) struct Bind {
    pub key: u32,
    pub new_key: u32,
    pub iova: u64,
    pub access: u32,
    /// The range, if any (none unbinds the window).
    pub range: Vec<verbs::Sge>,
}

/// Checks a bind of window `m` to `info` under the new key `new_key`, as
/// ibv_post_send(3) and ibv_bind_mw(3) describe it: EINVAL for no window,
/// a new key of another family, unknown access flags or an MR of another
/// PD. `earlier` is the key an earlier bind of the same chain gives the
/// window (the key it will hold when this bind runs), if there is one.
/// An MR registered without IBV_ACCESS_MW_BIND passes: rnicd fails that
/// bind in its completion, as rxe does.
pub(crate) unsafe fn bind_request(m: *mut ibv_mw, earlier: Option<u32>, new_key: u32, info: &ibv_mw_bind_info) -> Result<Bind, c_int> {
    if m.is_null() {
        return Err(libc::EINVAL);
    }
    let w = &*(m as *const Mw);
    let key = earlier.unwrap_or(w.mw.rkey);
    if new_key >> 8 != key >> 8 || new_key == key || info.mw_access_flags & !WINDOW_ACCESS != 0 {
        return Err(libc::EINVAL);
    }
    let range = if info.mr.is_null() || info.length == 0 {
        Vec::new()
    } else {
        if (*info.mr).pd != w.mw.pd || info.length > u32::MAX as u64 {
            return Err(libc::EINVAL);
        }
        vec![verbs::Sge { addr: info.addr, length: info.length as u32, lkey: (*info.mr).lkey }]
    };
    Ok(Bind { key, new_key, iova: info.addr, access: info.mw_access_flags, range })
}

/// The bind WR for rnicd, over `b`'s range.
pub(crate) fn bind_wr<'a>(wr_id: u64, flags: u8, b: &'a Bind) -> verbs::SendWr<'a> {
    let mut s = verbs::SendWr::new(wr_id, verbs::WrOpcode::BindKey, &b.range);
    s.flags = flags;
    s.remote_addr = b.iova;
    s.rkey = b.key;
    s.compare_add = b.access as u64;
    s.swap = b.new_key as u64;
    s
}

/// The window's bind WR was posted: it carries the new key from now on,
/// as the QP renames it in rnicd before any later WR runs.
pub(crate) unsafe fn posted(m: *mut ibv_mw, new_key: u32) {
    let w = &mut *(m as *mut Mw);
    w.mw.rkey = new_key;
    w.key.lock().unwrap_or_else(|e| e.into_inner()).renamed(new_key);
}

/// ibv_bind_mw of a type 1 window (verbs.h has checked the type and PD):
/// a bind WR on `q`'s send queue with a new rkey.
pub unsafe extern "C" fn bind_mw(q: *mut ibv_qp, m: *mut ibv_mw, mb: *mut ibv_mw_bind) -> c_int {
    if q.is_null() || m.is_null() || mb.is_null() {
        return libc::EINVAL;
    }
    let rkey = (*m).rkey;
    let new_key = (rkey & !0xff) | (rkey.wrapping_add(1) & 0xff);
    let b = match bind_request(m, None, new_key, &(*mb).bind_info) {
        Ok(b) => b,
        Err(e) => return e,
    };
    let s = bind_wr((*mb).wr_id, ((*mb).send_flags & 0xf) as u8, &b);
    match super::post_one(q, s) {
        0 => {
            posted(m, new_key);
            0
        }
        e => e,
    }
}

/// A WR as the send queue takes it: window binds and local invalidations
/// as rnicd's key-table WRs, the others as they are. One post of a chain
/// of both (`verbs::Qp::try_post_send`) keeps them in the order posted.
pub(crate) fn send_op(w: verbs::SendWr) -> verbs::SendOp {
    if w.opcode.is_local() {
        verbs::SendOp::Key(key_op(&w))
    } else {
        verbs::SendOp::Wr(w)
    }
}

fn key_op<'a>(w: &verbs::SendWr<'a>) -> KeyOp<'a> {
    let signaled = w.flags & verbs::send_flags::SIGNALED != 0;
    match w.opcode {
        verbs::WrOpcode::LocalInv => KeyOp::Invalidate { wr_id: w.wr_id, key: w.rkey, signaled },
        _ => KeyOp::BindWindow {
            wr_id: w.wr_id,
            key: w.rkey,
            new_key: w.swap as u32,
            iova: w.remote_addr,
            access: w.compare_add as u32,
            range: w.sg_list.first().copied(),
            signaled,
        },
    }
}
