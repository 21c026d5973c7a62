// SPDX-License-Identifier: GPL-2.0-or-later
//! A drop-in libibverbs.so.1 over rnicd (docs/ibverbs.md).
//!
//! Unmodified programs linked against rdma-core's libibverbs.so.1 load this
//! library instead when it comes first on the library path: they see one
//! device, `rnic0`, whose contexts, PDs, MRs, CQs, channels and RC QPs are
//! rnicd's, reached through the `verbs` crate. The library is this crate's
//! staticlib linked with rdma-core's version script (`link`): every one of
//! the 146 exports exists at its version, so that programs and the other
//! rdma-core libraries they link (libmlx5, libefa, librdmacm) load. Calls
//! this device does not support fail as a real driver's do.

// Every exported function is unsafe with the contract of its libibverbs
// man page (valid objects of this library, buffers of the sizes given).
#![allow(clippy::missing_safety_doc)]

pub mod ah;
mod chain;
pub mod cq;
pub mod device;
pub mod dm;
pub mod link;
pub mod mem;
pub mod open;
pub mod pdmr;
pub mod qp;
pub mod srq;
mod strings;
mod stubs;
pub mod sys;

pub(crate) fn set_errno(e: i32) {
    // SAFETY: errno is thread-local.
    unsafe { *libc::__errno_location() = e };
}
