//! The early section: the device's slow-changing part, sent by a migration
//! ahead of the switch so that the destination builds it while RAM moves.
//!
//! Saved (while the VM runs): PDs, MRs (keys, I/O addresses, RAM runs),
//! CQs (their sizes) and the connected QPs' shape (QPN, PD, CQs, ring
//! sizes), not their runtime state. The destination makes them in its
//! namespace with the same keys and QPNs: the QPs suspended with no state
//! (`verbs::NewObject::QpAwaitingState`), their rings allocated and
//! populated. Nothing of it answers a peer: the QPs are suspended, and the
//! GID is not on the destination's host before the commit.
//!
//! The section also carries the CQ rings and connected QPs whole (their
//! guest pages and ring layout), so that the state at the switch can name
//! only what changed since (`delta.rs`): the source keeps the section it
//! sent, the destination the one it received.
//!
//! At the switch the state arrives (whole, or as a delta over this
//! section) and `persist::restore_into` keeps every prepared object the
//! state still has unchanged, drops the others first (an object the source
//! destroyed, or one whose handle now names another), makes what the
//! source created since, and loads the QPs' states into the kept QPs with
//! one `LoadQpStates` request.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::time::Instant;

use pvrdma_abi::ib;
use serde::{Deserialize, Serialize};
use snapshot::{Result, Section, StateError};

use super::dev::Dev;
use super::objects::{CqRing, MrInfo, QpInfo};
use super::persist::{decode_checked, encode_checked};

/// Version of the early section (bincode with a CRC32, as the state).
/// 2: CQ rings and connected QPs whole (1 had their sizes and shapes).
const EARLY_VERSION: u32 = 2;

/// What a QP is, apart from its runtime state: what the destination
/// builds it from, and what must not have changed for it to be kept.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct QpShape {
    pub qpn: u32,
    pub pd_handle: u32,
    pub send_cq: u32,
    pub recv_cq: u32,
    pub sq_sig_all: bool,
    pub sq_wqe_cnt: u32,
    pub rq_wqe_cnt: u32,
    pub sq_max_sge: u32,
    pub rq_max_sge: u32,
}

impl QpShape {
    pub fn of(info: &QpInfo) -> QpShape {
        QpShape {
            qpn: info.qpn,
            pd_handle: info.pd_handle,
            send_cq: info.send_cq,
            recv_cq: info.recv_cq,
            sq_sig_all: info.sq_sig_all,
            sq_wqe_cnt: info.sq.wqe_cnt,
            rq_wqe_cnt: info.rq.wqe_cnt,
            sq_max_sge: info.sq.max_sge,
            rq_max_sge: info.rq.max_sge,
        }
    }

    /// The creation attributes rnicd makes the QP with.
    pub fn init(&self, scq: &verbs::Cq, rcq: &verbs::Cq) -> verbs::QpInitAttr {
        let mut init = verbs::QpInitAttr::new(scq, rcq);
        init.cap = verbs::QpCap {
            max_send_wr: self.sq_wqe_cnt,
            max_recv_wr: self.rq_wqe_cnt,
            max_send_sge: self.sq_max_sge,
            max_recv_sge: self.rq_max_sge,
            max_inline_data: 0,
        };
        init.sq_sig_all = self.sq_sig_all;
        init
    }
}

#[derive(Serialize, Deserialize)]
pub(crate) struct Early {
    pub gid: Ipv4Addr,
    /// (handle, user context handle).
    pub pds: Vec<(u32, u32)>,
    pub mrs: Vec<(u32, MrInfo)>,
    pub cqs: Vec<(u32, CqRing)>,
    /// The QPs that are connected (the guest last moved them to RTR, RTS
    /// or SQD): those the switch gives a state to.
    pub qps: Vec<(u32, QpInfo)>,
}

/// What a destination built from an early section, by the guest's handles,
/// with what each was built from. Dropped, each object is destroyed in
/// rnicd: the fields are in the order that takes them apart (QPs before
/// the CQs and PD they name).
#[derive(Default)]
pub(crate) struct Prepared {
    pub qps: HashMap<u32, (QpShape, verbs::Qp)>,
    pub mrs: HashMap<u32, (MrInfo, verbs::Mr)>,
    pub cqs: HashMap<u32, (u32, verbs::Cq)>,
    pub pds: HashMap<u32, verbs::Pd>,
    /// How long each part took (ms), shown with the switch's phases.
    pub phases: Vec<(String, f64)>,
}

fn connected(info: &QpInfo) -> bool {
    matches!(info.attr.qp_state, ib::qp_state::RTR | ib::qp_state::RTS | ib::qp_state::SQD)
}

/// The early section of a running device, and what it holds (which the
/// switch's delta is taken against); `None` if it has no objects.
pub(crate) fn save(name: &str, d: &Dev) -> Option<(Section, Early)> {
    if d.pds.len() == 0 {
        return None;
    }
    let early = Early {
        gid: d.gid,
        pds: d.pds.iter().map(|(h, p)| (*h, p.ctx_handle)).collect(),
        mrs: d.mrs.iter().map(|(h, m)| (*h, m.info.clone())).collect(),
        cqs: d.cqs.iter().map(|(h, c)| (*h, c.ring.clone())).collect(),
        qps: d.qps.iter().filter(|(_, q)| connected(&q.info)).map(|(h, q)| (*h, q.info.clone())).collect(),
    };
    Some((Section { name: name.to_string(), version: EARLY_VERSION, data: encode_checked(&early) }, early))
}

/// What an early section holds, checked.
pub(crate) fn decode(section: &Section) -> Result<Early> {
    decode_checked(section, EARLY_VERSION)
}

/// Builds what `early` (of section `name`) describes in the device's
/// namespace. The objects are not the device's yet: `restore` takes those
/// the state still has.
pub(crate) fn prepare(name: &str, early: &Early, d: &Dev) -> Result<Prepared> {
    let err = |why: String| StateError::Mismatch { name: name.to_string(), why };
    if early.gid != d.gid {
        return Err(err(format!("the early state is of GID {}, this device is {}", early.gid, d.gid)));
    }
    let mut p = Prepared::default();
    if d.testing.shift_ids {
        // The negative control makes other IDs at the switch: nothing
        // built ahead would be kept.
        return Ok(p);
    }
    let t = Instant::now();
    for (h, _) in &early.pds {
        let pd = d.be.ctx.alloc_pd().map_err(|e| err(format!("PD {h}: {e:#}")))?;
        p.pds.insert(*h, pd);
    }
    p.phases.push(("early: PDs".into(), t.elapsed().as_secs_f64() * 1e3));
    let t = Instant::now();
    let ram_fd = d.be.ram.fd();
    let mut mrs = Vec::new();
    for (h, info) in &early.mrs {
        let (h, info) = (*h, info.clone());
        if !info.runs_valid(d.ram_size) {
            return Err(err(format!("MR {h} lies outside guest RAM")));
        }
        if !p.pds.contains_key(&info.pd_handle) {
            return Err(err(format!("MR {h} names a missing PD")));
        }
        mrs.push((h, info));
    }
    let mut objects: Vec<verbs::NewObject> = mrs
        .iter()
        .map(|(_, info)| verbs::NewObject::Mr {
            pd: &p.pds[&info.pd_handle],
            fd: ram_fd,
            runs: &info.runs,
            access: info.access,
            iova: info.start,
            key: Some(info.key),
        })
        .collect();
    objects.extend(early.cqs.iter().map(|(_, ring)| verbs::NewObject::Cq { cqe: ring.entries, channel: Some(&d.be.channel) }));
    let made = d.be.ctx.create_batch(&objects).map_err(|e| err(format!("MRs and CQs: {e:#}")))?;
    drop(objects);
    let mut made = made.into_iter();
    for ((h, info), m) in mrs.into_iter().zip(made.by_ref()) {
        let verbs::Made::Mr(mr) = m else { return Err(err(format!("MR {h}: rnicd made another object"))) };
        p.mrs.insert(h, (info, mr));
    }
    for ((h, ring), m) in early.cqs.iter().zip(made) {
        let verbs::Made::Cq(cq) = m else { return Err(err(format!("CQ {h}: rnicd made another object"))) };
        p.cqs.insert(*h, (ring.entries, cq));
    }
    p.phases.push(("early: MRs and CQs".into(), t.elapsed().as_secs_f64() * 1e3));
    let t = Instant::now();
    let mut qps = Vec::new();
    for (h, info) in &early.qps {
        let (h, shape) = (*h, QpShape::of(info));
        let (Some((_, scq)), Some((_, rcq))) = (p.cqs.get(&shape.send_cq), p.cqs.get(&shape.recv_cq)) else {
            return Err(err(format!("QP {h} names a missing CQ")));
        };
        if !p.pds.contains_key(&shape.pd_handle) {
            return Err(err(format!("QP {h} names a missing PD")));
        }
        let init = shape.init(scq, rcq);
        // The peer the QP's state will name: rnicd warms its neighbour entry.
        let peer = info.attr.ah_attr.grh.dgid.ipv4().map(Ipv4Addr::from);
        qps.push((h, shape, init, peer));
    }
    let objects: Vec<verbs::NewObject> = qps
        .iter()
        .map(|(_, shape, init, peer)| verbs::NewObject::QpAwaitingState { pd: &p.pds[&shape.pd_handle], init, qpn: shape.qpn, peer: *peer })
        .collect();
    let made = d.be.ctx.create_batch(&objects).map_err(|e| err(format!("QPs: {e:#}")))?;
    drop(objects);
    for ((h, shape, _, _), m) in qps.into_iter().zip(made) {
        let verbs::Made::Qp(qp) = m else { return Err(err(format!("QP {h}: rnicd made another object"))) };
        p.qps.insert(h, (shape, qp));
    }
    p.phases.push(("early: QPs made suspended".into(), t.elapsed().as_secs_f64() * 1e3));
    Ok(p)
}

impl Prepared {
    /// Takes apart what is built, QPs first (they name CQs and PDs), then
    /// MRs, CQs and PDs.
    pub fn discard(self) {
        let Prepared { qps, mrs, cqs, pds, .. } = self;
        drop(qps);
        drop(mrs);
        drop(cqs);
        drop(pds);
    }

    /// Keeps only the objects `keep_*` says the final state still has
    /// unchanged, and takes the others apart now: before the switch makes
    /// the source's new objects, which may reuse their keys and QPNs.
    pub fn retain(
        &mut self,
        keep_pd: impl Fn(u32) -> bool,
        keep_mr: impl Fn(u32, &MrInfo) -> bool,
        keep_cq: impl Fn(u32, u32) -> bool,
        keep_qp: impl Fn(u32, &QpShape) -> bool,
    ) {
        self.qps.retain(|h, (s, _)| keep_qp(*h, s));
        self.mrs.retain(|h, (i, _)| keep_mr(*h, i));
        self.cqs.retain(|h, (e, _)| keep_cq(*h, *e));
        self.pds.retain(|h, _| keep_pd(*h));
    }
}
