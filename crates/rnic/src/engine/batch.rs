//! CreateBatch: many MRs, CQs and QPs in one control request, all or
//! nothing. A migrated device recreates its whole namespace with a few of
//! these inside the downtime instead of one round trip per object.

use std::os::fd::OwnedFd;

use anyhow::{anyhow, bail, Context as _};

use super::{Engine, MrRequest, QpRequest};
use crate::objects::ClientId;
use crate::proto::{self, Create, Reply};

/// What one item made, to take it back if a later one fails.
enum Made {
    Mr(u32),
    Cq(u32),
    Qp(u32),
}

impl Engine {
    /// Creates `items` in order, each as its own request would; each names
    /// the memfd (an index into `fds`) and the offset it lives at. If one
    /// fails, the ones made before it are destroyed and the error names it.
    pub(super) fn create_batch(&mut self, client: ClientId, items: Vec<Create>, fds: &[OwnedFd]) -> anyhow::Result<Reply> {
        if items.len() > proto::MAX_CREATE_BATCH {
            bail!("at most {} objects per CreateBatch", proto::MAX_CREATE_BATCH);
        }
        let mut made = Vec::with_capacity(items.len());
        let mut replies = Vec::with_capacity(items.len());
        for (i, item) in items.into_iter().enumerate() {
            match self.create_one(client, item, fds) {
                Ok((m, r)) => {
                    made.push(m);
                    replies.push(r);
                }
                Err(e) => {
                    self.unmake(made);
                    return Err(e.context(format!("item {i} of the batch (nothing of it was kept)")));
                }
            }
        }
        Ok(Reply::Created(replies))
    }

    fn create_one(&mut self, client: ClientId, item: Create, fds: &[OwnedFd]) -> anyhow::Result<(Made, Reply)> {
        let fd = |i: u8| fds.get(i as usize).ok_or_else(|| anyhow!("names memfd {i}, the request carries {}", fds.len()));
        match item {
            Create::Mr { pd, iova, access, fd: f, runs, key } => {
                let r = self.reg_mr(client, MrRequest::over_runs(pd, iova, access, runs, key)?, fd(f)?)?;
                let Reply::Mr { lkey, .. } = r else { bail!("RegMr made no MR") };
                Ok((Made::Mr(lkey), r))
            }
            Create::Cq { cap, channel, fd: f, ring_offset } => {
                ring_aligned(ring_offset)?;
                let r = self.create_cq(client, cap, channel, (fd(f)?, ring_offset))?;
                let Reply::Cq(h) = r else { bail!("CreateCq made no CQ") };
                Ok((Made::Cq(h), r))
            }
            Create::Qp {
                pd,
                send_cq,
                recv_cq,
                cap,
                sq_sig_all,
                sq_slots,
                rq_slots,
                qpn,
                restore,
                qp_type,
                fd: f,
                sq_offset,
                rq_offset,
                await_state,
                peer,
            } => {
                ring_aligned(sq_offset)?;
                ring_aligned(rq_offset)?;
                let ring = fd(f)?;
                let q = QpRequest { pd, send_cq, recv_cq, cap, sq_sig_all, sq_slots, rq_slots, qpn, qp_type, await_state, peer };
                let r = self.create_qp(client, q, restore, (ring, sq_offset), (ring, rq_offset)).context("QP")?;
                let Reply::Qp { qpn, .. } = r else { bail!("CreateQp made no QP") };
                Ok((Made::Qp(qpn), r))
            }
        }
    }

    /// Destroys what a failed batch made, last first (QPs before the CQs
    /// they name).
    fn unmake(&mut self, made: Vec<Made>) {
        for m in made.into_iter().rev() {
            match m {
                Made::Mr(k) => {
                    self.keys.remove(k);
                }
                Made::Cq(h) => {
                    self.cqs.remove(&h);
                }
                Made::Qp(q) => self.remove_qp(q),
            }
        }
    }
}

/// Rings are shared with the client and hold atomics: page aligned.
fn ring_aligned(offset: u64) -> anyhow::Result<()> {
    if !offset.is_multiple_of(4096) {
        bail!("ring offset {offset:#x} is not page aligned");
    }
    Ok(())
}
