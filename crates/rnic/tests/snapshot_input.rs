//! QP states come from clients: create-suspended and the migration requests
//! refuse bad ones with a clear error and never harm rnicd.
mod common;
use common::*;
use rnic::qp::RespJob;
use verbs::*;

fn valid(qpn: u32) -> QpSnapshot {
    let attr = QpAttr {
        qp_state: QpState::Rts,
        dest_gid: "10.9.9.9".parse().unwrap(),
        dest_qp_num: 0x77,
        path_mtu: Mtu::M1024,
        ..Default::default()
    };
    let runtime = QpRuntime { next_psn: 90, una: 95, tx_psn: 95, max_sent: 100, epsn: 5, ..Default::default() };
    QpSnapshot { version: QP_SNAPSHOT_VERSION, qpn, attr, runtime }
}

#[test]
fn bad_states_and_requests_are_refused() {
    let bed = Bed::new("rnsnap", 1);
    let ctx = bed.ctx(0);
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16, None).unwrap();
    let init = QpInitAttr::new(&cq, &cq);
    let err = |r: anyhow::Result<Qp>| format!("{:#}", r.err().expect("refused"));

    let mut s = valid(0x500);
    s.version = 2;
    assert!(err(pd.create_qp_suspended(&init, &s)).contains("version"));
    let mut s = valid(0x500);
    s.runtime.una = 80; // una before the first WQE's PSN
    assert!(err(pd.create_qp_suspended(&init, &s)).contains("inconsistent"));
    let mut s = valid(0x500);
    s.runtime.resp_queue = (0..10_000).map(|p| RespJob::Ack { psn: p, syndrome: 0 }).collect();
    assert!(pd.create_qp_suspended(&init, &s).is_err(), "oversized state refused");
    let mut s = valid(0x500);
    s.attr.qp_state = QpState::Init;
    assert!(err(pd.create_qp_suspended(&init, &s)).contains("RTR/RTS/SQD"));
    let mut s = valid(0x500);
    s.attr.retry_cnt = 9;
    assert!(pd.create_qp_suspended(&init, &s).is_err());

    // A valid state makes a suspended QP with that QPN; the QPN is then taken.
    let q = pd.create_qp_suspended(&init, &valid(0x500)).unwrap();
    assert_eq!(q.qpn, 0x500);
    assert!(err(pd.create_qp_suspended(&init, &valid(0x500))).contains("already in use"));
    let st = q.query_state().unwrap();
    assert_eq!((st.runtime.una, st.runtime.next_psn, st.runtime.epsn), (95, 90, 5));
    q.resume().unwrap();
    assert!(q.resume().is_err(), "resume of a running QP");
    assert!(q.query_state().is_err(), "query of a running QP");

    // Restore only into a QP in RESET that the client owns.
    assert!(format!("{:#}", ctx.restore_qps(&[valid(0x500)]).unwrap_err()).contains("RESET"));
    let other = bed.ctx(0);
    assert!(format!("{:#}", other.restore_qps(&[valid(0x500)]).unwrap_err()).contains("no QP"));
    assert!(other.suspend_qps(&[&q]).is_err(), "another client's QP");
    let fresh = pd.create_qp_with_qpn(&init, 0x501).unwrap();
    let mut s = valid(0x501);
    s.runtime.epsn = 0xffff_ffff; // masked to 24 bits, accepted
    ctx.restore_qps(&[s]).unwrap();
    assert_eq!(fresh.query_state().unwrap().runtime.epsn, 0xff_ffff);
    // rnicd is still fine.
    assert!(ctx.stats().unwrap()["bad_client_requests"].as_u64().unwrap() >= 8);
}

/// SuspendConnected (a migration's pause): only the connected QPs of the
/// batch are suspended and named; a batch with a QP that is not the
/// caller's is refused whole and suspends nothing.
#[test]
fn suspend_connected_takes_the_connected_qps_only() {
    let bed = Bed::new("rnsusc", 2);
    let (a, _b) = pair(&bed, 0, 1, ConnectOpts::default());
    let fresh = a.pd.create_qp(&QpInitAttr::new(&a.scq, &a.rcq)).unwrap();
    let other = End::new(bed.ctx(0), 4096, 4);

    let e = a.ctx.suspend_connected(&[&a.qp, &other.qp]).unwrap_err();
    assert!(format!("{e:#}").contains("no QP"), "{e:#}");
    assert!(a.qp.query_state().is_err(), "a refused batch suspends nothing");

    let done = a.ctx.suspend_connected(&[&fresh, &a.qp, &a.qp]).unwrap();
    assert_eq!(done, vec![a.qp.qpn], "the RESET QP is left alone, a repeated QPN named once");
    a.qp.query_state().unwrap();
    assert!(fresh.query_state().is_err());
    assert_eq!(a.ctx.suspend_connected(&[&a.qp]).unwrap(), vec![a.qp.qpn], "a suspended QP stays suspended");
    assert_eq!(a.ctx.suspend_connected(&[]).unwrap(), Vec::<u32>::new());
    a.ctx.resume_qps(&[&a.qp]).unwrap();
    assert!(a.qp.query_state().is_err(), "running again");
}

/// LoadQpStates (a migration's switch into QPs built ahead): only a
/// suspended QP of the caller's takes a state, and a batch with any bad
/// QP or state is refused whole.
#[test]
fn load_qp_states_takes_states_into_suspended_qps_only() {
    let bed = Bed::new("rnload", 1);
    let ctx = bed.ctx(0);
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16, None).unwrap();
    let init = QpInitAttr::new(&cq, &cq);
    let err = |r: anyhow::Result<()>| format!("{:#}", r.expect_err("refused"));

    // Built ahead: suspended, no state yet (RESET), rings allocated.
    let made = ctx
        .create_batch(&[
            NewObject::QpAwaitingState { pd: &pd, init: &init, qpn: 0x600 },
            NewObject::QpAwaitingState { pd: &pd, init: &init, qpn: 0x601 },
        ])
        .unwrap();
    let qps: Vec<Qp> = made.into_iter().map(|m| if let Made::Qp(q) = m { q } else { panic!("not a QP") }).collect();
    assert_eq!((qps[0].qpn, qps[1].qpn), (0x600, 0x601));
    assert_eq!(qps[0].query().unwrap().0.qp_state, QpState::Reset, "no state before the load");
    let fresh = pd.create_qp_with_qpn(&init, 0x602).unwrap();

    // A QP that is not suspended, a QPN that does not exist, another
    // client's QP, a QP named twice, bad states: each refused.
    assert!(err(ctx.load_qp_states(&[valid(0x602)])).contains("not suspended"));
    assert!(err(ctx.load_qp_states(&[valid(0x7777)])).contains("no QP"));
    assert!(err(bed.ctx(0).load_qp_states(&[valid(0x600)])).contains("no QP"));
    assert!(err(ctx.load_qp_states(&[valid(0x600), valid(0x600)])).contains("twice"));
    let mut s = valid(0x601);
    s.version = 2;
    assert!(err(ctx.load_qp_states(&[valid(0x600), s])).contains("version"));
    let mut s = valid(0x601);
    s.runtime.una = 80;
    assert!(err(ctx.load_qp_states(&[valid(0x600), s])).contains("inconsistent"));
    let mut s = valid(0x601);
    s.attr.qp_state = QpState::Init;
    assert!(err(ctx.load_qp_states(&[valid(0x600), s])).contains("RTR/RTS/SQD"));
    let mut s = valid(0x601);
    s.runtime.resp_queue = (0..10_000).map(|p| RespJob::Ack { psn: p, syndrome: 0 }).collect();
    assert!(ctx.load_qp_states(&[valid(0x600), s]).is_err(), "oversized state refused");
    // All or nothing: the good state of each refused batch was not taken.
    assert_eq!(qps[0].query().unwrap().0.qp_state, QpState::Reset);

    // Valid states load; the QPs stay suspended until they resume.
    ctx.load_qp_states(&[valid(0x600), valid(0x601)]).unwrap();
    let st = qps[1].query_state().unwrap();
    assert_eq!((st.attr.qp_state, st.runtime.una, st.runtime.next_psn, st.runtime.epsn), (QpState::Rts, 95, 90, 5));
    // A suspended QP that has its state may take another (the last wins).
    let mut s = valid(0x600);
    s.runtime.epsn = 7;
    ctx.load_qp_states(&[s]).unwrap();
    assert_eq!(qps[0].query_state().unwrap().runtime.epsn, 7);
    ctx.resume_qps(&[&qps[0], &qps[1]]).unwrap();
    assert!(err(ctx.load_qp_states(&[valid(0x600)])).contains("not suspended"), "a resumed QP takes no state");
    drop(fresh);
    // A QP awaiting a state cannot be UD, and rnicd is still fine.
    let mut ud = QpInitAttr::new(&cq, &cq);
    ud.qp_type = QpType::Ud;
    assert!(ctx.create_batch(&[NewObject::QpAwaitingState { pd: &pd, init: &ud, qpn: 0x610 }]).is_err());
    assert!(ctx.stats().unwrap()["bad_client_requests"].as_u64().unwrap() >= 10);
}
