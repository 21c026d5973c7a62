// SPDX-License-Identifier: GPL-2.0-or-later
//! Address handles. On RoCE an AH is the provider's own record of a
//! destination (GID, traffic class, hop limit), made without the kernel, as
//! mlx5's is; this device makes it and checks it as one. UD send WRs name
//! one (`ud_dest`): its GID is where the datagram goes.

use std::ffi::c_int;
use std::sync::atomic::Ordering;

use crate::pdmr::pd;
use crate::set_errno;
use crate::sys::*;

#[repr(C)]
pub struct Ah {
    /// First, so that the program's `ibv_ah *` is this struct's address.
    pub ah: ibv_ah,
    pub attr: ibv_ah_attr,
}

/// ibv_create_ah: RoCE needs the GRH (`is_global`) with a GID index inside
/// the port's table, on port 1; anything else fails with EINVAL as on a
/// kernel RoCE driver. The AH holds its PD (ibv_dealloc_pd fails EBUSY).
#[no_mangle]
pub unsafe extern "C" fn ibv_create_ah(p: *mut ibv_pd, attr: *mut ibv_ah_attr) -> *mut ibv_ah {
    let Some(pdr) = pd(p) else {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    };
    if attr.is_null() {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    let a = &*attr;
    let gids = crate::device::ctx(pdr.pd.context).map(|c| c.port.gid_tbl_len).unwrap_or(0);
    if a.is_global == 0 || a.port_num != 1 || i32::from(a.grh.sgid_index) >= gids {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    pdr.users.fetch_add(1, Ordering::AcqRel);
    let b = Box::into_raw(Box::new(Ah { ah: ibv_ah { context: pdr.pd.context, pd: p, handle: 0 }, attr: *a }));
    &mut (*b).ah
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_ah(a: *mut ibv_ah) -> c_int {
    if a.is_null() {
        return libc::EINVAL;
    }
    let b = Box::from_raw(a as *mut Ah);
    if let Some(pdr) = pd(b.ah.pd) {
        pdr.users.fetch_sub(1, Ordering::AcqRel);
    }
    0
}

/// The destination of a UD send through AH `a`: its GID's IPv4 address
/// (an IPv4-mapped GID; any other GID gives 0.0.0.0, which rnicd refuses
/// with IBV_WC_LOC_QP_OP_ERR as an unusable address), the remote QPN and
/// Q_Key. None for a NULL AH.
pub unsafe fn ud_dest(a: *mut ibv_ah, remote_qpn: u32, remote_qkey: u32) -> Option<verbs::UdDest> {
    if a.is_null() {
        return None;
    }
    let g = (*(a as *const Ah)).attr.grh.dgid.raw;
    let mapped = g[..10] == [0; 10] && g[10] == 0xff && g[11] == 0xff;
    let gid = if mapped { std::net::Ipv4Addr::new(g[12], g[13], g[14], g[15]) } else { std::net::Ipv4Addr::UNSPECIFIED };
    Some(verbs::UdDest { gid, qpn: remote_qpn, qkey: remote_qkey })
}
