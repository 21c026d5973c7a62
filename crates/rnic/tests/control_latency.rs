//! Control requests stay prompt while rnicd moves packets: with RDMA WRITE
//! streams running on 16 QPs from host 0, a client of host 0's rnicd asks
//! for its stats and queries a QP again and again; every request is
//! answered correctly and the streams complete. Printed (`--nocapture`):
//! the answer times with the control side looked at within rounds of
//! packet work and served every round (the default) and, for comparison,
//! with `RNICD_CONTROL_LOOK_US=0` (served between rounds only) and
//! `RNICD_CONTROL_FIRST=0` as well (served only when the loop looks at all
//! its sockets).
mod common;
use common::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use verbs::*;

const QPS: usize = 16;
const LEN: usize = 64 << 10;
const DEPTH: usize = 32;

/// WRITE streams on every pair until `stop`; returns the WRITEs completed.
fn stream(pairs: &[(End, End)], stop: &AtomicBool) -> u64 {
    let mut posted = vec![0usize; pairs.len()];
    let mut done = 0u64;
    let mut wcs = [Wc::default(); 64];
    while !stop.load(Ordering::Relaxed) || posted.iter().any(|p| *p > 0) {
        for (i, (a, b)) in pairs.iter().enumerate() {
            while !stop.load(Ordering::Relaxed) && posted[i] < DEPTH {
                a.qp.post_send(&[SendWr::write(1, &[a.mr.sge(0, LEN)], b.mr.addr, b.mr.rkey)]).unwrap();
                posted[i] += 1;
            }
            let n = a.scq.poll(&mut wcs).unwrap();
            for w in &wcs[..n] {
                assert_eq!(w.status, WcStatus::Success, "{w:?}");
            }
            posted[i] -= n;
            done += n as u64;
        }
    }
    done
}

/// Round trips of control requests to `ctx` while the streams run.
fn answer_times(ctx: &Context, qp: &Qp, n: usize) -> Vec<Duration> {
    let mut out = Vec::with_capacity(n);
    for k in 0..n {
        let t = Instant::now();
        if k % 2 == 0 {
            let s = ctx.stats().unwrap();
            assert!(s["tx_packets"].as_u64().is_some(), "{s}");
        } else {
            assert_eq!(qp.state().unwrap(), QpState::Rts);
        }
        out.push(t.elapsed());
        std::thread::sleep(Duration::from_millis(2));
    }
    out
}

/// One bed's answer times and WRITEs, its rnicds started with `env`.
fn run(name: &str, env: &[(&str, &str)]) -> (Vec<Duration>, u64) {
    for (k, v) in env {
        // SAFETY: set before the rnicd children start, no other thread reads it.
        unsafe { std::env::set_var(k, v) };
    }
    let bed = Bed::new(name, 2);
    let o = ConnectOpts { mtu: Mtu::M4096, rnr_retry: 7, ..Default::default() };
    let pairs: Arc<Vec<(End, End)>> = Arc::new((0..QPS).map(|_| pair_sized(&bed, 0, 1, o, 1 << 20, DEPTH as u32 * 2)).collect());
    let stop = Arc::new(AtomicBool::new(false));
    let (p, s) = (pairs.clone(), stop.clone());
    let streams = std::thread::spawn(move || stream(&p, &s));
    std::thread::sleep(Duration::from_millis(500));
    let ctx = bed.ctx(0);
    let times = answer_times(&ctx, &pairs[0].0.qp, 400);
    stop.store(true, Ordering::Relaxed);
    let writes = streams.join().unwrap();
    assert!(writes > 0);
    for (k, _) in env {
        // SAFETY: as above; the bed's rnicds have started.
        unsafe { std::env::remove_var(k) };
    }
    (times, writes)
}

fn summary(mut t: Vec<Duration>) -> String {
    t.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    format!("p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms", ms(t[t.len() / 2]), ms(t[t.len() * 99 / 100]), ms(t[t.len() - 1]))
}

#[test]
fn control_requests_are_answered_while_packets_flow() {
    let (within, w2) = run("rnctl2", &[]);
    let (between, w1) = run("rnctl1", &[("RNICD_CONTROL_LOOK_US", "0")]);
    let (later, w0) = run("rnctl0", &[("RNICD_CONTROL_LOOK_US", "0"), ("RNICD_CONTROL_FIRST", "0")]);
    println!("control answer times under {QPS} WRITE streams of {} KiB:", LEN >> 10);
    println!("  looked at within rounds:       {} ({w2} WRITEs)", summary(within));
    println!("  RNICD_CONTROL_LOOK_US=0:       {} ({w1} WRITEs)", summary(between));
    println!("  and RNICD_CONTROL_FIRST=0:     {} ({w0} WRITEs)", summary(later));
}
