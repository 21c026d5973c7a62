//! Work queue entries, completion queue entries and UAR doorbells
//! (`include/uapi/rdma/vmw_pvrdma-abi.h`, `pvrdma_qp.c`, `pvrdma_cq.c`).

use crate::{pod, Pod, PAGE_SIZE};

/// Pages at the start of a QP's page list that hold its ring state.
pub const QP_NUM_HEADER_PAGES: u32 = 1;
/// Byte offset of the SQ ring (`Ring`) in a QP's header page.
pub const QP_SQ_RING_OFFSET: u64 = 0;
/// Byte offset of the RQ ring in a QP's header page.
pub const QP_RQ_RING_OFFSET: u64 = 8;
/// Byte offset, in a CQ's page list, of the ring state (`RingState.rx`).
pub const CQ_RING_OFFSET: u64 = 8;
/// Byte offset, in a CQ's page list, of the first CQE.
pub const CQ_FIRST_CQE_OFFSET: u64 = PAGE_SIZE as u64;

/// Doorbells: 32-bit writes into a UAR page.
pub const UAR_HANDLE_MASK: u32 = 0x00ff_ffff;
pub const UAR_QP_OFFSET: u64 = 0;
pub const UAR_QP_SEND: u32 = 1 << 30;
pub const UAR_QP_RECV: u32 = 1 << 31;
pub const UAR_CQ_OFFSET: u64 = 4;
pub const UAR_CQ_ARM_SOL: u32 = 1 << 29;
pub const UAR_CQ_ARM: u32 = 1 << 30;
pub const UAR_CQ_POLL: u32 = 1 << 31;
pub const UAR_SRQ_OFFSET: u64 = 8;
pub const UAR_SRQ_RECV: u32 = 1 << 30;

/// A scatter/gather entry.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// A receive WQE's header; `num_sge` SGEs follow it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RqWqeHdr {
    pub wr_id: u64,
    pub num_sge: u32,
    pub total_len: u32,
}

/// `wr.rdma`: RDMA WRITE and READ.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WrRdma {
    pub remote_addr: u64,
    pub rkey: u32,
    pub reserved: [u8; 4],
}

/// `wr.atomic`: compare-and-swap and fetch-and-add.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WrAtomic {
    pub remote_addr: u64,
    /// The compare value (CAS) or the addend (FAA).
    pub compare_add: u64,
    pub swap: u64,
    pub rkey: u32,
    pub reserved: u32,
}

/// `wr.masked_atomics`; `wr_data` is a masked CAS `{swap, compare,
/// swap_mask, compare_mask}` or a masked FAA `{add, field_boundary}`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WrMaskedAtomics {
    pub remote_addr: u64,
    pub log_arg_sz: u32,
    pub rkey: u32,
    pub wr_data: [u64; 4],
}

/// `wr.fast_reg`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WrFastReg {
    pub iova_start: u64,
    pub pl_pdir_dma: u64,
    pub page_shift: u32,
    pub page_list_len: u32,
    pub length: u32,
    pub access_flags: u32,
    pub rkey: u32,
    pub pad: u32,
}

/// `struct pvrdma_av`, the address vector of a UD send.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Av {
    pub port_pd: u32,
    pub sl_tclass_flowlabel: u32,
    pub dgid: [u8; 16],
    pub src_path_bits: u8,
    pub gid_index: u8,
    pub stat_rate: u8,
    pub hop_limit: u8,
    pub dmac: [u8; 6],
    pub reserved: [u8; 6],
}

/// `wr.ud`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WrUd {
    pub remote_qpn: u32,
    pub remote_qkey: u32,
    pub av: Av,
}

/// The operation-specific union of a send WQE (48 bytes, 8-byte aligned);
/// read and write it through the typed accessors.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WrUnion {
    pub bytes: [u8; 48],
}

impl Default for WrUnion {
    fn default() -> Self {
        WrUnion { bytes: [0; 48] }
    }
}

impl WrUnion {
    fn get<T: Pod>(&self) -> T {
        T::read_from(&self.bytes).expect("every member fits the union")
    }
    fn set<T: Pod>(&mut self, v: &T) {
        self.bytes = [0; 48];
        self.bytes[..core::mem::size_of::<T>()].copy_from_slice(v.as_bytes());
    }
    pub fn rdma(&self) -> WrRdma {
        self.get()
    }
    pub fn set_rdma(&mut self, v: &WrRdma) {
        self.set(v)
    }
    pub fn atomic(&self) -> WrAtomic {
        self.get()
    }
    pub fn set_atomic(&mut self, v: &WrAtomic) {
        self.set(v)
    }
    pub fn masked_atomics(&self) -> WrMaskedAtomics {
        self.get()
    }
    pub fn fast_reg(&self) -> WrFastReg {
        self.get()
    }
    pub fn ud(&self) -> WrUd {
        self.get()
    }
    pub fn set_ud(&mut self, v: &WrUd) {
        self.set(v)
    }
}

/// A send WQE's header; `num_sge` SGEs follow it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SqWqeHdr {
    pub wr_id: u64,
    pub num_sge: u32,
    pub total_len: u32,
    /// `ib::wr_opcode`.
    pub opcode: u32,
    /// `ib::send_flags` bits.
    pub send_flags: u32,
    /// Immediate data (big endian, as posted) or the rkey to invalidate.
    pub ex: u32,
    pub reserved: u32,
    pub wr: WrUnion,
}

/// A 64-byte completion queue entry.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cqe {
    pub wr_id: u64,
    /// The QP's handle (the driver looks it up as `qp & 0xffff`).
    pub qp: u64,
    /// `ib::wc_opcode`.
    pub opcode: u32,
    /// `ib::wc_status`.
    pub status: u32,
    pub byte_len: u32,
    /// Immediate data, big endian as the sender posted it.
    pub imm_data: u32,
    pub src_qp: u32,
    /// `ib::wc_flags` bits.
    pub wc_flags: u32,
    pub vendor_err: u32,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
    pub port_num: u8,
    pub smac: [u8; 6],
    pub network_hdr_type: u8,
    pub reserved2: [u8; 6],
}

/// Bytes of one WQE slot of a queue whose WQEs carry up to `max_sge` SGEs
/// after a `hdr_size`-byte header: rounded up to a power of two.
pub const fn wqe_stride(hdr_size: usize, max_sge: u32) -> usize {
    (hdr_size + core::mem::size_of::<Sge>() * max_sge as usize).next_power_of_two()
}

/// Stride of a send WQE slot.
pub const fn sq_wqe_stride(max_sge: u32) -> usize {
    wqe_stride(core::mem::size_of::<SqWqeHdr>(), max_sge)
}

/// Stride of a receive WQE slot.
pub const fn rq_wqe_stride(max_sge: u32) -> usize {
    wqe_stride(core::mem::size_of::<RqWqeHdr>(), max_sge)
}

/// Pages a queue of `wqe_cnt` WQEs of `stride` bytes occupies.
pub const fn queue_pages(wqe_cnt: u32, stride: usize) -> u32 {
    (wqe_cnt as usize * stride).div_ceil(PAGE_SIZE) as u32
}

/// Pages of a CQ ring of `entries` CQEs, its state page included.
pub const fn cq_pages(entries: u32) -> u32 {
    1 + (entries as usize * core::mem::size_of::<Cqe>()).div_ceil(PAGE_SIZE) as u32
}

pod!(
    Sge = 16,
    RqWqeHdr = 16,
    WrRdma = 16,
    WrAtomic = 32,
    WrMaskedAtomics = 48,
    WrFastReg = 40,
    Av = 40,
    WrUd = 48,
    WrUnion = 48,
    SqWqeHdr = 80,
    Cqe = 64
);
const _: () = assert!(core::mem::offset_of!(Cqe, smac) == 51);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strides_and_pages_as_the_linux_driver_computes_them() {
        assert_eq!(sq_wqe_stride(1), 128);
        assert_eq!(sq_wqe_stride(4), 256);
        assert_eq!(rq_wqe_stride(1), 32);
        assert_eq!(rq_wqe_stride(4), 128);
        assert_eq!(queue_pages(64, 128), 2);
        assert_eq!(queue_pages(1, 32), 1);
        assert_eq!(cq_pages(64), 2);
        assert_eq!(cq_pages(128), 3);
    }

    #[test]
    fn the_wr_union_keeps_each_member() {
        let mut w = SqWqeHdr::default();
        w.wr.set_atomic(&WrAtomic { remote_addr: 0x1000, compare_add: 7, swap: 9, rkey: 0x55, reserved: 0 });
        assert_eq!(w.wr.atomic().swap, 9);
        assert_eq!(w.wr.rdma().remote_addr, 0x1000);
        let bytes = w.as_bytes();
        assert_eq!(bytes.len(), 80);
        assert_eq!(SqWqeHdr::read_from(bytes), Some(w));
        assert_eq!(SqWqeHdr::read_from(&bytes[..79]), None);
    }
}
