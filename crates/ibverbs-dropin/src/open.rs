// SPDX-License-Identifier: GPL-2.0-or-later
//! ibv_open_device: a context with its rnicd connection, and the tables
//! that name which function of this library serves each verbs operation
//! (the ops that verbs.h's inline functions call). The one module that
//! knows every kind of object; the objects' modules know only the context.

use std::ffi::c_void;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::device::{open_verbs, port_attr, query_device_ex, query_port_ex, Context, Device};
use crate::pdmr::parent_domain;
use crate::qp::mw;
use crate::sys::*;
use crate::{cq, dm, qp, set_errno, srq};

#[no_mangle]
pub unsafe extern "C" fn ibv_open_device(dev: *mut ibv_device) -> *mut ibv_context {
    if dev.is_null() {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    let d = &*(dev as *mut Device);
    let Ok(inner) = open_verbs(&d.sock, d.namespace) else {
        set_errno(libc::ENODEV);
        return std::ptr::null_mut();
    };
    let port = match inner.query_port(1) {
        Ok(p) => port_attr(&p),
        Err(_) => {
            set_errno(libc::ENODEV);
            return std::ptr::null_mut();
        }
    };
    // Each eventfd is owned as soon as it exists, so that the first is
    // closed when the second fails.
    let eventfd = || match libc::eventfd(0, libc::EFD_CLOEXEC) {
        fd if fd >= 0 => Ok(OwnedFd::from_raw_fd(fd)),
        _ => Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EMFILE)),
    };
    let (async_fd, cmd_fd) = match eventfd().and_then(|a| Ok((a, eventfd()?))) {
        Ok(fds) => fds,
        Err(e) => {
            set_errno(e);
            return std::ptr::null_mut();
        }
    };
    let Ok(idle) = inner.create_comp_channel() else {
        set_errno(libc::EMFILE);
        return std::ptr::null_mut();
    };
    if inner.open_async(async_fd.as_raw_fd()).is_err() {
        set_errno(libc::ENODEV);
        return std::ptr::null_mut();
    }
    let events = Default::default();
    let mut c =
        Box::new(Context { vctx: verbs_context::default(), inner, async_fd, cmd_fd, events, idle, port, dm_allocated: Default::default() });
    let v = &mut c.vctx;
    v.sz = std::mem::size_of::<verbs_context>();
    v.query_port = Some(query_port_ex);
    v.query_device_ex = Some(query_device_ex);
    v.create_qp_ex = Some(qp::create_qp_ex);
    v.create_cq_ex = Some(cq::create_cq_ex);
    v.create_srq_ex = Some(srq::create_srq_ex);
    v.alloc_dm = Some(dm::alloc_dm);
    v.free_dm = Some(dm::free_dm);
    v.reg_dm_mr = Some(dm::reg_dm_mr);
    v.alloc_td = Some(parent_domain::alloc_td);
    v.dealloc_td = Some(parent_domain::dealloc_td);
    v.alloc_parent_domain = Some(parent_domain::alloc_parent_domain);
    v.context.device = dev;
    v.context.cmd_fd = c.cmd_fd.as_raw_fd();
    v.context.async_fd = c.async_fd.as_raw_fd();
    v.context.num_comp_vectors = 1;
    // Tells the inline functions of verbs.h that the verbs_context before
    // this ibv_context is there (verbs_get_ctx_op).
    v.context.abi_compat = usize::MAX as *mut c_void;
    libc::pthread_mutex_init(&mut v.context.mutex as *mut _ as *mut libc::pthread_mutex_t, std::ptr::null());
    let ops = &mut v.context.ops;
    ops.poll_cq = Some(cq::poll_cq);
    ops.req_notify_cq = Some(cq::req_notify_cq);
    ops.post_send = Some(qp::post_send);
    ops.post_recv = Some(qp::post_recv);
    ops.post_srq_recv = Some(srq::post_srq_recv);
    ops.alloc_mw = Some(mw::alloc_mw);
    ops.dealloc_mw = Some(mw::dealloc_mw);
    ops.bind_mw = Some(mw::bind_mw);
    let c = Box::into_raw(c);
    &mut (*c).vctx.context
}
