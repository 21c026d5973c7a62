// SPDX-License-Identifier: GPL-2.0-or-later
//! WR chains as the post calls take them (a linked list of C structs).

use std::ffi::c_int;

use smallvec::SmallVec;

use crate::sys::*;

/// WRs of one post call checked and gathered on the stack; longer chains
/// spill to the heap.
pub(crate) const POST_ON_STACK: usize = 16;

/// Names `w` as the first WR of a chain not posted, where the caller asked
/// (`bad` may be NULL), as every post call reports a failure.
pub(crate) unsafe fn name_bad<T>(bad: *mut *mut T, w: *mut T) {
    if !bad.is_null() {
        *bad = w;
    }
}

/// The errno of a post that stopped short: ENOMEM for a full queue, EINVAL
/// for a WR the queue refused.
pub(crate) fn post_errno(e: &verbs::PostError) -> c_int {
    if e.full {
        libc::ENOMEM
    } else {
        libc::EINVAL
    }
}

// ibv_sge and the ring's Sge have the same layout (addr, length, lkey).
const _: () = assert!(
    std::mem::size_of::<ibv_sge>() == std::mem::size_of::<verbs::Sge>()
        && std::mem::align_of::<ibv_sge>() == std::mem::align_of::<verbs::Sge>()
);

/// A WR's SGE list as the ring's Sges. `num_sge` 0 is an empty list
/// whatever `sg_list` is: LOCAL_INV, zero-length sends and receives
/// legally pass NULL there, and no slice may be made from a NULL pointer
/// (not even an empty one). The caller has refused a negative `num_sge`,
/// and a NULL `sg_list` with a positive one.
pub(crate) unsafe fn sge_list<'a>(sg_list: *const ibv_sge, num_sge: c_int) -> &'a [verbs::Sge] {
    if num_sge <= 0 || sg_list.is_null() {
        &[]
    } else {
        std::slice::from_raw_parts(sg_list as *const verbs::Sge, num_sge as usize)
    }
}

/// Walks a receive chain for a QP's or an SRQ's ring: takes WRs while they
/// are well formed (`max_sge` each) and may fit (no more than `depth`, the
/// queue's), posts them with `post`, and names the first WR not posted in
/// `bad` (EINVAL for a bad WR, ENOMEM for a full queue), as rxe and mlx5
/// report a partial post. `post` holds the queue's lock for the whole
/// chain and says how many WRs went in if not all did (another thread may
/// have filled the queue meanwhile), so that `bad` is exactly the first WR
/// not posted.
pub(crate) unsafe fn post_recv_chain(
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
    max_sge: usize,
    depth: usize,
    post: impl FnOnce(&[verbs::RecvWr]) -> Result<(), verbs::PostError>,
) -> c_int {
    let mut wrs: SmallVec<[verbs::RecvWr; POST_ON_STACK]> = SmallVec::new();
    let mut err = 0;
    let mut w = wr;
    while !w.is_null() {
        let r = &*w;
        if wrs.len() >= depth {
            err = libc::ENOMEM;
            break;
        }
        if r.num_sge < 0 || r.num_sge as usize > max_sge || (r.num_sge > 0 && r.sg_list.is_null()) {
            err = libc::EINVAL;
            break;
        }
        wrs.push(verbs::RecvWr { wr_id: r.wr_id, sg_list: sge_list(r.sg_list, r.num_sge) });
        w = r.next;
    }
    if !wrs.is_empty() {
        if let Err(e) = post(&wrs) {
            name_bad(bad, nth(wr, e.posted));
            return post_errno(&e);
        }
    }
    if err != 0 {
        name_bad(bad, w);
    }
    err
}

/// The `n`th WR of a chain (0: `wr`), which has more than `n`.
unsafe fn nth(mut wr: *mut ibv_recv_wr, n: usize) -> *mut ibv_recv_wr {
    for _ in 0..n {
        wr = (*wr).next;
    }
    wr
}
