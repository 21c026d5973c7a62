// SPDX-License-Identifier: GPL-2.0-or-later
//! Asynchronous events: ibv_get_async_event and ibv_ack_async_event.
//!
//! The context's `async_fd` is an eventfd that rnicd signals when it queues
//! an event for this client (rnic::async_events), so a program can poll or
//! epoll it as on a kernel driver. ibv_get_async_event reads it (blocking
//! unless the program made the fd non-blocking), fetches rnicd's queue and
//! hands the events out one per call, naming the program's ibv_qp,
//! ibv_cq or ibv_srq. Events about an object the program has since destroyed are
//! dropped.

use std::collections::{HashMap, VecDeque};
use std::ffi::{c_int, c_void};
use std::os::fd::AsRawFd;
use std::sync::Mutex;

use verbs::{AsyncEvent, AsyncKind};

use super::ctx;
use crate::set_errno;
use crate::sys::*;

/// The objects events can name, and the events fetched but not handed out.
#[derive(Default)]
pub struct Events {
    /// QPN -> ibv_qp.
    qps: Mutex<HashMap<u32, usize>>,
    /// rnicd CQ handle -> ibv_cq.
    cqs: Mutex<HashMap<u32, usize>>,
    /// rnicd SRQ handle -> ibv_srq.
    srqs: Mutex<HashMap<u32, usize>>,
    pending: Mutex<VecDeque<(ibv_event_type, usize)>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Events {
    pub fn add_qp(&self, qpn: u32, qp: *mut ibv_qp) {
        lock(&self.qps).insert(qpn, qp as usize);
    }

    pub fn add_cq(&self, handle: u32, cq: *mut ibv_cq) {
        lock(&self.cqs).insert(handle, cq as usize);
    }

    pub fn add_srq(&self, handle: u32, srq: *mut ibv_srq) {
        lock(&self.srqs).insert(handle, srq as usize);
    }

    /// The QP, CQ or SRQ goes: its events, queued or to come, go with it.
    pub fn remove(&self, object: usize) {
        lock(&self.qps).retain(|_, o| *o != object);
        lock(&self.cqs).retain(|_, o| *o != object);
        lock(&self.srqs).retain(|_, o| *o != object);
        lock(&self.pending).retain(|(_, o)| *o != object);
    }

    fn translate(&self, e: &AsyncEvent) -> Option<(ibv_event_type, usize)> {
        let qp = |t| lock(&self.qps).get(&e.object).map(|o| (t, *o));
        match e.kind {
            AsyncKind::QpFatal => qp(IBV_EVENT_QP_FATAL),
            AsyncKind::QpReqErr => qp(IBV_EVENT_QP_REQ_ERR),
            AsyncKind::QpAccessErr => qp(IBV_EVENT_QP_ACCESS_ERR),
            AsyncKind::CqErr => lock(&self.cqs).get(&e.object).map(|o| (IBV_EVENT_CQ_ERR, *o)),
            AsyncKind::SrqLimitReached => lock(&self.srqs).get(&e.object).map(|o| (IBV_EVENT_SRQ_LIMIT_REACHED, *o)),
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_get_async_event(c: *mut ibv_context, ev: *mut ibv_async_event) -> c_int {
    let Some(cx) = ctx(c) else {
        set_errno(libc::EINVAL);
        return -1;
    };
    if ev.is_null() {
        set_errno(libc::EINVAL);
        return -1;
    }
    let fd = cx.async_fd.as_raw_fd();
    loop {
        let next = lock(&cx.events.pending).pop_front();
        if let Some((t, o)) = next {
            // The fd stays readable exactly while events remain, as a
            // kernel driver's event file does.
            settle(cx, fd);
            (*ev).event_type = t;
            if t == IBV_EVENT_CQ_ERR {
                (*ev).element.cq = o as *mut ibv_cq;
            } else if t == IBV_EVENT_SRQ_LIMIT_REACHED {
                (*ev).element.srq = o as *mut ibv_srq;
            } else {
                (*ev).element.qp = o as *mut ibv_qp;
            }
            return 0;
        }
        // Blocks, or fails with EAGAIN on a non-blocking fd (errno is set).
        let mut v = 0u64;
        if libc::read(fd, &mut v as *mut u64 as *mut c_void, 8) != 8 {
            return -1;
        }
        if !fetch(cx) {
            set_errno(libc::EIO);
            return -1;
        }
    }
}

/// Moves rnicd's queued events (those naming live objects) to `pending`.
fn fetch(cx: &super::Context) -> bool {
    let Ok(evs) = cx.inner.fetch_async() else { return false };
    let mine: Vec<_> = evs.iter().filter_map(|e| cx.events.translate(e)).collect();
    lock(&cx.events.pending).extend(mine);
    true
}

/// Clears the fd's counter, takes whatever rnicd queued meanwhile (so no
/// wake-up is lost), and signals the fd again if events remain.
unsafe fn settle(cx: &super::Context, fd: c_int) {
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    if libc::poll(&mut p, 1, 0) == 1 {
        let mut v = 0u64;
        libc::read(fd, &mut v as *mut u64 as *mut c_void, 8);
    }
    fetch(cx);
    if !lock(&cx.events.pending).is_empty() {
        let one = 1u64;
        libc::write(fd, &one as *const u64 as *const c_void, 8);
    }
}

/// Counts the event as handled on its object, as libibverbs does (its
/// destroy calls wait for these counts on a kernel driver; here an object's
/// events go with it, so destroy does not wait).
#[no_mangle]
pub unsafe extern "C" fn ibv_ack_async_event(ev: *mut ibv_async_event) {
    if ev.is_null() {
        return;
    }
    let e = &*ev;
    match e.event_type {
        IBV_EVENT_CQ_ERR if !e.element.cq.is_null() => (*e.element.cq).async_events_completed += 1,
        IBV_EVENT_SRQ_LIMIT_REACHED if !e.element.srq.is_null() => (*e.element.srq).events_completed += 1,
        IBV_EVENT_QP_FATAL | IBV_EVENT_QP_REQ_ERR | IBV_EVENT_QP_ACCESS_ERR if !e.element.qp.is_null() => {
            (*e.element.qp).events_completed += 1
        }
        _ => {}
    }
}
