//! The controller core: registers, doorbells, queue processing, completion
//! posting and asynchronous events. Everything here runs under one lock
//! (the vCPU thread on MMIO, or the completion worker).

use super::backend::Storage;
use super::config::{NamespaceSpec, NvmeConfig};
use super::dma::{self, Seg};
use super::jobs::{self, WriteJobs};
use super::queues::{Cq, Sq};
use super::spec::*;
use super::uring::{Uring, STOP_TAG, WAKE_TAG};
use crate::GuestMemory;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::{fence, Ordering};
use std::sync::{Arc, Condvar};

/// Outstanding Asynchronous Event Requests (0's based in Identify).
pub const AER_LIMIT: usize = 4;
pub const ERROR_LOG_ENTRIES: usize = 64;
/// Largest transfer: 2^MDTS pages of 4 KiB.
pub const MDTS: u8 = 7;
pub const MAX_TRANSFER: usize = (PAGE_SIZE as usize) << MDTS;
/// Composite temperature the device reports, in kelvin.
pub const TEMPERATURE_K: u16 = 313;
/// Requests in flight on the io_uring at once.
pub const URING_DEPTH: u32 = 4096;

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct Regs {
    pub cc: u32,
    pub csts: u32,
    pub aqa: u32,
    pub asq: u64,
    pub acq: u64,
    pub intms: u32,
}

/// A field missing from a saved state takes its power-on value (the queue
/// counts `nsqa`/`ncqa` are in every save, so the one-queue default never
/// applies to them).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(default = "Features::power_on")]
pub struct Features {
    pub arbitration: u32,
    pub power_mgmt: u32,
    /// Over / under temperature thresholds per sensor (0 = composite).
    pub temp_over: [u16; 9],
    pub temp_under: [u16; 9],
    pub error_recovery: u32,
    pub vwc: bool,
    /// Allocated I/O queues, 0's based.
    pub nsqa: u16,
    pub ncqa: u16,
    pub irq_coalescing: u32,
    pub irq_config: BTreeMap<u16, u32>,
    pub write_atomicity: u32,
    pub async_event_config: u32,
    pub sw_progress: u32,
}

impl Features {
    fn power_on() -> Features {
        Features::defaults(1)
    }

    pub fn defaults(queues: u16) -> Features {
        Features {
            arbitration: 0,
            power_mgmt: 0,
            temp_over: [343; 9],
            temp_under: [0; 9],
            error_recovery: 0,
            vwc: true,
            nsqa: queues - 1,
            ncqa: queues - 1,
            irq_coalescing: 0,
            irq_config: BTreeMap::new(),
            write_atomicity: 0,
            async_event_config: 0,
            sw_progress: 0,
        }
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct Aer {
    /// CIDs of Asynchronous Event Requests waiting for an event.
    pub outstanding: Vec<u16>,
    /// Events not yet reported (completion dword 0).
    pub pending: VecDeque<u32>,
    /// Event types reported and not yet cleared by reading their log page.
    pub masked: u8,
}

#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct ErrorEntry {
    pub count: u64,
    pub sqid: u16,
    pub cid: u16,
    pub status: u16,
    pub nsid: u32,
    pub lba: u64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct Counters {
    pub commands: u64,
    pub admin_commands: u64,
    pub errors: u64,
    pub reads: u64,
    pub writes: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub flushes: u64,
    pub async_events: u64,
    pub doorbell_errors: u64,
    pub fatal: u64,
    pub unsafe_shutdowns: u64,
    pub power_cycles: u64,
}

pub struct Namespace {
    pub spec: NamespaceSpec,
    pub storage: Storage,
    pub bytes: u64,
    pub blocks: u64,
    pub uuid: [u8; 16],
}

/// A file read or write submitted to io_uring.
pub struct Inflight {
    pub sqid: u16,
    pub cqid: u16,
    pub cid: u16,
    pub nsid: u32,
    /// The namespace's file (it stays open while requests are in flight:
    /// detaching drains first).
    pub fd: i32,
    pub write: bool,
    pub off: u64,
    pub len: usize,
    pub dsync: bool,
    pub segs: Vec<Seg>,
    pub iov: Vec<libc::iovec>,
}

// iovecs point into guest RAM (see Seg).
unsafe impl Send for Inflight {}

pub enum Outcome {
    Done(Status, u32),
    /// Submitted to io_uring; completes from the reaper.
    Async,
    /// An AER: completes when an event arrives.
    Held,
}

pub struct Ctrl {
    pub cfg: NvmeConfig,
    pub mem: GuestMemory,
    pub regs: Regs,
    pub sqs: Vec<Option<Sq>>,
    pub cqs: Vec<Option<Cq>>,
    /// SQs that stopped fetching for lack of CQ room or io_uring slots.
    pub blocked: BTreeSet<u16>,
    pub namespaces: BTreeMap<u32, Namespace>,
    pub features: Features,
    pub aer: Aer,
    pub changed_ns: BTreeSet<u32>,
    pub error_log: VecDeque<ErrorEntry>,
    pub error_count: u64,
    pub counters: Counters,
    pub uring: Option<Arc<Uring>>,
    pub inflight: Vec<Option<Inflight>>,
    pub free_slots: Vec<u32>,
    pub inflight_count: u32,
    pub paused: bool,
    pub stop: bool,
    pub scratch: Vec<Seg>,
    /// Buffers of finished file requests, reused by the next ones.
    pub spare: Vec<(Vec<Seg>, Vec<libc::iovec>)>,
    /// Wakes the completion worker when requests stay in flight after the
    /// inline reap (it sleeps otherwise, so page-cache hits cost no wakeup).
    pub worker_cv: Arc<Condvar>,
    pub worker_idle: bool,
    /// The worker must be woken once the lock is released.
    pub wake_pending: bool,
    /// The worker waits on the ring (a queued write job wakes it with a no-op).
    pub worker_on_ring: bool,
    /// Buffered writes for the worker to do itself (see jobs.rs).
    pub jobs: WriteJobs,
    /// Reused list of (tag, result) taken from the ring.
    pub reaped: Vec<(u64, i32)>,
}

// `spare` holds only empty vectors of raw pointers into guest RAM.
unsafe impl Send for Ctrl {}

impl Ctrl {
    pub fn new(cfg: NvmeConfig, mem: GuestMemory) -> Ctrl {
        let n = cfg.queues as usize + 1;
        let features = Features::defaults(cfg.queues);
        Ctrl {
            cfg,
            mem,
            regs: Regs::default(),
            sqs: vec![None; n],
            cqs: vec![None; n],
            blocked: BTreeSet::new(),
            namespaces: BTreeMap::new(),
            features,
            aer: Aer::default(),
            changed_ns: BTreeSet::new(),
            error_log: VecDeque::new(),
            error_count: 0,
            counters: Counters { power_cycles: 1, ..Default::default() },
            uring: None,
            inflight: Vec::new(),
            free_slots: Vec::new(),
            inflight_count: 0,
            paused: false,
            stop: false,
            scratch: Vec::with_capacity(256),
            spare: Vec::new(),
            worker_cv: Arc::new(Condvar::new()),
            worker_idle: false,
            wake_pending: false,
            worker_on_ring: false,
            jobs: WriteJobs::default(),
            reaped: Vec::new(),
        }
    }

    pub fn cap(&self) -> u64 {
        let mqes = (self.cfg.depth - 1).min(0xffff) as u64;
        let cqr = 1u64 << 16; // queues must be physically contiguous
        let timeout = 20u64 << 24; // 10 s in 500 ms units
        let css_nvm = 1u64 << 37;
        mqes | cqr | timeout | css_nvm // DSTRD = 0, MPSMIN = MPSMAX = 4 KiB
    }

    pub fn ready(&self) -> bool {
        self.regs.csts & CSTS_RDY != 0 && self.regs.csts & CSTS_CFS == 0
    }

    // ---- registers -------------------------------------------------------

    pub fn read_reg(&self, off: u64, data: &mut [u8]) {
        let mut img = [0u8; 0x38];
        img[0..8].copy_from_slice(&self.cap().to_le_bytes());
        img[8..12].copy_from_slice(&VERSION_1_4.to_le_bytes());
        img[0x0c..0x10].copy_from_slice(&self.regs.intms.to_le_bytes());
        img[0x10..0x14].copy_from_slice(&self.regs.intms.to_le_bytes());
        img[0x14..0x18].copy_from_slice(&self.regs.cc.to_le_bytes());
        img[0x1c..0x20].copy_from_slice(&self.regs.csts.to_le_bytes());
        img[0x24..0x28].copy_from_slice(&self.regs.aqa.to_le_bytes());
        img[0x28..0x30].copy_from_slice(&self.regs.asq.to_le_bytes());
        img[0x30..0x38].copy_from_slice(&self.regs.acq.to_le_bytes());
        for (i, d) in data.iter_mut().enumerate() {
            *d = img.get(off as usize + i).copied().unwrap_or(0);
        }
    }

    pub fn write_reg(&mut self, off: u64, data: &[u8]) {
        let v = match data.len() {
            4 => u32::from_le_bytes(data.try_into().unwrap()) as u64,
            8 => u64::from_le_bytes(data.try_into().unwrap()),
            _ => return, // registers take dword or qword accesses only
        };
        let enabled = self.regs.cc & CC_EN != 0;
        match (off, data.len()) {
            (REG_INTMS, 4) => self.regs.intms |= v as u32,
            (REG_INTMC, 4) => self.regs.intms &= !(v as u32),
            (REG_CC, 4) => self.write_cc(v as u32),
            (REG_NSSR, 4) => {} // NVM subsystem reset not supported (CAP.NSSRS = 0)
            (REG_AQA, 4) if !enabled => self.regs.aqa = v as u32 & 0x0fff_0fff,
            (REG_ASQ, 8) if !enabled => self.regs.asq = v & !0xfff,
            (REG_ASQ, 4) if !enabled => self.regs.asq = (self.regs.asq & !0xffff_ffff) | (v & 0xffff_f000),
            (0x2c, 4) if !enabled => self.regs.asq = (self.regs.asq & 0xffff_ffff) | v << 32,
            (REG_ACQ, 8) if !enabled => self.regs.acq = v & !0xfff,
            (REG_ACQ, 4) if !enabled => self.regs.acq = (self.regs.acq & !0xffff_ffff) | (v & 0xffff_f000),
            (0x34, 4) if !enabled => self.regs.acq = (self.regs.acq & 0xffff_ffff) | v << 32,
            _ => {}
        }
    }

    fn write_cc(&mut self, new: u32) {
        let old = self.regs.cc;
        let was_en = old & CC_EN != 0;
        let en = new & CC_EN != 0;
        // Shutdown notification: finish and flush, then report complete.
        let shn = (new >> 14) & 0x3;
        if was_en && !en {
            self.regs.cc = new;
            self.reset();
            return;
        }
        if was_en && en {
            // While enabled only SHN may change; anything else is a host bug.
            if (old ^ new) & !(0x3 << 14) != 0 {
                self.fatal("CC changed while enabled");
                return;
            }
            self.regs.cc = new;
            if shn != 0 {
                self.shutdown();
            } else {
                self.regs.csts &= !CSTS_SHST_MASK;
            }
            return;
        }
        self.regs.cc = new;
        if !was_en && en {
            self.enable();
        } else if shn == 0 {
            self.regs.csts &= !CSTS_SHST_MASK;
        }
    }

    fn enable(&mut self) {
        let cc = self.regs.cc;
        let css = (cc >> 4) & 0x7;
        let mps = (cc >> 7) & 0xf;
        let ams = (cc >> 11) & 0x7;
        let asqs = (self.regs.aqa & 0xfff) + 1;
        let acqs = ((self.regs.aqa >> 16) & 0xfff) + 1;
        let why = if css != 0 {
            Some("CC.CSS selects an unsupported command set")
        } else if mps != 0 {
            Some("CC.MPS is outside CAP.MPSMIN..MPSMAX")
        } else if ams != 0 {
            Some("CC.AMS selects an unsupported arbitration")
        } else if asqs < 2 || acqs < 2 {
            Some("AQA sizes the admin queues below two entries")
        } else if self.regs.asq == 0 || self.regs.acq == 0 {
            Some("ASQ/ACQ not set")
        } else if dma::host_range(&self.mem, self.regs.asq, asqs as usize * 64).is_none()
            || dma::host_range(&self.mem, self.regs.acq, acqs as usize * 16).is_none()
        {
            Some("admin queues lie outside guest RAM")
        } else if self.regs.csts & CSTS_CFS != 0 {
            Some("enable after a fatal status without a reset")
        } else {
            None
        };
        if let Some(why) = why {
            self.fatal(why);
            return;
        }
        self.sqs[0] = Some(Sq { qid: 0, cqid: 0, base: self.regs.asq, size: asqs, head: 0, tail: 0, prio: 0 });
        self.cqs[0] = Some(Cq::new(0, self.regs.acq, acqs, true, 0));
        self.regs.csts = (self.regs.csts & !CSTS_SHST_MASK) | CSTS_RDY;
    }

    /// Controller fatal status: the controller stops until the host resets it.
    pub fn fatal(&mut self, why: &str) {
        tracing::warn!(ctrl = %self.cfg.name, "nvme controller fatal status: {why}");
        self.counters.fatal += 1;
        self.regs.csts |= CSTS_CFS;
    }

    /// Controller reset (CC.EN 1 -> 0): in-flight I/O finishes, queues and
    /// outstanding commands go, features return to defaults.
    pub fn reset(&mut self) {
        self.drain();
        for q in self.sqs.iter_mut() {
            *q = None;
        }
        for q in self.cqs.iter_mut() {
            *q = None;
        }
        self.blocked.clear();
        self.aer = Aer::default();
        self.features = Features::defaults(self.cfg.queues);
        self.regs.csts &= !(CSTS_RDY | CSTS_CFS);
        if self.regs.cc & (0x3 << 14) == 0 {
            self.regs.csts &= !CSTS_SHST_MASK;
        }
    }

    fn shutdown(&mut self) {
        self.drain();
        for ns in self.namespaces.values() {
            if let Err(e) = ns.storage.flush() {
                tracing::warn!("nvme shutdown flush: {e}");
            }
        }
        self.regs.csts = (self.regs.csts & !CSTS_SHST_MASK) | CSTS_SHST_COMPLETE;
    }

    // ---- doorbells -------------------------------------------------------

    pub fn doorbell(&mut self, off: u64, data: &[u8]) {
        if data.len() != 4 || off % 4 != 0 || !self.ready() || self.regs.csts & CSTS_SHST_MASK != 0 {
            return;
        }
        let value = u32::from_le_bytes(data.try_into().unwrap());
        let idx = (off - DOORBELL_BASE) / 4;
        let qid = idx / 2;
        let is_cq = idx % 2 == 1;
        if qid >= self.sqs.len() as u64 {
            return self.doorbell_error(AER_INFO_INVALID_DB_REGISTER);
        }
        let qid = qid as u16;
        if is_cq {
            let Some(cq) = self.cqs[qid as usize].as_mut() else {
                return self.doorbell_error(AER_INFO_INVALID_DB_REGISTER);
            };
            if !cq.head_valid(value) {
                return self.doorbell_error(AER_INFO_INVALID_DB_VALUE);
            }
            cq.head = value;
            if !self.blocked.is_empty() && !self.paused {
                let waiting: Vec<u16> = self.blocked.iter().copied().collect();
                for sqid in waiting {
                    if self.sqs[sqid as usize].as_ref().map(|s| s.cqid) == Some(qid) {
                        self.blocked.remove(&sqid);
                        self.process_sq(sqid);
                    }
                }
                self.submit_uring();
            }
        } else {
            let Some(sq) = self.sqs[qid as usize].as_mut() else {
                return self.doorbell_error(AER_INFO_INVALID_DB_REGISTER);
            };
            if value >= sq.size {
                return self.doorbell_error(AER_INFO_INVALID_DB_VALUE);
            }
            sq.tail = value;
            if !self.paused {
                self.process_sq(qid);
                self.submit_uring();
            }
        }
    }

    fn doorbell_error(&mut self, info: u8) {
        self.counters.doorbell_errors += 1;
        self.raise_event(AER_TYPE_ERROR, info, LOG_ERROR);
    }

    // ---- fetching and completing ------------------------------------------

    /// Fetch and run commands of one SQ while its CQ has room.
    pub fn process_sq(&mut self, sqid: u16) {
        loop {
            let Some(sq) = self.sqs.get(sqid as usize).and_then(|s| s.as_ref()) else { return };
            if !sq.pending() {
                return;
            }
            let cqid = sq.cqid;
            let (base, head, size) = (sq.base, sq.head, sq.size);
            let Some(cq) = self.cqs[cqid as usize].as_mut() else { return };
            if !cq.has_room() || (sqid != 0 && self.inflight_count >= URING_DEPTH) {
                self.blocked.insert(sqid);
                return;
            }
            let mut raw = [0u8; 64];
            if !dma::read_guest(&self.mem, base + head as u64 * SQE_SIZE, &mut raw) {
                // The queue was checked at creation; RAM cannot shrink.
                self.fatal("submission queue outside guest RAM");
                return;
            }
            cq.reserved += 1;
            let sq = self.sqs[sqid as usize].as_mut().unwrap();
            sq.head = if head + 1 == size { 0 } else { head + 1 };
            let cmd = Command::parse(&raw);
            self.counters.commands += 1;
            let outcome = if sqid == 0 {
                self.counters.admin_commands += 1;
                self.admin(&cmd)
            } else {
                self.io(sqid, cqid, &cmd)
            };
            match outcome {
                Outcome::Done(status, dw0) => self.complete(sqid, cqid, cmd.cid, status, dw0, cmd.nsid),
                Outcome::Async | Outcome::Held => {}
            }
            if self.regs.csts & CSTS_CFS != 0 {
                return;
            }
        }
    }

    /// Post the completion of a fetched command (its CQ slot is reserved).
    pub fn complete(&mut self, sqid: u16, cqid: u16, cid: u16, status: Status, dw0: u32, nsid: u32) {
        if !status.is_success() {
            self.counters.errors += 1;
            self.log_error(sqid, cid, status, nsid);
        }
        let sq_head = self.sqs.get(sqid as usize).and_then(|s| s.as_ref()).map(|s| s.head).unwrap_or(0) as u16;
        let c = Completion { dw0, dw1: 0, sq_head, sq_id: sqid, cid, status };
        self.post(cqid, c);
    }

    fn post(&mut self, cqid: u16, c: Completion) {
        let Some(cq) = self.cqs.get_mut(cqid as usize).and_then(|c| c.as_mut()) else { return };
        cq.reserved = cq.reserved.saturating_sub(1);
        let addr = cq.base + cq.tail as u64 * CQE_SIZE;
        let bytes = c.encode(cq.phase);
        let Some(p) = dma::host_range(&self.mem, addr, 16) else { return };
        // SAFETY: checked range. Dwords 0-2 first, then dword 3 with the
        // phase tag, so a polling host never sees a half-written entry.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), p, 12);
            fence(Ordering::Release);
            std::ptr::write_volatile(p.add(12) as *mut u32, u32::from_le_bytes(bytes[12..16].try_into().unwrap()));
        }
        cq.advance_tail();
    }

    fn log_error(&mut self, sqid: u16, cid: u16, status: Status, nsid: u32) {
        self.error_count += 1;
        if self.error_log.len() == ERROR_LOG_ENTRIES {
            self.error_log.pop_back();
        }
        self.error_log.push_front(ErrorEntry { count: self.error_count, sqid, cid, status: status.field() << 1, nsid, lba: 0 });
    }

    // ---- asynchronous events ---------------------------------------------

    pub fn raise_event(&mut self, ty: u8, info: u8, log: u8) {
        let dw0 = ty as u32 | (info as u32) << 8 | (log as u32) << 16;
        if self.aer.masked & (1 << ty) != 0 || self.aer.pending.contains(&dw0) {
            return;
        }
        self.aer.pending.push_back(dw0);
        self.deliver_events();
    }

    pub fn deliver_events(&mut self) {
        // A paused device does not write guest memory; resume delivers.
        while !self.paused && !self.aer.outstanding.is_empty() {
            let Some(pos) = self.aer.pending.iter().position(|e| self.aer.masked & (1 << (e & 0x7)) == 0) else { return };
            let dw0 = self.aer.pending.remove(pos).unwrap();
            let cid = self.aer.outstanding.remove(0);
            self.aer.masked |= 1 << (dw0 & 0x7);
            self.counters.async_events += 1;
            self.complete(0, 0, cid, Status::SUCCESS, dw0, 0);
        }
    }

    /// Reading a log page (without Retain Asynchronous Event) re-arms the
    /// event types that point at it.
    pub fn log_read(&mut self, lid: u8) {
        let ty = match lid {
            LOG_ERROR => AER_TYPE_ERROR,
            LOG_SMART => AER_TYPE_SMART,
            LOG_CHANGED_NS => AER_TYPE_NOTICE,
            _ => return,
        };
        self.aer.masked &= !(1 << ty);
        self.aer.pending.retain(|e| !(e & 0x7 == ty as u32 && (e >> 16) & 0xff == lid as u32));
        self.deliver_events();
    }

    pub fn namespace_changed(&mut self, nsid: u32) {
        self.changed_ns.insert(nsid);
        if self.features.async_event_config & (1 << 8) != 0 && self.ready() {
            self.raise_event(AER_TYPE_NOTICE, AER_INFO_NS_ATTR_CHANGED, LOG_CHANGED_NS);
        }
    }

    pub fn critical_warning(&self) -> u8 {
        let over = self.features.temp_over[0];
        let under = self.features.temp_under[0];
        if TEMPERATURE_K >= over || TEMPERATURE_K < under {
            0x02
        } else {
            0
        }
    }

    // ---- io_uring ---------------------------------------------------------

    /// Hand queued file requests to the kernel. Page-cache hits finish
    /// inside the submit call, so reap right away: their completions are
    /// posted on this thread without waking the worker.
    pub fn submit_uring(&mut self) {
        if self.inflight_count > 0 {
            if let Some(u) = &self.uring {
                // Write jobs alone leave nothing to submit: no syscall.
                if u.has_unsubmitted() {
                    if let Err(e) = u.submit() {
                        tracing::warn!("io_uring submit: {e}");
                    }
                }
                self.reap();
                self.wake_worker_if_idle();
            }
        }
    }

    /// Ask for the completion worker when requests stay in flight and it
    /// sleeps. The wakeup itself happens when the lock is released (see
    /// `Locked`), so the woken worker does not run straight into the lock
    /// this thread still holds.
    fn wake_worker_if_idle(&mut self) {
        if self.inflight_count > 0 && self.worker_idle {
            self.worker_idle = false;
            self.wake_pending = true;
        }
    }

    /// Take finished file requests and post their completions; returns
    /// how many there were.
    pub fn reap(&mut self) -> usize {
        let Some(u) = &self.uring else { return 0 };
        let mut done = std::mem::take(&mut self.reaped);
        u.reap(|tag, res| done.push((tag, res)));
        let mut n = 0;
        for &(tag, res) in &done {
            match tag {
                STOP_TAG => self.stop = true,
                WAKE_TAG => {}
                _ => {
                    self.finish_inflight(tag as u32, res);
                    n += 1;
                }
            }
        }
        done.clear();
        self.reaped = done;
        if !self.blocked.is_empty() && !self.paused && self.inflight_count < URING_DEPTH {
            let waiting: Vec<u16> = std::mem::take(&mut self.blocked).into_iter().collect();
            for sqid in waiting {
                self.process_sq(sqid);
            }
            // The worker (or the next doorbell) reaps these.
            if let Some(u) = &self.uring {
                let _ = u.submit();
            }
            self.wake_worker_if_idle();
        }
        n
    }

    /// Wait until no file request is in flight (pause, reset, delete queue).
    pub fn drain(&mut self) {
        while self.inflight_count > 0 {
            self.submit_uring();
            self.reap();
            // Write jobs the worker has not taken yet: do them here.
            while let Some(slot) = self.jobs.queue.pop_front() {
                let res = self.write_job(slot);
                self.finish_inflight(slot, res);
            }
            if self.jobs.running.is_some() {
                // The worker writes without the lock and cannot post while
                // this thread holds it: take its result when it is there.
                match self.jobs.take_finished() {
                    Some((slot, res)) => self.finish_inflight(slot, res),
                    None => std::thread::sleep(std::time::Duration::from_micros(20)),
                }
                continue;
            }
            if self.inflight_count > 0 {
                if let Some(u) = &self.uring {
                    u.wait();
                }
            }
        }
    }

    /// Hand a buffered write (already in its in-flight slot) to the worker.
    pub fn queue_write_job(&mut self, slot: u32) {
        self.jobs.queue.push_back(slot);
        if self.worker_idle {
            self.worker_idle = false;
            self.wake_pending = true;
        } else if self.worker_on_ring {
            self.worker_on_ring = false;
            if let Some(u) = &self.uring {
                u.push_wake();
            }
        }
        // Otherwise the worker is busy and looks at the queue before it sleeps.
    }

    /// Do the write of in-flight `slot` on this thread; bytes or -errno.
    pub fn write_job(&self, slot: u32) -> i32 {
        let Some(op) = self.inflight.get(slot as usize).and_then(|s| s.as_ref()) else { return -libc::EINVAL };
        // SAFETY: the iovecs live in the slot and point into guest RAM
        // checked by map_prps; the slot stays until finish_inflight.
        unsafe { jobs::pwritev(op.fd, op.iov.as_ptr(), op.iov.len(), op.off, op.dsync) }
    }

    pub fn alloc_slot(&mut self) -> u32 {
        if let Some(s) = self.free_slots.pop() {
            return s;
        }
        self.inflight.push(None);
        (self.inflight.len() - 1) as u32
    }

    pub fn finish_inflight(&mut self, slot: u32, res: i32) {
        let Some(mut op) = self.inflight.get_mut(slot as usize).and_then(|s| s.take()) else { return };
        self.inflight_count -= 1;
        let mut status = Status::SUCCESS;
        if res < 0 {
            tracing::warn!("nvme file {} failed: {}", if op.write { "write" } else { "read" }, std::io::Error::from_raw_os_error(-res));
            status = Status::INTERNAL_ERROR;
        } else if (res as usize) < op.len {
            // Short transfer: finish the rest synchronously.
            status = self.finish_short(&op, res as usize);
        }
        if status.is_success() {
            if op.write {
                self.counters.bytes_written += op.len as u64;
            } else {
                self.counters.bytes_read += op.len as u64;
            }
        }
        self.complete(op.sqid, op.cqid, op.cid, status, 0, op.nsid);
        // Keep the buffers for the next request on this slot.
        op.segs.clear();
        op.iov.clear();
        self.spare.push((std::mem::take(&mut op.segs), std::mem::take(&mut op.iov)));
        self.free_slots.push(slot);
    }

    fn finish_short(&mut self, op: &Inflight, done: usize) -> Status {
        let mut skip = done;
        let mut rest = Vec::new();
        for s in &op.segs {
            if skip >= s.len {
                skip -= s.len;
                continue;
            }
            rest.push(Seg { ptr: s.ptr.wrapping_add(skip), len: s.len - skip });
            skip = 0;
        }
        let Some(ns) = self.namespaces.get_mut(&op.nsid) else { return Status::INTERNAL_ERROR };
        let off = op.off + done as u64;
        let r = if op.write { ns.storage.write_from(off, &rest, op.dsync) } else { ns.storage.read_into(off, &rest) };
        match r {
            Ok(()) => Status::SUCCESS,
            Err(_) => Status::INTERNAL_ERROR,
        }
    }
}
