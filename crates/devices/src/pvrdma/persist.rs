//! Save and restore of the device through `Persist`.
//!
//! Saved: the guest-visible registers and MSI-X table, the DSR and its event
//! rings' producer indices, the GID table, every object (PDs; MRs with their
//! keys, I/O addresses and RAM offsets; CQ rings with their producer index,
//! arming and completions not yet in the guest ring; QPs with their rings'
//! consumer indices, the device's copies of outstanding WQEs and, for
//! connected QPs, rnicd's runtime state from query-suspended).
//!
//! At a migration's switch (`save_switch`) the state is a delta over the
//! early section the source sent (`delta.rs`) when it sent one; `restore`
//! takes either.
//!
//! `save` needs a paused device (Lifecycle::pause suspended the QPs and took
//! every completion out of rnicd). `restore` builds the objects again in this
//! device's namespace with the same QPNs and keys, creates connected QPs
//! suspended from their states, reposts the outstanding WQEs rnicd had not
//! retired, in order, and leaves the device paused: `resume` resumes the QPs.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use bincode::Options as _;
use pvrdma_abi::ib;
use serde::{Deserialize, Serialize};
use snapshot::{Persist, Result, Section, StateError};
use verbs::{QpSnapshot, RecvWr};

use super::delta::{self, Baseline, DELTA_VERSION};
use super::dev::{Counters, Dev, DsrInfo, Regs};
use super::early::{self, Prepared, QpShape};
use super::objects::{Cq, CqRing, Mr, MrInfo, Pd, Qp, QpInfo, Uc};
use super::{lock, Pvrdma};
use crate::pci::GuestWritable;

/// 4: with SRQs (`srqs`, pvrdma/srq.rs); 3: with the guest-written
/// configuration space (2 had only MSI-X enable, in `regs`); 2: bincode
/// with a CRC32 of its own (1 was JSON).
const VERSION: u32 = 4;

/// The state's bytes: bincode (varints: compact, and 10-20 times faster to
/// make and read than JSON at hundreds of QPs) followed by the CRC32 of
/// those bytes, so that damage under the migration stream's own checksum
/// (a device's bug, `testing=corrupt-state`) is refused rather than taken
/// as a different PSN or ring index.
pub(super) fn encode_checked<T: Serialize>(saved: &T) -> Vec<u8> {
    // Serializing a plain state struct into a Vec cannot fail.
    let mut data = bincode::DefaultOptions::new().serialize(saved).expect("state serializes");
    let crc = crc32fast::hash(&data);
    data.extend_from_slice(&crc.to_le_bytes());
    data
}

/// A section of `version` made by [`encode_checked`], checked and decoded.
pub(super) fn decode_checked<T: serde::de::DeserializeOwned>(section: &Section, version: u32) -> Result<T> {
    if section.version != version {
        return Err(StateError::Version { name: section.name.clone(), found: section.version, expected: version });
    }
    let bad = |why: String| StateError::Decode { name: section.name.clone(), why };
    let Some(body_len) = section.data.len().checked_sub(4) else { return Err(bad("shorter than its checksum".into())) };
    let (body, crc) = section.data.split_at(body_len);
    if crc32fast::hash(body).to_le_bytes() != crc {
        return Err(bad("checksum mismatch".into()));
    }
    // The limit bounds what a length prefix can make the decoder allocate.
    bincode::DefaultOptions::new().with_limit(body.len() as u64).deserialize(body).map_err(|e| bad(e.to_string()))
}

#[derive(Serialize, Deserialize)]
pub(super) struct SavedQp {
    pub handle: u32,
    pub info: QpInfo,
    /// rnicd's runtime state of a connected (suspended) QP.
    pub state: Option<QpSnapshot>,
}

#[derive(Serialize, Deserialize)]
pub(super) struct Saved {
    gid: std::net::Ipv4Addr,
    regs: Regs,
    dsr: Option<DsrInfo>,
    gids: Vec<(u32, [u8; 16])>,
    ucs: Vec<(u32, Uc)>,
    pds: Vec<(u32, u32)>,
    pub mrs: Vec<(u32, MrInfo)>,
    pub cqs: Vec<(u32, CqRing)>,
    pub qps: Vec<SavedQp>,
    counters: Counters,
    /// Configuration space as the guest left it (a driver that turned bus
    /// mastering or memory decoding off finds it off after a restore).
    pci: GuestWritable,
    srqs: Vec<super::srq::SavedSrq>,
}

impl Pvrdma {
    /// The state of the paused device: whole, or (`over`) as a delta over
    /// the early section the source sent.
    fn save_as(&self, over: Option<&Baseline>) -> Result<Section> {
        let mut d = lock(&self.shared);
        let err = |why: String| StateError::Mismatch { name: self.name.clone(), why };
        if !d.paused && d.qps.len() > 0 {
            return Err(err("the device must be paused (QPs suspended) before its state is taken".into()));
        }
        // The suspended QPs' states: those the pause took with the suspend;
        // any other (a device restored and saved again without running)
        // in one batched request.
        let t = Instant::now();
        let suspended: HashSet<u32> = d.suspended.iter().copied().collect();
        let mut states = HashMap::new();
        let mut ask = Vec::new();
        for (h, q) in d.qps.iter().filter(|(h, _)| suspended.contains(h)) {
            match self.paused_states.get(&q.qp.qpn) {
                Some(s) => _ = states.insert(*h, s.clone()),
                None => ask.push((*h, &q.qp)),
            }
        }
        if !ask.is_empty() {
            let live: Vec<&verbs::Qp> = ask.iter().map(|(_, q)| *q).collect();
            let got = d.be.ctx.query_qp_states(&live).map_err(|e| err(format!("querying the suspended QPs: {e:#}")))?;
            states.extend(ask.iter().map(|(h, _)| *h).zip(got));
        }
        d.switch.record("query QP states", t);
        let t = Instant::now();
        let mut saved = Saved {
            gid: d.gid,
            regs: d.regs.clone(),
            dsr: d.dsr.clone(),
            gids: d.gids.iter().map(|(k, v)| (*k, *v)).collect(),
            ucs: d.ucs.iter().map(|(h, u)| (*h, u.clone())).collect(),
            pds: d.pds.iter().map(|(h, p)| (*h, p.ctx_handle)).collect(),
            mrs: Vec::new(),
            cqs: Vec::new(),
            qps: Vec::new(),
            counters: d.counters.clone(),
            pci: self.pci.guest_writable(),
            srqs: super::srq::save(&d).map_err(err)?,
        };
        let mut section = match over {
            Some(base) => {
                let delta = delta::take(&d, base, saved, &mut states);
                Section { name: self.name.clone(), version: DELTA_VERSION, data: encode_checked(&delta) }
            }
            None => {
                saved.mrs = d.mrs.iter().map(|(h, m)| (*h, m.info.clone())).collect();
                saved.cqs = d.cqs.iter().map(|(h, c)| (*h, c.ring.clone())).collect();
                saved.qps = d.qps.iter().map(|(h, q)| SavedQp { handle: *h, info: q.info.clone(), state: states.remove(h) }).collect();
                Section { name: self.name.clone(), version: VERSION, data: encode_checked(&saved) }
            }
        };
        d.switch.record(if over.is_some() { "encode state (delta over the early section)" } else { "encode state" }, t);
        d.switch.state_bytes = section.data.len() as u64;
        d.switch.delta = over.is_some();
        d.switch.objects = [d.pds.len(), d.mrs.len(), d.cqs.len(), d.qps.len(), 0];
        if std::mem::take(&mut d.testing.corrupt_state) {
            damage(&mut section.data);
        }
        Ok(section)
    }
}

impl Persist for Pvrdma {
    fn state_name(&self) -> String {
        self.name.clone()
    }

    fn save(&self) -> Result<Section> {
        self.save_as(None)
    }

    fn save_switch(&self) -> Result<Section> {
        let base = self.early_base.lock().unwrap_or_else(|e| e.into_inner());
        self.save_as(base.as_ref())
    }

    fn save_early(&self) -> Result<Option<Section>> {
        let mut d = lock(&self.shared);
        let churn = d.testing.churn_early;
        let err = |why: String| StateError::Mismatch { name: self.name.clone(), why };
        let spare = if churn { Some(d.make_spares().map_err(err)?) } else { None };
        let early = early::save(&self.name, &d);
        if let Some(spare) = spare {
            d.replace_spares(spare).map_err(err)?;
        }
        // What the switch's delta is taken against: this section, the last
        // one taken (a migration takes one before its switch).
        let (section, base) = early.map(|(s, e)| (s, Baseline::of(e))).unzip();
        *self.early_base.lock().unwrap_or_else(|e| e.into_inner()) = base;
        Ok(section)
    }

    fn prepare(&mut self, section: &Section) -> Result<()> {
        self.discard_prepared();
        *self.early_base.get_mut().unwrap_or_else(|e| e.into_inner()) = None;
        let early = early::decode(section)?;
        let d = lock(&self.shared);
        let built = early::prepare(&section.name, &early, &d);
        drop(d);
        // Kept even if nothing could be built: the delta at the switch is
        // over the section, whatever was built from it.
        *self.early_base.get_mut().unwrap_or_else(|e| e.into_inner()) = Some(Baseline::of(early));
        self.prepared = Some(built?);
        Ok(())
    }

    /// The objects go; the section stays (the engine discards them when
    /// the build failed, and the switch's delta is over the section). The
    /// next early section or restore replaces it.
    fn discard_prepared(&mut self) {
        if let Some(p) = self.prepared.take() {
            p.discard();
        }
    }

    fn restore(&mut self, section: &Section) -> Result<()> {
        let name = self.name.clone();
        let prepared = self.prepared.take();
        let base = self.early_base.get_mut().unwrap_or_else(|e| e.into_inner()).take();
        let err = |why: String| StateError::Mismatch { name: name.clone(), why };
        let t = Instant::now();
        let is_delta = section.version == DELTA_VERSION;
        let saved: Saved = if is_delta {
            let base =
                base.ok_or_else(|| err("a state that names only what changed since an early section this device did not receive".into()))?;
            delta::apply(decode_checked(section, DELTA_VERSION)?, base).map_err(err)?
        } else {
            decode_checked(section, VERSION)?
        };
        let pci = saved.pci;
        let mut d = lock(&self.shared);
        d.switch.begin();
        d.switch.record(if is_delta { "decode state (delta over the early section)" } else { "decode state" }, t);
        d.switch.state_bytes = section.data.len() as u64;
        d.switch.delta = is_delta;
        if saved.gid != d.gid {
            return Err(err(format!("the state is of GID {}, this device is {}", saved.gid, d.gid)));
        }
        if let Some(p) = &prepared {
            // Built ahead, outside the downtime: shown beside its phases.
            d.switch.phases.extend(p.phases.iter().cloned());
        }
        let t = Instant::now();
        d.reset();
        d.switch.record("reset", t);
        let r = restore_into(&mut d, saved, prepared).map_err(err);
        if r.is_err() {
            d.reset();
        }
        // Configuration space as the guest left it (its MSI-X enable and
        // function mask as the device then follows them).
        if r.is_ok() {
            self.pci.set_guest_writable(pci);
            d.follow_msix_control(&self.pci);
            d.bus_master = self.pci.bus_master();
        } else {
            self.pci.set_msix_enabled(d.regs.msix_enabled);
        }
        r
    }
}

/// `testing=corrupt-state`: flips the top bit of three bytes spread over
/// the encoded state, as damage on a path would. The section's checksum is
/// taken after this, so the damage reaches the destination's decoder,
/// which must refuse it: the state's own CRC32 no longer matches.
fn damage(data: &mut [u8]) {
    let n = data.len();
    for at in [n / 4, n / 2, 3 * n / 4] {
        if let Some(b) = data.get_mut(at) {
            *b ^= 0x80;
        }
    }
}

/// `testing=shift-ids`: another ID than the saved one, as a destination
/// without identity namespaces would give (the negative control of the
/// migration tests).
fn shifted(id: u32) -> u32 {
    id ^ 0x0040_0000
}

/// Which objects built ahead (`prepared`) the state `s` still has
/// unchanged: the others go before anything is made.
fn keep_prepared(p: &mut Prepared, s: &Saved) {
    let pds: HashSet<u32> = s.pds.iter().map(|(h, _)| *h).collect();
    let mrs: HashMap<u32, &MrInfo> = s.mrs.iter().map(|(h, i)| (*h, i)).collect();
    let cqs: HashMap<u32, u32> = s.cqs.iter().map(|(h, r)| (*h, r.entries)).collect();
    let qps: HashMap<u32, QpShape> = s.qps.iter().filter(|q| q.state.is_some()).map(|q| (q.handle, QpShape::of(&q.info))).collect();
    let keep_cq = |h: u32, entries: u32| cqs.get(&h) == Some(&entries) && p.cqs.get(&h).is_some_and(|(e, _)| *e == entries);
    let keep_qp = |h: u32, shape: &QpShape| {
        qps.get(&h) == Some(shape)
            && pds.contains(&shape.pd_handle)
            && keep_cq(shape.send_cq, cqs.get(&shape.send_cq).copied().unwrap_or(0))
            && keep_cq(shape.recv_cq, cqs.get(&shape.recv_cq).copied().unwrap_or(0))
    };
    let qps_kept: HashSet<u32> = p.qps.iter().filter(|(h, (shape, _))| keep_qp(**h, shape)).map(|(h, _)| *h).collect();
    let cqs_kept: HashSet<u32> = p.cqs.iter().filter(|(h, (e, _))| keep_cq(**h, *e)).map(|(h, _)| *h).collect();
    p.retain(
        |h| pds.contains(&h),
        |h, info| mrs.get(&h) == Some(&info) && pds.contains(&info.pd_handle),
        |h, _| cqs_kept.contains(&h),
        |h, _| qps_kept.contains(&h),
    );
}

fn restore_into(d: &mut Dev, s: Saved, prepared: Option<Prepared>) -> std::result::Result<(), String> {
    if s.regs.msix.len() != d.regs.msix.len() {
        return Err("MSI-X table of another size".into());
    }
    // What was built ahead and is still the source's is kept; the rest goes
    // now, before new objects may take its keys and QPNs.
    let t = Instant::now();
    let mut prep = prepared.unwrap_or_default();
    let built = [prep.pds.len(), prep.mrs.len(), prep.cqs.len(), prep.qps.len()];
    keep_prepared(&mut prep, &s);
    let kept = [prep.pds.len(), prep.mrs.len(), prep.cqs.len(), prep.qps.len()];
    if built != [0; 4] {
        d.switch.record("drop what changed since the early state", t);
    }
    d.regs = s.regs;
    d.dsr = s.dsr;
    d.gids = s.gids.into_iter().collect();
    d.counters = s.counters;
    for (h, u) in s.ucs {
        d.ucs.insert(h, u);
    }
    let t = Instant::now();
    let counts = [s.pds.len(), s.mrs.len(), s.cqs.len(), s.qps.len(), 0];
    for (h, ctx_handle) in s.pds {
        let pd = match prep.pds.remove(&h) {
            Some(pd) => pd,
            None => d.be.ctx.alloc_pd().map_err(|e| format!("PD {h}: {e:#}"))?,
        };
        d.pds.insert(h, Pd { ctx_handle, pd });
    }
    d.switch.record("PDs", t);
    // MRs and CQs in batched requests (all MRs name the one guest RAM
    // memfd; a batch's CQ rings share one memfd), then the QPs, which name
    // the CQs' new handles: a few round trips instead of one per object.
    let t = Instant::now();
    let shift = d.testing.shift_ids;
    let mut mrs = Vec::with_capacity(s.mrs.len());
    for (h, mut info) in s.mrs {
        if let Some((_, mr)) = prep.mrs.remove(&h) {
            d.mrs.insert(h, Mr { info, mr });
            continue;
        }
        if shift {
            info.key = shifted(info.key);
        }
        if d.pds.get(info.pd_handle).is_none() {
            return Err(format!("MR {h} names a missing PD"));
        }
        if !info.runs_valid(d.ram_size) {
            return Err(format!("MR {h} lies outside guest RAM"));
        }
        mrs.push((h, info));
    }
    let mut cqs_new = Vec::with_capacity(s.cqs.len());
    for (h, ring) in s.cqs {
        match prep.cqs.remove(&h) {
            Some((_, cq)) => place_cq(d, h, ring, cq),
            None => cqs_new.push((h, ring)),
        }
    }
    let ram_fd = d.be.ram.fd();
    let mut objects: Vec<verbs::NewObject> = mrs
        .iter()
        .map(|(_, info)| verbs::NewObject::Mr {
            pd: &d.pds.get(info.pd_handle).expect("checked above").pd,
            fd: ram_fd,
            runs: &info.runs,
            access: info.access,
            iova: info.start,
            key: Some(info.key),
        })
        .collect();
    objects.extend(cqs_new.iter().map(|(_, ring)| verbs::NewObject::Cq { cqe: ring.entries, channel: Some(&d.be.channel) }));
    let made = if objects.is_empty() { Vec::new() } else { d.be.ctx.create_batch(&objects).map_err(|e| format!("MRs and CQs: {e:#}"))? };
    drop(objects);
    let mut made = made.into_iter();
    for ((h, info), m) in mrs.into_iter().zip(made.by_ref()) {
        let verbs::Made::Mr(mr) = m else { return Err(format!("MR {h}: rnicd made another object")) };
        d.mrs.insert(h, Mr { info, mr });
    }
    d.switch.record("MRs", t);
    let t = Instant::now();
    for ((h, ring), m) in cqs_new.into_iter().zip(made) {
        let verbs::Made::Cq(cq) = m else { return Err(format!("CQ {h}: rnicd made another object")) };
        place_cq(d, h, ring, cq);
    }
    d.switch.record("CQs", t);
    super::srq::restore(d, s.srqs)?;
    let t = Instant::now();
    let mut reposted = 0;
    let mut suspended = Vec::new();
    let mut qps = Vec::with_capacity(s.qps.len());
    // QPs built ahead take their states; the others are made below.
    let mut loaded = Vec::new();
    let mut states = Vec::new();
    for sq in s.qps {
        if let (Some((_, qp)), Some(state)) = (prep.qps.remove(&sq.handle), &sq.state) {
            if state.qpn != sq.info.qpn || qp.qpn != sq.info.qpn {
                return Err(format!("QP {}: state of QPN {:#x} for QPN {:#x}", sq.handle, state.qpn, sq.info.qpn));
            }
            states.push(state.clone());
            loaded.push((sq.handle, sq.info, sq.state, qp));
            continue;
        }
        let (scq, rcq) = match (d.cqs.get(sq.info.send_cq), d.cqs.get(sq.info.recv_cq)) {
            (Some(a), Some(b)) => (a, b),
            _ => return Err(format!("QP {} names a missing CQ", sq.handle)),
        };
        if d.pds.get(sq.info.pd_handle).is_none() {
            return Err(format!("QP {} names a missing PD", sq.handle));
        }
        let init = QpShape::of(&sq.info).init(&scq.cq, &rcq.cq);
        let mut info = sq.info;
        let mut state = sq.state;
        if shift {
            info.qpn = shifted(info.qpn) & 0xff_ffff;
            if let Some(s) = state.as_mut() {
                s.qpn = info.qpn;
            }
        }
        if let Some(state) = &state {
            if state.qpn != info.qpn {
                return Err(format!("QP {}: state of QPN {:#x} for QPN {:#x}", sq.handle, state.qpn, info.qpn));
            }
        }
        qps.push((sq.handle, info, state, init));
    }
    if !states.is_empty() {
        d.be.ctx.load_qp_states(&states).map_err(|e| format!("QP states: {e:#}"))?;
        d.switch.record("QP states loaded", t);
    }
    let t = Instant::now();
    let objects: Vec<verbs::NewObject> = qps
        .iter()
        .map(|(_, info, state, init)| verbs::NewObject::Qp {
            pd: &d.pds.get(info.pd_handle).expect("checked above").pd,
            init,
            qpn: Some(info.qpn),
            state: state.as_ref(),
        })
        .collect();
    let made = if objects.is_empty() { Vec::new() } else { d.be.ctx.create_batch(&objects).map_err(|e| format!("QPs: {e:#}"))? };
    drop(objects);
    d.switch.record("QPs created suspended", t);
    let t = Instant::now();
    let mut all = Vec::with_capacity(loaded.len() + qps.len());
    all.extend(loaded);
    for ((handle, info, state, _), m) in qps.into_iter().zip(made) {
        let verbs::Made::Qp(qp) = m else { return Err(format!("QP {handle}: rnicd made another object")) };
        all.push((handle, info, state, qp));
    }
    super::srq::attach_restored(d, all.iter().map(|(h, _, _, qp)| (*h, qp)))?;
    for (handle, mut info, state, qp) in all {
        match &state {
            Some(state) => {
                // rnicd retired the WQEs below these counts; the rest are
                // posted again, in their order, before the QP resumes.
                let (sq_done, rq_done) = (state.runtime.sq_retired, state.runtime.rq_retired);
                info.sq_out.retain(|o| o.seq >= sq_done);
                info.rq_out.retain(|o| o.seq >= rq_done);
                suspended.push(handle);
            }
            None if info.attr.qp_state == ib::qp_state::INIT || info.attr.qp_state == ib::qp_state::ERR => {
                let a = verbs::QpAttr {
                    qp_state: super::cmd::qp_state_from_ib(info.attr.qp_state).unwrap_or(verbs::QpState::Init),
                    qp_access_flags: info.attr.qp_access_flags & 0xf,
                    port_num: 1,
                    ..Default::default()
                };
                let mask = verbs::mask::STATE | verbs::mask::ACCESS_FLAGS | verbs::mask::PORT | verbs::mask::PKEY_INDEX;
                if a.qp_state == verbs::QpState::Err {
                    // An errored QP only flushes; if rnicd will not put a
                    // fresh QP in ERR, the guest finds it in RESET.
                    let _ = qp.modify(&a, verbs::mask::STATE);
                } else {
                    qp.modify(&a, mask).map_err(|e| format!("QP {:#x} to INIT: {e:#}", info.qpn))?;
                }
            }
            None => {}
        }
        let recvs: Vec<RecvWr> =
            info.rq_out.iter().map(|o| RecvWr { wr_id: o.seq, sg_list: super::datapath::sge_slice(&o.sges) }).collect();
        if !recvs.is_empty() {
            qp.post_recv_quiet(&recvs).map_err(|e| format!("QP {:#x}: reposting receives: {e:#}", info.qpn))?;
        }
        reposted += recvs.len() + info.sq_out.len();
        let sends: Vec<verbs::SendWr> = info.sq_out.iter().map(super::datapath::to_send_wr).collect();
        if !sends.is_empty() {
            // A suspended QP reads its rings when it resumes: a doorbell
            // per QP would only wake rnicd to look at all of them again.
            let r = if state.is_some() { qp.post_send_quiet(&sends) } else { qp.post_send(&sends) };
            r.map_err(|e| format!("QP {:#x}: reposting sends: {e:#}", info.qpn))?;
        }
        d.qps.insert(handle, Qp { info, qp });
    }
    d.switch.record("WQEs reposted", t);
    d.switch.objects = counts;
    d.switch.objects[4] = reposted;
    (d.switch.early_built, d.switch.early_kept) = (built, kept);
    d.suspended = suspended;
    d.paused = true;
    Ok(())
}

/// A CQ of the state, on its rnicd CQ, armed as the guest left it.
fn place_cq(d: &mut Dev, h: u32, ring: CqRing, cq: verbs::Cq) {
    if ring.armed != 0 {
        cq.req_notify(ring.armed == pvrdma_abi::CQ_FLAG_ARMED_SOL);
    }
    d.cqs.insert(h, Cq { ring, cq, overran: false });
}
