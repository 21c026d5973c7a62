//! Receive moderation and coalesced ACKs (`daemon::holdoff`): a stream
//! paced by a capped link is received in batches after hold-offs and
//! acknowledged once per batch; a packet lost inside such a batch is still
//! recovered by go-back-N with every byte in place; a ping-pong of
//! single-packet messages is never held off. The rnicds hold off a fixed
//! 200 µs during every stream (`RNICD_HOLDOFF_FIXED`): whether the
//! adaptive hold-off engages depends on how the link spaces the packets
//! and on the load, what a hold-off does with a stream does not.
mod common;
use common::*;
use std::time::Instant;
use verbs::*;

/// The rate cap of the receiving host's link: a 1 KiB packet about every
/// 45 µs, so that the receiver would wake for each one.
const CAP_MBIT: u32 = 200;
const MSG: usize = 64 << 10;
const TOTAL: usize = 8 << 20;
const DEPTH: usize = 16;

/// Every rnicd of these tests holds off a fixed 200 µs during streams.
fn fixed_holdoff() {
    // SAFETY: every test sets the same value before its rnicds start.
    unsafe {
        std::env::set_var("RNICD_HOLDOFF_FIXED", "1");
        std::env::set_var("RNICD_HOLDOFF_US", "200");
    }
}

fn stat(ctx: &Context, key: &str) -> u64 {
    ctx.stats().unwrap()[key].as_u64().unwrap_or_else(|| panic!("no {key} in the stats"))
}

/// The counters `keys` of `ctx`'s rnicd now.
fn stats(ctx: &Context, keys: &[&str]) -> Vec<u64> {
    let s = ctx.stats().unwrap();
    keys.iter().map(|k| s[*k].as_u64().unwrap_or_else(|| panic!("no {k} in {s}"))).collect()
}

const KEYS: &[&str] = &["loop_holdoffs", "loop_holdoff_packets", "rx_packets", "ack_packets_sent", "retransmit_rewinds", "seq_naks_sent"];

/// Streams TOTAL bytes of 64 KiB WRITEs from host 0 to host 1 over a link
/// capped at CAP_MBIT, with `loss_pct`% of host 1's packets dropped;
/// checks every byte and returns the change of host 1's KEYS (and host
/// 0's rewinds) over the stream.
fn paced_stream(bed: &Bed, loss_pct: f64) -> (Vec<u64>, u64) {
    let o = ConnectOpts { mtu: Mtu::M1024, ..Default::default() };
    let (a, b) = pair_sized(bed, 0, 1, o, TOTAL, DEPTH as u32 * 2);
    let data = pattern(7, TOTAL);
    a.buf.write(0, &data);
    bed.tb.set_rate(1, 0, Some(CAP_MBIT)).unwrap();
    bed.tb.set_loss(1, 0, loss_pct).unwrap();
    let before = stats(&b.ctx, KEYS);
    let rewinds0 = stat(&a.ctx, "retransmit_rewinds");
    let msgs = TOTAL / MSG;
    let (mut posted, mut done) = (0, 0);
    let t0 = Instant::now();
    while done < msgs {
        assert!(t0.elapsed() < T, "stalled at {done} of {msgs}\nA {}\nB {}", a.ctx.stats().unwrap(), b.ctx.stats().unwrap());
        while posted < msgs && posted - done < DEPTH {
            let sg = [a.mr.sge(posted * MSG, MSG)];
            // Every fourth signaled: the others are acknowledged by
            // coalesced ACKs.
            let mut wr = SendWr::write(posted as u64, &sg, b.mr.addr + (posted * MSG) as u64, b.mr.rkey);
            if posted % 4 != 3 && posted + 1 != msgs {
                wr = wr.unsignaled();
            }
            a.qp.post_send(&[wr]).unwrap();
            posted += 1;
        }
        let w = ok(&a.scq);
        done = w.wr_id as usize + 1;
    }
    bed.tb.set_loss(1, 0, 0.0).unwrap();
    bed.tb.set_rate(1, 0, None).unwrap();
    assert!(b.buf.read(0, TOTAL) == data, "the written bytes arrived");
    let after = stats(&b.ctx, KEYS);
    (after.iter().zip(&before).map(|(x, y)| x - y).collect(), stat(&a.ctx, "retransmit_rewinds") - rewinds0)
}

#[test]
fn a_paced_stream_is_received_in_batches_and_acknowledged_per_batch() {
    fixed_holdoff();
    let bed = Bed::new("rxmod", 2);
    let (d, _) = paced_stream(&bed, 0.0);
    let (holdoffs, packets, rx, acks) = (d[0], d[1], d[2], d[3]);
    assert!(holdoffs > 0 && packets > 0, "no hold-off gathered packets of a paced stream: {d:?}");
    assert!(acks * 8 < rx, "{acks} ACKs for {rx} packets: not coalesced ({d:?})");
    assert_eq!((d[4], d[5]), (0, 0), "resends without loss: {d:?}");
}

#[test]
fn a_loss_inside_a_coalesced_batch_is_recovered() {
    fixed_holdoff();
    let bed = Bed::new("rxmodl", 2);
    let (d, rewinds) = paced_stream(&bed, 1.0);
    assert!(d[0] > 0 && d[1] > 0, "no hold-off gathered packets of a paced stream: {d:?}");
    assert!(rewinds > 0 || d[5] > 0, "1% loss and no recovery: rewinds {rewinds}, {d:?}");
}

/// A ping-pong of single-packet SENDs (each side answers the other's
/// message) is never held off: each message is answered at once.
#[test]
fn a_ping_pong_of_single_packet_messages_is_never_held_off() {
    fixed_holdoff();
    let bed = Bed::new("rxmodp", 2);
    let (a, b) = pair(&bed, 0, 1, ConnectOpts::default());
    let h0 = (stat(&a.ctx, "loop_holdoffs"), stat(&b.ctx, "loop_holdoffs"));
    const ROUNDS: u64 = 2000;
    let recv = |e: &End, i: u64| e.qp.post_recv(&[RecvWr { wr_id: i, sg_list: &[e.mr.sge(4096, 64)] }]).unwrap();
    recv(&b, 0);
    recv(&a, 0);
    for i in 0..ROUNDS {
        a.buf.write(0, &i.to_le_bytes());
        a.qp.post_send(&[SendWr::send(i, &[a.mr.sge(0, 8)])]).unwrap();
        let w = ok(&b.rcq);
        assert_eq!(w.byte_len, 8);
        assert_eq!(b.buf.read_u64(4096), i);
        recv(&b, i + 1);
        b.buf.write(0, &i.to_le_bytes());
        b.qp.post_send(&[SendWr::send(i, &[b.mr.sge(0, 8)])]).unwrap();
        ok(&a.rcq);
        assert_eq!(a.buf.read_u64(4096), i);
        recv(&a, i + 1);
        ok(&a.scq);
        ok(&b.scq);
    }
    let h1 = (stat(&a.ctx, "loop_holdoffs"), stat(&b.ctx, "loop_holdoffs"));
    assert_eq!(h1, h0, "hold-offs during a ping-pong of single-packet messages");
}
