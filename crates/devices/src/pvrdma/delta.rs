//! The state at a migration's switch as what changed since the early
//! section (`early.rs`), which both ends hold by then: the source the
//! section it sent, the destination the one it received.
//!
//! At hundreds of QPs nearly all of the whole state is object
//! descriptions that do not change while the VM runs (MR runs, the guest
//! pages of every ring): sending them again made the switch encode, send
//! and decode about 1.6 KB a QP. The delta names each MR still as the
//! early section had it by its handle only, and for a CQ or QP whose
//! pages and layout are unchanged only what moves while it runs (ring
//! indices, arming, pending completions; the QP's attributes if the guest
//! modified it since, rnicd's runtime state, and of its outstanding WQEs
//! those posted since: a receive WQE the guest posted long before the
//! early section and no message has consumed yet is named by its sequence
//! number, not sent again). An
//! object made or changed since the early section travels whole; one
//! destroyed since is simply not named. The destination rebuilds the whole
//! state from the early section and the delta, so `restore` has one path.

use std::collections::{HashMap, VecDeque};

use pvrdma_abi::{Cqe, Pod, QpAttr, Sge};
use serde::{Deserialize, Serialize};
use verbs::QpSnapshot;

use super::dev::Dev;
use super::early::Early;
use super::objects::{pod_bytes, pod_list, CqRing, MrInfo, OutRecv, OutSend, QpInfo, WqQueue};
use super::persist::{Saved, SavedQp};

/// Version of the delta section: from 0x100 on, apart from the whole
/// state's (`persist::VERSION`, small), so that `restore` tells them apart.
pub(super) const DELTA_VERSION: u32 = 0x101;

/// An early section by handle: what a delta is taken against and applied
/// over.
pub(crate) struct Baseline {
    pub mrs: HashMap<u32, MrInfo>,
    pub cqs: HashMap<u32, CqRing>,
    pub qps: HashMap<u32, QpInfo>,
}

impl Baseline {
    pub fn of(early: Early) -> Baseline {
        Baseline { mrs: early.mrs.into_iter().collect(), cqs: early.cqs.into_iter().collect(), qps: early.qps.into_iter().collect() }
    }
}

/// An object as the early section had it but for what moves while it
/// runs (`Runs`), or whole.
#[derive(Serialize, Deserialize)]
enum Part<R, W> {
    Runs(R),
    Whole(W),
}

/// What of a CQ moves while it runs.
#[derive(Serialize, Deserialize)]
struct CqRun {
    tail: u32,
    armed: u32,
    #[serde(with = "pod_list")]
    pending: VecDeque<Cqe>,
}

/// A QP's attributes, as the guest last set them.
#[derive(Serialize, Deserialize)]
struct Attr(#[serde(with = "pod_bytes")] QpAttr);

/// What of a QP moves while it runs.
#[derive(Serialize, Deserialize)]
struct QpRun {
    sq: (u32, u64),
    rq: (u32, u64),
    /// None: as in the early section (the guest did not modify the QP).
    attr: Option<Attr>,
    broken: bool,
    sq_out: Queue<OutSend>,
    rq_out: Queue<OutRecv>,
}

/// A QP's outstanding WQEs: a run of those the early section had, then
/// those posted since (a WQE's sequence number is given once, so a run
/// is named by its first one and its length).
#[derive(Serialize, Deserialize)]
struct Queue<T> {
    /// (sequence number of the first, how many in a row).
    kept: Option<(u64, u32)>,
    added: VecDeque<T>,
}

/// An outstanding WQE: its sequence number, and whether it is the very
/// same WQE as another (its bytes too, should a QP have been remade with
/// the same handle and numbers since).
trait Outstanding: Clone {
    fn seq(&self) -> u64;
    fn same(&self, o: &Self) -> bool;
}

fn same_sges(a: &[Sge], b: &[Sge]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.as_bytes() == y.as_bytes())
}

impl Outstanding for OutSend {
    fn seq(&self) -> u64 {
        self.seq
    }
    fn same(&self, o: &Self) -> bool {
        self.seq == o.seq && self.hdr.as_bytes() == o.hdr.as_bytes() && same_sges(&self.sges, &o.sges)
    }
}

impl Outstanding for OutRecv {
    fn seq(&self) -> u64 {
        self.seq
    }
    fn same(&self, o: &Self) -> bool {
        self.seq == o.seq && self.hdr.as_bytes() == o.hdr.as_bytes() && same_sges(&self.sges, &o.sges)
    }
}

impl<T: Outstanding> Queue<T> {
    fn take(now: &VecDeque<T>, then: &VecDeque<T>) -> Queue<T> {
        let kept = now.front().and_then(|first| {
            let j = then.iter().position(|t| t.seq() == first.seq())?;
            let n = then.iter().skip(j).zip(now).take_while(|(a, b)| a.same(b)).count();
            (n > 0).then_some((first.seq(), n as u32))
        });
        let skip = kept.map_or(0, |(_, n)| n as usize);
        Queue { kept, added: now.iter().skip(skip).cloned().collect() }
    }

    fn apply(self, then: &VecDeque<T>) -> Result<VecDeque<T>, String> {
        let mut out = VecDeque::with_capacity(self.added.len() + self.kept.map_or(0, |(_, n)| n as usize));
        if let Some((first, n)) = self.kept {
            let j = then.iter().position(|t| t.seq() == first).ok_or_else(|| format!("WQE {first} is not in the early section"))?;
            if then.len() - j < n as usize {
                return Err(format!("the early section has fewer than {n} WQEs from {first} on"));
            }
            out.extend(then.iter().skip(j).take(n as usize).cloned());
        }
        out.extend(self.added);
        Ok(out)
    }
}

/// The device state at the switch over an early section.
#[derive(Serialize, Deserialize)]
pub(super) struct Delta {
    /// Everything but the MRs, CQs and QPs (small), whole.
    rest: Saved,
    /// MRs exactly as in the early section.
    mrs_same: Vec<u32>,
    mrs: Vec<(u32, MrInfo)>,
    cqs: Vec<(u32, Part<CqRun, CqRing>)>,
    qps: Vec<(u32, Part<QpRun, QpInfo>, Option<QpSnapshot>)>,
}

fn same_queue(a: &WqQueue, b: &WqQueue) -> bool {
    (a.wqe_cnt, a.max_sge, a.stride, a.offset, a.ring_offset) == (b.wqe_cnt, b.max_sge, b.stride, b.offset, b.ring_offset)
}

/// Whether `now` differs from `then` only in what moves while a QP runs.
fn same_qp(now: &QpInfo, then: &QpInfo) -> bool {
    (now.qpn, now.pd_handle, now.send_cq, now.recv_cq, now.sq_sig_all)
        == (then.qpn, then.pd_handle, then.send_cq, then.recv_cq, then.sq_sig_all)
        && now.pages.pages == then.pages.pages
        && same_queue(&now.sq, &then.sq)
        && same_queue(&now.rq, &then.rq)
}

fn same_cq(now: &CqRing, then: &CqRing) -> bool {
    (now.ctx_handle, now.entries) == (then.ctx_handle, then.entries) && now.pages.pages == then.pages.pages
}

/// The delta of the paused device `d` over `base`; `rest` holds the state
/// but its MRs, CQs and QPs, `states` rnicd's states of the suspended QPs.
pub(super) fn take(d: &Dev, base: &Baseline, rest: Saved, states: &mut HashMap<u32, QpSnapshot>) -> Delta {
    let (mut mrs_same, mut mrs) = (Vec::new(), Vec::new());
    for (h, m) in d.mrs.iter() {
        match base.mrs.get(h) {
            Some(then) if *then == m.info => mrs_same.push(*h),
            _ => mrs.push((*h, m.info.clone())),
        }
    }
    let cqs = d
        .cqs
        .iter()
        .map(|(h, c)| {
            let r = &c.ring;
            let part = match base.cqs.get(h) {
                Some(then) if same_cq(r, then) => Part::Runs(CqRun { tail: r.tail, armed: r.armed, pending: r.pending.clone() }),
                _ => Part::Whole(r.clone()),
            };
            (*h, part)
        })
        .collect();
    let qps = d
        .qps
        .iter()
        .map(|(h, q)| {
            let i = &q.info;
            let part = match base.qps.get(h) {
                Some(then) if same_qp(i, then) => Part::Runs(QpRun {
                    sq: (i.sq.head, i.sq.next_seq),
                    rq: (i.rq.head, i.rq.next_seq),
                    attr: (i.attr != then.attr).then_some(Attr(i.attr)),
                    broken: i.broken,
                    sq_out: Queue::take(&i.sq_out, &then.sq_out),
                    rq_out: Queue::take(&i.rq_out, &then.rq_out),
                }),
                _ => Part::Whole(i.clone()),
            };
            (*h, part, states.remove(h))
        })
        .collect();
    Delta { rest, mrs_same, mrs, cqs, qps }
}

/// The whole state from `delta` over `base`, whose objects it takes (no
/// copy of their page lists inside the downtime); an object named twice
/// is refused as one the early section did not have.
pub(super) fn apply(delta: Delta, mut base: Baseline) -> Result<Saved, String> {
    let Delta { mut rest, mrs_same, mrs, cqs, qps } = delta;
    let missing = |what: &str, h: u32| format!("the delta names {what} {h} as in an early section that did not have it");
    rest.mrs = Vec::with_capacity(mrs_same.len() + mrs.len());
    for h in mrs_same {
        rest.mrs.push((h, base.mrs.remove(&h).ok_or_else(|| missing("MR", h))?));
    }
    rest.mrs.extend(mrs);
    rest.mrs.sort_by_key(|(h, _)| *h);
    rest.cqs = Vec::with_capacity(cqs.len());
    for (h, part) in cqs {
        let ring = match part {
            Part::Whole(ring) => ring,
            Part::Runs(run) => {
                let then = base.cqs.remove(&h).ok_or_else(|| missing("CQ", h))?;
                CqRing { tail: run.tail, armed: run.armed, pending: run.pending, ..then }
            }
        };
        rest.cqs.push((h, ring));
    }
    rest.qps = Vec::with_capacity(qps.len());
    for (handle, part, state) in qps {
        let info = match part {
            Part::Whole(info) => info,
            Part::Runs(run) => {
                let then = base.qps.remove(&handle).ok_or_else(|| missing("QP", handle))?;
                let bad = |why: String| format!("QP {handle}: {why}");
                let (sq_out, rq_out) = (run.sq_out.apply(&then.sq_out).map_err(bad)?, run.rq_out.apply(&then.rq_out).map_err(bad)?);
                let mut info = QpInfo { broken: run.broken, sq_out, rq_out, ..then };
                (info.sq.head, info.sq.next_seq) = run.sq;
                (info.rq.head, info.rq.next_seq) = run.rq;
                if let Some(Attr(attr)) = run.attr {
                    info.attr = attr;
                }
                info
            }
        };
        rest.qps.push(SavedQp { handle, info, state });
    }
    Ok(rest)
}
