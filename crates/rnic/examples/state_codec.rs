//! What the 256 QP states of a migration's switch cost to write and read
//! in each spilled-message format (`rnic::proto::spill::Format`): size, and the
//! best of 50 encodes and decodes. States shaped like the PVRDMA bench's
//! (a quarter of the QPs with READs replayable, a quarter with atomics).
//! `cargo run --release -p rnic --example state_codec`

use rnic::proto::spill::Format;
use rnic::proto::{Reply, Response};
use rnic::qp_snapshot::*;
use rnic::types::{QpAttr, QpState};
use std::time::Instant;

fn main() {
    let states: Vec<QpSnapshot> = (0..256u32)
        .map(|i| {
            let attr = QpAttr {
                qp_state: QpState::Rts,
                dest_gid: "10.200.0.3".parse().unwrap(),
                dest_qp_num: 0x6d117 + i,
                rq_psn: 0xabc123,
                sq_psn: 0x7f1234,
                max_rd_atomic: 16,
                max_dest_rd_atomic: 16,
                min_rnr_timer: 12,
                timeout: 14,
                rnr_retry: 7,
                ..Default::default()
            };
            let mut rt = QpRuntime {
                next_psn: 0x7f1234 + i * 977,
                una: 0x7f1234 + i * 977,
                tx_psn: 0x7f1234 + i * 977,
                max_sent: 0x7f1234 + i * 977,
                retry_left: 7,
                rnr_left: 7,
                cwnd: 64,
                epsn: 0xabc123 + i * 1313,
                msn: 0x12345 + i,
                sq_retired: 123456 + i as u64,
                rq_retired: 654321,
                ..Default::default()
            };
            if i % 4 == 2 {
                for k in 0..16u32 {
                    rt.read_history.push_back(ReadExec {
                        psn: 0xabc000 + k * 64,
                        last: 0xabc000 + k * 64 + 63,
                        rkey: 0x1234_5600 + k,
                        key_gen: Some(3),
                    });
                }
            }
            if i % 4 == 3 {
                for k in 0..16u32 {
                    rt.atomic_results.push_back((0xabc000 + k, 0x1234_5678_9abc_def0 + k as u64));
                }
            }
            QpSnapshot { version: QP_SNAPSHOT_VERSION, qpn: 0x2000 + i, attr, runtime: rt }
        })
        .collect();
    let resp: Response = Ok(Reply::QpStates(states));
    for f in [Format::Json, Format::Bincode] {
        let b = f.encode(&resp).unwrap();
        let (mut enc, mut dec) = (f64::MAX, f64::MAX);
        for _ in 0..50 {
            let t = Instant::now();
            let x = f.encode(&resp).unwrap();
            enc = enc.min(t.elapsed().as_secs_f64() * 1e3);
            let t = Instant::now();
            let _r: Response = f.decode(&x).unwrap();
            dec = dec.min(t.elapsed().as_secs_f64() * 1e3);
        }
        println!("{f:?}: {} bytes, encode {enc:.3} ms, decode {dec:.3} ms (best of 50)", b.len());
    }
}
