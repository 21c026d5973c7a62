//! A sequence NAK for the PSN the requester went back to less than a
//! round trip before is a duplicate (a NAK or a response gap that left the
//! responder before the resend reached it): it does not rewind again, and
//! `seq_naks_ignored` counts it. One that comes a round trip later says
//! the resend was lost too (or the responder resumed, maybe on another
//! host) and rewinds (`Qp::rewound_lately`). Engine in the test process,
//! the responder played by the test.
mod common;
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use common::direct::{self, Path, SendRing};
use rnic::engine::Engine;
use rnic::types::Mtu;
use rnic::wire::{self, Aeth, Flow, Headers, NakCode, Opcode, Syndrome, ROCE_PORT};

const LOCAL: Ipv4Addr = Ipv4Addr::new(10, 9, 4, 1);
const PEER: Ipv4Addr = Ipv4Addr::new(10, 9, 4, 2);

#[test]
fn a_sequence_nak_within_a_round_trip_of_the_rewind_is_a_duplicate() {
    let mut e = Engine::new(LOCAL);
    let mut keep = Vec::new();
    let r = direct::readable(&mut e, 4096, &mut keep);
    let path = Path { peer: PEER, dest_qpn: 0x77, rq_psn: 0, mtu: Mtu::M1024, max_dest_rd_atomic: 1, timeout: 14 };
    let qpn = direct::rts_qp(&mut e, r.pd, r.cq, &path, &mut keep);
    let mut sq = SendRing::new(&keep[keep.len() - 2]);
    for k in 0..2 {
        sq.post_write(k, r.rkey, 512, 0x1000, 0x99);
    }
    let t = Instant::now();
    e.poll_tx(64, t);
    let out = std::mem::take(&mut e.tx.pkts);
    assert_eq!(out.len(), 2, "both WRITEs leave");
    let back = Flow { src: LOCAL, dst: PEER, sport: out[0].sport, dport: ROCE_PORT };
    let first = wire::parse(&out[0].buf[..out[0].len], Some(&back)).unwrap().bth.psn;

    let flow = Flow { src: PEER, dst: LOCAL, sport: 0xc001, dport: ROCE_PORT };
    let mut nak = Headers::new(Opcode::Ack, qpn, first);
    nak.aeth = Some(Aeth { syndrome: Syndrome::Nak(NakCode::PsnSeqError), msn: 0 });
    let nak = wire::build(&flow, &nak, &[]);
    let stat = |e: &Engine, k: &str| serde_json::to_value(&e.stats).unwrap()[k].as_u64().unwrap();
    // Before any round trip was timed, the round trip counts as 20 ms.
    for (ms, rewinds, ignored) in [(1, 1, 0), (2, 1, 1), (10, 1, 2), (40, 2, 2)] {
        let at = t + Duration::from_millis(ms);
        e.on_packet_at(&nak, PEER, flow.sport, at, at);
        assert_eq!((stat(&e, "retransmit_rewinds"), stat(&e, "seq_naks_ignored")), (rewinds, ignored), "the NAK at {ms} ms");
    }
}
