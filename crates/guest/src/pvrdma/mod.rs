//! A polled driver for the PVRDMA device (VMware's paravirtual RDMA NIC, as
//! Linux's `vmw_pvrdma` drives it; the interface is crates/pvrdma-abi) and
//! a small verbs layer: PD, MR, CQ, SRQ, RC QP, post send/receive, poll.
//!
//! Bring-up follows `pvrdma_pci_probe`: read VERSION, hand over the
//! device-shared region (DSR) with the command and response slots and the
//! async and CQ-notification rings (DSRLOW, then DSRHIGH, on which the
//! device fills in its capabilities), check the capabilities, unmask
//! interrupts (IMR = 0), ACTIVATE and require ERR == 0, then CREATE_BIND the
//! VM's GID at index 0. Before that it sets up MSI-X as
//! `pvrdma_alloc_intrs` does: table entries for the response, async and
//! CQ vectors, aimed at vCPU 0's local APIC (firmware vectors
//! `irq::VECTOR_BASE + n`), then the capability's enable bit. It polls the
//! response slot for a command's answer, and CQs the way `pvrdma_poll_cq`
//! does (ring the POLL doorbell when a CQ looks empty, then look again);
//! `Cq::wait` arms the CQ and halts until its notification interrupt.
//! Memory comes from a bump region of identity-mapped RAM, so a virtual
//! address is the guest-physical one the device sees.

pub mod bench;
pub mod workloads;

use crate::hw::{mmio_read32, mmio_write32, Platform};
use crate::nvme::Region;
use core::ptr::{read_volatile, write_volatile};
use core::sync::atomic::{fence, AtomicU64, Ordering};
use pvrdma_abi::ib::{mtu, qp_attr_mask as mask, qp_state, qp_type, wr_opcode};
use pvrdma_abi::*;

const PAGE: u64 = PAGE_SIZE as u64;
/// Pages of each event ring, the state page included (as Linux).
const EVENT_RING_PAGES: u32 = 4;
/// How long a command may take before the driver gives up (as Linux: 10 s).
const CMD_TIMEOUT_NS: u64 = 10_000_000_000;

pub type Result<T> = core::result::Result<T, Error>;

#[derive(Debug, Clone, Copy)]
pub enum Error {
    NoDevice,
    Unsupported {
        version: u32,
        mode: u8,
        gid_types: u8,
    },
    ActivateFailed(u32),
    NoMemory,
    /// REG_ERR after REQUEST: the device rejected the command.
    Rejected {
        cmd: u32,
        err: u32,
    },
    /// The response's `err` byte.
    Failed {
        cmd: u32,
        err: u8,
    },
    WrongAck {
        cmd: u32,
        ack: u32,
    },
    Timeout {
        cmd: u32,
    },
    QueueFull,
    BadRing,
}

fn rd32(addr: u64) -> u32 {
    // SAFETY: identity-mapped guest RAM shared with the device.
    unsafe { read_volatile(addr as *const u32) }
}

fn wr32(addr: u64, v: u32) {
    // SAFETY: as above.
    unsafe { write_volatile(addr as *mut u32, v) }
}

fn read_pod<T: Pod>(addr: u64) -> T {
    // SAFETY: as above; Pod types take any bit pattern.
    unsafe { read_volatile(addr as *const T) }
}

fn write_pod<T: Pod>(addr: u64, v: &T) {
    // SAFETY: as above.
    unsafe { write_volatile(addr as *mut T, *v) }
}

/// `npages` contiguous zeroed pages and a two-level page directory listing
/// them: returns (directory address, first page address).
fn page_list(region: &mut Region, npages: u32) -> Result<(u64, u64)> {
    if npages == 0 || npages > PAGE_DIR_MAX_PAGES {
        return Err(Error::NoMemory);
    }
    let ntables = pdir_ntables(npages);
    let dir = region.alloc(PAGE).ok_or(Error::NoMemory)?;
    let tables = region.alloc(ntables as u64 * PAGE).ok_or(Error::NoMemory)?;
    let pages = region.alloc(npages as u64 * PAGE).ok_or(Error::NoMemory)?;
    for t in 0..ntables {
        // SAFETY: pages just allocated.
        unsafe { write_volatile((dir + pdir_dir_entry_offset(t)) as *mut u64, tables + t as u64 * PAGE) };
    }
    for i in 0..npages {
        let table = tables + pdir_table(i) as u64 * PAGE;
        unsafe { write_volatile((table + pdir_table_entry_offset(i)) as *mut u64, pages + i as u64 * PAGE) };
    }
    Ok((dir, pages))
}

pub struct Device {
    regs: u64,
    uar: u64,
    cmd_slot: u64,
    resp_slot: u64,
    pub version: u32,
    pub caps: DeviceCaps,
    plat: Platform,
    next_response: u64,
}

/// The first PCI function on bus 0 with these vendor and device IDs.
fn find_pci(vendor: u16, device: u16) -> Option<u8> {
    (0..32u8).find(|&d| crate::pci::read32(d, 0) == (device as u32) << 16 | vendor as u32)
}

/// The function's first three memory BARs in order (MSI-X, registers,
/// UAR), whether each takes one BAR register (32-bit) or two (64-bit):
/// Linux's resource numbers count registers, so a 64-bit BAR 0 moves the
/// register BAR to resource 2; counting BARs works for either layout.
fn memory_bars(dev: u8) -> [u64; 3] {
    let mut out = [0u64; 3];
    let (mut reg, mut n) = (0x10u8, 0usize);
    while reg <= 0x24 && n < 3 {
        let lo = crate::pci::read32(dev, reg);
        if lo & 1 == 1 {
            reg += 4; // an I/O BAR
            continue;
        }
        out[n] = crate::pci::bar64(dev, reg);
        n += 1;
        reg += if lo & 0x6 == 0x4 { 8 } else { 4 };
    }
    out
}

/// The CQ-notification ring's state page (its first page), which `Cq::wait`
/// consumes after an interrupt: the device posts (and interrupts) only
/// while the ring has room.
static CQ_NOTIFY_RING: AtomicU64 = AtomicU64::new(0);
/// How many times `Cq::wait` halted for a CQ interrupt: a completion that
/// arrives between the check and the arm is found by the poll after it, and
/// that round trip needs no interrupt, so only these halts each owe one.
pub static CQ_IRQ_WAITS: AtomicU64 = AtomicU64::new(0);

/// MSI-X capability ID in the PCI capability list.
const PCI_CAP_MSIX: u32 = 0x11;

/// Points the table entries of the device's vectors (response, async, CQ)
/// at vCPU 0's local APIC with firmware vectors `irq::VECTOR_BASE + n`,
/// unmasked, then enables MSI-X and the CPU's interrupts. A device
/// without the capability is left to polling.
fn setup_msix(dev: u8, msix_bar: u64) {
    let mut at = crate::pci::read32(dev, 0x34) as u8;
    while at != 0 && crate::pci::read32(dev, at) & 0xff != PCI_CAP_MSIX {
        at = (crate::pci::read32(dev, at) >> 8) as u8;
    }
    if at == 0 {
        return;
    }
    let table = msix_bar + (crate::pci::read32(dev, at + 4) & !7) as u64;
    for v in [INTR_VECTOR_RESPONSE, INTR_VECTOR_ASYNC, INTR_VECTOR_CQ] {
        let e = table + v as u64 * MSIX_ENTRY_SIZE;
        mmio_write32(e, 0xFEE0_0000); // destination APIC ID 0, physical
        mmio_write32(e + 4, 0);
        mmio_write32(e + 8, crate::irq::VECTOR_BASE as u32 + v);
        mmio_write32(e + 12, 0); // unmasked
    }
    crate::irq::init();
    let ctrl = crate::pci::read32(dev, at);
    crate::pci::write32(dev, at, (ctrl & 0x3fff_ffff) | 1 << 31);
    crate::irq::enable();
}

impl Device {
    /// Finds and brings up the device, and binds `gid` (an IPv4 address) at
    /// GID index 0.
    pub fn init(plat: Platform, region: &mut Region, gid: [u8; 4]) -> Result<Device> {
        let dev = find_pci(PCI_VENDOR_ID_VMWARE, PCI_DEVICE_ID_VMWARE_PVRDMA).ok_or(Error::NoDevice)?;
        crate::pci::enable_bus_master(dev);
        let bars = memory_bars(dev);
        let (regs, uar) = (bars[BAR_REG as usize], bars[BAR_UAR as usize]);
        let version = mmio_read32(regs + REG_VERSION);

        let dsr_addr = region.alloc(PAGE).ok_or(Error::NoMemory)?;
        let cmd_slot = region.alloc(PAGE).ok_or(Error::NoMemory)?;
        let resp_slot = region.alloc(PAGE).ok_or(Error::NoMemory)?;
        let (async_pdir, _) = page_list(region, EVENT_RING_PAGES)?;
        let (cq_pdir, cq_ring) = page_list(region, EVENT_RING_PAGES)?;
        let dsr = Dsr {
            driver_version: VERSION_QPHANDLE,
            gos_info: GosInfo::new(GOS_BITS_64, GOS_TYPE_LINUX, 1, 0),
            cmd_slot_dma: cmd_slot,
            resp_slot_dma: resp_slot,
            async_ring_pages: RingPageInfo { num_pages: EVENT_RING_PAGES, reserved: 0, pdir_dma: async_pdir },
            cq_ring_pages: RingPageInfo { num_pages: EVENT_RING_PAGES, reserved: 0, pdir_dma: cq_pdir },
            uar_pfn64: uar >> PAGE_SHIFT,
            ..Default::default()
        };
        write_pod(dsr_addr, &dsr);
        fence(Ordering::SeqCst);
        mmio_write32(regs + REG_DSRLOW, dsr_addr as u32);
        mmio_write32(regs + REG_DSRHIGH, (dsr_addr >> 32) as u32);
        let caps: DeviceCaps = read_pod(dsr_addr + Dsr::CAPS_OFFSET as u64);
        if !driver_supports(version, caps.mode, caps.gid_types) {
            return Err(Error::Unsupported { version, mode: caps.mode, gid_types: caps.gid_types });
        }
        mmio_write32(regs + REG_IMR, 0);
        mmio_write32(regs + REG_CTL, DEVICE_CTL_ACTIVATE);
        let err = mmio_read32(regs + REG_ERR);
        if err != 0 {
            return Err(Error::ActivateFailed(err));
        }
        let mut d = Device { regs, uar, cmd_slot, resp_slot, version, caps, plat, next_response: 1 };
        CQ_NOTIFY_RING.store(cq_ring, Ordering::SeqCst);
        setup_msix(dev, bars[BAR_MSIX as usize]);
        // As pvrdma_add_gid_at_index: the MTU in bytes, no VLAN, and the
        // GID type as a GID_TYPE_FLAG_* value (ib_gid_type_to_pvrdma).
        let gid_type = if caps.gid_types & GID_TYPE_FLAG_ROCE_V2 != 0 { GID_TYPE_FLAG_ROCE_V2 } else { GID_TYPE_FLAG_ROCE_V1 };
        let bind = CmdCreateBind {
            hdr: CmdHdr { cmd: CMD_CREATE_BIND, ..Default::default() },
            mtu: 1024,
            vlan: 0xfff,
            index: 0,
            new_gid: Gid::from_ipv4(gid).raw,
            gid_type,
            ..Default::default()
        };
        d.command::<_, CmdRespHdr>(&bind)?;
        Ok(d)
    }

    /// Runs one command: request into the command slot, REQUEST, ERR, then
    /// the response slot polled until it carries this request's ack.
    fn command<Req: Pod, Resp: Pod>(&mut self, req: &Req) -> Result<Resp> {
        let mut req = *req;
        let hdr = CmdHdr::read_from(req.as_bytes()).expect("requests start with a header");
        let (cmd, response) = (hdr.cmd, self.next_response);
        self.next_response += 1;
        req.as_bytes_mut()[..8].copy_from_slice(&response.to_le_bytes());
        // SAFETY: the response slot is our page.
        unsafe { core::ptr::write_bytes(self.resp_slot as *mut u8, 0, PAGE_SIZE) };
        write_pod(self.cmd_slot, &req);
        fence(Ordering::SeqCst);
        mmio_write32(self.regs + REG_REQUEST, 0);
        let err = mmio_read32(self.regs + REG_ERR);
        if err != 0 {
            return Err(Error::Rejected { cmd, err });
        }
        let t0 = self.plat.now_ns();
        loop {
            let h: CmdRespHdr = read_pod(self.resp_slot);
            if h.response == response && h.ack != 0 {
                fence(Ordering::SeqCst);
                if h.ack != resp_code(cmd) {
                    return Err(Error::WrongAck { cmd, ack: h.ack });
                }
                if h.err != 0 {
                    return Err(Error::Failed { cmd, err: h.err });
                }
                return Ok(read_pod(self.resp_slot));
            }
            if self.plat.now_ns() - t0 > CMD_TIMEOUT_NS {
                return Err(Error::Timeout { cmd });
            }
            core::hint::spin_loop();
        }
    }

    pub fn query_port(&mut self) -> Result<PortAttr> {
        let r: CmdQueryPortResp = self.command(&CmdQueryPort { hdr: hdr(CMD_QUERY_PORT), port_num: 1, ..Default::default() })?;
        Ok(r.attrs)
    }

    pub fn create_pd(&mut self) -> Result<u32> {
        let r: CmdCreatePdResp = self.command(&CmdCreatePd { hdr: hdr(CMD_CREATE_PD), ..Default::default() })?;
        Ok(r.pd_handle)
    }

    /// Registers `len` bytes of page-aligned RAM at `addr` (its I/O virtual
    /// address is `addr`).
    pub fn reg_mr(&mut self, region: &mut Region, pd: u32, addr: u64, len: u64, access: u32) -> Result<Mr> {
        self.reg_mr_pages(region, pd, addr, len, access, |i| (addr & !(PAGE - 1)) + i as u64 * PAGE)
    }

    /// Registers `len` bytes that peers and SGEs address from the
    /// page-aligned I/O virtual address `iova`, whose page `i` is the guest
    /// page `page(i)`: the pages may lie anywhere in RAM, as a Linux user
    /// buffer's do.
    pub fn reg_mr_pages(
        &mut self,
        region: &mut Region,
        pd: u32,
        iova: u64,
        len: u64,
        access: u32,
        page: impl Fn(u32) -> u64,
    ) -> Result<Mr> {
        let npages = len.div_ceil(PAGE) as u32;
        if npages == 0 || npages > PAGE_DIR_MAX_PAGES {
            return Err(Error::NoMemory);
        }
        let dir = region.alloc(PAGE).ok_or(Error::NoMemory)?;
        let ntables = pdir_ntables(npages);
        let tables = region.alloc(ntables as u64 * PAGE).ok_or(Error::NoMemory)?;
        for t in 0..ntables {
            unsafe { write_volatile((dir + pdir_dir_entry_offset(t)) as *mut u64, tables + t as u64 * PAGE) };
        }
        for i in 0..npages {
            let table = tables + pdir_table(i) as u64 * PAGE;
            unsafe { write_volatile((table + pdir_table_entry_offset(i)) as *mut u64, page(i)) };
        }
        let req = CmdCreateMr {
            hdr: hdr(CMD_CREATE_MR),
            start: iova,
            length: len,
            pdir_dma: dir,
            pd_handle: pd,
            access_flags: access,
            flags: 0,
            nchunks: npages,
        };
        let r: CmdCreateMrResp = self.command(&req)?;
        Ok(Mr { handle: r.mr_handle, lkey: r.lkey, rkey: r.rkey, addr: iova, len })
    }

    pub fn create_cq(&mut self, region: &mut Region, entries: u32) -> Result<Cq> {
        let entries = entries.max(1).next_power_of_two();
        let npages = cq_pages(entries);
        let (dir, pages) = page_list(region, npages)?;
        let req =
            CmdCreateCq { hdr: hdr(CMD_CREATE_CQ), pdir_dma: dir, ctx_handle: 0, cqe: entries, nchunks: npages, ..Default::default() };
        let r: CmdCreateCqResp = self.command(&req)?;
        Ok(Cq { handle: r.cq_handle, ring: pages + CQ_RING_OFFSET, cqes: pages + CQ_FIRST_CQE_OFFSET, entries, uar: self.uar })
    }

    /// A shared receive queue of `depth` WQEs of up to `max_sge` SGEs, laid
    /// out as rdma-core's provider does: a ring-state page (the driver
    /// produces into its `rx` ring), then the WQEs.
    pub fn create_srq(&mut self, region: &mut Region, pd: u32, depth: u32, max_sge: u32) -> Result<Srq> {
        let wqes = depth.max(1).next_power_of_two();
        let stride = rq_wqe_stride(max_sge);
        let npages = 1 + queue_pages(wqes, stride);
        let (dir, pages) = page_list(region, npages)?;
        let req = CmdCreateSrq {
            hdr: hdr(CMD_CREATE_SRQ),
            pdir_dma: dir,
            pd_handle: pd,
            nchunks: npages,
            attrs: SrqAttr { max_wr: wqes, max_sge, srq_limit: 0, reserved: 0 },
            srq_type: ib::srq_type::BASIC,
            reserved: [0; 7],
        };
        let r: CmdCreateSrqResp = self.command(&req)?;
        Ok(Srq {
            handle: r.srqn,
            ring: pages + RING_STATE_RX_PROD_TAIL,
            base: pages + PAGE,
            stride: stride as u64,
            wqes,
            max_sge,
            uar: self.uar,
        })
    }

    /// An RC QP with `depth` send and receive WQEs of up to `max_sge` SGEs.
    pub fn create_qp(&mut self, region: &mut Region, pd: u32, send_cq: &Cq, recv_cq: &Cq, depth: u32, max_sge: u32) -> Result<Qp> {
        self.create_qp_with(region, pd, send_cq, recv_cq, depth, max_sge, None)
    }

    /// An RC QP with `depth` send WQEs that takes its receives from `srq`
    /// (`is_srq`: no receive queue of its own).
    #[allow(clippy::too_many_arguments)]
    pub fn create_qp_on_srq(
        &mut self,
        region: &mut Region,
        pd: u32,
        send_cq: &Cq,
        recv_cq: &Cq,
        depth: u32,
        max_sge: u32,
        srq: &Srq,
    ) -> Result<Qp> {
        self.create_qp_with(region, pd, send_cq, recv_cq, depth, max_sge, Some(srq))
    }

    #[allow(clippy::too_many_arguments)]
    fn create_qp_with(
        &mut self,
        region: &mut Region,
        pd: u32,
        send_cq: &Cq,
        recv_cq: &Cq,
        depth: u32,
        max_sge: u32,
        srq: Option<&Srq>,
    ) -> Result<Qp> {
        let wqes = depth.max(1).next_power_of_two();
        let (sq_stride, rq_stride) = (sq_wqe_stride(max_sge), rq_wqe_stride(max_sge));
        let send_chunks = queue_pages(wqes, sq_stride);
        let (recv_wqes, recv_sge) = if srq.is_some() { (0, 0) } else { (wqes, max_sge) };
        let recv_chunks = queue_pages(recv_wqes, rq_stride);
        let total = QP_NUM_HEADER_PAGES + send_chunks + recv_chunks;
        let (dir, pages) = page_list(region, total)?;
        let req = CmdCreateQp {
            hdr: hdr(CMD_CREATE_QP),
            pdir_dma: dir,
            pd_handle: pd,
            send_cq_handle: send_cq.handle,
            recv_cq_handle: recv_cq.handle,
            max_send_wr: wqes,
            max_recv_wr: recv_wqes,
            max_send_sge: max_sge,
            max_recv_sge: recv_sge,
            total_chunks: total as u16,
            send_chunks: send_chunks as u16,
            max_atomic_arg: 8,
            qp_type: qp_type::RC,
            srq_handle: srq.map_or(0, |s| s.handle),
            is_srq: srq.is_some() as u8,
            ..Default::default()
        };
        let (qpn, handle) = if self.version >= VERSION_QPHANDLE {
            let r: CmdCreateQpRespV2 = self.command(&req)?;
            (r.qpn, r.qp_handle)
        } else {
            let r: CmdCreateQpResp = self.command(&req)?;
            (r.qpn, r.qpn)
        };
        let sq_base = pages + PAGE * QP_NUM_HEADER_PAGES as u64;
        Ok(Qp {
            handle,
            qpn,
            sq_ring: pages + QP_SQ_RING_OFFSET,
            rq_ring: pages + QP_RQ_RING_OFFSET,
            sq_base,
            rq_base: sq_base + PAGE * send_chunks as u64,
            sq_stride: sq_stride as u64,
            rq_stride: rq_stride as u64,
            wqes,
            max_sge: recv_sge,
            send_max_sge: max_sge,
            uar: self.uar,
            recv_unrung: core::cell::Cell::new(false),
        })
    }

    fn modify_qp(&mut self, qp: &Qp, attrs: &QpAttr, attr_mask: u32) -> Result<()> {
        self.command::<_, CmdRespHdr>(&CmdModifyQp { hdr: hdr(CMD_MODIFY_QP), qp_handle: qp.handle, attr_mask, attrs: *attrs })?;
        Ok(())
    }

    /// RESET -> INIT -> RTR -> RTS towards the remote QP, as every verbs
    /// program does.
    pub fn connect(&mut self, qp: &Qp, remote: &Remote) -> Result<()> {
        let access = ib::access::LOCAL_WRITE | ib::access::REMOTE_WRITE | ib::access::REMOTE_READ | ib::access::REMOTE_ATOMIC;
        let mut a = QpAttr { qp_state: qp_state::INIT, qp_access_flags: access, port_num: 1, ..Default::default() };
        self.modify_qp(qp, &a, mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::ACCESS_FLAGS)?;
        a.qp_state = qp_state::RTR;
        a.path_mtu = mtu::MTU_1024;
        a.dest_qp_num = remote.qpn;
        a.rq_psn = remote.psn;
        a.max_dest_rd_atomic = 16;
        a.min_rnr_timer = 1;
        a.ah_attr.grh.dgid = Gid::from_ipv4(remote.gid);
        a.ah_attr.grh.hop_limit = 64;
        a.ah_attr.ah_flags = 1; // IB_AH_GRH
        a.ah_attr.port_num = 1;
        let rtr = mask::STATE | mask::AV | mask::PATH_MTU | mask::DEST_QPN | mask::RQ_PSN | mask::MAX_DEST_RD_ATOMIC | mask::MIN_RNR_TIMER;
        self.modify_qp(qp, &a, rtr)?;
        a.qp_state = qp_state::RTS;
        a.sq_psn = remote.my_psn;
        a.timeout = 14;
        a.retry_cnt = 7;
        a.rnr_retry = 7;
        a.max_rd_atomic = 16;
        self.modify_qp(qp, &a, mask::STATE | mask::SQ_PSN | mask::TIMEOUT | mask::RETRY_CNT | mask::RNR_RETRY | mask::MAX_QP_RD_ATOMIC)
    }
}

fn hdr(cmd: u32) -> CmdHdr {
    CmdHdr { response: 0, cmd, reserved: 0 }
}

/// Where a QP connects to, and the PSN it starts sending with.
pub struct Remote {
    pub gid: [u8; 4],
    pub qpn: u32,
    pub psn: u32,
    pub my_psn: u32,
}

pub struct Mr {
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
    pub addr: u64,
    pub len: u64,
}

impl Mr {
    pub fn sge(&self, addr: u64, len: u32) -> Sge {
        Sge { addr, length: len, lkey: self.lkey }
    }
}

pub struct Cq {
    pub handle: u32,
    /// The `Ring` (device produces, driver consumes).
    ring: u64,
    cqes: u64,
    entries: u32,
    uar: u64,
}

impl Cq {
    fn take(&self) -> Result<Option<Cqe>> {
        let tail = rd32(self.ring);
        let head = rd32(self.ring + 4);
        match ring_has_data(tail, head, self.entries) {
            Err(_) => Err(Error::BadRing),
            Ok(None) => Ok(None),
            Ok(Some(slot)) => {
                fence(Ordering::Acquire);
                let c: Cqe = read_pod(self.cqes + slot as u64 * core::mem::size_of::<Cqe>() as u64);
                fence(Ordering::SeqCst);
                wr32(self.ring + 4, idx_inc(head, self.entries));
                Ok(Some(c))
            }
        }
    }

    /// One completion, if there is one: when the ring looks empty, the
    /// POLL doorbell asks the device to look for completions, then the ring
    /// is read again (as `pvrdma_poll_cq`).
    pub fn poll(&self) -> Result<Option<Cqe>> {
        if let Some(c) = self.take()? {
            return Ok(Some(c));
        }
        mmio_write32(self.uar + UAR_CQ_OFFSET, UAR_CQ_POLL | (self.handle & UAR_HANDLE_MASK));
        self.take()
    }

    /// One completion, sleeping for it if there is none, as a driver with
    /// interrupts does: arm the CQ, look once more (a completion that came
    /// before the arm notifies nothing), then halt until the CQ
    /// notification interrupt. May return None after a notification that
    /// was for another CQ. Without interrupts (no MSI-X), the WAIT
    /// doorbell.
    pub fn wait(&self) -> Result<Option<Cqe>> {
        if !crate::irq::ready() {
            return self.wait_doorbell();
        }
        if let Some(c) = self.take()? {
            return Ok(Some(c));
        }
        let vector = INTR_VECTOR_CQ as usize;
        let seen = crate::irq::count(vector);
        mmio_write32(self.uar + UAR_CQ_OFFSET, UAR_CQ_ARM | (self.handle & UAR_HANDLE_MASK));
        if let Some(c) = self.poll()? {
            return Ok(Some(c));
        }
        CQ_IRQ_WAITS.fetch_add(1, Ordering::Relaxed);
        crate::irq::wait_for(vector, seen);
        let ring = CQ_NOTIFY_RING.load(Ordering::SeqCst);
        wr32(ring + RING_STATE_RX_CONS_HEAD, rd32(ring + RING_STATE_RX_PROD_TAIL));
        // The device moved the completion into the ring before it notified.
        self.take()
    }

    /// One completion, sleeping in the device for it if there is none:
    /// the WAIT doorbell (`pvrdma_abi::transit::UAR_CQ_WAIT`, the device's
    /// stand-in for arming the CQ and halting until its interrupt, for a
    /// guest that takes no interrupts) returns once a completion is in the
    /// ring or after at most `CQ_WAIT_MAX_US`.
    pub fn wait_doorbell(&self) -> Result<Option<Cqe>> {
        if let Some(c) = self.take()? {
            return Ok(Some(c));
        }
        let doorbell = UAR_CQ_POLL | transit::UAR_CQ_WAIT | (self.handle & UAR_HANDLE_MASK);
        mmio_write32(self.uar + UAR_CQ_OFFSET, doorbell);
        self.take()
    }
}

pub struct Qp {
    pub handle: u32,
    pub qpn: u32,
    sq_ring: u64,
    rq_ring: u64,
    sq_base: u64,
    rq_base: u64,
    sq_stride: u64,
    rq_stride: u64,
    wqes: u32,
    /// SGEs per receive WQE: 0 on an SRQ (its receives are the SRQ's).
    max_sge: u32,
    send_max_sge: u32,
    uar: u64,
    /// Receive WQEs queued by `post_recv_later` whose RECV doorbell has not
    /// rung yet: the QP's next doorbell carries the RECV bit too.
    recv_unrung: core::cell::Cell<bool>,
}

/// What a send WQE does besides its SGEs.
#[derive(Clone, Copy)]
pub enum Op {
    Send,
    SendImm(u32),
    Write { raddr: u64, rkey: u32 },
    WriteImm { raddr: u64, rkey: u32, imm: u32 },
    Read { raddr: u64, rkey: u32 },
    FetchAdd { raddr: u64, rkey: u32, add: u64 },
    CmpSwap { raddr: u64, rkey: u32, compare: u64, swap: u64 },
}

impl Qp {
    /// Queues one send WQE and rings the SEND doorbell.
    pub fn post_send(&self, wr_id: u64, op: Op, sges: &[Sge], signaled: bool) -> Result<()> {
        self.queue_send(wr_id, op, sges, signaled)?;
        self.ring(UAR_QP_SEND);
        Ok(())
    }

    /// Queues one send WQE, then rings the SEND doorbell with Transit's
    /// WAIT bit (`pvrdma_abi::transit::UAR_QP_WAIT`): the doorbell returns
    /// once a completion is in `recv_cq`'s ring (the QP's receive CQ) or
    /// after at most `CQ_WAIT_MAX_US`, and that completion is returned if
    /// there is one. One MMIO exit for a request and the wait for its
    /// answer, where `post_send` and `Cq::wait_doorbell` take two.
    pub fn post_send_wait(&self, wr_id: u64, op: Op, sges: &[Sge], signaled: bool, recv_cq: &Cq) -> Result<Option<Cqe>> {
        self.queue_send(wr_id, op, sges, signaled)?;
        self.ring(UAR_QP_SEND | transit::UAR_QP_WAIT);
        recv_cq.take()
    }

    /// Rings the QP doorbell with `bits`, and with RECV when receive WQEs
    /// wait for theirs (the device takes the receive queue first).
    fn ring(&self, bits: u32) {
        let recv = if self.recv_unrung.replace(false) { UAR_QP_RECV } else { 0 };
        mmio_write32(self.uar + UAR_QP_OFFSET, bits | recv | (self.handle & UAR_HANDLE_MASK));
    }

    fn queue_send(&self, wr_id: u64, op: Op, sges: &[Sge], signaled: bool) -> Result<()> {
        if sges.len() > self.send_max_sge as usize {
            return Err(Error::QueueFull);
        }
        let tail = rd32(self.sq_ring);
        let head = rd32(self.sq_ring + 4);
        let slot = ring_has_space(tail, head, self.wqes).map_err(|_| Error::BadRing)?.ok_or(Error::QueueFull)?;
        let mut h = SqWqeHdr {
            wr_id,
            num_sge: sges.len() as u32,
            total_len: sges.iter().map(|s| s.length).sum(),
            send_flags: if signaled { ib::send_flags::SIGNALED } else { 0 },
            ..Default::default()
        };
        let rdma = |raddr, rkey| WrRdma { remote_addr: raddr, rkey, reserved: [0; 4] };
        match op {
            Op::Send => h.opcode = wr_opcode::SEND,
            Op::SendImm(imm) => {
                h.opcode = wr_opcode::SEND_WITH_IMM;
                h.ex = imm.to_be();
            }
            Op::Write { raddr, rkey } => {
                h.opcode = wr_opcode::RDMA_WRITE;
                h.wr.set_rdma(&rdma(raddr, rkey));
            }
            Op::WriteImm { raddr, rkey, imm } => {
                h.opcode = wr_opcode::RDMA_WRITE_WITH_IMM;
                h.ex = imm.to_be();
                h.wr.set_rdma(&rdma(raddr, rkey));
            }
            Op::Read { raddr, rkey } => {
                h.opcode = wr_opcode::RDMA_READ;
                h.wr.set_rdma(&rdma(raddr, rkey));
            }
            Op::FetchAdd { raddr, rkey, add } => {
                h.opcode = wr_opcode::ATOMIC_FETCH_AND_ADD;
                h.wr.set_atomic(&WrAtomic { remote_addr: raddr, compare_add: add, swap: 0, rkey, reserved: 0 });
            }
            Op::CmpSwap { raddr, rkey, compare, swap } => {
                h.opcode = wr_opcode::ATOMIC_CMP_AND_SWP;
                h.wr.set_atomic(&WrAtomic { remote_addr: raddr, compare_add: compare, swap, rkey, reserved: 0 });
            }
        }
        let at = self.sq_base + slot as u64 * self.sq_stride;
        write_pod(at, &h);
        for (i, s) in sges.iter().enumerate() {
            write_pod(at + core::mem::size_of::<SqWqeHdr>() as u64 + 16 * i as u64, s);
        }
        fence(Ordering::SeqCst);
        wr32(self.sq_ring, idx_inc(tail, self.wqes));
        Ok(())
    }

    /// Queues one receive WQE and rings the RECV doorbell.
    pub fn post_recv(&self, wr_id: u64, sges: &[Sge]) -> Result<()> {
        self.queue_recv(wr_id, sges)?;
        self.ring(UAR_QP_RECV);
        Ok(())
    }

    /// Queues one receive WQE whose doorbell rings with the QP's next one
    /// (a doorbell value may carry both SEND and RECV): a driver that
    /// reposts a receive and then sends saves an MMIO exit. Only for a
    /// receive not needed before the QP's next post (the peer sends
    /// nothing that would use it before then).
    pub fn post_recv_later(&self, wr_id: u64, sges: &[Sge]) -> Result<()> {
        self.queue_recv(wr_id, sges)?;
        self.recv_unrung.set(true);
        Ok(())
    }

    fn queue_recv(&self, wr_id: u64, sges: &[Sge]) -> Result<()> {
        if self.max_sge == 0 || sges.len() > self.max_sge as usize {
            return Err(Error::QueueFull);
        }
        queue_recv_wqe(self.rq_ring, self.rq_base, self.rq_stride, self.wqes, wr_id, sges)
    }
}

/// Writes one receive WQE into a receive ring, a QP's or an SRQ's (the
/// same layout), and publishes it by moving `prod_tail`; the caller rings
/// the doorbell.
fn queue_recv_wqe(ring: u64, base: u64, stride: u64, wqes: u32, wr_id: u64, sges: &[Sge]) -> Result<()> {
    let tail = rd32(ring);
    let head = rd32(ring + 4);
    let slot = ring_has_space(tail, head, wqes).map_err(|_| Error::BadRing)?.ok_or(Error::QueueFull)?;
    let h = RqWqeHdr { wr_id, num_sge: sges.len() as u32, total_len: sges.iter().map(|s| s.length).sum() };
    let at = base + slot as u64 * stride;
    write_pod(at, &h);
    for (i, s) in sges.iter().enumerate() {
        write_pod(at + core::mem::size_of::<RqWqeHdr>() as u64 + 16 * i as u64, s);
    }
    fence(Ordering::SeqCst);
    wr32(ring, idx_inc(tail, wqes));
    Ok(())
}

/// A shared receive queue: QPs created on it take their receives from its
/// ring in the order messages arrive.
pub struct Srq {
    pub handle: u32,
    /// Its `rx` ring state (prod_tail, then cons_head).
    ring: u64,
    base: u64,
    stride: u64,
    wqes: u32,
    max_sge: u32,
    uar: u64,
}

impl Srq {
    /// Queues one receive WQE and rings the SRQ doorbell.
    pub fn post_recv(&self, wr_id: u64, sges: &[Sge]) -> Result<()> {
        if sges.len() > self.max_sge as usize {
            return Err(Error::QueueFull);
        }
        queue_recv_wqe(self.ring, self.base, self.stride, self.wqes, wr_id, sges)?;
        mmio_write32(self.uar + UAR_SRQ_OFFSET, UAR_SRQ_RECV | (self.handle & UAR_HANDLE_MASK));
        Ok(())
    }
}
