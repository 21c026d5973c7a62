//! WRITE payloads sent in place (docs/rnic.md, "WRITE payloads leave in
//! place on their first transmission"): the first transmission of a WRITE packet leaves from the
//! source's memory region, its ICRC computed there before the kernel copies
//! the bytes. A payload the owner rewrites in between leaves with a bad
//! ICRC; the receiver must drop it, and the resend (a copy) must repair it.
mod common;
use common::*;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use verbs::*;

/// Bytes written, and the packet payload (path MTU 1024 on a 1500-byte link).
const LEN: usize = 32 << 20;
const CHUNK: usize = 1024;

/// A buffer the test keeps rewriting while rnicd sends it, as a guest
/// rewrites its pages under migration: one aligned 8-byte counter per
/// packet payload, bumped with atomic stores, so every state of each
/// payload is whole (the pattern with some counter value) and any other
/// bytes at the destination are damage. The WRITE must complete, the
/// receiver must have dropped payloads changed after their ICRC (so the
/// race was there and was repaired), and every payload must arrive whole.
#[test]
fn a_payload_rewritten_under_its_first_send_arrives_whole() {
    let bed = Bed::new("rnzc", 2);
    let (a, b) = pair_sized(&bed, 0, 1, ConnectOpts { mtu: Mtu::M1024, ..Default::default() }, LEN, 16);
    let base = pattern(23, LEN);
    a.buf.write(0, &base);
    let counter_at = |c: usize| c * CHUNK + 8 * (c % (CHUNK / 8));
    // Whether a payload changes between its ICRC and the kernel's copy is
    // a race of two CPUs; a run can miss it. Every attempt must deliver
    // whole payloads; the race must show in one of a few attempts.
    const ATTEMPTS: usize = 5;
    let (mut bad, mut rounds) = (0, 0);
    for attempt in 1..=ATTEMPTS {
        (bad, rounds) = rewrite_under_one_write(&bed, &a, &b, &base, counter_at);
        if bad > 0 {
            break;
        }
        eprintln!("attempt {attempt}: no payload changed under its first send in {rounds} rounds of rewriting");
    }
    assert!(bad > 0, "no payload changed under its first send in {ATTEMPTS} attempts; sender: {}", bed.ctx(0).stats().unwrap());
    eprintln!("{bad} payloads dropped for a bad ICRC and resent, {rounds} rounds of rewriting");
}

/// One WRITE of the whole buffer while a thread keeps rewriting its
/// counters; checks that it completes and that every payload arrived
/// whole. Returns the payloads the receiver dropped for a bad ICRC and the
/// rounds of rewriting.
fn rewrite_under_one_write(
    bed: &Bed,
    a: &End,
    b: &End,
    base: &[u8],
    counter_at: impl Fn(usize) -> usize + Send + Copy + 'static,
) -> (u64, u64) {
    for c in 0..LEN / CHUNK {
        a.buf.write_u64(counter_at(c), 0);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let ptr = a.buf.as_ptr() as usize;
    let writer = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut round = 0u64;
            while !stop.load(Ordering::Relaxed) {
                round += 1;
                for c in 0..LEN / CHUNK {
                    // SAFETY: an aligned word inside the buffer, which the
                    // test keeps mapped until the thread is joined; rnicd
                    // only reads it.
                    let w = unsafe { &*((ptr + counter_at(c)) as *const AtomicU64) };
                    w.store(round, Ordering::Relaxed);
                }
            }
            round
        })
    };
    let before = bed.ctx(1).stats().unwrap();
    let sg = [a.mr.sge(0, LEN)];
    a.qp.post_send(&[SendWr::write(1, &sg, b.mr.addr, b.mr.rkey)]).unwrap();
    let w = one(&a.scq);
    stop.store(true, Ordering::Relaxed);
    let rounds = writer.join().unwrap();
    assert_eq!(w.status, WcStatus::Success, "{w:?}\n{}", bed.ctx(0).stats().unwrap());
    let st = bed.ctx(1).stats().unwrap();
    let bad = st["rx_bad_icrc"].as_u64().unwrap() - before["rx_bad_icrc"].as_u64().unwrap();
    let got = b.buf.read(0, LEN);
    for c in 0..LEN / CHUNK {
        let at = counter_at(c);
        let v = u64::from_ne_bytes(got[at..at + 8].try_into().unwrap());
        assert!(v <= rounds, "payload {c}: counter {v} was never written (last {rounds})");
        let (lo, hi) = (c * CHUNK, (c + 1) * CHUNK);
        assert!(got[lo..at] == base[lo..at] && got[at + 8..hi] == base[at + 8..hi], "payload {c} arrived damaged");
    }
    (bad, rounds)
}
