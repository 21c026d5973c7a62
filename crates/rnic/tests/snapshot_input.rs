//! QP states come from clients: create-suspended and the migration requests
//! refuse bad ones with a clear error and never harm rnicd.
mod common;
use common::*;
use rnic::qp::RespJob;
use verbs::*;

fn valid(qpn: u32) -> QpSnapshot {
    rts_state(qpn, "10.9.9.9".parse().unwrap())
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
    let fresh2 = pd.create_qp_with_qpn(&init, 0x502).unwrap();
    // A QP named twice, or a bad state beside a good one: the whole
    // batch is refused and no QP takes its state.
    assert!(format!("{:#}", ctx.restore_qps(&[valid(0x501), valid(0x501)]).unwrap_err()).contains("twice"));
    let mut bad = valid(0x502);
    bad.runtime.una = 80;
    assert!(format!("{:#}", ctx.restore_qps(&[valid(0x501), bad]).unwrap_err()).contains("inconsistent"));
    assert_eq!(fresh.query().unwrap().0.qp_state, QpState::Reset, "a refused batch restores nothing");
    assert!(fresh.query_state().is_err(), "not suspended");
    let mut s = valid(0x501);
    s.runtime.epsn = 0xffff_ffff; // masked to 24 bits, accepted
    ctx.restore_qps(&[s, valid(0x502)]).unwrap();
    assert_eq!(fresh.query_state().unwrap().runtime.epsn, 0xff_ffff);
    assert_eq!(fresh2.query_state().unwrap().runtime.una, 95);
    // rnicd is still fine.
    assert!(ctx.stats().unwrap()["bad_client_requests"].as_u64().unwrap() >= 10);

    // A state that says 5 PSNs of the oldest WQE were acknowledged, and a
    // one-packet WQE reposted for it: the resume's resend names a packet
    // beyond that WQE. The WQE fails; rnicd runs on.
    let mut init = QpInitAttr::new(&cq, &cq);
    init.cap.max_inline_data = 64;
    let q = pd.create_qp_suspended(&init, &valid(0x503)).unwrap();
    q.post_send(&[SendWr::send(7, &[]).with_inline(&[1u8])]).unwrap();
    q.resume().unwrap();
    let wc = cq.wait(1, T).unwrap();
    assert_eq!((wc[0].wr_id, wc[0].status), (7, WcStatus::LocQpOpErr), "{wc:?}");
    assert!(ctx.stats().is_ok(), "rnicd answers after the bad resume");
}

/// SuspendConnected (a migration's pause): only the connected QPs of the
/// batch are suspended and named; a batch with a QP that is not the
/// caller's is refused whole and suspends nothing. SuspendQps and
/// ResumeQps are all or nothing too.
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

    // SuspendQps and ResumeQps check every QP before they change any: a
    // batch with a QP that cannot be suspended (RESET) or resumed (not
    // suspended) is refused whole; a QP named twice is taken once.
    let e = a.ctx.suspend_qps(&[&a.qp, &fresh]).unwrap_err();
    assert!(format!("{e:#}").contains("RTR/RTS/SQD"), "{e:#}");
    assert!(a.qp.query_state().is_err(), "a refused batch suspends nothing");
    a.ctx.suspend_qps(&[&a.qp, &a.qp]).unwrap();
    let e = a.ctx.resume_qps(&[&a.qp, &fresh]).unwrap_err();
    assert!(format!("{e:#}").contains("not suspended"), "{e:#}");
    a.qp.query_state().expect("a refused batch resumes nothing");
    a.ctx.resume_qps(&[&a.qp, &a.qp]).unwrap();
    assert!(a.qp.query_state().is_err(), "running again");
}

/// LoadQpStates (a migration's switch into QPs built ahead): only a QP of
/// the caller's made to await its state takes one, once; a QP that ran
/// (even suspended since) never does, and a batch with any bad QP or
/// state is refused whole.
#[test]
fn load_qp_states_fills_only_qps_awaiting_their_state() {
    let bed = Bed::new("rnload", 1);
    let ctx = bed.ctx(0);
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16, None).unwrap();
    let init = QpInitAttr::new(&cq, &cq);
    let err = |r: anyhow::Result<()>| format!("{:#}", r.expect_err("refused"));

    // Built ahead: suspended, no state yet (RESET), rings allocated.
    let made = ctx
        .create_batch(&[
            NewObject::QpAwaitingState { pd: &pd, init: &init, qpn: 0x600, peer: None },
            NewObject::QpAwaitingState { pd: &pd, init: &init, qpn: 0x601, peer: None },
        ])
        .unwrap();
    let qps: Vec<Qp> = made.into_iter().map(|m| if let Made::Qp(q) = m { q } else { panic!("not a QP") }).collect();
    assert_eq!((qps[0].qpn, qps[1].qpn), (0x600, 0x601));
    assert_eq!(qps[0].query().unwrap().0.qp_state, QpState::Reset, "no state before the load");
    let fresh = pd.create_qp_with_qpn(&init, 0x602).unwrap();
    // A QP that ran: connected (loopback), a message each way, suspended.
    let (a, b) = pair_sized(&bed, 0, 0, ConnectOpts::default(), 4096, 4);
    for (from, to) in [(&a, &b), (&b, &a)] {
        to.qp.post_recv(&[RecvWr { wr_id: 1, sg_list: &[to.mr.sge(0, 64)] }]).unwrap();
        from.qp.post_send(&[SendWr::send(2, &[from.mr.sge(1024, 64)])]).unwrap();
        ok(&from.scq);
        ok(&to.rcq);
    }
    assert_eq!(a.ctx.suspend_connected(&[&a.qp]).unwrap(), vec![a.qp.qpn]);
    let ran = a.qp.query_state().unwrap();

    // A QP that is not suspended, a QP that ran and was suspended (even
    // with its own state), a QPN that does not exist, another client's
    // QP, a QP named twice, bad states: each refused.
    assert!(err(ctx.load_qp_states(&[valid(0x602)])).contains("not awaiting"));
    let mut s = valid(a.qp.qpn);
    s.attr.dest_qp_num = b.qp.qpn;
    assert!(err(a.ctx.load_qp_states(&[s])).contains("not awaiting"), "a QP that ran");
    assert!(err(a.ctx.load_qp_states(std::slice::from_ref(&ran))).contains("not awaiting"), "a QP that ran, its own state");
    assert_eq!(a.qp.query_state().unwrap().runtime.una, ran.runtime.una, "the QP that ran is as it was");
    assert!(err(ctx.load_qp_states(&[valid(0x600), valid(0x602)])).contains("not awaiting"));
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
    // A QP that has its state takes no other (it loads once).
    let mut s = valid(0x600);
    s.runtime.epsn = 7;
    assert!(err(ctx.load_qp_states(&[s])).contains("not awaiting"));
    assert_eq!(qps[0].query_state().unwrap().runtime.epsn, 5, "the loaded state stays");
    ctx.resume_qps(&[&qps[0], &qps[1]]).unwrap();
    assert!(err(ctx.load_qp_states(&[valid(0x600)])).contains("not awaiting"), "a resumed QP takes no state");
    // One made to await a state that resumed without one is an ordinary
    // QP in RESET: it takes none either.
    let made = ctx.create_batch(&[NewObject::QpAwaitingState { pd: &pd, init: &init, qpn: 0x603, peer: None }]).unwrap();
    let Made::Qp(unloaded) = &made[0] else { panic!("not a QP") };
    ctx.resume_qps(&[unloaded]).unwrap();
    assert!(err(ctx.load_qp_states(&[valid(0x603)])).contains("not awaiting"));
    drop(fresh);
    // A QP awaiting a state cannot be UD, and rnicd is still fine.
    let mut ud = QpInitAttr::new(&cq, &cq);
    ud.qp_type = QpType::Ud;
    assert!(ctx.create_batch(&[NewObject::QpAwaitingState { pd: &pd, init: &ud, qpn: 0x610, peer: None }]).is_err());
    assert!(ctx.stats().unwrap()["bad_client_requests"].as_u64().unwrap() >= 14);
    // The QPs that refused states still work: the one that ran resumes
    // and carries a message.
    a.ctx.resume_qps(&[&a.qp]).unwrap();
    b.qp.post_recv(&[RecvWr { wr_id: 3, sg_list: &[b.mr.sge(0, 64)] }]).unwrap();
    a.qp.post_send(&[SendWr::send(4, &[a.mr.sge(1024, 64)])]).unwrap();
    ok(&a.scq);
    assert_eq!(ok(&b.rcq).wr_id, 3);
}
