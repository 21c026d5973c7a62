//! Shared receive queue verbs (crate::srq): create, modify, query, destroy,
//! attach a QP, and the saved state for migration.

use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, bail, Context as _};

use super::{is_connected, map_ring, Engine};
use crate::objects::ClientId;
use crate::proto::Reply;
use crate::ring::{RecvWqe, MAX_SGE};
use crate::srq::{self, SharedSrq, Srq, SrqAttr, SrqSnapshot, MAX_SRQ, MAX_SRQ_WR};

impl Engine {
    fn owned_srq(&self, client: ClientId, id: u32) -> anyhow::Result<&SharedSrq> {
        self.srqs.get(&id).filter(|s| srq::lock(s).owner == client).ok_or_else(|| anyhow!("no SRQ {id}"))
    }

    pub(super) fn create_srq(
        &mut self,
        client: ClientId,
        pd: u32,
        attr: SrqAttr,
        slots: u32,
        restore: Option<SrqSnapshot>,
        fds: &[OwnedFd],
    ) -> anyhow::Result<Reply> {
        self.owned_pd(client, pd)?;
        let fd = fds.first().context("CreateSrq needs a ring memfd")?;
        if self.srqs.len() as u32 >= MAX_SRQ {
            bail!("this namespace already holds {MAX_SRQ} SRQs");
        }
        if attr.max_wr == 0 || attr.max_wr > MAX_SRQ_WR || attr.max_sge == 0 || attr.max_sge as usize > MAX_SGE {
            bail!("an SRQ holds 1..={MAX_SRQ_WR} WQEs of 1..={MAX_SGE} SGEs, not {} of {}", attr.max_wr, attr.max_sge);
        }
        if attr.srq_limit > attr.max_wr {
            bail!("SRQ limit {} exceeds max_wr {}", attr.srq_limit, attr.max_wr);
        }
        if !slots.is_power_of_two() || slots < attr.max_wr || slots > 2 * MAX_SRQ_WR {
            bail!("the SRQ ring must have a power-of-two number of slots, at least max_wr");
        }
        let ring = map_ring::<RecvWqe>((fd, 0), slots, "SRQ")?;
        let id = self.alloc_id();
        let mut s = Srq::new(id, client, pd, attr, ring);
        if let Some(st) = &restore {
            s.restore(st).map_err(|e| anyhow!("create SRQ from a saved state: {e}"))?;
        }
        let attr = s.attr;
        self.srqs.insert(id, Arc::new(Mutex::new(s)));
        Ok(Reply::Srq { srq: id, attr })
    }

    pub(super) fn modify_srq(&mut self, client: ClientId, id: u32, max_wr: Option<u32>, limit: Option<u32>) -> anyhow::Result<Reply> {
        let s = self.owned_srq(client, id)?;
        let mut s = srq::lock(s);
        if max_wr.is_some() {
            bail!("resizing an SRQ is not supported");
        }
        if let Some(l) = limit {
            s.set_limit(l).map_err(|e| anyhow!(e))?;
        }
        Ok(Reply::Ok)
    }

    pub(super) fn query_srq(&self, client: ClientId, id: u32) -> anyhow::Result<Reply> {
        Ok(Reply::SrqAttr(srq::lock(self.owned_srq(client, id)?).attr))
    }

    pub(super) fn destroy_srq(&mut self, client: ClientId, id: u32) -> anyhow::Result<Reply> {
        let s = self.owned_srq(client, id)?;
        if self.qps.values().any(|q| q.uses_srq(s)) {
            bail!("SRQ {id} is busy: QPs still use it");
        }
        self.srqs.remove(&id);
        Ok(Reply::Ok)
    }

    pub(super) fn attach_srq(&mut self, client: ClientId, qpn: u32, id: u32) -> anyhow::Result<Reply> {
        let s = self.owned_srq(client, id)?.clone();
        let qp = self.owned_qp(client, qpn)?;
        if srq::lock(&s).pd != qp.pd {
            bail!("SRQ {id} and QP {qpn:#x} are in different PDs");
        }
        qp.attach_srq(id, s).map_err(|e| anyhow!(e))?;
        Ok(Reply::Ok)
    }

    pub(super) fn query_srq_state(&self, client: ClientId, id: u32) -> anyhow::Result<Reply> {
        let s = self.owned_srq(client, id)?;
        // Only a connected QP can hold one of the SRQ's WQEs (RESET gives
        // it back, ERR flushes it, INIT takes none): those must be
        // suspended for the state to be still.
        if self.qps.values().any(|q| q.uses_srq(s) && is_connected(q) && !q.suspended) {
            bail!("SRQ {id} has connected QPs that are not suspended");
        }
        Ok(Reply::SrqState(srq::lock(s).snapshot()))
    }

    /// Whether a QP or SRQ is in `pd` (it cannot go).
    pub(super) fn pd_has_srq(&self, pd: u32) -> bool {
        self.srqs.values().any(|s| srq::lock(s).pd == pd)
    }
}
