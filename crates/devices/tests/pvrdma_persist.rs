//! Save on host A, restore on host B, in the middle of traffic with a
//! bare-metal peer that is never told: the GID moves with the VM, the QPNs
//! and keys stay, the peer sees only RNR NAKs and retransmissions.
mod pvrdma;

use devices::Lifecycle;
use pvrdma::*;
use pvrdma_abi::ib::{wc_opcode, wc_status, wr_opcode};
use pvrdma_abi::*;
use snapshot::Persist;
use verbs::{RecvWr, SendWr, WcStatus};

#[test]
fn save_on_one_host_restore_on_another_mid_stream() {
    let bed = Bed::new("pvmove", 3);
    let (gid, mut d, fd_b) = bed.movable_device();
    let Conn { buf, key, mut scq, mut rcq, mut qp, .. } = d.rc_conn(ConnSpec { mr_len: 16 << 20, cq_entries: 128, depth: 64, sge: 2 });
    let peer = bed.peer_of(&mut d, &qp, gid, 10, 20);

    // Receives for 40 messages of 4 KiB: each names its own slot.
    const MSGS: u64 = 40;
    for i in 0..MSGS.min(60) {
        d.post_recv(&mut qp, i, &[Sge { addr: buf + i * 4096, length: 4096, lkey: key }]);
    }
    let msg = |i: u64| {
        let mut m = pattern(i + 7, 4096);
        m[..8].copy_from_slice(&i.to_le_bytes());
        m
    };
    let send_msgs = |from: u64, to: u64| {
        for i in from..to {
            peer.buf.write((3 << 20) + (i as usize % 64) * 4096, &msg(i));
            peer.qp.post_send(&[SendWr::send(i, &[peer.mr.sge((3 << 20) + (i as usize % 64) * 4096, 4096)])]).unwrap();
        }
    };
    // The guest writes 3 x 1 MiB to the peer while the peer sends 20 messages.
    let big: Vec<Vec<u8>> = (0..3).map(|k| pattern(100 + k, 1 << 20)).collect();
    for (k, b) in big.iter().enumerate() {
        d.put_bytes(buf + (8 << 20) + ((k as u64) << 20), b);
        let mut h = sq(1000 + k as u64, wr_opcode::RDMA_WRITE);
        h.wr.set_rdma(&WrRdma { remote_addr: peer.mr.addr + (k as u64) * (1 << 20), rkey: peer.mr.rkey, reserved: [0; 4] });
        d.post_send(&mut qp, h, &[Sge { addr: buf + (8 << 20) + ((k as u64) << 20), length: 1 << 20, lkey: key }]);
    }
    send_msgs(0, 20);
    let mut got = d.wait_cqes(&mut rcq, 5);

    // Pause mid-stream (QPs suspended in rnicd A), save, and move: the GID
    // leaves host A for host B; a new device there restores the state.
    d.dev.lock().unwrap().pause();
    let section = d.dev.lock().unwrap().save().expect("save");
    let q = d.query();
    let outstanding = q["qps"][0]["sq_outstanding"].as_u64().unwrap() + q["qps"][0]["rq_outstanding"].as_u64().unwrap();
    assert!(outstanding > 0, "the move happens with work in flight: {q}");
    bed.move_gid(gid, 0, 2);
    d.replace_device(&bed.nics[2].sock, gid, fd_b);
    d.dev.lock().unwrap().restore(&section).expect("restore");
    let q2 = d.query();
    assert_eq!(q2["qps"][0]["qpn"], q["qps"][0]["qpn"], "same QPN after the move");
    assert_eq!(q2["mrs"], q["mrs"], "same keys and addresses");
    d.dev.lock().unwrap().resume();

    // The rest of the stream, on host B, to the same peer.
    send_msgs(20, MSGS);
    got.extend(d.wait_cqes(&mut rcq, MSGS as usize - got.len()));
    for (i, c) in got.iter().enumerate() {
        assert_eq!(
            (c.wr_id, c.status, c.opcode, c.byte_len),
            (i as u64, wc_status::SUCCESS, wc_opcode::RECV, 4096),
            "in order, exactly once: {c:?}"
        );
        assert!(d.get_bytes(buf + i as u64 * 4096, 4096) == msg(i as u64), "message {i}");
    }
    let writes = d.wait_cqes(&mut scq, 3);
    for (k, c) in writes.iter().enumerate() {
        assert_eq!((c.wr_id, c.status), (1000 + k as u64, wc_status::SUCCESS), "{c:?}");
        assert!(peer.buf.read(k << 20, 1 << 20) == big[k], "WRITE {k} landed whole");
    }
    let pw = peer.cq.wait(MSGS as usize, T).unwrap();
    assert!(pw.iter().all(|w| w.status == WcStatus::Success), "the peer never sees an error: {pw:?}");
    assert_eq!(peer.qp.state().unwrap(), verbs::QpState::Rts);
    let _ = RecvWr { wr_id: 0, sg_list: &[] };
}
