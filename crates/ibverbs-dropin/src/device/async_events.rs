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
//!
//! As in libibverbs, every event handed out about an object (here and by
//! ibv_get_cq_event) is counted on it, and destroying the object waits
//! until the program has acknowledged as many (`wait_acked`): an event
//! thread that got an event may still use the object and ack it after
//! another thread asked to destroy it.

use std::collections::{HashMap, VecDeque};
use std::ffi::{c_int, c_void};
use std::os::fd::AsRawFd;
use std::ptr::addr_of_mut;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;

use verbs::{AsyncEvent, AsyncKind};

use super::ctx;
use crate::set_errno;
use crate::sys::*;

/// An object events can name, as the address of its ibv_qp, ibv_cq or
/// ibv_srq, and of its count of events handed out (the kernel's
/// `events_reported`, which libibverbs' destroy calls wait for).
#[derive(Clone, Copy)]
struct Named {
    object: usize,
    reported: usize,
}

impl Named {
    fn new<T>(object: *mut T, reported: &AtomicU32) -> Named {
        Named { object: object as usize, reported: reported as *const AtomicU32 as usize }
    }
}

/// The objects events can name, and the events fetched but not handed out.
#[derive(Default)]
pub struct Events {
    /// QPN -> ibv_qp.
    qps: Mutex<HashMap<u32, Named>>,
    /// rnicd CQ handle -> ibv_cq.
    cqs: Mutex<HashMap<u32, Named>>,
    /// rnicd SRQ handle -> ibv_srq.
    srqs: Mutex<HashMap<u32, Named>>,
    pending: Mutex<VecDeque<(ibv_event_type, Named)>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Events {
    /// `reported` lives in the object and counts the events handed out
    /// about it (so for each of the three below).
    pub fn add_qp(&self, qpn: u32, qp: *mut ibv_qp, reported: &AtomicU32) {
        lock(&self.qps).insert(qpn, Named::new(qp, reported));
    }

    pub fn add_cq(&self, handle: u32, cq: *mut ibv_cq, reported: &AtomicU32) {
        lock(&self.cqs).insert(handle, Named::new(cq, reported));
    }

    pub fn add_srq(&self, handle: u32, srq: *mut ibv_srq, reported: &AtomicU32) {
        lock(&self.srqs).insert(handle, Named::new(srq, reported));
    }

    /// The QP, CQ or SRQ goes: its events, queued or to come, go with it.
    pub fn remove(&self, object: usize) {
        lock(&self.qps).retain(|_, n| n.object != object);
        lock(&self.cqs).retain(|_, n| n.object != object);
        lock(&self.srqs).retain(|_, n| n.object != object);
        lock(&self.pending).retain(|(_, n)| n.object != object);
    }

    /// Takes the next event to hand out, counting it as reported on its
    /// object while `pending` is locked: `remove` then either took it out
    /// first or finds it counted (and its destroy waits for the ack).
    fn next(&self) -> Option<(ibv_event_type, usize)> {
        let mut p = lock(&self.pending);
        let (t, n) = p.pop_front()?;
        // SAFETY: the object is registered (its destroy removes it from
        // `pending` under this lock before freeing it), and its count with it.
        unsafe { (*(n.reported as *const AtomicU32)).fetch_add(1, Ordering::AcqRel) };
        Some((t, n.object))
    }

    fn translate(&self, e: &AsyncEvent) -> Option<(ibv_event_type, Named)> {
        let qp = |t| lock(&self.qps).get(&e.object).map(|n| (t, *n));
        match e.kind {
            AsyncKind::QpFatal => qp(IBV_EVENT_QP_FATAL),
            AsyncKind::QpReqErr => qp(IBV_EVENT_QP_REQ_ERR),
            AsyncKind::QpAccessErr => qp(IBV_EVENT_QP_ACCESS_ERR),
            AsyncKind::CqErr => lock(&self.cqs).get(&e.object).map(|n| (IBV_EVENT_CQ_ERR, *n)),
            AsyncKind::SrqLimitReached => lock(&self.srqs).get(&e.object).map(|n| (IBV_EVENT_SRQ_LIMIT_REACHED, *n)),
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
        if let Some((t, o)) = cx.events.next() {
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
/// The objects are looked up with `pending` locked, so that an object's
/// `remove` (tables first, then `pending`) never leaves one of its events
/// behind.
fn fetch(cx: &super::Context) -> bool {
    let Ok(evs) = cx.inner.fetch_async() else { return false };
    let mut p = lock(&cx.events.pending);
    p.extend(evs.iter().filter_map(|e| cx.events.translate(e)));
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

/// An object's mutex and condition variable (ibv_cq's, ibv_qp's, ibv_srq's)
/// as libc's types.
unsafe fn pthread(mutex: *mut pthread_mutex_t, cond: *mut pthread_cond_t) -> (*mut libc::pthread_mutex_t, *mut libc::pthread_cond_t) {
    (mutex as *mut libc::pthread_mutex_t, cond as *mut libc::pthread_cond_t)
}

/// Initializes an object's mutex and condition variable in place (they
/// must not move afterwards).
pub(crate) unsafe fn init_sync(mutex: *mut pthread_mutex_t, cond: *mut pthread_cond_t) {
    let (m, c) = pthread(mutex, cond);
    libc::pthread_mutex_init(m, std::ptr::null());
    libc::pthread_cond_init(c, std::ptr::null());
}

/// Adds `n` to an object's acknowledged events under its mutex and wakes
/// a destroy waiting for them (libibverbs' ibv_ack_cq_events and
/// ibv_ack_async_event).
pub(crate) unsafe fn ack(mutex: *mut pthread_mutex_t, cond: *mut pthread_cond_t, completed: *mut u32, n: u32) {
    let (m, c) = pthread(mutex, cond);
    libc::pthread_mutex_lock(m);
    *completed = (*completed).wrapping_add(n);
    libc::pthread_cond_signal(c);
    libc::pthread_mutex_unlock(m);
}

/// Blocks until `acked()` (read under the object's mutex) holds: a destroy
/// waiting, as libibverbs' ibv_cmd_destroy_cq/qp/srq, until every event
/// handed out about the object has been acknowledged. The object no longer
/// gets new events (its caller removed it first).
pub(crate) unsafe fn wait_acked(mutex: *mut pthread_mutex_t, cond: *mut pthread_cond_t, acked: impl Fn() -> bool) {
    let (m, c) = pthread(mutex, cond);
    libc::pthread_mutex_lock(m);
    while !acked() {
        libc::pthread_cond_wait(c, m);
    }
    libc::pthread_mutex_unlock(m);
}

/// Counts the event as handled on its object, as libibverbs does, and
/// wakes a destroy of the object waiting for it.
#[no_mangle]
pub unsafe extern "C" fn ibv_ack_async_event(ev: *mut ibv_async_event) {
    if ev.is_null() {
        return;
    }
    let e = &*ev;
    match e.event_type {
        IBV_EVENT_CQ_ERR if !e.element.cq.is_null() => {
            let q = e.element.cq;
            ack(addr_of_mut!((*q).mutex), addr_of_mut!((*q).cond), addr_of_mut!((*q).async_events_completed), 1)
        }
        IBV_EVENT_QP_FATAL
        | IBV_EVENT_QP_REQ_ERR
        | IBV_EVENT_QP_ACCESS_ERR
        | IBV_EVENT_COMM_EST
        | IBV_EVENT_SQ_DRAINED
        | IBV_EVENT_PATH_MIG
        | IBV_EVENT_PATH_MIG_ERR
        | IBV_EVENT_QP_LAST_WQE_REACHED
            if !e.element.qp.is_null() =>
        {
            let q = e.element.qp;
            ack(addr_of_mut!((*q).mutex), addr_of_mut!((*q).cond), addr_of_mut!((*q).events_completed), 1)
        }
        IBV_EVENT_SRQ_ERR | IBV_EVENT_SRQ_LIMIT_REACHED if !e.element.srq.is_null() => {
            let s = e.element.srq;
            ack(addr_of_mut!((*s).mutex), addr_of_mut!((*s).cond), addr_of_mut!((*s).events_completed), 1)
        }
        _ => {}
    }
}
