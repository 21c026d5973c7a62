//! Unreliable connected QPs (docs/rnic.md, "UC"): real rnicd processes on
//! two testbed hosts; SEND and WRITE (with and without immediate) arrive
//! exact, nothing is acknowledged, and a lost packet (dropped by nftables
//! on the receiving host) loses its own message only: the next message
//! arrives, in the receive WQE the lost one had begun, and nothing is
//! resent.
mod common;
use common::*;
use std::time::Duration;
use verbs::*;

/// The sender's first PSN.
const SQ_PSN: u32 = 0x00_1000;

/// A UC QP in RTS with its own CQs and a registered buffer.
fn uc_end(ctx: Context) -> End {
    let pd = ctx.alloc_pd().unwrap();
    let scq = ctx.create_cq(64, None).unwrap();
    let rcq = ctx.create_cq(64, None).unwrap();
    let mut init = QpInitAttr::new(&scq, &rcq);
    init.qp_type = QpType::Uc;
    init.cap.max_send_wr = 32;
    init.cap.max_recv_wr = 32;
    init.cap.max_send_sge = 4;
    let qp = pd.create_qp(&init).unwrap();
    let buf = MemBuf::new(1 << 20).unwrap();
    let mr = pd.reg_mr(&buf, 0, buf.len(), access::LOCAL_WRITE | access::REMOTE_WRITE).unwrap();
    End { qp, mr, scq, rcq, pd, buf, ctx }
}

/// Two UC QPs on hosts a and b, connected; a sends from SQ_PSN.
fn uc_pair(bed: &Bed, a: usize, b: usize) -> (End, End) {
    let (ea, eb) = (uc_end(bed.ctx(a)), uc_end(bed.ctx(b)));
    let o = ConnectOpts { access: access::LOCAL_WRITE | access::REMOTE_WRITE, ..Default::default() };
    ea.qp.uc_connect(&eb.qp.endpoint(0x20_0000), &ConnectOpts { sq_psn: SQ_PSN, ..o }).unwrap();
    eb.qp.uc_connect(&ea.qp.endpoint(SQ_PSN), &ConnectOpts { sq_psn: 0x20_0000, ..o }).unwrap();
    (ea, eb)
}

fn stat(ctx: &Context, name: &str) -> u64 {
    ctx.stats().unwrap()[name].as_u64().unwrap_or_else(|| panic!("no stat {name}"))
}

/// Nothing arrives in `cq` for a while.
fn quiet(cq: &Cq) {
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(cq.poll(&mut [Wc::default(); 4]).unwrap(), 0, "a completion arrived");
}

/// Drops, on host `h`, every RoCE packet whose BTH PSN is in `psns`,
/// counting them: the BTH's PSN is bits 72..96 of the UDP payload.
fn drop_psns(h: &testbed::Host, psns: &[u32]) {
    let set: Vec<String> = psns.iter().map(|p| p.to_string()).collect();
    let rules = format!(
        "table inet rnuc {{\n counter lost {{ }}\n chain in {{ type filter hook input priority -300; policy accept;\n  udp dport 4791 @th,136,24 {{ {} }} counter name \"lost\" drop\n }}\n}}",
        set.join(", ")
    );
    h.sh(&format!("nft -f - <<'EOF'\nadd table inet rnuc\ndelete table inet rnuc\n{rules}\nEOF")).unwrap();
}

fn dropped(h: &testbed::Host) -> u64 {
    let out = h.sh("nft list counter inet rnuc lost").unwrap();
    let w: Vec<&str> = out.split_whitespace().collect();
    w.iter().position(|x| *x == "packets").and_then(|i| w[i + 1].parse().ok()).unwrap_or_else(|| panic!("counter: {out}"))
}

#[test]
fn sends_and_writes_arrive_exact_and_unacknowledged() {
    let bed = Bed::new("rnuc", 2);
    let (a, b) = uc_pair(&bed, 0, 1);
    let mtu = bed.ctx(0).query_port(1).unwrap().active_mtu.bytes();
    let data = pattern(7, 64 << 10);
    a.buf.write(0, &data);
    let b_tx = stat(&b.ctx, "tx_packets");

    // A SEND of many packets from two SGEs, and one with immediate.
    b.qp.post_recv(&[RecvWr { wr_id: 1, sg_list: &[b.mr.sge(0, 32 << 10)] }]).unwrap();
    b.qp.post_recv(&[RecvWr { wr_id: 2, sg_list: &[b.mr.sge(32 << 10, 4096)] }]).unwrap();
    let len = 10 * mtu + 17;
    let sg = [a.mr.sge(0, 1000), a.mr.sge(4096, len - 1000)];
    a.qp.post_send(&[SendWr::send(10, &sg)]).unwrap();
    a.qp.post_send(&[SendWr::send(11, &[a.mr.sge(100, 300)]).with_imm(0xabcd)]).unwrap();
    assert_eq!(ok(&a.scq).wr_id, 10);
    assert_eq!(ok(&a.scq).wr_id, 11);
    let w = ok(&b.rcq);
    assert_eq!((w.wr_id, w.opcode, w.byte_len, w.qp_num, w.src_qp), (1, WcOpcode::Recv, len as u32, b.qp.qpn, a.qp.qpn));
    let mut want = data[..1000].to_vec();
    want.extend_from_slice(&data[4096..4096 + len - 1000]);
    assert!(b.buf.read(0, len) == want, "data differs");
    let w = ok(&b.rcq);
    assert_eq!((w.wr_id, w.byte_len, w.imm_data), (2, 300, 0xabcd));
    assert_eq!(w.wc_flags & wc_flags::WITH_IMM, wc_flags::WITH_IMM);
    assert!(b.buf.read(32 << 10, 300) == data[100..400], "data differs");

    // A WRITE of many packets takes no receive; one with immediate does.
    let (dst, wlen) = (b.mr.addr + (64 << 10), 20 * mtu + 3);
    a.qp.post_send(&[SendWr::write(12, &[a.mr.sge(0, wlen)], dst, b.mr.rkey)]).unwrap();
    assert_eq!(ok(&a.scq).wr_id, 12);
    b.qp.post_recv(&[RecvWr { wr_id: 3, sg_list: &[] }]).unwrap();
    a.qp.post_send(&[SendWr::write(13, &[a.mr.sge(8192, 64)], dst + (256 << 10), b.mr.rkey).with_imm(77)]).unwrap();
    assert_eq!(ok(&a.scq).wr_id, 13);
    let w = ok(&b.rcq);
    assert_eq!((w.wr_id, w.opcode, w.byte_len, w.imm_data), (3, WcOpcode::RecvRdmaWithImm, 64, 77));
    assert!(b.buf.read(64 << 10, wlen) == data[..wlen], "data differs");
    assert!(b.buf.read((64 << 10) + (256 << 10), 64) == data[8192..8192 + 64], "data differs");

    // The receiver sent nothing: no ACKs on UC.
    assert_eq!(stat(&b.ctx, "tx_packets"), b_tx, "the UC responder sent packets");
    assert_eq!(stat(&a.ctx, "retransmit_rewinds"), 0);

    // READ and atomics are not UC operations: the WR fails and the QP goes to ERR.
    a.qp.post_send(&[SendWr::read(14, &[a.mr.sge(0, 8)], dst, b.mr.rkey)]).unwrap();
    let w = one(&a.scq);
    assert_eq!((w.wr_id, w.status), (14, WcStatus::LocQpOpErr), "{w:?}");
    assert_eq!(a.qp.state().unwrap(), QpState::Err);
}

#[test]
fn a_lost_packet_loses_its_message_only_and_nothing_is_resent() {
    // One packet per datagram (no GSO), so that nftables sees each PSN.
    let bed = Bed::with_args("rnucl", 2, &["--no-gso"]);
    let (a, b) = uc_pair(&bed, 0, 1);
    let mtu = bed.ctx(0).query_port(1).unwrap().active_mtu.bytes();
    let h = bed.tb.host(1);
    // Five 4-packet messages: SEND, SEND, SEND, WRITE, WRITE with
    // immediate. Lose the second packet of the second SEND and the first
    // packet of the first WRITE.
    let psn = |msg: u32, pkt: u32| SQ_PSN + 4 * msg + pkt;
    drop_psns(h, &[psn(1, 1), psn(3, 0)]);
    let data = pattern(9, 20 * mtu);
    a.buf.write(0, &data);
    for i in 0..3 {
        b.qp.post_recv(&[RecvWr { wr_id: i, sg_list: &[b.mr.sge(i as usize * 8 * mtu, 8 * mtu)] }]).unwrap();
    }
    let dst = b.mr.addr + (512 << 10);
    let m = |k: usize| [a.mr.sge(k * 4 * mtu, 4 * mtu)];
    let (m0, m1, m2, m3, m4) = (m(0), m(1), m(2), m(3), m(4));
    a.qp.post_send(&[
        SendWr::send(10, &m0),
        SendWr::send(11, &m1),
        SendWr::send(12, &m2),
        SendWr::write(13, &m3, dst, b.mr.rkey),
        SendWr::write(14, &m4, dst + (64 << 10), b.mr.rkey).with_imm(5),
    ])
    .unwrap();
    // Every WR completes at the sender: nothing tells it of the losses.
    for id in 10..15 {
        assert_eq!(ok(&a.scq).wr_id, id);
    }

    // The first SEND arrives in receive 0; the second is lost whole, and
    // receive 1, which it had begun to fill, takes the third from its start.
    let w = ok(&b.rcq);
    assert_eq!((w.wr_id, w.byte_len), (0, 4 * mtu as u32));
    assert!(b.buf.read(0, 4 * mtu) == data[..4 * mtu], "data differs");
    let w = ok(&b.rcq);
    assert_eq!((w.wr_id, w.byte_len), (1, 4 * mtu as u32));
    assert!(b.buf.read(8 * mtu, 4 * mtu) == data[8 * mtu..12 * mtu], "data differs");
    // The WRITE that lost its first packet wrote nothing; the next one is
    // whole and its immediate takes receive 2.
    let w = ok(&b.rcq);
    assert_eq!((w.wr_id, w.opcode, w.byte_len, w.imm_data), (2, WcOpcode::RecvRdmaWithImm, 4 * mtu as u32, 5));
    assert!(b.buf.read(512 << 10, 4 * mtu).iter().all(|&x| x == 0), "a WRITE that lost its first packet wrote");
    assert!(b.buf.read((512 << 10) + (64 << 10), 4 * mtu) == data[16 * mtu..20 * mtu], "data differs");
    quiet(&b.rcq);

    // Nothing was resent: each dropped PSN was seen once, and the sender's
    // rnicd neither rewound nor heard from the receiver.
    assert_eq!(dropped(h), 2, "a lost packet was sent again");
    assert_eq!(stat(&a.ctx, "retransmit_rewinds"), 0);
    assert_eq!(stat(&b.ctx, "uc_dropped_msgs"), 2);
    // The lost SEND's two packets after the gap and the WRITE's other three.
    assert_eq!(stat(&b.ctx, "uc_dropped_pkts"), 5);
    assert_eq!(a.qp.state().unwrap(), QpState::Rts);
    assert_eq!(b.qp.state().unwrap(), QpState::Rts);
    h.sh("nft delete table inet rnuc").unwrap();

    // A message with no receive posted is dropped too, and the QP carries
    // on. The receive is posted once the drop is counted: the sender's
    // completion only says its rnicd sent the message.
    a.qp.post_send(&[SendWr::send(20, &[a.mr.sge(0, 64)])]).unwrap();
    ok(&a.scq);
    reaches(|| stat(&b.ctx, "uc_dropped_msgs"), 3, "messages dropped");
    quiet(&b.rcq);
    b.qp.post_recv(&[RecvWr { wr_id: 9, sg_list: &[b.mr.sge(0, 64)] }]).unwrap();
    a.qp.post_send(&[SendWr::send(21, &[a.mr.sge(64, 64)])]).unwrap();
    ok(&a.scq);
    let w = ok(&b.rcq);
    assert_eq!((w.wr_id, w.byte_len), (9, 64));
    assert!(b.buf.read(0, 64) == data[64..128], "data differs");
}
