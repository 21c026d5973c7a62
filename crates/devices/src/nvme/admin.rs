//! Admin command set.

use super::config::MAX_NAMESPACES;
use super::ctrl::{Ctrl, Outcome, AER_LIMIT, ERROR_LOG_ENTRIES, MDTS, TEMPERATURE_K};
use super::dma;
use super::queues::{Cq, Sq};
use super::spec::*;

fn done(s: Status) -> Outcome {
    Outcome::Done(s, 0)
}

fn put_str(b: &mut [u8], s: &str) {
    // ASCII, space padded.
    b.fill(b' ');
    let n = s.len().min(b.len());
    b[..n].copy_from_slice(&s.as_bytes()[..n]);
}

fn put16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
}
fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
fn put64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}
fn put128(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
    b[at + 8..at + 16].fill(0);
}

impl Ctrl {
    pub fn admin(&mut self, cmd: &Command) -> Outcome {
        if cmd.psdt != 0 || cmd.fuse != 0 {
            return done(Status::INVALID_FIELD);
        }
        match cmd.opcode {
            ADM_DELETE_SQ => done(self.delete_sq(cmd)),
            ADM_CREATE_SQ => done(self.create_sq(cmd)),
            ADM_GET_LOG_PAGE => done(self.get_log_page(cmd)),
            ADM_DELETE_CQ => done(self.delete_cq(cmd)),
            ADM_CREATE_CQ => done(self.create_cq(cmd)),
            ADM_IDENTIFY => done(self.identify(cmd)),
            ADM_ABORT => {
                // Commands run to completion as soon as they are fetched, so
                // there is never one left to abort: dword 0 bit 0 = not aborted.
                Outcome::Done(Status::SUCCESS, 1)
            }
            ADM_SET_FEATURES => match self.set_features(cmd) {
                Ok(dw0) => Outcome::Done(Status::SUCCESS, dw0),
                Err(s) => done(s),
            },
            ADM_GET_FEATURES => match self.get_features(cmd) {
                Ok(dw0) => Outcome::Done(Status::SUCCESS, dw0),
                Err(s) => done(s),
            },
            ADM_ASYNC_EVENT => {
                if self.aer.outstanding.len() >= AER_LIMIT {
                    return done(Status::AER_LIMIT_EXCEEDED);
                }
                self.aer.outstanding.push(cmd.cid);
                self.deliver_events();
                Outcome::Held
            }
            ADM_KEEP_ALIVE => done(Status::INVALID_OPCODE), // KAS = 0: not supported
            _ => done(Status::INVALID_OPCODE),
        }
    }

    fn io_queue_count(&self) -> (u16, u16) {
        (self.features.nsqa + 1, self.features.ncqa + 1)
    }

    fn create_cq(&mut self, cmd: &Command) -> Status {
        let qid = cmd.cdw10 as u16;
        let size = (cmd.cdw10 >> 16) + 1;
        let pc = cmd.cdw11 & 1 != 0;
        let ien = cmd.cdw11 & 2 != 0;
        let iv = (cmd.cdw11 >> 16) as u16;
        if qid == 0 || qid > self.io_queue_count().1 || self.cqs[qid as usize].is_some() {
            return Status::INVALID_QUEUE_ID;
        }
        if size < 2 || size > self.cfg.depth {
            return Status::INVALID_QUEUE_SIZE;
        }
        if ien && iv as usize > self.cfg.queues as usize {
            return Status::INVALID_INTERRUPT_VECTOR;
        }
        if !pc {
            return Status::INVALID_FIELD; // CAP.CQR: queues must be contiguous
        }
        if cmd.prp1 & (PAGE_SIZE - 1) != 0 {
            return Status::INVALID_PRP_OFFSET;
        }
        if dma::host_range(&self.mem, cmd.prp1, size as usize * CQE_SIZE as usize).is_none() {
            return Status::INVALID_FIELD;
        }
        if (self.regs.cc >> 20) & 0xf != 4 {
            return Status::INVALID_FIELD; // CC.IOCQES must be 16 bytes
        }
        self.cqs[qid as usize] = Some(Cq::new(qid, cmd.prp1, size, ien, iv));
        Status::SUCCESS
    }

    fn create_sq(&mut self, cmd: &Command) -> Status {
        let qid = cmd.cdw10 as u16;
        let size = (cmd.cdw10 >> 16) + 1;
        let pc = cmd.cdw11 & 1 != 0;
        let prio = ((cmd.cdw11 >> 1) & 0x3) as u8;
        let cqid = (cmd.cdw11 >> 16) as u16;
        if cqid == 0 || cqid as usize >= self.cqs.len() || self.cqs[cqid as usize].is_none() {
            return Status::INVALID_CQ;
        }
        if qid == 0 || qid > self.io_queue_count().0 || self.sqs[qid as usize].is_some() {
            return Status::INVALID_QUEUE_ID;
        }
        if size < 2 || size > self.cfg.depth {
            return Status::INVALID_QUEUE_SIZE;
        }
        if !pc {
            return Status::INVALID_FIELD;
        }
        if cmd.prp1 & (PAGE_SIZE - 1) != 0 {
            return Status::INVALID_PRP_OFFSET;
        }
        if dma::host_range(&self.mem, cmd.prp1, size as usize * SQE_SIZE as usize).is_none() {
            return Status::INVALID_FIELD;
        }
        if (self.regs.cc >> 16) & 0xf != 6 {
            return Status::INVALID_FIELD; // CC.IOSQES must be 64 bytes
        }
        self.sqs[qid as usize] = Some(Sq { qid, cqid, base: cmd.prp1, size, head: 0, tail: 0, prio });
        Status::SUCCESS
    }

    fn delete_sq(&mut self, cmd: &Command) -> Status {
        let qid = cmd.cdw10 as u16;
        if qid == 0 || qid as usize >= self.sqs.len() || self.sqs[qid as usize].is_none() {
            return Status::INVALID_QUEUE_ID;
        }
        // Commands already fetched from it finish (and post) first.
        self.drain();
        self.sqs[qid as usize] = None;
        self.blocked.remove(&qid);
        Status::SUCCESS
    }

    fn delete_cq(&mut self, cmd: &Command) -> Status {
        let qid = cmd.cdw10 as u16;
        if qid == 0 || qid as usize >= self.cqs.len() || self.cqs[qid as usize].is_none() {
            return Status::INVALID_QUEUE_ID;
        }
        if self.sqs.iter().flatten().any(|s| s.cqid == qid) {
            return Status::INVALID_QUEUE_DELETION;
        }
        self.cqs[qid as usize] = None;
        Status::SUCCESS
    }

    // ---- Identify ---------------------------------------------------------

    fn identify(&mut self, cmd: &Command) -> Status {
        let cns = cmd.cdw10 as u8;
        let csi = (cmd.cdw11 >> 24) as u8;
        let mut b = vec![0u8; 4096];
        let r = match cns {
            0x00 => self.identify_ns(cmd.nsid, &mut b),
            0x01 => {
                self.identify_ctrl(&mut b);
                Ok(())
            }
            0x02 => self.active_ns_list(cmd.nsid, &mut b),
            0x03 => self.ns_descriptors(cmd.nsid, &mut b),
            // I/O command set specific namespace / controller structures for
            // the NVM command set: all fields zero (no extended LBA formats,
            // no size limits beyond MDTS).
            0x05 if csi == 0 => self.check_active(cmd.nsid),
            0x06 if csi == 0 => Ok(()),
            0x07 if csi == 0 => self.active_ns_list(cmd.nsid, &mut b),
            0x05..=0x07 => Err(Status::INVALID_FIELD),
            // Command set independent Identify Namespace.
            0x08 => self.identify_ns_independent(cmd.nsid, &mut b),
            _ => Err(Status::INVALID_FIELD),
        };
        if let Err(s) = r {
            return s;
        }
        match dma::write_prp_data(&self.mem, cmd.prp1, cmd.prp2, &b) {
            Ok(()) => Status::SUCCESS,
            Err(s) => s,
        }
    }

    fn check_active(&self, nsid: u32) -> Result<(), Status> {
        if self.namespaces.contains_key(&nsid) {
            Ok(())
        } else {
            Err(Status::INVALID_NAMESPACE)
        }
    }

    fn identify_ns(&self, nsid: u32, b: &mut [u8]) -> Result<(), Status> {
        if nsid == 0 || nsid > MAX_NAMESPACES {
            return Err(Status::INVALID_NAMESPACE);
        }
        let Some(ns) = self.namespaces.get(&nsid) else {
            return Ok(()); // inactive namespace ID: all zeros
        };
        put64(b, 0, ns.blocks); // NSZE
        put64(b, 8, ns.blocks); // NCAP
        put64(b, 16, ns.blocks); // NUSE
        b[24] = 0; // NSFEAT
        b[25] = 0; // NLBAF: one format
        b[26] = 0; // FLBAS: format 0
        b[32] = 0x1 | 0x1 << 3; // DLFEAT: deallocated reads zeros; Write Zeroes may deallocate
        b[104..120].copy_from_slice(&ns.uuid); // NGUID
                                               // LBA format 0: LBADS, no metadata, best performance.
        let lbads = self.cfg.block_size.trailing_zeros();
        put32(b, 128, lbads << 16);
        Ok(())
    }

    fn identify_ns_independent(&self, nsid: u32, b: &mut [u8]) -> Result<(), Status> {
        if nsid == 0 || nsid > MAX_NAMESPACES {
            return Err(Status::INVALID_NAMESPACE);
        }
        if self.namespaces.contains_key(&nsid) {
            b[12] = 1; // NSTAT: namespace ready
        }
        Ok(())
    }

    fn identify_ctrl(&self, b: &mut [u8]) {
        put16(b, 0, super::PCI_VENDOR); // VID
        put16(b, 2, super::PCI_VENDOR); // SSVID
        put_str(&mut b[4..24], &format!("TRANSIT-{}", self.cfg.name)); // SN
        put_str(&mut b[24..64], "Transit virtual NVMe"); // MN
        put_str(&mut b[64..72], env!("CARGO_PKG_VERSION")); // FR
        b[72] = 6; // RAB
        b[77] = MDTS;
        put16(b, 78, 1); // CNTLID
        put32(b, 80, VERSION_1_4);
        put32(b, 92, 1 << 8); // OAES: namespace attribute notices
        b[111] = 1; // CNTRLTYPE: I/O controller
        put16(b, 256, 0); // OACS: no optional admin commands
        b[258] = 3; // ACL: 4 aborts
        b[259] = (AER_LIMIT - 1) as u8; // AERL
        b[260] = 0x3; // FRMW: slot 1 read-only, one slot
        b[261] = 0x2 | 0x4; // LPA: command effects log, extended data
        b[262] = (ERROR_LOG_ENTRIES - 1) as u8; // ELPE
        b[263] = 0; // NPSS: one power state
        put16(b, 266, 343); // WCTEMP
        put16(b, 268, 373); // CCTEMP
        b[512] = 0x66; // SQES
        b[513] = 0x44; // CQES
        put16(b, 514, 0); // MAXCMD
        put32(b, 516, MAX_NAMESPACES); // NN
        put16(b, 520, 0x1 | 0x4 | 0x8); // ONCS: Compare, DSM, Write Zeroes
        b[525] = 0x1 | 0x6; // VWC present; Flush with NSID FFFFFFFFh supported
        put_str(&mut b[768..1024], "");
        let nqn = format!("nqn.2024-01.io.transit:nvme:{}", self.cfg.name);
        b[768..1024].fill(0);
        b[768..768 + nqn.len().min(255)].copy_from_slice(&nqn.as_bytes()[..nqn.len().min(255)]);
        // Power state 0: 25 W, entry/exit latency 0.
        put16(b, 2048, 2500);
    }

    fn active_ns_list(&self, nsid: u32, b: &mut [u8]) -> Result<(), Status> {
        if nsid >= 0xffff_fffe {
            return Err(Status::INVALID_NAMESPACE);
        }
        for (i, id) in self.namespaces.keys().filter(|&&id| id > nsid).take(1024).enumerate() {
            put32(b, i * 4, *id);
        }
        Ok(())
    }

    fn ns_descriptors(&self, nsid: u32, b: &mut [u8]) -> Result<(), Status> {
        let ns = self.namespaces.get(&nsid).ok_or(Status::INVALID_NAMESPACE)?;
        // NGUID (type 2), UUID (type 3), command set identifier (type 4).
        b[0] = 2;
        b[1] = 16;
        b[4..20].copy_from_slice(&ns.uuid);
        b[20] = 3;
        b[21] = 16;
        b[24..40].copy_from_slice(&ns.uuid);
        b[40] = 4;
        b[41] = 1;
        b[44] = 0;
        Ok(())
    }

    // ---- Features ---------------------------------------------------------

    fn set_features(&mut self, cmd: &Command) -> Result<u32, Status> {
        let fid = cmd.cdw10 as u8;
        let save = cmd.cdw10 & (1 << 31) != 0;
        if save {
            return Err(Status::FEATURE_NOT_SAVEABLE);
        }
        let v = cmd.cdw11;
        let f = &mut self.features;
        match fid {
            FEAT_ARBITRATION => f.arbitration = v,
            FEAT_POWER_MGMT => {
                if v & 0x1f != 0 {
                    return Err(Status::INVALID_FIELD); // only power state 0
                }
                f.power_mgmt = v;
            }
            FEAT_TEMP_THRESHOLD => {
                let tmpth = v as u16;
                let sel = ((v >> 16) & 0xf) as usize;
                let thsel = (v >> 20) & 0x3;
                if sel > 8 || thsel > 1 {
                    return Err(Status::INVALID_FIELD);
                }
                let before = self.critical_warning();
                if thsel == 0 {
                    self.features.temp_over[sel] = tmpth;
                } else {
                    self.features.temp_under[sel] = tmpth;
                }
                let after = self.critical_warning();
                if after & !before & (self.features.async_event_config as u8) != 0 {
                    self.raise_event(AER_TYPE_SMART, AER_INFO_TEMPERATURE, LOG_SMART);
                }
            }
            FEAT_ERROR_RECOVERY => {
                if v & (1 << 16) != 0 {
                    return Err(Status::INVALID_FIELD); // DULBE needs NSFEAT bit 2
                }
                f.error_recovery = v;
            }
            FEAT_VWC => f.vwc = v & 1 != 0,
            FEAT_NUM_QUEUES => {
                let nsqr = v as u16;
                let ncqr = (v >> 16) as u16;
                if nsqr == 0xffff || ncqr == 0xffff {
                    return Err(Status::INVALID_FIELD);
                }
                if self.sqs.iter().skip(1).any(|q| q.is_some()) || self.cqs.iter().skip(1).any(|q| q.is_some()) {
                    return Err(Status::COMMAND_SEQUENCE_ERROR);
                }
                let max = self.cfg.queues - 1;
                f.nsqa = nsqr.min(max);
                f.ncqa = ncqr.min(max);
                return Ok(f.nsqa as u32 | (f.ncqa as u32) << 16);
            }
            FEAT_IRQ_COALESCING => f.irq_coalescing = v & 0xffff,
            FEAT_IRQ_CONFIG => {
                let iv = v as u16;
                if iv as usize > self.cfg.queues as usize {
                    return Err(Status::INVALID_FIELD);
                }
                f.irq_config.insert(iv, v & 0x1_ffff);
            }
            FEAT_WRITE_ATOMICITY => f.write_atomicity = v & 1,
            FEAT_ASYNC_EVENT_CONFIG => f.async_event_config = v & (0xff | 1 << 8),
            FEAT_SW_PROGRESS => f.sw_progress = v & 0xff,
            _ => return Err(Status::INVALID_FIELD),
        }
        Ok(0)
    }

    fn get_features(&self, cmd: &Command) -> Result<u32, Status> {
        let fid = cmd.cdw10 as u8;
        let sel = (cmd.cdw10 >> 8) & 0x7;
        let defaults;
        let f = match sel {
            0 => &self.features,
            1 | 2 => {
                // Nothing is saveable, so "saved" reads the defaults.
                defaults = super::ctrl::Features::defaults(self.cfg.queues);
                &defaults
            }
            3 => {
                // Supported capabilities: changeable, not saveable, not per namespace.
                return match fid {
                    FEAT_ARBITRATION
                    | FEAT_POWER_MGMT
                    | FEAT_TEMP_THRESHOLD
                    | FEAT_ERROR_RECOVERY
                    | FEAT_VWC
                    | FEAT_NUM_QUEUES
                    | FEAT_IRQ_COALESCING
                    | FEAT_IRQ_CONFIG
                    | FEAT_WRITE_ATOMICITY
                    | FEAT_ASYNC_EVENT_CONFIG
                    | FEAT_SW_PROGRESS => Ok(0x4),
                    _ => Err(Status::INVALID_FIELD),
                };
            }
            _ => return Err(Status::INVALID_FIELD),
        };
        Ok(match fid {
            FEAT_ARBITRATION => f.arbitration,
            FEAT_POWER_MGMT => f.power_mgmt,
            FEAT_TEMP_THRESHOLD => {
                let s = ((cmd.cdw11 >> 16) & 0xf) as usize;
                let thsel = (cmd.cdw11 >> 20) & 0x3;
                if s > 8 || thsel > 1 {
                    return Err(Status::INVALID_FIELD);
                }
                let t = if thsel == 0 { f.temp_over[s] } else { f.temp_under[s] };
                t as u32 | (s as u32) << 16 | thsel << 20
            }
            FEAT_ERROR_RECOVERY => f.error_recovery,
            FEAT_VWC => f.vwc as u32,
            FEAT_NUM_QUEUES => f.nsqa as u32 | (f.ncqa as u32) << 16,
            FEAT_IRQ_COALESCING => f.irq_coalescing,
            FEAT_IRQ_CONFIG => {
                let iv = cmd.cdw11 as u16;
                if iv as usize > self.cfg.queues as usize {
                    return Err(Status::INVALID_FIELD);
                }
                f.irq_config.get(&iv).copied().unwrap_or(iv as u32)
            }
            FEAT_WRITE_ATOMICITY => f.write_atomicity,
            FEAT_ASYNC_EVENT_CONFIG => f.async_event_config,
            FEAT_SW_PROGRESS => f.sw_progress,
            _ => return Err(Status::INVALID_FIELD),
        })
    }

    // ---- Log pages --------------------------------------------------------

    fn get_log_page(&mut self, cmd: &Command) -> Status {
        let lid = cmd.cdw10 as u8;
        let rae = cmd.cdw10 & (1 << 15) != 0;
        let numd = ((cmd.cdw10 >> 16) | (cmd.cdw11 & 0xffff) << 16) as usize + 1;
        let len = numd * 4;
        let offset = cmd.cdw12 as u64 | (cmd.cdw13 as u64) << 32;
        if cmd.nsid != 0 && cmd.nsid != 0xffff_ffff && lid != LOG_SMART {
            return Status::INVALID_FIELD;
        }
        let page = match lid {
            LOG_ERROR => self.error_log_page(),
            LOG_SMART => {
                if cmd.nsid != 0 && cmd.nsid != 0xffff_ffff {
                    return Status::INVALID_FIELD; // no per-namespace SMART
                }
                self.smart_page()
            }
            LOG_FW_SLOT => {
                let mut b = vec![0u8; 512];
                b[0] = 1; // active slot 1
                put_str(&mut b[8..16], env!("CARGO_PKG_VERSION"));
                b
            }
            LOG_CHANGED_NS => {
                let mut b = vec![0u8; 4096];
                if self.changed_ns.len() > 1024 {
                    put32(&mut b, 0, 0xffff_ffff);
                } else {
                    for (i, id) in self.changed_ns.iter().enumerate() {
                        put32(&mut b, i * 4, *id);
                    }
                }
                b
            }
            LOG_CMD_EFFECTS => {
                let mut b = vec![0u8; 4096];
                for op in [
                    ADM_DELETE_SQ,
                    ADM_CREATE_SQ,
                    ADM_GET_LOG_PAGE,
                    ADM_DELETE_CQ,
                    ADM_CREATE_CQ,
                    ADM_IDENTIFY,
                    ADM_ABORT,
                    ADM_SET_FEATURES,
                    ADM_GET_FEATURES,
                    ADM_ASYNC_EVENT,
                ] {
                    put32(&mut b, op as usize * 4, 1);
                }
                for op in [NVM_FLUSH, NVM_WRITE, NVM_READ, NVM_COMPARE, NVM_WRITE_ZEROES, NVM_DSM] {
                    let lbcc = if matches!(op, NVM_WRITE | NVM_WRITE_ZEROES | NVM_DSM) { 2 } else { 0 };
                    put32(&mut b, 1024 + op as usize * 4, 1 | lbcc);
                }
                b
            }
            _ => return Status::INVALID_LOG_PAGE,
        };
        if offset % 4 != 0 || offset >= page.len() as u64 {
            return Status::INVALID_FIELD;
        }
        let start = offset as usize;
        let mut out = vec![0u8; len.min(1 << 20)];
        let n = (page.len() - start).min(out.len());
        out[..n].copy_from_slice(&page[start..start + n]);
        if len > out.len() {
            return Status::INVALID_FIELD;
        }
        if let Err(s) = dma::write_prp_data(&self.mem, cmd.prp1, cmd.prp2, &out) {
            return s;
        }
        if !rae {
            if lid == LOG_CHANGED_NS {
                self.changed_ns.clear();
            }
            self.log_read(lid);
        }
        Status::SUCCESS
    }

    fn error_log_page(&self) -> Vec<u8> {
        let mut b = vec![0u8; 64 * ERROR_LOG_ENTRIES];
        for (i, e) in self.error_log.iter().enumerate() {
            let o = i * 64;
            put64(&mut b, o, e.count);
            put16(&mut b, o + 8, e.sqid);
            put16(&mut b, o + 10, e.cid);
            put16(&mut b, o + 12, e.status);
            put16(&mut b, o + 14, 0xffff); // parameter error location: not given
            put64(&mut b, o + 16, e.lba);
            put32(&mut b, o + 24, e.nsid);
        }
        b
    }

    fn smart_page(&self) -> Vec<u8> {
        let mut b = vec![0u8; 512];
        let c = &self.counters;
        b[0] = self.critical_warning();
        put16(&mut b, 1, TEMPERATURE_K);
        b[3] = 100; // available spare
        b[4] = 10; // spare threshold
        b[5] = 0; // percentage used
        put128(&mut b, 32, c.bytes_read.div_ceil(512_000));
        put128(&mut b, 48, c.bytes_written.div_ceil(512_000));
        put128(&mut b, 64, c.reads);
        put128(&mut b, 80, c.writes);
        put128(&mut b, 112, c.power_cycles);
        put128(&mut b, 144, c.unsafe_shutdowns);
        put128(&mut b, 176, self.error_count);
        b
    }
}
