//! The state at a migration's switch as a delta over the early section
//! (`Persist::save_switch`), moved from host A to host B mid-stream with a
//! bare-metal peer: objects made after the early section travel whole,
//! the rest by what changed; the destination rebuilds exactly the source's
//! objects, refuses a delta without the early section it is over, and the
//! stream goes on in order.
mod pvrdma;

use devices::Lifecycle;
use pvrdma::*;
use pvrdma_abi::ib::{wc_opcode, wc_status};
use pvrdma_abi::*;
use snapshot::Persist;
use verbs::SendWr;

#[test]
fn a_delta_over_the_early_section_restores_exactly_mid_stream() {
    let bed = Bed::new("pvdelta", 3);
    let (gid, mut d, fd_b) = bed.movable_device();
    let Conn { pd, buf, key, mut rcq, mut qp, .. } = d.rc_conn(ConnSpec { cq_entries: 128, depth: 64, sge: 2, ..Default::default() });
    let peer = bed.peer_of(&mut d, &qp, gid, 10, 20);

    const MSGS: u64 = 30;
    for i in 0..MSGS {
        d.post_recv(&mut qp, i, &[Sge { addr: buf + i * 4096, length: 4096, lkey: key }]);
    }
    let msg = |i: u64| pattern(i + 3, 4096);
    let send_msgs = |from: u64, to: u64| {
        for i in from..to {
            let at = (i as usize % 64) * 4096;
            peer.buf.write(at, &msg(i));
            peer.qp.post_send(&[SendWr::send(i, &[peer.mr.sge(at, 4096)])]).unwrap();
        }
    };
    send_msgs(0, 10);
    let mut got = d.wait_cqes(&mut rcq, 10);

    // The early section, then objects made after it (an MR and a CQ that
    // must travel whole in the delta) and more traffic.
    let early = d.dev.lock().unwrap().save_early().unwrap().expect("an early section");
    let (_, late_mr, late_key) = d.create_mr(pd, 64 << 10);
    let _late_cq = d.create_cq(64);
    send_msgs(10, 20);
    got.extend(d.wait_cqes(&mut rcq, 10));

    d.dev.lock().unwrap().pause();
    let whole = d.dev.lock().unwrap().save().expect("save");
    let delta = d.dev.lock().unwrap().save_switch().expect("save_switch");
    eprintln!("whole state {} bytes, delta {} bytes", whole.data.len(), delta.data.len());
    assert_ne!(delta.version, whole.version, "the switch's state is a delta");
    assert!(delta.data.len() < whole.data.len(), "the delta is smaller than the whole state");
    let q = d.query();
    assert!(q["mrs"].as_array().unwrap().iter().any(|m| m["handle"] == late_mr && m["key"] == late_key), "{q}");

    bed.move_gid(gid, 0, 2);
    d.replace_device(&bed.nics[2].sock, gid, fd_b);
    // Without the early section it is over, the delta is refused.
    let err = d.dev.lock().unwrap().restore(&delta).expect_err("a delta without its early section");
    assert!(err.to_string().contains("early section"), "{err}");
    d.dev.lock().unwrap().prepare(&early).expect("prepare");
    d.dev.lock().unwrap().restore(&delta).expect("restore the delta");
    let q2 = d.query();
    assert_eq!(q2["mrs"], q["mrs"], "same MRs, keys and addresses");
    assert_eq!(q2["objects"], q["objects"], "the same objects");
    let ids =
        |v: &serde_json::Value| v["qps"].as_array().unwrap().iter().map(|x| (x["handle"].clone(), x["qpn"].clone())).collect::<Vec<_>>();
    assert_eq!(ids(&q2), ids(&q), "same QPs and QPNs");
    assert_eq!(q2["switch"]["delta"], true, "{q2}");
    d.dev.lock().unwrap().resume();

    send_msgs(20, MSGS);
    got.extend(d.wait_cqes(&mut rcq, (MSGS - 20) as usize));
    for (i, c) in got.iter().enumerate() {
        assert_eq!(
            (c.wr_id, c.status, c.opcode, c.byte_len),
            (i as u64, wc_status::SUCCESS, wc_opcode::RECV, 4096),
            "in order, exactly once: {c:?}"
        );
        assert!(d.get_bytes(buf + i as u64 * 4096, 4096) == msg(i as u64), "message {i}");
    }
    assert_eq!(peer.qp.state().unwrap(), verbs::QpState::Rts);
}
