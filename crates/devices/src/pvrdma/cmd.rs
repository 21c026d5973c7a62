//! Commands: REQUEST runs the command in the command slot and writes the
//! response slot. A command that fails sets ERR (what the Linux driver reads
//! right after REQUEST) and, when the slot could be read, also answers with
//! `hdr.err` set, so a driver that waits for the response sees it too.

use std::net::Ipv4Addr;

use pvrdma_abi as abi;
use pvrdma_abi::ib;
use pvrdma_abi::*;
use verbs::{Mtu, QpState};

use super::dev::{Dev, DevState, GID_TBL_LEN, MAX_CQE, MAX_QP_WR, MAX_SGE};
use super::objects::{Cq, CqRing, Mr, MrInfo, Pd, Qp, QpInfo, Uc, WqQueue};
use super::Errno;

const PAGE: u64 = PAGE_SIZE as u64;

/// A response's bytes (its header is filled in by `request`).
fn resp<T: Pod>(v: T) -> Vec<u8> {
    v.as_bytes().to_vec()
}

impl Dev {
    /// REQUEST written.
    pub fn request(&mut self) {
        self.counters.commands += 1;
        let r = self.run_command();
        self.regs.err = match r {
            Ok(()) => 0,
            Err(e) => {
                self.counters.command_errors += 1;
                e as u32
            }
        };
    }

    fn run_command(&mut self) -> Result<(), Errno> {
        // Without bus mastering the command slot cannot be read.
        if self.regs.state != DevState::Active || self.paused || !self.bus_master {
            return Err(Errno::EPERM);
        }
        let (cmd_slot, resp_slot) = self.dsr.as_ref().map(|d| (d.cmd_slot, d.resp_slot)).ok_or(Errno::EPERM)?;
        let hdr: CmdHdr = self.guest.read(cmd_slot)?;
        let result = self.dispatch(hdr.cmd, cmd_slot);
        let (mut body, err) = match result {
            Ok(b) => (b, 0u8),
            Err(e) => (vec![0u8; std::mem::size_of::<CmdRespHdr>()], e as u8),
        };
        let rh = CmdRespHdr { response: hdr.response, ack: resp_code(hdr.cmd), err, reserved: [0; 3] };
        body[..std::mem::size_of::<CmdRespHdr>()].copy_from_slice(rh.as_bytes());
        self.guest.mem_write(resp_slot, &body)?;
        self.raise(INTR_VECTOR_RESPONSE);
        match err {
            0 => Ok(()),
            e => Err(Errno::from_u8(e)),
        }
    }

    fn dispatch(&mut self, cmd: u32, slot: u64) -> Result<Vec<u8>, Errno> {
        match cmd {
            CMD_QUERY_PORT => self.query_port(self.guest.read(slot)?),
            CMD_QUERY_PKEY => self.query_pkey(self.guest.read(slot)?),
            CMD_CREATE_PD => self.create_pd(self.guest.read(slot)?),
            CMD_DESTROY_PD => self.destroy_pd(self.guest.read(slot)?),
            CMD_CREATE_MR => self.create_mr(self.guest.read(slot)?),
            CMD_DESTROY_MR => self.destroy_mr(self.guest.read(slot)?),
            CMD_CREATE_CQ => self.create_cq(self.guest.read(slot)?),
            CMD_RESIZE_CQ => self.resize_cq(self.guest.read(slot)?),
            CMD_DESTROY_CQ => self.destroy_cq(self.guest.read(slot)?),
            CMD_CREATE_QP => self.create_qp(self.guest.read(slot)?),
            CMD_MODIFY_QP => self.modify_qp(self.guest.read(slot)?),
            CMD_QUERY_QP => self.query_qp(self.guest.read(slot)?),
            CMD_DESTROY_QP => self.destroy_qp(self.guest.read(slot)?),
            CMD_CREATE_UC => self.create_uc(self.guest.read(slot)?),
            CMD_DESTROY_UC => self.destroy_uc(self.guest.read(slot)?),
            CMD_CREATE_BIND => self.create_bind(self.guest.read(slot)?),
            CMD_DESTROY_BIND => self.destroy_bind(self.guest.read(slot)?),
            CMD_CREATE_SRQ => self.create_srq(self.guest.read(slot)?),
            CMD_MODIFY_SRQ => self.modify_srq(self.guest.read(slot)?),
            CMD_QUERY_SRQ => self.query_srq(self.guest.read(slot)?),
            CMD_DESTROY_SRQ => self.destroy_srq(self.guest.read(slot)?),
            _ => Err(Errno::EINVAL),
        }
    }

    fn query_port(&mut self, c: CmdQueryPort) -> Result<Vec<u8>, Errno> {
        if c.port_num != 1 {
            return Err(Errno::EINVAL);
        }
        let active = self.be.ctx.query_port(1).map(|p| p.active_mtu.bytes()).unwrap_or(1024).min(4096);
        let attrs = PortAttr {
            state: ib::port_state::ACTIVE,
            max_mtu: ib::mtu::MTU_4096,
            active_mtu: mtu_to_ib(active),
            gid_tbl_len: GID_TBL_LEN,
            port_cap_flags: ib::port_cap::CM_SUP | ib::port_cap::IP_BASED_GIDS,
            max_msg_sz: 1 << 31,
            pkey_tbl_len: 1,
            active_width: 1,
            active_speed: 1,
            phys_state: 5, // LinkUp
            ..Default::default()
        };
        Ok(resp(CmdQueryPortResp { hdr: Default::default(), attrs }))
    }

    fn query_pkey(&mut self, c: CmdQueryPkey) -> Result<Vec<u8>, Errno> {
        if c.port_num != 1 || c.index != 0 {
            return Err(Errno::EINVAL);
        }
        Ok(resp(CmdQueryPkeyResp { hdr: Default::default(), pkey: 0xffff, reserved: [0; 6] }))
    }

    fn check_ctx(&self, ctx_handle: u32) -> Result<(), Errno> {
        if ctx_handle == 0 || self.ucs.contains(ctx_handle) {
            Ok(())
        } else {
            Err(Errno::EINVAL)
        }
    }

    fn create_uc(&mut self, c: CmdCreateUc) -> Result<Vec<u8>, Errno> {
        let h = self.ucs.free_handle().ok_or(Errno::ENOMEM)?;
        self.ucs.insert(h, Uc { pfn: c.pfn64 });
        Ok(resp(CmdCreateUcResp { hdr: Default::default(), ctx_handle: h, reserved: [0; 4] }))
    }

    fn destroy_uc(&mut self, c: CmdDestroyUc) -> Result<Vec<u8>, Errno> {
        self.ucs.remove(c.ctx_handle).ok_or(Errno::EINVAL)?;
        Ok(resp(CmdRespHdr::default()))
    }

    fn create_pd(&mut self, c: CmdCreatePd) -> Result<Vec<u8>, Errno> {
        self.check_ctx(c.ctx_handle)?;
        let h = self.pds.free_handle().ok_or(Errno::ENOMEM)?;
        let pd = self.be.ctx.alloc_pd().map_err(|_| Errno::ENOMEM)?;
        self.pds.insert(h, Pd { ctx_handle: c.ctx_handle, pd });
        Ok(resp(CmdCreatePdResp { hdr: Default::default(), pd_handle: h, reserved: [0; 4] }))
    }

    fn destroy_pd(&mut self, c: CmdDestroyPd) -> Result<Vec<u8>, Errno> {
        if !self.pds.contains(c.pd_handle) {
            return Err(Errno::EINVAL);
        }
        let used = self.mrs.iter().any(|(_, m)| m.info.pd_handle == c.pd_handle)
            || self.qps.iter().any(|(_, q)| q.info.pd_handle == c.pd_handle)
            || self.srqs.iter().any(|(_, s)| s.info.pd_handle == c.pd_handle);
        if used {
            return Err(Errno::EBUSY);
        }
        self.pds.remove(c.pd_handle);
        Ok(resp(CmdRespHdr::default()))
    }

    fn create_mr(&mut self, c: CmdCreateMr) -> Result<Vec<u8>, Errno> {
        let pd = self.pds.get(c.pd_handle).ok_or(Errno::EINVAL)?;
        if c.access_flags & !(ib::access::LOCAL_WRITE | ib::access::REMOTE_WRITE | ib::access::REMOTE_READ | ib::access::REMOTE_ATOMIC) != 0
        {
            return Err(Errno::EINVAL);
        }
        let (start, length, runs) = if c.flags & MR_FLAG_FRMR != 0 {
            // Fast registration needs page lists rnicd cannot map (bmme_flags 0).
            return Err(Errno::ENOSYS);
        } else if c.flags & MR_FLAG_DMA != 0 {
            // All of guest RAM, addressed by guest-physical address.
            (0, self.ram_size, vec![(0, self.ram_size)])
        } else {
            if c.flags != 0 || c.length == 0 || c.nchunks == 0 {
                return Err(Errno::EINVAL);
            }
            let pages = self.guest.resolve_pdir(c.pdir_dma, c.nchunks)?;
            // Byte 0 sits at the start's offset in the first page; the
            // pages may be anywhere in guest RAM.
            let runs = pages.runs(c.start % PAGE, c.length).ok_or(Errno::EINVAL)?;
            // rnicd takes a bounded run list (docs/pvrdma.md).
            if runs.len() > verbs::MAX_REGION_RUNS {
                return Err(Errno::ENOMEM);
            }
            (c.start, c.length, runs)
        };
        let info = MrInfo { pd_handle: c.pd_handle, start, length, access: c.access_flags, flags: c.flags, runs, key: 0 };
        if !info.runs_valid(self.ram_size) || start.checked_add(length).is_none() {
            return Err(Errno::EFAULT);
        }
        let mr = pd.pd.reg_mr_runs(&self.be.ram, &info.runs, c.access_flags, None, start).map_err(|_| Errno::EINVAL)?;
        let h = self.mrs.free_handle().ok_or(Errno::ENOMEM)?;
        // While migrating, rnicd's writes into it must reach the dirty log.
        self.start_mr_trace(&mr).map_err(|_| Errno::ENOMEM)?;
        let key = mr.lkey;
        self.mrs.insert(h, Mr { info: MrInfo { key, ..info }, mr });
        Ok(resp(CmdCreateMrResp { hdr: Default::default(), mr_handle: h, lkey: key, rkey: key, reserved: [0; 4] }))
    }

    fn destroy_mr(&mut self, c: CmdDestroyMr) -> Result<Vec<u8>, Errno> {
        let m = self.mrs.remove(c.mr_handle).ok_or(Errno::EINVAL)?;
        if self.tracing && !self.testing.no_traces {
            // Its last writes go to the dirty log before the trace goes.
            let mut traced = std::mem::take(&mut self.traced);
            self.fetch_mr_trace(&m.mr, &m.info, &mut traced);
            self.traced = traced;
        }
        Ok(resp(CmdRespHdr::default()))
    }

    fn create_cq(&mut self, c: CmdCreateCq) -> Result<Vec<u8>, Errno> {
        self.check_ctx(c.ctx_handle)?;
        if !c.cqe.is_power_of_two() || c.cqe > MAX_CQE || c.nchunks < cq_pages(c.cqe) || c.nchunks > cq_pages(MAX_CQE) {
            return Err(Errno::EINVAL);
        }
        let pages = self.guest.resolve_pdir(c.pdir_dma, c.nchunks)?;
        let tail = self.guest.load_u32(pages.gpa(RING_STATE_RX_PROD_TAIL, 4)?)?;
        let tail = if idx_valid(tail, c.cqe) { tail } else { 0 };
        let h = self.cqs.free_handle().ok_or(Errno::ENOMEM)?;
        let cq = self.be.ctx.create_cq(c.cqe, Some(&self.be.channel)).map_err(|_| Errno::ENOMEM)?;
        let ring = CqRing { ctx_handle: c.ctx_handle, entries: c.cqe, pages, tail, armed: 0, pending: Default::default() };
        self.cqs.insert(h, Cq { ring, cq, overran: false });
        Ok(resp(CmdCreateCqResp { hdr: Default::default(), cq_handle: h, cqe: c.cqe }))
    }

    /// RESIZE_CQ carries no new pages: the device accepts a size the CQ's
    /// pages hold, while the guest ring and rnicd's are empty, and restarts
    /// the ring indices at 0.
    fn resize_cq(&mut self, c: CmdResizeCq) -> Result<Vec<u8>, Errno> {
        let guest = self.guest.clone();
        let cq = self.cqs.get_mut(c.cq_handle).ok_or(Errno::EINVAL)?;
        if !c.cqe.is_power_of_two() || c.cqe > cq.cq.cap || cq_pages(c.cqe) as u64 > cq.ring.pages.pages.len() as u64 {
            return Err(Errno::EINVAL);
        }
        let head = guest.load_u32(cq.ring.pages.gpa(RING_STATE_RX_CONS_HEAD, 4)?)?;
        if head != cq.ring.tail || !cq.ring.pending.is_empty() {
            return Err(Errno::EBUSY);
        }
        cq.ring.entries = c.cqe;
        cq.ring.tail = 0;
        guest.store_u32(cq.ring.pages.gpa(RING_STATE_RX_CONS_HEAD, 4)?, 0)?;
        guest.store_u32(cq.ring.pages.gpa(RING_STATE_RX_PROD_TAIL, 4)?, 0)?;
        Ok(resp(CmdResizeCqResp { hdr: Default::default(), cqe: c.cqe, reserved: [0; 4] }))
    }

    fn destroy_cq(&mut self, c: CmdDestroyCq) -> Result<Vec<u8>, Errno> {
        if !self.cqs.contains(c.cq_handle) {
            return Err(Errno::EINVAL);
        }
        if self.qps.iter().any(|(_, q)| q.info.send_cq == c.cq_handle || q.info.recv_cq == c.cq_handle) {
            return Err(Errno::EBUSY);
        }
        self.cqs.remove(c.cq_handle);
        Ok(resp(CmdRespHdr::default()))
    }

    fn create_qp(&mut self, c: CmdCreateQp) -> Result<Vec<u8>, Errno> {
        if c.qp_type != ib::qp_type::RC {
            // UD, UC and GSI QPs are not implemented.
            return Err(Errno::ENOSYS);
        }
        // A QP on an SRQ (in its PD) has no receive queue of its own: the
        // driver sends max_recv_wr and max_recv_sge 0 and no RQ pages.
        let srq = match c.is_srq {
            0 => None,
            _ => match self.srqs.get(c.srq_handle) {
                Some(s) if s.info.pd_handle == c.pd_handle => Some(c.srq_handle),
                _ => return Err(Errno::EINVAL),
            },
        };
        let (max_recv_wr, max_recv_sge) = if srq.is_some() { (0, 0) } else { (c.max_recv_wr, c.max_recv_sge) };
        let wr_ok = |n: u32| n.is_power_of_two() && n <= MAX_QP_WR;
        let sge_ok = |n: u32| (1..=MAX_SGE).contains(&n);
        let rq_ok = srq.is_some() || (wr_ok(max_recv_wr) && sge_ok(max_recv_sge));
        if !wr_ok(c.max_send_wr) || !sge_ok(c.max_send_sge) || !rq_ok {
            return Err(Errno::EINVAL);
        }
        let pd = self.pds.get(c.pd_handle).ok_or(Errno::EINVAL)?;
        let scq = self.cqs.get(c.send_cq_handle).ok_or(Errno::EINVAL)?;
        let rcq = self.cqs.get(c.recv_cq_handle).ok_or(Errno::EINVAL)?;
        let sq_stride = sq_wqe_stride(c.max_send_sge);
        let rq_stride = rq_wqe_stride(max_recv_sge);
        let send_chunks = c.send_chunks as u32;
        let total = c.total_chunks as u32;
        // The queues' pages and at most as many again (a driver may round
        // up): each QP's page list is kept, and saved with the device.
        let (sq_pages, rq_pages) = (queue_pages(c.max_send_wr, sq_stride), queue_pages(max_recv_wr, rq_stride));
        if sq_pages > send_chunks
            || total < QP_NUM_HEADER_PAGES + send_chunks
            || rq_pages > total - QP_NUM_HEADER_PAGES - send_chunks
            || total > QP_NUM_HEADER_PAGES + 2 * (sq_pages + rq_pages)
        {
            return Err(Errno::EINVAL);
        }
        let pages = self.guest.resolve_pdir(c.pdir_dma, total)?;
        let h = self.qps.free_handle().ok_or(Errno::ENOMEM)?;
        let mut init = verbs::QpInitAttr::new(&scq.cq, &rcq.cq);
        init.cap = verbs::QpCap { max_send_wr: c.max_send_wr, max_recv_wr, max_send_sge: c.max_send_sge, max_recv_sge, max_inline_data: 0 };
        init.sq_sig_all = c.sq_sig_all != 0;
        let qp = pd.pd.create_qp(&init).map_err(|_| Errno::ENOMEM)?;
        if let Some(s) = srq.and_then(|h| self.srqs.get(h)) {
            qp.attach_srq(&s.srq).map_err(|_| Errno::EINVAL)?;
        }
        let queue = |wqe_cnt, max_sge, stride: usize, offset, ring_offset| WqQueue {
            wqe_cnt,
            max_sge,
            stride: stride as u32,
            offset,
            ring_offset,
            head: 0,
            next_seq: 0,
        };
        let mut info = QpInfo {
            qpn: qp.qpn,
            pd_handle: c.pd_handle,
            send_cq: c.send_cq_handle,
            recv_cq: c.recv_cq_handle,
            sq_sig_all: c.sq_sig_all != 0,
            sq: queue(c.max_send_wr, c.max_send_sge, sq_stride, QP_NUM_HEADER_PAGES as u64 * PAGE, QP_SQ_RING_OFFSET),
            rq: queue(max_recv_wr, max_recv_sge, rq_stride, (QP_NUM_HEADER_PAGES + send_chunks) as u64 * PAGE, QP_RQ_RING_OFFSET),
            pages,
            attr: QpAttr::default(),
            broken: false,
            sq_out: Default::default(),
            rq_out: Default::default(),
        };
        // Consume from wherever the driver's rings start (zero for a new QP).
        for q in [&mut info.sq, &mut info.rq] {
            let head = info.pages.gpa(q.ring_offset + 4, 4).and_then(|a| self.guest.load_u32(a)).unwrap_or(0);
            q.head = if idx_valid(head, q.wqe_cnt) { head } else { 0 };
        }
        let qpn = qp.qpn;
        self.qps.insert(h, Qp { info, qp });
        if let Some(s) = srq.and_then(|s| self.srqs.get_mut(s)) {
            s.info.qps.push(h);
        }
        Ok(resp(CmdCreateQpRespV2 {
            hdr: Default::default(),
            qpn,
            qp_handle: h,
            max_send_wr: c.max_send_wr,
            max_recv_wr,
            max_send_sge: c.max_send_sge,
            max_recv_sge,
            max_inline_data: 0,
            pad: 0,
        }))
    }

    fn modify_qp(&mut self, c: CmdModifyQp) -> Result<Vec<u8>, Errno> {
        let guest = self.guest.clone();
        let qp = self.qps.get_mut(c.qp_handle).ok_or(Errno::EINVAL)?;
        let a = &c.attrs;
        let mask = c.attr_mask & ib::qp_attr_mask::ALL;
        let mut v = verbs::QpAttr {
            qp_access_flags: a.qp_access_flags,
            pkey_index: a.pkey_index,
            port_num: a.port_num,
            dest_qp_num: a.dest_qp_num,
            rq_psn: a.rq_psn,
            sq_psn: a.sq_psn,
            max_rd_atomic: a.max_rd_atomic,
            max_dest_rd_atomic: a.max_dest_rd_atomic,
            min_rnr_timer: a.min_rnr_timer,
            timeout: a.timeout,
            retry_cnt: a.retry_cnt,
            rnr_retry: a.rnr_retry,
            ..Default::default()
        };
        if mask & ib::qp_attr_mask::STATE != 0 {
            v.qp_state = qp_state_from_ib(a.qp_state).ok_or(Errno::EINVAL)?;
        }
        if mask & ib::qp_attr_mask::PATH_MTU != 0 {
            v.path_mtu = ib::mtu::bytes(a.path_mtu).and_then(|b| Mtu::from_bytes(b as usize)).ok_or(Errno::EINVAL)?;
        }
        if mask & ib::qp_attr_mask::AV != 0 {
            let ip = a.ah_attr.grh.dgid.ipv4().ok_or(Errno::EINVAL)?;
            v.dest_gid = Ipv4Addr::from(ip);
        }
        if a.qp_access_flags & !0xf != 0 && mask & ib::qp_attr_mask::ACCESS_FLAGS != 0 {
            return Err(Errno::EINVAL);
        }
        qp.qp.modify(&v, mask).map_err(|_| Errno::EINVAL)?;
        // The address vector stays that of the modify that set it (RTR),
        // not the zeros of later ones: a migration's early section tells
        // the destination the peer from it (early.rs).
        let av = if mask & ib::qp_attr_mask::AV != 0 { a.ah_attr } else { qp.info.attr.ah_attr };
        qp.info.attr = *a;
        qp.info.attr.ah_attr = av;
        if mask & ib::qp_attr_mask::STATE != 0 && a.qp_state == ib::qp_state::RESET {
            // The driver resets its rings with the QP: so does the device.
            let i = &mut qp.info;
            for q in [&mut i.sq, &mut i.rq] {
                q.head = 0;
                let _ = i.pages.gpa(q.ring_offset + 4, 4).and_then(|a| guest.store_u32(a, 0));
            }
            i.sq_out.clear();
            i.rq_out.clear();
            i.broken = false;
        }
        Ok(resp(CmdRespHdr::default()))
    }

    fn query_qp(&mut self, c: CmdQueryQp) -> Result<Vec<u8>, Errno> {
        let qp = self.qps.get(c.qp_handle).ok_or(Errno::EINVAL)?;
        let (v, _) = qp.qp.query().map_err(|_| Errno::EINVAL)?;
        let i = &qp.info;
        let mut a = QpAttr {
            qp_state: v.qp_state as u32,
            cur_qp_state: v.qp_state as u32,
            path_mtu: mtu_to_ib(v.path_mtu.bytes().min(4096)),
            rq_psn: v.rq_psn,
            sq_psn: v.sq_psn,
            dest_qp_num: v.dest_qp_num,
            qp_access_flags: v.qp_access_flags,
            pkey_index: v.pkey_index,
            sq_draining: v.sq_draining as u8,
            max_rd_atomic: v.max_rd_atomic,
            max_dest_rd_atomic: v.max_dest_rd_atomic,
            min_rnr_timer: v.min_rnr_timer,
            port_num: v.port_num,
            timeout: v.timeout,
            retry_cnt: v.retry_cnt,
            rnr_retry: v.rnr_retry,
            cap: abi::QpCap {
                max_send_wr: i.sq.wqe_cnt,
                max_recv_wr: i.rq.wqe_cnt,
                max_send_sge: i.sq.max_sge,
                max_recv_sge: i.rq.max_sge,
                max_inline_data: 0,
                reserved: 0,
            },
            ..Default::default()
        };
        a.ah_attr.grh.dgid = Gid::from_ipv4(v.dest_gid.octets());
        a.ah_attr.grh.hop_limit = 64;
        a.ah_attr.ah_flags = 1; // GRH
        a.ah_attr.port_num = 1;
        Ok(resp(CmdQueryQpResp { hdr: Default::default(), attrs: a }))
    }

    fn destroy_qp(&mut self, c: CmdDestroyQp) -> Result<Vec<u8>, Errno> {
        let q = self.qps.get(c.qp_handle).ok_or(Errno::EINVAL)?;
        // Its completions still in rnicd are matched to the QP (and its
        // SRQ's posted WQEs) only while it exists: take them first.
        let cqs = [q.info.send_cq, q.info.recv_cq];
        for cq in cqs {
            self.pull_cq(cq);
        }
        self.qps.remove(c.qp_handle).ok_or(Errno::EINVAL)?;
        // rnicd gave the SRQ back any receive the QP had taken.
        if let Some(s) = self.srq_of_qp(c.qp_handle).and_then(|s| self.srqs.get_mut(s)) {
            s.info.qps.retain(|q| *q != c.qp_handle);
        }
        Ok(resp(CmdDestroyQpResp { hdr: Default::default(), events_reported: 0, reserved: [0; 4] }))
    }

    fn create_bind(&mut self, c: CmdCreateBind) -> Result<Vec<u8>, Errno> {
        if c.index >= GID_TBL_LEN {
            return Err(Errno::EINVAL);
        }
        self.gids.insert(c.index, c.new_gid);
        Ok(resp(CmdRespHdr::default()))
    }

    fn destroy_bind(&mut self, c: CmdDestroyBind) -> Result<Vec<u8>, Errno> {
        if c.index >= GID_TBL_LEN || self.gids.remove(&c.index).is_none() {
            return Err(Errno::EINVAL);
        }
        Ok(resp(CmdRespHdr::default()))
    }
}

pub(crate) fn mtu_to_ib(bytes: usize) -> u32 {
    match bytes {
        256 => ib::mtu::MTU_256,
        512 => ib::mtu::MTU_512,
        1024 => ib::mtu::MTU_1024,
        2048 => ib::mtu::MTU_2048,
        _ => ib::mtu::MTU_4096,
    }
}

pub(crate) fn qp_state_from_ib(s: u32) -> Option<QpState> {
    Some(match s {
        ib::qp_state::RESET => QpState::Reset,
        ib::qp_state::INIT => QpState::Init,
        ib::qp_state::RTR => QpState::Rtr,
        ib::qp_state::RTS => QpState::Rts,
        ib::qp_state::SQD => QpState::Sqd,
        ib::qp_state::SQE => QpState::Sqe,
        ib::qp_state::ERR => QpState::Err,
        _ => return None,
    })
}
