// SPDX-License-Identifier: GPL-2.0-or-later
//! Completion queues and completion channels.
//!
//! ibv_poll_cq reads the CQ ring in shared memory (no system call). A
//! channel is rnicd's eventfd: it fires when an armed CQ gets a completion
//! and rnicd clears that CQ's arm, which is how ibv_get_cq_event tells which
//! of the channel's CQs the event was for.

use std::collections::VecDeque;
use std::ffi::{c_int, c_void};
use std::ptr::addr_of_mut;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Mutex;

use crate::device::async_events::{ack, init_sync, wait_acked};
use crate::device::ctx;
use crate::set_errno;
use crate::sys::*;
use verbs::pace::{now_ns, Idle, Pace};

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
    /// Its polls' history: whether an empty poll spins, yields or naps.
    pace: Pace,
    /// The completion ibv_start_poll/ibv_next_poll stand on (ibv_cq_ex).
    current: std::cell::Cell<verbs::Wc>,
    /// The context's idle channel's eventfd for a CQ made without a
    /// channel (else -1): what an idle ibv_poll_cq sleeps on.
    idle_fd: c_int,
    /// Completion events ibv_get_cq_event handed out for this CQ, and its
    /// IBV_EVENT_CQ_ERR events: ibv_destroy_cq waits until the program
    /// has acked as many (`comp_events_completed`, `async_events_completed`).
    comp_events_reported: AtomicU32,
    pub(crate) async_events_reported: AtomicU32,
}

/// The longest nap of an idle ibv_poll_cq on the idle channel.
const IDLE_NAP_MS: c_int = 1;

/// Whether streams are told from idle CQs (`TRANSIT_IBV_NO_STREAM_SPIN=1`:
/// not, for comparison).
fn stream_spin() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    !*OFF.get_or_init(|| std::env::var("TRANSIT_IBV_NO_STREAM_SPIN").as_deref() == Ok("1"))
}

#[repr(C)]
pub struct Channel {
    pub ch: ibv_comp_channel,
    pub inner: verbs::CompChannel,
    cqs: Mutex<Vec<usize>>,
    /// CQs whose event was read from the eventfd but not yet handed out.
    /// Taken with `cqs` held when both are, never the other way round.
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
    vector: c_int,
) -> *mut ibv_cq {
    create(c, cqe, cq_context, ch, vector) as *mut ibv_cq
}

/// Completion fields an ibv_cq_ex can report here.
const WC_EX_FLAGS: u64 = (IBV_WC_EX_WITH_BYTE_LEN
    | IBV_WC_EX_WITH_IMM
    | IBV_WC_EX_WITH_QP_NUM
    | IBV_WC_EX_WITH_SRC_QP
    | IBV_WC_EX_WITH_SLID
    | IBV_WC_EX_WITH_SL
    | IBV_WC_EX_WITH_DLID_PATH_BITS) as u64;

/// verbs_context.create_cq_ex (ibv_create_cq_ex).
pub unsafe extern "C" fn create_cq_ex(c: *mut ibv_context, attr: *mut ibv_cq_init_attr_ex) -> *mut ibv_cq_ex {
    if attr.is_null() {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    let a = &*attr;
    // A CQ may name a parent domain (and only one: mlx5's rule); its queue
    // keeps the library's memory (pdmr/parent_domain.rs).
    if a.comp_mask & IBV_CQ_INIT_ATTR_MASK_PD != 0 && crate::pdmr::pd(a.parent_domain).is_none_or(|p| p.parent.is_none()) {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    let known = IBV_CQ_INIT_ATTR_MASK_FLAGS | IBV_CQ_INIT_ATTR_MASK_PD;
    let flags_ok = a.comp_mask & !known == 0 && (a.comp_mask & IBV_CQ_INIT_ATTR_MASK_FLAGS == 0 || a.flags == 0);
    if a.wc_flags & !WC_EX_FLAGS != 0 || !flags_ok {
        set_errno(libc::EOPNOTSUPP);
        return std::ptr::null_mut();
    }
    if a.cqe > i32::MAX as u32 {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    let q = create(c, a.cqe as c_int, a.cq_context, a.channel, a.comp_vector as c_int);
    if !q.is_null() {
        let x = &mut (*q).cq;
        x.start_poll = Some(start_poll);
        x.next_poll = Some(next_poll);
        x.end_poll = Some(end_poll);
        x.read_opcode = Some(read_opcode);
        x.read_vendor_err = Some(read_zero_u32);
        x.read_byte_len = Some(read_byte_len);
        x.read_imm_data = Some(read_imm_data);
        x.read_qp_num = Some(read_qp_num);
        x.read_src_qp = Some(read_src_qp);
        x.read_wc_flags = Some(read_wc_flags);
        x.read_slid = Some(read_zero_u32);
        x.read_sl = Some(read_zero_u8);
        x.read_dlid_path_bits = Some(read_zero_u8);
    }
    q as *mut ibv_cq_ex
}

unsafe fn current<'a>(x: *mut ibv_cq_ex) -> &'a Cq {
    &*(x as *const Cq)
}

/// Takes the next completion into `current`; ENOENT when there is none.
unsafe fn advance(x: *mut ibv_cq_ex) -> c_int {
    let mut wc: ibv_wc = Default::default();
    match poll_cq(x as *mut ibv_cq, 1, &mut wc) {
        1 => {
            let q = current(x);
            q.current.set(verbs::Wc {
                wr_id: wc.wr_id,
                status: verbs::WcStatus::from_u8(wc.status as u8),
                opcode: verbs::WcOpcode::from_u8(wc.opcode as u8),
                byte_len: wc.byte_len,
                imm_data: wc.__bindgen_anon_1.imm_data,
                qp_num: wc.qp_num,
                src_qp: wc.src_qp,
                wc_flags: wc.wc_flags as u8,
            });
            (*x).status = wc.status;
            (*x).wr_id = wc.wr_id;
            0
        }
        0 => libc::ENOENT,
        _ => libc::EINVAL,
    }
}

unsafe extern "C" fn start_poll(x: *mut ibv_cq_ex, attr: *mut ibv_poll_cq_attr) -> c_int {
    if !attr.is_null() && (*attr).comp_mask != 0 {
        return libc::EINVAL;
    }
    advance(x)
}
unsafe extern "C" fn next_poll(x: *mut ibv_cq_ex) -> c_int {
    advance(x)
}
unsafe extern "C" fn end_poll(_x: *mut ibv_cq_ex) {}
unsafe extern "C" fn read_opcode(x: *mut ibv_cq_ex) -> ibv_wc_opcode {
    current(x).current.get().opcode as ibv_wc_opcode
}
unsafe extern "C" fn read_byte_len(x: *mut ibv_cq_ex) -> u32 {
    current(x).current.get().byte_len
}
/// Already in network order (as poll_cq's imm_data).
unsafe extern "C" fn read_imm_data(x: *mut ibv_cq_ex) -> __be32 {
    current(x).current.get().imm_data
}
unsafe extern "C" fn read_qp_num(x: *mut ibv_cq_ex) -> u32 {
    current(x).current.get().qp_num
}
unsafe extern "C" fn read_src_qp(x: *mut ibv_cq_ex) -> u32 {
    current(x).current.get().src_qp
}
unsafe extern "C" fn read_wc_flags(x: *mut ibv_cq_ex) -> std::ffi::c_uint {
    current(x).current.get().wc_flags as std::ffi::c_uint
}
unsafe extern "C" fn read_zero_u32(_x: *mut ibv_cq_ex) -> u32 {
    0
}
unsafe extern "C" fn read_zero_u8(_x: *mut ibv_cq_ex) -> u8 {
    0
}

unsafe fn create(c: *mut ibv_context, cqe: c_int, cq_context: *mut c_void, ch: *mut ibv_comp_channel, vector: c_int) -> *mut Cq {
    let Some(cx) = ctx(c) else {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    };
    // One completion vector (num_comp_vectors is 1).
    if vector < 0 || vector >= (*c).num_comp_vectors {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    let max = cx.inner.query_device().map(|d| d.max_cqe).unwrap_or(1 << 16);
    if cqe < 1 || cqe as u32 > max {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    let chan = ch as *mut Channel;
    // A CQ without a channel of the program's gets the context's idle
    // channel: the program never arms such a CQ itself. Its polls nap on
    // it only when rnicd is an ordinary process, to leave rnicd the CPU;
    // a real-time rnicd preempts the program anyway, and a nap would only
    // cost it an eventfd write and the program a wake-up per completion
    // (docs/ibverbs.md, "What works").
    let nap = chan.is_null() && !cx.inner.rnicd_realtime();
    let channel = if chan.is_null() { &cx.idle } else { &(*chan).inner };
    let idle_fd = if nap { cx.idle.fd() } else { -1 };
    let inner = match cx.inner.create_cq(cqe as u32, Some(channel)) {
        Ok(q) => q,
        Err(_) => {
            set_errno(libc::ENOMEM);
            return std::ptr::null_mut();
        }
    };
    let x = ibv_cq_ex { context: c, channel: ch, cq_context, cqe: inner.cap as c_int, ..Default::default() };
    let b = Box::into_raw(Box::new(Cq {
        cq: x,
        inner,
        armed: AtomicBool::new(false),
        chan,
        users: 0.into(),
        pace: Pace::default(),
        current: Default::default(),
        idle_fd,
        comp_events_reported: AtomicU32::new(0),
        async_events_reported: AtomicU32::new(0),
    }));
    init_sync(addr_of_mut!((*b).cq.mutex), addr_of_mut!((*b).cq.cond));
    if !chan.is_null() {
        (*chan).ch.refcnt += 1;
        (*chan).cqs.lock().unwrap_or_else(|e| e.into_inner()).push(b as usize);
    }
    cx.events.add_cq((*b).inner.handle(), b as *mut ibv_cq, &(*b).async_events_reported);
    b
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
    if let Some(cx) = ctx(q.cq.context) {
        cx.events.remove(c as usize);
    }
    // No more events name the CQ; those handed out must be acked first
    // (their thread may still use the CQ), as libibverbs' destroy waits.
    let b = c as *mut Cq;
    wait_acked(addr_of_mut!((*b).cq.mutex), addr_of_mut!((*b).cq.cond), || {
        (*b).cq.comp_events_completed == (*b).comp_events_reported.load(Ordering::Acquire)
            && (*b).cq.async_events_completed == (*b).async_events_reported.load(Ordering::Acquire)
    });
    drop(Box::from_raw(b));
    0
}

/// A CQ's ring (a power of two at least the size asked) shrinks never and
/// grows by moving: a size within the ring succeeds at once and `cqe` stays
/// the ring's size, as a driver may give more than asked; a larger one moves
/// the CQ to a new ring (`verbs::Cq::resize`, rnicd's ResizeCq), its
/// unpolled completions still first. Fewer than the completions it holds,
/// or past the device's limit, fail with EINVAL as on kernel drivers.
#[no_mangle]
pub unsafe extern "C" fn ibv_resize_cq(c: *mut ibv_cq, cqe: c_int) -> c_int {
    let Some(q) = cq(c) else { return libc::EINVAL };
    let Some(cx) = ctx(q.cq.context) else { return libc::EINVAL };
    let max = cx.inner.query_device().map(|d| d.max_cqe).unwrap_or(1 << 16);
    if cqe < 1 || cqe as u32 > max {
        return libc::EINVAL;
    }
    // A shrink is judged against what the CQ holds once rnicd has taken
    // the WRs already posted (it works asynchronously: a hardware CQ would
    // hold their completions by now; pyverbs' test_resize_cq posts sends and
    // at once shrinks below them).
    if cqe < (*c).cqe {
        match q.inner.settled() {
            Ok(n) if (cqe as u32) < n => return libc::EINVAL,
            Ok(_) => {}
            Err(_) => return libc::EIO,
        }
    }
    if cqe > (*c).cqe {
        match q.inner.resize(cqe as u32) {
            Ok(cap) => (*c).cqe = cap as c_int,
            Err(_) => return libc::ENOMEM,
        }
    }
    0
}

pub unsafe extern "C" fn poll_cq(c: *mut ibv_cq, n: c_int, wc: *mut ibv_wc) -> c_int {
    let Some(q) = cq(c) else { return -libc::EINVAL };
    // A negative count takes nothing and is no error: rxe's and mlx5's
    // poll loops (`for (npolled = 0; npolled < ne; ...)`) return 0.
    if n <= 0 {
        return 0;
    }
    if wc.is_null() {
        return -libc::EINVAL;
    }
    match look(q, n as usize, wc) {
        Ok(k) => {
            // Every completion counts for the pace, found at once or after
            // a nap: a ping-pong whose completions came after naps and went
            // unnoted looked idle from then on and napped in every round
            // trip (verbs::pace).
            if k > 0 {
                q.pace.found(now_ns());
            }
            k as c_int
        }
        Err(e) => e,
    }
}

/// One ibv_poll_cq: takes what is there; if nothing, spins, yields or naps
/// as the CQ's pace says, and then takes what is there.
unsafe fn look(q: &Cq, n: usize, wc: *mut ibv_wc) -> Result<usize, c_int> {
    let k = take(q, n, wc)?;
    if k > 0 || n == 0 {
        return Ok(k);
    }
    match q.pace.empty(now_ns(), q.idle_fd >= 0, stream_spin()) {
        Idle::Spin => Ok(0),
        Idle::Yield => {
            libc::sched_yield();
            Ok(0)
        }
        Idle::Nap => {
            // Arm, look once more (a completion may have landed before the
            // arm), then sleep until rnicd signals or the nap ends.
            q.inner.req_notify(false);
            let k = take(q, n, wc)?;
            if k > 0 {
                return Ok(k);
            }
            let mut p = libc::pollfd { fd: q.idle_fd, events: libc::POLLIN, revents: 0 };
            if libc::poll(&mut p, 1, IDLE_NAP_MS) > 0 {
                let mut v = 0u64;
                libc::read(q.idle_fd, &mut v as *mut u64 as *mut c_void, 8);
            }
            take(q, n, wc)
        }
    }
}

/// Moves up to `n` completions from the ring into `wc`.
unsafe fn take(q: &Cq, n: usize, wc: *mut ibv_wc) -> Result<usize, c_int> {
    let mut buf = [verbs::Wc::default(); 32];
    let mut done = 0usize;
    while done < n {
        let want = (n - done).min(buf.len());
        let k = q.inner.poll(&mut buf[..want]).map_err(|_| -libc::EOVERFLOW)?;
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
    Ok(done)
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
            if let Some(c) = next {
                // Counted while `pending` is locked: ibv_destroy_cq takes
                // the CQ out of it under the lock, then waits for the ack
                // of every event counted.
                (*(c as *const Cq)).comp_events_reported.fetch_add(1, Ordering::AcqRel);
                if !p.is_empty() {
                    // Keep the fd readable for the events still pending, so a
                    // program that polls the fd before each call sees them.
                    let one = 1u64;
                    libc::write(chan.ch.fd, &one as *const u64 as *const c_void, 8);
                }
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
        // The channel's CQs stay listed (and so alive) while they are looked at.
        let cqs = chan.cqs.lock().unwrap_or_else(|e| e.into_inner());
        let mut p = chan.pending.lock().unwrap_or_else(|e| e.into_inner());
        for &c in cqs.iter() {
            let q = &*(c as *const Cq);
            if q.armed.load(Ordering::Acquire) && !q.inner.armed() {
                q.armed.store(false, Ordering::Release);
                p.push_back(c);
            }
        }
    }
}

/// Acknowledges `n` events of the CQ and wakes an ibv_destroy_cq waiting
/// for them, as libibverbs does.
#[no_mangle]
pub unsafe extern "C" fn ibv_ack_cq_events(c: *mut ibv_cq, n: std::ffi::c_uint) {
    if !c.is_null() {
        ack(addr_of_mut!((*c).mutex), addr_of_mut!((*c).cond), addr_of_mut!((*c).comp_events_completed), n);
    }
}
