//! Shared receive queues: CREATE/MODIFY/QUERY/DESTROY_SRQ, the SRQ
//! doorbell, receive completions of QPs created with `is_srq`, the limit
//! event, and an SRQ's part of the saved state.
//!
//! An SRQ is an rnicd SRQ (`verbs::Srq`) in the device's namespace. Its
//! guest ring is laid out as rdma-core's `vmw_pvrdma` provider makes it:
//! page 0 holds a ring state whose `rx` ring the driver produces into
//! (`prod_tail`) and the device consumes (`cons_head`); receive WQEs start
//! at page 1. The SRQ doorbell (`UAR_SRQ_RECV | handle` at `UAR_SRQ_OFFSET`)
//! makes the device copy the new WQEs and post them to rnicd's SRQ, whose
//! wr_id is the device's sequence number; rnicd hands them to the attached
//! QPs in the order messages arrive. The device holds at most the guest
//! ring's size in rnicd: the rest stays in the guest ring (its `cons_head`
//! not advanced) and is taken as completions come back.
//!
//! Limit (ARM LIMIT, `srq_limit`): the device counts a WQE as posted until
//! its completion leaves rnicd's CQ; when that count (plus WQEs still in the
//! guest ring) drops below the limit it raises SRQ_LIMIT_REACHED with the
//! SRQ's handle once and disarms, as IBTA requires.

use pvrdma_abi::ib;
use pvrdma_abi::*;
use serde::{Deserialize, Serialize};
use verbs::{RecvWr, SrqSnapshot};

use super::datapath::{read_recv, sge_slice};
use super::dev::{Dev, MAX_SRQ_SGE, MAX_SRQ_WR};
use super::objects::{OutRecv, Srq, SrqInfo, WqQueue};
use super::Errno;

const PAGE: u64 = PAGE_SIZE as u64;

/// How many entries a ring of `n` (a power of two) holds between `head`
/// and `tail`, both valid indices.
fn ring_count(tail: u32, head: u32, n: u32) -> u32 {
    tail.wrapping_sub(head) & (2 * n - 1)
}

impl Dev {
    pub(super) fn create_srq(&mut self, c: CmdCreateSrq) -> Result<Vec<u8>, Errno> {
        let a = c.attrs;
        if c.srq_type != ib::srq_type::BASIC
            || !a.max_wr.is_power_of_two()
            || a.max_wr > MAX_SRQ_WR
            || !(1..=MAX_SRQ_SGE).contains(&a.max_sge)
            || a.srq_limit > a.max_wr
        {
            return Err(Errno::EINVAL);
        }
        let stride = rq_wqe_stride(a.max_sge);
        let need = 1 + queue_pages(a.max_wr, stride);
        // rdma-core gives the ring twice the WQE pages it needs.
        if c.nchunks < need || c.nchunks > 2 * need {
            return Err(Errno::EINVAL);
        }
        let pd = self.pds.get(c.pd_handle).ok_or(Errno::EINVAL)?;
        let pages = self.guest.resolve_pdir(c.pdir_dma, c.nchunks)?;
        let h = self.srqs.free_handle().ok_or(Errno::ENOMEM)?;
        let attr = verbs::SrqAttr { max_wr: a.max_wr, max_sge: a.max_sge, srq_limit: 0 };
        let srq = pd.pd.create_srq(&attr).map_err(|_| Errno::ENOMEM)?;
        let mut rq = WqQueue {
            wqe_cnt: a.max_wr,
            max_sge: a.max_sge,
            stride: stride as u32,
            offset: PAGE,
            ring_offset: RING_STATE_RX_PROD_TAIL,
            head: 0,
            next_seq: 0,
        };
        // Consume from wherever the driver's ring starts (zero for a new SRQ).
        let head = pages.gpa(RING_STATE_RX_CONS_HEAD, 4).and_then(|g| self.guest.load_u32(g)).unwrap_or(0);
        rq.head = if idx_valid(head, rq.wqe_cnt) { head } else { 0 };
        let info =
            SrqInfo { pd_handle: c.pd_handle, pages, rq, limit: a.srq_limit, broken: false, qps: Vec::new(), out: Default::default() };
        self.srqs.insert(h, Srq { info, srq });
        Ok(CmdCreateSrqResp { hdr: Default::default(), srqn: h, reserved: [0; 4] }.as_bytes().to_vec())
    }

    /// Only the limit can change (Linux sends nothing else); resizing is
    /// refused, as by most hardware.
    pub(super) fn modify_srq(&mut self, c: CmdModifySrq) -> Result<Vec<u8>, Errno> {
        let s = self.srqs.get_mut(c.srq_handle).ok_or(Errno::EINVAL)?;
        let known = ib::srq_attr_mask::MAX_WR | ib::srq_attr_mask::LIMIT;
        if c.attr_mask & !known != 0 || c.attr_mask & ib::srq_attr_mask::MAX_WR != 0 {
            return Err(Errno::EINVAL);
        }
        if c.attr_mask & ib::srq_attr_mask::LIMIT != 0 {
            if c.attrs.srq_limit > s.info.rq.wqe_cnt {
                return Err(Errno::EINVAL);
            }
            s.info.limit = c.attrs.srq_limit;
        }
        Ok(CmdRespHdr::default().as_bytes().to_vec())
    }

    pub(super) fn query_srq(&mut self, c: CmdQuerySrq) -> Result<Vec<u8>, Errno> {
        let s = self.srqs.get(c.srq_handle).ok_or(Errno::EINVAL)?;
        let attrs = SrqAttr { max_wr: s.info.rq.wqe_cnt, max_sge: s.info.rq.max_sge, srq_limit: s.info.limit, reserved: 0 };
        Ok(CmdQuerySrqResp { hdr: Default::default(), attrs }.as_bytes().to_vec())
    }

    /// Refused (EBUSY) while a QP uses the SRQ.
    pub(super) fn destroy_srq(&mut self, c: CmdDestroySrq) -> Result<Vec<u8>, Errno> {
        let s = self.srqs.get(c.srq_handle).ok_or(Errno::EINVAL)?;
        if !s.info.qps.is_empty() {
            return Err(Errno::EBUSY);
        }
        self.srqs.remove(c.srq_handle);
        Ok(CmdRespHdr::default().as_bytes().to_vec())
    }

    /// The SRQ QP `qp_handle` takes its receives from.
    pub(super) fn srq_of_qp(&self, qp_handle: u32) -> Option<u32> {
        self.srqs.iter().find(|(_, s)| s.info.qps.contains(&qp_handle)).map(|(h, _)| *h)
    }

    /// An SRQ whose ring is unusable: the device stops reading it and the
    /// driver hears of it through an SRQ_ERR async event.
    fn srq_fatal(&mut self, handle: u32) {
        if let Some(s) = self.srqs.get_mut(handle) {
            if !s.info.broken {
                s.info.broken = true;
                self.async_event(ib::event::SRQ_ERR, handle);
            }
        }
    }

    /// The guest's producer index of SRQ `handle`, checked.
    fn srq_tail(&self, handle: u32) -> Result<u32, Errno> {
        let s = self.srqs.get(handle).ok_or(Errno::EINVAL)?;
        let tail = self.guest.load_u32(s.info.pages.gpa(s.info.rq.ring_offset, 4)?)?;
        if !idx_valid(tail, s.info.rq.wqe_cnt) {
            return Err(Errno::ERANGE);
        }
        Ok(tail)
    }

    /// SRQ doorbell (and room made by completions): the new WQEs of the
    /// guest's ring, as many as rnicd's SRQ has room for, are checked,
    /// copied and posted. Ring indices outside [0, 2N) or a WQE with too
    /// many SGEs stop the SRQ with SRQ_ERR; the WQEs before a bad one are
    /// posted.
    pub(super) fn post_srq_recvs(&mut self, handle: u32) -> Result<(), Errno> {
        if self.srqs.get(handle).ok_or(Errno::EINVAL)?.info.broken {
            return Err(Errno::EIO);
        }
        let tail = match self.srq_tail(handle) {
            Ok(t) => t,
            Err(e) => {
                self.srq_fatal(handle);
                return Err(e);
            }
        };
        let guest = self.guest.clone();
        let s = self.srqs.get_mut(handle).ok_or(Errno::EINVAL)?;
        let i = &mut s.info;
        let room = (i.rq.wqe_cnt as usize).saturating_sub(i.out.len());
        let mut batch: Vec<OutRecv> = Vec::new();
        let mut bad = None;
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
                    i.rq.head = idx_inc(i.rq.head, i.rq.wqe_cnt);
                    bad = Some(e);
                    break;
                }
            }
        }
        if !batch.is_empty() {
            let wrs: Vec<RecvWr> = batch.iter().map(|o| RecvWr { wr_id: o.seq, sg_list: sge_slice(&o.sges) }).collect();
            s.srq.post_recv(&wrs).map_err(|_| Errno::ENOSPC)?;
            self.counters.rq_wqes += batch.len() as u64;
            s.info.out.extend(batch);
        }
        let head_at = s.info.pages.gpa(s.info.rq.ring_offset + 4, 4)?;
        guest.store_u32(head_at, s.info.rq.head)?;
        if let Some(e) = bad {
            self.counters.bad_wqes += 1;
            self.srq_fatal(handle);
            return Err(e);
        }
        Ok(())
    }

    /// A receive of SRQ `handle` completed (`seq`, rnicd's wr_id): the
    /// guest's wr_id. Raises the limit event when the posted count drops
    /// below an armed limit, and takes WQEs left in the guest ring now
    /// that rnicd has room.
    pub(super) fn srq_completed(&mut self, handle: u32, seq: u64) -> Option<u64> {
        let s = self.srqs.get_mut(handle)?;
        let pos = s.info.out.iter().position(|o| o.seq == seq)?;
        let wr_id = s.info.out.remove(pos)?.hdr.wr_id;
        let tail = self.srq_tail(handle).ok();
        let s = self.srqs.get_mut(handle)?;
        let unread = tail.map_or(0, |t| ring_count(t, s.info.rq.head, s.info.rq.wqe_cnt));
        let posted = s.info.out.len() as u32 + unread;
        if s.info.limit > 0 && posted < s.info.limit {
            s.info.limit = 0;
            self.async_event(ib::event::SRQ_LIMIT_REACHED, handle);
        }
        if unread > 0 && !self.paused {
            if let Err(e) = self.post_srq_recvs(handle) {
                self.regs.err = e as u32;
            }
        }
        Some(wr_id)
    }
}

/// An SRQ in the saved state: the guest side and rnicd's part (what it
/// took from its ring and what its suspended QPs gave back).
#[derive(Serialize, Deserialize)]
pub(super) struct SavedSrq {
    handle: u32,
    info: SrqInfo,
    state: SrqSnapshot,
}

/// Every SRQ's state, the device paused (its QPs suspended). An SRQ whose
/// QPs are not all suspended in rnicd (none connected: in RESET, INIT or
/// ERR, so none holds one of its WQEs) has rnicd taking nothing from it:
/// its state then says that everything not yet complete is still in the
/// ring.
pub(super) fn save(d: &Dev) -> Vec<SavedSrq> {
    d.srqs
        .iter()
        .map(|(h, s)| {
            let state = s.srq.query_state().unwrap_or_else(|_| SrqSnapshot {
                version: verbs::SRQ_SNAPSHOT_VERSION,
                attr: verbs::SrqAttr { max_wr: s.info.rq.wqe_cnt, max_sge: s.info.rq.max_sge, srq_limit: 0 },
                taken: s.info.out.front().map_or(s.info.rq.next_seq, |o| o.seq),
                returned: Vec::new(),
            });
            SavedSrq { handle: *h, info: s.info.clone(), state }
        })
        .collect()
}

/// The SRQs of a saved state, made in rnicd from their states before the
/// QPs (the PDs exist): each hands out what its QPs gave back first, then
/// the WQEs rnicd had not taken, reposted in their order.
pub(super) fn restore(d: &mut Dev, saved: Vec<SavedSrq>) -> Result<(), String> {
    for s in saved {
        let pd = d.pds.get(s.info.pd_handle).ok_or_else(|| format!("SRQ {} names a missing PD", s.handle))?;
        let attr = verbs::SrqAttr { max_wr: s.info.rq.wqe_cnt, max_sge: s.info.rq.max_sge, srq_limit: 0 };
        let srq = pd.pd.create_srq_restored(&attr, &s.state).map_err(|e| format!("SRQ {}: {e:#}", s.handle))?;
        let wrs: Vec<RecvWr> =
            s.info.out.iter().filter(|o| o.seq >= s.state.taken).map(|o| RecvWr { wr_id: o.seq, sg_list: sge_slice(&o.sges) }).collect();
        if !wrs.is_empty() {
            srq.post_recv(&wrs).map_err(|e| format!("SRQ {}: reposting receives: {e:#}", s.handle))?;
        }
        d.srqs.insert(s.handle, Srq { info: s.info, srq });
    }
    Ok(())
}

/// Attaches each restored QP that the state puts on an SRQ (before a QP
/// that was not connected is moved out of RESET).
pub(super) fn attach_restored<'a>(d: &Dev, qps: impl Iterator<Item = (u32, &'a verbs::Qp)>) -> Result<(), String> {
    for (h, qp) in qps {
        if let Some(s) = d.srq_of_qp(h).and_then(|sh| d.srqs.get(sh)) {
            qp.attach_srq(&s.srq).map_err(|e| format!("QP {:#x} on its SRQ: {e:#}", qp.qpn))?;
        }
    }
    Ok(())
}
