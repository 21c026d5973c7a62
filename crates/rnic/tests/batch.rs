//! Batched control requests: CreateBatch (many MRs, CQs and QPs in one
//! request, all or nothing) and FetchTraces. The engine is driven with raw
//! requests for bad input; the real rnicd serves a batch-made QP that
//! carries traffic to a peer.
mod common;

use std::net::Ipv4Addr;
use std::os::fd::OwnedFd;

use common::*;
use rnic::engine::Engine;
use rnic::mem::sealed_memfd;
use rnic::proto::{Create, Reply, Request, MAX_CREATE_BATCH, MAX_TRACE_BATCH};
use rnic::ring::{ring_bytes, RecvWqe, SendWqe};
use verbs::*;

const CLIENT: u64 = 1;
const PAGE: u64 = 4096;

use common::direct::dup;

/// An engine with one PD of CLIENT, guest-like memory (16 pages) and a
/// rings memfd (64 pages).
fn rig() -> (Engine, u32, OwnedFd, OwnedFd) {
    let mut e = Engine::new(Ipv4Addr::new(10, 9, 0, 1));
    let Reply::Pd(pd) = e.control(CLIENT, Request::AllocPd, vec![]).unwrap() else { panic!() };
    (e, pd, sealed_memfd("mem", 16 * PAGE as usize).unwrap(), sealed_memfd("rings", 64 * PAGE as usize).unwrap())
}

fn mr(pd: u32, page: u64, key: u32) -> Create {
    Create::Mr { pd, iova: 0x10_0000 + page * PAGE, access: access::ALL, fd: 0, runs: vec![(page * PAGE, PAGE)], key: Some(key) }
}

fn cq(page: u64) -> Create {
    Create::Cq { cap: 64, channel: None, fd: 1, ring_offset: page * PAGE }
}

fn qp(pd: u32, cq: u32, qpn: u32, page: u64) -> Create {
    let cap = QpCap { max_send_wr: 16, max_recv_wr: 16, max_send_sge: 4, max_recv_sge: 4, max_inline_data: 0 };
    let sq_len = ring_bytes::<SendWqe>(16) as u64;
    Create::Qp {
        pd,
        send_cq: cq,
        recv_cq: cq,
        cap,
        sq_sig_all: false,
        sq_slots: 16,
        rq_slots: 16,
        qpn: Some(qpn),
        restore: None,
        qp_type: Default::default(),
        fd: 1,
        sq_offset: page * PAGE,
        rq_offset: page * PAGE + sq_len,
        await_state: false,
        peer: None,
    }
}

fn batch(e: &mut Engine, items: Vec<Create>, fds: &[&OwnedFd]) -> Result<Vec<Reply>, String> {
    match e.control(CLIENT, Request::CreateBatch { items }, fds.iter().map(|f| dup(f)).collect()) {
        Ok(Reply::Created(v)) => Ok(v),
        Ok(r) => panic!("unexpected reply {r:?}"),
        Err(e) => Err(format!("{e:#}")),
    }
}

/// Whether the PD has nothing left on it (DeallocPd refuses a PD with MRs
/// or QPs), allocating it again for the next step.
fn pd_is_bare(e: &mut Engine, pd: &mut u32) -> bool {
    let bare = e.control(CLIENT, Request::DeallocPd { pd: *pd }, vec![]).is_ok();
    if bare {
        let Reply::Pd(p) = e.control(CLIENT, Request::AllocPd, vec![]).unwrap() else { panic!() };
        *pd = p;
    }
    bare
}

#[test]
fn a_batch_makes_every_object_in_order() {
    let (mut e, pd, mem, rings) = rig();
    // A CQ first: the QPs of a restore name CQs of an earlier batch.
    let Reply::Cq(c) = batch(&mut e, vec![cq(0)], &[&mem, &rings]).unwrap().remove(0) else { panic!() };
    let sq_rq = (ring_bytes::<SendWqe>(16) + ring_bytes::<RecvWqe>(16)) as u64 / PAGE;
    let items = vec![mr(pd, 0, 0x100), mr(pd, 1, 0x101), cq(1), qp(pd, c, 0x2000, 2), qp(pd, c, 0x2001, 2 + sq_rq)];
    let r = batch(&mut e, items, &[&mem, &rings]).unwrap();
    assert!(matches!(r[0], Reply::Mr { lkey: 0x100, rkey: 0x100 }), "{r:?}");
    assert!(matches!(r[1], Reply::Mr { lkey: 0x101, .. }), "{r:?}");
    assert!(matches!(r[2], Reply::Cq(_)), "{r:?}");
    assert!(matches!(r[3], Reply::Qp { qpn: 0x2000, .. }) && matches!(r[4], Reply::Qp { qpn: 0x2001, .. }), "{r:?}");
    assert!(e.qp(0x2000).is_some() && e.qp(0x2001).is_some());
}

#[test]
fn a_batch_failing_midway_leaves_nothing_behind() {
    let (mut e, mut pd, mem, rings) = rig();
    let Reply::Cq(c) = batch(&mut e, vec![cq(0)], &[&mem, &rings]).unwrap().remove(0) else { panic!() };
    // A key taken twice in one batch: the MR, CQ and QP before it go.
    let items = vec![mr(pd, 0, 0x100), cq(1), qp(pd, c, 0x2000, 2), mr(pd, 1, 0x100)];
    let err = batch(&mut e, items, &[&mem, &rings]).unwrap_err();
    assert!(err.contains("item 3") && err.contains("already in use"), "{err}");
    assert!(e.qp(0x2000).is_none());
    assert!(pd_is_bare(&mut e, &mut pd), "the failed batch left an MR or a QP on the PD");
    // A QPN taken before the batch.
    batch(&mut e, vec![qp(pd, c, 0x3000, 2)], &[&mem, &rings]).unwrap();
    let err = batch(&mut e, vec![mr(pd, 0, 0x100), qp(pd, c, 0x3000, 8)], &[&mem, &rings]).unwrap_err();
    assert!(err.contains("item 1") && err.contains("already in use"), "{err}");
    // The same objects without the clash are made, with the same IDs.
    let r = batch(&mut e, vec![mr(pd, 0, 0x100), cq(1), qp(pd, c, 0x2000, 8)], &[&mem, &rings]).unwrap();
    assert!(matches!(r[0], Reply::Mr { lkey: 0x100, .. }) && matches!(r[2], Reply::Qp { qpn: 0x2000, .. }), "{r:?}");
}

#[test]
fn bad_batches_are_refused_and_harm_nothing() {
    let (mut e, mut pd, mem, rings) = rig();
    let Reply::Cq(c) = batch(&mut e, vec![cq(0)], &[&mem, &rings]).unwrap().remove(0) else { panic!() };
    // Made for the PD of the moment (each check allocates it anew).
    let case = |k: usize, pd: u32| -> (Vec<Create>, Vec<&OwnedFd>, &str) {
        let m = mr(pd, 0, 0x100);
        match k {
            0 => (vec![m, cq(1)], vec![&mem], "names memfd 1"),
            1 => (vec![m, Create::Cq { cap: 64, channel: None, fd: 1, ring_offset: 100 }], vec![&mem, &rings], "not page aligned"),
            2 => (vec![m, cq(64)], vec![&mem, &rings], "beyond the memfd"),
            3 => (vec![m, mr(pd + 99, 1, 0x101)], vec![&mem, &rings], "no PD"),
            4 => (vec![m, qp(pd, c + 99, 0x2000, 2)], vec![&mem, &rings], "no CQ"),
            5 => (vec![m, qp(pd, c, 1, 2)], vec![&mem, &rings], "outside"),
            6 => (vec![m, mr(pd, 15, 0x101)], vec![&mem, &rings], ""),
            7 => (vec![m, Create::Cq { cap: 3, channel: None, fd: 1, ring_offset: 0 }], vec![&mem, &rings], "power of two"),
            8 => (vec![m, Create::Cq { cap: 64, channel: Some(7), fd: 1, ring_offset: PAGE }], vec![&mem, &rings], "no channel"),
            _ => ((0..=MAX_CREATE_BATCH as u64).map(|i| mr(pd, i % 16, 0x1000 + i as u32)).collect(), vec![&mem], "at most"),
        }
    };
    for k in 0..10 {
        let (items, fds, why) = case(k, pd);
        match batch(&mut e, items, &fds) {
            // Page 15 is the memory's last: that MR is fine; take it back.
            Ok(r) if why.is_empty() => {
                for x in r {
                    let Reply::Mr { lkey, .. } = x else { panic!() };
                    e.control(CLIENT, Request::DeregMr { lkey }, vec![]).unwrap();
                }
            }
            Ok(r) => panic!("accepted a batch that should fail with {why:?}: {r:?}"),
            Err(err) => assert!(err.contains(why), "wanted {why:?}, got {err}"),
        }
        assert!(pd_is_bare(&mut e, &mut pd), "a refused batch left something ({why})");
    }
    // Another client's PD and CQ are not this client's to use.
    let items = vec![mr(pd, 0, 0x100)];
    let err = e.control(2, Request::CreateBatch { items }, vec![dup(&mem)]).unwrap_err();
    assert!(format!("{err:#}").contains("no PD"), "{err:#}");
}

#[test]
fn fetch_traces_checks_every_key_first() {
    let (mut e, pd, mem, rings) = rig();
    let r = batch(&mut e, vec![mr(pd, 0, 0x100), mr(pd, 1, 0x101)], &[&mem, &rings]).unwrap();
    assert_eq!(r.len(), 2);
    for lkey in [0x100, 0x101] {
        e.control(CLIENT, Request::TraceMr { lkey, granularity: PAGE }, vec![]).unwrap();
    }
    let traces = |e: &mut Engine, lkeys: Vec<u32>, client| e.control(client, Request::FetchTraces { lkeys }, vec![]);
    for (lkeys, client, why) in
        [(vec![0x100, 0x999], CLIENT, "no MR"), (vec![0x100, 0x101], 2, "no MR"), (vec![0x100; MAX_TRACE_BATCH + 1], CLIENT, "at most")]
    {
        let err = traces(&mut e, lkeys, client).unwrap_err();
        assert!(format!("{err:#}").contains(why), "{err:#}");
    }
    let Reply::Traces(t) = traces(&mut e, vec![0x101, 0x100], CLIENT).unwrap() else { panic!() };
    assert_eq!(t.len(), 2);
    assert!(t.iter().all(|t| !t.all_dirty && t.runs.is_empty()), "{t:?}");
}

/// Through the real rnicd: objects of a namespace made with
/// `Context::create_batch` (rings in one shared memfd) carry a SEND and an
/// RDMA WRITE to a peer; a batch naming another namespace's PD is refused.
#[test]
fn batch_made_objects_carry_traffic_through_rnicd() {
    let bed = Bed::new("rnbatch", 2);
    let gid = bed.tb.spare_addr(0, 1);
    bed.tb.host(0).sh(&format!("ip addr add {gid}/24 dev eth0")).unwrap();
    let ctx = Context::open_namespace(Some(&bed.nics[0].sock), gid).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let buf = MemBuf::new(1 << 20).unwrap();
    let fd = buf.fd();
    let made = ctx
        .create_batch(&[
            NewObject::Mr { pd: &pd, fd, runs: &[(0, 1 << 19)], access: access::ALL, iova: 0x5000_0000, key: Some(0xabc00) },
            NewObject::Mr { pd: &pd, fd, runs: &[(1 << 19, 1 << 19)], access: access::ALL, iova: 0x6000_0000, key: Some(0xabd00) },
            NewObject::Cq { cqe: 64, channel: None },
            NewObject::Cq { cqe: 64, channel: None },
        ])
        .unwrap();
    let [Made::Mr(m0), Made::Mr(m1), Made::Cq(scq), Made::Cq(rcq)] = &made[..] else { panic!("objects of other kinds") };
    assert_eq!((m0.lkey, m1.rkey), (0xabc00, 0xabd00));
    let mut init = QpInitAttr::new(scq, rcq);
    (init.cap.max_send_wr, init.cap.max_recv_wr) = (32, 32);
    let Made::Qp(qp) = ctx.create_batch(&[NewObject::Qp { pd: &pd, init: &init, qpn: Some(0x4321), state: None }]).unwrap().remove(0)
    else {
        panic!()
    };
    assert_eq!(qp.qpn, 0x4321);

    let peer = End::new(bed.ctx(1), 1 << 20, 32);
    let o = ConnectOpts { mtu: Mtu::M1024, rnr_retry: 7, ..Default::default() };
    qp.connect(&peer.qp.endpoint(100), &ConnectOpts { sq_psn: 200, ..o }).unwrap();
    peer.qp.connect(&qp.endpoint(200), &ConnectOpts { sq_psn: 100, ..o }).unwrap();
    // The peer WRITEs into the second MR by its iova and key, then SENDs
    // into a receive posted on the first.
    let data = pattern(7, 8192);
    peer.buf.write(0, &data);
    qp.post_recv(&[RecvWr { wr_id: 1, sg_list: &[m0.sge(0, 4096)] }]).unwrap();
    peer.qp.post_send(&[SendWr::write(2, &[peer.mr.sge(0, 8192)], 0x6000_0000 + 4096, m1.rkey)]).unwrap();
    ok(&peer.scq);
    peer.qp.post_send(&[SendWr::send(3, &[peer.mr.sge(0, 100)])]).unwrap();
    ok(&peer.scq);
    assert_eq!(ok(rcq).byte_len, 100);
    assert_eq!(buf.read((1 << 19) + 4096, 8192), data);
    assert_eq!(buf.read(0, 100), data[..100]);

    // Another namespace's PD is unknown here, and the refusal keeps nothing.
    let other = Context::open(Some(&bed.nics[0].sock)).unwrap();
    let err = other
        .create_batch(&[
            NewObject::Cq { cqe: 8, channel: None },
            NewObject::Mr { pd: &pd, fd, runs: &[(0, 4096)], access: access::ALL, iova: 0, key: None },
        ])
        .err()
        .expect("a PD of another namespace is refused");
    assert!(format!("{err:#}").contains("no PD"), "{err:#}");
    let stats = other.stats().unwrap();
    assert!(stats["bad_client_requests"].as_u64().unwrap() >= 1, "{stats}");
}

/// Through the real rnicd: SuspendAndFetchTraces suspends the connected QP
/// and hands back its state and the pages a peer wrote, in one request; a
/// key of another namespace refuses the whole request, before anything is
/// suspended or any trace cleared.
#[test]
fn suspend_and_fetch_traces_in_one_request() {
    let bed = Bed::new("rnsusptr", 2);
    let ctx = bed.ctx(0);
    let me = End::new(ctx.clone(), 1 << 20, 32);
    let peer = End::new(bed.ctx(1), 1 << 20, 32);
    let o = ConnectOpts { mtu: Mtu::M1024, rnr_retry: 7, ..Default::default() };
    me.qp.connect(&peer.qp.endpoint(100), &ConnectOpts { sq_psn: 200, ..o }).unwrap();
    peer.qp.connect(&me.qp.endpoint(200), &ConnectOpts { sq_psn: 100, ..o }).unwrap();
    me.mr.start_trace(PAGE).unwrap();
    // The peer WRITEs pages 3 and 4 of the MR.
    peer.buf.write(0, &pattern(3, 8192));
    peer.qp.post_send(&[SendWr::write(1, &[peer.mr.sge(0, 8192)], me.mr.addr + 3 * PAGE, me.mr.rkey)]).unwrap();
    ok(&peer.scq);

    let other = End::new(bed.ctx(0), 4096, 4);
    let err = ctx.suspend_and_fetch_traces(&[&me.qp], &[&me.mr, &other.mr]).expect_err("a key of another namespace is refused");
    assert!(format!("{err:#}").contains("no MR"), "{err:#}");
    assert!(me.qp.query_state().is_err(), "a refused request suspended the QP");

    let (states, traces) = ctx.suspend_and_fetch_traces(&[&me.qp], &[&me.mr]).unwrap();
    assert_eq!(states.iter().map(|s| s.qpn).collect::<Vec<_>>(), [me.qp.qpn]);
    assert_eq!(states[0].qpn, me.qp.query_state().unwrap().qpn, "the QP is suspended");
    assert_eq!(traces.len(), 1);
    assert!(!traces[0].all_dirty, "{:?}", traces[0]);
    assert_eq!(traces[0].runs, [(3 * PAGE, 2 * PAGE)], "the refused request cleared nothing");
    assert!(me.mr.fetch_trace().unwrap().runs.is_empty(), "the request cleared the trace it returned");
    me.qp.resume().unwrap();
}
