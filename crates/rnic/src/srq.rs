//! Shared receive queues (ibv_srq): one ring of receive WQEs that every QP
//! attached to it takes from, instead of each QP's own receive queue.
//!
//! The ring is an ordinary RQ ring (`ring`) in a memfd of the client, which
//! posts into it without a system call. rnicd takes a WQE only when a message
//! that needs one arrives at an attached QP (the responder's receive-WQE
//! fetch, `qp::srq`), so WQEs go to QPs in arrival order and none sits idle
//! in a QP that gets no traffic. An empty SRQ makes the responder answer
//! with an RNR NAK, as an empty receive queue does.
//!
//! Limit: with `limit` armed (non-zero), the take that leaves fewer than
//! `limit` WQEs posted raises SRQ_LIMIT_REACHED for the owner and disarms it
//! (ibv_modify_srq re-arms), as IBTA and Linux rxe do.
//!
//! Migration: a WQE a QP took but has not started filling goes back to the
//! SRQ when that QP is suspended, reset or destroyed (`give_back`), ahead of
//! the ring. [`SrqSnapshot`] is the SRQ's state once its QPs are suspended:
//! how many WQEs rnicd took from the ring since creation (the owner reposts
//! the ones after those) and the given-back WQEs, which rnicd holds itself.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

use crate::mem::Mapping;
use crate::objects::ClientId;
use crate::qp_snapshot::SavedRecv;
use crate::ring::{RecvWqe, Ring, Sge, MAX_SGE};

/// Most SRQs per namespace and most WQEs per SRQ.
pub const MAX_SRQ: u32 = 1 << 12;
pub const MAX_SRQ_WR: u32 = 1 << 14;

/// Version of [`SrqSnapshot`]; bump on any change of its meaning.
pub const SRQ_SNAPSHOT_VERSION: u32 = 1;

/// An SRQ's attributes (ibv_srq_attr).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SrqAttr {
    pub max_wr: u32,
    pub max_sge: u32,
    pub srq_limit: u32,
}

/// The state of an SRQ whose QPs are all suspended (see the module doc).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SrqSnapshot {
    pub version: u32,
    pub attr: SrqAttr,
    /// WQEs taken from the ring since the SRQ was first created: the owner
    /// reposts its posted WQEs from this one on into the new SRQ's ring.
    pub taken: u64,
    /// WQEs given back by QPs, handed out before the ring's.
    pub returned: Vec<SavedRecv>,
}

pub struct Srq {
    pub id: u32,
    pub owner: ClientId,
    pub pd: u32,
    pub attr: SrqAttr,
    ring: Ring<RecvWqe>,
    _map: Mapping,
    returned: VecDeque<RecvWqe>,
    taken: u64,
}

/// What the QPs hold: the engine and every attached QP share the SRQ; one
/// engine thread uses it at a time, so the lock is never contended.
pub type SharedSrq = Arc<Mutex<Srq>>;

pub fn lock(s: &SharedSrq) -> MutexGuard<'_, Srq> {
    s.lock().unwrap_or_else(|e| e.into_inner())
}

/// A WQE handed to a QP.
pub enum Taken {
    Wqe(RecvWqe),
    /// More SGEs than the SRQ allows: the QP completes it with an error.
    Bad(RecvWqe),
}

impl Srq {
    pub fn new(id: u32, owner: ClientId, pd: u32, attr: SrqAttr, ring: (Ring<RecvWqe>, Mapping)) -> Srq {
        Srq { id, owner, pd, attr, ring: ring.0, _map: ring.1, returned: VecDeque::new(), taken: 0 }
    }

    /// WQEs posted and not yet taken.
    pub fn posted(&self) -> u32 {
        self.returned.len() as u32 + self.ring.ready()
    }

    /// The oldest posted WQE, and whether taking it crossed the armed limit
    /// (the caller raises the event; the limit is now disarmed).
    pub fn take(&mut self) -> Option<(Taken, bool)> {
        let r = match self.returned.pop_front() {
            Some(r) => r,
            None => {
                let r = self.ring.pop()?;
                self.taken += 1;
                r
            }
        };
        let hit = self.attr.srq_limit > 0 && self.posted() < self.attr.srq_limit;
        if hit {
            self.attr.srq_limit = 0;
        }
        let t = if r.num_sge > self.attr.max_sge { Taken::Bad(r) } else { Taken::Wqe(r) };
        Some((t, hit))
    }

    /// A WQE a QP took and will not use goes first again.
    pub fn give_back(&mut self, r: RecvWqe) {
        self.returned.push_front(r);
    }

    /// ibv_modify_srq: only the limit (0 disarms); resizing is refused, as
    /// by most hardware drivers.
    pub fn set_limit(&mut self, limit: u32) -> Result<(), String> {
        if limit > self.attr.max_wr {
            return Err(format!("SRQ limit {limit} exceeds max_wr {}", self.attr.max_wr));
        }
        self.attr.srq_limit = limit;
        Ok(())
    }

    pub fn snapshot(&self) -> SrqSnapshot {
        SrqSnapshot {
            version: SRQ_SNAPSHOT_VERSION,
            attr: self.attr,
            taken: self.taken,
            returned: self.returned.iter().map(save_recv).collect(),
        }
    }

    /// Takes a saved state into a new SRQ, which has the same attributes.
    pub fn restore(&mut self, s: &SrqSnapshot) -> Result<(), String> {
        if s.version != SRQ_SNAPSHOT_VERSION {
            return Err(format!("SRQ state version {} (this rnicd reads {SRQ_SNAPSHOT_VERSION})", s.version));
        }
        if s.returned.len() > self.attr.max_wr as usize || s.attr.srq_limit > self.attr.max_wr {
            return Err("SRQ state holds more than max_wr WQEs".into());
        }
        let returned = s.returned.iter().map(|r| load_recv(r, self.attr.max_sge)).collect::<Result<VecDeque<_>, _>>()?;
        self.returned = returned;
        self.taken = s.taken;
        self.attr.srq_limit = s.attr.srq_limit;
        Ok(())
    }
}

pub fn save_recv(r: &RecvWqe) -> SavedRecv {
    let n = (r.num_sge as usize).min(MAX_SGE);
    SavedRecv { wr_id: r.wr_id, sge: r.sge[..n].iter().map(|s| (s.addr, s.length, s.lkey)).collect() }
}

/// A saved WQE back into ring form; refused if it has more than `max_sge` SGEs.
pub fn load_recv(s: &SavedRecv, max_sge: u32) -> Result<RecvWqe, String> {
    if s.sge.len() > (max_sge as usize).min(MAX_SGE) {
        return Err(format!("a saved receive WQE has {} SGEs, more than {max_sge}", s.sge.len()));
    }
    let mut r = RecvWqe { wr_id: s.wr_id, num_sge: s.sge.len() as u32, ..Default::default() };
    for (d, &(addr, length, lkey)) in r.sge.iter_mut().zip(&s.sge) {
        *d = Sge { addr, length, lkey };
    }
    Ok(r)
}
