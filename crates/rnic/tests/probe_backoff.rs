//! Karn's rule for the loss probe and the retransmission timer: once one
//! fired, its backoff stays until a packet sent only once is answered,
//! which gives a round trip to time the next one by. A QP whose answers
//! come later than its first probe (20 ms before any sample) therefore
//! probes once, not for every message: clearing the backoff on any answer
//! had it resend each window and void each round trip sample, for ever.
//! Likewise a QP answered later than its IB timeout, though always
//! answered, times out once and then waits as long as its answers take.
//! Engine in the test process, the peer played by the test with answers at
//! chosen times.
mod common;
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use common::direct::{self, Path, SendRing};
use rnic::engine::Engine;
use rnic::types::Mtu;
use rnic::wire::{self, Aeth, Flow, Headers, Opcode, Syndrome, ROCE_PORT};

const LOCAL: Ipv4Addr = Ipv4Addr::new(10, 9, 3, 1);
const PEER: Ipv4Addr = Ipv4Addr::new(10, 9, 3, 2);
const PEER_QPN: u32 = 0x77;

/// What a QP with IB timeout `timeout` that sends `writes` WRITEs one
/// after another, each ACKed `answer` after it left, ends with; its probes
/// and timeouts resend, and their answers are never needed.
struct Outcome {
    probes: u64,
    timeouts: u64,
    /// The smoothed round trip (µs).
    srtt: f64,
}

fn run(timeout: u8, answer: Duration, writes: u64) -> Outcome {
    let mut e = Engine::new(LOCAL);
    let mut keep = Vec::new();
    let r = direct::readable(&mut e, 4096, &mut keep);
    let path = Path { peer: PEER, dest_qpn: PEER_QPN, rq_psn: 0, mtu: Mtu::M1024, max_dest_rd_atomic: 1, timeout };
    let qpn = direct::rts_qp(&mut e, r.pd, r.cq, &path, &mut keep);
    let mut sq = SendRing::new(&keep[keep.len() - 2]);
    let flow = Flow { src: PEER, dst: LOCAL, sport: 0xc001, dport: ROCE_PORT };
    let mut t = Instant::now();
    for k in 0..writes {
        sq.post_write(k, r.rkey, 512, 0x1000, 0x99);
        e.poll_tx(64, t);
        let sent = direct::sent(&mut e, |w| (w.bth.opcode, w.bth.psn));
        let (opcode, psn) = sent[0];
        assert_eq!(opcode, Opcode::WriteOnly);
        // The QP's timers run just before the answer comes.
        e.poll_tx(64, t + answer - Duration::from_millis(1));
        e.tx.pkts.clear();
        let mut h = Headers::new(Opcode::Ack, qpn, psn);
        h.aeth = Some(Aeth { syndrome: Syndrome::Ack(0x1f), msn: k as u32 + 1 });
        let at = t + answer;
        e.on_packet_at(&wire::build(&flow, &h, &[]), PEER, flow.sport, at, at);
        t = at + Duration::from_millis(1);
    }
    let srtt = e.qp(qpn).unwrap().debug_state(t)["requester"]["srtt_us"].as_f64().unwrap();
    Outcome { probes: e.stats.loss_probes, timeouts: e.stats.timeouts, srtt }
}

/// Timeout 14: the IB timer (67 ms) stays out of the way of the answers.
const LONG_TIMEOUT: u8 = 14;

#[test]
fn answers_later_than_the_first_probe_stop_the_probes() {
    let o = run(LONG_TIMEOUT, Duration::from_millis(30), 10);
    assert_eq!(o.probes, 1, "one probe at 20 ms, then backed off until a round trip was timed");
    assert_eq!(o.timeouts, 0);
    assert!((29_000.0..=31_000.0).contains(&o.srtt), "the 30 ms round trip was timed: srtt {} us", o.srtt);
}

#[test]
fn prompt_answers_never_probe() {
    let o = run(LONG_TIMEOUT, Duration::from_millis(2), 10);
    assert_eq!((o.probes, o.timeouts), (0, 0));
    assert!((1_900.0..=2_100.0).contains(&o.srtt), "srtt {} us", o.srtt);
}

#[test]
fn answers_later_than_the_ib_timeout_stretch_the_timer() {
    // Timeout 12: 16.8 ms, under the 25 ms the answers take (and under
    // the probe's first 20 ms, so no probe runs).
    let o = run(12, Duration::from_millis(25), 10);
    assert_eq!(
        o.timeouts, 1,
        "the first write times out; the backed-off timer lets the second be timed, and then the timer waits as long as answers take"
    );
    assert_eq!(o.probes, 0);
    assert!((24_000.0..=26_000.0).contains(&o.srtt), "the 25 ms round trip was timed: srtt {} us", o.srtt);
}
