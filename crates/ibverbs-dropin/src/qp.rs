// SPDX-License-Identifier: GPL-2.0-or-later
//! RC and UD queue pairs: create, modify, query, destroy, and the post calls.
//!
//! ibv_post_send/ibv_post_recv translate the WR chain into the SQ/RQ rings
//! in shared memory; a system call (the doorbell) happens only when rnicd
//! is not polling the rings. A chain is checked before any WR is posted,
//! then posted under the queue's lock, as a driver posts it; `bad_wr`
//! points at the first WR that was not posted, also when another thread
//! filled the queue meanwhile.

use std::ffi::c_int;
use std::net::Ipv4Addr;
use std::ptr::addr_of_mut;
use std::sync::atomic::{AtomicU32, Ordering};

use smallvec::SmallVec;

use crate::chain::{name_bad, post_errno, post_recv_chain, sge_list, POST_ON_STACK};
use crate::cq::{cq, Cq};
use crate::device::async_events::{init_sync, wait_acked};
use crate::pdmr::{pd, Pd};
use crate::set_errno;
use crate::sys::*;

pub mod mw;

#[repr(C)]
pub struct Qp {
    /// Every QP is an ibv_qp_ex (its first field is the ibv_qp).
    pub qpx: ibv_qp_ex,
    pub inner: verbs::Qp,
    send_cq: *const Cq,
    recv_cq: *const Cq,
    pd: *const Pd,
    /// Whether the QP was made with send_ops_flags (ibv_qp_to_qp_ex).
    extended: bool,
    /// IBV_QPT_RC, IBV_QPT_UC or IBV_QPT_UD.
    qp_type: ibv_qp_type,
    /// As created (init_attr.sq_sig_all), for ibv_query_qp.
    sq_sig_all: c_int,
    /// WRs built by ibv_wr_* since ibv_wr_start, posted by ibv_wr_complete.
    batch: std::sync::Mutex<Batch>,
    /// Asynchronous events ibv_get_async_event handed out about the QP:
    /// ibv_destroy_qp waits until the program has acked as many
    /// (`events_completed`).
    pub(crate) events_reported: AtomicU32,
    /// The rings' memory from a parent domain's allocator: after `inner`
    /// (dropped first, unmapping the rings), so that it goes back to the
    /// allocator only once the rings are gone.
    _queue_memory: Option<crate::pdmr::parent_domain::QueueMemory>,
}

/// One WR built through the ibv_qp_ex builders.
struct PendingWr {
    wr_id: u64,
    opcode: verbs::WrOpcode,
    flags: u8,
    remote_addr: u64,
    rkey: u32,
    compare_add: u64,
    swap: u64,
    imm: u32,
    sges: Vec<verbs::Sge>,
    inline: Option<Vec<u8>>,
    /// UD: set by ibv_wr_set_ud_addr.
    ud: Option<verbs::UdDest>,
    /// A window's bind: the window and its new key (qp/mw.rs).
    window: Option<(*mut ibv_mw, u32)>,
}

#[derive(Default)]
struct Batch {
    wrs: Vec<PendingWr>,
    /// The first error of the batch (reported by ibv_wr_complete).
    err: c_int,
}

impl Qp {
    /// Sends are taken in RTS, SQD, SQE and ERR (flushed there); before
    /// RTS they fail with EINVAL, as in rxe and mlx5.
    fn can_send(&self) -> bool {
        !matches!(self.qpx.qp_base.state, IBV_QPS_RESET | IBV_QPS_INIT | IBV_QPS_RTR)
    }
}

unsafe fn qp<'a>(q: *mut ibv_qp) -> Option<&'a Qp> {
    (!q.is_null()).then(|| &*(q as *const Qp))
}

unsafe fn create(c: *mut ibv_context, attr: *mut ibv_qp_init_attr_ex) -> *mut ibv_qp {
    let fail = |e: i32| {
        set_errno(e);
        std::ptr::null_mut()
    };
    if attr.is_null() {
        return fail(libc::EINVAL);
    }
    let a = &mut *attr;
    let Some(pdr) = pd(a.pd) else { return fail(libc::EINVAL) };
    let qp_type = match a.qp_type {
        IBV_QPT_RC => verbs::QpType::Rc,
        IBV_QPT_UC => verbs::QpType::Uc,
        IBV_QPT_UD => verbs::QpType::Ud,
        _ => return fail(libc::EOPNOTSUPP),
    };
    let srq = crate::srq::srq(a.srq);
    let (Some(scq), Some(rcq)) = (cq(a.send_cq), cq(a.recv_cq)) else { return fail(libc::EINVAL) };
    let Some(cx) = crate::device::ctx(c) else { return fail(libc::EINVAL) };
    let dev = match cx.inner.query_device() {
        Ok(d) => d,
        Err(_) => return fail(libc::EIO),
    };
    let cap = &mut a.cap;
    if cap.max_send_wr > dev.max_qp_wr
        || cap.max_recv_wr > dev.max_qp_wr
        || cap.max_send_sge > dev.max_sge
        || cap.max_recv_sge > dev.max_sge
        || cap.max_inline_data > dev.max_inline_data
    {
        return fail(libc::EINVAL);
    }
    let mut init = verbs::QpInitAttr::new(&scq.inner, &rcq.inner);
    init.cap = verbs::QpCap {
        max_send_wr: cap.max_send_wr.max(1),
        max_recv_wr: cap.max_recv_wr.max(1),
        max_send_sge: cap.max_send_sge.max(1),
        max_recv_sge: cap.max_recv_sge.max(1),
        max_inline_data: cap.max_inline_data,
    };
    init.sq_sig_all = a.sq_sig_all != 0;
    init.qp_type = qp_type;
    let queue_memory = match crate::pdmr::parent_domain::QueueMemory::for_qp(a.pd, verbs::qp_ring_bytes(&init.cap)) {
        Ok(m) => m,
        Err(e) => return fail(e),
    };
    init.rings_at = queue_memory.as_ref().map(|m| m.rings_at());
    let inner = match pdr.inner.create_qp(&init) {
        Ok(q) => q,
        Err(_) => return fail(libc::ENOMEM),
    };
    if let Some(s) = srq {
        if inner.attach_srq(&s.inner).is_err() {
            return fail(libc::EINVAL);
        }
    }
    // The caps the QP really has, as drivers report back.
    cap.max_send_wr = inner.cap.max_send_wr;
    // A QP on an SRQ has no receive queue of its own.
    cap.max_recv_wr = if srq.is_some() { 0 } else { inner.cap.max_recv_wr };
    cap.max_send_sge = inner.cap.max_send_sge;
    cap.max_recv_sge = if srq.is_some() { 0 } else { inner.cap.max_recv_sge };
    cap.max_inline_data = inner.cap.max_inline_data;
    let mut x = ibv_qp_ex::default();
    let base = &mut x.qp_base;
    base.context = c;
    base.qp_context = a.qp_context;
    base.pd = a.pd;
    base.send_cq = a.send_cq;
    base.recv_cq = a.recv_cq;
    base.srq = a.srq;
    base.handle = inner.qpn;
    base.qp_num = inner.qpn;
    base.state = IBV_QPS_RESET;
    base.qp_type = a.qp_type;
    let extended = a.comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS != 0;
    if extended {
        let ops = match qp_type {
            verbs::QpType::Rc => SEND_OPS,
            verbs::QpType::Uc => UC_SEND_OPS,
            verbs::QpType::Ud => UD_SEND_OPS,
        };
        if a.send_ops_flags & !ops != 0 {
            return fail(libc::EOPNOTSUPP);
        }
        if a.qp_type == IBV_QPT_UD {
            x.wr_set_ud_addr = Some(wr_set_ud_addr);
        }
        x.wr_start = Some(wr_start);
        x.wr_complete = Some(wr_complete);
        x.wr_abort = Some(wr_abort);
        x.wr_rdma_write = Some(wr_rdma_write);
        x.wr_rdma_write_imm = Some(wr_rdma_write_imm);
        x.wr_rdma_read = Some(wr_rdma_read);
        x.wr_atomic_write = Some(wr_atomic_write);
        x.wr_send = Some(wr_send);
        x.wr_send_imm = Some(wr_send_imm);
        x.wr_send_inv = Some(wr_send_inv);
        x.wr_local_inv = Some(wr_local_inv);
        x.wr_bind_mw = Some(wr_bind_mw);
        x.wr_atomic_cmp_swp = Some(wr_atomic_cmp_swp);
        x.wr_atomic_fetch_add = Some(wr_atomic_fetch_add);
        x.wr_set_sge = Some(wr_set_sge);
        x.wr_set_sge_list = Some(wr_set_sge_list);
        x.wr_set_inline_data = Some(wr_set_inline_data);
        x.wr_set_inline_data_list = Some(wr_set_inline_data_list);
    }
    scq.users.fetch_add(1, Ordering::AcqRel);
    rcq.users.fetch_add(1, Ordering::AcqRel);
    pdr.users.fetch_add(1, Ordering::AcqRel);
    if let Some(s) = srq {
        s.users.fetch_add(1, Ordering::AcqRel);
    }
    let b = Box::into_raw(Box::new(Qp {
        qpx: x,
        inner,
        send_cq: scq,
        recv_cq: rcq,
        pd: pdr,
        extended,
        qp_type: a.qp_type,
        sq_sig_all: (a.sq_sig_all != 0) as c_int,
        batch: Default::default(),
        events_reported: AtomicU32::new(0),
        _queue_memory: queue_memory,
    }));
    init_sync(addr_of_mut!((*b).qpx.qp_base.mutex), addr_of_mut!((*b).qpx.qp_base.cond));
    if let Some(cx) = crate::device::ctx(c) {
        cx.events.add_qp((*b).inner.qpn, b as *mut ibv_qp, &(*b).events_reported);
    }
    b as *mut ibv_qp
}

#[no_mangle]
pub unsafe extern "C" fn ibv_create_qp(p: *mut ibv_pd, attr: *mut ibv_qp_init_attr) -> *mut ibv_qp {
    let (Some(pdr), false) = (pd(p), attr.is_null()) else {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    };
    let a = &mut *attr;
    let mut ex = ibv_qp_init_attr_ex {
        qp_context: a.qp_context,
        send_cq: a.send_cq,
        recv_cq: a.recv_cq,
        srq: a.srq,
        cap: a.cap,
        qp_type: a.qp_type,
        sq_sig_all: a.sq_sig_all,
        comp_mask: IBV_QP_INIT_ATTR_PD,
        pd: p,
        ..Default::default()
    };
    let q = create(pdr.pd.context, &mut ex);
    a.cap = ex.cap;
    q
}

pub unsafe extern "C" fn create_qp_ex(c: *mut ibv_context, attr: *mut ibv_qp_init_attr_ex) -> *mut ibv_qp {
    if attr.is_null() {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    // Creation flags are accepted when there are none (all of them ask for
    // hardware features: scatter FCS, CVLAN stripping, source QPN...).
    let known = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS | IBV_QP_INIT_ATTR_CREATE_FLAGS;
    let flags = if (*attr).comp_mask & IBV_QP_INIT_ATTR_CREATE_FLAGS != 0 { (*attr).create_flags } else { 0 };
    if (*attr).comp_mask & !known != 0 || (*attr).comp_mask & IBV_QP_INIT_ATTR_PD == 0 || flags != 0 {
        set_errno(libc::EOPNOTSUPP);
        return std::ptr::null_mut();
    }
    create(c, attr)
}

#[no_mangle]
pub unsafe extern "C" fn ibv_qp_to_qp_ex(q: *mut ibv_qp) -> *mut ibv_qp_ex {
    match qp(q) {
        Some(x) if x.extended => q as *mut ibv_qp_ex,
        _ => {
            set_errno(libc::EOPNOTSUPP);
            std::ptr::null_mut()
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_qp(q: *mut ibv_qp) -> c_int {
    if q.is_null() {
        return libc::EINVAL;
    }
    if let Some(cx) = crate::device::ctx((*q).context) {
        cx.events.remove(q as usize);
    }
    // No more events name the QP; those handed out must be acked first
    // (their thread may still use the QP), as libibverbs' destroy waits.
    let x = q as *mut Qp;
    wait_acked(addr_of_mut!((*q).mutex), addr_of_mut!((*q).cond), || (*q).events_completed == (*x).events_reported.load(Ordering::Acquire));
    let b = Box::from_raw(x);
    (*b.send_cq).users.fetch_sub(1, Ordering::AcqRel);
    (*b.recv_cq).users.fetch_sub(1, Ordering::AcqRel);
    (*b.pd).users.fetch_sub(1, Ordering::AcqRel);
    if let Some(s) = crate::srq::srq(b.qpx.qp_base.srq) {
        s.users.fetch_sub(1, Ordering::AcqRel);
    }
    drop(b);
    0
}

fn state_from(s: ibv_qp_state) -> Option<verbs::QpState> {
    use verbs::QpState::*;
    Some(match s {
        IBV_QPS_RESET => Reset,
        IBV_QPS_INIT => Init,
        IBV_QPS_RTR => Rtr,
        IBV_QPS_RTS => Rts,
        IBV_QPS_SQD => Sqd,
        IBV_QPS_SQE => Sqe,
        IBV_QPS_ERR => Err,
        _ => return None,
    })
}

fn state_to(s: verbs::QpState) -> ibv_qp_state {
    use verbs::QpState::*;
    match s {
        Reset => IBV_QPS_RESET,
        Init => IBV_QPS_INIT,
        Rtr => IBV_QPS_RTR,
        Rts => IBV_QPS_RTS,
        Sqd => IBV_QPS_SQD,
        Sqe => IBV_QPS_SQE,
        Err => IBV_QPS_ERR,
    }
}

fn mtu_from(m: ibv_mtu) -> Option<verbs::Mtu> {
    Some(match m {
        IBV_MTU_256 => verbs::Mtu::M256,
        IBV_MTU_512 => verbs::Mtu::M512,
        IBV_MTU_1024 => verbs::Mtu::M1024,
        IBV_MTU_2048 => verbs::Mtu::M2048,
        IBV_MTU_4096 => verbs::Mtu::M4096,
        _ => return None,
    })
}

fn mtu_to(m: verbs::Mtu) -> ibv_mtu {
    match m {
        verbs::Mtu::M256 => IBV_MTU_256,
        verbs::Mtu::M512 => IBV_MTU_512,
        verbs::Mtu::M1024 => IBV_MTU_1024,
        verbs::Mtu::M2048 => IBV_MTU_2048,
        _ => IBV_MTU_4096,
    }
}

/// Attribute mask bits this device understands (RC's, UC's and UD's).
/// IBV_QP_CAP is in no transition of the IB spec's table (kernel drivers
/// refuse it in every one), and IBV_QP_EN_SQD_ASYNC_NOTIFY asks for an
/// IBV_EVENT_SQ_DRAINED that rnicd never raises; both fail with EINVAL,
/// as do alternate paths.
const KNOWN_MASK: c_int = (IBV_QP_STATE
    | IBV_QP_QKEY
    | IBV_QP_CUR_STATE
    | IBV_QP_ACCESS_FLAGS
    | IBV_QP_PKEY_INDEX
    | IBV_QP_PORT
    | IBV_QP_AV
    | IBV_QP_PATH_MTU
    | IBV_QP_TIMEOUT
    | IBV_QP_RETRY_CNT
    | IBV_QP_RNR_RETRY
    | IBV_QP_RQ_PSN
    | IBV_QP_MAX_QP_RD_ATOMIC
    | IBV_QP_MIN_RNR_TIMER
    | IBV_QP_SQ_PSN
    | IBV_QP_MAX_DEST_RD_ATOMIC
    | IBV_QP_PATH_MIG_STATE
    | IBV_QP_DEST_QPN) as c_int;

/// Which of IBV_QP_CUR_STATE and IBV_QP_PATH_MIG_STATE the transition
/// `cur` -> `new` of a QP of type `t` takes as optional attributes in the
/// IB spec's table (Linux's qp_state_table, ib_modify_qp_is_ok). Neither
/// means anything to rnicd (a QP has one path, always migrated), so the
/// drop-in takes them there and refuses them elsewhere, as drivers do.
fn bookkeeping_attrs(t: ibv_qp_type, cur: ibv_qp_state, new: ibv_qp_state) -> u32 {
    let ud = t == IBV_QPT_UD;
    match (cur, new) {
        (IBV_QPS_RTR | IBV_QPS_RTS | IBV_QPS_SQD, IBV_QPS_RTS) if ud => IBV_QP_CUR_STATE,
        (IBV_QPS_RTR | IBV_QPS_RTS | IBV_QPS_SQD, IBV_QPS_RTS) => IBV_QP_CUR_STATE | IBV_QP_PATH_MIG_STATE,
        // RC has no SQE state (UC and UD do).
        (IBV_QPS_SQE, IBV_QPS_RTS) if t != IBV_QPT_RC => IBV_QP_CUR_STATE,
        (IBV_QPS_SQD, IBV_QPS_SQD) if !ud => IBV_QP_PATH_MIG_STATE,
        _ => 0,
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_modify_qp(q: *mut ibv_qp, attr: *mut ibv_qp_attr, mask: c_int) -> c_int {
    let (Some(x), false) = (qp(q), attr.is_null()) else { return libc::EINVAL };
    if mask & !KNOWN_MASK != 0 {
        return libc::EINVAL;
    }
    let a = &*attr;
    let mask = mask as u32;
    // As the kernel: the transition is judged from the state the caller
    // names with IBV_QP_CUR_STATE, else from the QP's.
    let cur = if mask & IBV_QP_CUR_STATE != 0 { a.cur_qp_state } else { x.qpx.qp_base.state };
    if state_from(cur).is_none() {
        return libc::EINVAL;
    }
    let new = if mask & IBV_QP_STATE != 0 { a.qp_state } else { cur };
    let bookkeeping = mask & (IBV_QP_CUR_STATE | IBV_QP_PATH_MIG_STATE);
    if bookkeeping & !bookkeeping_attrs(x.qp_type, cur, new) != 0 {
        return libc::EINVAL;
    }
    let mask = mask & !bookkeeping;
    let mut v = verbs::QpAttr::default();
    if mask & IBV_QP_STATE != 0 {
        let Some(s) = state_from(a.qp_state) else { return libc::EINVAL };
        v.qp_state = s;
    }
    if mask & IBV_QP_PATH_MTU != 0 {
        let Some(m) = mtu_from(a.path_mtu) else { return libc::EINVAL };
        v.path_mtu = m;
    }
    if mask & IBV_QP_AV != 0 {
        // RoCE needs the GRH: its destination GID is the peer's address.
        if a.ah_attr.is_global == 0 {
            return libc::EINVAL;
        }
        // The source GID must be one of the port's.
        let gids = crate::device::ctx(x.qpx.qp_base.context).map(|c| c.port.gid_tbl_len).unwrap_or(0);
        if i32::from(a.ah_attr.grh.sgid_index) >= gids {
            return libc::EINVAL;
        }
        let g = a.ah_attr.grh.dgid.raw;
        if g[..10] != [0; 10] || g[10] != 0xff || g[11] != 0xff {
            return libc::EINVAL;
        }
        v.dest_gid = Ipv4Addr::new(g[12], g[13], g[14], g[15]);
    }
    v.qp_access_flags = a.qp_access_flags;
    v.pkey_index = a.pkey_index;
    v.port_num = a.port_num;
    v.dest_qp_num = a.dest_qp_num;
    v.rq_psn = a.rq_psn;
    v.sq_psn = a.sq_psn;
    v.max_rd_atomic = a.max_rd_atomic;
    v.max_dest_rd_atomic = a.max_dest_rd_atomic;
    v.min_rnr_timer = a.min_rnr_timer;
    v.timeout = a.timeout;
    v.retry_cnt = a.retry_cnt;
    v.rnr_retry = a.rnr_retry;
    v.qkey = a.qkey;
    match x.inner.modify(&v, mask) {
        Ok(()) => {
            if mask & IBV_QP_STATE != 0 {
                (*(q as *mut Qp)).qpx.qp_base.state = a.qp_state;
                if a.qp_state == IBV_QPS_RESET {
                    // As kernel drivers do: a QP back in RESET leaves no
                    // completions behind in its CQs.
                    (*x.send_cq).inner.discard_qp(x.inner.qpn);
                    (*x.recv_cq).inner.discard_qp(x.inner.qpn);
                }
            }
            0
        }
        Err(_) => libc::EINVAL,
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_qp(q: *mut ibv_qp, attr: *mut ibv_qp_attr, mask: c_int, init: *mut ibv_qp_init_attr) -> c_int {
    let (Some(x), false) = (qp(q), attr.is_null()) else { return libc::EINVAL };
    let Ok((v, cap)) = x.inner.query() else { return libc::EINVAL };
    // A QP on an SRQ has no receive queue of its own (as create reports).
    let on_srq = !x.qpx.qp_base.srq.is_null();
    let mut a = ibv_qp_attr {
        qp_state: state_to(v.qp_state),
        cur_qp_state: state_to(v.qp_state),
        path_mtu: mtu_to(v.path_mtu),
        path_mig_state: IBV_MIG_MIGRATED,
        rq_psn: v.rq_psn,
        sq_psn: v.sq_psn,
        dest_qp_num: v.dest_qp_num,
        qp_access_flags: v.qp_access_flags,
        cap: ibv_qp_cap {
            max_send_wr: cap.max_send_wr,
            max_recv_wr: if on_srq { 0 } else { cap.max_recv_wr },
            max_send_sge: cap.max_send_sge,
            max_recv_sge: if on_srq { 0 } else { cap.max_recv_sge },
            max_inline_data: cap.max_inline_data,
        },
        pkey_index: v.pkey_index,
        sq_draining: v.sq_draining as u8,
        max_rd_atomic: v.max_rd_atomic,
        max_dest_rd_atomic: v.max_dest_rd_atomic,
        min_rnr_timer: v.min_rnr_timer,
        port_num: v.port_num,
        timeout: v.timeout,
        retry_cnt: v.retry_cnt,
        rnr_retry: v.rnr_retry,
        qkey: v.qkey,
        ..Default::default()
    };
    a.ah_attr.is_global = 1;
    a.ah_attr.port_num = v.port_num;
    a.ah_attr.grh.hop_limit = 64;
    let mut g = [0u8; 16];
    g[10] = 0xff;
    g[11] = 0xff;
    g[12..].copy_from_slice(&v.dest_gid.octets());
    a.ah_attr.grh.dgid.raw = g;
    *attr = a;
    if !init.is_null() {
        let b = &x.qpx.qp_base;
        *init = ibv_qp_init_attr {
            qp_context: b.qp_context,
            send_cq: b.send_cq,
            recv_cq: b.recv_cq,
            srq: b.srq,
            cap: a.cap,
            qp_type: x.qp_type,
            sq_sig_all: x.sq_sig_all,
        };
    }
    // As libibverbs' ibv_query_qp: the state read becomes qp->state (rnicd
    // moves a QP to ERR on its own).
    if mask as u32 & IBV_QP_STATE != 0 {
        (*(q as *mut Qp)).qpx.qp_base.state = a.qp_state;
    }
    0
}

pub unsafe extern "C" fn post_send(q: *mut ibv_qp, wr: *mut ibv_send_wr, bad: *mut *mut ibv_send_wr) -> c_int {
    let Some(x) = qp(q) else {
        name_bad(bad, wr);
        return libc::EINVAL;
    };
    if !x.can_send() {
        name_bad(bad, wr);
        return libc::EINVAL;
    }
    let cap = x.inner.cap;
    // No more WRs than the queue holds are gathered; whether they fit now
    // is for the post to say, the queue locked (another thread may be
    // posting to it).
    let depth = cap.max_send_wr as usize;
    // Inline payloads gathered per WR (they must outlive the post call).
    let mut inline: Vec<Vec<u8>> = Vec::new();
    // A chain of up to POST_ON_STACK WRs is checked and posted without a
    // heap allocation: perftest and most programs post one WR per call.
    let mut wrs: SmallVec<[(*mut ibv_send_wr, verbs::WrOpcode); POST_ON_STACK]> = SmallVec::new();
    // Window binds, in the order of their WRs (qp/mw.rs).
    let mut binds: Vec<(*mut ibv_mw, mw::Bind)> = Vec::new();
    let mut err = 0;
    let mut w = wr;
    while !w.is_null() {
        let r = &*w;
        if wrs.len() >= depth {
            err = libc::ENOMEM;
            break;
        }
        // Memory windows' WRs (qp/mw.rs): BIND_MW becomes rnicd's key bind,
        // LOCAL_INV its invalidation; other values are refused as drivers do.
        let op = if r.opcode == IBV_WR_BIND_MW { Some(verbs::WrOpcode::BindKey) } else { verbs::WrOpcode::from_u8(r.opcode as u8) };
        let Some(op) = op.filter(|op| r.opcode <= 9 && (r.opcode == IBV_WR_LOCAL_INV || r.opcode == IBV_WR_BIND_MW || !op.is_local()))
        else {
            err = libc::EINVAL;
            break;
        };
        // UD sends only SENDs, each to the address handle its WR names.
        if x.qp_type == IBV_QPT_UD
            && (!matches!(op, verbs::WrOpcode::Send | verbs::WrOpcode::SendImm) || crate::ah::ud_dest(r.wr.ud.ah, 0, 0).is_none())
        {
            err = libc::EINVAL;
            break;
        }
        if x.qp_type == IBV_QPT_UC && !uc_carries(op) {
            err = libc::EINVAL;
            break;
        }
        if op == verbs::WrOpcode::BindKey {
            // A bind names its range in bind_mw, not in the SGE list.
            let b = &r.__bindgen_anon_2.bind_mw;
            let earlier = binds.iter().rev().find(|(m, _)| *m == b.mw).map(|(_, e)| e.new_key);
            match mw::bind_request(b.mw, earlier, b.rkey, &b.bind_info) {
                Ok(bind) => binds.push((b.mw, bind)),
                Err(e) => {
                    err = e;
                    break;
                }
            }
            wrs.push((w, op));
            w = r.next;
            continue;
        }
        if r.num_sge < 0 || (r.num_sge > 0 && r.sg_list.is_null()) {
            err = libc::EINVAL;
            break;
        }
        let sges = sge_list(r.sg_list, r.num_sge);
        // More SGEs than the QP takes are refused, inline data too (as
        // rxe's validate_send_wr).
        if sges.len() > cap.max_send_sge as usize || (op.is_atomic() && sges.len() != 1) {
            err = libc::EINVAL;
            break;
        }
        if r.send_flags & IBV_SEND_INLINE != 0 && !op.is_read_or_atomic() {
            let total: usize = sges.iter().map(|s| s.length as usize).sum();
            if total > cap.max_inline_data as usize {
                err = libc::EINVAL;
                break;
            }
            let mut buf = Vec::with_capacity(total);
            // An empty SGE may have a NULL address.
            for s in sges.iter().filter(|s| s.length > 0) {
                buf.extend_from_slice(std::slice::from_raw_parts(s.addr as *const u8, s.length as usize));
            }
            inline.push(buf);
        }
        wrs.push((w, op));
        w = r.next;
    }
    let mut posted: SmallVec<[verbs::SendOp; POST_ON_STACK]> = SmallVec::with_capacity(wrs.len());
    let mut inl = inline.iter();
    let mut bind = binds.iter();
    for &(w, op) in &wrs {
        let r = &*w;
        if op == verbs::WrOpcode::BindKey {
            let (_, b) = bind.next().expect("checked above");
            posted.push(mw::send_op(mw::bind_wr(r.wr_id, (r.send_flags & 0xf) as u8 & !verbs::send_flags::INLINE, b)));
            continue;
        }
        let mut s = verbs::SendWr::new(r.wr_id, op, sge_list(r.sg_list, r.num_sge));
        s.flags = (r.send_flags & 0xf) as u8 & !verbs::send_flags::INLINE;
        match op {
            verbs::WrOpcode::RdmaWrite | verbs::WrOpcode::RdmaWriteImm | verbs::WrOpcode::RdmaRead => {
                s.remote_addr = r.wr.rdma.remote_addr;
                s.rkey = r.wr.rdma.rkey;
            }
            verbs::WrOpcode::AtomicCmpSwp | verbs::WrOpcode::AtomicFetchAdd => {
                s.remote_addr = r.wr.atomic.remote_addr;
                s.rkey = r.wr.atomic.rkey;
                s.compare_add = r.wr.atomic.compare_add;
                s.swap = r.wr.atomic.swap;
            }
            _ => {}
        }
        if x.qp_type == IBV_QPT_UD {
            s.ud = crate::ah::ud_dest(r.wr.ud.ah, r.wr.ud.remote_qpn, r.wr.ud.remote_qkey);
        }
        match op {
            verbs::WrOpcode::SendImm | verbs::WrOpcode::RdmaWriteImm => s.imm = u32::from_be(r.__bindgen_anon_1.imm_data),
            verbs::WrOpcode::SendInv => s.imm = r.__bindgen_anon_1.invalidate_rkey,
            verbs::WrOpcode::LocalInv => s.rkey = r.__bindgen_anon_1.invalidate_rkey,
            _ => {}
        }
        if r.send_flags & IBV_SEND_INLINE != 0 && !op.is_read_or_atomic() {
            s = s.with_inline(inl.next().expect("gathered above"));
        }
        posted.push(mw::send_op(s));
    }
    // The whole chain is posted under the send queue's lock; if the queue
    // filled first, the post says where it stopped.
    let (n, stop) = if posted.is_empty() {
        (0, 0)
    } else {
        match x.inner.try_post_send(&posted, false) {
            Ok(()) => (wrs.len(), 0),
            Err(e) => (e.posted, post_errno(&e)),
        }
    };
    let mut bind = binds.iter();
    for _ in wrs[..n].iter().filter(|(_, op)| *op == verbs::WrOpcode::BindKey) {
        let (m, b) = bind.next().expect("one per bind WR");
        mw::posted(*m, b.new_key);
    }
    if stop != 0 {
        name_bad(bad, wrs[n].0);
        return stop;
    }
    if err != 0 {
        name_bad(bad, w);
    }
    err
}

pub unsafe extern "C" fn post_recv(q: *mut ibv_qp, wr: *mut ibv_recv_wr, bad: *mut *mut ibv_recv_wr) -> c_int {
    let Some(x) = qp(q) else {
        name_bad(bad, wr);
        return libc::EINVAL;
    };
    // As rxe and mlx5: a QP in RESET, or on an SRQ, takes no receives.
    if x.qpx.qp_base.state == IBV_QPS_RESET || !x.qpx.qp_base.srq.is_null() {
        name_bad(bad, wr);
        return libc::EINVAL;
    }
    let (max_sge, depth) = (x.inner.cap.max_recv_sge as usize, x.inner.cap.max_recv_wr as usize);
    post_recv_chain(wr, bad, max_sge, depth, |wrs| x.inner.try_post_recv(wrs))
}

/// Posts one WR built elsewhere (a type 1 window's bind, qp/mw.rs) on an RC
/// QP that can send.
pub(crate) unsafe fn post_one(q: *mut ibv_qp, s: verbs::SendWr) -> c_int {
    let Some(x) = qp(q) else { return libc::EINVAL };
    if !x.can_send() || x.qp_type == IBV_QPT_UD {
        return libc::EINVAL;
    }
    match x.inner.try_post_send(&[mw::send_op(s)], true) {
        Ok(()) => 0,
        Err(e) => post_errno(&e),
    }
}

/// The ibv_wr_* operations this device builds (send_ops_flags).
const SEND_OPS: u64 = (IBV_QP_EX_WITH_RDMA_WRITE
    | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM
    | IBV_QP_EX_WITH_ATOMIC_WRITE
    | IBV_QP_EX_WITH_SEND
    | IBV_QP_EX_WITH_SEND_WITH_IMM
    | IBV_QP_EX_WITH_RDMA_READ
    | IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP
    | IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD
    | IBV_QP_EX_WITH_SEND_WITH_INV
    | IBV_QP_EX_WITH_LOCAL_INV
    | IBV_QP_EX_WITH_BIND_MW) as u64;

/// Those of a UD QP.
const UD_SEND_OPS: u64 = (IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM) as u64;
/// UC: SEND and RDMA WRITE (with immediate), and the local WRs; no READ,
/// atomics or SEND with invalidate (IBA 9.8.3).
const UC_SEND_OPS: u64 = (IBV_QP_EX_WITH_RDMA_WRITE
    | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM
    | IBV_QP_EX_WITH_SEND
    | IBV_QP_EX_WITH_SEND_WITH_IMM
    | IBV_QP_EX_WITH_LOCAL_INV
    | IBV_QP_EX_WITH_BIND_MW) as u64;

/// Whether a UC QP takes this WR (as rxe's `wr_opcode_mask` for UC).
fn uc_carries(op: verbs::WrOpcode) -> bool {
    use verbs::WrOpcode::*;
    matches!(op, Send | SendImm | RdmaWrite | RdmaWriteImm | LocalInv | BindKey)
}

unsafe fn batch<'a>(q: *mut ibv_qp_ex) -> std::sync::MutexGuard<'a, Batch> {
    (*(q as *const Qp)).batch.lock().unwrap_or_else(|e| e.into_inner())
}

unsafe extern "C" fn wr_start(q: *mut ibv_qp_ex) {
    *batch(q) = Batch::default();
}

unsafe extern "C" fn wr_abort(q: *mut ibv_qp_ex) {
    *batch(q) = Batch::default();
}

/// Posts the batch; all or nothing, as the builders of kernel drivers.
unsafe extern "C" fn wr_complete(q: *mut ibv_qp_ex) -> c_int {
    let b = std::mem::take(&mut *batch(q));
    if b.err != 0 {
        return b.err;
    }
    let x = &*(q as *const Qp);
    if !x.can_send() {
        return libc::EINVAL;
    }
    let cap = x.inner.cap;
    let mut wrs = Vec::with_capacity(b.wrs.len());
    for p in &b.wrs {
        let mut s = verbs::SendWr::new(p.wr_id, p.opcode, &p.sges);
        s.flags = p.flags & !verbs::send_flags::INLINE;
        s.remote_addr = p.remote_addr;
        s.rkey = p.rkey;
        s.compare_add = p.compare_add;
        s.swap = p.swap;
        s.imm = p.imm;
        if x.qp_type == IBV_QPT_UD {
            if p.ud.is_none() {
                return libc::EINVAL;
            }
            s.ud = p.ud;
        }
        if x.qp_type == IBV_QPT_UC && !uc_carries(p.opcode) {
            return libc::EINVAL;
        }
        if let Some(d) = &p.inline {
            // An atomic write's 8 bytes travel in the WQE whatever the QP's
            // inline size (they are the WR's operand, as a CAS's are).
            if d.len() > cap.max_inline_data as usize && p.opcode != verbs::WrOpcode::AtomicWrite {
                return libc::EINVAL;
            }
            s = s.with_inline(d);
        } else if p.sges.len() > cap.max_send_sge as usize || (p.opcode.is_atomic() && p.sges.len() != 1) {
            return libc::EINVAL;
        }
        wrs.push(mw::send_op(s));
    }
    // All or nothing under the send queue's lock (another thread may be
    // posting to it).
    match x.inner.try_post_send(&wrs, true) {
        Ok(()) => {
            for (m, key) in b.wrs.iter().filter_map(|p| p.window) {
                mw::posted(m, key);
            }
            0
        }
        Err(e) => post_errno(&e),
    }
}

/// Starts the next WR of the batch with the QP's wr_id and wr_flags.
unsafe fn push(q: *mut ibv_qp_ex, opcode: verbs::WrOpcode, rkey: u32, remote_addr: u64) -> std::sync::MutexGuard<'static, Batch> {
    let mut b = batch(q);
    b.wrs.push(PendingWr {
        wr_id: (*q).wr_id,
        opcode,
        flags: ((*q).wr_flags & 0xf) as u8,
        remote_addr,
        rkey,
        compare_add: 0,
        swap: 0,
        imm: 0,
        sges: Vec::new(),
        inline: None,
        ud: None,
        window: None,
    });
    b
}

unsafe extern "C" fn wr_rdma_write(q: *mut ibv_qp_ex, rkey: u32, addr: u64) {
    drop(push(q, verbs::WrOpcode::RdmaWrite, rkey, addr));
}
unsafe extern "C" fn wr_rdma_write_imm(q: *mut ibv_qp_ex, rkey: u32, addr: u64, imm: __be32) {
    push(q, verbs::WrOpcode::RdmaWriteImm, rkey, addr).wrs.last_mut().unwrap().imm = u32::from_be(imm);
}
/// ibv_wr_atomic_write: the 8 bytes at `data` go in the WQE.
unsafe extern "C" fn wr_atomic_write(q: *mut ibv_qp_ex, rkey: u32, addr: u64, data: *const std::ffi::c_void) {
    let v = if data.is_null() { None } else { Some(std::slice::from_raw_parts(data as *const u8, 8).to_vec()) };
    let mut b = push(q, verbs::WrOpcode::AtomicWrite, rkey, addr);
    match v {
        Some(v) => b.wrs.last_mut().unwrap().inline = Some(v),
        None => b.err = libc::EINVAL,
    }
}
unsafe extern "C" fn wr_rdma_read(q: *mut ibv_qp_ex, rkey: u32, addr: u64) {
    drop(push(q, verbs::WrOpcode::RdmaRead, rkey, addr));
}
unsafe extern "C" fn wr_send(q: *mut ibv_qp_ex) {
    drop(push(q, verbs::WrOpcode::Send, 0, 0));
}
unsafe extern "C" fn wr_send_imm(q: *mut ibv_qp_ex, imm: __be32) {
    push(q, verbs::WrOpcode::SendImm, 0, 0).wrs.last_mut().unwrap().imm = u32::from_be(imm);
}
unsafe extern "C" fn wr_send_inv(q: *mut ibv_qp_ex, invalidate_rkey: u32) {
    push(q, verbs::WrOpcode::SendInv, 0, 0).wrs.last_mut().unwrap().imm = invalidate_rkey;
}
unsafe extern "C" fn wr_local_inv(q: *mut ibv_qp_ex, invalidate_rkey: u32) {
    drop(push(q, verbs::WrOpcode::LocalInv, invalidate_rkey, 0));
}
unsafe extern "C" fn wr_bind_mw(q: *mut ibv_qp_ex, m: *mut ibv_mw, rkey: u32, info: *const ibv_mw_bind_info) {
    let mut b = push(q, verbs::WrOpcode::BindKey, 0, 0);
    // The key an earlier bind of this batch gives the window, if any.
    let earlier = b.wrs.iter().rev().skip(1).find_map(|p| p.window.filter(|(w, _)| *w == m).map(|(_, k)| k));
    let r = if info.is_null() { Err(libc::EINVAL) } else { mw::bind_request(m, earlier, rkey, &*info) };
    match r {
        Ok(bind) => {
            let w = b.wrs.last_mut().unwrap();
            w.rkey = bind.key;
            w.remote_addr = bind.iova;
            w.compare_add = bind.access as u64;
            w.swap = bind.new_key as u64;
            w.sges = bind.range;
            w.window = Some((m, rkey));
        }
        Err(e) => b.err = e,
    }
}
unsafe extern "C" fn wr_atomic_cmp_swp(q: *mut ibv_qp_ex, rkey: u32, addr: u64, compare: u64, swap: u64) {
    let mut b = push(q, verbs::WrOpcode::AtomicCmpSwp, rkey, addr);
    let w = b.wrs.last_mut().unwrap();
    w.compare_add = compare;
    w.swap = swap;
}
unsafe extern "C" fn wr_atomic_fetch_add(q: *mut ibv_qp_ex, rkey: u32, addr: u64, add: u64) {
    push(q, verbs::WrOpcode::AtomicFetchAdd, rkey, addr).wrs.last_mut().unwrap().compare_add = add;
}

/// Applies `f` to the WR being built; a setter without a WR is an error of
/// the batch.
unsafe fn with_last(q: *mut ibv_qp_ex, f: impl FnOnce(&mut PendingWr)) {
    let mut b = batch(q);
    match b.wrs.last_mut() {
        Some(w) => f(w),
        None => b.err = libc::EINVAL,
    }
}

unsafe extern "C" fn wr_set_ud_addr(q: *mut ibv_qp_ex, ah: *mut ibv_ah, remote_qpn: u32, remote_qkey: u32) {
    let d = crate::ah::ud_dest(ah, remote_qpn, remote_qkey);
    let mut b = batch(q);
    match (b.wrs.last_mut(), d) {
        (Some(w), Some(d)) => w.ud = Some(d),
        _ => b.err = libc::EINVAL,
    }
}

unsafe extern "C" fn wr_set_sge(q: *mut ibv_qp_ex, lkey: u32, addr: u64, length: u32) {
    with_last(q, |w| w.sges = vec![verbs::Sge { addr, length, lkey }]);
}
unsafe extern "C" fn wr_set_sge_list(q: *mut ibv_qp_ex, n: usize, list: *const ibv_sge) {
    let sges = if n == 0 || list.is_null() { &[][..] } else { std::slice::from_raw_parts(list as *const verbs::Sge, n) };
    with_last(q, |w| w.sges = sges.to_vec());
}
unsafe extern "C" fn wr_set_inline_data(q: *mut ibv_qp_ex, addr: *mut std::ffi::c_void, length: usize) {
    let d = if length == 0 { Vec::new() } else { std::slice::from_raw_parts(addr as *const u8, length).to_vec() };
    with_last(q, |w| w.inline = Some(d));
}
unsafe extern "C" fn wr_set_inline_data_list(q: *mut ibv_qp_ex, n: usize, list: *const ibv_data_buf) {
    let mut d = Vec::new();
    for i in 0..n {
        let b = &*list.add(i);
        if b.length > 0 {
            d.extend_from_slice(std::slice::from_raw_parts(b.addr as *const u8, b.length));
        }
    }
    with_last(q, |w| w.inline = Some(d));
}
