//! PCI identity, BARs, BAR1 registers, device control, interrupts and the
//! device versions (`pvrdma_dev_api.h`, `pvrdma.h`).

/// PCI vendor ID (VMware).
pub const PCI_VENDOR_ID_VMWARE: u16 = 0x15ad;
/// PCI device ID of the PVRDMA function.
pub const PCI_DEVICE_ID_VMWARE_PVRDMA: u16 = 0x0820;
/// PCI class code: network controller, other (0x0207 is InfiniBand; Linux
/// binds by IDs only; the function carries RoCE, so "other network").
pub const PCI_CLASS_NETWORK_OTHER: u32 = 0x028000;

/// RoCE v1 device version.
pub const VERSION_ROCEV1: u32 = 17;
/// RoCE v2 device version.
pub const VERSION_ROCEV2: u32 = 18;
/// 64-bit page frame numbers (`uar_pfn64`, `create_uc.pfn64`).
pub const VERSION_PPN64: u32 = 19;
/// The device chooses QPNs and keys; QP handles are not QPNs
/// (`create_qp_resp_v2`).
pub const VERSION_QPHANDLE: u32 = 20;

/// Board ID and revision the Linux driver reports.
pub const BOARD_ID: u32 = 1;
pub const REV_ID: u32 = 1;

/// BAR0: MSI-X table and PBA (MMIO). Linux's probe requires BARs 0 and 1
/// to be memory BARs and reads the UAR at BAR 2, so BARs 0 and 1 are 32-bit
/// (a 64-bit BAR 0 would take BAR register 1); VMware's are all 32-bit.
pub const BAR_MSIX: u8 = 0;
/// BAR1: device registers (MMIO, 32-bit).
pub const BAR_REG: u8 = 1;
/// BAR2: UAR (doorbell) pages, one page per user context (`pvrdma_dev_api.h`
/// calls it 64-bit; Transit's, like VMware's, is a 32-bit BAR below 4 GiB).
pub const BAR_UAR: u8 = 2;

/// MSI-X vectors the driver asks for: response, async, one CQ vector.
pub const MAX_INTERRUPTS: u32 = 3;

/// BAR1 register offsets (32-bit registers).
pub const REG_VERSION: u64 = 0x00; // R: device version
pub const REG_DSRLOW: u64 = 0x04; // W: device shared region, low 32 bits of its address
pub const REG_DSRHIGH: u64 = 0x08; // W: high 32 bits; the device fills `caps` on this write
pub const REG_CTL: u64 = 0x0c; // W: a DEVICE_CTL_* value
pub const REG_REQUEST: u64 = 0x10; // W: run the command in the command slot
pub const REG_ERR: u64 = 0x14; // R: device error (non-zero: the last request was rejected)
pub const REG_ICR: u64 = 0x18; // R: interrupt cause (INTR_CAUSE_* bits)
pub const REG_IMR: u64 = 0x1c; // R/W: interrupt mask (0 enables all, !0 masks all)
pub const REG_MACL: u64 = 0x20; // R/W: MAC address, low 32 bits
pub const REG_MACH: u64 = 0x24; // R/W: MAC address, high 16 bits
/// Size of the register BAR.
pub const REG_BAR_SIZE: u64 = 0x1000;

/// `REG_CTL` values.
pub const DEVICE_CTL_ACTIVATE: u32 = 0;
pub const DEVICE_CTL_UNQUIESCE: u32 = 1;
pub const DEVICE_CTL_RESET: u32 = 2;

/// Interrupt vectors.
pub const INTR_VECTOR_RESPONSE: u32 = 0;
pub const INTR_VECTOR_ASYNC: u32 = 1;
pub const INTR_VECTOR_CQ: u32 = 2;
/// `REG_ICR` bits, one per vector.
pub const INTR_CAUSE_RESPONSE: u32 = 1 << INTR_VECTOR_RESPONSE;
pub const INTR_CAUSE_ASYNC: u32 = 1 << INTR_VECTOR_ASYNC;
pub const INTR_CAUSE_CQ: u32 = 1 << INTR_VECTOR_CQ;

/// MSI-X BAR layout (the interface does not fix it; QEMU's device used a
/// 16 KiB BAR with the table at 0 and the PBA at 0x2000).
pub const MSIX_BAR_SIZE: u64 = 0x4000;
pub const MSIX_TABLE_OFFSET: u64 = 0;
pub const MSIX_PBA_OFFSET: u64 = 0x2000;
/// One MSI-X table entry: address low/high, data, vector control.
pub const MSIX_ENTRY_SIZE: u64 = 16;

/// Object flags.
pub const CQ_FLAG_ARMED_SOL: u32 = 1 << 0;
pub const CQ_FLAG_ARMED: u32 = 1 << 1;
/// CREATE_MR flags: a DMA region (all of memory, no page directory) and a
/// fast-registration region.
pub const MR_FLAG_DMA: u32 = 1 << 0;
pub const MR_FLAG_FRMR: u32 = 1 << 1;

/// `caps.atomic_ops` bits.
pub const ATOMIC_OP_COMP_SWAP: u8 = 1 << 0;
pub const ATOMIC_OP_FETCH_ADD: u8 = 1 << 1;
pub const ATOMIC_OP_MASK_COMP_SWAP: u8 = 1 << 2;
pub const ATOMIC_OP_MASK_FETCH_ADD: u8 = 1 << 3;

/// `caps.bmme_flags` bits.
pub const BMME_FLAG_LOCAL_INV: u8 = 1 << 0;
pub const BMME_FLAG_REMOTE_INV: u8 = 1 << 1;
pub const BMME_FLAG_FAST_REG_WR: u8 = 1 << 2;

/// `caps.gid_types` bits (RoCE mode).
pub const GID_TYPE_FLAG_ROCE_V1: u8 = 1 << 0;
pub const GID_TYPE_FLAG_ROCE_V2: u8 = 1 << 1;

/// `caps.mode`.
pub const DEVICE_MODE_ROCE: u8 = 0;
pub const DEVICE_MODE_IWARP: u8 = 1;
pub const DEVICE_MODE_IB: u8 = 2;

/// `gos_info` values.
pub const GOS_BITS_UNK: u32 = 0;
pub const GOS_BITS_32: u32 = 1;
pub const GOS_BITS_64: u32 = 2;
pub const GOS_TYPE_UNK: u32 = 0;
pub const GOS_TYPE_LINUX: u32 = 1;

/// Whether the Linux driver accepts a device of `version` whose caps report
/// `mode` and `gid_types` (`PVRDMA_SUPPORTED`).
pub const fn driver_supports(version: u32, mode: u8, gid_types: u8) -> bool {
    let v17 = version == VERSION_ROCEV1 && gid_types == GID_TYPE_FLAG_ROCE_V1;
    let v18 = version >= VERSION_ROCEV2 && (gid_types == GID_TYPE_FLAG_ROCE_V1 || gid_types == GID_TYPE_FLAG_ROCE_V2);
    mode == DEVICE_MODE_ROCE && (v17 || v18)
}

/// Transit's extensions of the interface.
pub mod transit {
    /// Transit's extension of the CQ doorbell, with `UAR_CQ_POLL`: when the
    /// CQ ring is still empty after the poll, the doorbell write returns
    /// only once a completion has reached the ring, or after at most
    /// `CQ_WAIT_MAX_US`. It stands in for "arm the CQ, HLT, take the
    /// interrupt" in a guest that takes no interrupts: the vCPU sleeps
    /// instead of spinning on POLL doorbells. Linux never sets bit 28
    /// (between the handle and ARM_SOL), so for it nothing changes.
    pub const UAR_CQ_WAIT: u32 = 1 << 28;
    /// Transit's extension of the QP doorbell, with `UAR_QP_SEND` and/or
    /// `UAR_QP_RECV`: after posting, the doorbell write waits as a WAIT
    /// doorbell (above) on the QP's receive CQ. A request that waits for
    /// its answer (a ping-pong, an RPC) takes one MMIO exit instead of two,
    /// and the vCPU sleeps right after the post. Linux never sets bit 28 of
    /// a QP doorbell either.
    pub const UAR_QP_WAIT: u32 = 1 << 28;
    /// The longest a WAIT doorbell holds the vCPU (a timer tick's worth):
    /// a pause or a stop of the vCPU waits at most this long for it.
    pub const CQ_WAIT_MAX_US: u64 = 1000;
}
