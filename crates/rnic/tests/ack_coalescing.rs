//! ACK coalescing between two testbed hosts: unsignaled messages ask for an
//! ACK only now and then (signaled ones always do), and the responder
//! acknowledges the rest by its ACK timer, so a requester that stops after
//! unsignaled messages hears about them without resending anything.
mod common;
use common::*;
use std::time::Instant;
use verbs::*;

fn stat(ctx: &Context, key: &str) -> u64 {
    ctx.stats().unwrap()[key].as_u64().unwrap_or(0)
}

#[test]
fn unsignaled_stream_needs_few_acks_and_no_nak() {
    let bed = Bed::new("rnack", 2);
    let (a, b) = pair(&bed, 0, 1, ConnectOpts::default());
    let data = pattern(3, 64 * 1000);
    a.buf.write(0, &data);
    let acks0 = stat(&b.ctx, "tx_packets");
    let drops0 = bed.kernel_drops();

    // 1,000 unsignaled one-packet WRITEs, then one signaled: when it
    // completes, every earlier one was acknowledged (in order).
    let n = 1000u64;
    for i in 0..=n {
        let off = (i.min(n - 1) * 64) as usize;
        let sg = [a.mr.sge(off, 64)];
        let mut wr = SendWr::write(i, &sg, b.mr.addr + off as u64, b.mr.rkey);
        if i < n {
            wr = wr.unsignaled();
        }
        while a.qp.post_send(&[wr]).is_err() {
            std::thread::yield_now();
        }
    }
    let w = ok(&a.scq);
    assert_eq!(w.wr_id, n);
    assert_eq!(b.buf.read(0, data.len()), data);
    let acks = stat(&b.ctx, "tx_packets") - acks0;
    assert!(acks < n / 2, "{acks} ACK packets for {n} unsignaled messages: not coalesced");
    // Unless the kernel dropped a packet on the way (a receive buffer or
    // backlog overflowing on a host too loaded to run rnicd in time), a NAK
    // asks for a resend only where a loaded host's veth delivered packets
    // out of order (see stream_acks.rs): at most one per thousand packets,
    // where a NAK per coalesced ACK would be hundreds. The requester's loss
    // probe (4 ms at least, far beyond the responder's 100 us ACK timer)
    // can also fire when the responder's host does not run its rnicd for
    // that long (a loaded CI host): every resend starts from a NAK or such
    // a probe.
    let drops = bed.kernel_drops() - drops0 + stat(&b.ctx, "rx_malformed") + stat(&b.ctx, "rx_bad_icrc");
    if drops == 0 {
        let (naks, received) = (stat(&b.ctx, "seq_naks_sent"), stat(&b.ctx, "rx_packets"));
        assert!(naks * 1000 <= received, "{naks} NAKs without loss for {received} packets: {}", b.ctx.stats().unwrap());
        let (rewinds, probes) = (stat(&a.ctx, "retransmit_rewinds"), stat(&a.ctx, "loss_probes"));
        assert!(rewinds <= naks + probes, "{rewinds} rewinds without a NAK or a loss probe: {}", a.ctx.stats().unwrap());
    }
}

#[test]
fn lone_unsignaled_message_is_acknowledged_by_the_responder_timer() {
    let bed = Bed::new("rnackt", 2);
    // No retransmission timer (timeout 0), so no loss probe: the
    // responder's ACK timer is the only thing that can answer, however
    // late a loaded host runs it.
    let (a, b) = pair(&bed, 0, 1, ConnectOpts { timeout: 0, ..Default::default() });
    for round in 0..3u64 {
        let acks0 = stat(&b.ctx, "tx_packets");
        a.buf.write(0, &round.to_le_bytes());
        a.qp.post_send(&[SendWr::write(round, &[a.mr.sge(0, 8)], b.mr.addr, b.mr.rkey).unsignaled()]).unwrap();
        // Nothing else is posted: only the responder's ACK timer can answer.
        let t0 = Instant::now();
        while stat(&b.ctx, "tx_packets") == acks0 {
            assert!(t0.elapsed() < T, "no ACK for a lone unsignaled WRITE");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(b.buf.read_u64(0), round);
        assert_eq!(stat(&b.ctx, "dup_requests"), 0, "the WRITE was resent before it was acknowledged");
        assert_eq!(stat(&a.ctx, "retransmit_rewinds"), 0);
    }
}
