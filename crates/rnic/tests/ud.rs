//! Unreliable datagram QPs (docs/rnic.md, "UD"): real rnicd processes on two
//! testbed hosts, datagrams between them and within one rnicd, GRH and
//! completion contents, and every way a datagram is refused or dropped.
mod common;
use common::*;
use std::net::Ipv4Addr;
use std::time::Duration;
use verbs::*;

const QKEY: u32 = 0x1111_2222;

/// A UD QP in RTS with its own CQs and a registered buffer.
struct UdEnd {
    qp: Qp,
    mr: Mr,
    scq: Cq,
    rcq: Cq,
    buf: MemBuf,
    _pd: Pd,
    ctx: Context,
}

impl UdEnd {
    fn new(ctx: Context, qkey: u32) -> UdEnd {
        let pd = ctx.alloc_pd().unwrap();
        let scq = ctx.create_cq(64, None).unwrap();
        let rcq = ctx.create_cq(64, None).unwrap();
        let mut init = QpInitAttr::new(&scq, &rcq);
        init.qp_type = QpType::Ud;
        init.cap.max_send_wr = 16;
        init.cap.max_recv_wr = 16;
        let qp = pd.create_qp(&init).unwrap();
        qp.ud_activate(qkey, 0x42).unwrap();
        let buf = MemBuf::new(1 << 20).unwrap();
        let mr = pd.reg_mr(&buf, 0, buf.len(), access::LOCAL_WRITE).unwrap();
        UdEnd { qp, mr, scq, rcq, buf, _pd: pd, ctx }
    }

    fn dest(&self, qkey: u32) -> UdDest {
        UdDest { gid: self.ctx.gid(), qpn: self.qp.qpn, qkey }
    }

    fn recv(&self, wr_id: u64, off: usize, len: usize) {
        self.qp.post_recv(&[RecvWr { wr_id, sg_list: &[self.mr.sge(off, len)] }]).unwrap();
    }

    fn stat(&self, name: &str) -> u64 {
        self.ctx.stats().unwrap()[name].as_u64().unwrap()
    }
}

/// Nothing arrives in `cq` for a while.
fn quiet(cq: &Cq) {
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(cq.poll(&mut [Wc::default(); 4]).unwrap(), 0, "a completion arrived");
}

#[test]
fn datagrams_between_hosts_and_within_one_rnicd() {
    let bed = Bed::new("rnud", 2);
    let a = UdEnd::new(bed.ctx(0), QKEY);
    let b = UdEnd::new(bed.ctx(1), QKEY);
    let c = UdEnd::new(bed.ctx(0), QKEY);
    let data = pattern(5, 4096);
    a.buf.write(0, &data);

    // SEND with two SGEs: GRH, then the payload; the completion names the sender.
    b.recv(1, 0, 8192);
    let sg = [a.mr.sge(0, 600), a.mr.sge(1000, 400)];
    a.qp.post_send(&[SendWr::send_to(10, &sg, b.dest(QKEY))]).unwrap();
    assert_eq!(ok(&a.scq).wr_id, 10);
    let w = ok(&b.rcq);
    assert_eq!((w.wr_id, w.opcode, w.byte_len, w.src_qp, w.qp_num), (1, WcOpcode::Recv, GRH_LEN as u32 + 1000, a.qp.qpn, b.qp.qpn));
    assert_eq!(w.wc_flags & (wc_flags::GRH | wc_flags::WITH_IMM), wc_flags::GRH);
    let mut want = data[..600].to_vec();
    want.extend_from_slice(&data[1000..1400]);
    assert_eq!(b.buf.read(GRH_LEN, 1000), want);

    // The GRH: 20 zero bytes, then the IPv4 header of the datagram (BTH 12,
    // DETH 8, payload 1000, ICRC 4 in UDP in IPv4) with a valid checksum.
    let grh = b.buf.read(0, GRH_LEN);
    assert_eq!(grh[..20], [0; 20]);
    let ip = &grh[20..];
    assert_eq!((ip[0], ip[9]), (0x45, 17), "IPv4, UDP");
    assert_eq!(u16::from_be_bytes([ip[2], ip[3]]) as usize, 20 + 8 + 12 + 8 + 1000 + 4);
    assert_eq!(Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]), bed.nics[0].addr);
    assert_eq!(Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]), bed.nics[1].addr);
    let sum: u32 = ip.chunks_exact(2).map(|x| u32::from(u16::from_be_bytes([x[0], x[1]]))).sum();
    assert_eq!((sum & 0xffff) + (sum >> 16), 0xffff, "IPv4 header checksum");

    // SEND with immediate, inline; the Q_Key taken from the QP (high bit).
    b.recv(2, 0, 256);
    a.qp.post_send(&[SendWr::send_to(11, &[], b.dest(0x8000_0000)).with_inline(b"hello").with_imm(0xfeed)]).unwrap();
    ok(&a.scq);
    let w = ok(&b.rcq);
    assert_eq!((w.wr_id, w.byte_len, w.imm_data), (2, GRH_LEN as u32 + 5, 0xfeed));
    assert_eq!(w.wc_flags & (wc_flags::GRH | wc_flags::WITH_IMM), wc_flags::GRH | wc_flags::WITH_IMM);
    assert_eq!(b.buf.read(GRH_LEN, 5), b"hello");

    // A whole port MTU in one datagram, and to a QP of the same rnicd. The
    // testbed's 1500-byte link makes the port's active MTU 1024.
    let mtu = bed.ctx(0).query_port(1).unwrap().active_mtu.bytes();
    assert_eq!(mtu, 1024, "active MTU of a 1500-byte link");
    c.recv(3, 0, 8192);
    a.qp.post_send(&[SendWr::send_to(12, &[a.mr.sge(0, mtu)], c.dest(QKEY))]).unwrap();
    ok(&a.scq);
    let w = ok(&c.rcq);
    assert_eq!((w.wr_id, w.byte_len, w.src_qp), (3, (GRH_LEN + mtu) as u32, a.qp.qpn));
    assert_eq!(c.buf.read(GRH_LEN, mtu), data[..mtu]);
    assert_eq!(c.buf.read(20 + 12, 4), bed.nics[0].addr.octets());

    // Many datagrams in a row, unsignaled but the last: all arrive, in order.
    for i in 0..16 {
        b.recv(100 + i, 4096 * (i as usize + 1), 4096);
    }
    let sges: Vec<_> = (0..16).map(|i| [a.mr.sge(i * 8, 64)]).collect();
    let wrs: Vec<_> = sges.iter().enumerate().map(|(i, s)| SendWr::send_to(200 + i as u64, s, b.dest(QKEY)).unsignaled()).collect();
    let mut wrs = wrs;
    wrs[15] = SendWr::send_to(215, &sges[15], b.dest(QKEY));
    a.qp.post_send(&wrs).unwrap();
    assert_eq!(ok(&a.scq).wr_id, 215);
    let ws = b.rcq.wait(16, T).unwrap();
    assert_eq!(ws.iter().map(|w| w.wr_id).collect::<Vec<_>>(), (100..116).collect::<Vec<_>>());
    for (i, w) in ws.iter().enumerate() {
        assert_eq!(w.status, WcStatus::Success);
        assert_eq!(b.buf.read(4096 * (i + 1) + GRH_LEN, 64), data[i * 8..i * 8 + 64]);
    }
    assert_eq!(a.stat("ud_sent"), 19);
    assert_eq!(b.stat("ud_delivered"), 18);
    // Sends posted while rnicd polled the rings (no doorbell) never waited
    // for a timer to be found.
    assert_eq!(a.stat("late_ring_wqes"), 0);
}

#[test]
fn refused_and_dropped_datagrams() {
    let bed = Bed::new("rnudx", 2);
    let a = UdEnd::new(bed.ctx(0), QKEY);
    let b = UdEnd::new(bed.ctx(1), QKEY);
    a.buf.write(0, &pattern(9, 8192));

    // Wrong Q_Key: dropped at the receiver and counted; the sender cannot
    // tell (UD has no ACKs), and the receive stays posted for the next one.
    b.recv(1, 0, 8192);
    a.qp.post_send(&[SendWr::send_to(1, &[a.mr.sge(0, 100)], b.dest(QKEY ^ 1))]).unwrap();
    ok(&a.scq);
    reaches(|| b.stat("ud_qkey_drops"), 1, "datagrams dropped for their Q_Key");
    quiet(&b.rcq);
    a.qp.post_send(&[SendWr::send_to(2, &[a.mr.sge(0, 100)], b.dest(QKEY))]).unwrap();
    ok(&a.scq);
    assert_eq!(ok(&b.rcq).wr_id, 1);

    // No receive posted: dropped and counted.
    a.qp.post_send(&[SendWr::send_to(3, &[a.mr.sge(0, 100)], b.dest(QKEY))]).unwrap();
    ok(&a.scq);
    reaches(|| b.stat("ud_no_recv_drops"), 1, "datagrams dropped for want of a receive");
    quiet(&b.rcq);

    // A receive buffer too small for GRH + payload: that receive fails with
    // LOC_LEN_ERR, the QP carries on.
    b.recv(2, 0, 100);
    b.recv(3, 0, 8192);
    a.qp.post_send(&[SendWr::send_to(4, &[a.mr.sge(0, 100)], b.dest(QKEY))]).unwrap();
    ok(&a.scq);
    let w = one(&b.rcq);
    assert_eq!((w.wr_id, w.status), (2, WcStatus::LocLenErr));
    a.qp.post_send(&[SendWr::send_to(5, &[a.mr.sge(0, 100)], b.dest(QKEY))]).unwrap();
    ok(&a.scq);
    assert_eq!(ok(&b.rcq).wr_id, 3);

    // Larger than the port's active MTU (1024 on the testbed's 1500-byte
    // link), though it would fit rnicd's largest path MTU: LOC_LEN_ERR,
    // nothing sent (no IP fragments), the QP carries on.
    let mtu = bed.ctx(0).query_port(1).unwrap().active_mtu.bytes();
    b.recv(4, 0, 8192);
    a.qp.post_send(&[SendWr::send_to(6, &[a.mr.sge(0, mtu + 1)], b.dest(QKEY))]).unwrap();
    let w = one(&a.scq);
    assert_eq!((w.wr_id, w.status), (6, WcStatus::LocLenErr));
    assert_eq!(a.stat("ud_oversize_sends"), 1);
    quiet(&b.rcq);
    assert_eq!(a.qp.state().unwrap(), QpState::Rts);

    // Only SENDs: an RDMA WRITE on a UD QP is a malformed WR (LOC_QP_OP_ERR).
    // Then a bad address handle (no usable GID) on a fresh QP: the same.
    a.qp.post_send(&[SendWr::write(7, &[a.mr.sge(0, 8)], 0, 0)]).unwrap();
    let w = one(&a.scq);
    assert_eq!((w.wr_id, w.status), (7, WcStatus::LocQpOpErr));
    assert_eq!(a.qp.state().unwrap(), QpState::Err);
    let a2 = UdEnd::new(bed.ctx(0), QKEY);
    let bad = UdDest { gid: Ipv4Addr::UNSPECIFIED, ..b.dest(QKEY) };
    a2.qp.post_send(&[SendWr::send_to(8, &[a2.mr.sge(0, 8)], bad), SendWr::send_to(9, &[a2.mr.sge(0, 8)], b.dest(QKEY))]).unwrap();
    let ws = a2.scq.wait(2, T).unwrap();
    assert_eq!((ws[0].wr_id, ws[0].status), (8, WcStatus::LocQpOpErr));
    assert_eq!((ws[1].wr_id, ws[1].status), (9, WcStatus::WrFlushErr));
    assert_eq!(a2.qp.state().unwrap(), QpState::Err);

    // An RC QP does not take UD packets, nor a UD QP RC ones.
    let rc = End::new(bed.ctx(1), 1 << 20, 16);
    rc.qp
        .connect(&QpEndpoint { gid: bed.nics[0].addr, qpn: a2.qp.qpn, psn: 0 }, &ConnectOpts { mtu: Mtu::M1024, ..Default::default() })
        .unwrap();
    rc.qp.post_recv(&[RecvWr { wr_id: 1, sg_list: &[rc.mr.sge(0, 4096)] }]).unwrap();
    let a3 = UdEnd::new(bed.ctx(0), QKEY);
    a3.qp.post_send(&[SendWr::send_to(10, &[a3.mr.sge(0, 8)], UdDest { gid: bed.nics[1].addr, qpn: rc.qp.qpn, qkey: QKEY })]).unwrap();
    ok(&a3.scq);
    reaches(|| b.stat("ud_other_drops"), 1, "datagrams dropped for another reason");
    quiet(&rc.rcq);
}

#[test]
fn ud_modify_takes_ud_attributes() {
    let bed = Bed::new("rnudm", 1);
    let ctx = bed.ctx(0);
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(8, None).unwrap();
    let mut init = QpInitAttr::new(&cq, &cq);
    init.qp_type = QpType::Ud;
    let qp = pd.create_qp(&init).unwrap();
    let a = QpAttr { qp_state: QpState::Init, port_num: 1, qkey: 7, ..Default::default() };
    let e = qp.modify(&a, mask::STATE | mask::PKEY_INDEX | mask::PORT).unwrap_err();
    assert!(format!("{e:#}").contains("QKEY"), "{e:#}");
    let e = qp.modify(&a, mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::QKEY | mask::ACCESS_FLAGS).unwrap_err();
    assert!(format!("{e:#}").contains("ACCESS_FLAGS"), "{e:#}");
    qp.modify(&a, mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::QKEY).unwrap();
    let rtr = QpAttr { qp_state: QpState::Rtr, dest_qp_num: 5, ..a };
    qp.modify(&rtr, mask::STATE | mask::DEST_QPN).unwrap_err();
    qp.modify(&rtr, mask::STATE).unwrap();
    let rts = QpAttr { qp_state: QpState::Rts, sq_psn: 9, qkey: 0x77, ..a };
    qp.modify(&rts, mask::STATE).unwrap_err();
    qp.modify(&rts, mask::STATE | mask::SQ_PSN | mask::QKEY).unwrap();
    let (got, _) = qp.query().unwrap();
    assert_eq!((got.qp_state, got.qkey, got.sq_psn), (QpState::Rts, 0x77, 9));
    assert!(qp.suspend().is_err(), "UD QPs are not suspended");
}
