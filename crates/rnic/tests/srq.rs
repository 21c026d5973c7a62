//! Shared receive queues (docs/rnic.md, "Shared receive queues"): real
//! rnicd processes on testbed hosts; several QPs taking receives from one
//! SRQ, RNR NAKs while it is empty, the limit event, the checks of its
//! verbs, and an SRQ holding WQEs saved and restored with its QP.
mod common;
use common::*;
use std::collections::HashSet;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};
use verbs::*;

/// Receivers on one host: a PD, an SRQ, a receive buffer, and `n` RC QPs
/// attached to the SRQ (each with its own CQs).
struct Receivers {
    qps: Vec<Qp>,
    srq: Srq,
    rcq: Cq,
    scq: Cq,
    mr: Mr,
    buf: MemBuf,
    pd: Pd,
    ctx: Context,
}

const SLOT: usize = 4096;

impl Receivers {
    fn new(ctx: Context, n: usize, attr: SrqAttr) -> Receivers {
        let pd = ctx.alloc_pd().unwrap();
        let srq = pd.create_srq(&attr).unwrap();
        let scq = ctx.create_cq(256, None).unwrap();
        let rcq = ctx.create_cq(1024, None).unwrap();
        let qps = (0..n).map(|_| new_qp(&pd, &scq, &rcq, Some(&srq))).collect();
        let buf = MemBuf::new(4 << 20).unwrap();
        let mr = pd.reg_mr(&buf, 0, buf.len(), access::ALL).unwrap();
        Receivers { qps, srq, rcq, scq, mr, buf, pd, ctx }
    }

    /// Posts receive `i` (wr_id i, its own slot of the buffer).
    fn post(&self, i: u64) {
        let sge = self.mr.sge((i as usize % 1024) * SLOT, SLOT);
        self.srq.post_recv(&[RecvWr { wr_id: i, sg_list: &[sge] }]).unwrap();
    }
}

fn new_qp(pd: &Pd, scq: &Cq, rcq: &Cq, srq: Option<&Srq>) -> Qp {
    let mut init = QpInitAttr::new(scq, rcq);
    init.cap.max_recv_wr = 1;
    let qp = pd.create_qp(&init).unwrap();
    if let Some(s) = srq {
        qp.attach_srq(s).unwrap();
    }
    qp
}

/// A sender on another host: one QP per receiver QP.
fn senders(ctx: &Context, r: &Receivers, o: ConnectOpts) -> (Vec<Qp>, Cq, Mr, MemBuf, Pd) {
    let pd = ctx.alloc_pd().unwrap();
    let scq = ctx.create_cq(1024, None).unwrap();
    let rcq = ctx.create_cq(64, None).unwrap();
    let buf = MemBuf::new(1 << 20).unwrap();
    let mr = pd.reg_mr(&buf, 0, buf.len(), access::ALL).unwrap();
    let qps: Vec<Qp> = r.qps.iter().map(|_| new_qp(&pd, &scq, &rcq, None)).collect();
    for (s, q) in qps.iter().zip(&r.qps) {
        s.connect(&q.endpoint(0x100), &ConnectOpts { sq_psn: 0x900, ..o }).unwrap();
        q.connect(&s.endpoint(0x900), &ConnectOpts { sq_psn: 0x100, ..o }).unwrap();
    }
    (qps, scq, mr, buf, pd)
}

/// The message `m` of sender `q`: its first 8 bytes say who and which.
fn message(q: usize, m: u64, len: usize) -> Vec<u8> {
    let mut d = pattern(q as u64 * 1_000_003 + m, len);
    d[..8].copy_from_slice(&((q as u64) << 32 | m).to_le_bytes());
    d
}

fn opts() -> ConnectOpts {
    ConnectOpts { rnr_retry: 7, min_rnr_timer: 1, ..Default::default() }
}

fn stat(ctx: &Context, name: &str) -> u64 {
    ctx.stats().unwrap()[name].as_u64().unwrap()
}

/// Waits for `n` completions of `cq`, all successful.
fn oks(cq: &Cq, n: usize) -> Vec<Wc> {
    let w = cq.wait(n, T).unwrap();
    assert_eq!(w.len(), n);
    for c in &w {
        assert_eq!(c.status, WcStatus::Success, "{c:?}");
    }
    w
}

#[test]
fn qps_share_one_receive_queue_and_get_rnr_naks_when_it_is_empty() {
    let bed = Bed::new("rnsrq", 2);
    let r = Receivers::new(bed.ctx(0), 3, SrqAttr { max_wr: 64, max_sge: 2, srq_limit: 0 });
    let sctx = bed.ctx(1);
    let (sq, scq, smr, sbuf, _spd) = senders(&sctx, &r, opts());

    // Every receive goes to exactly one message, whichever QP it came by;
    // each message lands whole (up to 3 packets at the default path MTU).
    const PER_QP: u64 = 20;
    for i in 0..3 * PER_QP {
        r.post(i);
    }
    for m in 0..PER_QP {
        for (q, s) in sq.iter().enumerate() {
            let len = 100 + (m as usize * 211) % 3000;
            let off = (q * PER_QP as usize + m as usize) * SLOT;
            sbuf.write(off, &message(q, m, len));
            s.post_send(&[SendWr::send(m, &[smr.sge(off, len)])]).unwrap();
        }
    }
    oks(&scq, 3 * PER_QP as usize);
    let wcs = oks(&r.rcq, 3 * PER_QP as usize);
    let mut used = HashSet::new();
    let mut next = [0u64; 3];
    for w in &wcs {
        assert!(used.insert(w.wr_id), "receive {} completed twice", w.wr_id);
        let got = r.buf.read((w.wr_id as usize % 1024) * SLOT, w.byte_len as usize);
        let who = u64::from_le_bytes(got[..8].try_into().unwrap());
        let (q, m) = ((who >> 32) as usize, who & 0xffff_ffff);
        assert_eq!(r.qps[q].qpn, w.qp_num, "the completion names the QP the message came by");
        assert_eq!(m, next[q], "messages of one QP complete in order");
        next[q] += 1;
        assert_eq!(got, message(q, m, w.byte_len as usize));
    }
    assert_eq!(r.srq.query().unwrap(), SrqAttr { max_wr: 64, max_sge: 2, srq_limit: 0 });

    // Empty SRQ: the senders' messages get RNR NAKs until receives come.
    let naks = stat(&r.ctx, "rnr_naks_sent");
    for (q, s) in sq.iter().enumerate() {
        sbuf.write(q * SLOT, &message(q, 99, 64));
        s.post_send(&[SendWr::send(99, &[smr.sge(q * SLOT, 64)])]).unwrap();
    }
    let t0 = Instant::now();
    while stat(&r.ctx, "rnr_naks_sent") < naks + 3 && t0.elapsed() < T {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(stat(&r.ctx, "rnr_naks_sent") >= naks + 3, "every QP answered with an RNR NAK");
    assert_eq!(r.rcq.poll(&mut [Wc::default(); 4]).unwrap(), 0);
    for i in 100..103 {
        r.post(i);
    }
    oks(&scq, 3);
    let got: HashSet<u64> = oks(&r.rcq, 3).iter().map(|w| w.wr_id).collect();
    assert_eq!(got, (100..103).collect());
}

#[test]
fn limit_event_and_bad_calls() {
    let bed = Bed::new("rnsrl", 2);
    let r = Receivers::new(bed.ctx(0), 1, SrqAttr { max_wr: 8, max_sge: 1, srq_limit: 0 });
    let ev = rnic::eventfd::create(true).unwrap();
    r.ctx.open_async(ev.as_raw_fd()).unwrap();

    // Bad attributes and calls are refused and change nothing.
    assert!(r.pd.create_srq(&SrqAttr { max_wr: 0, max_sge: 1, srq_limit: 0 }).is_err());
    assert!(r.pd.create_srq(&SrqAttr { max_wr: 8, max_sge: 9, srq_limit: 0 }).is_err());
    assert!(r.pd.create_srq(&SrqAttr { max_wr: 8, max_sge: 1, srq_limit: 9 }).is_err());
    assert!(r.srq.set_limit(9).is_err(), "a limit above max_wr");
    let two = [r.mr.sge(0, 8), r.mr.sge(8, 8)];
    assert!(r.srq.post_recv(&[RecvWr { wr_id: 1, sg_list: &two }]).is_err(), "more SGEs than max_sge");
    for i in 0..8 {
        r.post(i);
    }
    assert!(r.srq.post_recv(&[RecvWr { wr_id: 9, sg_list: &two[..1] }]).is_err(), "more WRs than max_wr");
    let connected = &r.qps[0];
    assert!(connected.attach_srq(&r.srq).is_err(), "attached twice");

    // Limit 4: the take that leaves 3 posted raises the event, once.
    r.srq.set_limit(4).unwrap();
    assert_eq!(r.srq.query().unwrap().srq_limit, 4);
    let sctx = bed.ctx(1);
    let (sq, scq, smr, _sbuf, _spd) = senders(&sctx, &r, opts());
    for m in 0..6 {
        sq[0].post_send(&[SendWr::send(m, &[smr.sge(0, 32)])]).unwrap();
        oks(&scq, 1);
        oks(&r.rcq, 1);
        let evs = r.ctx.fetch_async().unwrap();
        let want = if m == 4 { vec![AsyncEvent { kind: AsyncKind::SrqLimitReached, object: r.srq.handle() }] } else { vec![] };
        assert_eq!(evs, want, "after message {m}");
    }
    assert_eq!(r.srq.query().unwrap().srq_limit, 0, "the event disarmed the limit");

    // A QP past RESET cannot be attached; the SRQ is busy while a QP uses it.
    let other = new_qp(&r.pd, &r.scq, &r.rcq, None);
    other
        .modify(
            &QpAttr { qp_state: QpState::Init, port_num: 1, ..Default::default() },
            mask::STATE | mask::PORT | mask::ACCESS_FLAGS | mask::PKEY_INDEX,
        )
        .unwrap();
    assert!(other.attach_srq(&r.srq).is_err(), "attach past RESET");
    let Receivers { qps, srq, .. } = r;
    let (srq, e) = srq.destroy().expect_err("destroyed while a QP uses it");
    assert!(format!("{e:#}").contains("busy"), "{e:#}");
    drop(qps);
    drop(sq);
    srq.destroy().map_err(|(_, e)| e).unwrap();
}

#[test]
fn srq_holding_wqes_is_saved_and_restored_with_its_qp() {
    let bed = Bed::new("rnsrs", 2);
    let attr = SrqAttr { max_wr: 32, max_sge: 1, srq_limit: 0 };
    let r = Receivers::new(bed.ctx(0), 1, attr);
    let sctx = bed.ctx(1);
    let (sq, scq, smr, sbuf, _spd) = senders(&sctx, &r, opts());
    // Receives 0..10 posted; messages 0..4 take 0..4.
    for i in 0..10 {
        r.post(i);
    }
    let send = |m: u64| {
        let off = (m as usize % 200) * SLOT;
        sbuf.write(off, &message(0, m, 1000));
        sq[0].post_send(&[SendWr::send(m, &[smr.sge(off, 1000)])]).unwrap();
    };
    for m in 0..4 {
        send(m);
    }
    oks(&scq, 4);
    let done: Vec<u64> = oks(&r.rcq, 4).iter().map(|w| w.wr_id).collect();
    assert_eq!(done, [0, 1, 2, 3]);

    // Save: suspend the QP; the SRQ's state says what rnicd took from it.
    let qp = &r.qps[0];
    qp.suspend().unwrap();
    let qst = qp.query_state().unwrap();
    let sst = r.srq.query_state().unwrap();
    assert_eq!(sst.taken, 4);
    assert!(sst.returned.is_empty());
    let sst: SrqSnapshot = serde_json::from_slice(&serde_json::to_vec(&sst).unwrap()).unwrap();
    // The peer keeps sending while the QP is away: RNR NAKs, then retries.
    for m in 4..8 {
        send(m);
    }

    // Restore in the same namespace: new SRQ and QP (same QPN), the
    // unconsumed receives reposted, then resume.
    let Receivers { qps, srq, rcq, scq: rscq, mr, buf, pd, ctx } = r;
    let qpn = qps[0].qpn;
    drop(qps);
    drop(srq);
    let srq2 = pd.create_srq_restored(&attr, &sst).unwrap();
    let mut init = QpInitAttr::new(&rscq, &rcq);
    init.cap.max_recv_wr = 1;
    let qp2 = pd.create_qp_suspended(&init, &qst).unwrap();
    assert_eq!(qp2.qpn, qpn);
    qp2.attach_srq(&srq2).unwrap();
    for i in sst.taken..10 {
        let sge = mr.sge(i as usize * SLOT, SLOT);
        srq2.post_recv(&[RecvWr { wr_id: i, sg_list: &[sge] }]).unwrap();
    }
    qp2.resume().unwrap();
    oks(&scq, 4);
    let wcs = oks(&rcq, 4);
    for (k, w) in wcs.iter().enumerate() {
        assert_eq!(w.wr_id, 4 + k as u64, "the restored SRQ hands out the receives in order");
        assert_eq!(buf.read(w.wr_id as usize * SLOT, 1000), message(0, 4 + k as u64, 1000));
    }
    assert!(srq2.query_state().is_err(), "the QP runs again: no state while it does");
    drop(ctx);
}

#[test]
fn ud_qps_take_datagram_receives_from_the_srq() {
    const QKEY: u32 = 0x1234_5678;
    let bed = Bed::new("rnsru", 2);
    let ctx = bed.ctx(0);
    let pd = ctx.alloc_pd().unwrap();
    let srq = pd.create_srq(&SrqAttr { max_wr: 16, max_sge: 1, srq_limit: 0 }).unwrap();
    let cq = ctx.create_cq(64, None).unwrap();
    let ud = |pd: &Pd, cq: &Cq, srq: Option<&Srq>| {
        let mut init = QpInitAttr::new(cq, cq);
        init.qp_type = QpType::Ud;
        let qp = pd.create_qp(&init).unwrap();
        if let Some(s) = srq {
            qp.attach_srq(s).unwrap();
        }
        qp.ud_activate(QKEY, 1).unwrap();
        qp
    };
    let r = [ud(&pd, &cq, Some(&srq)), ud(&pd, &cq, Some(&srq))];
    let buf = MemBuf::new(1 << 20).unwrap();
    let mr = pd.reg_mr(&buf, 0, buf.len(), access::LOCAL_WRITE).unwrap();
    for i in 0..4u64 {
        srq.post_recv(&[RecvWr { wr_id: i, sg_list: &[mr.sge(i as usize * SLOT, SLOT)] }]).unwrap();
    }
    let sctx = bed.ctx(1);
    let spd = sctx.alloc_pd().unwrap();
    let scq = sctx.create_cq(64, None).unwrap();
    let s = ud(&spd, &scq, None);
    let sbuf = MemBuf::new(1 << 16).unwrap();
    let smr = spd.reg_mr(&sbuf, 0, sbuf.len(), access::LOCAL_WRITE).unwrap();
    // Datagrams to either QP take the SRQ's receives in order.
    for m in 0..4u64 {
        let q = &r[m as usize % 2];
        let data = message(m as usize % 2, m, 500);
        sbuf.write(m as usize * 512, &data);
        let dest = UdDest { gid: ctx.gid(), qpn: q.qpn, qkey: QKEY };
        s.post_send(&[SendWr::send_to(m, &[smr.sge(m as usize * 512, 500)], dest)]).unwrap();
        oks(&scq, 1);
        let w = oks(&cq, 1)[0];
        assert_eq!((w.wr_id, w.qp_num, w.byte_len), (m, q.qpn, GRH_LEN as u32 + 500));
        assert_eq!(buf.read(m as usize * SLOT + GRH_LEN, 500), data);
    }
    // An empty SRQ: the datagram is dropped, as with an empty RQ.
    let drops = stat(&ctx, "ud_no_recv_drops");
    let dest = UdDest { gid: ctx.gid(), qpn: r[0].qpn, qkey: QKEY };
    s.post_send(&[SendWr::send_to(9, &[smr.sge(0, 64)], dest)]).unwrap();
    oks(&scq, 1);
    let t0 = Instant::now();
    while stat(&ctx, "ud_no_recv_drops") == drops && t0.elapsed() < T {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(stat(&ctx, "ud_no_recv_drops"), drops + 1);
    assert_eq!(cq.poll(&mut [Wc::default(); 2]).unwrap(), 0);
}

/// Control requests about SRQs with bad arguments, straight into an engine
/// (no client-side checks in the way): each gets an error and changes nothing.
#[test]
fn bad_srq_requests_get_errors() {
    use common::direct::{self, dup};
    use rnic::proto::{Reply, Request};
    use rnic::qp_snapshot::SavedRecv;
    use rnic::ring::{ring_bytes, RecvWqe};

    let mut e = rnic::engine::Engine::new("10.9.0.1".parse().unwrap());
    let (c, other) = (1, 2);
    let Reply::Pd(pd) = e.control(c, Request::AllocPd, vec![]).unwrap() else { panic!() };
    let ring = rnic::mem::sealed_memfd("srq", ring_bytes::<RecvWqe>(16)).unwrap();
    let attr = SrqAttr { max_wr: 16, max_sge: 2, srq_limit: 0 };
    let create = |attr: SrqAttr, slots: u32, restore: Option<SrqSnapshot>| Request::CreateSrq { pd, attr, slots, restore };
    let bad = [
        (create(SrqAttr { max_wr: 0, ..attr }, 16, None), "max_wr 0"),
        (create(SrqAttr { max_wr: MAX_SRQ_WR + 1, ..attr }, 1 << 15, None), "max_wr too large"),
        (create(SrqAttr { max_sge: 0, ..attr }, 16, None), "max_sge 0"),
        (create(SrqAttr { max_sge: 9, ..attr }, 16, None), "max_sge 9"),
        (create(SrqAttr { srq_limit: 17, ..attr }, 16, None), "limit above max_wr"),
        (create(attr, 8, None), "ring smaller than max_wr"),
        (create(attr, 24, None), "ring not a power of two"),
        (create(attr, 64, None), "ring larger than its memfd"),
        (create(attr, 16, Some(SrqSnapshot { version: 99, ..Default::default() })), "unknown state version"),
        (
            create(
                attr,
                16,
                Some(SrqSnapshot { version: SRQ_SNAPSHOT_VERSION, returned: vec![SavedRecv::default(); 17], ..Default::default() }),
            ),
            "more saved WQEs than max_wr",
        ),
        (
            create(
                attr,
                16,
                Some(SrqSnapshot {
                    version: SRQ_SNAPSHOT_VERSION,
                    returned: vec![SavedRecv { wr_id: 1, sge: vec![(0, 1, 1); 3] }],
                    ..Default::default()
                }),
            ),
            "a saved WQE with more SGEs than max_sge",
        ),
        (Request::CreateSrq { pd: pd + 100, attr, slots: 16, restore: None }, "unknown PD"),
    ];
    for (req, why) in bad {
        assert!(e.control(c, req, vec![dup(&ring)]).is_err(), "{why}");
    }
    assert!(e.control(c, create(attr, 16, None), vec![]).is_err(), "no ring memfd");
    assert!(e.control(other, create(attr, 16, None), vec![dup(&ring)]).is_err(), "another client's PD");
    e.control(c, Request::DeallocPd { pd }, vec![]).expect("no SRQ was made in the PD");
    assert!(e.is_empty(), "nothing was made");
    let Reply::Pd(pd) = e.control(c, Request::AllocPd, vec![]).unwrap() else { panic!() };

    let Reply::Srq { srq, attr: got } = e.control(c, Request::CreateSrq { pd, attr, slots: 16, restore: None }, vec![dup(&ring)]).unwrap()
    else {
        panic!()
    };
    assert_eq!(got, attr);
    // Handles that are not the caller's SRQ, a resize, a limit past max_wr.
    for (req, why) in [
        (Request::QuerySrq { srq: srq + 100 }, "unknown SRQ"),
        (Request::ModifySrq { srq, max_wr: Some(32), srq_limit: None }, "resize"),
        (Request::ModifySrq { srq, max_wr: None, srq_limit: Some(17) }, "limit past max_wr"),
        (Request::DestroySrq { srq: srq + 100 }, "destroy unknown"),
        (Request::AttachSrq { qpn: 0x1234, srq }, "attach to an unknown QP"),
    ] {
        assert!(e.control(c, req, vec![]).is_err(), "{why}");
    }
    for req in [Request::QuerySrq { srq }, Request::DestroySrq { srq }, Request::QuerySrqState { srq }] {
        assert!(e.control(other, req, vec![]).is_err(), "another client's SRQ");
    }
    assert!(e.control(c, Request::DeallocPd { pd }, vec![]).is_err(), "the PD holds the SRQ");

    // A QP of another PD cannot use it; a QP of its PD can, once.
    let Reply::Pd(pd2) = e.control(c, Request::AllocPd, vec![]).unwrap() else { panic!() };
    let (cq, _cqfd) = direct::cq(&mut e, c, 64);
    let (q2, _q2_rings) = direct::rc_qp(&mut e, c, pd2, cq, 1, 0);
    assert!(e.control(c, Request::AttachSrq { qpn: q2, srq }, vec![]).is_err(), "a QP of another PD");
    let (q1, _q1_rings) = direct::rc_qp(&mut e, c, pd, cq, 1, 0);
    e.control(c, Request::AttachSrq { qpn: q1, srq }, vec![]).unwrap();
    assert!(e.control(c, Request::AttachSrq { qpn: q1, srq }, vec![]).is_err(), "attached twice");
    // A QP in RESET holds none of the SRQ's WQEs: the state can be taken
    // without suspending it (only connected QPs must be).
    assert!(matches!(e.control(c, Request::QuerySrqState { srq }, vec![]).unwrap(), Reply::SrqState(_)), "its QP is in RESET");
    assert!(e.control(c, Request::DestroySrq { srq }, vec![]).is_err(), "busy");
    e.control(c, Request::DestroyQp { qpn: q1 }, vec![]).unwrap();
    assert!(matches!(e.control(c, Request::QuerySrqState { srq }, vec![]).unwrap(), Reply::SrqState(_)));
    e.control(c, Request::DestroySrq { srq }, vec![]).unwrap();
    // The client goes: everything of it goes.
    drop(e.client_gone(c));
    assert!(e.is_empty());
}
