//! `workload=pvrdma-bench gid=A.B.C.D`: the guest side of `bench/pvrdma/run`.
//!
//! Two RC QPs to `transit rdma peer` (which sees `bench=1` in our IDs and
//! answers as a bench responder, crates/verbs/src/peer/bench.rs): one that
//! RDMA-WRITEs into the peer's buffer, one that ping-pongs SENDs. After the
//! ID exchange the guest takes its orders from the host through the
//! mailbox, one at a time, so the bench can alternate it with bare-metal
//! runs on the same hosts:
//!
//! - `write size=S secs=T depth=D`: WRITEs of S bytes (at most 1 MiB), D
//!   in flight, every one signaled, for T seconds; answers `result
//!   test=write size=S bytes=B ns=N wqes=W post_ns=P` where P is the
//!   guest's own time spent posting (building the WQE and ringing the
//!   doorbell) over all W WQEs;
//! - `lat size=S iters=N`: N SEND round trips of S bytes, every ping
//!   signaled and its completion taken before the next; answers `result
//!   test=lat size=S iters=N p50_ns= p99_ns= avg_ns= irq_waits=`, each
//!   sample half a round trip as `ib_send_lat` counts it; `irq_waits` is
//!   how many times the guest halted for a CQ interrupt.
//!
//! Either order takes `wait=1` (the default), `wait=2` or `wait=0`: how
//! the guest waits for completions: by interrupt (`Cq::wait`: arm the CQ,
//! HLT until its notification), in the device with the WAIT doorbell
//! (`Cq::wait_doorbell`), or spinning on POLL doorbells (`Cq::poll`, as
//! `pvrdma_poll_cq` in a busy-polling application). With `wait=2` the
//! latency test's pings wait in their own SEND doorbell
//! (`Qp::post_send_wait`), one MMIO exit per round trip.

use super::workloads::{fail, parse_ip, PeerInfo};
use super::{Cq, Op, Qp, Remote};
use crate::args::Args;
use crate::hw::Platform;
use crate::mailbox::TextBuf;
use crate::nvme::Region;
use core::fmt::Write;
use pvrdma_abi::ib::{wc_opcode, wc_status};

const MAX_SIZE: u64 = 1 << 20;
const DEPTH: u32 = 64;
const MAX_ITERS: u64 = 100_000;

pub fn run(plat: Platform, args: &Args, boot: &crate::boot::BootInfo) -> ! {
    let Some(gid) = args.get("gid").and_then(parse_ip) else {
        println!("pvrdma-bench: FAIL give the VM's GID as gid=A.B.C.D");
        plat.exit(2)
    };
    let mut region = Region { next: boot.firmware_end, end: boot.ram_size };
    let Some(mut mb) = crate::mailbox::Mailbox::find(boot.mmio_base) else {
        println!("pvrdma-bench: FAIL no mailbox page");
        plat.exit(1)
    };
    let mut dev = super::Device::init(plat, &mut region, gid).unwrap_or_else(|e| fail(plat, "bring-up", e));
    let pd = dev.create_pd().unwrap_or_else(|e| fail(plat, "CREATE_PD", e));
    // The WRITE source (1 MiB), then the ping-pong's send and receive
    // buffers, then the latency samples.
    let samples_len = MAX_ITERS * 4;
    let len = MAX_SIZE + 2 * 4096 + samples_len;
    let buf = region.alloc(len).unwrap_or_else(|| fail(plat, "memory", super::Error::NoMemory));
    let (ping, pong, samples) = (buf + MAX_SIZE, buf + MAX_SIZE + 4096, buf + MAX_SIZE + 8192);
    let mr = dev.reg_mr(&mut region, pd, buf, len, pvrdma_abi::ib::access::LOCAL_WRITE).unwrap_or_else(|e| fail(plat, "CREATE_MR", e));
    let mut make = || {
        let cq = dev.create_cq(&mut region, 2 * DEPTH).unwrap_or_else(|e| fail(plat, "CREATE_CQ", e));
        let qp = dev.create_qp(&mut region, pd, &cq, &cq, DEPTH, 1).unwrap_or_else(|e| fail(plat, "CREATE_QP", e));
        (qp, cq)
    };
    let (wqp, wcq) = make();
    let (lqp, lcq) = make();
    // A CQ no QP completes into: waiting for the next order, the guest
    // sleeps in its WAIT doorbell (1 ms at a time) instead of spinning on
    // the mailbox, which would hold one of the host's cores while the
    // bench measures bare metal beside it.
    let idle = dev.create_cq(&mut region, 1).unwrap_or_else(|e| fail(plat, "CREATE_CQ", e));

    let mut me = TextBuf::<256>::new();
    let _ = write!(
        me,
        "bench=1 gid={}.{}.{}.{} write.qpn={} write.psn=1 lat.qpn={} lat.psn=2",
        gid[0], gid[1], gid[2], gid[3], wqp.qpn, lqp.qpn
    );
    mb.publish(me.as_bytes());
    let mut pbuf = [0u8; 0x700];
    let (mut host_seq, plen) = mb.wait_host(0, &mut pbuf);
    let ptext = core::str::from_utf8(&pbuf[..plen]).unwrap_or("");
    let peer = PeerInfo(ptext);
    let (Some(pgid), Some(addr), Some(rkey)) = (peer.get("gid").and_then(parse_ip), peer.num("big.addr"), peer.num("big.rkey")) else {
        println!("pvrdma-bench: FAIL the peer's message lacks gid=, big.addr= or big.rkey=: {}", ptext);
        plat.exit(1)
    };
    for (qp, w) in [(&wqp, "write"), (&lqp, "lat")] {
        let mut k = TextBuf::<16>::new();
        let _ = write!(k, "{w}.qpn");
        let qpn = peer.num(core::str::from_utf8(k.as_bytes()).unwrap()).unwrap_or(0) as u32;
        let mut k = TextBuf::<16>::new();
        let _ = write!(k, "{w}.psn");
        let psn = peer.num(core::str::from_utf8(k.as_bytes()).unwrap()).unwrap_or(0) as u32;
        let my_psn = if w == "write" { 1 } else { 2 };
        dev.connect(qp, &Remote { gid: pgid, qpn, psn, my_psn }).unwrap_or_else(|e| fail(plat, "MODIFY_QP", e));
    }
    for k in 0..DEPTH as u64 / 2 {
        lqp.post_recv(k, &[mr.sge(pong, 4096)]).unwrap_or_else(|e| fail(plat, "post_recv", e));
    }
    println!("pvrdma-bench: connected; waiting for orders in the mailbox");
    mb.publish(b"ready");

    let mut b = Bench { plat, mr: &mr, src: buf, ping, pong, samples, raddr: addr, rkey: rkey as u32, wait: Wait::Interrupt };
    loop {
        let (seq, n) = loop {
            if let Some(m) = mb.host_message(host_seq, &mut pbuf) {
                break m;
            }
            let _ = idle.wait_doorbell();
        };
        host_seq = seq;
        let order = PeerInfo(core::str::from_utf8(&pbuf[..n]).unwrap_or(""));
        let mut out = TextBuf::<256>::new();
        let size = order.num("size").unwrap_or(0);
        b.wait = match order.num("wait").unwrap_or(1) {
            0 => Wait::Spin,
            2 => Wait::Doorbell,
            _ => Wait::Interrupt,
        };
        if order.0.starts_with("write ") && (1..=MAX_SIZE).contains(&size) {
            let secs = order.num("secs").unwrap_or(1).clamp(1, 60);
            let depth = order.num("depth").unwrap_or(32).clamp(1, DEPTH as u64 - 1);
            let r = b.write_bw(&wqp, &wcq, size, secs * 1_000_000_000, depth);
            let _ = write!(out, "result test=write size={size} bytes={} ns={} wqes={} post_ns={}", r.0, r.1, r.2, r.3);
        } else if order.0.starts_with("lat ") && (1..=4096).contains(&size) {
            let iters = order.num("iters").unwrap_or(1000).clamp(1, MAX_ITERS);
            let halts = super::CQ_IRQ_WAITS.load(core::sync::atomic::Ordering::Relaxed);
            let (p50, p99, avg) = b.send_lat(&lqp, &lcq, size, iters);
            let halts = super::CQ_IRQ_WAITS.load(core::sync::atomic::Ordering::Relaxed) - halts;
            let _ = write!(out, "result test=lat size={size} iters={iters} p50_ns={p50} p99_ns={p99} avg_ns={avg} irq_waits={halts}");
        } else {
            let _ = write!(out, "error unknown order (write size=1..1048576 secs= depth=, lat size=1..4096 iters=)");
        }
        mb.publish(out.as_bytes());
    }
}

struct Bench<'a> {
    plat: Platform,
    mr: &'a super::Mr,
    src: u64,
    ping: u64,
    pong: u64,
    samples: u64,
    raddr: u64,
    rkey: u32,
    wait: Wait,
}

/// How the bench waits for a completion it needs before going on.
#[derive(Clone, Copy, PartialEq)]
enum Wait {
    Spin,
    Interrupt,
    Doorbell,
}

impl Bench<'_> {
    /// The next completion of `cq`: when `block`, and the bench waits
    /// rather than spins, sleeping in the device until one comes.
    fn next(&self, cq: &Cq, block: bool) -> Option<super::Cqe> {
        let r = match (block, self.wait) {
            (true, Wait::Interrupt) => cq.wait(),
            (true, Wait::Doorbell) => cq.wait_doorbell(),
            _ => cq.poll(),
        };
        r.unwrap_or_else(|e| fail(self.plat, "poll", e))
    }

    /// (bytes completed, ns, WQEs posted, ns spent posting).
    fn write_bw(&self, qp: &Qp, cq: &Cq, size: u64, ns: u64, depth: u64) -> (u64, u64, u64, u64) {
        let plat = self.plat;
        let (mut posted, mut done, mut post_ns) = (0u64, 0u64, 0u64);
        let t0 = plat.now_ns();
        let mut now = t0;
        while now - t0 < ns || done < posted {
            if now - t0 < ns && posted - done < depth {
                // One clock read per batch: reading the clock is an exit too.
                let p0 = plat.now_ns();
                let mut n = 0;
                while posted - done < depth {
                    let op = Op::Write { raddr: self.raddr, rkey: self.rkey };
                    if qp.post_send(posted, op, &[self.mr.sge(self.src, size as u32)], true).is_err() {
                        break;
                    }
                    posted += 1;
                    n += 1;
                }
                if n > 0 {
                    post_ns += plat.now_ns() - p0;
                }
            }
            // Nothing more to post: sleep for the next completion.
            let full = posted - done >= depth || now - t0 >= ns;
            let mut block = full;
            while let Some(w) = self.next(cq, block) {
                block = false;
                if w.status != wc_status::SUCCESS {
                    println!("pvrdma-bench: WRITE {} failed with status {}", w.wr_id, w.status);
                    plat.exit(1)
                }
                done += 1;
            }
            now = plat.now_ns();
        }
        (done * size, now - t0, posted, post_ns)
    }

    /// SEND round trips: (p50, p99, average) in ns.
    fn send_lat(&self, qp: &Qp, cq: &Cq, size: u64, iters: u64) -> (u64, u64, u64) {
        let plat = self.plat;
        // SAFETY: `samples` is our RAM for MAX_ITERS u32s.
        let samples = unsafe { core::slice::from_raw_parts_mut(self.samples as *mut u32, iters as usize) };
        let mut total = 0u64;
        for s in samples.iter_mut() {
            // Every ping is signaled, as ib_send_lat and `transit rdma
            // send-lat` post theirs: a signaled SEND asks the peer for its
            // ACK at once, where an unsignaled one would wait for the
            // responder's ACK timer (docs/ibverbs.md, "Benchmark"). Its
            // completion is collected before the next ping is posted; the
            // sample ends at the pong.
            let ping = [self.mr.sge(self.ping, size as u32)];
            let t0 = plat.now_ns();
            // With the WAIT doorbell the SEND's own doorbell waits for the
            // pong (one MMIO exit for both), and carries the receive
            // reposted after the last pong.
            let mut first = if self.wait == Wait::Doorbell {
                qp.post_send_wait(0, Op::Send, &ping, true, cq).unwrap_or_else(|e| fail(plat, "post_send", e))
            } else {
                qp.post_send(0, Op::Send, &ping, true).unwrap_or_else(|e| fail(plat, "post_send", e));
                None
            };
            let (mut sent, mut got, mut dt) = (false, false, 0);
            while !(sent && got) {
                // Sleep for the first completion, then take what else came.
                let mut block = true;
                while let Some(w) = first.take().or_else(|| self.next(cq, block)) {
                    block = false;
                    if w.status != wc_status::SUCCESS {
                        println!("pvrdma-bench: SEND round trip failed with status {}", w.status);
                        plat.exit(1)
                    }
                    if w.opcode == wc_opcode::RECV {
                        dt = plat.now_ns() - t0;
                        got = true;
                        // Its doorbell rings with the next ping's: the peer
                        // sends nothing before that ping.
                        qp.post_recv_later(w.wr_id, &[self.mr.sge(self.pong, 4096)]).unwrap_or_else(|e| fail(plat, "post_recv", e));
                    } else {
                        sent = true;
                    }
                    if sent && got {
                        break;
                    }
                }
            }
            // Half the round trip (the pong's arrival), as ib_send_lat and
            // `transit rdma send-lat` report it.
            let dt = dt / 2;
            *s = dt.min(u32::MAX as u64) as u32;
            total += dt;
        }
        samples.sort_unstable();
        let pick = |q: u64| samples[((iters - 1) * q / 100) as usize] as u64;
        (pick(50), pick(99), total / iters)
    }
}
