//! Indirect keys, the key pool, cross-client aliases and the registration
//! cache (docs/mkeys.md), between two testbed hosts each running a real
//! rnicd process; data verified byte for byte.
mod common;
use common::*;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;
use verbs::mkeys::{AliasCache, KeyGrant, KeyPool};
use verbs::rcache::Rcache;
use verbs::*;

const RW: u32 = access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC;

/// A QP of `pd` connected to itself: binds run on it without touching the wire.
fn local_qp(ctx: &Context, pd: &Pd) -> (Qp, Cq) {
    let cq = ctx.create_cq(256, None).unwrap();
    let mut init = QpInitAttr::new(&cq, &cq);
    init.cap.max_send_wr = 128;
    let qp = pd.create_qp(&init).unwrap();
    qp.connect(&qp.endpoint(0), &ConnectOpts::default()).unwrap();
    (qp, cq)
}

#[test]
fn indirect_key_klm_bind_use_and_invalidate() {
    let bed = Bed::new("mkind", 2);
    let o = ConnectOpts { mtu: Mtu::M1024, ..Default::default() };
    let (a, b) = pair(&bed, 0, 1, o);
    // b binds a key to three separate ranges of its MR, seen contiguously at 0x1000_0000.
    let k = b.pd.create_indirect_key(4, None).unwrap();
    let ranges = [b.mr.sge(100_000, 5000), b.mr.sge(2 << 20, 3000), b.mr.sge(6 << 20, 10_000)];
    let iova = 0x1000_0000u64;
    b.qp.post_bind(1, k.key(), iova, RW, &ranges, true).unwrap();
    let w = ok(&b.scq);
    assert_eq!((w.wr_id, w.opcode), (1, WcOpcode::BindKey));

    // A WRITE across all three entries lands in each range in order.
    let data = pattern(3, 18_000);
    a.buf.write(0, &data);
    a.qp.post_send(&[SendWr::write(2, &[a.mr.sge(0, 18_000)], iova, k.key())]).unwrap();
    ok(&a.scq);
    assert_eq!(b.buf.read(100_000, 5000), data[..5000]);
    assert_eq!(b.buf.read(2 << 20, 3000), data[5000..8000]);
    assert_eq!(b.buf.read(6 << 20, 10_000), data[8000..]);
    // READ back a piece crossing the first boundary; an atomic inside one entry.
    a.qp.post_send(&[SendWr::read(3, &[a.mr.sge(1 << 20, 2000)], iova + 4000, k.key())]).unwrap();
    ok(&a.scq);
    assert_eq!(a.buf.read(1 << 20, 2000), data[4000..6000]);
    b.buf.write_u64(6 << 20, 5);
    a.qp.post_send(&[SendWr::fetch_add(4, &[a.mr.sge(2 << 20, 8)], iova + 8000, k.key(), 3)]).unwrap();
    ok(&a.scq);
    assert_eq!((a.buf.read_u64(2 << 20), b.buf.read_u64(6 << 20)), (5, 8));
    // The owner uses the key as an lkey too (a SEND gathering through it).
    a.qp.post_recv(&[RecvWr { wr_id: 5, sg_list: &[a.mr.sge(3 << 20, 18_000)] }]).unwrap();
    b.qp.post_send(&[SendWr::send(6, &[Sge { addr: iova, length: 18_000, lkey: k.key() }])]).unwrap();
    assert_eq!(ok(&a.rcq).byte_len, 18_000);
    ok(&b.scq);
    assert_eq!(a.buf.read(3 << 20, 5000), b.buf.read(100_000, 5000));

    // Outside the bound range: remote access error, nothing written.
    let before = b.buf.read(6 << 20, 10_000);
    a.qp.post_send(&[SendWr::write(7, &[a.mr.sge(0, 100)], iova + 17_950, k.key())]).unwrap();
    assert_eq!(one(&a.scq).status, WcStatus::RemAccessErr);
    assert_eq!(b.buf.read(6 << 20, 10_000), before);

    // Invalidated: refused on the wire (a fresh pair; the old one is in ERR).
    let (a, b) = pair(&bed, 0, 1, o);
    let k = b.pd.create_indirect_key(1, None).unwrap();
    b.qp.post_bind(1, k.key(), b.mr.addr, RW, &[b.mr.sge(0, 4096)], false).unwrap();
    b.qp.post_local_inv(2, k.key(), true).unwrap();
    let w = ok(&b.scq);
    assert_eq!((w.wr_id, w.opcode), (2, WcOpcode::LocalInv));
    a.qp.post_send(&[SendWr::write(3, &[a.mr.sge(0, 64)], b.mr.addr, k.key())]).unwrap();
    assert_eq!(one(&a.scq).status, WcStatus::RemAccessErr);
    // The namespace's counter: the first bind, then this bind and invalidation.
    let st = b.ctx.stats().unwrap();
    assert_eq!(st["key_binds"], 3);
}

#[test]
fn bad_binds_and_bad_control_requests() {
    let bed = Bed::new("mkbad", 1);
    let ctx = bed.ctx(0);
    let pd = ctx.alloc_pd().unwrap();
    let buf = MemBuf::new(1 << 20).unwrap();
    let mr = pd.reg_mr(&buf, 0, 1 << 20, RW).unwrap();
    let ro = pd.reg_mr(&buf, 0, 4096, access::LOCAL_WRITE | access::REMOTE_READ).unwrap();
    let k = pd.create_indirect_key(2, None).unwrap();
    let status = |ranges: &[Sge], key: u32, acc: u32| {
        let (qp, cq) = local_qp(&ctx, &pd);
        qp.post_bind(9, key, 0x5000, acc, ranges, true).unwrap();
        let w = one(&cq);
        (w.status, qp.state().unwrap())
    };
    // Outside the MR, an unknown MR, more access than the MR grants.
    assert_eq!(status(&[mr.sge((1 << 20) - 10, 11)], k.key(), RW), (WcStatus::LocProtErr, QpState::Err));
    assert_eq!(status(&[Sge { addr: mr.addr, length: 10, lkey: 0xdead }], k.key(), RW).0, WcStatus::LocProtErr);
    assert_eq!(status(&[ro.sge(0, 100)], k.key(), RW).0, WcStatus::LocProtErr);
    // A KLM list longer than the key takes, or than any key takes.
    let three = [mr.sge(0, 10), mr.sge(100, 10), mr.sge(200, 10)];
    assert_eq!(status(&three, k.key(), RW).0, WcStatus::LocLenErr);
    let many: Vec<Sge> = (0..25).map(|i| mr.sge(i * 16, 16)).collect();
    let k24 = pd.create_indirect_key(24, None).unwrap();
    assert_eq!(status(&many, k24.key(), RW).0, WcStatus::LocLenErr);
    assert_eq!(status(&many[..24], k24.key(), RW).0, WcStatus::Success);
    // A rebind from a client that does not own the key (same host, another connection).
    let other = bed.ctx(0);
    let opd = other.alloc_pd().unwrap();
    let obuf = MemBuf::new(4096).unwrap();
    let omr = opd.reg_mr(&obuf, 0, 4096, RW).unwrap();
    let (oqp, ocq) = local_qp(&other, &opd);
    oqp.post_bind(1, k.key(), 0, RW, &[omr.sge(0, 64)], true).unwrap();
    assert_eq!(one(&ocq).status, WcStatus::LocProtErr);
    // Binding through another client's MR is refused too.
    assert_eq!(status(&[omr.sge(0, 64)], k.key(), RW).0, WcStatus::LocProtErr);
    let st = ctx.stats().unwrap();
    assert!(st["key_bind_errors"].as_u64().unwrap() >= 7, "{st}");

    // Control path: clear errors.
    let e = pd.create_indirect_key(0, None).err().unwrap().to_string();
    assert!(e.contains("1..=24"), "{e}");
    assert!(pd.create_indirect_key(25, None).is_err());
    let e = pd.create_indirect_key(1, Some(mr.lkey)).err().unwrap().to_string();
    assert!(e.contains("already in use"), "{e}");
    let e = opd.create_alias(ctx.client_id(), k.key()).err().unwrap().to_string();
    assert!(e.contains("did not grant"), "{e}");
    k.grant(other.client_id()).unwrap();
    let e = opd.create_alias(ctx.client_id(), k.key()).err().unwrap().to_string();
    assert!(e.contains("not bound"), "{e}");
    let e = opd.create_alias(ctx.client_id(), 0x1234).err().unwrap().to_string();
    assert!(e.contains("has no key"), "{e}");
}

/// Messages in each `race`.
const N_MSGS: usize = 256;

/// Sets its flag when dropped, unwinding included.
struct SetOnDrop<'a>(&'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// Owner rebinds a key between two buffers A and B (same iova) while the
/// peer writes (or reads) through it: every message lands wholly in A or
/// wholly in B, or is refused with a remote access error when a rebind fell
/// inside it; never partly in each.
fn race(bed: &Bed, msg: usize, read: bool, pause: Duration) -> (usize, usize, usize) {
    let o = ConnectOpts { mtu: Mtu::M1024, ..Default::default() };
    const N: usize = N_MSGS;
    let (a, b) = pair_sized(bed, 0, 1, o, 2 * N * msg + 4096, 512);
    let (off_a, off_b) = (0usize, N * msg);
    let pool = KeyPool::new(&b.pd, 1, 1).unwrap();
    let iova = 0x7000_0000u64;
    let sge_of = |off: usize| Sge { addr: b.mr.addr + off as u64, length: (N * msg) as u32, lkey: b.mr.lkey };
    if read {
        b.buf.write(off_a, &vec![0xaa; N * msg]);
        b.buf.write(off_b, &vec![0xbb; N * msg]);
    } else {
        for i in 0..N {
            a.buf.write(i * msg, &pattern(i as u64, msg));
        }
    }
    let mut key = pool.get_at(&[sge_of(off_a)], iova, RW).unwrap();
    let rkey = key.key();
    // The first message completes before the first rebind: one that must
    // land whole whatever the machine's load, so a run in which every
    // other message met a rebind still shows the key works. After it,
    // every eighth message waits for a rebind, so the race happens on any
    // machine (at least N / 8 rebinds among the messages).
    let (stop, first_done, rebinds) = (AtomicBool::new(false), AtomicBool::new(false), AtomicUsize::new(0));
    let mut statuses = Vec::new();
    let wait_rebind = |seen: usize| {
        let t0 = std::time::Instant::now();
        while rebinds.load(Ordering::Acquire) == seen {
            assert!(t0.elapsed() < T, "no rebind");
            std::thread::sleep(Duration::from_micros(100));
        }
    };
    std::thread::scope(|s| {
        // Set however this closure ends (a failed wait panics): the
        // rebinder stops, and the scope's join returns.
        let _stop = SetOnDrop(&stop);
        s.spawn(|| {
            while !first_done.load(Ordering::Acquire) && !stop.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_micros(100));
            }
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                key.rebind_at(&[sge_of(if i % 2 == 0 { off_b } else { off_a })], iova, RW).unwrap();
                i += 1;
                rebinds.store(i, Ordering::Release);
                std::thread::sleep(pause);
            }
        });
        for i in 0..N {
            let sg = [a.mr.sge(i * msg, msg)];
            let at = iova + (i * msg) as u64;
            let wr = if read { SendWr::read(i as u64, &sg, at, rkey) } else { SendWr::write(i as u64, &sg, at, rkey) };
            a.qp.post_send(&[wr]).unwrap();
            if i == 0 {
                statuses.extend(a.scq.wait(1, T).unwrap().iter().map(|w| (w.wr_id as usize, w.status)));
                first_done.store(true, Ordering::Release);
            }
            if i % 8 == 7 {
                wait_rebind(rebinds.load(Ordering::Acquire));
            }
        }
        statuses.extend(a.scq.wait(N - 1, T).unwrap().iter().map(|w| (w.wr_id as usize, w.status)));
    });
    let binds = rebinds.into_inner();
    let (mut whole, mut refused) = (0, 0);
    for (i, st) in statuses {
        match st {
            WcStatus::Success => whole += 1,
            WcStatus::RemAccessErr => refused += 1,
            WcStatus::WrFlushErr => {}
            s => panic!("message {i}: {s:?}\nA {}\nB {}", a.ctx.stats().unwrap(), b.ctx.stats().unwrap()),
        }
        if read {
            let got = a.buf.read(i * msg, msg);
            if st == WcStatus::Success {
                assert!(got.iter().all(|&x| x == 0xaa) || got.iter().all(|&x| x == 0xbb), "READ {i} mixed A and B");
            }
        } else {
            let want = pattern(i as u64, msg);
            let chunks = |off: usize| {
                let got = b.buf.read(off + i * msg, msg);
                got.chunks(1024).zip(want.chunks(1024)).filter(|(g, w)| g == w).count()
            };
            let (in_a, in_b) = (chunks(off_a), chunks(off_b));
            assert!(in_a == 0 || in_b == 0, "WRITE {i} landed partly in A ({in_a} KiB) and partly in B ({in_b} KiB)");
            if st == WcStatus::Success {
                assert_eq!(in_a.max(in_b), msg.div_ceil(1024), "WRITE {i} completed but is not whole");
            }
        }
    }
    (whole, refused, binds)
}

#[test]
fn peer_write_and_read_racing_rebind() {
    let bed = Bed::new("mkrace", 2);
    // One-packet messages resolve the binding once: never refused.
    let (whole, refused, binds) = race(&bed, 1024, false, Duration::ZERO);
    assert_eq!((whole, refused), (256, 0));
    assert!(binds >= N_MSGS / 8, "{binds} rebinds");
    let (whole, refused, _) = race(&bed, 1024, true, Duration::ZERO);
    assert_eq!((whole, refused), (256, 0));
    // 16-packet messages: whole, or refused when a rebind fell inside
    // (rebinding every millisecond, so that most messages see none).
    for read in [false, true] {
        let (whole, refused, binds) = race(&bed, 16 << 10, read, Duration::from_millis(1));
        eprintln!("16 KiB {}: {whole} whole, {refused} refused, {binds} rebinds", if read { "READs" } else { "WRITEs" });
        assert!(whole > 0 && binds >= N_MSGS / 8, "{whole} whole, {binds} rebinds");
    }
}

/// Drops READ responses (RoCE packets over 200 bytes) from `from` arriving
/// at host `h` once about `bytes` bytes of them passed (an nft quota); ACKs
/// and NAKs always pass. `None` lets everything through again.
fn stall_after(bed: &Bed, h: usize, from: std::net::Ipv4Addr, bytes: Option<usize>) {
    let host = bed.tb.host(h);
    let _ = host.sh("nft delete table inet mkstall");
    if let Some(b) = bytes {
        host.sh(&format!(
            "nft add table inet mkstall && nft add chain inet mkstall in '{{ type filter hook input priority 0; }}' && \
             nft add rule inet mkstall in ip saddr {from} udp dport 4791 meta length gt 200 quota over {b} bytes drop"
        ))
        .unwrap();
    }
}

/// A READ whose responses stop after a few packets is resent from the
/// middle after the requester's timeout. Without a rebind in between, the
/// resent part comes from the same memory. With the key rebound in between,
/// the resent READ is not answered (the requester fails it after its
/// retries) and never returns data of the new binding after data of the
/// old one; the responder's QP stays usable.
#[test]
fn read_resent_after_rebind_is_not_answered_not_mixed() {
    // No GSO: the quota counts single response packets.
    let bed = Bed::with_args("mkrd", 2, &["--no-gso"]);
    const MSG: usize = 16 << 10;
    let iova = 0x6000_0000u64;
    let responder_addr = bed.nics[1].addr;
    for rebind in [false, true] {
        // Without a rebind the READ must outlive the stall, whose lifting
        // (an nft process) a loaded host can delay: 268 ms a try (timeout
        // 16) rather than 17 (12), which the rebind case keeps, where the
        // READ is to fail after its retries.
        let timeout = if rebind { 12 } else { 16 };
        let o = ConnectOpts { mtu: Mtu::M1024, timeout, retry_cnt: 7, ..Default::default() };
        let (a, b) = pair_sized(&bed, 0, 1, o, 4 * MSG, 64);
        b.buf.write(0, &vec![0xaa; MSG]);
        b.buf.write(MSG, &vec![0xbb; MSG]);
        let pool = KeyPool::new(&b.pd, 1, 1).unwrap();
        let mut key = pool.get_at(&[b.mr.sge(0, MSG)], iova, RW).unwrap();
        let dups = b.ctx.stats().unwrap()["dup_requests"].as_u64().unwrap_or(0);
        // About 4 of the 16 responses (1 KiB payload, about 1.07 KB each) pass.
        stall_after(&bed, 0, responder_addr, Some(4400));
        let sent = |c: &verbs::Context| c.stats().unwrap()["tx_packets"].as_u64().unwrap_or(0);
        let tx0 = sent(&b.ctx);
        a.qp.post_send(&[SendWr::read(1, &[a.mr.sge(0, MSG)], iova, key.key())]).unwrap();
        // The rebind must come after the responder answered the READ from
        // the old binding (its 16 responses left), however late a loaded
        // host gets to it; a fixed sleep let it rebind first.
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while sent(&b.ctx) < tx0 + (MSG / 1024) as u64 {
            assert!(std::time::Instant::now() < deadline, "the responder never answered the READ");
            std::thread::sleep(Duration::from_millis(1));
        }
        // The requester probes and resends from the first lost response;
        // until the stall is lifted its resent responses are lost too.
        if rebind {
            key.rebind_at(&[b.mr.sge(MSG, MSG)], iova, RW).unwrap();
        }
        stall_after(&bed, 0, responder_addr, None);
        let w = one(&a.scq);
        let got = a.buf.read(0, MSG);
        assert!(b.ctx.stats().unwrap()["dup_requests"].as_u64().unwrap_or(0) > dups, "the READ was resent");
        if rebind {
            assert_eq!(
                w.status,
                WcStatus::RetryExcErr,
                "a READ resent across a rebind is not answered\nA {}\nB {}",
                a.ctx.stats().unwrap(),
                b.ctx.stats().unwrap()
            );
            assert!(!got.contains(&0xbb), "the resent READ read the new binding after the old one ({w:?})");
            assert!(got[..1024].iter().all(|&x| x == 0xaa), "its first responses came from the old binding");
            assert_eq!(b.qp.state().unwrap(), QpState::Rts, "the responder's QP is not in error");
        } else {
            assert_eq!(w.status, WcStatus::Success);
            assert!(got.iter().all(|&x| x == 0xaa), "the resent part comes from the same binding");
        }
        drop(key);
    }
}

/// A second client of the same host ("DPU agent") reaches the owner's
/// memory through aliases cached by owner<<32|key; rebinding, revoking and
/// the owner's death make them stale, and stale aliases are never used.
#[test]
fn cross_client_aliases_and_staleness() {
    let bed = Bed::new("mkalias", 2);
    let o = ConnectOpts { mtu: Mtu::M1024, ..Default::default() };
    let (agent, peer) = pair(&bed, 0, 1, o);
    let owner = bed.ctx(0);
    let opd = owner.alloc_pd().unwrap();
    let obuf = MemBuf::new(1 << 20).unwrap();
    let omr = opd.reg_mr(&obuf, 0, 1 << 20, RW).unwrap();
    let data = pattern(9, 64 << 10);
    obuf.write(0, &data);
    let pool = KeyPool::new(&opd, 2, 1).unwrap();
    let mut k = pool.get(&[omr.sge(0, 256 << 10)], RW).unwrap();
    k.indirect().grant(agent.ctx.client_id()).unwrap();
    omr.grant(agent.ctx.client_id()).unwrap();

    let cache = AliasCache::new(&agent.pd).unwrap();
    let al = cache.get(owner.client_id(), k.key()).unwrap();
    assert!(std::sync::Arc::ptr_eq(&al, &cache.get(owner.client_id(), k.key()).unwrap()), "cached");
    assert_eq!((al.iova, al.len), (omr.addr, 256 << 10));
    // The agent WRITEs from and READs into the owner's memory.
    agent.qp.post_send(&[SendWr::write(1, &[al.sge(0, 64 << 10)], peer.mr.addr, peer.mr.rkey)]).unwrap();
    ok(&agent.scq);
    assert_eq!(peer.buf.read(0, 64 << 10), data);
    peer.buf.write(1 << 20, &pattern(10, 4096));
    agent.qp.post_send(&[SendWr::read(2, &[al.sge(128 << 10, 4096)], peer.mr.addr + (1 << 20), peer.mr.rkey)]).unwrap();
    ok(&agent.scq);
    assert_eq!(obuf.read(128 << 10, 4096), pattern(10, 4096));
    // An alias of the direct MR too.
    let direct = cache.get(owner.client_id(), omr.lkey).unwrap();
    assert!(direct.is_live().unwrap());

    // The owner rebinds: stale, refused at use (LOC_PROT_ERR, nothing sent).
    k.rebind(&[omr.sge(512 << 10, 4096)], RW).unwrap();
    assert!(!al.is_live().unwrap());
    peer.buf.write(0, &[0u8; 4096]);
    agent.qp.post_send(&[SendWr::write(3, &[al.sge(0, 4096)], peer.mr.addr, peer.mr.rkey)]).unwrap();
    assert_eq!(one(&agent.scq).status, WcStatus::LocProtErr);
    assert_eq!(peer.buf.read(0, 4096), vec![0u8; 4096]);
    // get_checked replaces it with a live one, for the new binding.
    let al2 = cache.get_checked(owner.client_id(), k.key()).unwrap();
    assert!(al2.is_live().unwrap() && al2.key != al.key);
    assert_eq!(al2.iova, omr.addr + (512 << 10));

    // Revoked: stale, and no new alias can be made.
    k.indirect().revoke(agent.ctx.client_id()).unwrap();
    assert!(!al2.is_live().unwrap());
    assert!(cache.get_checked(owner.client_id(), k.key()).is_err());

    // The owner dies: its MR alias turns stale, and a peer using the alias
    // as an rkey (the agent's PD is its QP's) gets a remote access error.
    let (agent2, peer2) = pair(&bed, 0, 1, o);
    omr.grant(agent2.ctx.client_id()).unwrap();
    let cache2 = AliasCache::new(&agent2.pd).unwrap();
    let al3 = cache2.get(owner.client_id(), omr.lkey).unwrap();
    peer2.qp.post_send(&[SendWr::write(1, &[peer2.mr.sge(0, 4096)], al3.iova, al3.key)]).unwrap();
    ok(&peer2.scq);
    assert!(al3.is_live().unwrap());
    drop(k);
    drop(pool);
    drop((omr, opd, direct));
    drop(owner);
    // rnicd tears the owner down when it reads the hang-up, later.
    reaches(|| al3.is_live().unwrap() as u64, 0, "the liveness of the alias of a gone owner's region");
    peer2.qp.post_send(&[SendWr::write(2, &[peer2.mr.sge(0, 4096)], al3.iova, al3.key)]).unwrap();
    assert_eq!(one(&peer2.scq).status, WcStatus::RemAccessErr);
    drop(al);
}

/// Anonymous memory of `len` bytes at `hint` (MAP_FIXED when given).
fn anon(len: usize, hint: Option<u64>) -> u64 {
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | if hint.is_some() { libc::MAP_FIXED } else { 0 };
    // SAFETY: fresh anonymous memory (MAP_FIXED only over our own unmapped range).
    let p = unsafe { libc::mmap(hint.unwrap_or(0) as *mut libc::c_void, len, libc::PROT_READ | libc::PROT_WRITE, flags, -1, 0) };
    assert_ne!(p, libc::MAP_FAILED);
    p as u64
}

fn peek(addr: u64, len: usize) -> Vec<u8> {
    // SAFETY: test memory we mapped.
    unsafe { std::slice::from_raw_parts(addr as *const u8, len).to_vec() }
}

/// The rcache: hits, merges, LRU eviction, and invalidation on munmap,
/// madvise(DONTNEED) and mremap. A buffer freed and mapped again at the
/// same address never receives data a peer sends to the old one.
#[test]
fn rcache_hits_merges_evicts_and_invalidates() {
    let bed = Bed::new("mkrc", 2);
    let o = ConnectOpts { mtu: Mtu::M1024, ..Default::default() };
    let (a, b) = pair(&bed, 0, 1, o);
    let rc = Rcache::new(&b.pd, RW, 4, 64 << 20).unwrap();
    const LEN: usize = 1 << 20;
    // A reservation of 4 MiB: the tests map and remap inside it only.
    let buf = anon(4 * LEN, None);
    // SAFETY: our mapping.
    unsafe { std::ptr::write_bytes(buf as *mut u8, 0x5a, LEN) };
    let r1 = rc.register(buf, LEN as u64).unwrap();
    assert_eq!(peek(buf, 16), vec![0x5a; 16], "content kept when moved");
    let data = pattern(1, 64 << 10);
    a.buf.write(0, &data);
    a.qp.post_send(&[SendWr::write(1, &[a.mr.sge(0, 64 << 10)], buf + 4096, r1.rkey)]).unwrap();
    ok(&a.scq);
    assert_eq!(peek(buf + 4096, 64 << 10), data);
    // Hit inside; a miss overlapping it merges into one region.
    let r2 = rc.register(buf + 8192, 1000).unwrap();
    assert_eq!((r2.lkey, rc.stats().hits), (r1.lkey, 1));
    let r3 = rc.register(buf + LEN as u64 - 4096, 8192).unwrap();
    let st = rc.stats();
    assert_eq!((st.misses, st.merges, st.regions), (2, 1, 1), "{st:?}");
    assert_eq!((r3.addr, r3.len), (buf, LEN as u64 + 4096));
    drop((r1, r2, r3));

    // munmap, then new memory at the same address: a miss with a new key;
    // the old key is refused and the new buffer receives nothing through it.
    let old_rkey = rc.register(buf, LEN as u64).unwrap().rkey;
    // SAFETY: our mapping.
    unsafe { libc::munmap(buf as *mut libc::c_void, LEN) };
    let again = anon(LEN, Some(buf));
    assert_eq!(again, buf);
    assert_eq!(peek(buf + 4096, 16), vec![0; 16]);
    let fresh = rc.register(buf, LEN as u64).unwrap();
    assert_ne!(fresh.rkey, old_rkey);
    assert!(rc.stats().invalidations >= 1);
    a.qp.post_send(&[SendWr::write(2, &[a.mr.sge(0, 64 << 10)], buf + 4096, old_rkey)]).unwrap();
    assert_eq!(one(&a.scq).status, WcStatus::RemAccessErr);
    assert_eq!(peek(buf, LEN), vec![0; LEN], "the reused buffer received data meant for the old one");
    // The new key works (new QPs: the old ones are in ERR).
    let qa = End::new(bed.ctx(0), 1 << 20, 16);
    let qb = b.pd.create_qp(&QpInitAttr::new(&b.scq, &b.rcq)).unwrap();
    qa.qp.connect(&qb.endpoint(0), &o).unwrap();
    qb.connect(&qa.qp.endpoint(0), &o).unwrap();
    qa.buf.write(0, &data);
    qa.qp.post_send(&[SendWr::write(3, &[qa.mr.sge(0, 64 << 10)], buf + 4096, fresh.rkey)]).unwrap();
    ok(&qa.scq);
    assert_eq!(peek(buf + 4096, 64 << 10), data);
    drop(fresh);

    // madvise(DONTNEED) and mremap invalidate too.
    let inv = rc.stats().invalidations;
    let r = rc.register(buf, 4096).unwrap().rkey;
    // SAFETY: advice on our own mapping.
    unsafe { libc::madvise(buf as *mut libc::c_void, 4096, libc::MADV_DONTNEED) };
    rc.sync();
    assert!(rc.stats().invalidations > inv);
    assert_ne!(rc.register(buf, 4096).unwrap().rkey, r);
    let inv = rc.stats().invalidations;
    // SAFETY: moves our own mapping.
    let moved =
        unsafe { libc::mremap(buf as *mut libc::c_void, LEN, LEN, libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED, buf + 2 * LEN as u64) };
    assert_ne!(moved, libc::MAP_FAILED);
    rc.sync();
    assert!(rc.stats().invalidations > inv);

    // LRU: at most 4 regions; the least recently used idle one goes.
    rc.flush();
    let bufs: Vec<u64> = (0..5).map(|_| anon(8192, None)).collect();
    for &x in &bufs {
        drop(rc.register(x, 8192).unwrap());
    }
    let st = rc.stats();
    assert_eq!((st.regions, st.evictions), (4, 1), "{st:?}");
    let hits = st.hits;
    drop(rc.register(bufs[4], 100).unwrap());
    assert_eq!(rc.stats().hits, hits + 1);
    drop(rc.register(bufs[0], 100).unwrap());
    assert_eq!(rc.stats().hits, hits + 1, "the first region was evicted");
}

/// A QP of `pd` (on host 0) connected to a fresh peer on host 1: a link
/// for one step that may leave its QPs in ERR.
fn link(bed: &Bed, ctx: &Context, pd: &Pd, o: ConnectOpts) -> (Qp, Cq, End) {
    let cq = ctx.create_cq(64, None).unwrap();
    let mut init = QpInitAttr::new(&cq, &cq);
    init.cap.max_send_wr = 16;
    let qp = pd.create_qp(&init).unwrap();
    let peer = End::new(bed.ctx(1), 2 << 20, 16);
    qp.connect(&peer.qp.endpoint(0x100), &ConnectOpts { sq_psn: 0x200, ..o }).unwrap();
    peer.qp.connect(&qp.endpoint(0x200), &ConnectOpts { sq_psn: 0x100, ..o }).unwrap();
    (qp, cq, peer)
}

/// Aliases across namespaces (the seed's cross-GVMI keys): an owner in a
/// second namespace of host 0's rnicd grants its keys to an agent of the
/// default namespace, which reaches the owner's memory through aliases
/// (as an lkey, and as an rkey its peer uses); a rebind, a revocation and
/// the owner's death (its namespace closing) make them stale: refused at
/// use, locally and on the wire.
#[test]
fn aliases_across_namespaces_and_staleness() {
    let bed = Bed::new("mkxns", 2);
    let o = ConnectOpts { mtu: Mtu::M1024, ..Default::default() };
    let gid = bed.tb.spare_addr(0, 1);
    bed.tb.host(0).sh(&format!("ip addr add {gid}/24 dev eth0")).unwrap();
    let actx = bed.ctx(0);
    let apd = actx.alloc_pd().unwrap();
    let owner = Context::open_namespace(Some(&bed.nics[0].sock), gid).unwrap();
    assert_ne!(owner.gid(), actx.gid());
    let opd = owner.alloc_pd().unwrap();
    let obuf = MemBuf::new(1 << 20).unwrap();
    let omr = opd.reg_mr(&obuf, 0, 1 << 20, RW).unwrap();
    let data = pattern(21, 64 << 10);
    obuf.write(0, &data);
    let pool = KeyPool::new(&opd, 1, 1).unwrap();
    let mut k = pool.get(&[omr.sge(0, 256 << 10)], RW).unwrap();

    // Not granted yet; an unknown namespace.
    let e = apd.create_alias_in(gid, owner.client_id(), k.key()).err().unwrap().to_string();
    assert!(e.contains("did not grant"), "{e}");
    let nowhere = bed.tb.spare_addr(0, 2);
    let e = apd.create_alias_in(nowhere, owner.client_id(), k.key()).err().unwrap().to_string();
    assert!(e.contains("no namespace"), "{e}");

    k.indirect().grant(actx.client_id()).unwrap();
    omr.grant(actx.client_id()).unwrap();
    let cache = AliasCache::of_namespace(&apd, gid).unwrap();
    let al = cache.get(owner.client_id(), k.key()).unwrap();
    assert!(std::sync::Arc::ptr_eq(&al, &cache.get(owner.client_id(), k.key()).unwrap()), "cached");
    assert!(al.is_live().unwrap());
    assert_eq!((al.iova, al.len), (omr.addr, 256 << 10));
    // The agent WRITEs from the owner's memory and READs into it; its peer
    // WRITEs into it with the alias as rkey.
    let (qp, cq, peer) = link(&bed, &actx, &apd, o);
    qp.post_send(&[SendWr::write(1, &[al.sge(0, 64 << 10)], peer.mr.addr, peer.mr.rkey)]).unwrap();
    ok(&cq);
    assert_eq!(peer.buf.read(0, 64 << 10), data);
    peer.buf.write(1 << 20, &pattern(22, 8192));
    qp.post_send(&[SendWr::read(2, &[al.sge(128 << 10, 8192)], peer.mr.addr + (1 << 20), peer.mr.rkey)]).unwrap();
    ok(&cq);
    assert_eq!(obuf.read(128 << 10, 8192), pattern(22, 8192));
    peer.buf.write(0, &pattern(23, 4096));
    peer.qp.post_send(&[SendWr::write(3, &[peer.mr.sge(0, 4096)], al.iova + 4096, al.key)]).unwrap();
    ok(&peer.scq);
    assert_eq!(obuf.read(4096, 4096), pattern(23, 4096));
    // Past the bound range: refused, nothing sent.
    peer.buf.write(0, &[0u8; 8192]);
    qp.post_send(&[SendWr::write(4, &[al.sge(252 << 10, 8192)], peer.mr.addr, peer.mr.rkey)]).unwrap();
    assert_eq!(one(&cq).status, WcStatus::LocProtErr);
    assert_eq!(peer.buf.read(0, 8192), vec![0u8; 8192]);

    // The owner rebinds: stale, refused on the wire; get_checked makes a
    // new alias for the new binding.
    k.rebind(&[omr.sge(512 << 10, 4096)], RW).unwrap();
    assert!(!al.is_live().unwrap());
    let before = obuf.read(0, 1 << 20);
    let (_qp, _cq, peer) = link(&bed, &actx, &apd, o);
    peer.qp.post_send(&[SendWr::write(1, &[peer.mr.sge(0, 4096)], al.iova, al.key)]).unwrap();
    assert_eq!(one(&peer.scq).status, WcStatus::RemAccessErr);
    assert_eq!(obuf.read(0, 1 << 20), before, "nothing written through a stale alias");
    let al2 = cache.get_checked(owner.client_id(), k.key()).unwrap();
    assert!(al2.is_live().unwrap() && al2.key != al.key);
    assert_eq!(al2.iova, omr.addr + (512 << 10));

    // Revoked: stale for good, no new alias.
    k.indirect().revoke(actx.client_id()).unwrap();
    assert!(!al2.is_live().unwrap());
    assert!(cache.get_checked(owner.client_id(), k.key()).is_err());

    // The owner dies (its namespace closes): the MR alias turns stale and
    // the peer using it as an rkey gets a remote access error.
    let al3 = apd.create_alias_in(gid, owner.client_id(), omr.lkey).unwrap();
    let (_qp, _cq, peer) = link(&bed, &actx, &apd, o);
    peer.qp.post_send(&[SendWr::write(1, &[peer.mr.sge(0, 4096)], al3.iova, al3.key)]).unwrap();
    ok(&peer.scq);
    drop(k);
    drop(pool);
    drop((omr, opd));
    drop(owner);
    // rnicd tears the owner down when it reads the hang-up, later.
    reaches(|| al3.is_live().unwrap() as u64, 0, "the liveness of the alias of a gone owner's region");
    peer.qp.post_send(&[SendWr::write(2, &[peer.mr.sge(0, 4096)], al3.iova, al3.key)]).unwrap();
    assert_eq!(one(&peer.scq).status, WcStatus::RemAccessErr);
}
