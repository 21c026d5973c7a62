//! The data path, run on the thread that rings the doorbell (the vCPU's MMIO
//! write) with no hop to another thread of the vmm:
//!
//! - QP SEND / RECV doorbell: the new WQEs of the guest's ring are read,
//!   checked, copied (the device keeps its copy until the WQE completes) and
//!   posted to the QP's rnicd rings; rnicd then moves the payload itself
//!   through its mapping of guest RAM.
//! - CQ POLL doorbell (rung by the driver when its CQ looks empty): rnicd's
//!   completions are moved into the guest's CQ ring.
//! - CQ ARM: the CQ is armed; the notifier thread (mod.rs) turns rnicd's next
//!   completion event into a CQ notification.

use pvrdma_abi::ib::{send_flags as ib_send, wc_opcode, wc_status, wr_opcode};
use pvrdma_abi::*;
use verbs::{RecvWr, SendWr, Wc, WcOpcode, WrOpcode};

use super::dev::Dev;
use super::objects::{OutRecv, OutSend, QpInfo};
use super::Errno;

/// How many completions one drain moves at most (a POLL doorbell's work is
/// bounded; the driver rings again when its ring is empty).
const DRAIN_BATCH: usize = 64;

/// Why a guest WQE is refused, as the CQE status it completes with.
fn bad_wqe_status(e: Errno) -> u32 {
    match e {
        Errno::E2BIG => wc_status::LOC_LEN_ERR,
        Errno::ENOSYS => wc_status::LOC_QP_OP_ERR,
        _ => wc_status::LOC_PROT_ERR,
    }
}

impl Dev {
    /// A 32-bit write into a UAR page. A doorbell the device cannot honour
    /// (no such object, no operation bit, bad ring indices, a bad WQE) sets
    /// ERR to the reason and is counted; nothing else happens beyond what the
    /// reason itself reports (a CQE status, an async event).
    pub fn doorbell(&mut self, offset_in_page: u64, value: u32) {
        if let Err(e) = self.ring_doorbell(offset_in_page, value) {
            self.counters.bad_doorbells += 1;
            self.regs.err = e as u32;
        }
    }

    /// The CQ a doorbell then waits on, without the device lock (the
    /// vCPU's MMIO write returns after the wait): a CQ doorbell with
    /// Transit's WAIT and POLL bits waits on its CQ, a QP doorbell with
    /// Transit's WAIT bit on the QP's receive CQ.
    pub fn doorbell_waits_on(&self, offset_in_page: u64, value: u32) -> Option<u32> {
        let handle = value & UAR_HANDLE_MASK;
        match offset_in_page {
            UAR_CQ_OFFSET => {
                let wait = transit::UAR_CQ_WAIT | UAR_CQ_POLL;
                (value & wait == wait).then_some(handle)
            }
            UAR_QP_OFFSET if value & transit::UAR_QP_WAIT != 0 => self.qps.get(handle).map(|q| q.info.recv_cq),
            _ => None,
        }
    }

    fn ring_doorbell(&mut self, offset_in_page: u64, value: u32) -> Result<(), Errno> {
        if self.paused || !self.bus_master || self.regs.state != super::dev::DevState::Active {
            return Err(Errno::EPERM);
        }
        let handle = value & UAR_HANDLE_MASK;
        match offset_in_page {
            UAR_QP_OFFSET => {
                if !self.qps.contains(handle) || value & (UAR_QP_SEND | UAR_QP_RECV) == 0 {
                    return Err(Errno::EINVAL);
                }
                if value & UAR_QP_RECV != 0 {
                    if self.srq_of_qp(handle).is_some() {
                        // Its receives are the SRQ's: it has no queue to read.
                        return Err(Errno::EINVAL);
                    }
                    self.post_recvs(handle)?;
                }
                if value & UAR_QP_SEND != 0 {
                    self.post_sends(handle)?;
                }
                Ok(())
            }
            UAR_CQ_OFFSET => {
                if !self.cqs.contains(handle) || value & (UAR_CQ_ARM | UAR_CQ_ARM_SOL | UAR_CQ_POLL) == 0 {
                    return Err(Errno::EINVAL);
                }
                if value & (UAR_CQ_ARM | UAR_CQ_ARM_SOL) != 0 {
                    self.arm_cq(handle, value & UAR_CQ_ARM_SOL != 0 && value & UAR_CQ_ARM == 0);
                }
                if value & UAR_CQ_POLL != 0 {
                    // An armed CQ notifies whoever moves its completions:
                    // a POLL that drained them first would leave the
                    // notifier thread nothing to notify for.
                    self.drain_and_notify(handle);
                }
                Ok(())
            }
            UAR_SRQ_OFFSET => {
                if !self.srqs.contains(handle) || value & UAR_SRQ_RECV == 0 {
                    return Err(Errno::EINVAL);
                }
                self.post_srq_recvs(handle)
            }
            _ => Err(Errno::EINVAL),
        }
    }

    /// The guest's producer index of a QP queue, checked.
    fn ring_tail(&self, handle: u32, send: bool) -> Result<u32, Errno> {
        let qp = self.qps.get(handle).ok_or(Errno::EINVAL)?;
        let q = if send { &qp.info.sq } else { &qp.info.rq };
        let tail = self.guest.load_u32(qp.info.pages.gpa(q.ring_offset, 4)?)?;
        if !idx_valid(tail, q.wqe_cnt) {
            return Err(Errno::ERANGE);
        }
        Ok(tail)
    }

    /// A QP whose rings are unusable: the device stops reading them and the
    /// driver hears of it through a QP_FATAL async event.
    fn qp_fatal(&mut self, handle: u32) {
        if let Some(qp) = self.qps.get_mut(handle) {
            if !qp.info.broken {
                qp.info.broken = true;
                self.async_event(ib::event::QP_FATAL, handle);
            }
        }
    }

    /// The tail the driver published for the QP's send (`send`) or
    /// receive ring, before WQEs are taken from it: EIO for a QP whose
    /// rings the device no longer reads, and an impossible tail makes the
    /// QP fatal.
    fn tail_to_take(&mut self, handle: u32, send: bool) -> Result<u32, Errno> {
        if self.qps.get(handle).is_some_and(|q| q.info.broken) {
            return Err(Errno::EIO);
        }
        let tail = self.ring_tail(handle, send);
        if tail.is_err() {
            self.qp_fatal(handle);
        }
        tail
    }

    pub fn post_sends(&mut self, handle: u32) -> Result<(), Errno> {
        let tail = self.tail_to_take(handle, true)?;
        let guest = self.guest.clone();
        let mut bad = None;
        let left;
        {
            let qp = self.qps.get_mut(handle).ok_or(Errno::EINVAL)?;
            let i = &mut qp.info;
            let mut batch: Vec<OutSend> = Vec::new();
            // Take no more WQEs than rnicd's queue has room for: the rest
            // stay in the guest's ring (its head does not pass them) and go
            // when completions free room (`drain_cq`). Taken and refused,
            // they would be lost, and their completions with them.
            let room = qp.qp.send_room() as usize;
            while batch.len() < room {
                let Ok(Some(slot)) = ring_has_data(tail, i.sq.head, i.sq.wqe_cnt) else { break };
                let at = i.sq.offset + slot as u64 * i.sq.stride as u64;
                match read_send(&guest, &i.pages, at, i.sq.stride, i.sq.max_sge) {
                    Ok((hdr, sges)) => {
                        batch.push(OutSend { seq: i.sq.next_seq, hdr, sges });
                        i.sq.next_seq += 1;
                        i.sq.head = idx_inc(i.sq.head, i.sq.wqe_cnt);
                    }
                    Err(e) => {
                        // The bad WQE is consumed and completes in error; the
                        // device takes nothing more from this queue.
                        let hdr = guest.read::<SqWqeHdr>(i.pages.gpa(at, 80).unwrap_or(0)).unwrap_or_default();
                        i.sq.head = idx_inc(i.sq.head, i.sq.wqe_cnt);
                        i.broken = true;
                        bad = Some((hdr.wr_id, hdr.opcode, e));
                        break;
                    }
                }
            }
            if !batch.is_empty() {
                let wrs: Vec<SendWr> = batch.iter().map(to_send_wr).collect();
                qp.qp.post_send(&wrs).map_err(|_| Errno::ENOSPC)?;
                self.counters.sq_wqes += batch.len() as u64;
                qp.info.sq_out.extend(batch);
                forget_retired_unsignaled(&mut qp.info);
            }
            left = bad.is_none() && matches!(ring_has_data(tail, qp.info.sq.head, qp.info.sq.wqe_cnt), Ok(Some(_)));
            let head_at = qp.info.pages.gpa(qp.info.sq.ring_offset + 4, 4)?;
            guest.store_u32(head_at, qp.info.sq.head)?;
        }
        if left {
            // Unsignaled sends bring no completion that would take the
            // rest: the notifier thread looks again (`take_waiting_sends`).
            self.sends_waiting.store(true, std::sync::atomic::Ordering::Release);
        }
        if let Some((wr_id, opcode, e)) = bad {
            self.counters.bad_wqes += 1;
            self.fail_qp(handle, true, wr_id, send_wc_opcode(opcode), bad_wqe_status(e));
            return Err(e);
        }
        Ok(())
    }

    /// Takes the send WQEs left in guests' rings while rnicd's queues were
    /// full (`sends_waiting`); those that still find no room wait again.
    pub fn take_waiting_sends(&mut self) {
        if self.paused || !self.bus_master || self.regs.state != super::dev::DevState::Active {
            self.sends_waiting.store(true, std::sync::atomic::Ordering::Release);
            return;
        }
        let handles: Vec<u32> = self.qps.iter().map(|(h, _)| *h).collect();
        for h in handles {
            if self.wqes_waiting(h, true) {
                let _ = self.post_sends(h);
            }
        }
    }

    /// Whether QP `handle`'s send (`send`) or receive ring holds WQEs the
    /// device has not taken, on a QP whose rings it still reads.
    fn wqes_waiting(&self, handle: u32, send: bool) -> bool {
        let Some(q) = self.qps.get(handle).filter(|q| !q.info.broken) else { return false };
        let head = if send { q.info.sq.head } else { q.info.rq.head };
        self.ring_tail(handle, send).is_ok_and(|t| t != head)
    }

    pub fn post_recvs(&mut self, handle: u32) -> Result<(), Errno> {
        let tail = self.tail_to_take(handle, false)?;
        let guest = self.guest.clone();
        let mut bad = None;
        {
            let qp = self.qps.get_mut(handle).ok_or(Errno::EINVAL)?;
            let i = &mut qp.info;
            let mut batch: Vec<OutRecv> = Vec::new();
            // As for sends: no more than rnicd's receive queue has room for
            // (a guest that posts beyond its queue's depth sees its ring
            // full); the rest go when receive completions free room.
            let room = qp.qp.recv_slots() as usize;
            while batch.len() < room {
                let Ok(Some(slot)) = ring_has_data(tail, i.rq.head, i.rq.wqe_cnt) else { break };
                let at = i.rq.offset + slot as u64 * i.rq.stride as u64;
                match read_recv(&guest, &i.pages, at, i.rq.stride, i.rq.max_sge) {
                    Ok((hdr, sges)) => {
                        batch.push(OutRecv { seq: i.rq.next_seq, hdr, sges });
                        i.rq.next_seq += 1;
                        i.rq.head = idx_inc(i.rq.head, i.rq.wqe_cnt);
                    }
                    Err(e) => {
                        let hdr = guest.read::<RqWqeHdr>(i.pages.gpa(at, 16).unwrap_or(0)).unwrap_or_default();
                        i.rq.head = idx_inc(i.rq.head, i.rq.wqe_cnt);
                        i.broken = true;
                        bad = Some((hdr.wr_id, e));
                        break;
                    }
                }
            }
            if !batch.is_empty() {
                let wrs: Vec<RecvWr> = batch.iter().map(|o| RecvWr { wr_id: o.seq, sg_list: sge_slice(&o.sges) }).collect();
                qp.qp.post_recv(&wrs).map_err(|_| Errno::ENOSPC)?;
                self.counters.rq_wqes += batch.len() as u64;
                qp.info.rq_out.extend(batch);
            }
            let head_at = qp.info.pages.gpa(qp.info.rq.ring_offset + 4, 4)?;
            guest.store_u32(head_at, qp.info.rq.head)?;
        }
        if let Some((wr_id, e)) = bad {
            self.counters.bad_wqes += 1;
            self.fail_qp(handle, false, wr_id, wc_opcode::RECV, bad_wqe_status(e));
            return Err(e);
        }
        Ok(())
    }

    /// A refused WQE: its error completion goes to the guest's CQ and the
    /// rnicd QP moves to ERR, so the WQEs before it flush as on hardware.
    fn fail_qp(&mut self, handle: u32, send: bool, wr_id: u64, opcode: u32, status: u32) {
        let Some(qp) = self.qps.get(handle) else { return };
        let attr = verbs::QpAttr { qp_state: verbs::QpState::Err, ..Default::default() };
        let _ = qp.qp.modify(&attr, verbs::mask::STATE);
        let cq = if send { qp.info.send_cq } else { qp.info.recv_cq };
        let cqe = Cqe { wr_id, qp: handle as u64, opcode, status, ..Default::default() };
        if let Some(c) = self.cqs.get_mut(cq) {
            c.ring.pending.push_back(cqe);
        }
        self.drain_cq(cq);
    }

    /// CQ ARM doorbell: notify on the next (solicited) completion.
    pub fn arm_cq(&mut self, handle: u32, solicited_only: bool) {
        let Some(cq) = self.cqs.get_mut(handle) else { return };
        cq.ring.armed = if solicited_only { CQ_FLAG_ARMED_SOL } else { CQ_FLAG_ARMED };
        cq.cq.req_notify(solicited_only);
        self.cq_armed.store(true, std::sync::atomic::Ordering::Release);
        if let Some(t) = &self.notifier_thread {
            t.unpark();
        }
    }

    /// Whether some guest CQ is armed (its notification still to come).
    pub fn any_cq_armed(&self) -> bool {
        self.cqs.iter().any(|(_, c)| c.ring.armed != 0)
    }

    /// Takes up to one batch of rnicd's completions of CQ `handle` into its
    /// pending list, however long it is; returns how many there were.
    fn pull_batch(&mut self, handle: u32) -> usize {
        self.pull_batch_noting(handle, usize::MAX, &mut Vec::new())
    }

    /// `pull_batch` while the pending list holds fewer than `bound`
    /// completions, adding to `freed` each QP and queue (true: send) whose
    /// completions freed room in rnicd's queues.
    fn pull_batch_noting(&mut self, handle: u32, bound: usize, freed: &mut Vec<(u32, bool)>) -> usize {
        let mut wcs = [Wc::default(); DRAIN_BATCH];
        let Some(cq) = self.cqs.get_mut(handle) else { return 0 };
        // With no room (want 0) the poll still runs: it takes nothing but
        // reports an overrun, which a guest that never takes its
        // completions would otherwise never hear of.
        let want = DRAIN_BATCH.min(bound.saturating_sub(cq.ring.pending.len()));
        let polled = match cq.cq.poll(&mut wcs[..want]) {
            Ok(n) => n,
            Err(_) => {
                // Overrun: the guest's CQ was smaller than what it had
                // outstanding. Its completions are lost and no more come,
                // so the guest hears of it as from hardware (CQ_ERR)
                // rather than waiting without end; once.
                if !cq.overran {
                    cq.overran = true;
                    self.counters.cq_overruns += 1;
                    self.async_event(ib::event::CQ_ERR, handle);
                }
                0
            }
        };
        for wc in &wcs[..polled] {
            let send = !matches!(wc.opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm);
            if let Some(qp) = self.qp_handle_of(wc.qp_num) {
                if !freed.contains(&(qp, send)) {
                    freed.push((qp, send));
                }
            }
            if let Some(cqe) = self.complete(wc) {
                if let Some(cq) = self.cqs.get_mut(handle) {
                    cq.ring.pending.push_back(cqe);
                }
            }
        }
        polled
    }

    /// Takes every completion rnicd holds for CQ `handle` (before a save:
    /// rnicd's CQ does not move, the pending list does).
    pub fn pull_cq(&mut self, handle: u32) {
        while self.pull_batch(handle) > 0 {}
    }

    /// Moves completions from rnicd's CQ (and completions waiting for room)
    /// into the guest's CQ ring. Returns how many reached the guest ring.
    pub fn drain_cq(&mut self, handle: u32) -> usize {
        if !self.bus_master {
            // Completions wait in rnicd until the guest ring may be written.
            return 0;
        }
        let guest = self.guest.clone();
        let mut freed = Vec::new();
        // Completions wait in rnicd once the guest's ring and as many again
        // are full: a guest that stops taking them then overruns rnicd's CQ
        // (CQ_ERR, above) instead of growing this list without end.
        let bound = self.cqs.get(handle).map_or(0, |c| c.ring.entries as usize);
        self.pull_batch_noting(handle, bound, &mut freed);
        // WQEs the guest queued while rnicd's queue was full. (A QP on an
        // SRQ has no receive ring of its own: the SRQ refills itself.)
        for (qp, send) in freed {
            let own_ring = send || self.srq_of_qp(qp).is_none();
            if own_ring && self.wqes_waiting(qp, send) {
                let _ = if send { self.post_sends(qp) } else { self.post_recvs(qp) };
            }
        }
        let Some(cq) = self.cqs.get_mut(handle) else { return 0 };
        let r = &mut cq.ring;
        let mut moved = 0;
        let head_at = r.pages.gpa(RING_STATE_RX_CONS_HEAD, 4);
        while let Some(cqe) = r.pending.front().copied() {
            let Ok(head) = head_at.and_then(|a| guest.load_u32(a)) else { break };
            let Ok(Some(slot)) = ring_has_space(r.tail, head, r.entries) else { break };
            let Ok(at) = r.pages.gpa(CQ_FIRST_CQE_OFFSET + slot as u64 * 64, 64) else { break };
            if guest.write(at, &cqe).is_err() {
                break;
            }
            r.tail = idx_inc(r.tail, r.entries);
            if r.pages.gpa(RING_STATE_RX_PROD_TAIL, 4).and_then(|a| guest.store_u32(a, r.tail)).is_err() {
                break;
            }
            r.pending.pop_front();
            moved += 1;
            self.counters.cqes += 1;
            if cqe.status != wc_status::SUCCESS {
                self.counters.error_cqes += 1;
            }
        }
        moved
    }

    /// Turns an rnicd completion into the guest's CQE: the QPN becomes the
    /// QP handle, the device's sequence number the guest's wr_id; the WQE
    /// copies it completes (unsignaled ones before it included) are dropped.
    fn complete(&mut self, wc: &Wc) -> Option<Cqe> {
        let handle = self.qp_handle_of(wc.qp_num)?;
        let recv = matches!(wc.opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm);
        let srq = if recv { self.srq_of_qp(handle) } else { None };
        let qp = self.qps.get_mut(handle)?;
        let wr_id = if let Some(srq) = srq {
            self.srq_completed(srq, wc.wr_id)?
        } else if recv {
            let pos = qp.info.rq_out.iter().position(|o| o.seq == wc.wr_id)?;
            let o = qp.info.rq_out.drain(..=pos).next_back()?;
            o.hdr.wr_id
        } else {
            let pos = qp.info.sq_out.iter().position(|o| o.seq == wc.wr_id)?;
            let o = qp.info.sq_out.drain(..=pos).next_back()?;
            o.hdr.wr_id
        };
        Some(Cqe {
            wr_id,
            qp: handle as u64,
            opcode: wc.opcode as u32,
            status: wc.status as u32,
            byte_len: wc.byte_len,
            imm_data: wc.imm_data.to_be(),
            src_qp: wc.src_qp,
            wc_flags: wc.wc_flags as u32,
            port_num: 1,
            ..Default::default()
        })
    }

    /// Drains every armed CQ that has completions and notifies the driver
    /// (the notifier thread, after rnicd's completion event).
    /// For a WAIT doorbell on CQ `handle`: whether the guest has something
    /// to look at (a completion in its ring, or a device or CQ that no
    /// longer serves doorbells). If not, rnicd's CQ is armed so that its
    /// next completion raises a channel event (the guest's own arming, for
    /// CQ notifications, stays as it was).
    pub fn cq_wait_done(&mut self, handle: u32) -> bool {
        if self.paused || !self.bus_master || self.regs.state != super::dev::DevState::Active {
            return true;
        }
        if self.drain_and_notify(handle) > 0 || !self.guest_cq_empty(handle) {
            return true;
        }
        let Some(cq) = self.cqs.get(handle) else { return true };
        cq.cq.req_notify(false);
        // A completion that landed before the arm raised no event.
        cq.cq.ready() > 0 && self.drain_and_notify(handle) > 0
    }

    /// Drains CQ `handle` into the guest ring; if the guest armed the CQ and
    /// completions arrived, it gets its CQ notification (whoever drained:
    /// the notifier thread or a vCPU in a WAIT doorbell).
    pub(super) fn drain_and_notify(&mut self, handle: u32) -> usize {
        let moved = self.drain_cq(handle);
        if moved > 0 {
            if let Some(c) = self.cqs.get_mut(handle).filter(|c| c.ring.armed != 0) {
                c.ring.armed = 0;
                self.cq_notify(handle);
            }
        }
        moved
    }

    /// Whether CQ `handle`'s guest ring holds no completion (true when it
    /// cannot be read: there is nothing for the guest to take there).
    fn guest_cq_empty(&self, handle: u32) -> bool {
        let Some(cq) = self.cqs.get(handle) else { return true };
        let r = &cq.ring;
        match r.pages.gpa(RING_STATE_RX_CONS_HEAD, 4).and_then(|a| self.guest.load_u32(a)) {
            Ok(head) => !matches!(ring_has_data(r.tail, head, r.entries), Ok(Some(_))),
            Err(_) => true,
        }
    }

    pub fn notify_armed(&mut self) {
        for h in self.cqs.handles() {
            if self.cqs.get(h).is_some_and(|c| c.ring.armed != 0) {
                self.drain_and_notify(h);
            }
        }
    }
}

/// Reads and checks one send WQE: header, opcode, SGE count.
fn read_send(
    guest: &super::guest::Guest,
    pages: &super::guest::PageList,
    at: u64,
    stride: u32,
    max_sge: u32,
) -> Result<(SqWqeHdr, Vec<Sge>), Errno> {
    let hdr: SqWqeHdr = guest.read(pages.gpa(at, stride as u64)?)?;
    if hdr.num_sge > max_sge {
        return Err(Errno::E2BIG);
    }
    match hdr.opcode {
        wr_opcode::RDMA_WRITE
        | wr_opcode::RDMA_WRITE_WITH_IMM
        | wr_opcode::SEND
        | wr_opcode::SEND_WITH_IMM
        | wr_opcode::RDMA_READ
        | wr_opcode::ATOMIC_CMP_AND_SWP
        | wr_opcode::ATOMIC_FETCH_AND_ADD => {}
        _ => return Err(Errno::ENOSYS),
    }
    let base = pages.gpa(at, stride as u64)?;
    let sges = (0..hdr.num_sge as u64).map(|k| guest.read::<Sge>(base + 80 + k * 16)).collect::<Result<Vec<_>, _>>()?;
    Ok((hdr, sges))
}

/// Reads and checks one receive WQE.
pub(crate) fn read_recv(
    guest: &super::guest::Guest,
    pages: &super::guest::PageList,
    at: u64,
    stride: u32,
    max_sge: u32,
) -> Result<(RqWqeHdr, Vec<Sge>), Errno> {
    let base = pages.gpa(at, stride as u64)?;
    let hdr: RqWqeHdr = guest.read(base)?;
    if hdr.num_sge > max_sge {
        return Err(Errno::E2BIG);
    }
    let sges = (0..hdr.num_sge as u64).map(|k| guest.read::<Sge>(base + 16 + k * 16)).collect::<Result<Vec<_>, _>>()?;
    Ok((hdr, sges))
}

pub(crate) fn sge_slice(s: &[Sge]) -> &[verbs::Sge] {
    // SAFETY: pvrdma_abi::Sge and rnic's Sge are both repr(C) {u64, u32, u32}
    // (asserted below), so a slice of one is a slice of the other.
    unsafe { std::slice::from_raw_parts(s.as_ptr() as *const verbs::Sge, s.len()) }
}
const _: () = assert!(std::mem::size_of::<verbs::Sge>() == std::mem::size_of::<Sge>());
const _: () = assert!(std::mem::align_of::<verbs::Sge>() == std::mem::align_of::<Sge>());

/// The rnicd WR for a copied guest WQE; its wr_id is the device's sequence.
pub(crate) fn to_send_wr(o: &OutSend) -> SendWr<'_> {
    let h = &o.hdr;
    let sg = sge_slice(&o.sges);
    let mut wr = match h.opcode {
        wr_opcode::RDMA_WRITE | wr_opcode::RDMA_WRITE_WITH_IMM => {
            let r = h.wr.rdma();
            SendWr::write(o.seq, sg, r.remote_addr, r.rkey)
        }
        wr_opcode::RDMA_READ => {
            let r = h.wr.rdma();
            SendWr::read(o.seq, sg, r.remote_addr, r.rkey)
        }
        wr_opcode::ATOMIC_CMP_AND_SWP => {
            let a = h.wr.atomic();
            SendWr::cmp_swap(o.seq, sg, a.remote_addr, a.rkey, a.compare_add, a.swap)
        }
        wr_opcode::ATOMIC_FETCH_AND_ADD => {
            let a = h.wr.atomic();
            SendWr::fetch_add(o.seq, sg, a.remote_addr, a.rkey, a.compare_add)
        }
        _ => SendWr::send(o.seq, sg),
    };
    if matches!(h.opcode, wr_opcode::RDMA_WRITE_WITH_IMM | wr_opcode::SEND_WITH_IMM) {
        // The guest posts immediate data big endian (__be32); rnicd takes it
        // in host order.
        wr = wr.with_imm(u32::from_be(h.ex));
    }
    debug_assert!(matches!(
        wr.opcode,
        WrOpcode::RdmaWrite
            | WrOpcode::RdmaWriteImm
            | WrOpcode::Send
            | WrOpcode::SendImm
            | WrOpcode::RdmaRead
            | WrOpcode::AtomicCmpSwp
            | WrOpcode::AtomicFetchAdd
    ));
    let mut flags = 0u8;
    if h.send_flags & ib_send::SIGNALED != 0 {
        flags |= verbs::send_flags::SIGNALED;
    }
    if h.send_flags & ib_send::FENCE != 0 {
        flags |= verbs::send_flags::FENCE;
    }
    if h.send_flags & ib_send::SOLICITED != 0 {
        flags |= verbs::send_flags::SOLICITED;
    }
    wr.flags = flags;
    wr
}

/// The CQE opcode of a send WQE's completion.
fn send_wc_opcode(op: u32) -> u32 {
    match op {
        wr_opcode::RDMA_WRITE | wr_opcode::RDMA_WRITE_WITH_IMM => wc_opcode::RDMA_WRITE,
        wr_opcode::RDMA_READ => wc_opcode::RDMA_READ,
        wr_opcode::ATOMIC_CMP_AND_SWP => wc_opcode::COMP_SWAP,
        wr_opcode::ATOMIC_FETCH_AND_ADD => wc_opcode::FETCH_ADD,
        _ => wc_opcode::SEND,
    }
}

/// Drops the copies of unsignaled send WQEs that rnicd has certainly
/// retired. rnicd holds at most its ring (the queue's depth) and as many
/// again taken from it, so a WQE with more than that many posted after it
/// is retired; an unsignaled one gets no completion, and no migration
/// reposts it. Without this, a guest that never signals would grow the
/// list without end (the copies go otherwise only with a later signaled
/// completion). Signaled copies stay until their completion is taken.
fn forget_retired_unsignaled(i: &mut QpInfo) {
    let retired = i.sq_out.len().saturating_sub(2 * i.sq.wqe_cnt as usize + 1);
    if retired == 0 || i.sq_sig_all {
        return;
    }
    let mut k = 0;
    i.sq_out.retain(|o| {
        k += 1;
        k > retired || o.hdr.send_flags & ib_send::SIGNALED != 0
    });
}
