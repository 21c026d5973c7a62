//! Shared receive queues (ibv_srq, rnic's `srq`): a receive ring that every
//! QP attached to it takes its receive WQEs from. Posting writes the shared
//! ring only; rnicd reads it when a message arrives, so no doorbell is rung.

use std::os::fd::AsRawFd;
use std::sync::Mutex;

use anyhow::{anyhow, bail, Context as _};
use rnic::mem::{sealed_memfd, Mapping};
use rnic::proto::{Reply, Request};
/// Most SGEs of an SRQ's WR.
pub use rnic::ring::MAX_SGE as MAX_SRQ_SGE;
use rnic::ring::{ring_bytes, RecvWqe, Ring, MAX_SGE};
pub use rnic::srq::{SrqAttr, SrqSnapshot, MAX_SRQ, MAX_SRQ_WR, SRQ_SNAPSHOT_VERSION};

use crate::{push_recv_wqes, queue_room, Context, Pd, PostError, Qp, RecvWr};

pub struct Srq {
    ctx: Context,
    handle: u32,
    max_wr: u32,
    max_sge: u32,
    ring: Mutex<Ring<RecvWqe>>,
    _map: Mapping,
    /// rnicd destroyed it already (`destroy`): the drop only frees the
    /// mapping and the context.
    destroyed: bool,
}

impl Pd {
    /// ibv_create_srq: `attr.max_wr` WQEs of up to `attr.max_sge` SGEs; a
    /// non-zero `attr.srq_limit` arms the limit event.
    pub fn create_srq(&self, attr: &SrqAttr) -> anyhow::Result<Srq> {
        self.create_srq_inner(attr, None)
    }

    /// An SRQ from the state of one saved elsewhere (`Srq::query_state`),
    /// with the same attributes: it hands out the WQEs its QPs gave back
    /// first; repost the WRs posted after the `taken` first ones.
    pub fn create_srq_restored(&self, attr: &SrqAttr, state: &SrqSnapshot) -> anyhow::Result<Srq> {
        self.create_srq_inner(attr, Some(state.clone()))
    }

    fn create_srq_inner(&self, attr: &SrqAttr, restore: Option<SrqSnapshot>) -> anyhow::Result<Srq> {
        if attr.max_wr == 0 || attr.max_wr > MAX_SRQ_WR || attr.max_sge as usize > MAX_SGE {
            bail!("an SRQ holds 1..={MAX_SRQ_WR} WRs of up to {MAX_SGE} SGEs");
        }
        let slots = attr.max_wr.next_power_of_two();
        let len = ring_bytes::<RecvWqe>(slots);
        let fd = sealed_memfd("transit-srq", len)?;
        let map = Mapping::map(&fd, 0, len)?;
        map.populate_first(rnic::ring::FIRST_USE_BYTES);
        // SAFETY: a mapping of the ring's size, kept in the Srq.
        let ring = unsafe { Ring::new(map.ptr(), len, slots) }.context("ring")?;
        let attr = SrqAttr { max_sge: attr.max_sge.max(1), ..*attr };
        let req = Request::CreateSrq { pd: self.handle, attr, slots, restore };
        match self.ctx.inner.call(&req, &[fd.as_raw_fd()])? {
            Reply::Srq { srq, attr } => Ok(Srq {
                ctx: self.ctx.clone(),
                handle: srq,
                max_wr: attr.max_wr,
                max_sge: attr.max_sge,
                ring: Mutex::new(ring),
                _map: map,
                destroyed: false,
            }),
            r => bail!("unexpected reply {r:?}"),
        }
    }
}

impl Srq {
    pub fn handle(&self) -> u32 {
        self.handle
    }

    pub fn context(&self) -> &Context {
        &self.ctx
    }

    pub fn max_sge(&self) -> u32 {
        self.max_sge
    }

    /// The queue's depth (max_wr as created).
    pub fn max_wr(&self) -> u32 {
        self.max_wr
    }

    /// WRs that can be posted now before the queue is full.
    pub fn free_slots(&self) -> u32 {
        queue_room(&self.ring.lock().unwrap_or_else(|e| e.into_inner()), self.max_wr)
    }

    /// ibv_post_srq_recv: posts in order; stops at the first WR that has
    /// too many SGEs or finds the queue full (the error says which).
    pub fn post_recv(&self, wrs: &[RecvWr]) -> anyhow::Result<()> {
        self.try_post_recv(wrs).map_err(|e| e.error)
    }

    /// As `post_recv`, the error saying how many WRs went in: the chain is
    /// posted under one hold of the queue's lock, as a driver does, so
    /// that with threads posting at once it names the first WR not posted.
    pub fn try_post_recv(&self, wrs: &[RecvWr]) -> Result<(), PostError> {
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        let room = queue_room(&ring, self.max_wr) as usize;
        let (posted, stop) = push_recv_wqes(&mut ring, wrs, self.max_sge, room);
        drop(ring);
        match stop {
            None => Ok(()),
            Some(s) => Err(PostError::stopped(posted, s, "shared receive queue")),
        }
    }

    /// ibv_modify_srq with IBV_SRQ_LIMIT: arms the limit event (0 disarms).
    pub fn set_limit(&self, limit: u32) -> anyhow::Result<()> {
        self.call(Request::ModifySrq { srq: self.handle, max_wr: None, srq_limit: Some(limit) }).map(|_| ())
    }

    /// ibv_query_srq.
    pub fn query(&self) -> anyhow::Result<SrqAttr> {
        match self.call(Request::QuerySrq { srq: self.handle })? {
            Reply::SrqAttr(a) => Ok(a),
            r => bail!("unexpected reply {r:?}"),
        }
    }

    /// The SRQ's state once every QP using it is suspended.
    pub fn query_state(&self) -> anyhow::Result<SrqSnapshot> {
        match self.call(Request::QuerySrqState { srq: self.handle })? {
            Reply::SrqState(s) => Ok(s),
            r => bail!("unexpected reply {r:?}"),
        }
    }

    /// ibv_destroy_srq; refused while a QP uses it.
    pub fn destroy(self) -> Result<(), (Srq, anyhow::Error)> {
        match self.call(Request::DestroySrq { srq: self.handle }) {
            Ok(_) => {
                let mut gone = self;
                gone.destroyed = true;
                Ok(())
            }
            Err(e) => Err((self, e)),
        }
    }

    fn call(&self, req: Request) -> anyhow::Result<Reply> {
        self.ctx.inner.call(&req, &[])
    }
}

impl Drop for Srq {
    fn drop(&mut self) {
        if self.destroyed {
            return;
        }
        self.ctx.inner.destroy(&Request::DestroySrq { srq: self.handle });
    }
}

impl Qp {
    /// Makes the QP (in RESET, or just created suspended) take its
    /// receives from `srq` (ibv_qp_init_attr.srq).
    pub fn attach_srq(&self, srq: &Srq) -> anyhow::Result<()> {
        match self.ctx.inner.call(&Request::AttachSrq { qpn: self.qpn, srq: srq.handle }, &[])? {
            Reply::Ok => Ok(()),
            r => Err(anyhow!("unexpected reply {r:?}")),
        }
    }
}
