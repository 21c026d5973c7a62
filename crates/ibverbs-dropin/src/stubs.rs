// SPDX-License-Identifier: GPL-2.0-or-later
//! Exports this device does not support. They exist so that every import
//! of a program or of the other rdma-core libraries resolves at load time
//! (everything there is linked BIND_NOW); called, they fail as a kernel
//! driver without the feature does. Arguments are not read, so the stubs
//! take none (the C caller cleans up its own arguments on x86-64).

use std::ffi::{c_int, c_void};

use crate::set_errno;

/// Functions returning an errno value (0 is success).
macro_rules! errno_stubs {
    ($($name:ident),* $(,)?) => {$(
        #[no_mangle]
        pub extern "C" fn $name() -> c_int { libc::EOPNOTSUPP }
    )*};
}

/// Functions returning a pointer: NULL with errno.
macro_rules! null_stubs {
    ($($name:ident),* $(,)?) => {$(
        #[no_mangle]
        pub extern "C" fn $name() -> *mut c_void { set_errno(libc::EOPNOTSUPP); std::ptr::null_mut() }
    )*};
}

/// Functions returning -1 with errno.
macro_rules! minus_one_stubs {
    ($($name:ident),* $(,)?) => {$(
        #[no_mangle]
        pub extern "C" fn $name() -> c_int { set_errno(libc::EOPNOTSUPP); -1 }
    )*};
}

/// Functions without a result (driver and import plumbing).
macro_rules! void_stubs {
    ($($name:ident),* $(,)?) => {$(
        #[no_mangle]
        pub extern "C" fn $name() {}
    )*};
}

// The kernel-command layer for providers (libmlx5, libefa): no kernel
// uverbs device here, so every command fails as without one.
errno_stubs!(
    ibv_cmd_advise_mr,
    ibv_cmd_alloc_dm,
    ibv_cmd_alloc_mw,
    ibv_cmd_alloc_pd,
    ibv_cmd_attach_mcast,
    ibv_cmd_close_xrcd,
    ibv_cmd_create_ah,
    ibv_cmd_create_counters,
    ibv_cmd_create_cq,
    ibv_cmd_create_cq_ex,
    ibv_cmd_create_flow,
    ibv_cmd_create_flow_action_esp,
    ibv_cmd_create_qp,
    ibv_cmd_create_qp_ex,
    ibv_cmd_create_qp_ex2,
    ibv_cmd_create_rwq_ind_table,
    ibv_cmd_create_srq,
    ibv_cmd_create_srq_ex,
    ibv_cmd_create_wq,
    ibv_cmd_dealloc_mw,
    ibv_cmd_dealloc_pd,
    ibv_cmd_dereg_mr,
    ibv_cmd_destroy_ah,
    ibv_cmd_destroy_counters,
    ibv_cmd_destroy_cq,
    ibv_cmd_destroy_flow,
    ibv_cmd_destroy_flow_action,
    ibv_cmd_destroy_qp,
    ibv_cmd_destroy_rwq_ind_table,
    ibv_cmd_destroy_srq,
    ibv_cmd_destroy_wq,
    ibv_cmd_detach_mcast,
    ibv_cmd_free_dm,
    ibv_cmd_get_context,
    ibv_cmd_modify_cq,
    ibv_cmd_modify_flow_action_esp,
    ibv_cmd_modify_qp,
    ibv_cmd_modify_qp_ex,
    ibv_cmd_modify_srq,
    ibv_cmd_modify_wq,
    ibv_cmd_open_qp,
    ibv_cmd_open_xrcd,
    ibv_cmd_poll_cq,
    ibv_cmd_post_recv,
    ibv_cmd_post_send,
    ibv_cmd_post_srq_recv,
    ibv_cmd_query_context,
    ibv_cmd_query_device_any,
    ibv_cmd_query_mr,
    ibv_cmd_query_port,
    ibv_cmd_query_qp,
    ibv_cmd_query_srq,
    ibv_cmd_read_counters,
    ibv_cmd_reg_dm_mr,
    ibv_cmd_reg_dmabuf_mr,
    ibv_cmd_reg_mr,
    ibv_cmd_req_notify_cq,
    ibv_cmd_rereg_mr,
    ibv_cmd_resize_cq,
    execute_ioctl,
);

// Verbs this device lacks: multicast and address handles from completions
// (UD), ECE,
// resolving L2 addresses, importing objects of another process.
errno_stubs!(ibv_attach_mcast, ibv_detach_mcast, ibv_query_ece, ibv_set_ece, ibv_init_ah_from_wc, ibv_resolve_eth_l2_from_gid,);
null_stubs!(
    ibv_create_ah_from_wc,
    ibv_import_device,
    ibv_import_dm,
    ibv_import_mr,
    ibv_import_pd,
    ibv_reg_dmabuf_mr,
    _verbs_init_and_alloc_context,
    verbs_open_device,
);
// sysfs: the device has no sysfs directory, so reading its files fails.
minus_one_stubs!(ibv_read_sysfs_file, ibv_read_ibdev_sysfs_file);

/// Where sysfs is mounted (a string, as rdma-core returns).
#[no_mangle]
pub extern "C" fn ibv_get_sysfs_path() -> *const std::ffi::c_char {
    c"/sys".as_ptr()
}
void_stubs!(
    ibv_unimport_dm,
    ibv_unimport_mr,
    ibv_unimport_pd,
    ibv_copy_ah_attr_from_kern,
    ibv_copy_path_rec_from_kern,
    ibv_copy_path_rec_to_kern,
    ibv_copy_qp_attr_from_kern,
    __verbs_log,
    verbs_init_cq,
    verbs_set_ops,
    verbs_uninit_context,
);

/// Called by the constructors of libmlx5 and libefa when they load; the
/// drop-in has no providers, so there is nothing to register.
#[no_mangle]
pub extern "C" fn verbs_register_driver_34() {}

#[no_mangle]
pub static mut verbs_allow_disassociate_destroy: bool = false;

#[no_mangle]
pub extern "C" fn __ioctl_final_num_attrs() -> std::ffi::c_uint {
    0
}

/// Registered pages are handled across fork by the library (mem.rs): a
/// child gets its own copy, as with a kernel that needs no fork support.
#[no_mangle]
pub extern "C" fn ibv_fork_init() -> c_int {
    0
}

/// IBV_FORK_UNNEEDED.
#[no_mangle]
pub extern "C" fn ibv_is_fork_initialized() -> c_int {
    crate::sys::IBV_FORK_UNNEEDED as c_int
}

#[no_mangle]
pub extern "C" fn ibv_dontfork_range() -> c_int {
    0
}

#[no_mangle]
pub extern "C" fn ibv_dofork_range() -> c_int {
    0
}

/// IBV_QUERY_QP_DATA_IN_ORDER_WHOLE_MSG is not promised: 0.
#[no_mangle]
pub extern "C" fn ibv_query_qp_data_in_order() -> c_int {
    0
}
