//! The device-shared region (DSR): the page the driver allocates at probe and
//! hands over through `REG_DSRLOW`/`REG_DSRHIGH`. The driver writes the slot
//! and ring addresses; the device writes `caps` when `REG_DSRHIGH` is written.

use crate::pod;

/// Guest OS information: a 32-bit bitfield `gos_bits:2, gos_type:4,
/// gos_ver:16, gos_misc:10`, then a pad word.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GosInfo {
    pub bits: u32,
    pub pad: u32,
}

impl GosInfo {
    pub const fn new(gos_bits: u32, gos_type: u32, gos_ver: u32, gos_misc: u32) -> Self {
        GosInfo { bits: (gos_bits & 0x3) | (gos_type & 0xf) << 2 | (gos_ver & 0xffff) << 6 | (gos_misc & 0x3ff) << 22, pad: 0 }
    }
    pub const fn gos_bits(&self) -> u32 {
        self.bits & 0x3
    }
    pub const fn gos_type(&self) -> u32 {
        (self.bits >> 2) & 0xf
    }
    pub const fn gos_ver(&self) -> u32 {
        (self.bits >> 6) & 0xffff
    }
    pub const fn gos_misc(&self) -> u32 {
        (self.bits >> 22) & 0x3ff
    }
}

/// Device capabilities (`struct pvrdma_device_caps`), written by the device.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceCaps {
    pub fw_ver: u64,
    /// Big endian, as the guest reads it.
    pub node_guid: u64,
    /// Big endian.
    pub sys_image_guid: u64,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub atomic_arg_sizes: u64,
    pub ex_comp_mask: u32,
    pub device_cap_flags2: u32,
    pub max_fa_bit_boundary: u32,
    pub log_max_atomic_inline_arg: u32,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_qp: u32,
    pub max_qp_wr: u32,
    pub device_cap_flags: u32,
    pub max_sge: u32,
    pub max_sge_rd: u32,
    pub max_cq: u32,
    pub max_cqe: u32,
    pub max_mr: u32,
    pub max_pd: u32,
    pub max_qp_rd_atom: u32,
    pub max_ee_rd_atom: u32,
    pub max_res_rd_atom: u32,
    pub max_qp_init_rd_atom: u32,
    pub max_ee_init_rd_atom: u32,
    pub max_ee: u32,
    pub max_rdd: u32,
    pub max_mw: u32,
    pub max_raw_ipv6_qp: u32,
    pub max_raw_ethy_qp: u32,
    pub max_mcast_grp: u32,
    pub max_mcast_qp_attach: u32,
    pub max_total_mcast_qp_attach: u32,
    pub max_ah: u32,
    pub max_fmr: u32,
    pub max_map_per_fmr: u32,
    pub max_srq: u32,
    pub max_srq_wr: u32,
    pub max_srq_sge: u32,
    pub max_uar: u32,
    pub gid_tbl_len: u32,
    pub max_pkeys: u16,
    pub local_ca_ack_delay: u8,
    pub phys_port_cnt: u8,
    /// `DEVICE_MODE_*`.
    pub mode: u8,
    /// `ATOMIC_OP_*` bits.
    pub atomic_ops: u8,
    /// `BMME_FLAG_*` bits.
    pub bmme_flags: u8,
    /// `GID_TYPE_FLAG_*` bits.
    pub gid_types: u8,
    pub max_fast_reg_page_list_len: u32,
}

/// Where a ring's pages are: the number of pages including the state page,
/// and the guest-physical address of its page directory.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RingPageInfo {
    pub num_pages: u32,
    pub reserved: u32,
    pub pdir_dma: u64,
}

/// The device-shared region (`#pragma pack(1)` in Linux; every field is at
/// its natural alignment there, so `repr(C)` gives the same bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Dsr {
    pub driver_version: u32,
    pub pad: u32,
    pub gos_info: GosInfo,
    /// Guest-physical address of the command slot page.
    pub cmd_slot_dma: u64,
    /// Guest-physical address of the response slot page.
    pub resp_slot_dma: u64,
    /// The async event ring.
    pub async_ring_pages: RingPageInfo,
    /// The CQ notification ring.
    pub cq_ring_pages: RingPageInfo,
    /// The kernel's UAR page frame: `uar_pfn` (u32) before version 19,
    /// `uar_pfn64` from 19 on; a union in Linux.
    pub uar_pfn64: u64,
    pub caps: DeviceCaps,
}

impl Dsr {
    /// Byte offset of `caps`, the part the device writes.
    pub const CAPS_OFFSET: usize = 72;
}

pod!(GosInfo = 8, DeviceCaps = 208, RingPageInfo = 16, Dsr = 280);
const _: () = assert!(core::mem::offset_of!(Dsr, caps) == Dsr::CAPS_OFFSET);
const _: () = assert!(core::mem::offset_of!(Dsr, uar_pfn64) == 64);
const _: () = assert!(core::mem::offset_of!(DeviceCaps, max_pkeys) == 196);
