//! A host-side NVMe driver that talks to the controller through the bus
//! interface and real guest memory, with no vCPU: used by the device tests
//! and by bench/nvme to measure the device alone.

use super::spec::*;
use super::NvmeController;
use crate::bus::BusDevice;
use crate::GuestMemory;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use vm_memory::{Bytes, GuestAddress};

pub struct QueuePair {
    pub qid: u16,
    pub sq_base: u64,
    pub cq_base: u64,
    pub size: u32,
    pub sq_tail: u32,
    pub cq_head: u32,
    pub phase: bool,
}

pub struct HostDriver {
    pub dev: Arc<Mutex<NvmeController>>,
    pub mem: GuestMemory,
    pub admin: QueuePair,
    pub io: Vec<QueuePair>,
    next_free: u64,
    mem_end: u64,
    next_cid: u16,
    /// Completions taken while waiting for another command, per queue.
    stash: Vec<(usize, Completion)>,
    /// How long `wait` spins before giving up (a lost completion is a bug).
    pub timeout: Duration,
}

impl HostDriver {
    /// `alloc_from..alloc_to`: guest memory the driver may use for queues and buffers.
    pub fn new(dev: Arc<Mutex<NvmeController>>, mem: GuestMemory, alloc_from: u64, alloc_to: u64) -> HostDriver {
        HostDriver {
            dev,
            mem,
            admin: QueuePair { qid: 0, sq_base: 0, cq_base: 0, size: 0, sq_tail: 0, cq_head: 0, phase: true },
            io: Vec::new(),
            next_free: alloc_from,
            mem_end: alloc_to,
            next_cid: 1,
            stash: Vec::new(),
            timeout: Duration::from_secs(20),
        }
    }

    pub fn alloc(&mut self, bytes: u64) -> u64 {
        let a = self.next_free.div_ceil(PAGE_SIZE) * PAGE_SIZE;
        self.next_free = a + bytes;
        assert!(self.next_free <= self.mem_end, "harness out of guest memory");
        a
    }

    pub fn read32(&self, off: u64) -> u32 {
        let mut b = [0u8; 4];
        self.dev.lock().unwrap().read(off, &mut b);
        u32::from_le_bytes(b)
    }
    pub fn read64(&self, off: u64) -> u64 {
        let mut b = [0u8; 8];
        self.dev.lock().unwrap().read(off, &mut b);
        u64::from_le_bytes(b)
    }
    pub fn write32(&self, off: u64, v: u32) {
        self.dev.lock().unwrap().write(off, &v.to_le_bytes());
    }
    pub fn write64(&self, off: u64, v: u64) {
        self.dev.lock().unwrap().write(off, &v.to_le_bytes());
    }

    pub fn csts(&self) -> u32 {
        self.read32(REG_CSTS)
    }

    /// Program the admin queue and enable; returns CSTS afterwards.
    pub fn enable(&mut self, admin_entries: u32) -> u32 {
        self.admin = QueuePair { qid: 0, sq_base: 0, cq_base: 0, size: admin_entries, sq_tail: 0, cq_head: 0, phase: true };
        self.stash.clear();
        self.admin.sq_base = self.alloc(admin_entries as u64 * SQE_SIZE);
        self.admin.cq_base = self.alloc(admin_entries as u64 * CQE_SIZE);
        self.zero(self.admin.cq_base, admin_entries as u64 * CQE_SIZE);
        self.write32(REG_AQA, (admin_entries - 1) | (admin_entries - 1) << 16);
        self.write64(REG_ASQ, self.admin.sq_base);
        self.write64(REG_ACQ, self.admin.cq_base);
        self.write32(REG_CC, Self::cc_enabled());
        self.csts()
    }

    /// CC with EN, 4 KiB pages, NVM set, 64/16-byte entries.
    pub fn cc_enabled() -> u32 {
        CC_EN | 6 << 16 | 4 << 20
    }

    pub fn zero(&self, addr: u64, len: u64) {
        self.mem.write_slice(&vec![0u8; len as usize], GuestAddress(addr)).unwrap();
    }

    pub fn write_mem(&self, addr: u64, data: &[u8]) {
        self.mem.write_slice(data, GuestAddress(addr)).unwrap();
    }

    pub fn read_mem(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.mem.read_slice(&mut v, GuestAddress(addr)).unwrap();
        v
    }

    fn qp(&mut self, q: usize) -> &mut QueuePair {
        if q == 0 {
            &mut self.admin
        } else {
            &mut self.io[q - 1]
        }
    }

    /// Put a command in queue `q` (0 = admin) without ringing the doorbell.
    pub fn push(&mut self, q: usize, cmd: &Command) {
        let bytes = cmd.to_bytes();
        let qp = self.qp(q);
        let addr = qp.sq_base + qp.sq_tail as u64 * SQE_SIZE;
        qp.sq_tail = (qp.sq_tail + 1) % qp.size;
        // A plain store of the 64 bytes, as a guest driver does (the
        // generic guest-memory copy costs more than the rest of the push).
        let p = super::dma::host_range(&self.mem, addr, bytes.len()).expect("SQ inside guest RAM");
        // SAFETY: the range was checked to lie inside a guest RAM mapping.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), p, bytes.len()) };
    }

    /// Write queue `q`'s SQ tail doorbell.
    pub fn ring(&mut self, q: usize) {
        let qp = self.qp(q);
        let (qid, tail) = (qp.qid, qp.sq_tail);
        self.write32(DOORBELL_BASE + 8 * qid as u64, tail);
    }

    /// Take one completion from queue `q` if there is one; rings the CQ head doorbell.
    pub fn poll(&mut self, q: usize) -> Option<Completion> {
        let c = self.peek(q)?;
        let qp = self.qp(q);
        qp.cq_head += 1;
        if qp.cq_head == qp.size {
            qp.cq_head = 0;
            qp.phase = !qp.phase;
        }
        let (qid, head) = (qp.qid, qp.cq_head);
        self.write32(DOORBELL_BASE + 8 * qid as u64 + 4, head);
        Some(c)
    }

    /// Take up to `max` completions, ringing the CQ head doorbell once.
    pub fn poll_many(&mut self, q: usize, max: usize, out: &mut Vec<Completion>) -> usize {
        let mut n = 0;
        while n < max {
            let Some(c) = self.peek(q) else { break };
            out.push(c);
            let qp = self.qp(q);
            qp.cq_head += 1;
            if qp.cq_head == qp.size {
                qp.cq_head = 0;
                qp.phase = !qp.phase;
            }
            n += 1;
        }
        if n > 0 {
            let qp = self.qp(q);
            let (qid, head) = (qp.qid, qp.cq_head);
            self.write32(DOORBELL_BASE + 8 * qid as u64 + 4, head);
        }
        n
    }

    fn peek(&mut self, q: usize) -> Option<Completion> {
        let qp = self.qp(q);
        let addr = qp.cq_base + qp.cq_head as u64 * CQE_SIZE;
        let phase = qp.phase;
        let p = super::dma::host_range(&self.mem, addr, 16).unwrap();
        // Read the phase dword first, then the rest (the device writes in the other order).
        let dw3 = unsafe { std::ptr::read_volatile(p.add(12) as *const u32) };
        if (dw3 >> 16) & 1 != phase as u32 {
            return None;
        }
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        let mut b = [0u8; 16];
        unsafe { std::ptr::copy_nonoverlapping(p, b.as_mut_ptr(), 16) };
        Some(Completion::decode(&b).0)
    }

    /// Wait for one completion on queue `q`.
    pub fn wait(&mut self, q: usize) -> Option<Completion> {
        if let Some(i) = self.stash.iter().position(|(sq, _)| *sq == q) {
            return Some(self.stash.remove(i).1);
        }
        let start = Instant::now();
        loop {
            if let Some(c) = self.poll(q) {
                return Some(c);
            }
            if start.elapsed() > self.timeout {
                return None;
            }
            std::hint::spin_loop();
        }
    }

    pub fn cid(&mut self) -> u16 {
        self.next_cid = self.next_cid.wrapping_add(1).max(1);
        self.next_cid
    }

    /// Submit an admin command and wait for its completion.
    pub fn admin_cmd(&mut self, mut cmd: Command) -> Completion {
        cmd.cid = self.cid();
        self.push(0, &cmd);
        self.ring(0);
        self.wait_cid(0, cmd.cid).expect("admin command completes")
    }

    /// Wait for the completion of `cid` on queue `q`, keeping the others for `wait`.
    pub fn wait_cid(&mut self, q: usize, cid: u16) -> Option<Completion> {
        if let Some(i) = self.stash.iter().position(|(sq, c)| *sq == q && c.cid == cid) {
            return Some(self.stash.remove(i).1);
        }
        let start = Instant::now();
        loop {
            if let Some(c) = self.poll(q) {
                if c.cid == cid {
                    return Some(c);
                }
                self.stash.push((q, c));
            }
            if start.elapsed() > self.timeout {
                return None;
            }
            std::hint::spin_loop();
        }
    }

    /// Identify into a fresh page; returns (status, data).
    pub fn identify(&mut self, cns: u8, nsid: u32, csi: u8) -> (Status, Vec<u8>) {
        let buf = self.alloc(4096);
        self.zero(buf, 4096);
        let c = self.admin_cmd(Command {
            opcode: ADM_IDENTIFY,
            nsid,
            prp1: buf,
            cdw10: cns as u32,
            cdw11: (csi as u32) << 24,
            ..Default::default()
        });
        (c.status, self.read_mem(buf, 4096))
    }

    /// Create `n` I/O queue pairs of `entries` each (CQ i serves SQ i).
    pub fn create_io_queues(&mut self, n: u16, entries: u32) -> Result<(), Status> {
        for qid in 1..=n {
            let cq = self.alloc(entries as u64 * CQE_SIZE);
            let sq = self.alloc(entries as u64 * SQE_SIZE);
            self.zero(cq, entries as u64 * CQE_SIZE);
            let c = self.admin_cmd(Command {
                opcode: ADM_CREATE_CQ,
                prp1: cq,
                cdw10: qid as u32 | (entries - 1) << 16,
                cdw11: 1,
                ..Default::default()
            });
            if !c.status.is_success() {
                return Err(c.status);
            }
            let c = self.admin_cmd(Command {
                opcode: ADM_CREATE_SQ,
                prp1: sq,
                cdw10: qid as u32 | (entries - 1) << 16,
                cdw11: 1 | (qid as u32) << 16,
                ..Default::default()
            });
            if !c.status.is_success() {
                return Err(c.status);
            }
            self.io.push(QueuePair { qid, sq_base: sq, cq_base: cq, size: entries, sq_tail: 0, cq_head: 0, phase: true });
        }
        Ok(())
    }

    /// A Read or Write of `nlb` blocks at `slba` to/from a buffer at `buf`
    /// (PRP list built in `list` when the buffer spans more than two pages).
    #[allow(clippy::too_many_arguments)]
    pub fn rw_cmd(&mut self, write: bool, nsid: u32, slba: u64, nlb: u32, buf: u64, bytes: usize, list: Option<u64>) -> Command {
        let pages = bytes.div_ceil(PAGE_SIZE as usize);
        let prp2 = if pages <= 1 {
            0
        } else if pages == 2 {
            buf + PAGE_SIZE
        } else {
            let list = list.expect("a PRP list page");
            let entries: Vec<u8> = (1..pages).flat_map(|i| (buf + i as u64 * PAGE_SIZE).to_le_bytes()).collect();
            self.write_mem(list, &entries);
            list
        };
        Command {
            opcode: if write { NVM_WRITE } else { NVM_READ },
            nsid,
            prp1: buf,
            prp2,
            cdw10: slba as u32,
            cdw11: (slba >> 32) as u32,
            cdw12: nlb - 1,
            ..Default::default()
        }
    }

    /// Submit one I/O command on queue `q` and wait for it.
    pub fn io_cmd(&mut self, q: usize, mut cmd: Command) -> Completion {
        cmd.cid = self.cid();
        self.push(q, &cmd);
        self.ring(q);
        self.wait_cid(q, cmd.cid).expect("I/O command completes")
    }
}

/// A controller plus guest memory and a driver, set up and enabled: the
/// common start of tests and the bench.
pub fn setup(spec: &str, ram: usize) -> HostDriver {
    let mem = GuestMemory::from_ranges(&[(GuestAddress(0), ram)]).expect("guest memory");
    let cfg = super::NvmeConfig::parse(spec).expect("nvme spec");
    let ctrl = NvmeController::new(cfg, mem.clone(), crate::layout::PCI_BAR_BASE).expect("controller");
    let mut d = HostDriver::new(Arc::new(Mutex::new(ctrl)), mem, 0x10_0000, ram as u64);
    let csts = d.enable(64);
    assert_eq!(csts & (CSTS_RDY | CSTS_CFS), CSTS_RDY, "controller ready");
    d
}
