//! Transit's WAIT doorbell (`pvrdma_abi::transit::UAR_CQ_WAIT`): a guest
//! that takes no interrupts sleeps in the device until a completion reaches
//! its CQ ring, instead of spinning on POLL doorbells. Real rnicd processes
//! on testbed hosts and a bare-metal verbs peer, as in pvrdma_device.rs.
mod pvrdma;

use std::time::{Duration, Instant};

use devices::Lifecycle;
use pvrdma::*;
use pvrdma_abi::ib::{wc_opcode, wc_status};
use pvrdma_abi::*;
use verbs::SendWr;

const WAIT: u32 = UAR_CQ_POLL | transit::UAR_CQ_WAIT;

/// A stream of peer SENDs taken with WAIT doorbells only (no POLL loop):
/// every message arrives, once, in order; a WAIT with nothing coming
/// returns on its own; a WAIT on a CQ the guest armed for notification
/// leaves the notification intact; bad handles and a paused device answer
/// at once.
#[test]
fn wait_doorbell_sleeps_until_a_completion_reaches_the_ring() {
    let bed = Bed::new("pvwait", 2);
    let (gid, mut d) = bed.device();
    let Conn { buf, key, mut scq, mut rcq, mut qp, .. } = d.rc_conn(ConnSpec::default());
    let peer = bed.peer_of(&mut d, &qp, gid, 500, 700);

    // Nothing is coming: the WAIT returns by itself (bounded) with an
    // empty ring and no error.
    let t0 = Instant::now();
    d.doorbell(UAR_CQ_OFFSET, WAIT | rcq.handle);
    assert!(t0.elapsed() < Duration::from_secs(5), "a WAIT with nothing coming must end");
    assert!(d.take(&mut rcq).is_none());
    assert_eq!(d.rd(REG_ERR), 0);

    // The peer sends a stream, eight messages at a time, while the guest
    // takes them with WAIT doorbells only.
    const N: u64 = 200;
    for i in 0..16 {
        d.post_recv(&mut qp, i, &[Sge { addr: buf + i * 256, length: 256, lkey: key }]);
    }
    let mut next = 0u64;
    let deadline = Instant::now() + T;
    while next < N {
        let batch = next..(next + 8).min(N);
        for i in batch.clone() {
            peer.buf.write(i as usize * 8, &i.to_le_bytes());
            peer.qp.post_send(&[SendWr::send(i, &[peer.mr.sge(i as usize * 8, 8)])]).unwrap();
        }
        while next < batch.end {
            assert!(Instant::now() < deadline, "timed out after {next} of {N} messages");
            let Some(c) = d.take(&mut rcq) else {
                d.doorbell(UAR_CQ_OFFSET, WAIT | rcq.handle);
                continue;
            };
            assert_eq!((c.status, c.opcode), (wc_status::SUCCESS, wc_opcode::RECV), "{c:?}");
            let slot = c.wr_id;
            let got = u64::from_le_bytes(d.get_bytes(buf + slot * 256, 8).try_into().unwrap());
            assert_eq!(got, next, "message {next} (receive slot {slot})");
            next += 1;
            d.post_recv(&mut qp, slot, &[Sge { addr: buf + slot * 256, length: 256, lkey: key }]);
        }
        let w = peer.cq.wait(batch.count(), T).unwrap();
        assert!(w.iter().all(|w| w.status == verbs::WcStatus::Success), "{w:?}");
    }
    assert_eq!(d.rd(REG_ERR), 0);
    assert!(d.take(&mut rcq).is_none(), "no completion twice");

    // A CQ the guest armed for notification: a WAIT on it still returns with
    // the completion, and the armed CQ's notification still comes.
    let notes_before: u32 = d.get(d.cq_ring + RING_STATE_RX_PROD_TAIL);
    d.doorbell(UAR_CQ_OFFSET, UAR_CQ_ARM | scq.handle);
    d.put_bytes(buf + 512 * 1024, b"ping");
    peer.qp.post_recv(&[verbs::RecvWr { wr_id: 1, sg_list: &[peer.mr.sge(4096, 64)] }]).unwrap();
    d.post_send(&mut qp, sq(77, pvrdma_abi::ib::wr_opcode::SEND), &[Sge { addr: buf + 512 * 1024, length: 4, lkey: key }]);
    let deadline = Instant::now() + T;
    let c = loop {
        if let Some(c) = d.take(&mut scq) {
            break c;
        }
        assert!(Instant::now() < deadline, "the SEND completion never came");
        d.doorbell(UAR_CQ_OFFSET, WAIT | scq.handle);
    };
    assert_eq!((c.wr_id, c.status, c.opcode), (77, wc_status::SUCCESS, wc_opcode::SEND), "{c:?}");
    let deadline = Instant::now() + T;
    while d.get::<u32>(d.cq_ring + RING_STATE_RX_PROD_TAIL) == notes_before {
        assert!(Instant::now() < deadline, "the armed CQ was never notified");
        std::thread::sleep(Duration::from_millis(1));
    }

    // Bad handles get ERR and return at once; so does a paused device.
    d.doorbell(UAR_CQ_OFFSET, WAIT | 999);
    assert_eq!(d.rd(REG_ERR), 22, "EINVAL for a WAIT on no CQ");
    d.dev.lock().unwrap().pause();
    d.doorbell(UAR_CQ_OFFSET, WAIT | rcq.handle);
    assert_eq!(d.rd(REG_ERR), 1, "EPERM for a WAIT on a paused device");
    d.dev.lock().unwrap().resume();
    let slot = notes_before % event_ring_slots(EVENT_RING_PAGES, 4);
    assert_eq!(d.get::<Cqne>(d.cq_ring + EVENT_RING_FIRST_OFFSET + slot as u64 * 4).info, scq.handle);
}

/// Transit's WAIT bit on the QP doorbell (`transit::UAR_QP_WAIT`): a
/// ping-pong with one doorbell per round trip. Each ping's SEND doorbell
/// also carries the RECV bit for the receive reposted after the last pong
/// (queued without a doorbell of its own) and waits on the QP's receive CQ:
/// every pong arrives, once, in order, in a receive the device took from
/// such a combined doorbell (the QP has only four receives, so without them
/// the peer would run out of the guest's receives at the fifth ping). A
/// QP doorbell with WAIT for no QP answers at once with EINVAL.
#[test]
fn send_doorbell_with_wait_returns_with_the_answer() {
    let bed = Bed::new("pvqpwait", 2);
    let (gid, mut d) = bed.device();
    let Conn { buf, key, mut rcq, mut qp, .. } = d.rc_conn(ConnSpec::default());
    let peer = bed.peer_of(&mut d, &qp, gid, 500, 700);

    const N: u64 = 50;
    const RECVS: u64 = 4;
    for i in 0..RECVS {
        d.post_recv(&mut qp, i, &[Sge { addr: buf + i * 256, length: 256, lkey: key }]);
    }
    for k in 0..8 {
        peer.qp.post_recv(&[verbs::RecvWr { wr_id: k, sg_list: &[peer.mr.sge(k as usize * 64, 64)] }]).unwrap();
    }
    std::thread::scope(|s| {
        // The peer answers every ping with a pong carrying the same number.
        s.spawn(|| {
            for i in 0..N {
                let got = loop {
                    let w = peer.cq.wait(1, T).unwrap();
                    assert_eq!(w.len(), 1, "ping {i} never came");
                    assert_eq!(w[0].status, verbs::WcStatus::Success, "{w:?}");
                    if w[0].opcode == verbs::WcOpcode::Recv {
                        break w[0].wr_id;
                    }
                };
                let ping = u64::from_le_bytes(peer.buf.read(got as usize * 64, 8).try_into().unwrap());
                assert_eq!(ping, i, "ping order");
                peer.qp.post_recv(&[verbs::RecvWr { wr_id: got, sg_list: &[peer.mr.sge(got as usize * 64, 64)] }]).unwrap();
                peer.buf.write(4096, &i.to_le_bytes());
                peer.qp.post_send(&[SendWr::send(i, &[peer.mr.sge(4096, 8)]).unsignaled()]).unwrap();
            }
        });
        let ping_at = buf + 512 * 1024;
        for i in 0..N {
            d.put_bytes(ping_at, &i.to_le_bytes());
            let unsignaled = SqWqeHdr { send_flags: 0, ..sq(i, pvrdma_abi::ib::wr_opcode::SEND) };
            d.put_send(&mut qp, unsignaled, &[Sge { addr: ping_at, length: 8, lkey: key }]);
            let recv = if i > 0 { UAR_QP_RECV } else { 0 };
            d.doorbell(UAR_QP_OFFSET, UAR_QP_SEND | recv | transit::UAR_QP_WAIT | qp.handle);
            assert_eq!(d.rd(REG_ERR), 0, "ping {i}");
            let deadline = Instant::now() + T;
            let c = loop {
                if let Some(c) = d.take(&mut rcq) {
                    break c;
                }
                // The doorbell's wait is bounded: on a loaded host the pong
                // may come later.
                assert!(Instant::now() < deadline, "pong {i} never came");
                d.doorbell(UAR_CQ_OFFSET, WAIT | rcq.handle);
            };
            assert_eq!((c.status, c.opcode), (wc_status::SUCCESS, wc_opcode::RECV), "{c:?}");
            let slot = c.wr_id;
            let pong = u64::from_le_bytes(d.get_bytes(buf + slot * 256, 8).try_into().unwrap());
            assert_eq!(pong, i, "pong {i} (receive slot {slot})");
            // Reposted without a doorbell: the next ping's carries it.
            d.put_recv(&mut qp, slot, &[Sge { addr: buf + slot * 256, length: 256, lkey: key }]);
        }
    });
    assert!(d.take(&mut rcq).is_none(), "no completion twice");

    let t0 = Instant::now();
    d.doorbell(UAR_QP_OFFSET, UAR_QP_SEND | transit::UAR_QP_WAIT | 999);
    assert_eq!(d.rd(REG_ERR), 22, "EINVAL for a QP doorbell on no QP");
    assert!(t0.elapsed() < Duration::from_secs(5));
}
