//! A VMware PVRDMA device (the interface of Linux's `vmw_pvrdma` driver,
//! version 20) whose backend is one RDMA namespace of the host's rnicd.
//! See docs/pvrdma.md.
//!
//! The VM is one namespace on its host's rnicd, whose GID is the VM's own
//! address: the QPNs, lkeys and rkeys the guest sees are the namespace's own
//! (no translation), so what a peer learns stays true after a move. Memory
//! regions are ranges of the guest RAM memfd that rnicd maps itself: the vmm
//! never copies payload.
//!
//! Threading: the vCPU thread runs commands and doorbells inline (datapath.rs).
//! One notifier thread per device waits for rnicd's completion events and
//! turns them into CQ notifications for armed CQs. A WAIT doorbell sleeps on
//! the vCPU thread for the next completion event, without the lock. All state
//! sits behind one lock.

mod churn;
mod cmd;
mod config;
mod datapath;
mod delta;
mod dev;
mod early;
mod guest;
mod negative;
mod objects;
mod persist;
mod reach;
mod srq;
mod switch;
mod traces;

pub use config::{PvrdmaConfig, Testing};
pub use traces::{PageRun, TraceHandle};

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pvrdma_abi as abi;
use serde_json::json;

use crate::bus::BusDevice;
use crate::pci::{Bar, PciConfig, PciFunction};
use crate::{GuestMemory, Lifecycle};
use dev::{Backend, Dev, DevState, MSIX_VECTORS, UAR_PAGES};
use guest::Guest;

/// Error numbers the device reports in ERR and `hdr.err` (Linux errno values,
/// spelled as in C).
#[allow(clippy::upper_case_acronyms)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Errno {
    EPERM = 1,
    ENOENT = 2,
    EIO = 5,
    E2BIG = 7,
    ENOMEM = 12,
    EFAULT = 14,
    EBUSY = 16,
    EINVAL = 22,
    ENOSPC = 28,
    ERANGE = 34,
    ENOSYS = 38,
}

impl Errno {
    fn from_u8(v: u8) -> Errno {
        use Errno::*;
        [EPERM, ENOENT, EIO, E2BIG, ENOMEM, EFAULT, EBUSY, EINVAL, ENOSPC, ERANGE, ENOSYS]
            .into_iter()
            .find(|e| *e as u8 == v)
            .unwrap_or(EINVAL)
    }
}

fn lock(m: &Mutex<Dev>) -> MutexGuard<'_, Dev> {
    // A panic elsewhere must not take the device down with it.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Sizes of the three regions (each a power of two).
pub const MSIX_BAR_SIZE: u64 = abi::MSIX_BAR_SIZE;
pub const REG_BAR_SIZE: u64 = abi::REG_BAR_SIZE;
pub const UAR_BAR_SIZE: u64 = UAR_PAGES * 4096;
/// BAR slots of the three regions (32-bit BARs 0, 1 and 2, as Linux's
/// `pvrdma_pci_probe` expects).
const BAR_MSIX: usize = abi::BAR_MSIX as usize;
const BAR_REG: usize = abi::BAR_REG as usize;
const BAR_UAR: usize = abi::BAR_UAR as usize;
/// Bytes of MMIO one device takes from an address aligned to `BAR_ALIGN`.
pub const BAR_SPAN: u64 = UAR_BAR_SIZE + MSIX_BAR_SIZE + REG_BAR_SIZE;
pub const BAR_ALIGN: u64 = UAR_BAR_SIZE;

/// The PCI function: configuration space, the device state and its
/// notifier thread.
pub struct Pvrdma {
    name: String,
    shared: Arc<Mutex<Dev>>,
    pci: PciConfig,
    stop: Arc<AtomicBool>,
    notifier: Option<JoinHandle<()>>,
    /// What a WAIT doorbell sleeps on (the vCPU's own view of rnicd's
    /// completion channel).
    cq_waiter: Arc<verbs::ChannelWaiter>,
    /// The states of the QPs the last pause suspended, by QPN: rnicd
    /// returns them with the suspend (a suspended QP's state does not
    /// change), so that the save asks nothing more inside the downtime.
    paused_states: HashMap<u32, verbs::QpSnapshot>,
    /// Destination: what an early section built ahead of the switch
    /// (`early.rs`), until `restore` takes it or the migration fails.
    prepared: Option<early::Prepared>,
    /// The early section this device last sent (source) or received
    /// (destination): what the state at the switch is a delta over.
    early_base: Mutex<Option<delta::Baseline>>,
}

/// One of the device's BARs on the MMIO bus.
pub struct PvrdmaBar {
    shared: Arc<Mutex<Dev>>,
    slot: usize,
    cq_waiter: Arc<verbs::ChannelWaiter>,
}

impl Pvrdma {
    /// A device in namespace `cfg.gid` of the rnicd at `cfg.rnicd` (or the one
    /// found in this network namespace), reaching guest RAM `mem` (whose
    /// memfd, sealed against shrinking, is `ram_memfd`). Its BARs, 32-bit,
    /// take [`BAR_SPAN`] bytes from `bar_base`, aligned to [`BAR_ALIGN`] and
    /// below 4 GiB (the 32-bit PCI hole, `layout::PCI_HOLE_BASE`).
    pub fn new(cfg: PvrdmaConfig, mem: GuestMemory, ram_memfd: OwnedFd, bar_base: u64) -> Result<Pvrdma, String> {
        if !bar_base.is_multiple_of(BAR_ALIGN) {
            return Err(format!("BAR base {bar_base:#x} is not aligned to {BAR_ALIGN:#x}"));
        }
        if bar_base + BAR_SPAN > 1 << 32 {
            return Err(format!("BAR base {bar_base:#x}: the device's 32-bit BARs must lie below 4 GiB"));
        }
        let ram = verbs::MemBuf::from_memfd(ram_memfd).map_err(|e| format!("guest RAM for rnicd: {e:#}"))?;
        let ctx =
            verbs::Context::open_namespace(cfg.rnicd.as_deref(), cfg.gid).map_err(|e| format!("rnicd namespace {}: {e:#}", cfg.gid))?;
        let channel = ctx.create_comp_channel().map_err(|e| format!("rnicd completion channel: {e:#}"))?;
        let waiter = |who: &str| channel.waiter().map_err(|e| format!("{who} on the completion channel: {e:#}"));
        let (notifier_waiter, cq_waiter) = (waiter("notifier")?, Arc::new(waiter("CQ waiter")?));
        let ram_size = ram.len() as u64;
        let be = Backend { ctx, ram: Arc::new(ram), channel: Arc::new(channel) };
        let shared = Arc::new(Mutex::new(Dev::new(cfg.name.clone(), cfg.gid, Guest { mem }, ram_size, be, cfg.testing)));
        let class = abi::PCI_CLASS_NETWORK_OTHER;
        let mut pci = PciConfig::new(
            abi::PCI_VENDOR_ID_VMWARE,
            abi::PCI_DEVICE_ID_VMWARE_PVRDMA,
            (class >> 16) as u8,
            (class >> 8) as u8,
            class as u8,
        );
        // The largest region first keeps each aligned to its size.
        pci.set_bar32(BAR_UAR, Bar { addr: bar_base, size: UAR_BAR_SIZE });
        pci.set_bar32(BAR_MSIX, Bar { addr: bar_base + UAR_BAR_SIZE, size: MSIX_BAR_SIZE });
        pci.set_bar32(BAR_REG, Bar { addr: bar_base + UAR_BAR_SIZE + MSIX_BAR_SIZE, size: REG_BAR_SIZE });
        let msix_bar = abi::BAR_MSIX;
        pci.set_msix_capability(MSIX_VECTORS as u16, msix_bar, abi::MSIX_TABLE_OFFSET as u32, msix_bar, abi::MSIX_PBA_OFFSET as u32);
        let stop = Arc::new(AtomicBool::new(false));
        let notifier = {
            let (shared, stop) = (shared.clone(), stop.clone());
            std::thread::Builder::new()
                .name(format!("pvrdma-{}", cfg.name))
                .spawn(move || notifier(shared, notifier_waiter, stop))
                .map_err(|e| format!("notifier thread: {e}"))?
        };
        lock(&shared).notifier_thread = Some(notifier.thread().clone());
        Ok(Pvrdma {
            name: cfg.name,
            shared,
            pci,
            stop,
            notifier: Some(notifier),
            cq_waiter,
            paused_states: HashMap::new(),
            prepared: None,
            early_base: Mutex::new(None),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Where the device sends its MSI-X messages (the platform's local
    /// APICs). Without one, raised vectors stay pending in the PBA and ICR.
    pub fn set_msi_sink(&self, sink: Arc<dyn crate::apic::MsiSink>) {
        lock(&self.shared).msi = Some(sink);
    }

    /// The BARs to put on the MMIO bus: (device, address, size).
    pub fn bars(&self) -> Vec<(Arc<Mutex<PvrdmaBar>>, u64, u64)> {
        [BAR_MSIX, BAR_REG, BAR_UAR]
            .into_iter()
            .map(|slot| {
                let b = self.pci.bar(slot).expect("declared in new");
                let bar = PvrdmaBar { shared: self.shared.clone(), slot, cq_waiter: self.cq_waiter.clone() };
                (Arc::new(Mutex::new(bar)), b.addr, b.size)
            })
            .collect()
    }

    /// The guest pages this device and its rnicd reach without the vCPU
    /// (rings, then memory regions), as `(gpa, len)` byte ranges: what a
    /// postcopy switch carries (`reach.rs`).
    pub fn device_pages(&self) -> Vec<(u64, u64)> {
        reach::device_pages(&lock(&self.shared))
    }

    /// Destination, before its switch: the same pages as far as the early
    /// section it received names them (none without one).
    pub fn early_pages(&self) -> Vec<(u64, u64)> {
        self.early_base.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(reach::early_pages).unwrap_or_default()
    }

    /// The VM's state has gone to a migration's destination: this host
    /// stops answering for the GID, before the destination claims it (and
    /// claims it again in `resume` if the migration fails).
    pub fn release_gid(&self) -> Result<(), String> {
        let mut d = lock(&self.shared);
        let t = Instant::now();
        d.be.ctx.release_gid().map_err(|e| format!("pvrdma {}: releasing GID {}: {e:#}", d.name, d.gid))?;
        d.switch.record("release GID", t);
        d.claimed = false;
        Ok(())
    }

    /// The VM runs on another host: every object goes from this host's
    /// rnicd, and the namespace closes with the connection. One close, not a
    /// destroy per object: at 256 QPs those were some 800 round trips on
    /// this host's CPUs just after the switch.
    pub fn close(&self) {
        let mut d = lock(&self.shared);
        let t = Instant::now();
        d.stop_traces();
        d.be.ctx.close();
        d.reset();
        d.switch.record("close after the move", t);
    }

    /// The vCPUs are about to be stopped (`true`) or were not (`false`,
    /// a pause that gave up): a vCPU asleep in a WAIT doorbell sleeps
    /// inside its MMIO exit, where the platform's kick, which wakes a HLT,
    /// does not reach; without this it stopped only at the WAIT's bound
    /// (`CQ_WAIT_MAX_US`). `resume` ends the interruption too.
    pub fn interrupt_waits(&self, on: bool) {
        if on {
            self.cq_waiter.interrupt();
        } else {
            self.cq_waiter.clear_interrupt();
        }
    }

    /// `query-pvrdma`: objects, QP states and counters.
    pub fn query(&self) -> serde_json::Value {
        let d = lock(&self.shared);
        let qps: Vec<_> = d
            .qps
            .iter()
            .map(|(h, q)| {
                let state = q.qp.state().map(|s| format!("{s:?}").to_uppercase()).unwrap_or_else(|e| format!("unknown ({e})"));
                json!({
                    "handle": h, "qpn": q.info.qpn, "state": state, "broken": q.info.broken,
                    "send_cq": q.info.send_cq, "recv_cq": q.info.recv_cq,
                    "sq_outstanding": q.info.sq_out.len(), "rq_outstanding": q.info.rq_out.len(),
                })
            })
            .collect();
        let mrs: Vec<_> = d
            .mrs
            .iter()
            .map(|(h, m)| json!({"handle": h, "key": m.info.key, "start": m.info.start, "length": m.info.length, "runs": m.info.runs}))
            .collect();
        json!({
            "name": d.name,
            "gid": d.gid.to_string(),
            "state": format!("{:?}", d.regs.state).to_lowercase(),
            "paused": d.paused,
            "claimed": d.claimed,
            "tracing": d.tracing,
            "objects": {
                "contexts": d.ucs.len(), "pds": d.pds.len(), "mrs": d.mrs.len(),
                "cqs": d.cqs.len(), "qps": d.qps.len(), "srqs": d.srqs.len(),
            },
            "bus_master": d.bus_master,
            "cqs": d.cqs.iter().map(|(h, c)| json!({
                "handle": h, "entries": c.ring.entries, "pending": c.ring.pending.len(), "overran": c.overran,
            })).collect::<Vec<_>>(),
            "srqs": d.srqs.iter().map(|(h, s)| json!({
                "handle": h, "pd": s.info.pd_handle, "max_wr": s.info.rq.wqe_cnt, "max_sge": s.info.rq.max_sge,
                "limit": s.info.limit, "broken": s.info.broken, "qps": s.info.qps, "outstanding": s.info.out.len(),
            })).collect::<Vec<_>>(),
            "qps": qps,
            "mrs": mrs,
            "counters": serde_json::to_value(&d.counters).unwrap_or_default(),
            "switch": serde_json::to_value(&d.switch).unwrap_or_default(),
        })
    }
}

/// Waits for rnicd's completion events and notifies armed CQs. Its waiter
/// leaves the eventfd alone, so a vCPU in a WAIT doorbell sees the same
/// events. While no guest CQ is armed it does not wait on the channel at
/// all, but parked: a completion that only a WAIT doorbell waits for then
/// wakes one thread (the vCPU's), not two that then contend for the
/// device lock on a small host. The edge-triggered epoll keeps an event
/// that came while parked, so arming never misses one.
fn notifier(shared: Arc<Mutex<Dev>>, waiter: verbs::ChannelWaiter, stop: Arc<AtomicBool>) {
    let (armed, sends_waiting) = {
        let d = lock(&shared);
        (d.cq_armed.clone(), d.sends_waiting.clone())
    };
    while !stop.load(Ordering::Acquire) {
        // At least every 50 ms (the waits below).
        if sends_waiting.swap(false, Ordering::AcqRel) {
            lock(&shared).take_waiting_sends();
        }
        if !armed.load(Ordering::Acquire) {
            std::thread::park_timeout(Duration::from_millis(50));
            // A restored device's CQs may be armed without an ARM doorbell.
            let d = lock(&shared);
            if d.any_cq_armed() {
                armed.store(true, Ordering::Release);
            }
            continue;
        }
        match waiter.wait(Duration::from_millis(50)) {
            Ok(true) => {
                let mut d = lock(&shared);
                if !d.paused && d.regs.state == DevState::Active {
                    d.notify_armed();
                }
                if !d.any_cq_armed() {
                    armed.store(false, Ordering::Release);
                }
            }
            Ok(false) => {}
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

impl PvrdmaBar {
    /// The WAIT doorbell (`abi::transit::UAR_CQ_WAIT`, after its POLL ran,
    /// or `UAR_QP_WAIT` after its posts, on the QP's receive CQ):
    /// sleeps on rnicd's completion channel, without the device lock, until
    /// a completion reaches CQ `handle`'s guest ring or the bound passes.
    /// The analogue of a guest that arms its CQ and halts until the
    /// interrupt, on a platform that cannot inject one.
    fn wait_cq(&self, handle: u32) {
        let deadline = Instant::now() + Duration::from_micros(abi::transit::CQ_WAIT_MAX_US);
        let mut slept = false;
        loop {
            let mut d = lock(&self.shared);
            if d.cq_wait_done(handle) {
                return;
            }
            if !slept {
                d.counters.cq_waits += 1;
                slept = true;
            }
            drop(d);
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || !self.cq_waiter.wait(left).unwrap_or(false) {
                // The bound passed, or the vCPUs are being stopped: one
                // last look, as after a timer tick.
                let mut d = lock(&self.shared);
                if d.cq_wait_done(handle) {
                    d.counters.cq_wait_late += 1;
                } else if self.cq_waiter.is_interrupted() {
                    d.counters.cq_waits_broken += 1;
                } else {
                    d.counters.cq_wait_timeouts += 1;
                }
                return;
            }
        }
    }

    fn read_reg(d: &mut Dev, offset: u64) -> u32 {
        match offset {
            abi::REG_VERSION => abi::VERSION_QPHANDLE,
            abi::REG_DSRLOW => d.regs.dsr_low,
            abi::REG_DSRHIGH => d.regs.dsr_high,
            abi::REG_ERR => d.regs.err,
            abi::REG_ICR => {
                // Read to clear: ICR is the cause register of a driver
                // without MSI-X (Linux reads it only then, in its INTx/MSI
                // handler), which handles what it read. The PBA is MSI-X
                // state: a pending bit stays until its message is sent.
                std::mem::take(&mut d.regs.icr)
            }
            abi::REG_IMR => d.regs.imr,
            abi::REG_MACL => u32::from_le_bytes([d.regs.mac[0], d.regs.mac[1], d.regs.mac[2], d.regs.mac[3]]),
            abi::REG_MACH => u16::from_le_bytes([d.regs.mac[4], d.regs.mac[5]]) as u32,
            _ => 0,
        }
    }

    fn write_reg(d: &mut Dev, offset: u64, v: u32) {
        match offset {
            abi::REG_DSRLOW => d.regs.dsr_low = v,
            abi::REG_DSRHIGH => {
                d.regs.dsr_high = v;
                d.regs.err = match d.regs.state {
                    DevState::Reset => d.set_dsr().err().map(|e| e as u32).unwrap_or(0),
                    _ => Errno::EPERM as u32,
                };
            }
            abi::REG_CTL => {
                d.regs.err = match v {
                    abi::DEVICE_CTL_ACTIVATE if d.regs.state == DevState::DsrSet => {
                        d.regs.state = DevState::Active;
                        0
                    }
                    abi::DEVICE_CTL_UNQUIESCE if d.regs.state == DevState::Active => 0,
                    abi::DEVICE_CTL_RESET => {
                        d.reset();
                        0
                    }
                    _ => Errno::EPERM as u32,
                };
            }
            abi::REG_REQUEST => d.request(),
            abi::REG_IMR => {
                d.regs.imr = v;
                // Vectors raised while masked by IMR are not pending in the
                // PBA (as on a device that does not signal them at all).
            }
            abi::REG_MACL => d.regs.mac[..4].copy_from_slice(&v.to_le_bytes()),
            abi::REG_MACH => d.regs.mac[4..].copy_from_slice(&v.to_le_bytes()[..2]),
            _ => {}
        }
    }

    fn read_msix(d: &Dev, offset: u64) -> u32 {
        let table_end = abi::MSIX_TABLE_OFFSET + MSIX_VECTORS as u64 * abi::MSIX_ENTRY_SIZE;
        if (abi::MSIX_TABLE_OFFSET..table_end).contains(&offset) {
            let e = ((offset - abi::MSIX_TABLE_OFFSET) / abi::MSIX_ENTRY_SIZE) as usize;
            d.regs.msix[e][((offset % abi::MSIX_ENTRY_SIZE) / 4) as usize]
        } else if offset == abi::MSIX_PBA_OFFSET {
            d.regs.pba as u32
        } else if offset == abi::MSIX_PBA_OFFSET + 4 {
            (d.regs.pba >> 32) as u32
        } else {
            0
        }
    }

    fn write_msix(d: &mut Dev, offset: u64, v: u32) {
        let table_end = abi::MSIX_TABLE_OFFSET + MSIX_VECTORS as u64 * abi::MSIX_ENTRY_SIZE;
        if (abi::MSIX_TABLE_OFFSET..table_end).contains(&offset) {
            let e = ((offset - abi::MSIX_TABLE_OFFSET) / abi::MSIX_ENTRY_SIZE) as usize;
            let word = ((offset % abi::MSIX_ENTRY_SIZE) / 4) as usize;
            d.regs.msix[e][word] = v;
            if word == 3 {
                // Unmasking an entry sends what it held pending.
                d.send_pending();
            }
        }
    }
}

impl BusDevice for PvrdmaBar {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        // 32-bit registers only; other sizes or misaligned reads see zeros.
        if data.len() != 4 || !offset.is_multiple_of(4) {
            data.fill(0);
            return;
        }
        let mut d = lock(&self.shared);
        let v = match self.slot {
            BAR_REG => Self::read_reg(&mut d, offset),
            BAR_MSIX => Self::read_msix(&d, offset),
            _ => 0, // doorbells read as zero
        };
        data.copy_from_slice(&v.to_le_bytes());
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let Ok(b) = <[u8; 4]>::try_from(data) else { return };
        if !offset.is_multiple_of(4) {
            return;
        }
        let v = u32::from_le_bytes(b);
        let mut d = lock(&self.shared);
        match self.slot {
            BAR_REG => Self::write_reg(&mut d, offset, v),
            BAR_MSIX => Self::write_msix(&mut d, offset, v),
            _ => {
                d.doorbell(offset % 4096, v);
                if let Some(cq) = d.doorbell_waits_on(offset % 4096, v) {
                    drop(d);
                    self.wait_cq(cq);
                }
            }
        }
    }
}

impl Pvrdma {
    /// The command register's bus master enable, written by the guest.
    /// Turned off, the device stops touching guest memory as hardware
    /// whose DMA is blocked: it quiesces as for a pause (QPs suspended in
    /// rnicd, so peers get RNR NAKs and rnicd moves no payload; completions
    /// kept in the device), and commands, doorbells, events and MSI-X
    /// messages wait or fail (docs/pvrdma.md). Turned on again, it resumes.
    fn follow_bus_master(&mut self) {
        let on = self.pci.bus_master();
        let was = std::mem::replace(&mut lock(&self.shared).bus_master, on);
        match (was, on) {
            (true, false) => Lifecycle::pause(self),
            (false, true) => Lifecycle::resume(self),
            _ => {}
        }
    }
}

impl PciFunction for Pvrdma {
    fn pci_config(&mut self) -> &mut PciConfig {
        &mut self.pci
    }

    fn config_written(&mut self, reg: usize) {
        if reg == 1 {
            self.follow_bus_master();
        }
        if reg * 4 == crate::pci::MSIX_CAP_OFFSET {
            let mut d = lock(&self.shared);
            d.follow_msix_control(&self.pci);
            d.send_pending();
        }
    }
}

impl Lifecycle for Pvrdma {
    /// Suspends every QP in rnicd (the peer hears RNR NAKs, never an error)
    /// and moves the completions rnicd already made into the guest's CQs (or
    /// the device's pending lists): afterwards nothing touches guest memory.
    fn pause(&mut self) {
        let mut d = lock(&self.shared);
        if d.paused {
            return;
        }
        d.switch.begin();
        if d.testing.no_traces {
            d.hold_until_peers_fill_a_receive_queue();
        }
        let t = Instant::now();
        // Only connected QPs have a transport to suspend; the others hold
        // nothing but their attributes and posted WQEs. rnicd knows which
        // are connected (a QP may have gone to ERR on its own): one batched
        // request suspends those and returns their states.
        // While a migration traces the MRs, the same request takes their
        // last traces: once the QPs are suspended rnicd writes no guest
        // memory, and the engine's last scan needs no round trip of its own.
        let handles = d.qps.handles();
        let with_traces = d.traces_wanted();
        let suspended = {
            let qps: Vec<&verbs::Qp> = handles.iter().filter_map(|h| d.qps.get(*h)).map(|q| &q.qp).collect();
            if with_traces {
                let mrs: Vec<&verbs::Mr> = d.mrs.iter().map(|(_, m)| &m.mr).collect();
                d.be.ctx.suspend_and_fetch_traces(&qps, &mrs).map(|(states, traces)| (states, Some(traces)))
            } else {
                d.be.ctx.suspend_connected_states(&qps).map(|states| (states, None))
            }
        };
        let traces = match suspended {
            Ok((states, traces)) => {
                self.paused_states = states.into_iter().map(|s| (s.qpn, s)).collect();
                traces
            }
            Err(e) => {
                tracing::warn!("pvrdma {}: suspending QPs: {e:#}", d.name);
                self.paused_states = HashMap::new();
                None
            }
        };
        let live = handles.into_iter().filter(|h| d.qps.get(*h).is_some_and(|q| self.paused_states.contains_key(&q.qp.qpn))).collect();
        d.suspended = live;
        let phase = if let Some(traces) = traces {
            d.keep_last_traces(traces);
            "suspend QPs and fetch traces"
        } else {
            "suspend QPs"
        };
        d.switch.record(phase, t);
        let t = Instant::now();
        for h in d.cqs.handles() {
            while d.drain_cq(h) > 0 {}
            d.pull_cq(h);
        }
        d.switch.record("drain CQs", t);
        d.paused = true;
    }

    /// Claims the GID on this host unless it holds it already (a VM that
    /// starts, is restored, or arrives by migration: the source released
    /// it as its state left; a source whose migration failed takes it back),
    /// then resumes the QPs (also after a restore, where
    /// they were created suspended) and serves doorbells again. A claim and
    /// a resume go to rnicd as one request: inside a migration's downtime
    /// each request is a round trip that may wait for a CPU.
    fn resume(&mut self) {
        self.cq_waiter.clear_interrupt();
        let mut d = lock(&self.shared);
        let claim = !d.claimed;
        // A guest that turned bus mastering off keeps the device quiesced
        // until it turns it on again.
        let wake = d.paused && d.bus_master;
        if !claim && !wake {
            return;
        }
        let t = Instant::now();
        let suspended = if wake { std::mem::take(&mut d.suspended) } else { Vec::new() };
        let (claimed, resumed) = {
            let qps: Vec<&verbs::Qp> = suspended.iter().filter_map(|h| d.qps.get(*h)).map(|q| &q.qp).collect();
            match (claim, wake) {
                // A failed claim resumed nothing: the QPs resume anyway
                // (the peers then time out, which is what an operator sees).
                (true, true) => match d.be.ctx.claim_gid_and_resume_qps(&qps) {
                    Ok(()) => (Ok(()), Ok(())),
                    Err(e) => (Err(e), d.be.ctx.resume_qps(&qps)),
                },
                (true, false) => (d.be.ctx.claim_gid(), Ok(())),
                _ => (Ok(()), d.be.ctx.resume_qps(&qps)),
            }
        };
        if let Err(e) = claimed {
            tracing::warn!("pvrdma {}: claiming GID {} on this host (and resuming its QPs): {e:#}", d.name, d.gid);
        }
        if let Err(e) = resumed {
            tracing::warn!("pvrdma {}: resuming QPs: {e:#}", d.name);
        }
        d.claimed = true;
        let phase = match (claim, wake) {
            (true, true) => "claim GID and resume QPs",
            (true, false) => "claim GID",
            _ => "resume QPs",
        };
        d.switch.record(phase, t);
        if !wake {
            return;
        }
        self.paused_states.clear();
        let t = Instant::now();
        d.paused = false;
        d.last_traces_taken = false;
        for h in d.cqs.handles() {
            d.drain_and_notify(h);
        }
        // Completions taken while paused left SRQ limits and ring WQEs
        // unchecked.
        for h in d.srqs.handles() {
            d.srq_catch_up(h);
        }
        d.switch.record("drain CQs after resume", t);
        // Vectors raised before a save are sent on the destination.
        d.send_pending();
    }
}

impl Drop for Pvrdma {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.notifier.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}
