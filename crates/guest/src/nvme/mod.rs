//! A polled NVMe driver: no interrupts, no allocator. Queues and buffers
//! come from a bump region of guest RAM above the firmware.

pub mod check;
pub mod perf;
pub mod verify;

use crate::hw::{mmio_read32, mmio_read64, mmio_write32, mmio_write64};
use core::ptr::{read_volatile, write_volatile};
use core::sync::atomic::{fence, Ordering};

pub const PAGE: u64 = 4096;
pub const MAX_QUEUES: usize = 16;

const CAP: u64 = 0x00;
const CC: u64 = 0x14;
const CSTS: u64 = 0x1c;
const AQA: u64 = 0x24;
const ASQ: u64 = 0x28;
const ACQ: u64 = 0x30;

pub const OP_FLUSH: u8 = 0x00;
pub const OP_WRITE: u8 = 0x01;
pub const OP_READ: u8 = 0x02;

/// Guest RAM handed out in page-aligned pieces.
pub struct Region {
    pub next: u64,
    pub end: u64,
}

impl Region {
    pub fn alloc(&mut self, bytes: u64) -> Option<u64> {
        let a = (self.next + PAGE - 1) & !(PAGE - 1);
        let end = a.checked_add(bytes)?;
        if end > self.end {
            return None;
        }
        self.next = end;
        // SAFETY: identity-mapped guest RAM that nothing else uses.
        unsafe { core::ptr::write_bytes(a as *mut u8, 0, bytes as usize) };
        Some(a)
    }
}

#[derive(Clone, Copy, Default)]
pub struct Sqe {
    pub opcode: u8,
    /// Byte 1 of dword 0: FUSE (bits 1:0) and PSDT (bits 7:6).
    pub flags: u8,
    pub cid: u16,
    pub nsid: u32,
    pub prp1: u64,
    pub prp2: u64,
    pub cdw10: u32,
    pub cdw11: u32,
    pub cdw12: u32,
}

#[derive(Clone, Copy, Default)]
pub struct Cqe {
    pub dw0: u32,
    pub sq_head: u16,
    pub cid: u16,
    /// Status field (SCT << 8 | SC), 0 = success.
    pub status: u16,
}

#[derive(Clone, Copy, Default)]
pub struct Queue {
    pub qid: u16,
    pub sq: u64,
    pub cq: u64,
    pub size: u32,
    pub sq_tail: u32,
    pub cq_head: u32,
    pub phase: bool,
}

pub struct Nvme {
    pub bar: u64,
    pub stride: u64,
    pub admin: Queue,
    pub io: [Queue; MAX_QUEUES],
    pub nio: usize,
    pub max_entries: u32,
    pub nsid: u32,
    pub ns_blocks: u64,
    pub block: u32,
    pub max_transfer: u32,
    pub scratch: u64,
    next_cid: u16,
    /// CID of the outstanding Asynchronous Event Request, if any.
    aer_cid: Option<u16>,
    /// Dword 0 of an event that arrived while waiting for something else.
    event: Option<u32>,
}

impl Nvme {
    /// Find the controller on PCI, reset it, bring up the admin queue and
    /// identify it and namespace `nsid`.
    pub fn init(region: &mut Region, nsid: u32) -> Result<Nvme, &'static str> {
        let dev = crate::pci::find(0x01, 0x08, 0x02).ok_or("no NVMe controller on PCI bus 0")?;
        crate::pci::enable_bus_master(dev);
        let bar = crate::pci::bar64(dev, 0x10);
        if bar == 0 {
            return Err("NVMe BAR0 not assigned");
        }
        let cap = mmio_read64(bar + CAP);
        let max_entries = ((cap & 0xffff) + 1) as u32;
        let stride = 4u64 << ((cap >> 32) & 0xf);
        // Reset, then wait for RDY = 0.
        mmio_write32(bar + CC, 0);
        let mut spins = 0u64;
        while mmio_read32(bar + CSTS) & 1 != 0 {
            spins += 1;
            if spins > 10_000_000 {
                return Err("controller does not leave ready after reset");
            }
        }
        let entries = 32u32;
        let asq = region.alloc(entries as u64 * 64).ok_or("out of memory for the admin SQ")?;
        let acq = region.alloc(entries as u64 * 16).ok_or("out of memory for the admin CQ")?;
        let scratch = region.alloc(PAGE).ok_or("out of memory")?;
        mmio_write32(bar + AQA, (entries - 1) | (entries - 1) << 16);
        mmio_write64(bar + ASQ, asq);
        mmio_write64(bar + ACQ, acq);
        mmio_write32(bar + CC, 1 | 6 << 16 | 4 << 20);
        loop {
            let csts = mmio_read32(bar + CSTS);
            if csts & 2 != 0 {
                return Err("controller fatal status while enabling");
            }
            if csts & 1 != 0 {
                break;
            }
        }
        let mut n = Nvme {
            bar,
            stride,
            admin: Queue { qid: 0, sq: asq, cq: acq, size: entries, sq_tail: 0, cq_head: 0, phase: true },
            io: [Queue::default(); MAX_QUEUES],
            nio: 0,
            max_entries,
            nsid,
            ns_blocks: 0,
            block: 512,
            max_transfer: 4096,
            scratch,
            next_cid: 0,
            aer_cid: None,
            event: None,
        };
        // Identify controller: MDTS and the model.
        n.admin_cmd(Sqe { opcode: 0x06, prp1: scratch, cdw10: 1, ..Default::default() }).map_err(|_| "identify controller failed")?;
        let id = unsafe { core::slice::from_raw_parts(scratch as *const u8, 4096) };
        let mdts = id[77];
        n.max_transfer = if mdts == 0 { 1 << 20 } else { (4096u32 << mdts).min(1 << 20) };
        // Copy the model out: the scratch page is reused below.
        let mut model_buf = [0u8; 40];
        model_buf.copy_from_slice(&id[24..64]);
        let model = core::str::from_utf8(&model_buf).unwrap_or("?").trim_end();
        let nn = u32::from_le_bytes([id[516], id[517], id[518], id[519]]);
        // Identify namespace.
        n.admin_cmd(Sqe { opcode: 0x06, nsid, prp1: scratch, cdw10: 0, ..Default::default() }).map_err(|_| "identify namespace failed")?;
        let ns = unsafe { core::slice::from_raw_parts(scratch as *const u8, 4096) };
        n.ns_blocks = u64::from_le_bytes(ns[0..8].try_into().unwrap());
        let flbas = ns[26] & 0xf;
        let lbaf = u32::from_le_bytes(ns[128 + 4 * flbas as usize..132 + 4 * flbas as usize].try_into().unwrap());
        n.block = 1 << ((lbaf >> 16) & 0xff);
        if n.ns_blocks == 0 {
            return Err("namespace is not active");
        }
        println!(
            "nvme: {} at {:#x}: {} namespaces, ns{} {} blocks of {} bytes, max transfer {} KiB, queues up to {} entries",
            model,
            bar,
            nn,
            nsid,
            n.ns_blocks,
            n.block,
            n.max_transfer >> 10,
            max_entries
        );
        Ok(n)
    }

    fn cid(&mut self) -> u16 {
        self.next_cid = self.next_cid.wrapping_add(1);
        self.next_cid
    }

    /// Ask for `count` I/O queue pairs of `entries`; returns how many exist.
    pub fn create_io_queues(&mut self, region: &mut Region, count: usize, entries: u32) -> Result<usize, &'static str> {
        let count = count.clamp(1, MAX_QUEUES);
        let entries = entries.clamp(2, self.max_entries);
        let want = (count - 1) as u32;
        let c = self
            .admin_cmd(Sqe { opcode: 0x09, cdw10: 0x07, cdw11: want | want << 16, ..Default::default() })
            .map_err(|_| "set number of queues failed")?;
        let got = ((c.dw0 & 0xffff).min(c.dw0 >> 16) + 1) as usize;
        let count = count.min(got);
        for i in 0..count {
            let qid = (i + 1) as u16;
            let cq = region.alloc(entries as u64 * 16).ok_or("out of memory for I/O CQs")?;
            let sq = region.alloc(entries as u64 * 64).ok_or("out of memory for I/O SQs")?;
            self.admin_cmd(Sqe { opcode: 0x05, prp1: cq, cdw10: qid as u32 | (entries - 1) << 16, cdw11: 1, ..Default::default() })
                .map_err(|_| "create I/O CQ failed")?;
            self.admin_cmd(Sqe {
                opcode: 0x01,
                prp1: sq,
                cdw10: qid as u32 | (entries - 1) << 16,
                cdw11: 1 | (qid as u32) << 16,
                ..Default::default()
            })
            .map_err(|_| "create I/O SQ failed")?;
            self.io[i] = Queue { qid, sq, cq, size: entries, sq_tail: 0, cq_head: 0, phase: true };
        }
        self.nio = count;
        Ok(count)
    }

    /// Run one admin command to completion.
    pub fn admin_cmd(&mut self, mut cmd: Sqe) -> Result<Cqe, Cqe> {
        cmd.cid = self.cid();
        let mut q = self.admin;
        self.push(&mut q, &cmd);
        self.ring(&q);
        let mut spins = 0u64;
        let c = loop {
            if let Some(c) = self.poll(&mut q) {
                if c.cid == cmd.cid {
                    break c;
                }
                if Some(c.cid) == self.aer_cid {
                    self.aer_cid = None;
                    self.event = Some(c.dw0);
                }
            }
            spins += 1;
            if spins.is_multiple_of(65536) && self.fatal() {
                // The controller stopped (CSTS.CFS): this command will never complete.
                self.admin = q;
                return Err(Cqe { status: 0xffff, cid: cmd.cid, ..Default::default() });
            }
        };
        self.ack(&q);
        self.admin = q;
        if c.status == 0 {
            Ok(c)
        } else {
            Err(c)
        }
    }

    /// Controller fatal status (CSTS.CFS).
    pub fn fatal(&self) -> bool {
        mmio_read32(self.bar + CSTS) & 2 != 0
    }

    /// Enable namespace-attribute notices and post an Asynchronous Event Request.
    pub fn arm_events(&mut self) {
        let _ = self.admin_cmd(Sqe { opcode: 0x09, cdw10: 0x0b, cdw11: 1 << 8, ..Default::default() });
        self.post_aer();
    }

    fn post_aer(&mut self) {
        let cid = self.cid();
        let mut q = self.admin;
        self.push(&mut q, &Sqe { opcode: 0x0c, cid, ..Default::default() });
        self.ring(&q);
        self.admin = q;
        self.aer_cid = Some(cid);
    }

    /// Check for an asynchronous event; reports namespace changes on the
    /// console (reading the log re-arms the event) and re-posts the request.
    pub fn check_events(&mut self) {
        let mut q = self.admin;
        let mut seen = false;
        while let Some(c) = self.poll(&mut q) {
            seen = true;
            if Some(c.cid) == self.aer_cid {
                self.aer_cid = None;
                self.event = Some(c.dw0);
            }
        }
        if seen {
            self.ack(&q);
        }
        self.admin = q;
        let Some(ev) = self.event.take() else { return };
        let (ty, info, log) = (ev & 7, (ev >> 8) & 0xff, (ev >> 16) & 0xff);
        println!("nvme: async event type={} info={:#x} log={:#x}", ty, info, log);
        if log != 0 {
            let numd = 1024 - 1;
            let r =
                self.admin_cmd(Sqe { opcode: 0x02, nsid: 0xffff_ffff, prp1: self.scratch, cdw10: log | numd << 16, ..Default::default() });
            if ty == 2 && info == 0 && r.is_ok() {
                let ids = unsafe { core::slice::from_raw_parts(self.scratch as *const u32, 1024) };
                let mut n = 0;
                for id in ids.iter().take_while(|&&id| id != 0) {
                    n += 1;
                    println!("nvme: namespace {} changed", id);
                }
                // Which of them are attached now.
                let _ = self.admin_cmd(Sqe { opcode: 0x06, prp1: self.scratch, cdw10: 2, ..Default::default() });
                let active = unsafe { core::slice::from_raw_parts(self.scratch as *const u32, 1024) };
                let count = active.iter().take_while(|&&id| id != 0).count();
                println!("nvme: {} namespaces changed, {} active now", n, count);
            }
        }
        self.post_aer();
    }

    pub fn poll_io(&mut self, q: usize) -> Option<Cqe> {
        let mut qq = self.io[q];
        let c = self.poll(&mut qq);
        self.io[q] = qq;
        c
    }

    pub fn push_io(&mut self, q: usize, cmd: &Sqe) {
        let mut qq = self.io[q];
        self.push(&mut qq, cmd);
        self.io[q] = qq;
    }

    /// Acknowledge consumed completions and ring the SQ tail of I/O queue `q`.
    pub fn kick_io(&self, q: usize) {
        self.ack(&self.io[q]);
        self.ring(&self.io[q]);
    }

    /// Write a submission entry at the queue's tail (no doorbell yet).
    pub fn push(&self, q: &mut Queue, c: &Sqe) {
        let p = (q.sq + q.sq_tail as u64 * 64) as *mut u32;
        let dw = [
            c.opcode as u32 | (c.flags as u32) << 8 | (c.cid as u32) << 16,
            c.nsid,
            0,
            0,
            0,
            0,
            c.prp1 as u32,
            (c.prp1 >> 32) as u32,
            c.prp2 as u32,
            (c.prp2 >> 32) as u32,
            c.cdw10,
            c.cdw11,
            c.cdw12,
            0,
            0,
            0,
        ];
        for (i, v) in dw.iter().enumerate() {
            // SAFETY: the SQ lies in our region.
            unsafe { write_volatile(p.add(i), *v) };
        }
        q.sq_tail = (q.sq_tail + 1) % q.size;
    }

    pub fn ring(&self, q: &Queue) {
        fence(Ordering::SeqCst);
        mmio_write32(self.bar + 0x1000 + (2 * q.qid as u64) * self.stride, q.sq_tail);
    }

    /// Take the next completion if its phase tag says it is new.
    pub fn poll(&self, q: &mut Queue) -> Option<Cqe> {
        let p = (q.cq + q.cq_head as u64 * 16) as *const u32;
        // SAFETY: the CQ lies in our region.
        let dw3 = unsafe { read_volatile(p.add(3)) };
        if (dw3 >> 16) & 1 != q.phase as u32 {
            return None;
        }
        fence(Ordering::Acquire);
        let dw0 = unsafe { read_volatile(p) };
        let dw2 = unsafe { read_volatile(p.add(2)) };
        q.cq_head += 1;
        if q.cq_head == q.size {
            q.cq_head = 0;
            q.phase = !q.phase;
        }
        Some(Cqe { dw0, sq_head: dw2 as u16, cid: dw3 as u16, status: ((dw3 >> 17) & 0x7ff) as u16 })
    }

    /// Tell the controller how far the CQ was consumed.
    pub fn ack(&self, q: &Queue) {
        mmio_write32(self.bar + 0x1000 + (2 * q.qid as u64 + 1) * self.stride, q.cq_head);
    }

    /// A read or write of `bytes` at `lba` to/from `buf`; `list` is a page
    /// for the PRP list when the buffer spans more than two pages.
    pub fn rw(&self, write: bool, cid: u16, lba: u64, buf: u64, bytes: u32, list: u64) -> Sqe {
        let pages = (bytes as u64).div_ceil(PAGE);
        let prp2 = if pages <= 1 {
            0
        } else if pages == 2 {
            buf + PAGE
        } else {
            for i in 1..pages {
                // SAFETY: the list page lies in our region.
                unsafe { write_volatile((list as *mut u64).add(i as usize - 1), buf + i * PAGE) };
            }
            list
        };
        let nlb = bytes / self.block;
        Sqe {
            opcode: if write { OP_WRITE } else { OP_READ },
            cid,
            nsid: self.nsid,
            prp1: buf,
            prp2,
            cdw10: lba as u32,
            cdw11: (lba >> 32) as u32,
            cdw12: nlb - 1,
            flags: 0,
        }
    }
}

/// xorshift64*
pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// The region the driver may use: `nvme_mem=START[-END]`-style words
/// `nvme_mem=` (start) and `nvme_mem_end=`, else from the firmware end to RAM end.
pub fn region(args: &crate::args::Args, boot: &crate::boot::BootInfo) -> Region {
    let start = args.num("nvme_mem", boot.firmware_end).max(boot.firmware_end);
    let end = args.num("nvme_mem_end", boot.ram_size).min(boot.ram_size);
    Region { next: start, end }
}
