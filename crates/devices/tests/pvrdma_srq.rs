//! Shared receive queues of the PVRDMA device, driven as Linux's
//! vmw_pvrdma driver and rdma-core's provider drive them, against real
//! rnicd processes on testbed hosts with bare-metal verbs peers: several
//! QPs taking receives from one SRQ (data checked byte for byte), the limit
//! event, the commands' checks and bad input, an SRQ holding receives
//! saved on one host and restored on another, and bus mastering.
mod pvrdma;

use std::time::Duration;

use devices::Lifecycle;
use pvrdma::*;
use pvrdma_abi::ib::{self, wc_opcode, wc_status};
use pvrdma_abi::*;
use snapshot::Persist;
use verbs::{SendWr, WcStatus};

const EPERM: u32 = 1;
const EIO: u32 = 5;
const E2BIG: u32 = 7;
const EFAULT: u8 = 14;
const EBUSY: u8 = 16;
const EINVAL: u8 = 22;
const ERANGE: u32 = 34;

/// Receive slots in the guest MR.
const SLOT: u64 = 4096;

/// Message `m` of peer `q`: its numbers in the first 16 bytes, then a
/// pattern; at most 1000 bytes, so one packet each.
fn message(q: usize, m: u64) -> Vec<u8> {
    let len = 200 + ((m as usize * 37 + q * 101) % 800);
    let mut v = pattern(q as u64 * 1000 + m, len);
    v[..8].copy_from_slice(&(q as u64).to_le_bytes());
    v[8..16].copy_from_slice(&m.to_le_bytes());
    v
}

fn send_from(peer: &Peer, q: usize, m: u64) {
    let off = (2 << 20) + (m as usize % 256) * 1024;
    let msg = message(q, m);
    peer.buf.write(off, &msg);
    peer.qp.post_send(&[SendWr::send(m, &[peer.mr.sge(off, msg.len())])]).unwrap();
}

/// A receive of slot `i`: two SGEs (the first 100 bytes, then the rest).
fn slot_sges(buf: u64, key: u32, i: u64) -> [Sge; 2] {
    let at = buf + i * SLOT;
    [Sge { addr: at, length: 100, lkey: key }, Sge { addr: at + 100, length: SLOT as u32 - 100, lkey: key }]
}

/// Checks receive completions: each names its QP, lands whole in the slot
/// its wr_id names, every (peer, message) exactly once and in order per QP.
fn check_receives(d: &Drv, cqes: &[Cqe], buf: u64, qp_of_peer: &[u32], next: &mut [u64]) {
    for c in cqes {
        assert_eq!((c.status, c.opcode), (wc_status::SUCCESS, wc_opcode::RECV), "{c:?}");
        let q = qp_of_peer.iter().position(|h| *h as u64 == c.qp).unwrap_or_else(|| panic!("CQE of an unknown QP: {c:?}"));
        let head = d.get_bytes(buf + c.wr_id * SLOT, 16);
        let m = u64::from_le_bytes(head[8..16].try_into().unwrap());
        assert_eq!(u64::from_le_bytes(head[..8].try_into().unwrap()), q as u64, "slot {} holds another QP's message", c.wr_id);
        assert_eq!(m, next[q], "QP {q}: messages in order, exactly once");
        next[q] += 1;
        let want = message(q, m);
        assert_eq!(c.byte_len as usize, want.len(), "{c:?}");
        assert!(d.get_bytes(buf + c.wr_id * SLOT, want.len()) == want, "QP {q} message {m} byte for byte");
    }
}

#[test]
fn qps_share_one_srq_with_bare_metal_peers() {
    let bed = Bed::new("pvsrq", 2);
    let (gid, mut d) = bed.device();
    let caps: DeviceCaps = d.get(d.dsr + Dsr::CAPS_OFFSET as u64);
    assert!(caps.max_srq > 0, "Linux offers SRQs only when max_srq is not 0: {caps:?}");
    assert!(caps.max_srq_wr >= 64 && caps.max_srq_sge >= 2, "{caps:?}");

    let pd = d.create_pd();
    let (buf, _, key) = d.create_mr(pd, 128 * SLOT);
    let scq = d.create_cq(256);
    let mut rcq = d.create_cq(256);
    let mut srq = d.create_srq(pd, 64, 2, 0);
    let q: CmdQuerySrqResp = d.cmd(CmdQuerySrq { hdr: Drv::hdr(CMD_QUERY_SRQ), srq_handle: srq.handle, reserved: [0; 4] }).unwrap();
    assert_eq!((q.attrs.max_wr, q.attrs.max_sge, q.attrs.srq_limit), (64, 2, 0));

    // Three QPs on the SRQ, each connected to its own bare-metal peer QP.
    const QPS: usize = 3;
    let mut qps = Vec::new();
    let mut peers = Vec::new();
    for i in 0..QPS {
        let qp = d.try_create_qp_on_srq(pd, &scq, &rcq, srq.handle, 16, 1).unwrap();
        let peer = bed.peer_of(&mut d, &qp, gid, 100 + i as u32, 200 + i as u32);
        qps.push(qp);
        peers.push(peer);
    }
    let handles: Vec<u32> = qps.iter().map(|q| q.handle).collect();
    // A receive doorbell on a QP of the SRQ: it has no queue of its own.
    d.doorbell(UAR_QP_OFFSET, UAR_QP_RECV | qps[0].handle);
    assert_eq!(d.rd(REG_ERR), EINVAL as u32);

    // 48 receives, then 16 messages from each peer, interleaved.
    for i in 0..48 {
        d.put_srq_recv(&mut srq, i, &slot_sges(buf, key, i));
    }
    d.doorbell(UAR_SRQ_OFFSET, UAR_SRQ_RECV | srq.handle);
    assert_eq!(d.query()["srqs"][0]["outstanding"], 48);
    let mut sent = [0u64; QPS];
    let mut send = |k: usize| {
        send_from(&peers[k], k, sent[k]);
        sent[k] += 1;
    };
    for _ in 0..16 {
        for k in 0..QPS {
            send(k);
        }
    }
    let mut next = [0u64; QPS];
    let got = d.wait_cqes(&mut rcq, 48);
    check_receives(&d, &got, buf, &handles, &mut next);
    let mut ids: Vec<u64> = got.iter().map(|c| c.wr_id).collect();
    ids.sort();
    assert_eq!(ids, (0..48).collect::<Vec<_>>(), "every receive used once");

    // ARM LIMIT: 10 receives posted, limit 6; the fifth message leaves 5.
    let mut ev_head = 0;
    assert!(d.async_events(&mut ev_head).is_empty());
    for i in 48..58 {
        d.post_srq_recv(&mut srq, i, &slot_sges(buf, key, i));
    }
    let m = CmdModifySrq {
        hdr: Drv::hdr(CMD_MODIFY_SRQ),
        srq_handle: srq.handle,
        attr_mask: ib::srq_attr_mask::LIMIT,
        attrs: SrqAttr { srq_limit: 6, ..Default::default() },
    };
    d.cmd::<_, CmdRespHdr>(m).unwrap();
    for k in [0, 1, 2, 0] {
        send(k);
    }
    check_receives(&d, &d.wait_cqes(&mut rcq, 4), buf, &handles, &mut next);
    assert!(d.async_events(&mut ev_head).is_empty(), "6 receives still posted: no event yet");
    send(1);
    check_receives(&d, &d.wait_cqes(&mut rcq, 1), buf, &handles, &mut next);
    assert_eq!(d.async_events(&mut ev_head), vec![Eqe { event_type: ib::event::SRQ_LIMIT_REACHED, info: srq.handle }]);
    assert!(d.rd(REG_ICR) & INTR_CAUSE_ASYNC != 0);
    let q: CmdQuerySrqResp = d.cmd(CmdQuerySrq { hdr: Drv::hdr(CMD_QUERY_SRQ), srq_handle: srq.handle, reserved: [0; 4] }).unwrap();
    assert_eq!(q.attrs.srq_limit, 0, "the event disarms the limit");
    send(2);
    check_receives(&d, &d.wait_cqes(&mut rcq, 1), buf, &handles, &mut next);
    assert!(d.async_events(&mut ev_head).is_empty(), "once per arming");

    // The last 4 receives, then an empty SRQ: the next message waits at
    // the peer (RNR NAKs) until a receive is posted.
    for k in [0, 1, 2, 0] {
        send(k);
    }
    check_receives(&d, &d.wait_cqes(&mut rcq, 4), buf, &handles, &mut next);
    assert_eq!(d.query()["srqs"][0]["outstanding"], 0);
    send(2);
    std::thread::sleep(Duration::from_millis(300));
    d.doorbell(UAR_CQ_OFFSET, UAR_CQ_POLL | rcq.handle);
    assert!(d.take(&mut rcq).is_none(), "no receive posted: nothing completes");
    d.post_srq_recv(&mut srq, 60, &slot_sges(buf, key, 60));
    check_receives(&d, &d.wait_cqes(&mut rcq, 1), buf, &handles, &mut next);
    assert_eq!(next, sent);
    for (k, p) in peers.iter().enumerate() {
        let w = p.cq.wait(sent[k] as usize, T).unwrap();
        assert!(w.iter().all(|w| w.status == WcStatus::Success), "{w:?}");
        assert_eq!(p.qp.state().unwrap(), verbs::QpState::Rts, "the peers never see an error");
    }

    // The SRQ and its PD cannot go while QPs use it; then they can.
    let destroy =
        |d: &mut Drv, h: u32| d.cmd::<_, CmdRespHdr>(CmdDestroySrq { hdr: Drv::hdr(CMD_DESTROY_SRQ), srq_handle: h, reserved: [0; 4] });
    assert_eq!(destroy(&mut d, srq.handle).err(), Some(EBUSY));
    let dpd = CmdDestroyPd { hdr: Drv::hdr(CMD_DESTROY_PD), pd_handle: pd, reserved: [0; 4] };
    assert_eq!(d.cmd::<_, CmdRespHdr>(dpd).err(), Some(EBUSY));
    for qp in &qps {
        d.cmd::<_, CmdDestroyQpResp>(CmdDestroyQp { hdr: Drv::hdr(CMD_DESTROY_QP), qp_handle: qp.handle, reserved: [0; 4] }).unwrap();
    }
    destroy(&mut d, srq.handle).unwrap();
    assert_eq!(destroy(&mut d, srq.handle).err(), Some(EINVAL));
    assert_eq!(d.query()["objects"]["srqs"], 0);
    assert_eq!(d.query()["counters"]["error_cqes"], 0);
}

#[test]
fn bad_srq_input_gets_errors_and_harms_nothing() {
    let bed = Bed::new("pvsrqbad", 2);
    let (gid, mut d) = bed.device();
    let pd = d.create_pd();
    let pd2 = d.create_pd();
    let (buf, _, key) = d.create_mr(pd, 64 * SLOT);
    let scq = d.create_cq(64);
    let mut rcq = d.create_cq(64);

    // CREATE_SRQ: type, sizes, limit, pages, PD, page directory.
    let (_, pdir) = d.region(3);
    let create = |pd_handle, max_wr, max_sge, srq_limit, srq_type, nchunks, pdir_dma| CmdCreateSrq {
        hdr: Drv::hdr(CMD_CREATE_SRQ),
        pdir_dma,
        pd_handle,
        nchunks,
        attrs: SrqAttr { max_wr, max_sge, srq_limit, reserved: 0 },
        srq_type,
        reserved: [0; 7],
    };
    let bad = [
        ("XRC", create(pd, 16, 1, 0, ib::srq_type::XRC, 3, pdir)),
        ("max_wr not a power of two", create(pd, 12, 1, 0, 0, 3, pdir)),
        ("max_wr beyond the caps", create(pd, 1 << 16, 1, 0, 0, 3, pdir)),
        ("no SGE", create(pd, 16, 0, 0, 0, 3, pdir)),
        ("9 SGEs", create(pd, 16, 9, 0, 0, 3, pdir)),
        ("limit above max_wr", create(pd, 16, 1, 17, 0, 3, pdir)),
        ("pages fewer than the ring", create(pd, 1024, 8, 0, 0, 3, pdir)),
        ("no such PD", create(999, 16, 1, 0, 0, 3, pdir)),
    ];
    for (why, c) in bad {
        assert_eq!(d.cmd::<_, CmdCreateSrqResp>(c).err(), Some(EINVAL), "{why}");
    }
    assert_eq!(d.cmd::<_, CmdCreateSrqResp>(create(pd, 16, 1, 0, 0, 3, RAM + 4096)).err(), Some(EINVAL), "directory outside RAM");
    let page = d.alloc(1);
    let outside = d.pdir(&[page, page + 4096, RAM]);
    assert_eq!(d.cmd::<_, CmdCreateSrqResp>(create(pd, 16, 1, 0, 0, 3, outside)).err(), Some(EFAULT), "a ring page outside RAM");
    assert_eq!(d.query()["objects"]["srqs"], 0);

    // MODIFY_SRQ: resizing, a limit above max_wr, unknown bits, bad handle.
    let mut srq = d.create_srq(pd, 16, 2, 0);
    let modify = |h, attr_mask, srq_limit| CmdModifySrq {
        hdr: Drv::hdr(CMD_MODIFY_SRQ),
        srq_handle: h,
        attr_mask,
        attrs: SrqAttr { max_wr: 32, srq_limit, ..Default::default() },
    };
    for (why, m) in [
        ("resize", modify(srq.handle, ib::srq_attr_mask::MAX_WR, 0)),
        ("limit above max_wr", modify(srq.handle, ib::srq_attr_mask::LIMIT, 17)),
        ("unknown mask bit", modify(srq.handle, 1 << 5, 0)),
        ("no such SRQ", modify(777, ib::srq_attr_mask::LIMIT, 1)),
    ] {
        assert_eq!(d.cmd::<_, CmdRespHdr>(m).err(), Some(EINVAL), "{why}");
    }

    // CREATE_QP on an SRQ: no such SRQ, an SRQ of another PD.
    assert_eq!(d.try_create_qp_on_srq(pd, &scq, &rcq, 555, 16, 1).err(), Some(EINVAL));
    assert_eq!(d.try_create_qp_on_srq(pd2, &scq, &rcq, srq.handle, 16, 1).err(), Some(EINVAL));
    assert_eq!(d.query()["objects"]["qps"], 0);

    // Doorbells: no such SRQ, no operation bit.
    let before = d.query()["counters"]["bad_doorbells"].as_u64().unwrap();
    d.doorbell(UAR_SRQ_OFFSET, UAR_SRQ_RECV | 99);
    assert_eq!(d.rd(REG_ERR), EINVAL as u32);
    d.doorbell(UAR_SRQ_OFFSET, srq.handle);
    assert_eq!(d.query()["counters"]["bad_doorbells"].as_u64().unwrap(), before + 2);

    // A WQE with more SGEs than the SRQ's: the WQEs before it are posted,
    // it is consumed, SRQ_ERR is posted, and the SRQ is read no more.
    let mut ev_head = 0;
    d.put_srq_recv(&mut srq, 1, &slot_sges(buf, key, 1));
    let at = srq.base + 4096 + (srq.tail & (srq.cnt - 1)) as u64 * srq.stride;
    d.put_srq_recv(&mut srq, 2, &slot_sges(buf, key, 2));
    d.put(at, &RqWqeHdr { wr_id: 2, num_sge: 3, total_len: 0 });
    d.doorbell(UAR_SRQ_OFFSET, UAR_SRQ_RECV | srq.handle);
    assert_eq!(d.rd(REG_ERR), E2BIG);
    assert_eq!(d.async_events(&mut ev_head), vec![Eqe { event_type: ib::event::SRQ_ERR, info: srq.handle }]);
    let s = &d.query()["srqs"][0];
    assert_eq!((s["broken"].as_bool(), s["outstanding"].as_u64()), (Some(true), Some(1)), "{s}");
    let head: u32 = d.get(srq.base + RING_STATE_RX_CONS_HEAD);
    assert_eq!(head, 2, "the bad WQE was consumed");
    d.post_srq_recv(&mut srq, 3, &slot_sges(buf, key, 3));
    assert_eq!(d.rd(REG_ERR), EIO, "a stopped SRQ is not read");
    assert!(d.async_events(&mut ev_head).is_empty(), "SRQ_ERR once");

    // Ring indices outside [0, 2N) on a fresh SRQ: ERANGE, SRQ_ERR, nothing read.
    let srq2 = d.create_srq(pd, 16, 1, 0);
    d.put(srq2.base + RING_STATE_RX_PROD_TAIL, &(2 * srq2.cnt + 3));
    d.doorbell(UAR_SRQ_OFFSET, UAR_SRQ_RECV | srq2.handle);
    assert_eq!(d.rd(REG_ERR), ERANGE);
    assert_eq!(d.async_events(&mut ev_head), vec![Eqe { event_type: ib::event::SRQ_ERR, info: srq2.handle }]);
    assert_eq!(d.query()["srqs"][1]["outstanding"], 0);

    // The device still works: a QP on a third SRQ receives from a peer.
    let mut srq3 = d.create_srq(pd, 16, 2, 0);
    let qp = d.try_create_qp_on_srq(pd, &scq, &rcq, srq3.handle, 16, 1).unwrap();
    let peer = bed.peer_of(&mut d, &qp, gid, 1, 2);
    d.post_srq_recv(&mut srq3, 9, &slot_sges(buf, key, 9));
    send_from(&peer, 0, 0);
    check_receives(&d, &d.wait_cqes(&mut rcq, 1), buf, &[qp.handle], &mut [0]);
    assert_eq!(peer.cq.wait(1, T).unwrap()[0].status, WcStatus::Success);
}

/// Save on host A with receives posted on an SRQ that two QPs share, some
/// taken and completed, restore on host B: the SRQ hands out the rest in
/// order, the peers are never told and never see an error.
#[test]
fn srq_with_posted_receives_is_saved_and_restored_on_another_host() {
    let bed = Bed::new("pvsrqmv", 3);
    let (gid, mut d, fd_b) = bed.movable_device();
    let pd = d.create_pd();
    let (buf, _, key) = d.create_mr(pd, 64 * SLOT);
    let scq = d.create_cq(128);
    let mut rcq = d.create_cq(128);
    let mut srq = d.create_srq(pd, 32, 2, 0);
    let mut qps = Vec::new();
    let mut peers = Vec::new();
    for i in 0..2u32 {
        let qp = d.try_create_qp_on_srq(pd, &scq, &rcq, srq.handle, 16, 1).unwrap();
        let peer = bed.peer_of(&mut d, &qp, gid, 10 + i, 20 + i);
        qps.push(qp);
        peers.push(peer);
    }
    let handles: Vec<u32> = qps.iter().map(|q| q.handle).collect();
    for i in 0..30 {
        d.put_srq_recv(&mut srq, i, &slot_sges(buf, key, i));
    }
    d.doorbell(UAR_SRQ_OFFSET, UAR_SRQ_RECV | srq.handle);
    let mut next = [0u64; 2];
    for m in 0..5 {
        send_from(&peers[0], 0, m);
        send_from(&peers[1], 1, m);
    }
    let mut got = d.wait_cqes(&mut rcq, 10);
    check_receives(&d, &got, buf, &handles, &mut next);

    d.dev.lock().unwrap().pause();
    let section = d.dev.lock().unwrap().save().expect("save");
    let q = d.query();
    assert_eq!(q["srqs"][0]["outstanding"], 20, "{q}");
    bed.move_gid(gid, 0, 2);
    // The peers keep sending while the VM is away: RNR NAKs, retries.
    for m in 5..8 {
        send_from(&peers[0], 0, m);
        send_from(&peers[1], 1, m);
    }
    d.replace_device(&bed.nics[2].sock, gid, fd_b);
    d.dev.lock().unwrap().restore(&section).expect("restore");
    let q2 = d.query();
    assert_eq!(q2["srqs"], q["srqs"], "the SRQ as it was");
    assert_eq!(q2["qps"][0]["qpn"], q["qps"][0]["qpn"]);
    d.dev.lock().unwrap().resume();

    for m in 8..15 {
        send_from(&peers[0], 0, m);
        send_from(&peers[1], 1, m);
    }
    let rest = d.wait_cqes(&mut rcq, 20);
    check_receives(&d, &rest, buf, &handles, &mut next);
    assert_eq!(next, [15, 15]);
    got.extend(rest);
    let ids: Vec<u64> = got.iter().map(|c| c.wr_id).collect();
    assert_eq!(ids, (0..30).collect::<Vec<_>>(), "the SRQ hands out its receives in order, before and after the move");
    // A receive posted after the move is used too.
    d.post_srq_recv(&mut srq, 40, &slot_sges(buf, key, 40));
    send_from(&peers[1], 1, 15);
    check_receives(&d, &d.wait_cqes(&mut rcq, 1), buf, &handles, &mut next);
    for p in &peers {
        let w = p.cq.wait(if p.qp.qpn == peers[1].qp.qpn { 16 } else { 15 }, T).unwrap();
        assert!(w.iter().all(|w| w.status == WcStatus::Success), "the peer never sees an error: {w:?}");
        assert_eq!(p.qp.state().unwrap(), verbs::QpState::Rts);
    }
}

/// With bus mastering off the device touches no guest memory: commands
/// fail with EPERM and write no response, doorbells are refused, an
/// incoming message waits at the peer (RNR NAKs) and no completion is
/// written; turned on again, everything continues.
#[test]
fn without_bus_mastering_the_device_leaves_guest_memory_alone() {
    let bed = Bed::new("pvbm", 2);
    let (gid, mut d) = bed.device();
    let pd = d.create_pd();
    let (buf, _, key) = d.create_mr(pd, 64 * SLOT);
    let scq = d.create_cq(64);
    let mut rcq = d.create_cq(64);
    let mut srq = d.create_srq(pd, 16, 2, 0);
    let qp = d.try_create_qp_on_srq(pd, &scq, &rcq, srq.handle, 16, 1).unwrap();
    let peer = bed.peer_of(&mut d, &qp, gid, 1, 2);
    d.post_srq_recv(&mut srq, 0, &slot_sges(buf, key, 0));
    let mut next = [0u64];
    send_from(&peer, 0, 0);
    check_receives(&d, &d.wait_cqes(&mut rcq, 1), buf, &[qp.handle], &mut next);
    assert_eq!(peer.cq.wait(1, T).unwrap()[0].status, WcStatus::Success);

    d.post_srq_recv(&mut srq, 1, &slot_sges(buf, key, 1));
    d.bus_master(false);
    assert_eq!((d.query()["bus_master"].as_bool(), d.query()["paused"].as_bool()), (Some(false), Some(true)));
    let slot_before = d.get_bytes(buf + SLOT, SLOT as usize);
    let ring_before = d.get_bytes(rcq.base, 4096 * 2);
    send_from(&peer, 0, 1);
    // A command: ERR, no response.
    let (err, resp) = d.cmd_raw(&CmdQuerySrq { hdr: Drv::hdr(CMD_QUERY_SRQ), srq_handle: srq.handle, reserved: [0; 4] });
    assert_eq!(err, EPERM);
    assert!(resp.iter().all(|b| *b == 0), "no response written");
    // Doorbells: refused, nothing read or written.
    d.put_srq_recv(&mut srq, 2, &slot_sges(buf, key, 2));
    let bad = d.query()["counters"]["bad_doorbells"].as_u64().unwrap();
    d.doorbell(UAR_SRQ_OFFSET, UAR_SRQ_RECV | srq.handle);
    d.doorbell(UAR_CQ_OFFSET, UAR_CQ_POLL | rcq.handle);
    assert_eq!(d.rd(REG_ERR), EPERM);
    assert_eq!(d.query()["counters"]["bad_doorbells"].as_u64().unwrap(), bad + 2);
    std::thread::sleep(Duration::from_millis(500));
    let head: u32 = d.get(srq.base + RING_STATE_RX_CONS_HEAD);
    assert_eq!(head, 2, "the new receive was not read");
    assert!(d.get_bytes(buf + SLOT, SLOT as usize) == slot_before, "the message did not reach guest memory");
    assert!(d.get_bytes(rcq.base, 4096 * 2) == ring_before, "no completion written");
    let mut w = [verbs::Wc::default(); 1];
    assert_eq!(peer.cq.poll(&mut w).unwrap(), 0, "the peer's SEND waits");

    d.bus_master(true);
    check_receives(&d, &d.wait_cqes(&mut rcq, 1), buf, &[qp.handle], &mut next);
    d.doorbell(UAR_SRQ_OFFSET, UAR_SRQ_RECV | srq.handle);
    send_from(&peer, 0, 2);
    check_receives(&d, &d.wait_cqes(&mut rcq, 1), buf, &[qp.handle], &mut next);
    let w = peer.cq.wait(2, T).unwrap();
    assert!(w.iter().all(|w| w.status == WcStatus::Success), "the peer never sees an error: {w:?}");
    let q: CmdQuerySrqResp = d.cmd(CmdQuerySrq { hdr: Drv::hdr(CMD_QUERY_SRQ), srq_handle: srq.handle, reserved: [0; 4] }).unwrap();
    assert_eq!(q.attrs.max_wr, 16);
}
