//! Figures for docs/pvrdma.md (ignored by default; run with
//! `cargo test --release -p devices --test pvrdma_bench -- --ignored --nocapture`):
//! the guest's cost per posted WQE (the doorbell's MMIO write, run inline on
//! the posting thread) beside a bare-metal verbs post, the cost of the
//! alternative's extra thread hop, and 2-byte SEND ping-pong latency guest <->
//! peer beside bare metal <-> peer. One JSON line at the end.
mod pvrdma;

use std::sync::mpsc;
use std::time::{Duration, Instant};

use pvrdma::*;
use pvrdma_abi::ib::{self, wr_opcode};
use pvrdma_abi::*;
use verbs::{RecvWr, SendWr};

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() as f64 - 1.0) * p) as usize]
}

#[test]
#[ignore]
fn datapath_figures() {
    let bed = Bed::new("pvbench", 3);
    let (gid, mut d) = bed.device();
    let Conn { buf, key, mut scq, mut rcq, mut qp, .. } = d.rc_conn(ConnSpec { cq_entries: 256, depth: 64, sge: 1, ..Default::default() });
    let peer = bed.peer_of(&mut d, &qp, gid, 1, 2);

    // Cost per posted WQE: 64-byte WRITEs, every 32nd signaled.
    const N: u64 = 20_000;
    let mut post = Duration::ZERO;
    for i in 0..N {
        let mut h = sq(i, wr_opcode::RDMA_WRITE);
        if i % 32 != 31 {
            h.send_flags = 0;
        }
        h.wr.set_rdma(&WrRdma { remote_addr: peer.mr.addr, rkey: peer.mr.rkey, reserved: [0; 4] });
        let t = Instant::now();
        d.post_send(&mut qp, h, &[Sge { addr: buf, length: 64, lkey: key }]);
        post += t.elapsed();
        if i % 32 == 31 {
            d.wait_cqes(&mut scq, 1);
        }
    }
    let guest_post_us = post.as_secs_f64() * 1e6 / N as f64;

    // The same on a bare-metal QP (host 2 -> host 1).
    let bare = Peer::new(bed.ctx(2));
    let bpeer = Peer::new(bed.ctx(1));
    bare.connect(bed.nics[1].addr, bpeer.qp.qpn, 1, 2);
    bpeer.connect(bed.nics[2].addr, bare.qp.qpn, 2, 1);
    let mut post = Duration::ZERO;
    let sge = [bare.mr.sge(0, 64)];
    for i in 0..N {
        let mut wr = SendWr::write(i, &sge, bpeer.mr.addr, bpeer.mr.rkey);
        if i % 32 != 31 {
            wr = wr.unsignaled();
        }
        let t = Instant::now();
        bare.qp.post_send(&[wr]).unwrap();
        post += t.elapsed();
        if i % 32 == 31 {
            bare.cq.wait(1, T).unwrap();
        }
    }
    let bare_post_us = post.as_secs_f64() * 1e6 / N as f64;

    // The alternative design's extra hop: handing the doorbell to a device
    // thread that sleeps until woken (mpsc round trip to a parked thread).
    let (tx, rx) = mpsc::channel::<u64>();
    let (btx, brx) = mpsc::channel::<u64>();
    let t = std::thread::spawn(move || {
        while let Ok(v) = rx.recv() {
            btx.send(v).unwrap();
        }
    });
    let mut hops = Vec::new();
    for i in 0..5000u64 {
        let t0 = Instant::now();
        tx.send(i).unwrap();
        brx.recv().unwrap();
        hops.push(t0.elapsed().as_secs_f64() * 1e6 / 2.0);
        std::thread::sleep(Duration::from_micros(20));
    }
    drop(tx);
    t.join().unwrap();
    let hop_us = pct(&mut hops, 0.5);

    // 2-byte SEND ping-pong: guest -> peer -> guest, and bare -> peer -> bare.
    const PINGS: usize = 2000;
    let mut lat = Vec::new();
    for i in 0..PINGS as u64 {
        d.post_recv(&mut qp, i, &[Sge { addr: buf + 4096, length: 64, lkey: key }]);
        peer.qp.post_recv(&[RecvWr { wr_id: i, sg_list: &[peer.mr.sge(4096, 64)] }]).unwrap();
        let t0 = Instant::now();
        d.post_send(&mut qp, sq(i, wr_opcode::SEND), &[Sge { addr: buf, length: 2, lkey: key }]);
        peer.cq.wait(1, T).unwrap();
        peer.qp.post_send(&[SendWr::send(i, &[peer.mr.sge(0, 2)])]).unwrap();
        d.wait_cqes(&mut rcq, 1);
        lat.push(t0.elapsed().as_secs_f64() * 1e6);
        d.wait_cqes(&mut scq, 1);
        peer.cq.wait(1, T).unwrap();
    }
    let (g50, g99) = (pct(&mut lat, 0.5), pct(&mut lat, 0.99));
    let mut lat = Vec::new();
    for i in 0..PINGS as u64 {
        bare.qp.post_recv(&[RecvWr { wr_id: i, sg_list: &[bare.mr.sge(4096, 64)] }]).unwrap();
        bpeer.qp.post_recv(&[RecvWr { wr_id: i, sg_list: &[bpeer.mr.sge(4096, 64)] }]).unwrap();
        let t0 = Instant::now();
        bare.qp.post_send(&[SendWr::send(i, &[bare.mr.sge(0, 2)])]).unwrap();
        bpeer.cq.wait(1, T).unwrap();
        bpeer.qp.post_send(&[SendWr::send(i, &[bpeer.mr.sge(0, 2)])]).unwrap();
        let mut got = 0;
        while got < 2 {
            got += bare.cq.wait(1, T).unwrap().len();
        }
        lat.push(t0.elapsed().as_secs_f64() * 1e6);
        bpeer.cq.wait(1, T).unwrap();
    }
    let (b50, b99) = (pct(&mut lat, 0.5), pct(&mut lat, 0.99));
    let _ = ib::qp_state::RTS;
    println!("post per WQE: guest (doorbell inline) {guest_post_us:.2} us, bare-metal verbs {bare_post_us:.2} us");
    println!("one thread hop (the alternative's hand-off), p50: {hop_us:.2} us");
    println!("2 B SEND round trip: guest p50 {g50:.1} us p99 {g99:.1} us; bare p50 {b50:.1} us p99 {b99:.1} us");
    println!(
        "{}",
        serde_json::json!({"guest_post_us": guest_post_us, "bare_post_us": bare_post_us, "thread_hop_us": hop_us,
            "rtt_guest_p50_us": g50, "rtt_guest_p99_us": g99, "rtt_bare_p50_us": b50, "rtt_bare_p99_us": b99})
    );
}
