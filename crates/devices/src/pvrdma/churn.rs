//! `testing=churn-early`: the device changes its objects right after a
//! migration took its early section, as a guest that makes and destroys
//! QPs and MRs during a migration does, so that a test can show that the
//! switch rebuilds exactly the source's final set on the destination
//! (crates/transit/tests/pvrdma_migrate.rs).
//!
//! The spares are the device's own, never the guest's: an MR over the
//! first page of the guest's first MR and a QP shaped as the guest's
//! first, sharing its PD and CQs, connected towards TEST-NET-1 (nothing
//! answers there) and never given work, so no workload sees them. Made
//! before the early section, they are destroyed after it and others are
//! made in the handles they freed, with other keys and QPNs.

use std::net::Ipv4Addr;

use pvrdma_abi::ib;

use super::dev::Dev;
use super::objects::{Mr, MrInfo, Qp};

/// Where the spare QP is connected: RFC 5737's TEST-NET-1.
const NOWHERE: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);

/// The handles of a spare MR and QP.
pub(crate) struct Spares {
    mr: u32,
    qp: u32,
}

impl Dev {
    /// Makes a spare MR and a spare connected QP.
    pub(crate) fn make_spares(&mut self) -> Result<Spares, String> {
        let (mr_model, qp_model) = match (self.mrs.iter().next(), self.qps.iter().next()) {
            (Some((_, m)), Some((_, q))) => (m.info.clone(), q.info.clone()),
            _ => return Err("testing=churn-early needs an MR and a QP of the guest's".into()),
        };
        let (gpa, _) = *mr_model.runs.first().ok_or("the guest's MR has no pages")?;
        let info = MrInfo { runs: vec![(gpa, 4096)], length: 4096, access: ib::access::LOCAL_WRITE, ..mr_model };
        let pd = &self.pds.get(info.pd_handle).ok_or("the guest's MR names no PD")?.pd;
        let mr = pd.reg_mr_runs(&self.be.ram, &info.runs, info.access, None, info.start).map_err(|e| format!("spare MR: {e:#}"))?;
        if self.tracing {
            self.start_mr_trace(&mr)?;
        }
        let mr_handle = self.mrs.free_handle().ok_or("no free MR handle")?;
        self.mrs.insert(mr_handle, Mr { info: MrInfo { key: mr.lkey, ..info }, mr });

        let shape = super::early::QpShape::of(&qp_model);
        let (scq, rcq) = match (self.cqs.get(shape.send_cq), self.cqs.get(shape.recv_cq)) {
            (Some(a), Some(b)) => (a, b),
            _ => return Err("the guest's QP names no CQ".into()),
        };
        let pd = &self.pds.get(shape.pd_handle).ok_or("the guest's QP names no PD")?.pd;
        let qp = pd.create_qp(&shape.init(&scq.cq, &rcq.cq)).map_err(|e| format!("spare QP: {e:#}"))?;
        let remote = verbs::QpEndpoint { gid: NOWHERE, qpn: 0x42, psn: 0 };
        qp.connect(&remote, &verbs::ConnectOpts::default()).map_err(|e| format!("spare QP: {e:#}"))?;
        let mut info = qp_model;
        info.qpn = qp.qpn;
        info.attr.qp_state = ib::qp_state::RTS;
        info.sq_out.clear();
        info.rq_out.clear();
        for q in [&mut info.sq, &mut info.rq] {
            q.head = 0;
            q.next_seq = 0;
        }
        let qp_handle = self.qps.free_handle().ok_or("no free QP handle")?;
        self.qps.insert(qp_handle, Qp { info, qp });
        tracing::info!("pvrdma {}: testing=churn-early: spare MR {mr_handle} and QP {qp_handle} made", self.name);
        Ok(Spares { mr: mr_handle, qp: qp_handle })
    }

    /// Destroys `old` and makes new spares (in the handles it freed).
    pub(crate) fn replace_spares(&mut self, old: Spares) -> Result<(), String> {
        let gone = (self.mrs.remove(old.mr).map(|m| m.info.key), self.qps.remove(old.qp).map(|q| q.info.qpn));
        let new = self.make_spares()?;
        let made = (self.mrs.get(new.mr).map(|m| m.info.key), self.qps.get(new.qp).map(|q| q.info.qpn));
        tracing::info!(
            "pvrdma {}: testing=churn-early: after the early section, (MR key, QPN) {gone:x?} destroyed, {made:x?} made",
            self.name
        );
        Ok(())
    }
}
