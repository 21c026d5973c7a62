//! rnicd under a rate cap: the testbed's `tbf` qdisc on the sending host
//! holds 100 ms of traffic, far less than several QPs may have in flight,
//! and drops what overflows it. rnicd must see those drops (ENOBUFS with
//! IP_RECVERR, or the sequence NAK a drop causes), keep the refused packets
//! for a later send and shrink the QPs' windows, so that the link carries
//! its rate with few resends instead of overflowing its queue again at
//! every window. The goodput and resend figures are timings that swing
//! with load: bench/rdma/cap-ab reports them; this test asserts behaviour.
mod common;
use common::*;
use std::time::{Duration, Instant};
use verbs::*;

const CAP_MBIT: u32 = 100;
const QPS: usize = 4;
const MSG: usize = 256 << 10;
/// Bytes each QP writes: 32 MiB in all, about 2.8 s at the cap.
const PER_QP: usize = 8 << 20;
const DEPTH: usize = 16;

/// (bytes, packets, dropped) the root qdisc of `eth0` of host `h` reports.
fn qdisc_counters(bed: &Bed, h: usize) -> (u64, u64, u64) {
    let out = bed.tb.host(h).sh("tc -s qdisc show dev eth0 root").unwrap();
    let word = |after: &str| -> u64 {
        let i = out.find(after).unwrap_or_else(|| panic!("no {after:?} in {out}")) + after.len();
        out[i..].trim_start().split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
    };
    (word("Sent "), word("bytes "), word("dropped "))
}

/// Four QPs stream 256 KiB WRITEs from host 0, whose link is capped at
/// 100 Mbit/s: every byte arrives, rnicd counts the qdisc's refusals and
/// cuts the windows, and no refused packet is dropped (`send_errors`).
#[test]
fn writes_over_a_capped_link_arrive_with_refusals_kept() {
    let bed = Bed::new("rcap", 2);
    let o = ConnectOpts { mtu: Mtu::M1024, ..Default::default() };
    let pairs: Vec<(End, End)> = (0..QPS).map(|_| pair_sized(&bed, 0, 1, o, PER_QP, DEPTH as u32 * 2)).collect();
    for (q, (a, _)) in pairs.iter().enumerate() {
        a.buf.write(0, &pattern(q as u64, PER_QP));
    }
    bed.tb.set_rate(0, 0, Some(CAP_MBIT)).unwrap();
    let before = qdisc_counters(&bed, 0);
    let stats_before = bed.ctx(0).stats().unwrap();
    let msgs = PER_QP / MSG;
    let (mut posted, mut done) = (vec![0usize; QPS], vec![0usize; QPS]);
    let mut wcs = [Wc::default(); 32];
    let t0 = Instant::now();
    while done.iter().any(|&d| d < msgs) {
        assert!(t0.elapsed() < T, "stalled: {done:?} of {msgs}\n{}", bed.ctx(0).stats().unwrap());
        let mut idle = true;
        for (q, (a, b)) in pairs.iter().enumerate() {
            while posted[q] < msgs && posted[q] - done[q] < DEPTH {
                let off = posted[q] * MSG;
                let sg = [a.mr.sge(off, MSG)];
                a.qp.post_send(&[SendWr::write(posted[q] as u64, &sg, b.mr.addr + off as u64, b.mr.rkey)]).unwrap();
                posted[q] += 1;
            }
            let n = a.scq.poll(&mut wcs).unwrap();
            for w in &wcs[..n] {
                assert_eq!(w.status, WcStatus::Success, "QP {q}: {w:?}\n{}", bed.ctx(0).stats().unwrap());
                assert_eq!(w.wr_id as usize, done[q], "QP {q}: completions in order");
                done[q] += 1;
            }
            idle &= n == 0;
        }
        if idle {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let after = qdisc_counters(&bed, 0);
    let stats = bed.ctx(0).stats().unwrap();
    for (q, (a, b)) in pairs.iter().enumerate() {
        assert!(a.buf.read(0, PER_QP) == b.buf.read(0, PER_QP), "QP {q}: the written bytes arrived");
    }
    let payload = (QPS * PER_QP) as f64;
    let goodput = payload * 8.0 / secs / 1e6;
    let wire = (after.0 - before.0) as f64;
    let dropped = after.2 - before.2;
    eprintln!(
        "rate_cap: {goodput:.1} Mbit/s of {CAP_MBIT} in {secs:.2} s; qdisc sent {:.3} x the payload, dropped {dropped} of {} packets; rnicd {stats}",
        wire / payload,
        after.1 - before.1
    );
    let counter = |s: &serde_json::Value, k: &str| s[k].as_u64().unwrap_or_else(|| panic!("no {k} in {s}"));
    // The windows may keep the queue from ever overflowing; if it did, rnicd saw it.
    assert!(
        dropped == 0 || counter(&stats, "local_drops") > counter(&stats_before, "local_drops"),
        "rnicd saw the qdisc's refusals: {stats}"
    );
    assert!(counter(&stats, "window_cuts") > counter(&stats_before, "window_cuts"), "the windows were cut: {stats}");
    assert_eq!(counter(&stats, "send_errors"), counter(&stats_before, "send_errors"), "refused packets were kept, not dropped: {stats}");
}
