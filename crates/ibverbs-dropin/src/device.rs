// SPDX-License-Identifier: GPL-2.0-or-later
//! Devices and contexts: ibv_get_device_list, the queries (ibv_open_device
//! is in open.rs).
//!
//! There is one device, `rnic0`: the rnicd this process finds (the verbs
//! crate's `find_socket`: `TRANSIT_RNICD_SOCK` or the default socket of one
//! of the namespace's addresses). `TRANSIT_IBV_NAMESPACE=A.B.C.D` opens the
//! RDMA namespace of that GID inside it instead of rnicd's own.

use std::ffi::{c_char, c_int, c_void};
use std::net::Ipv4Addr;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::Mutex;

use crate::set_errno;
use crate::sys::*;

pub mod async_events;

pub const DEVICE_NAME: &str = "rnic0";

/// Device memory per context, reported as `max_dm_size` (the MEMIC size
/// of the NICs the tests were written on).
pub const MAX_DM_SIZE: u64 = 256 << 10;

/// An ibv_device with what opening it needs.
#[repr(C)]
pub struct Device {
    pub dev: ibv_device,
    pub sock: PathBuf,
    pub namespace: Option<Ipv4Addr>,
    pub guid: u64,
}

/// An ibv_context inside its verbs_context, with the rnicd connection.
#[repr(C)]
pub struct Context {
    pub vctx: verbs_context,
    pub inner: verbs::Context,
    /// The eventfd rnicd signals when it queues an asynchronous event for
    /// this context (async_events.rs).
    pub async_fd: OwnedFd,
    pub events: async_events::Events,
    /// Stands for the kernel command fd: some programs dup it (to import
    /// the context elsewhere, which this device refuses), so it must be a
    /// real descriptor.
    pub cmd_fd: OwnedFd,
    /// The channel of every CQ made without one: ibv_poll_cq sleeps on it
    /// when a program spins on an empty CQ (cq.rs).
    pub idle: verbs::CompChannel,
    pub port: ibv_port_attr,
    /// Bytes of device memory allocated in this context (dm.rs; shared
    /// with its DMs, which a program may free after closing the context).
    pub dm_allocated: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

/// The device, once found (it lives as long as the process, as a device
/// of libibverbs does while listed). Until rnicd is found, every
/// ibv_get_device_list looks again.
static DEVICE: Mutex<Option<&'static Device>> = Mutex::new(None);

fn copy_str(dst: &mut [c_char], s: &str) {
    for (d, b) in dst.iter_mut().zip(s.bytes().chain(std::iter::once(0))) {
        *d = b as c_char;
    }
}

fn namespace() -> Option<Ipv4Addr> {
    std::env::var("TRANSIT_IBV_NAMESPACE").ok().and_then(|s| s.parse().ok())
}

pub(crate) fn open_verbs(sock: &std::path::Path, ns: Option<Ipv4Addr>) -> anyhow::Result<verbs::Context> {
    match ns {
        Some(g) => verbs::Context::open_namespace(Some(sock), g),
        None => verbs::Context::open(Some(sock)),
    }
}

fn discover() -> Option<Box<Device>> {
    let sock = verbs::find_socket().ok()?;
    let ns = namespace();
    let ctx = open_verbs(&sock, ns).ok()?;
    let guid = ctx.query_device().ok()?.node_guid;
    let mut d = Box::new(Device { dev: ibv_device::default(), sock, namespace: ns, guid });
    d.dev.node_type = IBV_NODE_CA;
    d.dev.transport_type = IBV_TRANSPORT_IB;
    copy_str(&mut d.dev.name, DEVICE_NAME);
    copy_str(&mut d.dev.dev_name, "uverbs0");
    copy_str(&mut d.dev.dev_path, "/sys/class/infiniband_verbs/uverbs0");
    copy_str(&mut d.dev.ibdev_path, &format!("/sys/class/infiniband/{DEVICE_NAME}"));
    Some(d)
}

fn device() -> Option<&'static Device> {
    let mut d = DEVICE.lock().unwrap_or_else(|e| e.into_inner());
    if d.is_none() {
        *d = discover().map(|b| &*Box::leak(b));
    }
    *d
}

#[no_mangle]
pub unsafe extern "C" fn ibv_get_device_list(num: *mut c_int) -> *mut *mut ibv_device {
    let n = usize::from(device().is_some());
    let list = libc::calloc(n + 1, std::mem::size_of::<*mut ibv_device>()) as *mut *mut ibv_device;
    if list.is_null() {
        set_errno(libc::ENOMEM);
        return std::ptr::null_mut();
    }
    if let Some(d) = device() {
        *list = &d.dev as *const ibv_device as *mut ibv_device;
    }
    if !num.is_null() {
        *num = n as c_int;
    }
    list
}

#[no_mangle]
pub unsafe extern "C" fn ibv_free_device_list(list: *mut *mut ibv_device) {
    libc::free(list as *mut c_void);
}

#[no_mangle]
pub unsafe extern "C" fn ibv_get_device_name(dev: *mut ibv_device) -> *const c_char {
    if dev.is_null() {
        set_errno(libc::EINVAL);
        return std::ptr::null();
    }
    (*dev).name.as_ptr()
}

#[no_mangle]
pub unsafe extern "C" fn ibv_get_device_guid(dev: *mut ibv_device) -> u64 {
    if dev.is_null() {
        return 0;
    }
    (*(dev as *mut Device)).guid.to_be()
}

#[no_mangle]
pub unsafe extern "C" fn ibv_get_device_index(dev: *mut ibv_device) -> c_int {
    if dev.is_null() {
        return -1;
    }
    0
}

/// The drop-in's Context behind an ibv_context (NULL if none).
pub unsafe fn ctx<'a>(c: *mut ibv_context) -> Option<&'a Context> {
    if c.is_null() {
        return None;
    }
    let off = std::mem::offset_of!(verbs_context, context);
    Some(&*((c as *mut u8).sub(off) as *const Context))
}

#[no_mangle]
pub unsafe extern "C" fn ibv_close_device(c: *mut ibv_context) -> c_int {
    if c.is_null() {
        return libc::EINVAL;
    }
    let off = std::mem::offset_of!(verbs_context, context);
    drop(Box::from_raw((c as *mut u8).sub(off) as *mut Context));
    0
}

fn mtu_enum(m: verbs::Mtu) -> ibv_mtu {
    match m {
        verbs::Mtu::M256 => IBV_MTU_256,
        verbs::Mtu::M512 => IBV_MTU_512,
        verbs::Mtu::M1024 => IBV_MTU_1024,
        verbs::Mtu::M2048 => IBV_MTU_2048,
        _ => IBV_MTU_4096,
    }
}

pub(crate) fn port_attr(p: &verbs::PortAttr) -> ibv_port_attr {
    ibv_port_attr {
        state: if p.state == "ACTIVE" { IBV_PORT_ACTIVE } else { IBV_PORT_DOWN },
        max_mtu: mtu_enum(p.max_mtu),
        active_mtu: mtu_enum(p.active_mtu),
        gid_tbl_len: p.gid_tbl_len as c_int,
        port_cap_flags: IBV_PORT_CM_SUP,
        max_msg_sz: 1 << 30,
        pkey_tbl_len: 1,
        lmc: 0,
        max_vl_num: 1,
        active_width: 1,
        active_speed: 32, // 10 Gb/s per lane (IB_SPEED_FDR10 encoding used by RoCE drivers)
        phys_state: 5,    // LinkUp
        link_layer: IBV_LINK_LAYER_ETHERNET as u8,
        ..Default::default()
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_device(c: *mut ibv_context, attr: *mut ibv_device_attr) -> c_int {
    let (Some(c), false) = (ctx(c), attr.is_null()) else { return libc::EINVAL };
    let Ok(d) = c.inner.query_device() else { return libc::EIO };
    let mut a = ibv_device_attr::default();
    copy_str(&mut a.fw_ver, &d.fw_ver);
    a.node_guid = d.node_guid.to_be();
    a.sys_image_guid = d.node_guid.to_be();
    a.max_mr_size = d.max_mr_size;
    a.page_size_cap = 4096;
    a.vendor_id = d.vendor_id;
    a.vendor_part_id = d.vendor_part_id;
    a.max_qp = d.max_qp as c_int;
    a.max_qp_wr = d.max_qp_wr.min(i32::MAX as u32) as c_int;
    a.device_cap_flags = IBV_DEVICE_RC_RNR_NAK_GEN | IBV_DEVICE_PORT_ACTIVE_EVENT | IBV_DEVICE_MEM_WINDOW;
    a.max_sge = d.max_sge as c_int;
    a.max_sge_rd = d.max_sge as c_int;
    a.max_cq = d.max_cq as c_int;
    a.max_cqe = d.max_cqe.min(i32::MAX as u32) as c_int;
    // Shared receive queues (srq.rs).
    a.max_srq = verbs::MAX_SRQ as c_int;
    a.max_srq_wr = verbs::MAX_SRQ_WR as c_int;
    a.max_srq_sge = verbs::MAX_SRQ_SGE as c_int;
    a.max_mr = d.max_mr as c_int;
    a.max_pd = d.max_pd as c_int;
    a.max_qp_rd_atom = d.max_qp_rd_atom as c_int;
    a.max_res_rd_atom = (d.max_qp_rd_atom * d.max_qp.min(1 << 16)) as c_int;
    a.max_qp_init_rd_atom = d.max_qp_init_rd_atom as c_int;
    a.atomic_cap = if d.atomic_cap == "ATOMIC_HCA" { IBV_ATOMIC_HCA } else { IBV_ATOMIC_NONE };
    a.max_pkeys = 1;
    a.local_ca_ack_delay = 15;
    a.phys_port_cnt = 1;
    *attr = a;
    0
}

pub(crate) unsafe extern "C" fn query_device_ex(
    c: *mut ibv_context,
    input: *const ibv_query_device_ex_input,
    attr: *mut ibv_device_attr_ex,
    attr_size: usize,
) -> c_int {
    if attr.is_null() || (!input.is_null() && (*input).comp_mask != 0) {
        return libc::EINVAL;
    }
    let mut a = ibv_device_attr_ex::default();
    let r = ibv_query_device(c, &mut a.orig_attr);
    if r != 0 {
        return r;
    }
    a.phys_port_cnt_ex = 1;
    a.max_dm_size = MAX_DM_SIZE;
    let n = attr_size.min(std::mem::size_of::<ibv_device_attr_ex>());
    std::ptr::write_bytes(attr as *mut u8, 0, attr_size);
    std::ptr::copy_nonoverlapping(&a as *const _ as *const u8, attr as *mut u8, n);
    0
}

pub(crate) unsafe extern "C" fn query_port_ex(c: *mut ibv_context, port: u8, attr: *mut ibv_port_attr, len: usize) -> c_int {
    let (Some(c), false) = (ctx(c), attr.is_null()) else { return libc::EINVAL };
    if port != 1 {
        return libc::EINVAL;
    }
    let a = c.port;
    let n = len.min(std::mem::size_of::<ibv_port_attr>());
    std::ptr::write_bytes(attr as *mut u8, 0, len);
    std::ptr::copy_nonoverlapping(&a as *const _ as *const u8, attr as *mut u8, n);
    0
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_port(c: *mut ibv_context, port: u8, attr: *mut ibv_port_attr) -> c_int {
    // The exported function takes rdma-core's `struct _compat_ibv_port_attr`
    // (binaries built before port_cap_flags2): the fields up to and
    // including `flags`, 48 bytes; the rest is not the caller's memory.
    query_port_ex(c, port, attr, std::mem::offset_of!(ibv_port_attr, port_cap_flags2))
}

fn v4_mapped(ip: Ipv4Addr) -> [u8; 16] {
    let mut g = [0u8; 16];
    g[10] = 0xff;
    g[11] = 0xff;
    g[12..].copy_from_slice(&ip.octets());
    g
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_gid(c: *mut ibv_context, port: u8, index: c_int, gid: *mut ibv_gid) -> c_int {
    let (Some(c), false) = (ctx(c), gid.is_null()) else { return -1 };
    if index < 0 {
        return -1;
    }
    match c.inner.query_gid(port, index as u32) {
        Ok(ip) => {
            (*gid).raw = v4_mapped(ip);
            0
        }
        Err(_) => -1,
    }
}

#[no_mangle]
pub unsafe extern "C" fn _ibv_query_gid_ex(
    c: *mut ibv_context,
    port: u32,
    index: u32,
    entry: *mut ibv_gid_entry,
    flags: u32,
    size: usize,
) -> c_int {
    let (Some(cx), false) = (ctx(c), entry.is_null()) else { return libc::EINVAL };
    if flags != 0 || size < std::mem::size_of::<ibv_gid_entry>() {
        return libc::EINVAL;
    }
    let Ok(ip) = cx.inner.query_gid(port as u8, index) else { return libc::ENODATA };
    let mut e = ibv_gid_entry { gid_index: index, port_num: port, gid_type: IBV_GID_TYPE_ROCE_V2, ..Default::default() };
    e.gid.raw = v4_mapped(ip);
    *entry = e;
    0
}

#[no_mangle]
pub unsafe extern "C" fn _ibv_query_gid_table(
    c: *mut ibv_context,
    entries: *mut ibv_gid_entry,
    max: usize,
    flags: u32,
    size: usize,
) -> isize {
    let Some(cx) = ctx(c) else { return -(libc::EINVAL as isize) };
    // As the kernel: a buffer too small for the whole table is an error.
    let n = cx.port.gid_tbl_len as usize;
    if max < n {
        return -(libc::EINVAL as isize);
    }
    for i in 0..n {
        let r = _ibv_query_gid_ex(c, 1, i as u32, entries.add(i), flags, size);
        if r != 0 {
            return -(r as isize);
        }
    }
    n as isize
}

/// `enum ibv_gid_type_sysfs` of driver.h: 1 is RoCE v2.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_gid_type(c: *mut ibv_context, port: u8, index: u32, ty: *mut c_int) -> c_int {
    let Some(cx) = ctx(c) else { return libc::EINVAL };
    if ty.is_null() || port != 1 || index >= cx.port.gid_tbl_len as u32 {
        return libc::EINVAL;
    }
    *ty = 1;
    0
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_pkey(c: *mut ibv_context, port: u8, index: c_int, pkey: *mut u16) -> c_int {
    if ctx(c).is_none() || pkey.is_null() || port != 1 || index != 0 {
        return -1;
    }
    *pkey = 0xffffu16.to_be();
    0
}

#[no_mangle]
pub unsafe extern "C" fn ibv_get_pkey_index(c: *mut ibv_context, port: u8, pkey: u16) -> c_int {
    if ctx(c).is_none() || port != 1 || u16::from_be(pkey) & 0x7fff != 0x7fff {
        return -1;
    }
    0
}
