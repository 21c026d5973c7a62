//! Moving a whole namespace of N QPs between two hosts while the peer keeps
//! sending on every QP (and streams RDMA WRITEs and fetch-and-adds on QP 0):
//! every SEND arrives exactly once and in order on its QP, every atomic
//! executes once, the peer's QPs stay in RTS. `bench_qp_migrate` (ignored;
//! run by bench/qp-migrate) measures the blackout the peer sees, the state
//! size and the peer's throughput, and the cost of write tracing.
mod common;
use common::*;
use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use verbs::*;

const MB: usize = 1 << 20;
const KEY: u32 = 0x6d6d00;
const IOVA: u64 = 0x7e00_0000_0000;
/// SEND rounds per QP: 0-1 before the move, 2-3 released just before it
/// (they hit the move), 4-5 after it.
const ROUNDS: usize = 6;
const WRITE_LEN: usize = 64 << 10;
const M_WRITES: usize = 4 * MB; // the peer's WRITE stream lands here (64 slots)
const M_CNT: usize = 3 * MB + MB / 2; // the peer's fetch-and-add counter
const M_RECV: usize = 0; // receive buffers: (qp * ROUNDS + round) * 64

struct Peer {
    qps: Vec<Qp>,
    scq: Cq,
    mr: Mr,
    buf: MemBuf,
    _pd: Pd,
    ctx: Context,
}

/// Peer-side record: completion times and WRITE bytes, for the figures.
#[derive(Default)]
struct Timeline {
    events: Vec<(Instant, u64)>,
}

fn peer_loop(p: &Peer, released: &AtomicUsize, stop: &AtomicBool, tl: &Mutex<Timeline>) {
    let n = p.qps.len();
    for i in 0..n {
        for r in 0..ROUNDS {
            let mut msg = [0u8; 64];
            msg[..8].copy_from_slice(&(i as u64).to_le_bytes());
            msg[8..16].copy_from_slice(&(r as u64).to_le_bytes());
            p.buf.write((i * ROUNDS + r) * 64, &msg);
        }
    }
    let mut sent = vec![0usize; n];
    let mut done = vec![0usize; n];
    let (mut w_posted, mut w_done, mut fa_posted, mut fa_done) = (0u64, 0u64, 0u64, 0u64);
    let mut wcs = [Wc::default(); 256];
    let mut last = Instant::now();
    loop {
        let rel = released.load(Ordering::Acquire);
        let all_sent = done.iter().all(|&d| d == ROUNDS);
        if stop.load(Ordering::Acquire) && all_sent && w_posted == w_done && fa_posted == fa_done {
            break;
        }
        for i in 0..n {
            while sent[i] < rel.min(ROUNDS) && sent[i] - done[i] < 2 {
                let r = sent[i];
                let id = (i * ROUNDS + r) as u64;
                p.qps[i].post_send(&[SendWr::send(id, &[p.mr.sge((i * ROUNDS + r) * 64, 64)])]).unwrap();
                sent[i] += 1;
            }
        }
        if !stop.load(Ordering::Acquire) {
            // The throughput stream on QP 0: 4 WRITEs in flight, one atomic every 8.
            while w_posted - w_done < 4 {
                let slot = (w_posted % 64) as usize;
                let id = 1 << 40 | w_posted;
                p.qps[0]
                    .post_send(&[SendWr::write(id, &[p.mr.sge(MB, WRITE_LEN)], IOVA + (M_WRITES + slot * WRITE_LEN) as u64, KEY)])
                    .unwrap();
                w_posted += 1;
                if w_posted % 8 == 0 && fa_posted == fa_done {
                    let id = 2 << 40 | fa_posted;
                    p.qps[0].post_send(&[SendWr::fetch_add(id, &[p.mr.sge(2 * MB, 8)], IOVA + M_CNT as u64, KEY, 1)]).unwrap();
                    fa_posted += 1;
                }
            }
        }
        let k = p.scq.poll(&mut wcs).unwrap();
        let now = Instant::now();
        let mut tl = tl.lock().unwrap();
        for w in &wcs[..k] {
            assert_eq!(w.status, WcStatus::Success, "peer completion {w:?}");
            match w.wr_id >> 40 {
                0 => {
                    let (i, r) = ((w.wr_id as usize) / ROUNDS, (w.wr_id as usize) % ROUNDS);
                    assert_eq!(r, done[i], "peer SENDs on QP {i} complete in order");
                    done[i] += 1;
                    tl.events.push((now, 0));
                }
                1 => {
                    assert_eq!(w.wr_id & 0xff_ffff_ffff, w_done, "WRITEs complete in order");
                    w_done += 1;
                    tl.events.push((now, WRITE_LEN as u64));
                }
                _ => {
                    assert_eq!(p.buf.read_u64(2 * MB), fa_done, "fetch-and-add {fa_done} executed exactly once");
                    fa_done += 1;
                    tl.events.push((now, 0));
                }
            }
        }
        drop(tl);
        if k > 0 {
            last = now;
        } else {
            assert!(last.elapsed() < Duration::from_secs(60), "peer made no progress for 60 s");
            std::thread::sleep(Duration::from_micros(20));
        }
    }
}

/// What one move measured.
#[derive(Debug)]
struct MoveReport {
    qps: usize,
    blackout_ms: f64,
    /// The longest gap in a window of the same length without a move.
    baseline_gap_ms: f64,
    state_bytes_per_qp: usize,
    gbps_before: f64,
    gbps_during: f64,
    gbps_after: f64,
}

fn gbps(ev: &[(Instant, u64)], from: Instant, to: Instant) -> f64 {
    let bytes: u64 = ev.iter().filter(|e| e.0 >= from && e.0 < to).map(|e| e.1).sum();
    let s = to.duration_since(from).as_secs_f64().max(1e-6);
    bytes as f64 * 8.0 / s / 1e9
}

fn init_attr(scq: &Cq, rcq: &Cq) -> QpInitAttr {
    let mut init = QpInitAttr::new(scq, rcq);
    init.cap.max_send_wr = 16;
    init.cap.max_recv_wr = ROUNDS as u32;
    init
}

fn drain(cq: &Cq, out: &mut Vec<Wc>) {
    let mut wcs = [Wc::default(); 256];
    loop {
        let k = cq.poll(&mut wcs).unwrap();
        out.extend_from_slice(&wcs[..k]);
        if k == 0 {
            break;
        }
    }
}

/// One pre-copy round: copies the blocks the trace reports dirty (all if it
/// says so) from `src` to `dst`; returns the bytes copied.
fn copy_dirty(mr: &Mr, src: &MemBuf, dst: &MemBuf) -> usize {
    let t = mr.fetch_trace().unwrap();
    let runs = if t.all_dirty { vec![(0, src.len() as u64)] } else { t.runs };
    let mut n = 0;
    for (off, len) in runs {
        dst.write(off as usize, &src.read(off as usize, len as usize));
        n += len as usize;
    }
    n
}

/// Sets up N QP pairs (namespace `gid` on host 0 <-> host 1), runs the peer,
/// moves the namespace to host 2 mid-stream, checks everything, measures.
fn move_namespace(prefix: &str, n: usize, settle: Duration) -> MoveReport {
    let bed = Bed::new(prefix, 3);
    let (h_old, h_new) = (bed.tb.host(0), bed.tb.host(2));
    let gid: Ipv4Addr = bed.tb.spare_addr(0, 9);
    // The old host must not teach the peer its MAC for the GID after the
    // move: its ARP requests use its primary address (arp_announce 2).
    h_old.sh(&format!("sysctl -qw net.ipv4.conf.all.arp_announce=2; ip addr add {gid}/24 dev eth0")).unwrap();

    let ctx = Context::open_namespace(Some(&bed.nics[0].sock), gid).unwrap();
    let mctx = ctx.clone();
    let pd = ctx.alloc_pd().unwrap();
    let cqn = (n * ROUNDS * 2).next_power_of_two() as u32;
    let (scq, rcq) = (ctx.create_cq(cqn, None).unwrap(), ctx.create_cq(cqn, None).unwrap());
    let buf = MemBuf::new(8 * MB).unwrap();
    let mr = pd.reg_mr_at(&buf, 0, 8 * MB, access::ALL, Some(KEY), IOVA).unwrap();
    let mqps: Vec<Qp> = (0..n).map(|_| pd.create_qp(&init_attr(&scq, &rcq)).unwrap()).collect();

    let pctx = bed.ctx(1);
    let ppd = pctx.alloc_pd().unwrap();
    let pscq = pctx.create_cq(cqn.max(1024), None).unwrap();
    let prcq = pctx.create_cq(64, None).unwrap();
    let pbuf = MemBuf::new(4 * MB).unwrap();
    let pmr = ppd.reg_mr(&pbuf, 0, 4 * MB, access::ALL).unwrap();
    let pqps: Vec<Qp> = (0..n).map(|_| ppd.create_qp(&init_attr(&pscq, &prcq)).unwrap()).collect();
    let o = ConnectOpts { mtu: Mtu::M4096, rnr_retry: 7, min_rnr_timer: 6, ..Default::default() };
    for (m, p) in mqps.iter().zip(&pqps) {
        m.connect(&p.endpoint(0x2000), &ConnectOpts { sq_psn: 0x1000, ..o }).unwrap();
        p.connect(&m.endpoint(0x1000), &ConnectOpts { sq_psn: 0x2000, ..o }).unwrap();
    }
    for (i, m) in mqps.iter().enumerate() {
        let wrs: Vec<_> = (0..ROUNDS).map(|r| [mr.sge(M_RECV + (i * ROUNDS + r) * 64, 64)]).collect();
        let rws: Vec<_> = (0..ROUNDS).map(|r| RecvWr { wr_id: (i * ROUNDS + r) as u64, sg_list: &wrs[r] }).collect();
        m.post_recv(&rws).unwrap();
    }

    let peer = Peer { qps: pqps, scq: pscq, mr: pmr, buf: pbuf, _pd: ppd, ctx: pctx };
    let released = Arc::new(AtomicUsize::new(2));
    let stop = Arc::new(AtomicBool::new(false));
    let tl = Arc::new(Mutex::new(Timeline::default()));
    let (rel2, stop2, tl2) = (released.clone(), stop.clone(), tl.clone());
    let t_start = Instant::now();
    let peer_thread = std::thread::spawn(move || {
        peer_loop(&peer, &rel2, &stop2, &tl2);
        peer
    });

    // Before the move: rounds 0-1 delivered, the WRITE stream running.
    let mut rwc = Vec::new();
    while rwc.len() < 2 * n {
        drain(&rcq, &mut rwc);
        assert!(!peer_thread.is_finished(), "peer thread ended early");
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(settle);
    released.store(4, Ordering::Release);
    std::thread::sleep(Duration::from_millis(1));

    // The destination's PD, CQs and MR (same key and address) are made
    // ahead, as in a pre-copy phase; the QPs need their final state.
    let ctx2 = Context::open_namespace(Some(&bed.nics[2].sock), gid).unwrap();
    let pd2 = ctx2.alloc_pd().unwrap();
    let (scq2, rcq2) = (ctx2.create_cq(cqn, None).unwrap(), ctx2.create_cq(cqn, None).unwrap());
    let buf2 = MemBuf::new(8 * MB).unwrap();
    let mr2 = pd2.reg_mr_at(&buf2, 0, 8 * MB, access::ALL, Some(KEY), IOVA).unwrap();
    // The QPs too, with their QPNs, in RESET: they take their states later.
    let qps2: Vec<Qp> = mqps.iter().map(|q| pd2.create_qp_with_qpn(&init_attr(&scq2, &rcq2), q.qpn).unwrap()).collect();
    // The new host takes the address ahead but does not answer ARP for it
    // (arp_ignore 8) until the move, so the peer keeps reaching the old host
    // until the announcement.
    h_new.sh(&format!("sysctl -qw net.ipv4.conf.eth0.arp_ignore=8; ip addr add {gid}/24 dev eth0")).unwrap();
    let announcer = h_new.in_netns(move || rnic::announce::Announcer::new(gid)).unwrap().unwrap();
    // Pre-copy: the whole memory once, then what rnicd wrote meanwhile (its
    // write trace), while the QPs keep running.
    mr.start_trace(4096).unwrap();
    buf2.write(0, &buf.read(0, 8 * MB));
    for _ in 0..8 {
        if copy_dirty(&mr, &buf, &buf2) < 256 << 10 {
            break;
        }
    }

    let before = bed.ctx(1).stats().unwrap();
    // The move.
    let t_suspend = Instant::now();
    let mrefs: Vec<&Qp> = mqps.iter().collect();
    mctx.suspend_qps(&mrefs).unwrap();
    let mut phases = vec![("suspend", t_suspend.elapsed())];
    drain(&rcq, &mut rwc);
    drain(&scq, &mut Vec::new());
    let states: Vec<QpSnapshot> = mctx.query_qp_states(&mrefs).unwrap();
    let state_bytes: usize = states.iter().map(|s| serde_json::to_vec(s).unwrap().len()).sum();
    phases.push(("query", t_suspend.elapsed()));
    // The last pre-copy round: only what was written since the previous one.
    let copied = copy_dirty(&mr, &buf, &buf2);
    phases.push(("memory copy", t_suspend.elapsed()));
    ctx2.restore_qps(&states).unwrap();
    phases.push(("restore states", t_suspend.elapsed()));
    for (i, (st, q)) in states.iter().zip(&qps2).enumerate() {
        assert_eq!(st.qpn, q.qpn);
        let from = st.runtime.rq_retired as usize;
        let sg: Vec<_> = (from..ROUNDS).map(|r| [mr2.sge(M_RECV + (i * ROUNDS + r) * 64, 64)]).collect();
        let rws: Vec<_> = (from..ROUNDS).map(|r| RecvWr { wr_id: (i * ROUNDS + r) as u64, sg_list: &sg[r - from] }).collect();
        if !rws.is_empty() {
            // Suspended: rnicd takes them from the ring when it resumes.
            q.post_recv_quiet(&rws).unwrap();
        }
    }
    phases.push(("repost", t_suspend.elapsed()));
    // The announcement: gratuitous ARP from the new host (as a VMM announces
    // a moved guest) points the peer's neighbour entry at it.
    announcer.announce(1).unwrap();
    phases.push(("address moved + announced", t_suspend.elapsed()));
    ctx2.resume_qps(&qps2.iter().collect::<Vec<_>>()).unwrap();
    phases.push(("resumed", t_suspend.elapsed()));
    eprintln!(
        "{n} QPs, {copied} bytes copied after suspend; ms since suspend: {}",
        phases.iter().map(|(k, d)| format!("{k} {:.2}", d.as_secs_f64() * 1e3)).collect::<Vec<_>>().join(", ")
    );
    let t_resumed = Instant::now();

    // After: the rest arrives on the new host; then rounds 4-5.
    std::thread::sleep(settle);
    // The old host lets the address and the namespace go. (Done after the
    // blackout is measured: on this testbed the process spawns of `ip` and
    // `sysctl` take the CPU from both rnicds, which two real hosts would not.
    // The peer already sends to the new host.)
    h_old.sh(&format!("ip addr del {gid}/24 dev eth0")).unwrap();
    h_new.sh("sysctl -qw net.ipv4.conf.eth0.arp_ignore=0").unwrap();
    drop(mrefs);
    drop(mqps);
    drop((mr, scq, rcq, pd, ctx, mctx));
    released.store(ROUNDS, Ordering::Release);
    let t0 = Instant::now();
    while rwc.len() < ROUNDS * n {
        drain(&rcq2, &mut rwc);
        assert!(t0.elapsed() < Duration::from_secs(120), "moved QPs stalled: {} of {} receives", rwc.len(), ROUNDS * n);
        std::thread::sleep(Duration::from_millis(1));
    }
    let t_end = Instant::now();
    stop.store(true, Ordering::Release);
    let peer = match peer_thread.join() {
        Ok(p) => p,
        Err(_) => {
            let s1 = bed.ctx(1).stats().unwrap();
            let s2 = ctx2.stats().unwrap();
            panic!("peer thread failed; peer rnicd {s1}; new host namespace {s2}; {:?} since resume", t_resumed.elapsed());
        }
    };

    // Exactly once, in order, per QP; the data is what the peer sent.
    let mut next = vec![0usize; n];
    for w in &rwc {
        assert_eq!(w.status, WcStatus::Success, "{w:?}");
        let (i, r) = ((w.wr_id as usize) / ROUNDS, (w.wr_id as usize) % ROUNDS);
        assert_eq!(r, next[i], "QP {i}: messages in order, none twice");
        next[i] += 1;
        let off = M_RECV + (i * ROUNDS + r) * 64;
        assert_eq!((buf2.read_u64(off), buf2.read_u64(off + 8)), (i as u64, r as u64), "QP {i} message {r}");
    }
    assert!(next.iter().all(|&k| k == ROUNDS));
    // Every peer atomic executed exactly once (the peer checked the old values).
    for q in &peer.qps {
        assert_eq!(q.state().unwrap(), QpState::Rts, "the peer's QPs never leave RTS");
    }
    let ps = peer.ctx.stats().unwrap();
    let d = |k: &str| ps[k].as_u64().unwrap_or(0) - before[k].as_u64().unwrap_or(0);
    eprintln!(
        "{n} QPs, peer rnicd from the suspend on (before it): timeouts {} ({}) loss probes {} ({}) rewinds {} ({}) rnr_naks_received {} out-of-window responses {} bad ICRC {}",
        d("timeouts"), before["timeouts"], d("loss_probes"), before["loss_probes"], d("retransmit_rewinds"), before["retransmit_rewinds"],
        d("rnr_naks_received"), d("rx_resp_out_of_window"), ps["rx_bad_icrc"]
    );

    let ev = std::mem::take(&mut tl.lock().unwrap().events);
    let mut times: Vec<Instant> = ev.iter().map(|e| e.0).collect();
    times.sort();
    // Blackout: the longest time without any peer completion from the suspend
    // up to the peer's first completion after the resume.
    // The baseline is the same measure over a window of the same length in
    // normal operation, half a settle time before the suspend.
    let first_after = times.iter().copied().find(|t| *t > t_resumed).unwrap_or(t_resumed);
    let window = first_after.duration_since(t_suspend);
    // (A gap that began before the window counts from the window's start:
    // on a loaded machine the peer may already be waiting when the suspend comes.)
    let longest_gap = |from: Instant| {
        times
            .windows(2)
            .filter(|w| w[1] > from && w[0] < from + window)
            .map(|w| (w[0].max(from), w[1]))
            .max_by_key(|w| w.1.duration_since(w.0))
    };
    let gap = longest_gap(t_suspend);
    let blackout = gap.map(|(a, b)| b.duration_since(a)).unwrap_or_default();
    let baseline = longest_gap(t_suspend - settle / 2).map(|(a, b)| b.duration_since(a)).unwrap_or_default();
    if let Some((a, b)) = gap {
        let ms = |x: Instant| if x >= t_suspend { (x - t_suspend).as_secs_f64() * 1e3 } else { -(t_suspend - x).as_secs_f64() * 1e3 };
        eprintln!(
            "{n} QPs: longest gap from {:.2} to {:.2} ms after the suspend; resumed at {:.2} ms; baseline gap {:.2} ms",
            ms(a),
            ms(b),
            ms(t_resumed),
            baseline.as_secs_f64() * 1e3
        );
    }
    let before_from = t_start.max(t_suspend - settle);
    MoveReport {
        qps: n,
        blackout_ms: blackout.as_secs_f64() * 1e3,
        baseline_gap_ms: baseline.as_secs_f64() * 1e3,
        state_bytes_per_qp: state_bytes / n,
        gbps_before: gbps(&ev, before_from, t_suspend),
        gbps_during: gbps(&ev, t_suspend, t_resumed),
        gbps_after: gbps(&ev, t_resumed, t_end.min(t_resumed + settle)),
    }
}

#[test]
fn thousand_qps_move_under_traffic() {
    let r = move_namespace("rnmany", 1000, Duration::from_millis(100));
    eprintln!("{r:?}");
}

/// RDMA WRITE throughput of 64 KiB messages into an MR, traced or not.
fn write_gbps(traced: bool, secs: f64) -> f64 {
    let bed = Bed::new(if traced { "rntrc1" } else { "rntrc0" }, 2);
    // Path MTU 1024: packets fit the 1500-byte link, so UDP GSO applies (the
    // bench/rdma configuration); 4096 would measure IP fragmentation.
    let o = ConnectOpts { mtu: Mtu::M1024, ..Default::default() };
    let (a, b) = pair(&bed, 0, 1, o);
    if traced {
        b.mr.start_trace(4096).unwrap();
    }
    let (mut posted, mut done) = (0u64, 0u64);
    let t0 = Instant::now();
    let mut wcs = [Wc::default(); 64];
    let mut fetch_at = t0;
    while t0.elapsed().as_secs_f64() < secs {
        while posted - done < 16 {
            let off = (posted % 64) as usize * WRITE_LEN;
            a.qp.post_send(&[SendWr::write(posted, &[a.mr.sge(off, WRITE_LEN)], b.mr.addr + off as u64, b.mr.rkey)]).unwrap();
            posted += 1;
        }
        let k = a.scq.poll(&mut wcs).unwrap();
        done += k as u64;
        if traced && fetch_at.elapsed() > Duration::from_millis(100) {
            // The owner fetches as a pre-copy loop would.
            b.mr.fetch_trace().unwrap();
            fetch_at = Instant::now();
        }
    }
    let s = t0.elapsed().as_secs_f64();
    a.scq.wait((posted - done) as usize, T).unwrap();
    done as f64 * WRITE_LEN as f64 * 8.0 / s / 1e9
}

#[test]
#[ignore = "benchmark: run by bench/qp-migrate"]
fn bench_qp_migrate() {
    let mut rows = Vec::new();
    // RNIC_QPM_COUNTS=1,100 runs some counts only (profiling).
    let counts: Vec<usize> = std::env::var("RNIC_QPM_COUNTS")
        .map(|v| v.split(',').filter_map(|x| x.parse().ok()).collect())
        .unwrap_or_else(|_| vec![1, 100, 1000]);
    for n in counts {
        let r = move_namespace(&format!("rnbm{n}"), n, Duration::from_millis(1000));
        eprintln!("{r:?}");
        rows.push(format!(
            r#"{{"qps": {}, "blackout_ms": {:.3}, "baseline_gap_ms": {:.3}, "state_bytes_per_qp": {}, "peer_gbps_before": {:.3}, "peer_gbps_during": {:.3}, "peer_gbps_after": {:.3}}}"#,
            r.qps, r.blackout_ms, r.baseline_gap_ms, r.state_bytes_per_qp, r.gbps_before, r.gbps_during, r.gbps_after
        ));
    }
    // Alternate to spread the machine's load drift over both.
    let (mut with, mut without) = (0.0, 0.0);
    let trace_runs = if std::env::var_os("RNIC_QPM_COUNTS").is_some() { 0 } else { 3 };
    for _ in 0..trace_runs {
        without += write_gbps(false, 2.0) / trace_runs as f64;
        with += write_gbps(true, 2.0) / trace_runs as f64;
    }
    rows.push(format!(r#"{{"test": "write_trace_cost", "gbps_with": {with:.3}, "gbps_without": {without:.3}}}"#));
    println!("BENCH_JSON {{\"rows\": [{}]}}", rows.join(", "));
}
