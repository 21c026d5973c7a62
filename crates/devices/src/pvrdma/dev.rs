//! The device state behind one lock: registers, the DSR and its event rings,
//! MSI-X, the GID table, the object tables and the counters; bring-up
//! (DSR, CTL) and interrupt delivery.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::sync::Arc;

use pvrdma_abi as abi;
use pvrdma_abi::{Cqne, Dsr, Eqe, Pod};
use serde::{Deserialize, Serialize};

use super::guest::{Guest, PageList};
use super::objects::{Cq, Mr, Pd, Qp, Srq, Table, Uc};
use super::Errno;
use crate::apic::MsiSink;

/// Limits the device reports in its caps; also the sizes of its tables.
pub(crate) const MAX_QP: u32 = 1024;
pub(crate) const MAX_CQ: u32 = 1024;
pub(crate) const MAX_MR: u32 = 4096;
pub(crate) const MAX_PD: u32 = 1024;
pub(crate) const MAX_UC: u32 = 64;
pub(crate) const MAX_QP_WR: u32 = 1024;
/// SRQs, and WQEs and SGEs per SRQ (what the driver checks CREATE_SRQ
/// against; a non-zero `max_srq` is what makes Linux offer SRQs at all).
pub(crate) const MAX_SRQ: u32 = 1024;
pub(crate) const MAX_SRQ_WR: u32 = 1024;
pub(crate) const MAX_SRQ_SGE: u32 = MAX_SGE;
pub(crate) const MAX_CQE: u32 = 4096;
/// rnicd's limit of SGEs per WQE.
pub(crate) const MAX_SGE: u32 = 8;
pub(crate) const GID_TBL_LEN: u32 = 4;
pub(crate) const MAX_PKEYS: u16 = 1;
pub(crate) const MAX_RD_ATOM: u32 = 16;
/// MSI-X vectors the table holds (response, async, CQ and spares).
pub(crate) const MSIX_VECTORS: usize = 16;
/// Vector control bit 0 of an MSI-X table entry: masked.
pub(crate) const MSIX_ENTRY_MASKED: u32 = 1;
/// UAR pages in BAR2: the kernel's page 0 and one per user context.
pub(crate) const UAR_PAGES: u64 = MAX_UC as u64;

/// Where the device is in its bring-up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum DevState {
    /// After reset: no DSR.
    Reset,
    /// The DSR is known and its caps are written; waiting for ACTIVATE.
    DsrSet,
    /// Commands and doorbells are served.
    Active,
}

/// Guest-visible registers (BAR1) and MSI-X (BAR0).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Regs {
    pub state: DevState,
    pub dsr_low: u32,
    pub dsr_high: u32,
    pub err: u32,
    pub icr: u32,
    pub imr: u32,
    pub mac: [u8; 6],
    /// MSI-X table: address low/high, data, control per vector.
    pub msix: Vec<[u32; 4]>,
    /// MSI-X pending bits: vectors raised while MSI-X was enabled and
    /// their entry or the whole function masked, sent and cleared when
    /// unmasked. Reading ICR leaves them alone.
    pub pba: u64,
    /// The configuration space's MSI-X enable, without function mask
    /// (kept here so that the device's threads see it under its lock).
    #[serde(default)]
    pub msix_enabled: bool,
}

/// What the device took from the DSR at DSRHIGH.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct DsrInfo {
    pub addr: u64,
    pub cmd_slot: u64,
    pub resp_slot: u64,
    pub async_ring: Option<EventRing>,
    pub cq_ring: Option<EventRing>,
}

/// An event ring of the DSR (async events or CQ notifications).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct EventRing {
    pub pages: PageList,
    pub slots: u32,
    pub tail: u32,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub(crate) struct Counters {
    pub commands: u64,
    pub command_errors: u64,
    pub sq_wqes: u64,
    pub rq_wqes: u64,
    pub bad_wqes: u64,
    pub cqes: u64,
    pub error_cqes: u64,
    pub bad_doorbells: u64,
    pub async_events: u64,
    /// rnicd CQs that overran (completions lost; see `Cq::overran`).
    pub cq_overruns: u64,
    pub cq_notifications: u64,
    pub dropped_events: u64,
    /// Guest pages rnicd wrote while traced (migrations: sent again).
    pub traced_pages: u64,
    /// Traces that had to report a whole MR.
    pub trace_overflows: u64,
    /// WAIT doorbells that slept, and those of them that ended at the bound
    /// rather than with a completion.
    pub cq_waits: u64,
    pub cq_wait_timeouts: u64,
    /// WAIT doorbells ended early because the vCPUs were being stopped.
    pub cq_waits_broken: u64,
    /// Sleeps that ended at the bound although a completion had reached
    /// rnicd's CQ by then: a wake-up that did not come (or a completion in
    /// the sleep's last instant).
    pub cq_wait_late: u64,
    /// MSI-X messages sent, and those the platform refused (an entry whose
    /// address or data names no vCPU or no valid vector).
    pub interrupts: u64,
    pub lost_interrupts: u64,
}

/// rnicd, as this device reaches it.
pub(crate) struct Backend {
    pub ctx: verbs::Context,
    /// Guest RAM (its memfd), what every memory region is a range of.
    pub ram: Arc<verbs::MemBuf>,
    pub channel: Arc<verbs::CompChannel>,
}

pub(crate) struct Dev {
    pub name: String,
    pub gid: Ipv4Addr,
    pub guest: Guest,
    pub ram_size: u64,
    pub be: Backend,
    pub regs: Regs,
    pub dsr: Option<DsrInfo>,
    pub gids: BTreeMap<u32, [u8; 16]>,
    pub ucs: Table<Uc>,
    pub pds: Table<Pd>,
    pub mrs: Table<Mr>,
    pub cqs: Table<Cq>,
    pub qps: Table<Qp>,
    pub srqs: Table<Srq>,
    /// QPs suspended by `pause` (or created suspended by a restore), which
    /// `resume` resumes.
    pub suspended: Vec<u32>,
    pub counters: Counters,
    /// Set by Lifecycle::pause: no guest memory access, no rnicd work.
    pub paused: bool,
    /// Bus mastering (PCI command bit 2) as configuration space says:
    /// without it the device reads and writes no guest memory and sends no
    /// MSI-X message (`Pvrdma::follow_bus_master`).
    pub bus_master: bool,
    /// A migration runs: every MR is traced (traces.rs).
    pub tracing: bool,
    /// Pages traced in MRs destroyed since the last take (and, once
    /// `last_traces_taken`, those of every MR up to the pause).
    pub traced: Vec<super::traces::PageRun>,
    /// The pause took rnicd's traces of every MR with its suspend: nothing
    /// has written the MRs since, and `take_traced` asks rnicd no more.
    pub last_traces_taken: bool,
    /// This host answers for the GID (claimed through rnicd).
    pub claimed: bool,
    pub testing: super::config::Testing,
    /// The phases of the last switchover (query-pvrdma `switch`).
    pub switch: super::switch::SwitchLog,
    /// Where MSI-X messages go (the vCPUs' local APICs); none: interrupts
    /// stay pending.
    pub msi: Option<Arc<dyn MsiSink>>,
    /// MSI-X is enabled but the whole function masked (configuration
    /// space): vectors go pending rather than nowhere. Saved with the
    /// configuration space (persist.rs).
    pub msix_function_masked: bool,
    /// Some guest CQ is armed: the notifier thread waits on rnicd's
    /// completion channel only then (mod.rs, `notifier`).
    pub cq_armed: Arc<std::sync::atomic::AtomicBool>,
    /// Some QP's send WQEs wait in the guest's ring because rnicd's queue
    /// was full at the doorbell: the notifier thread takes them when no
    /// send completion (which takes them at once) comes first.
    pub sends_waiting: Arc<std::sync::atomic::AtomicBool>,
    /// The notifier thread, unparked when the guest arms a CQ.
    pub notifier_thread: Option<std::thread::Thread>,
}

impl Dev {
    pub fn new(name: String, gid: Ipv4Addr, guest: Guest, ram_size: u64, be: Backend, testing: super::config::Testing) -> Dev {
        Dev {
            name,
            gid,
            guest,
            ram_size,
            be,
            regs: Regs::reset(gid),
            dsr: None,
            gids: BTreeMap::new(),
            ucs: Table::new(MAX_UC),
            pds: Table::new(MAX_PD),
            mrs: Table::new(MAX_MR),
            cqs: Table::new(MAX_CQ),
            qps: Table::new(MAX_QP),
            srqs: Table::new(MAX_SRQ),
            suspended: Vec::new(),
            counters: Counters::default(),
            paused: false,
            bus_master: false,
            tracing: false,
            traced: Vec::new(),
            last_traces_taken: false,
            claimed: false,
            testing,
            switch: Default::default(),
            msi: None,
            msix_function_masked: false,
            cq_armed: Default::default(),
            sends_waiting: Default::default(),
            notifier_thread: None,
        }
    }

    /// The MAC the device reports: locally administered, from the GID.
    pub fn mac(gid: Ipv4Addr) -> [u8; 6] {
        let o = gid.octets();
        [0x02, 0x50, o[0], o[1], o[2], o[3]]
    }

    /// CTL RESET: every object goes (rnicd's too) and the DSR is forgotten.
    pub fn reset(&mut self) {
        if self.tracing {
            // What rnicd wrote into the MRs still goes to the dirty log.
            let traced = self.take_traced();
            self.traced = traced;
        }
        self.qps.clear();
        self.srqs.clear();
        self.cqs.clear();
        self.mrs.clear();
        self.suspended.clear();
        self.pds.clear();
        self.ucs.clear();
        self.gids.clear();
        self.dsr = None;
        // MSI-X belongs to the PCI function, not to the device's reset.
        let (msix, enabled) = (std::mem::take(&mut self.regs.msix), self.regs.msix_enabled);
        self.regs = Regs::reset(self.gid);
        self.regs.msix = msix;
        self.regs.msix_enabled = enabled;
    }

    pub fn caps(&self) -> abi::DeviceCaps {
        abi::DeviceCaps {
            fw_ver: 0x0001_0000,
            // EUI-64 of the MAC, big endian as the guest reads it.
            node_guid: {
                let m = Dev::mac(self.gid);
                u64::from_ne_bytes([m[0] ^ 2, m[1], m[2], 0xff, 0xfe, m[3], m[4], m[5]])
            },
            sys_image_guid: 0,
            max_mr_size: self.ram_size,
            page_size_cap: 0x1000,
            atomic_arg_sizes: 8,
            vendor_id: abi::PCI_VENDOR_ID_VMWARE as u32,
            vendor_part_id: abi::PCI_DEVICE_ID_VMWARE_PVRDMA as u32,
            hw_ver: 1,
            max_qp: MAX_QP,
            max_qp_wr: MAX_QP_WR,
            max_sge: MAX_SGE,
            max_sge_rd: MAX_SGE,
            max_cq: MAX_CQ,
            max_cqe: MAX_CQE,
            max_mr: MAX_MR,
            max_pd: MAX_PD,
            max_srq: MAX_SRQ,
            max_srq_wr: MAX_SRQ_WR,
            max_srq_sge: MAX_SRQ_SGE,
            max_qp_rd_atom: MAX_RD_ATOM,
            max_res_rd_atom: MAX_RD_ATOM * MAX_QP,
            max_qp_init_rd_atom: MAX_RD_ATOM,
            max_uar: UAR_PAGES as u32,
            gid_tbl_len: GID_TBL_LEN,
            max_pkeys: MAX_PKEYS,
            local_ca_ack_delay: 15,
            phys_port_cnt: 1,
            mode: abi::DEVICE_MODE_ROCE,
            atomic_ops: abi::ATOMIC_OP_COMP_SWAP | abi::ATOMIC_OP_FETCH_ADD,
            bmme_flags: 0,
            gid_types: abi::GID_TYPE_FLAG_ROCE_V2,
            max_fast_reg_page_list_len: 0,
            ..Default::default()
        }
    }

    /// DSRHIGH written: read the DSR, resolve its rings, write the caps.
    pub fn set_dsr(&mut self) -> Result<(), Errno> {
        if !self.bus_master {
            return Err(Errno::EPERM);
        }
        let addr = (self.regs.dsr_high as u64) << 32 | self.regs.dsr_low as u64;
        let dsr: Dsr = self.guest.read(addr)?;
        // The command and response slots are whole pages of guest RAM:
        // checked now, so that no command runs (and makes objects) whose
        // response could not be written.
        if !self.guest.page_ok(dsr.cmd_slot_dma) || !self.guest.page_ok(dsr.resp_slot_dma) {
            return Err(Errno::EFAULT);
        }
        let ring = |info: &abi::RingPageInfo, size: usize| -> Result<Option<EventRing>, Errno> {
            if info.num_pages == 0 {
                return Ok(None);
            }
            if info.num_pages < 2 {
                return Err(Errno::EINVAL);
            }
            let pages = self.guest.resolve_pdir(info.pdir_dma, info.num_pages)?;
            Ok(Some(EventRing { pages, slots: abi::event_ring_slots(info.num_pages, size), tail: 0 }))
        };
        let async_ring = ring(&dsr.async_ring_pages, std::mem::size_of::<Eqe>())?;
        let cq_ring = ring(&dsr.cq_ring_pages, std::mem::size_of::<Cqne>())?;
        let caps = self.caps();
        self.guest.write(addr + Dsr::CAPS_OFFSET as u64, &caps)?;
        self.dsr = Some(DsrInfo { addr, cmd_slot: dsr.cmd_slot_dma, resp_slot: dsr.resp_slot_dma, async_ring, cq_ring });
        // The device produces from whatever index the driver left.
        self.sync_event_tails();
        self.regs.state = DevState::DsrSet;
        Ok(())
    }

    /// Start each event ring's producer where the ring's state page says.
    fn sync_event_tails(&mut self) {
        let guest = self.guest.clone();
        if let Some(d) = self.dsr.as_mut() {
            for r in [d.async_ring.as_mut(), d.cq_ring.as_mut()].into_iter().flatten() {
                let tail = r.pages.gpa(abi::RING_STATE_RX_PROD_TAIL, 4).and_then(|a| guest.load_u32(a)).unwrap_or(0);
                r.tail = if abi::idx_valid(tail, r.slots) { tail } else { 0 };
            }
        }
    }

    /// Raises interrupt `vector`: its ICR bit, and when MSI-X is enabled
    /// and IMR does not mask the vector, its MSI-X message (the table
    /// entry's address and data) if the entry and function are unmasked,
    /// else its pending bit. With MSI-X disabled the function signals
    /// through ICR alone (a driver without MSI-X reads it), so enabling
    /// MSI-X later sends nothing stale.
    pub fn raise(&mut self, vector: u32) {
        self.regs.icr |= 1 << vector.min(31);
        let msix_on = self.regs.msix_enabled || self.msix_function_masked;
        if vector as usize >= MSIX_VECTORS || self.regs.imr & (1 << vector) != 0 || !msix_on {
            return;
        }
        self.regs.pba |= 1 << vector;
        self.send_pending();
    }

    /// Takes MSI-X enable and function mask from configuration space
    /// (written by the guest, or restored).
    pub fn follow_msix_control(&mut self, pci: &crate::pci::PciConfig) {
        use crate::pci::{MSIX_CTRL_ENABLE, MSIX_CTRL_FUNCTION_MASK};
        self.regs.msix_enabled = pci.msix_enabled();
        let ctrl = pci.msix_control();
        self.msix_function_masked = ctrl & MSIX_CTRL_ENABLE != 0 && ctrl & MSIX_CTRL_FUNCTION_MASK != 0;
    }

    /// Sends the message of every pending vector whose entry is unmasked,
    /// when MSI-X is enabled (after a raise, an entry unmasked, MSI-X
    /// enabled or a restore).
    pub fn send_pending(&mut self) {
        // An MSI-X message is a memory write: it waits for bus mastering.
        let Some(sink) = self.msi.as_ref().filter(|_| self.regs.msix_enabled && self.bus_master) else { return };
        for v in 0..MSIX_VECTORS {
            let e = self.regs.msix[v];
            if self.regs.pba & (1 << v) == 0 || e[3] & MSIX_ENTRY_MASKED != 0 {
                continue;
            }
            self.regs.pba &= !(1 << v);
            let addr = (e[1] as u64) << 32 | e[0] as u64;
            if sink.send(addr, e[2]) {
                self.counters.interrupts += 1;
            } else {
                self.counters.lost_interrupts += 1;
            }
        }
    }

    /// Appends an entry to an event ring; false when the ring is absent,
    /// full or broken (the event is counted as dropped).
    fn push_event<T: Pod>(&mut self, which: fn(&mut DsrInfo) -> Option<&mut EventRing>, entry: &T) -> bool {
        let guest = self.guest.clone();
        if !self.bus_master {
            // The ring is guest memory: no event without bus mastering.
            self.counters.dropped_events += 1;
            return false;
        }
        let Some(r) = self.dsr.as_mut().and_then(which) else { return false };
        let size = std::mem::size_of::<T>() as u64;
        let ok = (|| -> Result<(), Errno> {
            let head = guest.load_u32(r.pages.gpa(abi::RING_STATE_RX_CONS_HEAD, 4)?)?;
            let slot = abi::ring_has_space(r.tail, head, r.slots).map_err(|_| Errno::EINVAL)?.ok_or(Errno::ENOSPC)?;
            guest.write(r.pages.gpa(abi::EVENT_RING_FIRST_OFFSET + slot as u64 * size, size)?, entry)?;
            r.tail = abi::idx_inc(r.tail, r.slots);
            guest.store_u32(r.pages.gpa(abi::RING_STATE_RX_PROD_TAIL, 4)?, r.tail)
        })()
        .is_ok();
        if !ok {
            self.counters.dropped_events += 1;
        }
        ok
    }

    /// An async event (`ib::event`) about object `info`.
    pub fn async_event(&mut self, event_type: u32, info: u32) {
        if self.push_event(|d| d.async_ring.as_mut(), &Eqe { event_type, info }) {
            self.counters.async_events += 1;
            self.raise(abi::INTR_VECTOR_ASYNC);
        }
    }

    /// A CQ notification for `cq_handle`.
    pub fn cq_notify(&mut self, cq_handle: u32) {
        if self.push_event(|d| d.cq_ring.as_mut(), &Cqne { info: cq_handle }) {
            self.counters.cq_notifications += 1;
            self.raise(abi::INTR_VECTOR_CQ);
        }
    }

    /// The handle of the QP with number `qpn`.
    pub fn qp_handle_of(&self, qpn: u32) -> Option<u32> {
        self.qps.iter().find(|(_, q)| q.info.qpn == qpn).map(|(h, _)| *h)
    }
}

impl Regs {
    pub fn reset(gid: Ipv4Addr) -> Regs {
        Regs {
            state: DevState::Reset,
            dsr_low: 0,
            dsr_high: 0,
            err: 0,
            icr: 0,
            imr: !0,
            mac: Dev::mac(gid),
            msix: vec![[0, 0, 0, MSIX_ENTRY_MASKED]; MSIX_VECTORS],
            pba: 0,
            msix_enabled: false,
        }
    }
}
