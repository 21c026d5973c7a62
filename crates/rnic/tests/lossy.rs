//! Long mixed streams of every operation kind under kernel-level packet loss,
//! duplication and reordering: nothing lost, duplicated or reordered for the
//! application, every byte and every atomic result checked.
mod common;
use common::*;
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::collections::VecDeque;
use std::time::Duration;
use verbs::*;

const REGION: usize = 4 << 20; // B: target of WRITE/READ, shadowed here
const RECV_BASE: usize = 4 << 20; // B: receive buffers
const RECV_SLOT: usize = 8192;
const NRECV: usize = 256;
const SLOT: usize = 64 << 10; // A: per-op source/destination slots
const SLOTS: usize = 64;
const WINDOW: usize = 32;

enum Expect {
    None,
    Read { slot: usize, data: Vec<u8> },
    Atomic { slot: usize, orig: u64 },
}

pub fn mixed_stream(bed: &Bed, ops: usize, seed: u64) {
    let o = ConnectOpts { mtu: Mtu::M1024, timeout: 13, retry_cnt: 7, rnr_retry: 7, min_rnr_timer: 2, ..Default::default() };
    let (a, b) = pair_sized(bed, 0, 1, o, 8 << 20, 512);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut shadow = vec![0u8; REGION];
    let mut counter: u64 = 0; // B's atomic word at offset 0
    let atom_base = SLOTS * SLOT; // A: 8-byte atomic results
    for k in 0..NRECV {
        b.qp.post_recv(&[RecvWr { wr_id: k as u64, sg_list: &[b.mr.sge(RECV_BASE + k * RECV_SLOT, RECV_SLOT)] }]).unwrap();
    }
    let mut pending: VecDeque<(u64, Expect)> = VecDeque::new();
    let mut sends: VecDeque<(u64, usize, bool)> = VecDeque::new();
    let (mut sent_msgs, mut recvd_msgs) = (0usize, 0usize);
    let mut wcs = [Wc::default(); 32];

    let mut drain = |pending: &mut VecDeque<(u64, Expect)>, sends: &mut VecDeque<(u64, usize, bool)>, recvd: &mut usize, until: usize| {
        let t0 = std::time::Instant::now();
        while pending.len() > until || (until == 0 && !sends.is_empty()) {
            assert!(t0.elapsed() < T, "stalled: {} ops pending\nA {}\nB {}", pending.len(), a.ctx.stats().unwrap(), b.ctx.stats().unwrap());
            let n = a.scq.poll(&mut wcs).unwrap();
            for w in &wcs[..n] {
                let (id, exp) = pending.pop_front().expect("completion without a WR");
                assert_eq!(w.wr_id, id, "send completions out of order");
                assert_eq!(
                    w.status,
                    WcStatus::Success,
                    "{w:?}\nA {}\nB {}\n{}\n{}",
                    a.ctx.stats().unwrap(),
                    b.ctx.stats().unwrap(),
                    bed.tb.host(0).sh("grep Udp: /proc/net/snmp; grep -i reasm /proc/net/snmp").unwrap(),
                    bed.tb.host(1).sh("grep Udp: /proc/net/snmp").unwrap()
                );
                match exp {
                    Expect::None => {}
                    Expect::Read { slot, data } => assert!(a.buf.read(slot * SLOT, data.len()) == data, "READ {id} returned wrong data"),
                    Expect::Atomic { slot, orig } => assert_eq!(a.buf.read_u64(atom_base + slot * 8), orig, "atomic {id}"),
                }
            }
            let n = b.rcq.poll(&mut wcs).unwrap();
            for w in &wcs[..n] {
                assert_eq!(w.status, WcStatus::Success, "{w:?}");
                let (id, len, imm_write) = sends.pop_front().expect("a message nobody sent");
                assert_eq!(w.byte_len as usize, len, "message {id}");
                let k = w.wr_id as usize;
                if imm_write {
                    assert_eq!((w.opcode, w.imm_data), (WcOpcode::RecvRdmaWithImm, id as u32), "messages reordered or lost");
                    *recvd += 1;
                    b.qp.post_recv(&[RecvWr { wr_id: k as u64, sg_list: &[b.mr.sge(RECV_BASE + k * RECV_SLOT, RECV_SLOT)] }]).unwrap();
                    continue;
                }
                let got = b.buf.read(RECV_BASE + k * RECV_SLOT, len);
                assert_eq!(u64::from_le_bytes(got[..8].try_into().unwrap()), id, "messages reordered or lost");
                assert!(got[8..] == pattern(id, len - 8)[..], "message {id} payload");
                *recvd += 1;
                b.qp.post_recv(&[RecvWr { wr_id: k as u64, sg_list: &[b.mr.sge(RECV_BASE + k * RECV_SLOT, RECV_SLOT)] }]).unwrap();
            }
            if n == 0 {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    };

    for i in 0..ops as u64 {
        drain(&mut pending, &mut sends, &mut recvd_msgs, WINDOW - 1);
        let slot = i as usize % SLOTS;
        let kind = rng.gen_range(0..10);
        let exp = match kind {
            0..=2 => {
                let len = rng.gen_range(8..=6000);
                let mut msg = i.to_le_bytes().to_vec();
                msg.extend(pattern(i, len - 8));
                a.buf.write(slot * SLOT, &msg);
                let sg = [a.mr.sge(slot * SLOT, len)];
                a.qp.post_send(&[SendWr::send(i, &sg)]).unwrap();
                sends.push_back((i, len, false));
                sent_msgs += 1;
                Expect::None
            }
            3..=5 => {
                let len = rng.gen_range(1..=SLOT);
                let off = rng.gen_range(8..REGION - len);
                let data = pattern(i ^ 0xabc, len);
                a.buf.write(slot * SLOT, &data);
                shadow[off..off + len].copy_from_slice(&data);
                let sg = [a.mr.sge(slot * SLOT, len)];
                // FENCE: an earlier READ of this range must have its data first
                // (IB lets a later WRITE overtake an outstanding READ otherwise).
                let mut wr = SendWr::write(i, &sg, b.mr.addr + off as u64, b.mr.rkey).with_flags(send_flags::FENCE);
                if rng.gen_bool(0.1) {
                    // WRITE with immediate consumes a receive: it is a message too.
                    wr = wr.with_imm(i as u32);
                    sends.push_back((i, len, true));
                }
                a.qp.post_send(&[wr]).unwrap();
                Expect::None
            }
            6..=7 => {
                let len = rng.gen_range(1..=SLOT);
                let off = rng.gen_range(8..REGION - len);
                let sg = [a.mr.sge(slot * SLOT, len)];
                a.qp.post_send(&[SendWr::read(i, &sg, b.mr.addr + off as u64, b.mr.rkey)]).unwrap();
                Expect::Read { slot, data: shadow[off..off + len].to_vec() }
            }
            8 => {
                let add = rng.gen_range(1..1000u64);
                let sg = [a.mr.sge(atom_base + slot * 8, 8)];
                a.qp.post_send(&[SendWr::fetch_add(i, &sg, b.mr.addr, b.mr.rkey, add)]).unwrap();
                let orig = counter;
                counter = counter.wrapping_add(add);
                Expect::Atomic { slot, orig }
            }
            _ => {
                let sg = [a.mr.sge(atom_base + slot * 8, 8)];
                let hit = rng.gen_bool(0.7);
                let cmp = if hit { counter } else { counter.wrapping_add(1) };
                a.qp.post_send(&[SendWr::cmp_swap(i, &sg, b.mr.addr, b.mr.rkey, cmp, counter.wrapping_mul(2).wrapping_add(1))]).unwrap();
                let orig = counter;
                if hit {
                    counter = counter.wrapping_mul(2).wrapping_add(1);
                }
                Expect::Atomic { slot, orig }
            }
        };
        pending.push_back((i, exp));
    }
    drain(&mut pending, &mut sends, &mut recvd_msgs, 0);
    let _ = (sent_msgs, recvd_msgs);
    for h in 0..2 {
        eprintln!("host {h} udp: {}", bed.tb.host(h).sh("grep Udp: /proc/net/snmp").unwrap());
    }
    assert!(b.buf.read(8, REGION - 8) == shadow[8..], "WRITE data differs from the shadow copy");
    assert_eq!(b.buf.read_u64(0), counter, "atomics executed a wrong number of times");
    eprintln!("A {}\nB {}", a.ctx.stats().unwrap(), b.ctx.stats().unwrap());
}

#[test]
fn clean_link_mixed_stream() {
    let bed = Bed::new("rnmix", 2);
    mixed_stream(&bed, 1500, 1);
}

#[test]
fn loss_1pct_mixed_stream() {
    let bed = Bed::new("rnl1", 2);
    bed.tb.set_loss(0, 0, 1.0).unwrap();
    mixed_stream(&bed, 2000, 2);
}

#[test]
fn loss_10pct_mixed_stream() {
    let bed = Bed::new("rnl10", 2);
    bed.tb.set_loss(0, 0, 10.0).unwrap();
    mixed_stream(&bed, 1000, 3);
}

#[test]
fn duplication_and_reordering_mixed_stream() {
    let bed = Bed::new("rndup", 2);
    bed.tb.set_dup(0, 0, 5.0).unwrap();
    bed.tb.set_dup(1, 0, 5.0).unwrap();
    bed.tb.set_reorder(0, 0, 5.0, Duration::from_millis(3)).unwrap();
    bed.tb.set_reorder(1, 0, 5.0, Duration::from_millis(3)).unwrap();
    mixed_stream(&bed, 2000, 4);
    assert!(bed.tb.reordered(0, 0) > 0, "the testbed reordered nothing");
}
