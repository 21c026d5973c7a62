//! The QP side of shared receive queues (`crate::srq`): a QP attached to an
//! SRQ never reads its own receive ring; its responder takes one WQE from
//! the SRQ when a message that needs one arrives, and holds at most that one.

use super::{Ctx, Qp};
use crate::async_events::{AsyncEvent, AsyncKind};
use crate::ring::{Cqe, RecvWqe};
use crate::srq::{self, SharedSrq, Taken};
use crate::types::{QpState, WcOpcode, WcStatus};

impl Qp {
    /// Makes the QP take its receives from `srq` (ibv_create_qp with
    /// `init_attr.srq`): while it is in RESET with nothing posted, or when
    /// it was just created suspended.
    pub fn attach_srq(&mut self, id: u32, srq: SharedSrq) -> Result<(), String> {
        if self.srq.is_some() {
            return Err(format!("QP {:#x} already has an SRQ", self.qpn));
        }
        if !(self.attr.qp_state == QpState::Reset || self.suspended) {
            return Err(format!("an SRQ is attached to a QP in RESET, not {:?}", self.attr.qp_state));
        }
        // Receives already taken from its own ring would be given back to
        // the SRQ (`give_back_srq_wqe`) and reach other QPs. A QP restored
        // in the middle of a SEND holds the SRQ WQE it was filling (the
        // state's `srq_wqe`, put in `rq`): that one is the SRQ's already
        // and the responder goes on filling it.
        let restored_wqe = usize::from(self.suspended && self.rt.in_send);
        if self.rq_ring.ready() > 0 || self.rq.len() > restored_wqe {
            return Err("the QP has receives posted on its own queue".into());
        }
        self.srq = Some((id, srq));
        Ok(())
    }

    /// The SRQ the QP takes its receives from.
    pub fn srq_id(&self) -> Option<u32> {
        self.srq.as_ref().map(|s| s.0)
    }

    /// The next receive WQE from the SRQ into `rq`. WQEs with too many SGEs
    /// complete with an error (as a bad WQE of the QP's own queue does).
    pub(super) fn take_srq_wqe(&mut self, ctx: &mut Ctx) {
        if let Some(r) = self.pop_srq(ctx) {
            self.rq.push_back(r);
        }
    }

    /// One WQE from the SRQ (None when it is empty), raising the limit
    /// event if this take crossed the armed limit.
    pub(super) fn pop_srq(&mut self, ctx: &mut Ctx) -> Option<RecvWqe> {
        let (id, s) = self.srq.as_ref()?;
        // Bad WQEs complete in error and the next is taken, at most a
        // ring's worth per call (a client may keep writing bad ones).
        let mut left = srq::lock(s).posted();
        loop {
            if left == 0 {
                return None;
            }
            left -= 1;
            let (t, limit_hit) = srq::lock(s).take()?;
            if limit_hit {
                ctx.asyncs.raise(self.owner, AsyncEvent { kind: AsyncKind::SrqLimitReached, object: *id });
            }
            match t {
                Taken::Wqe(r) => return Some(r),
                Taken::Bad(r) => self.complete_bad_recv(ctx, r.wr_id),
            }
        }
    }

    /// The QP stops (suspend, reset, destroy): a WQE it took but has not
    /// started filling goes back to the SRQ for another QP.
    pub(crate) fn give_back_srq_wqe(&mut self) {
        let Some((_, s)) = &self.srq else { return };
        if self.rt.in_send {
            return;
        }
        let mut s = srq::lock(s);
        while let Some(r) = self.rq.pop_back() {
            s.give_back(r);
        }
    }

    /// Whether `srq` is this QP's SRQ.
    pub fn uses_srq(&self, srq: &SharedSrq) -> bool {
        self.srq.as_ref().is_some_and(|(_, s)| std::sync::Arc::ptr_eq(s, srq))
    }
}

impl Qp {
    /// A receive WQE that cannot be used (too many SGEs), from the QP's own
    /// queue or its SRQ: counted, and completed with LOC_QP_OP_ERR.
    pub(super) fn complete_bad_recv(&self, ctx: &mut Ctx, wr_id: u64) {
        ctx.stats.bad_wqes += 1;
        let cqe = Cqe { wr_id, qp_num: self.qpn, status: WcStatus::LocQpOpErr as u8, opcode: WcOpcode::Recv as u8, ..Default::default() };
        ctx.complete(self.recv_cq, cqe, false);
    }
}
