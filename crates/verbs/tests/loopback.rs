//! Two rnicd instances in this process on two loopback addresses.
use std::net::Ipv4Addr;
use std::time::Duration;

use verbs::*;

struct Nic {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    h: Option<std::thread::JoinHandle<anyhow::Result<()>>>,
    path: std::path::PathBuf,
}
impl Drop for Nic {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(h) = self.h.take() {
            let _ = h.join();
        }
    }
}
fn nic(addr: Ipv4Addr) -> Nic {
    let path = std::env::temp_dir().join(format!("rnicd-test-{}-{addr}.sock", std::process::id()));
    let (stop, h) = rnic::daemon::spawn(rnic::daemon::Config {
        addr,
        sock: path.clone(),
        gso: false,
        max_channels_per_client: rnic::daemon::DEFAULT_MAX_CHANNELS_PER_CLIENT,
    })
    .unwrap();
    Nic { stop, h: Some(h), path }
}

/// A buffer of `len` bytes registered with `pd` for every access.
fn buf_mr(pd: &Pd, len: usize) -> (MemBuf, Mr) {
    let b = MemBuf::new(len).unwrap();
    let m = pd.reg_mr(&b, 0, b.len(), access::ALL).unwrap();
    (b, m)
}

/// Connects `qa` and `qb` to each other at path MTU `mtu`, their first
/// send PSNs `psn_a` and `psn_b`.
fn connect(qa: &Qp, qb: &Qp, mtu: Mtu, psn_a: u32, psn_b: u32) {
    let o = ConnectOpts { mtu, ..Default::default() };
    qa.connect(&qb.endpoint(psn_b), &ConnectOpts { sq_psn: psn_a, ..o }).unwrap();
    qb.connect(&qa.endpoint(psn_a), &ConnectOpts { sq_psn: psn_b, ..o }).unwrap();
}

#[test]
fn write_read_send_atomic_loopback() {
    let a = nic(Ipv4Addr::new(127, 0, 0, 2));
    let b = nic(Ipv4Addr::new(127, 0, 0, 3));
    let ca = Context::open(Some(&a.path)).unwrap();
    let cb = Context::open(Some(&b.path)).unwrap();
    let (pa, pb) = (ca.alloc_pd().unwrap(), cb.alloc_pd().unwrap());
    let (cqa, cqb) = (ca.create_cq(64, None).unwrap(), cb.create_cq(64, None).unwrap());
    let qa = pa.create_qp(&QpInitAttr::new(&cqa, &cqa)).unwrap();
    let qb = pb.create_qp(&QpInitAttr::new(&cqb, &cqb)).unwrap();
    let ((ba, ma), (bb, mb)) = (buf_mr(&pa, 1 << 20), buf_mr(&pb, 1 << 20));
    connect(&qa, &qb, Mtu::M1024, 200, 100);
    let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 + 3) as u8).collect();
    ba.write(0, &data);
    qa.post_send(&[SendWr::write(1, &[ma.sge(0, data.len())], mb.addr, mb.rkey)]).unwrap();
    let wc = cqa.wait(1, Duration::from_secs(10)).unwrap();
    assert_eq!(wc[0].status, WcStatus::Success, "{wc:?}");
    assert_eq!(bb.read(0, data.len()), data);
    // READ it back into another place.
    qa.post_send(&[SendWr::read(2, &[ma.sge(500_000, data.len())], mb.addr, mb.rkey)]).unwrap();
    let wc = cqa.wait(1, Duration::from_secs(10)).unwrap();
    assert_eq!(wc[0].status, WcStatus::Success, "{wc:?}");
    assert_eq!(ba.read(500_000, data.len()), data);
    // SEND with imm.
    qb.post_recv(&[RecvWr { wr_id: 9, sg_list: &[mb.sge(600_000, 5000)] }]).unwrap();
    qa.post_send(&[SendWr::send(3, &[ma.sge(0, 4000)]).with_imm(0xabcd)]).unwrap();
    let wc = cqb.wait(1, Duration::from_secs(10)).unwrap();
    assert_eq!((wc[0].status, wc[0].byte_len, wc[0].imm_data, wc[0].wr_id), (WcStatus::Success, 4000, 0xabcd, 9));
    assert_eq!(bb.read(600_000, 4000), data[..4000]);
    cqa.wait(1, Duration::from_secs(10)).unwrap();
    // atomics
    bb.write_u64(800_000, 5);
    qa.post_send(&[SendWr::fetch_add(4, &[ma.sge(900_000, 8)], mb.addr + 800_000, mb.rkey, 10)]).unwrap();
    qa.post_send(&[SendWr::cmp_swap(5, &[ma.sge(900_008, 8)], mb.addr + 800_000, mb.rkey, 15, 99)]).unwrap();
    let wc = cqa.wait(2, Duration::from_secs(10)).unwrap();
    assert!(wc.iter().all(|w| w.status == WcStatus::Success), "{wc:?}");
    assert_eq!(ba.read_u64(900_000), 5);
    assert_eq!(ba.read_u64(900_008), 15);
    assert_eq!(bb.read_u64(800_000), 99);
}

#[test]
fn big_read_small_mtu() {
    let a = nic(Ipv4Addr::new(127, 0, 0, 4));
    let b = nic(Ipv4Addr::new(127, 0, 0, 5));
    let ca = Context::open(Some(&a.path)).unwrap();
    let cb = Context::open(Some(&b.path)).unwrap();
    let (pa, pb) = (ca.alloc_pd().unwrap(), cb.alloc_pd().unwrap());
    let (cqa, cqb) = (ca.create_cq(64, None).unwrap(), cb.create_cq(64, None).unwrap());
    let qa = pa.create_qp(&QpInitAttr::new(&cqa, &cqa)).unwrap();
    let qb = pb.create_qp(&QpInitAttr::new(&cqb, &cqb)).unwrap();
    let ((_ba, ma), (_bb, mb)) = (buf_mr(&pa, 4 << 20), buf_mr(&pb, 4 << 20));
    connect(&qa, &qb, Mtu::M256, 200, 100);
    qa.post_send(&[SendWr::read(2, &[ma.sge(0, 4 << 20)], mb.addr, mb.rkey)]).unwrap();
    let wc = cqa.wait(1, Duration::from_secs(20)).unwrap();
    eprintln!("A {}\nB {}", ca.stats().unwrap(), cb.stats().unwrap());
    assert_eq!(wc[0].status, WcStatus::Success, "{wc:?}");
}

/// SEND ping-pong where both sides sleep on a completion channel
/// (`Cq::poll_or_wait`), posting both while rnicd polls the rings (no
/// doorbell) and after pauses long enough for rnicd to stop polling and
/// sleep (doorbell needed): every message arrives, in order, intact.
#[test]
fn ping_pong_sleeping_and_polling() {
    let a = nic(Ipv4Addr::new(127, 0, 0, 6));
    let b = nic(Ipv4Addr::new(127, 0, 0, 7));
    let ca = Context::open(Some(&a.path)).unwrap();
    let cb = Context::open(Some(&b.path)).unwrap();
    let (pa, pb) = (ca.alloc_pd().unwrap(), cb.alloc_pd().unwrap());
    let (cha, chb) = (ca.create_comp_channel().unwrap(), cb.create_comp_channel().unwrap());
    let (scqa, scqb) = (ca.create_cq(256, None).unwrap(), cb.create_cq(256, None).unwrap());
    let (rcqa, rcqb) = (ca.create_cq(64, Some(&cha)).unwrap(), cb.create_cq(64, Some(&chb)).unwrap());
    let qa = pa.create_qp(&QpInitAttr::new(&scqa, &rcqa)).unwrap();
    let qb = pb.create_qp(&QpInitAttr::new(&scqb, &rcqb)).unwrap();
    let ((ba, ma), (bb, mb)) = (buf_mr(&pa, 1 << 16), buf_mr(&pb, 1 << 16));
    connect(&qa, &qb, Mtu::M1024, 9, 7);
    let mut wc = [Wc::default(); 4];
    let spin = Duration::from_micros(2);
    let recv = |q: &Qp, m: &Mr, i: u64| q.post_recv(&[RecvWr { wr_id: i, sg_list: &[m.sge(0, 64)] }]).unwrap();
    recv(&qb, &mb, 0);
    recv(&qa, &ma, 0);
    for i in 1..=300u64 {
        if i % 50 == 0 {
            // Long enough for both rnicds to stop polling and sleep.
            std::thread::sleep(Duration::from_millis(3));
        }
        ba.write(100, &i.to_le_bytes());
        qa.post_send(&[SendWr::send(i, &[ma.sge(100, 8)]).unsignaled()]).unwrap();
        assert_eq!(rcqb.poll_or_wait(&mut wc[..1], &chb, spin, Duration::from_secs(10)).unwrap(), 1, "message {i} lost");
        assert_eq!((wc[0].status, wc[0].byte_len), (WcStatus::Success, 8));
        assert_eq!(bb.read_u64(0), i);
        recv(&qb, &mb, i);
        bb.write(100, &(i * 3).to_le_bytes());
        qb.post_send(&[SendWr::send(i, &[mb.sge(100, 8)]).unsignaled()]).unwrap();
        assert_eq!(rcqa.poll_or_wait(&mut wc[..1], &cha, spin, Duration::from_secs(10)).unwrap(), 1, "reply {i} lost");
        assert_eq!(ba.read_u64(0), i * 3);
        recv(&qa, &ma, i);
        if i % 32 == 0 {
            let _ = scqa.poll(&mut wc);
            let _ = scqb.poll(&mut wc);
        }
    }
}

/// A receiver that waits for solicited completions only
/// (`Cq::poll_or_wait_solicited`) sleeps through an unsolicited message
/// and wakes for the solicited one after it, and then gets both.
#[test]
fn a_solicited_wait_sleeps_through_unsolicited_messages() {
    let a = nic(Ipv4Addr::new(127, 0, 0, 8));
    let b = nic(Ipv4Addr::new(127, 0, 0, 9));
    let ca = Context::open(Some(&a.path)).unwrap();
    let cb = Context::open(Some(&b.path)).unwrap();
    let (pa, pb) = (ca.alloc_pd().unwrap(), cb.alloc_pd().unwrap());
    let chb = cb.create_comp_channel().unwrap();
    let scqa = ca.create_cq(16, None).unwrap();
    let rcqb = cb.create_cq(16, Some(&chb)).unwrap();
    let qa = pa.create_qp(&QpInitAttr::new(&scqa, &scqa)).unwrap();
    let qb = pb.create_qp(&QpInitAttr::new(&rcqb, &rcqb)).unwrap();
    let ((_ba, ma), (_bb, mb)) = (buf_mr(&pa, 1 << 16), buf_mr(&pb, 1 << 16));
    connect(&qa, &qb, Mtu::M1024, 9, 7);
    for i in 0..2u64 {
        qb.post_recv(&[RecvWr { wr_id: i, sg_list: &[mb.sge(i as usize * 64, 64)] }]).unwrap();
    }
    let woke = std::sync::atomic::AtomicBool::new(false);
    let waiter_tid = std::sync::atomic::AtomicI32::new(0);
    std::thread::scope(|s| {
        let waiter = s.spawn(|| {
            // SAFETY: gettid has no preconditions.
            waiter_tid.store(unsafe { libc::gettid() }, std::sync::atomic::Ordering::SeqCst);
            let mut wc = [Wc::default(); 4];
            let n = rcqb.poll_or_wait_solicited(&mut wc, &chb, Duration::from_secs(20)).unwrap();
            woke.store(true, std::sync::atomic::Ordering::SeqCst);
            wc[..n].iter().map(|w| (w.status, w.wr_id)).collect::<Vec<_>>()
        });
        // The waiter armed its CQ and sleeps on the channel before the
        // first message goes: seen armed, and asleep in two looks 20 ms
        // apart (a look alone could catch it waiting for the ring's lock).
        let asleep = || {
            let tid = waiter_tid.load(std::sync::atomic::Ordering::SeqCst);
            let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).unwrap_or_default();
            tid != 0 && stat.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('S'))
        };
        let t = std::time::Instant::now();
        while !(rcqb.armed() && asleep() && {
            std::thread::sleep(Duration::from_millis(20));
            asleep()
        }) {
            assert!(t.elapsed() < Duration::from_secs(20), "the waiter never slept on its channel");
            std::thread::sleep(Duration::from_millis(5));
        }
        qa.post_send(&[SendWr::send(1, &[ma.sge(0, 8)])]).unwrap();
        assert_eq!(scqa.wait(1, Duration::from_secs(10)).unwrap()[0].status, WcStatus::Success);
        // The unsolicited message is in the receiver's CQ (the sender's
        // completion says it was placed); it raised no event.
        std::thread::sleep(Duration::from_millis(300));
        assert!(!woke.load(std::sync::atomic::Ordering::SeqCst), "an unsolicited completion woke the waiter");
        qa.post_send(&[SendWr::send(2, &[ma.sge(8, 8)]).solicited()]).unwrap();
        let got = waiter.join().unwrap();
        assert_eq!(got, vec![(WcStatus::Success, 0), (WcStatus::Success, 1)]);
    });
}
