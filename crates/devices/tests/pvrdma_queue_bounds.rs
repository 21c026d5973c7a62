//! A guest that posts or completes more than its queues hold: what it
//! posts beyond a queue's depth waits in its own ring (the device's head
//! does not pass it) and goes when completions free room, as on hardware;
//! nothing is lost and nothing grows in the device without bound.
mod pvrdma;

use std::time::{Duration, Instant};

use pvrdma::*;
use pvrdma_abi::ib::{self, wc_status, wr_opcode};
use pvrdma_abi::*;
use verbs::{SendWr, WcStatus};

const DEPTH: u32 = 8;

/// The device's consumer head of a QP's send (`send`) or receive ring.
fn ring_head(d: &Drv, qp: &GQp, send: bool) -> u32 {
    d.get(qp.base + if send { QP_SQ_RING_OFFSET } else { QP_RQ_RING_OFFSET } + 4)
}

fn qp_field(d: &Drv, qp: &GQp, field: &str) -> u64 {
    let q = d.query();
    let e = q["qps"].as_array().unwrap().iter().find(|e| e["handle"] == qp.handle).unwrap().clone();
    e[field].as_u64().unwrap()
}

/// Receives posted beyond the queue's depth while the first ones wait for
/// messages stay in the guest's ring; each message's completion makes room
/// and the next one goes: all of them complete, in order, with their
/// wr_ids.
#[test]
fn receives_beyond_the_depth_wait_in_the_ring_and_none_is_lost() {
    let bed = Bed::new("pvd-rqb", 2);
    let (gid, mut d) = bed.device();
    let mut c = d.rc_conn(ConnSpec { depth: DEPTH, cq_entries: 64, ..Default::default() });
    let peer = bed.peer_of(&mut d, &c.qp, gid, 1, 2);
    let (buf, key) = (c.buf, c.key);
    let n = 2 * DEPTH as u64;
    for i in 0..DEPTH as u64 {
        d.post_recv(&mut c.qp, i, &[Sge { addr: buf + i * 256, length: 256, lkey: key }]);
    }
    assert_eq!(ring_head(&d, &c.qp, false), DEPTH, "the first receives are taken");
    // The ring shows room again (the device took them); the guest fills it.
    for i in DEPTH as u64..n {
        d.post_recv(&mut c.qp, i, &[Sge { addr: buf + i * 256, length: 256, lkey: key }]);
    }
    assert_eq!(ring_head(&d, &c.qp, false), DEPTH, "rnicd's queue is full: the rest wait in the guest's ring");
    assert_eq!(qp_field(&d, &c.qp, "rq_outstanding"), DEPTH as u64);
    for i in 0..n {
        peer.buf.write(i as usize * 64, &pattern(i, 64));
        peer.qp.post_send(&[SendWr::send(i, &[peer.mr.sge(i as usize * 64, 64)])]).unwrap();
    }
    let cqes = d.wait_cqes(&mut c.rcq, n as usize);
    for (i, e) in cqes.iter().enumerate() {
        assert_eq!((e.wr_id, e.status, e.byte_len), (i as u64, wc_status::SUCCESS, 64), "{e:?}");
        assert_eq!(d.get_bytes(buf + i as u64 * 256, 64), pattern(i as u64, 64));
    }
    for _ in 0..n {
        assert_eq!(peer.cq.wait(1, T).unwrap()[0].status, WcStatus::Success);
    }
    assert_eq!(ring_head(&d, &c.qp, false), (n as u32) % (2 * DEPTH));
    assert_eq!(qp_field(&d, &c.qp, "rq_outstanding"), 0);
}

/// A guest that never signals its sends: they go on (rnicd retires them,
/// and the guest's ring shows their slots free), and the device's copies of
/// them, kept for completions and for a migration's reposts, stay bounded:
/// at most twice the depth and one, however many went.
#[test]
fn unsignaled_sends_keep_flowing_and_their_copies_stay_bounded() {
    let bed = Bed::new("pvd-sqb", 2);
    let (gid, mut d) = bed.device();
    let mut c = d.rc_conn(ConnSpec { depth: DEPTH, ..Default::default() });
    let peer = bed.peer_of(&mut d, &c.qp, gid, 1, 2);
    let (buf, key) = (c.buf, c.key);
    let n = 20 * DEPTH as u64;
    let bound = 2 * DEPTH as u64 + 1;
    for i in 0..=n {
        // Wait for a free slot in the guest's ring (what a driver's post
        // checks), ringing the doorbell meanwhile.
        let t = Instant::now();
        while (c.qp.sq_tail + 2 * DEPTH - ring_head(&d, &c.qp, true)) % (2 * DEPTH) >= DEPTH {
            assert!(t.elapsed() < T, "the send ring stays full at WQE {i}");
            d.doorbell(UAR_QP_OFFSET, UAR_QP_SEND | c.qp.handle);
            std::thread::sleep(Duration::from_micros(100));
        }
        d.put_bytes(buf + i * 64, &pattern(i, 64));
        let mut h = sq(i, wr_opcode::RDMA_WRITE);
        if i < n {
            h.send_flags = 0;
        }
        h.wr.set_rdma(&WrRdma { remote_addr: peer.mr.addr + i * 64, rkey: peer.mr.rkey, reserved: [0; 4] });
        d.post_send(&mut c.qp, h, &[Sge { addr: buf + i * 64, length: 64, lkey: key }]);
        let held = qp_field(&d, &c.qp, "sq_outstanding");
        assert!(held <= bound, "{held} copies held after WQE {i}");
    }
    // The last one was signaled: its completion retires all before it.
    let e = d.wait_cqes(&mut c.scq, 1)[0];
    assert_eq!((e.wr_id, e.status), (n, wc_status::SUCCESS), "{e:?}");
    assert_eq!(qp_field(&d, &c.qp, "sq_outstanding"), 0);
    let all: Vec<u8> = (0..=n).flat_map(|i| pattern(i, 64)).collect();
    assert_eq!(peer.buf.read(0, all.len()), all);
}

/// A guest that never takes its completions: the device keeps at most a
/// ring's worth waiting for room, rnicd's CQ then overruns and the guest
/// hears CQ_ERR, however often it rings POLL.
#[test]
fn completions_the_guest_never_takes_do_not_pile_up_in_the_device() {
    let bed = Bed::new("pvd-cqb", 2);
    let (gid, mut d) = bed.device();
    let entries = 4;
    let mut c = d.rc_conn(ConnSpec { cq_entries: entries, depth: 64, ..Default::default() });
    let peer = bed.peer_of(&mut d, &c.qp, gid, 1, 2);
    let (buf, key) = (c.buf, c.key);
    let mut ev_head = 0;
    let n = 40u64;
    for i in 0..n {
        d.post_recv(&mut c.qp, i, &[Sge { addr: buf + i * 256, length: 256, lkey: key }]);
    }
    for i in 0..n {
        // One message at a time, each completed in rnicd before the POLL:
        // the device's pending list fills first and rnicd's CQ overruns
        // while the device has no room to take from it.
        peer.qp.post_send(&[SendWr::send(i, &[peer.mr.sge(0, 64)])]).unwrap();
        assert_eq!(peer.cq.wait(1, T).unwrap()[0].status, WcStatus::Success);
        // POLL without taking anything: the device moves what fits.
        d.doorbell(UAR_CQ_OFFSET, UAR_CQ_POLL | c.rcq.handle);
        let q = d.query();
        let cq = q["cqs"].as_array().unwrap().iter().find(|e| e["handle"] == c.rcq.handle).unwrap().clone();
        assert!(cq["pending"].as_u64().unwrap() <= entries as u64, "{cq}");
    }
    let t = Instant::now();
    while !d.async_events(&mut ev_head).contains(&Eqe { event_type: ib::event::CQ_ERR, info: c.rcq.handle }) {
        assert!(t.elapsed() < T, "no CQ_ERR for an overrun CQ");
        d.doorbell(UAR_CQ_OFFSET, UAR_CQ_POLL | c.rcq.handle);
        std::thread::sleep(Duration::from_millis(1));
    }
    let q = d.query();
    let cq = q["cqs"].as_array().unwrap().iter().find(|e| e["handle"] == c.rcq.handle).unwrap().clone();
    assert!(cq["pending"].as_u64().unwrap() <= entries as u64 && cq["overran"] == true, "{cq}");
    // The ring holds what reached it before the overrun, in order.
    let held: Vec<u64> = std::iter::from_fn(|| d.take(&mut c.rcq)).map(|e| e.wr_id).collect();
    assert!(held.len() <= entries as usize && held.windows(2).all(|w| w[0] < w[1]), "{held:?}");
}
