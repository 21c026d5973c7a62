//! A QP that resumes (in place or on another host, after a move) tells its
//! peer the PSN it expects with a sequence NAK, and the peer's requester
//! resends from there at once, even though it rewound for an RNR NAK of the
//! suspended QP before and that resend was lost (sent to a host that no
//! longer answered). Only a rewind for a response that showed the same gap
//! makes such a NAK a duplicate.
//!
//! The same holds when the lost resend was one for a gap the QP had NAKed
//! before it was suspended: a NAK for the same PSN a round trip after that
//! rewind means the resend was lost too.
//!
//! The peer runs without a retransmission timer or loss probe (timeout 0),
//! so the NAK is the only thing that can make it resend: a requester that
//! ignored it would wait for ever, and one with timers would wait for them
//! (the longest part of the peer's stall across a move).
mod common;
use common::*;
use std::time::{Duration, Instant};
use verbs::*;

fn nft(h: &testbed::Host, chains: &str) {
    h.sh(&format!("nft -f - <<'EOF'\nadd table inet rnnak\ndelete table inet rnnak\ntable inet rnnak {{\n{chains}\n}}\nEOF")).unwrap();
}

fn counter(h: &testbed::Host, name: &str) -> u64 {
    let out = h.sh(&format!("nft list counter inet rnnak {name}")).unwrap();
    let w: Vec<&str> = out.split_whitespace().collect();
    w.iter().position(|x| *x == "packets").and_then(|i| w[i + 1].parse().ok()).unwrap_or_else(|| panic!("counter {name}: {out}"))
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < Duration::from_secs(30), "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_resumed_qps_sequence_nak_makes_the_peer_resend_after_a_lost_rnr_resend() {
    let bed = Bed::new("rnnak", 2);
    let o = ConnectOpts { rnr_retry: 7, timeout: 0, ..Default::default() };
    let (m, p) = pair(&bed, 0, 1, o);
    m.qp.post_recv(&[RecvWr { wr_id: 7, sg_list: &[m.mr.sge(0, 64)] }]).unwrap();
    m.qp.suspend().unwrap();

    // The peer's SEND meets the suspended QP: RNR NAKs, and a resend after each wait.
    let rnr_before = p.ctx.stats().unwrap()["rnr_naks_received"].as_u64().unwrap();
    p.buf.write(4096, &pattern(3, 64));
    p.qp.post_send(&[SendWr::send(1, &[p.mr.sge(4096, 64)])]).unwrap();
    wait_until("the peer heard an RNR NAK", || p.ctx.stats().unwrap()["rnr_naks_received"].as_u64().unwrap() > rnr_before);

    // Its host stops answering: the next resend is lost, and no timer of the
    // peer resends again.
    let h = bed.tb.host(0);
    nft(
        h,
        "counter lost { }\nchain in { type filter hook input priority -300; policy accept;\n udp dport 4791 counter name \"lost\" drop\n}",
    );
    wait_until("a resend of the peer was lost", || counter(h, "lost") > 0);
    std::thread::sleep(Duration::from_millis(50));
    h.sh("nft delete table inet rnnak").unwrap();
    assert!(p.scq.poll(&mut [Wc::default(); 1]).unwrap() == 0, "nothing completes while the QP is suspended");

    // The resume's sequence NAK is the only kick.
    m.qp.resume().unwrap();
    let w = p.scq.wait(1, Duration::from_secs(20)).expect("the peer resent after the resumed QP's sequence NAK")[0];
    assert_eq!((w.wr_id, w.status), (1, WcStatus::Success), "{w:?}");
    let r = ok(&m.rcq);
    assert_eq!((r.wr_id, r.byte_len), (7, 64), "{r:?}");
    assert_eq!(m.buf.read(0, 64), pattern(3, 64), "delivered once, whole");
    assert_eq!(p.qp.state().unwrap(), QpState::Rts);
}

/// The peer's first SEND is dropped on the way in (nftables, by its PSN),
/// so the QP NAKs the gap when the second arrives; the peer rewinds and
/// resends, and the resend of the first is dropped too. The QP is
/// suspended and resumed (the drop lifted meanwhile): its resume NAK names
/// the PSN the gap NAK did, and the peer, which rewound for that PSN long
/// before, resends at once. (The SENDs go apart: GRO would merge packets
/// that leave together, and the rule would drop both.)
#[test]
fn a_resume_nak_for_a_gap_already_naked_makes_the_peer_resend_its_lost_resend() {
    let bed = Bed::new("rnnakgap", 2);
    let o = ConnectOpts { rnr_retry: 7, timeout: 0, ..Default::default() };
    let (m, p) = pair(&bed, 0, 1, o);
    m.qp.post_recv(&[RecvWr { wr_id: 7, sg_list: &[m.mr.sge(0, 64)] }, RecvWr { wr_id: 8, sg_list: &[m.mr.sge(64, 64)] }]).unwrap();
    // The peer's first PSN (`pair`: 0x100000), bytes 9-11 of the BTH after
    // the 8-byte UDP header.
    let h = bed.tb.host(0);
    nft(
        h,
        "counter lost { }\nchain in { type filter hook input priority -300; policy accept;\n udp dport 4791 @th,136,24 0x100000 counter name \"lost\" drop\n}",
    );
    let rewinds = || p.ctx.stats().unwrap()["retransmit_rewinds"].as_u64().unwrap();
    let before = rewinds();
    p.buf.write(16384, &pattern(5, 128));
    p.qp.post_send(&[SendWr::send(1, &[p.mr.sge(16384, 64)])]).unwrap();
    wait_until("the first SEND was lost", || counter(h, "lost") >= 1);
    p.qp.post_send(&[SendWr::send(2, &[p.mr.sge(16384 + 64, 64)])]).unwrap();
    wait_until("the first SEND's resend was lost too", || counter(h, "lost") >= 2);
    assert!(rewinds() > before, "the peer rewound for the gap NAK");

    m.qp.suspend().unwrap();
    h.sh("nft delete table inet rnnak").unwrap();
    // Well past the peer's round trip since it rewound.
    std::thread::sleep(Duration::from_millis(200));
    assert!(p.scq.poll(&mut [Wc::default(); 1]).unwrap() == 0, "nothing completed before the resume");

    m.qp.resume().unwrap();
    for id in [1, 2] {
        let w = p.scq.wait(1, Duration::from_secs(20)).expect("the peer resent after the resumed QP's sequence NAK")[0];
        assert_eq!((w.wr_id, w.status), (id, WcStatus::Success), "{w:?}");
    }
    for id in [7, 8] {
        let r = ok(&m.rcq);
        assert_eq!((r.wr_id, r.byte_len), (id, 64), "{r:?}");
    }
    assert_eq!(m.buf.read(0, 128), pattern(5, 128), "delivered once each, in order, whole");
    assert_eq!(p.qp.state().unwrap(), QpState::Rts);
}
