//! NVM command set: Read, Write, Flush, Write Zeroes, Dataset Management,
//! Compare. Memory namespaces run inline; file reads and writes go to
//! io_uring when there is one.

use super::ctrl::{Ctrl, Inflight, Outcome, MAX_TRANSFER};
use super::dma;
use super::spec::*;

fn done(s: Status) -> Outcome {
    Outcome::Done(s, 0)
}

impl Ctrl {
    pub fn io(&mut self, sqid: u16, cqid: u16, cmd: &Command) -> Outcome {
        if cmd.psdt != 0 || cmd.fuse != 0 {
            return done(Status::INVALID_FIELD); // no SGLs, no fused operations
        }
        match cmd.opcode {
            NVM_READ | NVM_WRITE => self.read_write(sqid, cqid, cmd),
            NVM_FLUSH => done(self.flush(cmd)),
            NVM_WRITE_ZEROES => done(self.write_zeroes(cmd)),
            NVM_DSM => done(self.dsm(cmd)),
            NVM_COMPARE => done(self.compare(cmd)),
            _ => done(Status::INVALID_OPCODE),
        }
    }

    /// Check namespace and LBA range; returns (byte offset, byte length).
    fn lba_range(&self, nsid: u32, slba: u64, nlb: u64) -> Result<(u64, u64), Status> {
        let ns = self.namespaces.get(&nsid).ok_or(Status::INVALID_NAMESPACE)?;
        let end = slba.checked_add(nlb).ok_or(Status::LBA_OUT_OF_RANGE)?;
        if end > ns.blocks {
            return Err(Status::LBA_OUT_OF_RANGE);
        }
        let bs = self.cfg.block_size as u64;
        Ok((slba * bs, nlb * bs))
    }

    fn read_write(&mut self, sqid: u16, cqid: u16, cmd: &Command) -> Outcome {
        let write = cmd.opcode == NVM_WRITE;
        let (off, len) = match self.lba_range(cmd.nsid, cmd.slba(), cmd.nlb() as u64) {
            Ok(r) => r,
            Err(s) => return done(s),
        };
        if len as usize > MAX_TRANSFER {
            return done(Status::INVALID_FIELD);
        }
        let mut segs = std::mem::take(&mut self.scratch);
        if let Err(s) = dma::map_prps(&self.mem, cmd.prp1, cmd.prp2, len as usize, &mut segs) {
            self.scratch = segs;
            return done(s);
        }
        if write {
            self.counters.writes += 1;
        } else {
            self.counters.reads += 1;
        }
        // FUA, or a disabled volatile write cache, asks for stable writes.
        let dsync = write && (cmd.cdw12 & (1 << 30) != 0 || !self.features.vwc);
        let ns = self.namespaces.get_mut(&cmd.nsid).unwrap();
        let use_uring = ns.storage.is_file() && self.uring.is_some();
        if !use_uring {
            let r = if write { ns.storage.write_from(off, &segs, dsync) } else { ns.storage.read_into(off, &segs) };
            self.scratch = segs;
            return match r {
                Ok(()) => {
                    if write {
                        self.counters.bytes_written += len;
                    } else {
                        self.counters.bytes_read += len;
                    }
                    done(Status::SUCCESS)
                }
                Err(e) => {
                    tracing::warn!("nvme {}: {e}", if write { "write" } else { "read" });
                    done(Status::INTERNAL_ERROR)
                }
            };
        }
        let fd = match &ns.storage {
            super::backend::Storage::File(f) => std::os::fd::AsRawFd::as_raw_fd(&f.file),
            _ => unreachable!(),
        };
        let direct_ok = match &ns.storage {
            super::backend::Storage::File(f) => !f.direct || segs.iter().all(|s| super::backend::aligned(s.ptr, s.len, 0)),
            _ => true,
        };
        if !direct_ok {
            // O_DIRECT cannot take this buffer as is: go through a bounce buffer.
            let r = if write { ns.storage.write_from(off, &segs, dsync) } else { ns.storage.read_into(off, &segs) };
            self.scratch = segs;
            return done(if r.is_ok() { Status::SUCCESS } else { Status::INTERNAL_ERROR });
        }
        let (mut seg_buf, mut iov) = self.spare.pop().unwrap_or_default();
        seg_buf.extend_from_slice(&segs);
        self.scratch = segs;
        iov.extend(seg_buf.iter().map(|s| libc::iovec { iov_base: s.ptr as *mut libc::c_void, iov_len: s.len }));
        let buffered = match &ns.storage {
            super::backend::Storage::File(f) => !f.direct,
            _ => false,
        };
        let slot = self.alloc_slot();
        let op = Inflight { sqid, cqid, cid: cmd.cid, nsid: cmd.nsid, fd, write, off, len: len as usize, dsync, segs: seg_buf, iov };
        let iov_ptr = op.iov.as_ptr();
        let n = op.iov.len() as u32;
        self.inflight[slot as usize] = Some(op);
        self.inflight_count += 1;
        if write && buffered {
            // io_uring would pass it to a kernel worker anyway (jobs.rs).
            self.queue_write_job(slot);
            return Outcome::Async;
        }
        // SAFETY: the iovecs live in the slot until the completion is reaped.
        let mut queued = unsafe { self.uring.as_ref().unwrap().push_rw(write, fd, iov_ptr, n, off, dsync, slot as u64) };
        if !queued {
            // Submission ring full: hand the batch to the kernel, reap, retry.
            let uring = self.uring.clone().unwrap();
            let _ = uring.submit();
            self.reap();
            queued = unsafe { uring.push_rw(write, fd, iov_ptr, n, off, dsync, slot as u64) };
        }
        if !queued {
            let op = self.inflight[slot as usize].take().unwrap();
            self.inflight_count -= 1;
            self.free_slots.push(slot);
            let ns = self.namespaces.get_mut(&cmd.nsid).unwrap();
            let r = if write { ns.storage.write_from(off, &op.segs, dsync) } else { ns.storage.read_into(off, &op.segs) };
            return done(if r.is_ok() { Status::SUCCESS } else { Status::INTERNAL_ERROR });
        }
        Outcome::Async
    }

    fn flush(&mut self, cmd: &Command) -> Status {
        self.counters.flushes += 1;
        let targets: Vec<u32> = if cmd.nsid == 0xffff_ffff {
            self.namespaces.keys().copied().collect()
        } else if self.namespaces.contains_key(&cmd.nsid) {
            vec![cmd.nsid]
        } else {
            return Status::INVALID_NAMESPACE;
        };
        // Writes completed before this flush are on the ring's finished side
        // already; make them stable.
        for id in targets {
            if let Err(e) = self.namespaces[&id].storage.flush() {
                tracing::warn!("nvme flush: {e}");
                return Status::INTERNAL_ERROR;
            }
        }
        Status::SUCCESS
    }

    fn write_zeroes(&mut self, cmd: &Command) -> Status {
        let (off, len) = match self.lba_range(cmd.nsid, cmd.slba(), cmd.nlb() as u64) {
            Ok(r) => r,
            Err(s) => return s,
        };
        let deallocate = cmd.cdw12 & (1 << 25) != 0;
        let ns = self.namespaces.get_mut(&cmd.nsid).unwrap();
        match ns.storage.zero(off, len, deallocate) {
            Ok(()) => {
                self.counters.writes += 1;
                Status::SUCCESS
            }
            Err(_) => Status::INTERNAL_ERROR,
        }
    }

    fn dsm(&mut self, cmd: &Command) -> Status {
        if !self.namespaces.contains_key(&cmd.nsid) {
            return Status::INVALID_NAMESPACE;
        }
        let nr = (cmd.cdw10 & 0xff) as usize + 1;
        let deallocate = cmd.cdw11 & (1 << 2) != 0;
        let mut raw = vec![0u8; nr * 16];
        let mut segs = Vec::new();
        if let Err(s) = dma::map_prps(&self.mem, cmd.prp1, cmd.prp2, raw.len(), &mut segs) {
            return s;
        }
        dma::copy_from_segs(&segs, &mut raw);
        let mut ranges = Vec::with_capacity(nr);
        for r in raw.chunks_exact(16) {
            let nlb = u32::from_le_bytes(r[4..8].try_into().unwrap()) as u64;
            let slba = u64::from_le_bytes(r[8..16].try_into().unwrap());
            match self.lba_range(cmd.nsid, slba, nlb) {
                Ok(x) => ranges.push(x),
                Err(s) => return s,
            }
        }
        if !deallocate {
            return Status::SUCCESS; // attributes are hints only
        }
        let ns = self.namespaces.get_mut(&cmd.nsid).unwrap();
        for (off, len) in ranges {
            if len > 0 && ns.storage.zero(off, len, true).is_err() {
                return Status::INTERNAL_ERROR;
            }
        }
        Status::SUCCESS
    }

    fn compare(&mut self, cmd: &Command) -> Status {
        let (off, len) = match self.lba_range(cmd.nsid, cmd.slba(), cmd.nlb() as u64) {
            Ok(r) => r,
            Err(s) => return s,
        };
        if len as usize > MAX_TRANSFER {
            return Status::INVALID_FIELD;
        }
        let mut segs = Vec::new();
        if let Err(s) = dma::map_prps(&self.mem, cmd.prp1, cmd.prp2, len as usize, &mut segs) {
            return s;
        }
        let mut host = vec![0u8; len as usize];
        dma::copy_from_segs(&segs, &mut host);
        let mut media = vec![0u8; len as usize];
        if self.namespaces[&cmd.nsid].storage.read_bytes(off, &mut media).is_err() {
            return Status::INTERNAL_ERROR;
        }
        self.counters.reads += 1;
        if host == media {
            Status::SUCCESS
        } else {
            Status::COMPARE_FAILURE
        }
    }
}
