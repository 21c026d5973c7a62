//! Every operation and error path between two testbed hosts, each running a
//! real rnicd process; data verified byte for byte.
mod common;
use common::*;
use std::time::Duration;
use verbs::*;

#[test]
fn every_operation_byte_exact() {
    let bed = Bed::new("rnops", 2);
    let o = ConnectOpts { mtu: Mtu::M1024, ..Default::default() };
    let (a, b) = pair(&bed, 0, 1, o);
    let data = pattern(1, 3 << 20);
    a.buf.write(0, &data);

    // RDMA WRITE of a multi-packet message, then READ it back elsewhere.
    a.qp.post_send(&[SendWr::write(1, &[a.mr.sge(0, 3 << 20)], b.mr.addr + 4096, b.mr.rkey)]).unwrap();
    let w = ok(&a.scq);
    assert_eq!((w.wr_id, w.opcode, w.byte_len), (1, WcOpcode::RdmaWrite, 3 << 20));
    assert_eq!(b.buf.read(4096, 3 << 20), data);
    a.qp.post_send(&[SendWr::read(2, &[a.mr.sge(4 << 20, 3 << 20)], b.mr.addr + 4096, b.mr.rkey)]).unwrap();
    let w = ok(&a.scq);
    assert_eq!((w.wr_id, w.opcode, w.byte_len), (2, WcOpcode::RdmaRead, 3 << 20));
    assert_eq!(a.buf.read(4 << 20, 3 << 20), data);

    // SEND with scatter/gather on both sides, with immediate.
    b.qp.post_recv(&[RecvWr { wr_id: 10, sg_list: &[b.mr.sge(100, 700), b.mr.sge(5000, 5000)] }]).unwrap();
    a.qp.post_send(&[SendWr::send(3, &[a.mr.sge(10, 3000), a.mr.sge(20_000, 2500)]).with_imm(0xdeadbeef)]).unwrap();
    let w = ok(&b.rcq);
    assert_eq!((w.wr_id, w.opcode, w.byte_len, w.imm_data), (10, WcOpcode::Recv, 5500, 0xdeadbeef));
    assert!(w.wc_flags & wc_flags::WITH_IMM != 0);
    assert_eq!(w.src_qp, a.qp.qpn);
    let mut want = data[10..3010].to_vec();
    want.extend_from_slice(&data[20_000..22_500]);
    let mut got = b.buf.read(100, 700);
    got.extend(b.buf.read(5000, 4800));
    assert_eq!(got, want);
    ok(&a.scq);

    // Inline SEND, zero-length SEND.
    b.qp.post_recv(&[RecvWr { wr_id: 11, sg_list: &[b.mr.sge(7 << 20, 4096)] }, RecvWr { wr_id: 12, sg_list: &[b.mr.sge(7 << 20, 16)] }])
        .unwrap();
    let inl = pattern(7, 200);
    a.qp.post_send(&[SendWr::send(4, &[]).with_inline(&inl), SendWr::send(5, &[])]).unwrap();
    let ws = b.rcq.wait(2, T).unwrap();
    assert_eq!((ws[0].wr_id, ws[0].byte_len, ws[0].status), (11, 200, WcStatus::Success));
    assert_eq!((ws[1].wr_id, ws[1].byte_len, ws[1].status), (12, 0, WcStatus::Success));
    assert_eq!(b.buf.read(7 << 20, 200), inl);
    assert_eq!(a.scq.wait(2, T).unwrap().iter().map(|w| w.wr_id).collect::<Vec<_>>(), vec![4, 5]);

    // WRITE with immediate consumes a RECV and reports the length.
    b.qp.post_recv(&[RecvWr { wr_id: 13, sg_list: &[] }]).unwrap();
    a.qp.post_send(&[SendWr::write(6, &[a.mr.sge(0, 10_000)], b.mr.addr + (6 << 20), b.mr.rkey).with_imm(77)]).unwrap();
    let w = ok(&b.rcq);
    assert_eq!((w.wr_id, w.opcode, w.byte_len, w.imm_data), (13, WcOpcode::RecvRdmaWithImm, 10_000, 77));
    assert_eq!(b.buf.read(6 << 20, 10_000), data[..10_000]);
    ok(&a.scq);

    // Unsignaled WRs: only the signaled one completes, all take effect.
    let mut wrs = Vec::new();
    let sges: Vec<_> = (0..10).map(|i| [a.mr.sge(i * 1000, 1000)]).collect();
    for (i, s) in sges.iter().enumerate() {
        wrs.push(SendWr::write(100 + i as u64, s, b.mr.addr + (5 << 20) + i as u64 * 1000, b.mr.rkey).unsignaled());
    }
    wrs.push(SendWr::write(200, &sges[0], b.mr.addr + (5 << 20) + 20_000, b.mr.rkey));
    a.qp.post_send(&wrs).unwrap();
    let w = ok(&a.scq);
    assert_eq!(w.wr_id, 200);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(a.scq.poll(&mut [Wc::default(); 4]).unwrap(), 0);
    assert_eq!(b.buf.read(5 << 20, 10_000), data[..10_000]);

    // Atomics.
    b.buf.write_u64(64, 40);
    a.qp.post_send(&[
        SendWr::fetch_add(20, &[a.mr.sge((8 << 20) - 64, 8)], b.mr.addr + 64, b.mr.rkey, 2),
        SendWr::cmp_swap(21, &[a.mr.sge((8 << 20) - 56, 8)], b.mr.addr + 64, b.mr.rkey, 42, 1000),
        SendWr::cmp_swap(22, &[a.mr.sge((8 << 20) - 48, 8)], b.mr.addr + 64, b.mr.rkey, 42, 5),
    ])
    .unwrap();
    let ws = a.scq.wait(3, T).unwrap();
    assert!(ws.iter().all(|w| w.status == WcStatus::Success), "{ws:?}");
    assert_eq!(ws.iter().map(|w| w.opcode).collect::<Vec<_>>(), vec![WcOpcode::FetchAdd, WcOpcode::CompSwap, WcOpcode::CompSwap]);
    assert_eq!(a.buf.read_u64((8 << 20) - 64), 40);
    assert_eq!(a.buf.read_u64((8 << 20) - 56), 42);
    assert_eq!(a.buf.read_u64((8 << 20) - 48), 1000);
    assert_eq!(b.buf.read_u64(64), 1000);

    // Completion channel: armed CQ wakes the waiter.
    let ch = b.ctx.create_comp_channel().unwrap();
    let ncq = b.ctx.create_cq(16, Some(&ch)).unwrap();
    ncq.req_notify(false);
    assert!(!ch.get_cq_event(Some(Duration::from_millis(50))).unwrap());
    drop(ncq);

    // Closing a channel that a CQ still uses is legal (a context closed
    // with a CQ left over): the CQ keeps working and nothing counts as a
    // bad request.
    let bad = |c: &Context| c.stats().unwrap()["bad_client_requests"].as_u64().unwrap();
    let before = bad(&b.ctx);
    let ch = b.ctx.create_comp_channel().unwrap();
    let ncq = b.ctx.create_cq(16, Some(&ch)).unwrap();
    drop(ch);
    ncq.req_notify(false);
    assert_eq!(ncq.poll(&mut [Wc::default()]).unwrap(), 0);
    drop(ncq);
    assert_eq!(bad(&b.ctx), before);
}

#[test]
fn large_message_and_all_mtus() {
    let bed = Bed::new("rnbig", 2);
    for mtu in [Mtu::M256, Mtu::M4096, Mtu::M8192, Mtu::M32768] {
        let size = if mtu == Mtu::M256 { 4 << 20 } else { 64 << 20 };
        let (a, b) = pair_sized(&bed, 0, 1, ConnectOpts { mtu, ..Default::default() }, size, 16);
        let data = pattern(mtu.bytes() as u64, size);
        a.buf.write(0, &data);
        a.qp.post_send(&[SendWr::write(1, &[a.mr.sge(0, size)], b.mr.addr, b.mr.rkey)]).unwrap();
        let w = one(&a.scq);
        assert_eq!(w.status, WcStatus::Success, "{w:?} at {mtu:?}\nA {}\nB {}", a.ctx.stats().unwrap(), b.ctx.stats().unwrap());
        assert!(b.buf.read(0, size) == data, "WRITE data differs at mtu {mtu:?}");
        a.buf.fill(0);
        a.qp.post_send(&[SendWr::read(2, &[a.mr.sge(0, size)], b.mr.addr, b.mr.rkey)]).unwrap();
        let w = one(&a.scq);
        assert_eq!(w.status, WcStatus::Success, "{w:?} at {mtu:?}\nA {}\nB {}", a.ctx.stats().unwrap(), b.ctx.stats().unwrap());
        assert!(a.buf.read(0, size) == data, "READ data differs at mtu {mtu:?}");
    }
}

/// 1 GiB, the largest message: one WRITE and one SEND (slow in debug builds).
#[test]
fn one_gib_message() {
    let bed = Bed::new("rngib", 2);
    let size = 1usize << 30;
    let (a, b) = pair_sized(&bed, 0, 1, ConnectOpts { mtu: Mtu::M32768, ..Default::default() }, size, 4);
    for i in 0..(size >> 20) {
        a.buf.write(i << 20, &pattern(i as u64, 1 << 20));
    }
    a.qp.post_send(&[SendWr::write(1, &[a.mr.sge(0, size)], b.mr.addr, b.mr.rkey)]).unwrap();
    let w = ok(&a.scq);
    assert_eq!(w.byte_len as usize, size);
    for i in (0..(size >> 20)).step_by(37) {
        assert!(b.buf.read(i << 20, 1 << 20) == pattern(i as u64, 1 << 20), "MiB {i} differs");
    }
    b.buf.fill(0);
    b.qp.post_recv(&[RecvWr { wr_id: 1, sg_list: &[b.mr.sge(0, size)] }]).unwrap();
    a.qp.post_send(&[SendWr::send(2, &[a.mr.sge(0, size)])]).unwrap();
    let w = ok(&b.rcq);
    assert_eq!(w.byte_len as usize, size);
    ok(&a.scq);
    for i in (0..(size >> 20)).step_by(29) {
        assert!(b.buf.read(i << 20, 1 << 20) == pattern(i as u64, 1 << 20), "MiB {i} differs");
    }
}

fn expect_flushed(cq: &Cq, n: usize) {
    let ws = cq.wait(n, T).unwrap();
    assert!(ws.iter().all(|w| w.status == WcStatus::WrFlushErr), "{ws:?}");
}

#[test]
fn remote_access_errors() {
    let bed = Bed::new("rnacc", 2);
    let o = ConnectOpts { mtu: Mtu::M1024, ..Default::default() };

    // Bad rkey: requester REM_ACCESS_ERR, following WRs flushed, both QPs in ERR.
    let (a, b) = pair(&bed, 0, 1, o);
    a.qp.post_send(&[
        SendWr::write(1, &[a.mr.sge(0, 100)], b.mr.addr, b.mr.rkey ^ 0x5a5a),
        SendWr::write(2, &[a.mr.sge(0, 100)], b.mr.addr, b.mr.rkey),
    ])
    .unwrap();
    assert_eq!(one(&a.scq).status, WcStatus::RemAccessErr);
    expect_flushed(&a.scq, 1);
    assert_eq!(a.qp.state().unwrap(), QpState::Err);
    assert_eq!(b.qp.state().unwrap(), QpState::Err);
    // Posting to a QP in ERR completes with flush errors.
    b.qp.post_recv(&[RecvWr { wr_id: 5, sg_list: &[] }]).unwrap();
    expect_flushed(&b.rcq, 1);

    // Out of bounds WRITE, READ and atomic.
    for (i, kind) in ["write", "read", "atomic"].iter().enumerate() {
        let (a, b) = pair(&bed, 0, 1, o);
        let end = b.mr.addr + b.mr.len as u64;
        let sg = [a.mr.sge(0, 64)];
        let sg8 = [a.mr.sge(0, 8)];
        let wr = match i {
            0 => SendWr::write(1, &sg, end - 32, b.mr.rkey),
            1 => SendWr::read(1, &sg, end - 32, b.mr.rkey),
            _ => SendWr::fetch_add(1, &sg8, end, b.mr.rkey, 1),
        };
        a.qp.post_send(&[wr]).unwrap();
        assert_eq!(one(&a.scq).status, WcStatus::RemAccessErr, "{kind}");
        assert_eq!(b.qp.state().unwrap(), QpState::Err, "{kind}");
    }

    // Missing permissions: a region registered for local access only.
    for i in 0..3 {
        let (a, b) = pair(&bed, 0, 1, o);
        let lbuf = MemBuf::new(4096).unwrap();
        let perm = [
            access::LOCAL_WRITE | access::REMOTE_READ,
            access::LOCAL_WRITE | access::REMOTE_WRITE,
            access::LOCAL_WRITE | access::REMOTE_WRITE,
        ][i];
        let lmr = b.pd.reg_mr(&lbuf, 0, 4096, perm).unwrap();
        let sg = [a.mr.sge(0, 64)];
        let sg8 = [a.mr.sge(0, 8)];
        let wr = match i {
            0 => SendWr::write(1, &sg, lmr.addr, lmr.rkey),
            1 => SendWr::read(1, &sg, lmr.addr, lmr.rkey),
            _ => SendWr::cmp_swap(1, &sg8, lmr.addr, lmr.rkey, 0, 1),
        };
        a.qp.post_send(&[wr]).unwrap();
        assert_eq!(one(&a.scq).status, WcStatus::RemAccessErr, "case {i}");
        assert_eq!(lbuf.read_u64(0), 0, "memory must be untouched");
    }

    // A region of another PD is not reachable through this QP.
    let (a, b) = pair(&bed, 0, 1, o);
    let other_pd = b.ctx.alloc_pd().unwrap();
    let obuf = MemBuf::new(4096).unwrap();
    let omr = other_pd.reg_mr(&obuf, 0, 4096, access::ALL).unwrap();
    a.qp.post_send(&[SendWr::write(1, &[a.mr.sge(0, 64)], omr.addr, omr.rkey)]).unwrap();
    assert_eq!(one(&a.scq).status, WcStatus::RemAccessErr);
}

#[test]
fn local_and_length_errors() {
    let bed = Bed::new("rnloc", 2);
    let o = ConnectOpts { mtu: Mtu::M1024, ..Default::default() };
    // Bad lkey: local protection error, QP to ERR.
    let (a, _b) = pair(&bed, 0, 1, o);
    a.qp.post_send(&[SendWr::write(1, &[Sge { addr: a.mr.addr, length: 10, lkey: a.mr.lkey ^ 1 }], 0, 0)]).unwrap();
    assert_eq!(one(&a.scq).status, WcStatus::LocProtErr);
    assert_eq!(a.qp.state().unwrap(), QpState::Err);

    // Receive buffer too small: responder LOC_LEN_ERR, requester REM_INV_REQ_ERR.
    let (a, b) = pair(&bed, 0, 1, o);
    b.qp.post_recv(&[RecvWr { wr_id: 1, sg_list: &[b.mr.sge(0, 100)] }, RecvWr { wr_id: 2, sg_list: &[b.mr.sge(0, 100)] }]).unwrap();
    a.qp.post_send(&[SendWr::send(1, &[a.mr.sge(0, 3000)])]).unwrap();
    assert_eq!(one(&a.scq).status, WcStatus::RemInvReqErr);
    let w = one(&b.rcq);
    assert_eq!((w.wr_id, w.status), (1, WcStatus::LocLenErr));
    expect_flushed(&b.rcq, 1);

    // READ into a local region without LOCAL_WRITE.
    let (a, b) = pair(&bed, 0, 1, o);
    let rbuf = MemBuf::new(4096).unwrap();
    let rmr = a.pd.reg_mr(&rbuf, 0, 4096, access::REMOTE_READ).unwrap();
    a.qp.post_send(&[SendWr::read(1, &[rmr.sge(0, 64)], b.mr.addr, b.mr.rkey)]).unwrap();
    assert_eq!(one(&a.scq).status, WcStatus::LocProtErr);
}

#[test]
fn rnr_retry_until_receive_posted() {
    let bed = Bed::new("rnrnr", 2);
    let o = ConnectOpts { mtu: Mtu::M1024, min_rnr_timer: 14, rnr_retry: 7, ..Default::default() };
    let (a, b) = pair(&bed, 0, 1, o);
    let data = pattern(3, 5000);
    a.buf.write(0, &data);
    a.qp.post_send(&[
        SendWr::send(1, &[a.mr.sge(0, 5000)]),
        SendWr::write(2, &[a.mr.sge(0, 10)], b.mr.addr + 100_000, b.mr.rkey).with_imm(9),
    ])
    .unwrap();
    // Wait for the NAKs themselves rather than a fixed time: on a loaded
    // machine 300 ms could pass with only a few RNR periods served.
    let start = std::time::Instant::now();
    loop {
        let st = b.ctx.stats().unwrap();
        if st["rnr_naks_sent"].as_u64().unwrap() > 10 {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "the responder never sent 10 RNR NAKs: {st}");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(a.scq.poll(&mut [Wc::default(); 2]).unwrap(), 0, "nothing completes without a RECV");
    b.qp.post_recv(&[RecvWr { wr_id: 7, sg_list: &[b.mr.sge(0, 8192)] }, RecvWr { wr_id: 8, sg_list: &[] }]).unwrap();
    let ws = a.scq.wait(2, T).unwrap();
    assert!(ws.iter().all(|w| w.status == WcStatus::Success), "{ws:?}");
    let ws = b.rcq.wait(2, T).unwrap();
    assert_eq!((ws[0].wr_id, ws[0].byte_len), (7, 5000));
    assert_eq!((ws[1].wr_id, ws[1].imm_data, ws[1].opcode), (8, 9, WcOpcode::RecvRdmaWithImm));
    assert_eq!(b.buf.read(0, 5000), data);
    assert_eq!(a.qp.state().unwrap(), QpState::Rts);

    // With a finite rnr_retry the requester gives up.
    let (a, _b) = pair(&bed, 0, 1, ConnectOpts { rnr_retry: 2, min_rnr_timer: 1, ..o });
    a.qp.post_send(&[SendWr::send(1, &[a.mr.sge(0, 10)]), SendWr::send(2, &[a.mr.sge(0, 10)])]).unwrap();
    assert_eq!(one(&a.scq).status, WcStatus::RnrRetryExcErr);
    expect_flushed(&a.scq, 1);
    assert_eq!(a.qp.state().unwrap(), QpState::Err);
}

#[test]
fn vanished_peer_drives_qp_to_error() {
    let mut bed = Bed::new("rngone", 2);
    let o = ConnectOpts { mtu: Mtu::M1024, timeout: 10, retry_cnt: 3, ..Default::default() };
    let (a, b) = pair(&bed, 0, 1, o);
    a.qp.post_send(&[SendWr::write(1, &[a.mr.sge(0, 100)], b.mr.addr, b.mr.rkey)]).unwrap();
    ok(&a.scq);
    drop(b);
    bed.kill(1);
    a.qp.post_send(&[
        SendWr::write(2, &[a.mr.sge(0, 100_000)], 0x1000, 1),
        SendWr::read(3, &[a.mr.sge(0, 100)], 0x1000, 1),
        SendWr::send(4, &[a.mr.sge(0, 100)]),
    ])
    .unwrap();
    let w = one(&a.scq);
    assert_eq!((w.wr_id, w.status), (2, WcStatus::RetryExcErr));
    expect_flushed(&a.scq, 2);
    assert_eq!(a.qp.state().unwrap(), QpState::Err);
    let st = a.ctx.stats().unwrap();
    assert!(st["timeouts"].as_u64().unwrap() >= 4, "{st}");
}

/// A send queue's slot stays taken until its WR completes, as on
/// hardware, not only until rnicd takes the WQE from the ring: with the
/// peer's rnicd stopped (no ACKs), a queue 4 deep takes 4 WRITEs, and once
/// rnicd has taken all of them from the ring a fifth is still refused as
/// full (the drop-in's ENOMEM). The ACKs' completions free the slots.
#[test]
fn a_send_slot_stays_taken_until_its_wr_completes() {
    const DEPTH: u32 = 4;
    let bed = Bed::new("rndepth", 2);
    let o = ConnectOpts { timeout: 18, ..Default::default() };
    let (a, b) = pair_sized(&bed, 0, 1, o, 1 << 16, DEPTH);
    let sge = [a.mr.sge(0, 64)];
    let write = |i: u64| SendOp::Wr(SendWr::write(i, &sge, b.mr.addr, b.mr.rkey));
    let stopped = Stopped::new(&bed, 1);
    let ring = a.qp.send_room();
    for i in 0..DEPTH as u64 {
        a.qp.try_post_send(&[write(i)], false).unwrap();
    }
    reaches(|| u64::from(a.qp.send_room() == ring), 1, "rnicd took the WQEs from the ring");
    let e = a.qp.try_post_send(&[write(9)], false).expect_err("the queue holds 4 WRs not yet complete");
    assert!(e.full && e.posted == 0, "{e:?}");
    drop(stopped);
    let done: Vec<u64> = a.scq.wait(DEPTH as usize, T).unwrap().iter().map(|w| w.wr_id).collect();
    assert_eq!(done, (0..DEPTH as u64).collect::<Vec<_>>());
    let more: Vec<SendOp> = (10..10 + DEPTH as u64).map(write).collect();
    a.qp.try_post_send(&more, true).expect("the completions freed the queue");
    assert_eq!(a.scq.wait(DEPTH as usize, T).unwrap().len(), DEPTH as usize);
}

/// A stopped rnicd (SIGSTOP: alive, answering nothing): a control request
/// fails once its timeout passes, saying so, and the connection closes;
/// later requests fail at once, and dropping the objects does not wait.
/// After SIGCONT, a new connection is served as before.
#[test]
fn a_stopped_rnicd_fails_requests_after_the_timeout() {
    let bed = Bed::new("rnstop", 1);
    let e = End::new(bed.ctx(0), 4096, 4);
    e.ctx.set_call_timeout(Duration::from_millis(500)).unwrap();
    let stopped = Stopped::new(&bed, 0);
    let t = std::time::Instant::now();
    let err = e.ctx.query_device().map(|_| ()).expect_err("a stopped rnicd answers nothing");
    assert!(format!("{err:#}").contains("did not answer within 500ms"), "{err:#}");
    assert!(t.elapsed() < T, "failed only after {:?}", t.elapsed());
    let err = e.ctx.create_cq(4, None).map(|_| ()).expect_err("the connection is closed");
    assert!(format!("{err:#}").contains("closed"), "{err:#}");
    drop(e);
    assert!(t.elapsed() < T, "the objects' drops waited for rnicd");
    drop(stopped);
    End::new(bed.ctx(0), 4096, 4).ctx.query_device().unwrap();
}

/// Host `i`'s rnicd stopped (SIGSTOP) until this is dropped, also when the
/// test fails: a stopped rnicd would hold the objects' drops for their
/// timeout.
struct Stopped(nix::unistd::Pid);

impl Stopped {
    fn new(bed: &Bed, i: usize) -> Stopped {
        let pid = nix::unistd::Pid::from_raw(bed.nics[i].pid().unwrap() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
        // Stopped once the kernel says so (state T), not when the signal is sent.
        let state = || std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap().rsplit(") ").next().unwrap().starts_with('T');
        reaches(|| u64::from(state()), 1, "rnicd stopped");
        Stopped(pid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(self.0, nix::sys::signal::Signal::SIGCONT);
    }
}

#[test]
fn qp_state_machine_rules() {
    let bed = Bed::new("rnfsm", 1);
    let e = End::new(bed.ctx(0), 4096, 4);
    let a = QpAttr { qp_state: QpState::Rts, ..Default::default() };
    assert!(e.qp.modify(&a, mask::STATE).is_err(), "RESET -> RTS is not allowed");
    let a = QpAttr { qp_state: QpState::Init, ..Default::default() };
    assert!(e.qp.modify(&a, mask::STATE).is_err(), "INIT needs PKEY_INDEX|PORT|ACCESS_FLAGS");
    e.qp.modify(&a, mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::ACCESS_FLAGS).unwrap();
    assert_eq!(e.qp.state().unwrap(), QpState::Init);
    let a = QpAttr { qp_state: QpState::Rtr, ..Default::default() };
    assert!(e.qp.modify(&a, mask::STATE | mask::AV).is_err(), "RTR needs more attributes");
    e.qp.modify(&QpAttr { qp_state: QpState::Err, ..Default::default() }, mask::STATE).unwrap();
    e.qp.modify(&QpAttr { qp_state: QpState::Reset, ..Default::default() }, mask::STATE).unwrap();
    assert_eq!(e.qp.state().unwrap(), QpState::Reset);
    // SQD and back.
    let peer = End::new(bed.ctx(0), 4096, 4);
    let o = ConnectOpts::default();
    e.qp.connect(&peer.qp.endpoint(0), &o).unwrap();
    peer.qp.connect(&e.qp.endpoint(0), &o).unwrap();
    e.qp.modify(&QpAttr { qp_state: QpState::Sqd, ..Default::default() }, mask::STATE).unwrap();
    assert_eq!(e.qp.state().unwrap(), QpState::Sqd);
    e.qp.modify(&QpAttr { qp_state: QpState::Rts, ..Default::default() }, mask::STATE).unwrap();
    e.qp.post_send(&[SendWr::write(1, &[e.mr.sge(0, 8)], peer.mr.addr, peer.mr.rkey)]).unwrap();
    ok(&e.scq);
}

#[test]
fn dying_client_loses_only_its_resources() {
    let bed = Bed::new("rndie", 2);
    let o = ConnectOpts { mtu: Mtu::M1024, timeout: 10, retry_cnt: 2, ..Default::default() };
    let (a, b) = pair(&bed, 0, 1, o);
    let (c, d) = pair(&bed, 0, 1, o);
    // b's client connection goes away (all of its objects with it).
    let rkey = b.mr.rkey;
    let addr = b.mr.addr;
    drop(b);
    a.qp.post_send(&[SendWr::write(1, &[a.mr.sge(0, 100)], addr, rkey)]).unwrap();
    assert_eq!(one(&a.scq).status, WcStatus::RetryExcErr);
    // The other client of the same rnicd is unaffected.
    c.qp.post_send(&[SendWr::write(1, &[c.mr.sge(0, 100)], d.mr.addr, d.mr.rkey)]).unwrap();
    ok(&c.scq);
    let st = d.ctx.stats().unwrap();
    assert!(st["clients_gone"].as_u64().unwrap() >= 1, "{st}");
}

/// A client whose completion channel cannot take another event (a
/// blocking eventfd at its largest count): rnicd skips the signal instead
/// of waiting in the write, and serves every client on.
#[test]
fn a_full_blocking_channel_does_not_hold_rnicd() {
    let bed = Bed::new("rnfullch", 1);
    let ctx = bed.ctx(0);
    let ch = ctx.create_comp_channel().unwrap();
    // SAFETY: a write to the channel's own eventfd.
    let full = 0xffff_ffff_ffff_fffe_u64.to_ne_bytes();
    assert_eq!(unsafe { libc::write(ch.fd(), full.as_ptr().cast(), 8) }, 8);
    let cq = ctx.create_cq(16, Some(&ch)).unwrap();
    cq.req_notify(false);
    let pd = ctx.alloc_pd().unwrap();
    let qp = pd.create_qp(&QpInitAttr::new(&cq, &cq)).unwrap();
    qp.modify(&QpAttr { qp_state: QpState::Err, ..Default::default() }, mask::STATE).unwrap();
    qp.post_recv(&[RecvWr { wr_id: 9, sg_list: &[] }]).unwrap();
    // The flushed receive completes and would signal the channel.
    assert_eq!(one(&cq).status, WcStatus::WrFlushErr);
    // Another client connects and asks (from a thread: a held rnicd would
    // never answer its hello).
    let sock = bed.nics[0].sock.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(Context::open(Some(&sock)).and_then(|c| c.stats()).is_ok()));
    assert_eq!(rx.recv_timeout(Duration::from_secs(20)), Ok(true), "rnicd answers another client");
}

#[test]
fn hostile_packets_and_requests_are_counted_and_dropped() {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let bed = Bed::new("rnhost", 2);
    let target = bed.nics[1].addr;
    // Garbage datagrams at UDP 4791 from the other host.
    bed.tb
        .host(0)
        .in_netns(move || {
            let s = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
            for i in 0..500u32 {
                let mut junk = pattern(i as u64, (i as usize * 7) % 300);
                if i % 3 == 0 && junk.len() > 12 {
                    junk[0] = 0x04; // plausible opcode, bad ICRC
                }
                let _ = s.send_to(&junk, (target, 4791));
            }
        })
        .unwrap();
    // Garbage on the control socket.
    let raw = |bytes: &[u8], fds: &[i32]| -> String {
        let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) };
        let sock = unsafe { OwnedFd::from_raw_fd(fd) };
        let ua = nix::sys::socket::UnixAddr::new(&bed.nics[1].sock).unwrap();
        nix::sys::socket::connect(sock.as_raw_fd(), &ua).unwrap();
        let iov = [std::io::IoSlice::new(bytes)];
        let cm = [nix::sys::socket::ControlMessage::ScmRights(fds)];
        nix::sys::socket::sendmsg::<()>(
            sock.as_raw_fd(),
            &iov,
            if fds.is_empty() { &[] } else { &cm },
            nix::sys::socket::MsgFlags::empty(),
            None,
        )
        .unwrap();
        let mut buf = vec![0u8; 65536];
        let n = nix::sys::socket::recv(sock.as_raw_fd(), &mut buf, nix::sys::socket::MsgFlags::empty()).unwrap_or(0);
        String::from_utf8_lossy(&buf[..n]).into_owned()
    };
    assert!(raw(b"\x00\x01garbage", &[]).contains("malformed"));
    assert!(raw(br#"{"Hello":{"version":99}}"#, &[]).contains("Err"));
    assert!(raw(br#"{"RegMr":{"pd":1,"iova":0,"len":4096,"access":15,"fd_offset":0}}"#, &[]).contains("Err"));
    // Objects only after the hello (they live in the namespace it joins);
    // questions any time.
    assert!(raw(br#""AllocPd""#, &[]).contains("Hello first"));
    assert!(raw(br#""QueryDevice""#, &[]).contains("Device"));
    // An unsealed memfd must be refused (it could shrink under rnicd).
    let mfd = unsafe { libc::memfd_create(c"x".as_ptr(), 0) };
    unsafe { libc::ftruncate(mfd, 4096) };
    let ctx = bed.ctx(1);
    let pd = ctx.alloc_pd().unwrap();
    drop(pd);
    assert!(raw(br#"{"RegMr":{"pd":2,"iova":0,"len":4096,"access":15,"fd_offset":0}}"#, &[mfd]).contains("Err"));
    assert!(raw(br#"{"CreateQp":{"pd":1,"send_cq":1,"recv_cq":1,"cap":{"max_send_wr":1,"max_recv_wr":1,"max_send_sge":1,"max_recv_sge":1,"max_inline_data":0},"sq_sig_all":false,"sq_slots":3,"rq_slots":0}}"#, &[]).contains("Err"));
    let st = ctx.stats().unwrap();
    assert!(st["rx_bad_icrc"].as_u64().unwrap() + st["rx_malformed"].as_u64().unwrap() >= 400, "{st}");
    assert!(st["bad_client_requests"].as_u64().unwrap() >= 4, "{st}");
    // And rnicd still works.
    let (a, b) = pair(&bed, 0, 1, ConnectOpts::default());
    a.buf.write(0, b"still alive");
    a.qp.post_send(&[SendWr::write(1, &[a.mr.sge(0, 11)], b.mr.addr, b.mr.rkey)]).unwrap();
    ok(&a.scq);
    assert_eq!(b.buf.read(0, 11), b"still alive");
}

/// A sender on host 0 connected to a receiver on host 1 whose one CQ
/// (send and receive) reports to a completion channel.
struct ChannelPair {
    a: End,
    ch: CompChannel,
    cq: Cq,
    qp: Qp,
    mr: Mr,
    _keep: (Pd, MemBuf),
}

fn channel_pair(bed: &Bed) -> ChannelPair {
    let a = End::new(bed.ctx(0), 1 << 20, 16);
    let cb = bed.ctx(1);
    let ch = cb.create_comp_channel().unwrap();
    let cq = cb.create_cq(64, Some(&ch)).unwrap();
    let pd = cb.alloc_pd().unwrap();
    let qp = pd.create_qp(&QpInitAttr::new(&cq, &cq)).unwrap();
    let buf = MemBuf::new(1 << 20).unwrap();
    let mr = pd.reg_mr(&buf, 0, buf.len(), access::ALL).unwrap();
    let o = ConnectOpts::default();
    a.qp.connect(&qp.endpoint(7), &ConnectOpts { sq_psn: 3, ..o }).unwrap();
    qp.connect(&a.qp.endpoint(3), &ConnectOpts { sq_psn: 7, ..o }).unwrap();
    ChannelPair { a, ch, cq, qp, mr, _keep: (pd, buf) }
}

#[test]
fn completion_channel_notifies_armed_cq() {
    let bed = Bed::new("rnchan", 2);
    let ChannelPair { a, ch, cq, qp, mr, _keep } = channel_pair(&bed);
    for i in 0..4 {
        qp.post_recv(&[RecvWr { wr_id: i, sg_list: &[mr.sge(0, 4096)] }]).unwrap();
    }
    // Armed for any completion: the next one fires the channel.
    cq.req_notify(false);
    assert!(!ch.get_cq_event(Some(Duration::from_millis(100))).unwrap(), "no event before a completion");
    a.qp.post_send(&[SendWr::send(1, &[a.mr.sge(0, 10)])]).unwrap();
    assert!(ch.get_cq_event(Some(T)).unwrap(), "armed CQ must notify");
    assert_eq!(cq.poll(&mut [Wc::default(); 4]).unwrap(), 1);
    // Not re-armed: no event.
    a.qp.post_send(&[SendWr::send(2, &[a.mr.sge(0, 10)])]).unwrap();
    ok(&a.scq);
    ok(&a.scq);
    assert!(!ch.get_cq_event(Some(Duration::from_millis(100))).unwrap(), "one event per arming");
    assert_eq!(cq.poll(&mut [Wc::default(); 4]).unwrap(), 1);
    // Solicited only: an unsolicited SEND does not fire, a solicited one does.
    cq.req_notify(true);
    a.qp.post_send(&[SendWr::send(3, &[a.mr.sge(0, 10)])]).unwrap();
    ok(&a.scq);
    assert!(!ch.get_cq_event(Some(Duration::from_millis(100))).unwrap(), "unsolicited must not fire");
    a.qp.post_send(&[SendWr::send(4, &[a.mr.sge(0, 10)]).with_flags(send_flags::SOLICITED)]).unwrap();
    assert!(ch.get_cq_event(Some(T)).unwrap(), "solicited must fire");
    assert_eq!(cq.poll(&mut [Wc::default(); 4]).unwrap(), 2);
    drop(qp);
}

/// A waiter on a completion channel (what a PVRDMA WAIT doorbell sleeps
/// on) ends a wait under way, and every wait after it, once interrupted,
/// however long its timeout; cleared, it waits for channel events again.
#[test]
fn an_interrupted_channel_waiter_stops_waiting() {
    let bed = Bed::new("rnwbrk", 2);
    let ChannelPair { a, ch, cq, qp, mr, _keep } = channel_pair(&bed);
    let waiter = std::sync::Arc::new(ch.waiter().unwrap());

    // A wait of an hour, under way, ends with the interruption.
    let (started_tx, started) = std::sync::mpsc::channel();
    let w = waiter.clone();
    let sleeper = std::thread::spawn(move || {
        started_tx.send(()).unwrap();
        w.wait(Duration::from_secs(3600)).unwrap()
    });
    started.recv().unwrap();
    std::thread::sleep(Duration::from_millis(50));
    waiter.interrupt();
    assert!(!sleeper.join().unwrap(), "an interrupted wait reports no channel event");
    assert!(!waiter.wait(Duration::from_secs(3600)).unwrap(), "waits end at once while interrupted");

    // Cleared: a wait times out, and a completion of an armed CQ wakes it.
    waiter.clear_interrupt();
    assert!(!waiter.is_interrupted());
    assert!(!waiter.wait(Duration::from_millis(20)).unwrap(), "nothing happened");
    qp.post_recv(&[RecvWr { wr_id: 1, sg_list: &[mr.sge(0, 4096)] }]).unwrap();
    cq.req_notify(false);
    a.qp.post_send(&[SendWr::send(1, &[a.mr.sge(0, 10)])]).unwrap();
    assert!(waiter.wait(T).unwrap(), "a completion wakes a cleared waiter");
    assert_eq!(cq.poll(&mut [Wc::default(); 4]).unwrap(), 1);
    drop(qp);
}
