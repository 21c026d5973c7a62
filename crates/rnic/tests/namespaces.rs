//! RDMA namespaces: one rnicd serving two GIDs, each namespace choosing the
//! same QPN and key for different objects; traffic to each GID reaches only
//! its own objects, and a taken ID is refused.
mod common;
use common::*;
use verbs::*;

const QPN: u32 = 0x1234;
const KEY: u32 = 0xabcd00;

/// An end inside namespace `gid` of host `h`'s rnicd, with chosen QPN and key.
fn end_in(bed: &Bed, h: usize, gid: std::net::Ipv4Addr) -> End {
    let ctx = Context::open_namespace(Some(&bed.nics[h].sock), gid).unwrap();
    assert_eq!(ctx.gid(), gid);
    let pd = ctx.alloc_pd().unwrap();
    let scq = ctx.create_cq(64, None).unwrap();
    let rcq = ctx.create_cq(64, None).unwrap();
    let mut init = QpInitAttr::new(&scq, &rcq);
    init.cap.max_send_wr = 32;
    init.cap.max_recv_wr = 32;
    let qp = pd.create_qp_with_qpn(&init, QPN).unwrap();
    assert_eq!(qp.qpn, QPN);
    let buf = MemBuf::new(1 << 20).unwrap();
    let mr = pd.reg_mr_with_key(&buf, 0, buf.len(), access::ALL, KEY).unwrap();
    assert_eq!((mr.lkey, mr.rkey), (KEY, KEY));
    End { qp, mr, scq, rcq, pd, buf, ctx }
}

#[test]
fn namespaces_isolate_same_ids_and_refuse_duplicates() {
    let bed = Bed::new("rnns", 2);
    let h0 = bed.tb.host(0);
    let (g1, g2) = (bed.tb.spare_addr(0, 1), bed.tb.spare_addr(0, 2));
    h0.sh(&format!("ip addr add {g1}/24 dev eth0 && ip addr add {g2}/24 dev eth0")).unwrap();

    let n1 = end_in(&bed, 0, g1);
    let n2 = end_in(&bed, 0, g2);

    // Duplicates are refused inside a namespace, with a clear error.
    let e = n1.pd.create_qp_with_qpn(&QpInitAttr::new(&n1.scq, &n1.rcq), QPN).err().expect("duplicate QPN refused");
    assert!(format!("{e:#}").contains("already in use"), "{e:#}");
    let e = n1.pd.reg_mr_with_key(&n1.buf, 0, 4096, access::ALL, KEY).err().expect("duplicate key refused");
    assert!(format!("{e:#}").contains("already in use"), "{e:#}");
    let e = n1.pd.create_qp_with_qpn(&QpInitAttr::new(&n1.scq, &n1.rcq), 1).err().expect("reserved QPN refused");
    assert!(format!("{e:#}").contains("outside"), "{e:#}");
    // The daemon's own namespace does not see them either.
    let def = bed.ctx(0);
    assert_eq!(def.gid(), bed.nics[0].addr);
    let pd = def.alloc_pd().unwrap();
    let (c1, c2) = (def.create_cq(8, None).unwrap(), def.create_cq(8, None).unwrap());
    let own = pd.create_qp_with_qpn(&QpInitAttr::new(&c1, &c2), QPN).expect("same QPN in the default namespace");

    // Peers on host 1 connect to each namespace's QP by GID.
    let o = ConnectOpts { mtu: Mtu::M1024, rnr_retry: 7, ..Default::default() };
    let p1 = End::new(bed.ctx(1), 1 << 20, 32);
    let p2 = End::new(bed.ctx(1), 1 << 20, 32);
    for (n, p) in [(&n1, &p1), (&n2, &p2)] {
        n.qp.connect(&p.qp.endpoint(100), &ConnectOpts { sq_psn: 200, ..o }).unwrap();
        p.qp.connect(&n.qp.endpoint(200), &ConnectOpts { sq_psn: 100, ..o }).unwrap();
    }

    // WRITE with the same rkey and address to each GID, and a SEND to each.
    for (i, (n, p)) in [(&n1, &p1), (&n2, &p2)].into_iter().enumerate() {
        let data = pattern(i as u64 + 1, 100_000);
        p.buf.write(0, &data);
        n.qp.post_recv(&[RecvWr { wr_id: 7, sg_list: &[n.mr.sge(500_000, 4096)] }]).unwrap();
        p.qp.post_send(&[SendWr::write(1, &[p.mr.sge(0, 100_000)], n.mr.addr, KEY), SendWr::send(2, &[p.mr.sge(0, 3000)])]).unwrap();
        let ws = p.scq.wait(2, T).unwrap();
        assert!(ws.iter().all(|w| w.status == WcStatus::Success), "{ws:?}");
        let w = ok(&n.rcq);
        assert_eq!((w.wr_id, w.byte_len, w.src_qp), (7, 3000, p.qp.qpn));
    }
    for (i, n) in [&n1, &n2].into_iter().enumerate() {
        let data = pattern(i as u64 + 1, 100_000);
        assert_eq!(n.buf.read(0, 100_000), data, "namespace {i} holds only its own WRITE");
        assert_eq!(n.buf.read(500_000, 3000), data[..3000], "namespace {i} got only its own SEND");
        assert!(n.rcq.poll(&mut [Wc::default(); 4]).unwrap() == 0, "no extra receive in namespace {i}");
    }
    // The default namespace's QP with the same number saw nothing.
    assert_eq!(c2.poll(&mut [Wc::default(); 4]).unwrap(), 0);
    drop(own);

    // A namespace goes with its last client; its IDs are then free again.
    drop(n1);
    let again = end_in(&bed, 0, g1);
    assert_eq!(again.qp.qpn, QPN);
}

/// `Context::close` ends the connection in one step: rnicd releases every
/// object and the namespace with it, the handles still held drop without a
/// request each, and the closed context refuses further requests.
#[test]
fn closing_a_context_releases_its_namespace() {
    let bed = Bed::new("rnnsc", 1);
    let g = bed.tb.spare_addr(0, 1);
    bed.tb.host(0).sh(&format!("ip addr add {g}/24 dev eth0")).unwrap();
    let old = end_in(&bed, 0, g);
    old.ctx.close();
    let e = old.ctx.alloc_pd().err().expect("a closed context refuses requests");
    assert!(format!("{e:#}").contains("closed"), "{e:#}");

    // rnicd handles the hang-up in its own time: the IDs come free soon.
    let t0 = std::time::Instant::now();
    loop {
        let ctx = Context::open_namespace(Some(&bed.nics[0].sock), g).unwrap();
        let (pd, cq) = (ctx.alloc_pd().unwrap(), ctx.create_cq(8, None).unwrap());
        if pd.create_qp_with_qpn(&QpInitAttr::new(&cq, &cq), QPN).is_ok() {
            break;
        }
        assert!(t0.elapsed() < T, "the closed connection's QPN stayed taken");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let again = end_in(&bed, 0, g);
    // The old handles go now; nothing of theirs reaches rnicd, so the new
    // objects with the same QPN and key stay.
    drop(old);
    assert_eq!(again.qp.state().unwrap(), QpState::Reset);
    let e = again.pd.reg_mr_with_key(&again.buf, 0, 4096, access::ALL, KEY).err().expect("the key is still taken");
    assert!(format!("{e:#}").contains("already in use"), "{e:#}");
}
