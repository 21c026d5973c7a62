// SPDX-License-Identifier: GPL-2.0-or-later
//! Completion queues and completion channels.
//!
//! ibv_poll_cq reads the CQ ring in shared memory (no system call). A
//! channel is rnicd's eventfd: it fires when an armed CQ gets a completion
//! and rnicd clears that CQ's arm, which is how ibv_get_cq_event tells which
//! of the channel's CQs the event was for.

use std::collections::VecDeque;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use crate::device::ctx;
use crate::set_errno;
use crate::sys::*;

#[repr(C)]
pub struct Cq {
    /// An ibv_cq_ex, whose first fields are the ibv_cq.
    pub cq: ibv_cq_ex,
    pub inner: verbs::Cq,
    /// Armed by ibv_req_notify_cq and not yet reported by ibv_get_cq_event.
    armed: AtomicBool,
    chan: *mut Channel,
    /// QPs using this CQ.
    pub users: std::sync::atomic::AtomicUsize,
    /// ibv_poll_cq calls in a row that found nothing.
    empty_polls: std::sync::atomic::AtomicU32,
}

/// Empty polls in a row after which ibv_poll_cq yields the CPU. A program
/// that spins on its CQ (as perftest and ibv_rc_pingpong do) would
/// otherwise starve rnicd, which does the NIC's work on the same CPUs: on a
/// loaded 2-CPU host a spinning ping-pong took 30 ms per round trip, and
/// 90 us when it yielded. A poll that finds completions never yields.
const SPINS_BEFORE_YIELD: u32 = 16;

#[repr(C)]
pub struct Channel {
    pub ch: ibv_comp_channel,
    pub inner: verbs::CompChannel,
    cqs: Mutex<Vec<usize>>,
    /// CQs whose event was read from the eventfd but not yet handed out.
    pending: Mutex<VecDeque<usize>>,
}

pub unsafe fn cq<'a>(c: *mut ibv_cq) -> Option<&'a Cq> {
    (!c.is_null()).then(|| &*(c as *const Cq))
}

#[no_mangle]
pub unsafe extern "C" fn ibv_create_comp_channel(c: *mut ibv_context) -> *mut ibv_comp_channel {
    let Some(cx) = ctx(c) else {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    };
    match cx.inner.create_comp_channel() {
        Ok(inner) => {
            let ch = ibv_comp_channel { context: c, fd: inner.fd(), refcnt: 0 };
            Box::into_raw(Box::new(Channel { ch, inner, cqs: Mutex::new(Vec::new()), pending: Mutex::new(VecDeque::new()) }))
                as *mut ibv_comp_channel
        }
        Err(_) => {
            set_errno(libc::EMFILE);
            std::ptr::null_mut()
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_comp_channel(ch: *mut ibv_comp_channel) -> c_int {
    if ch.is_null() {
        return libc::EINVAL;
    }
    if (*ch).refcnt > 0 {
        return libc::EBUSY;
    }
    drop(Box::from_raw(ch as *mut Channel));
    0
}

#[no_mangle]
pub unsafe extern "C" fn ibv_create_cq(
    c: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    ch: *mut ibv_comp_channel,
    _vector: c_int,
) -> *mut ibv_cq {
    let Some(cx) = ctx(c) else {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    };
    let max = cx.inner.query_device().map(|d| d.max_cqe).unwrap_or(1 << 16);
    if cqe < 1 || cqe as u32 > max {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    let chan = ch as *mut Channel;
    let inner = match cx.inner.create_cq(cqe as u32, if chan.is_null() { None } else { Some(&(*chan).inner) }) {
        Ok(q) => q,
        Err(_) => {
            set_errno(libc::ENOMEM);
            return std::ptr::null_mut();
        }
    };
    let mut x = ibv_cq_ex { context: c, channel: ch, cq_context, cqe: inner.cap as c_int, ..Default::default() };
    libc::pthread_mutex_init(&mut x.mutex as *mut _ as *mut libc::pthread_mutex_t, std::ptr::null());
    libc::pthread_cond_init(&mut x.cond as *mut _ as *mut libc::pthread_cond_t, std::ptr::null());
    let b = Box::into_raw(Box::new(Cq { cq: x, inner, armed: AtomicBool::new(false), chan, users: 0.into(), empty_polls: 0.into() }));
    if !chan.is_null() {
        (*chan).ch.refcnt += 1;
        (*chan).cqs.lock().unwrap_or_else(|e| e.into_inner()).push(b as usize);
    }
    b as *mut ibv_cq
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_cq(c: *mut ibv_cq) -> c_int {
    let Some(q) = cq(c) else { return libc::EINVAL };
    if q.users.load(Ordering::Acquire) > 0 {
        return libc::EBUSY;
    }
    let chan = q.chan;
    if !chan.is_null() {
        (*chan).cqs.lock().unwrap_or_else(|e| e.into_inner()).retain(|x| *x != c as usize);
        (*chan).pending.lock().unwrap_or_else(|e| e.into_inner()).retain(|x| *x != c as usize);
        (*chan).ch.refcnt -= 1;
    }
    drop(Box::from_raw(c as *mut Cq));
    0
}

#[no_mangle]
pub unsafe extern "C" fn ibv_resize_cq(_c: *mut ibv_cq, _cqe: c_int) -> c_int {
    libc::EOPNOTSUPP
}

pub unsafe extern "C" fn poll_cq(c: *mut ibv_cq, n: c_int, wc: *mut ibv_wc) -> c_int {
    let Some(q) = cq(c) else { return -libc::EINVAL };
    if n < 0 || (n > 0 && wc.is_null()) {
        return -libc::EINVAL;
    }
    let mut buf = [verbs::Wc::default(); 32];
    let mut done = 0usize;
    while done < n as usize {
        let want = (n as usize - done).min(buf.len());
        let k = match q.inner.poll(&mut buf[..want]) {
            Ok(k) => k,
            Err(_) => return -libc::EOVERFLOW,
        };
        for (i, w) in buf[..k].iter().enumerate() {
            let out = &mut *wc.add(done + i);
            *out = ibv_wc {
                wr_id: w.wr_id,
                status: w.status as u32,
                opcode: w.opcode as u32,
                byte_len: w.byte_len,
                qp_num: w.qp_num,
                src_qp: w.src_qp,
                wc_flags: w.wc_flags as u32,
                ..Default::default()
            };
            out.__bindgen_anon_1.imm_data = if w.wc_flags & verbs::wc_flags::WITH_INV != 0 { w.imm_data } else { w.imm_data.to_be() };
        }
        done += k;
        if k < want {
            break;
        }
    }
    if done == 0 && n > 0 {
        if q.empty_polls.fetch_add(1, Ordering::Relaxed) >= SPINS_BEFORE_YIELD {
            libc::sched_yield();
        }
    } else {
        q.empty_polls.store(0, Ordering::Relaxed);
    }
    done as c_int
}

pub unsafe extern "C" fn req_notify_cq(c: *mut ibv_cq, solicited_only: c_int) -> c_int {
    let Some(q) = cq(c) else { return libc::EINVAL };
    q.armed.store(true, Ordering::Release);
    q.inner.req_notify(solicited_only != 0);
    0
}

#[no_mangle]
pub unsafe extern "C" fn ibv_get_cq_event(ch: *mut ibv_comp_channel, cq_out: *mut *mut ibv_cq, ctx_out: *mut *mut c_void) -> c_int {
    if ch.is_null() || cq_out.is_null() {
        set_errno(libc::EINVAL);
        return -1;
    }
    let chan = &*(ch as *const Channel);
    loop {
        let next = {
            let mut p = chan.pending.lock().unwrap_or_else(|e| e.into_inner());
            let next = p.pop_front();
            if next.is_some() && !p.is_empty() {
                // Keep the fd readable for the events still pending, so a
                // program that polls the fd before each call sees them.
                let one = 1u64;
                libc::write(chan.ch.fd, &one as *const u64 as *const c_void, 8);
            }
            next
        };
        if let Some(c) = next {
            let q = &*(c as *const Cq);
            *cq_out = c as *mut ibv_cq;
            if !ctx_out.is_null() {
                *ctx_out = q.cq.cq_context;
            }
            return 0;
        }
        let mut v = 0u64;
        if libc::read(chan.ch.fd, &mut v as *mut u64 as *mut c_void, 8) != 8 {
            return -1; // errno from read: EAGAIN on a non-blocking channel
        }
        let cqs = chan.cqs.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let mut p = chan.pending.lock().unwrap_or_else(|e| e.into_inner());
        for c in cqs {
            let q = &*(c as *const Cq);
            if q.armed.load(Ordering::Acquire) && !q.inner.armed() {
                q.armed.store(false, Ordering::Release);
                p.push_back(c);
            }
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_ack_cq_events(c: *mut ibv_cq, n: std::ffi::c_uint) {
    if let Some(q) = cq(c) {
        let m = &q.cq.mutex as *const _ as *mut libc::pthread_mutex_t;
        libc::pthread_mutex_lock(m);
        (*(c as *mut Cq)).cq.comp_events_completed += n;
        libc::pthread_mutex_unlock(m);
    }
}
