//! An RC QP's receive queue: rnicd takes a posted receive from the shared
//! ring when a message needs it, so posting one needs no doorbell, the
//! ring holds exactly the receives not yet used (a queue of max_recv_wr, as
//! on a device), and a QP in ERR still flushes a receive posted to it.
mod common;
use common::*;
use std::time::Duration;
use verbs::*;

#[test]
fn receives_wait_in_the_ring_until_a_message_takes_them() {
    let bed = Bed::new("rnrq", 2);
    let o = ConnectOpts { mtu: Mtu::M1024, min_rnr_timer: 1, rnr_retry: 7, ..Default::default() };
    // 16 receives: the ring is exactly max_recv_wr slots.
    let (a, b) = pair_sized(&bed, 0, 1, o, 1 << 20, 16);
    let rsg = [b.mr.sge(0, 4096)];
    let recvs: Vec<RecvWr> = (0..16).map(|i| RecvWr { wr_id: i, sg_list: &rsg }).collect();
    b.qp.post_recv(&recvs).unwrap();
    // Had the post rung rnicd, it would have moved the receives off the
    // ring by now and the queue would take 16 more.
    std::thread::sleep(Duration::from_millis(200));
    assert!(b.qp.post_recv(&[RecvWr { wr_id: 99, sg_list: &rsg }]).is_err(), "a 17th receive fits a queue of 16");

    // Each SEND takes one, in order; its slot is free again.
    let data = pattern(5, 3000);
    a.buf.write(0, &data);
    a.qp.post_send(&[SendWr::send(1, &[a.mr.sge(0, 3000)])]).unwrap();
    ok(&a.scq);
    let w = ok(&b.rcq);
    assert_eq!((w.wr_id, w.byte_len), (0, 3000));
    assert_eq!(b.buf.read(0, 3000), data);
    b.qp.post_recv(&[RecvWr { wr_id: 16, sg_list: &rsg }]).unwrap();
    assert!(b.qp.post_recv(&[RecvWr { wr_id: 99, sg_list: &rsg }]).is_err(), "the queue holds 16 again");

    // 16 more SENDs than receives were ever short of: all arrive, in order.
    let ssg = [a.mr.sge(0, 100)];
    let sends: Vec<SendWr> = (0..16).map(|i| SendWr::send(10 + i, &ssg)).collect();
    a.qp.post_send(&sends).unwrap();
    let ws = b.rcq.wait(16, T).unwrap();
    assert!(ws.iter().all(|w| w.status == WcStatus::Success), "{ws:?}");
    assert_eq!(ws.iter().map(|w| w.wr_id).collect::<Vec<_>>(), (1..=16).collect::<Vec<_>>());
    a.scq.wait(16, T).unwrap();

    // A receive posted after the QP went to ERR on its own (a bad rkey
    // from the peer) is flushed: in ERR the post rings the doorbell.
    a.qp.post_send(&[SendWr::write(2, &[a.mr.sge(0, 8)], b.mr.addr, b.mr.rkey ^ 0x77)]).unwrap();
    assert_eq!(one(&a.scq).status, WcStatus::RemAccessErr);
    assert_eq!(b.qp.state().unwrap(), QpState::Err);
    b.qp.post_recv(&[RecvWr { wr_id: 50, sg_list: &rsg }]).unwrap();
    let w = one(&b.rcq);
    assert_eq!((w.wr_id, w.status), (50, WcStatus::WrFlushErr));
    assert_eq!(b.ctx.stats().unwrap()["late_ring_wqes"].as_u64(), Some(0));
}
