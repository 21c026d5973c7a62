//! Many objects in few control requests: [`Context::create_batch`] makes
//! MRs, CQs and QPs with one `CreateBatch` request per chunk (the rings of a
//! chunk share one memfd), and [`Context::fetch_traces`] takes many MRs'
//! write traces per request. A migrated device restores its namespace so,
//! inside the downtime, instead of one round trip per object.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::Mutex;

use anyhow::{bail, Context as _};
use rnic::mem::{sealed_memfd, Mapping};
use rnic::proto::{self, Create, Reply, Request};
use rnic::ring::{ring_bytes, Cqe, RecvWqe, Ring, SendWqe, MAX_INLINE, MAX_SGE};

use crate::{CompChannel, Context, Cq, Mr, Pd, Qp, QpInitAttr, QpSnapshot, TraceReport};

/// One object for [`Context::create_batch`].
pub enum NewObject<'a> {
    /// As [`Pd::reg_mr_runs`]: the `(fd_offset, len)` runs of the sealed
    /// memfd `fd` laid end to end, addressed from `iova`.
    Mr { pd: &'a Pd, fd: RawFd, runs: &'a [(u64, u64)], access: u32, iova: u64, key: Option<u32> },
    /// As [`Context::create_cq`].
    Cq { cqe: u32, channel: Option<&'a CompChannel> },
    /// As [`Pd::create_qp_with_qpn`] (`state`: none) or
    /// [`Pd::create_qp_suspended`] (the QPN is the state's).
    Qp { pd: &'a Pd, init: &'a QpInitAttr, qpn: Option<u32>, state: Option<&'a QpSnapshot> },
    /// A QP made suspended with no state yet (in RESET), its rings
    /// allocated: it answers nothing and reads nothing until
    /// [`Context::load_qp_states`] gives it a state and it resumes. A
    /// migration's destination builds its QPs so ahead of the switch.
    /// `peer`, the address the state will name if known: rnicd warms its
    /// host's neighbour entry for it (an ARP request from the host's own
    /// address), as it opens the QP's send socket, before the resume.
    QpAwaitingState { pd: &'a Pd, init: &'a QpInitAttr, qpn: u32, peer: Option<std::net::Ipv4Addr> },
}

/// What [`Context::create_batch`] made, in the order asked.
pub enum Made {
    Mr(Mr),
    Cq(Cq),
    Qp(Qp),
}

/// Descriptors of a request that are not MR memfds: the chunk's rings and
/// the memfd the request spills into when larger than a datagram.
const RESERVED_FDS: usize = 2;

/// A ring placed in a chunk's rings memfd.
struct Placed {
    offset: u64,
    len: usize,
}

impl Context {
    /// Creates `objects` in order with as few requests as fit (each a
    /// `CreateBatch`: at most MAX_CREATE_BATCH objects, and MR memfds that
    /// leave descriptors for the chunk's rings and a spilled request). Each
    /// request is all or nothing in rnicd; if a later one fails, what the
    /// earlier ones made is dropped (destroyed) before the error returns.
    pub fn create_batch(&self, objects: &[NewObject]) -> anyhow::Result<Vec<Made>> {
        let mut out = Vec::with_capacity(objects.len());
        let mut start = 0;
        while start < objects.len() {
            let mut items = Vec::new();
            let mut mr_fds: Vec<RawFd> = Vec::new();
            let mut rings_len = 0usize;
            let mut end = start;
            while end < objects.len() && items.len() < proto::MAX_CREATE_BATCH {
                let (item, fds_after, rings_after) = item(&objects[end], &mr_fds, rings_len)?;
                if fds_after.len() + RESERVED_FDS > fdmsg::MAX_FDS {
                    if items.is_empty() {
                        bail!("object {end} names more memfds than a request carries");
                    }
                    break;
                }
                (mr_fds, rings_len) = (fds_after, rings_after);
                items.push(item);
                end += 1;
            }
            out.extend(self.create_chunk(&objects[start..end], items, &mr_fds, rings_len)?);
            start = end;
        }
        Ok(out)
    }

    /// One CreateBatch: makes the chunk's rings memfd, maps each ring, asks
    /// rnicd, and builds the objects from its replies.
    fn create_chunk(&self, objects: &[NewObject], mut items: Vec<Create>, mr_fds: &[RawFd], rings_len: usize) -> anyhow::Result<Vec<Made>> {
        // A chunk of MRs only sends no rings memfd.
        let rings_fd = if rings_len > 0 { Some(sealed_memfd("transit-rings", rings_len)?) } else { None };
        let ring_idx = mr_fds.len() as u8;
        let mut rings = Vec::new();
        for item in items.iter_mut() {
            match item {
                Create::Mr { .. } => {}
                Create::Cq { cap, fd, ring_offset, .. } => {
                    *fd = ring_idx;
                    rings.push(Placed { offset: *ring_offset, len: ring_bytes::<Cqe>(*cap) });
                }
                Create::Qp { sq_slots, rq_slots, fd, sq_offset, rq_offset, .. } => {
                    *fd = ring_idx;
                    rings.push(Placed { offset: *sq_offset, len: ring_bytes::<SendWqe>(*sq_slots) });
                    rings.push(Placed { offset: *rq_offset, len: ring_bytes::<RecvWqe>(*rq_slots) });
                }
            }
        }
        let mut maps = Vec::with_capacity(rings.len());
        if let Some(fd) = &rings_fd {
            for r in &rings {
                let m = Mapping::map_sealed(fd, r.offset, r.len)?;
                m.populate_first(rnic::ring::FIRST_USE_BYTES);
                maps.push(m);
            }
        }
        let mut fds = mr_fds.to_vec();
        fds.extend(rings_fd.as_ref().map(|f| f.as_raw_fd()));
        let replies = match self.inner.call(&Request::CreateBatch { items }, &fds)? {
            Reply::Created(v) if v.len() == objects.len() => v,
            r => bail!("unexpected reply {r:?}"),
        };
        let mut maps = maps.into_iter();
        let mut out = Vec::with_capacity(objects.len());
        for (o, r) in objects.iter().zip(replies) {
            out.push(match (o, r) {
                (NewObject::Mr { iova, runs, .. }, Reply::Mr { lkey, rkey }) => {
                    let len = runs.iter().map(|r| r.1 as usize).sum();
                    Made::Mr(Mr { ctx: self.clone(), lkey, rkey, addr: *iova, len })
                }
                (NewObject::Cq { cqe, .. }, Reply::Cq(h)) => {
                    let cap = (*cqe).max(1).next_power_of_two();
                    let map = maps.next().context("ring mapping")?;
                    // SAFETY: the mapping holds the ring's bytes and is kept in the Cq.
                    let ring = unsafe { Ring::new(map.ptr(), map.len(), cap) }.context("ring")?;
                    Made::Cq(Cq {
                        ctx: self.clone(),
                        handle: h,
                        ring: Mutex::new(ring),
                        held: Default::default(),
                        map: Mutex::new(map),
                        cap,
                    })
                }
                (NewObject::Qp { init, .. } | NewObject::QpAwaitingState { init, .. }, Reply::Qp { qpn, cap }) => {
                    let (sqm, rqm) = (maps.next().context("ring mapping")?, maps.next().context("ring mapping")?);
                    let sq_slots = init.cap.max_send_wr.max(1).next_power_of_two();
                    let rq_slots = init.cap.max_recv_wr.max(1).next_power_of_two();
                    // SAFETY: mappings of the rings' sizes, kept in the Qp.
                    let sq = unsafe { Ring::new(sqm.ptr(), sqm.len(), sq_slots) }.context("ring")?;
                    let rq = unsafe { Ring::new(rqm.ptr(), rqm.len(), rq_slots) }.context("ring")?;
                    Made::Qp(Qp { ctx: self.clone(), qpn, cap, sq: Mutex::new(sq), rq: Mutex::new(rq), _maps: (sqm, rqm) })
                }
                (_, r) => bail!("reply {r:?} does not match its object"),
            });
        }
        Ok(out)
    }

    /// The write traces of `mrs` (see [`Mr::fetch_trace`]), in their order,
    /// MAX_TRACE_BATCH per request.
    pub fn fetch_traces(&self, mrs: &[&Mr]) -> anyhow::Result<Vec<TraceReport>> {
        let lkeys = |c: &[&Mr]| c.iter().map(|m| m.lkey).collect();
        self.chunked(
            mrs,
            proto::MAX_TRACE_BATCH,
            |c| Request::FetchTraces { lkeys: lkeys(c) },
            |c, r| match r {
                Reply::Traces(v) if v.len() == c.len() => Ok(v),
                r => Err(r),
            },
        )
    }
}

/// The request item of `o`, with the chunk's MR memfds and rings' length
/// once it is in. The rings memfd is made for the whole chunk, so its
/// index (`fd` of CQs and QPs) is set when the chunk is complete.
fn item(o: &NewObject, mr_fds: &[RawFd], rings_len: usize) -> anyhow::Result<(Create, Vec<RawFd>, usize)> {
    let mut fds = mr_fds.to_vec();
    Ok(match *o {
        NewObject::Mr { pd, fd, runs, access, iova, key } => {
            let i = fds.iter().position(|f| *f == fd).unwrap_or_else(|| {
                fds.push(fd);
                fds.len() - 1
            });
            let item = Create::Mr { pd: pd.handle, iova, access, fd: i as u8, runs: runs.to_vec(), key };
            (item, fds, rings_len)
        }
        NewObject::Cq { cqe, channel } => {
            let cap = cqe.max(1).next_power_of_two();
            let item = Create::Cq { cap, channel: channel.map(|c| c.handle), fd: 0, ring_offset: rings_len as u64 };
            (item, fds, rings_len + ring_bytes::<Cqe>(cap))
        }
        NewObject::Qp { pd, init, qpn, state } => qp_item(pd, init, qpn.or(state.map(|s| s.qpn)), state, None, fds, rings_len)?,
        NewObject::QpAwaitingState { pd, init, qpn, peer } => qp_item(pd, init, Some(qpn), None, Some(peer), fds, rings_len)?,
    })
}

/// The request item of a QP, its rings placed at `rings_len`.
fn qp_item(
    pd: &Pd,
    init: &QpInitAttr,
    qpn: Option<u32>,
    state: Option<&QpSnapshot>,
    // Made awaiting its state (with its peer, if known).
    awaiting: Option<Option<std::net::Ipv4Addr>>,
    fds: Vec<RawFd>,
    rings_len: usize,
) -> anyhow::Result<(Create, Vec<RawFd>, usize)> {
    let cap = init.cap;
    if cap.max_send_sge as usize > MAX_SGE || cap.max_recv_sge as usize > MAX_SGE || cap.max_inline_data as usize > MAX_INLINE {
        bail!("at most {MAX_SGE} SGEs and {MAX_INLINE} bytes inline");
    }
    let sq_slots = cap.max_send_wr.max(1).next_power_of_two();
    let rq_slots = cap.max_recv_wr.max(1).next_power_of_two();
    let sq_offset = rings_len as u64;
    let rq_offset = sq_offset + ring_bytes::<SendWqe>(sq_slots) as u64;
    let item = Create::Qp {
        pd: pd.handle,
        send_cq: init.send_cq,
        recv_cq: init.recv_cq,
        cap,
        sq_sig_all: init.sq_sig_all,
        sq_slots,
        rq_slots,
        qpn,
        restore: state.map(|s| Box::new(s.clone())),
        qp_type: init.qp_type,
        fd: 0,
        sq_offset,
        rq_offset,
        await_state: awaiting.is_some(),
        peer: awaiting.flatten(),
    };
    Ok((item, fds, rq_offset as usize + ring_bytes::<RecvWqe>(rq_slots)))
}
