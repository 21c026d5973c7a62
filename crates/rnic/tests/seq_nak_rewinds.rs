//! Every sequence NAK rewinds, even one for the PSN the requester went
//! back to a moment before: a responder NAKs a gap once, so a second NAK
//! says the resend was lost too, or that the responder resumed (maybe on
//! another host) and names the PSN it expects (`Qp::on_seq_nak`). Taken
//! as a duplicate within a round trip, such NAKs were ignored after moves
//! at 256 QPs, whose round trips are tens of ms. Engine in the test
//! process, the responder played by the test.
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
fn every_sequence_nak_rewinds() {
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
    let psns = direct::sent(&mut e, |w| w.bth.psn);
    assert_eq!(psns.len(), 2, "both WRITEs leave");
    let first = psns[0];

    let flow = Flow { src: PEER, dst: LOCAL, sport: 0xc001, dport: ROCE_PORT };
    let mut nak = Headers::new(Opcode::Ack, qpn, first);
    nak.aeth = Some(Aeth { syndrome: Syndrome::Nak(NakCode::PsnSeqError), msn: 0 });
    let nak = wire::build(&flow, &nak, &[]);
    let stat = |e: &Engine, k: &str| serde_json::to_value(&e.stats).unwrap()[k].as_u64().unwrap();
    // Before any round trip was timed, the round trip counts as 20 ms:
    // NAKs 1 and 9 ms after the first came within it.
    for (ms, rewinds) in [(1, 1), (2, 2), (10, 3), (40, 4)] {
        let at = t + Duration::from_millis(ms);
        e.on_packet_at(&nak, PEER, flow.sport, at, at);
        assert_eq!(stat(&e, "retransmit_rewinds"), rewinds, "the NAK at {ms} ms rewinds");
    }
}
