//! `workload=nvme-perf [rw=randread|randwrite|read|write] [bs=4096] [qd=1]
//! [queues=1] [secs=5] [ns=1]`: fio-like load; prints IOPS and latency
//! percentiles (guest clock) and exits 0.

use super::{Nvme, Region, Rng, PAGE};
use crate::args::Args;
use crate::hw::Platform;

/// Latency histogram: 100 ns bins below 100 us, then 10 us bins up to ~100 ms.
const FINE_BINS: usize = 1000;
const COARSE_BINS: usize = 10_000;
const BINS: usize = FINE_BINS + COARSE_BINS + 1;

fn bin(ns: u64) -> usize {
    if ns < 100_000 {
        (ns / 100) as usize
    } else {
        (FINE_BINS + ((ns - 100_000) / 10_000) as usize).min(BINS - 1)
    }
}

fn bin_upper_ns(b: usize) -> u64 {
    if b < FINE_BINS {
        (b as u64 + 1) * 100
    } else {
        100_000 + (b - FINE_BINS + 1) as u64 * 10_000
    }
}

fn percentile(hist: &[u32], total: u64, p: u64) -> u64 {
    let want = (total * p).div_ceil(100).max(1);
    let mut seen = 0u64;
    for (b, &c) in hist.iter().enumerate() {
        seen += c as u64;
        if seen >= want {
            return bin_upper_ns(b);
        }
    }
    bin_upper_ns(BINS - 1)
}

pub fn run(plat: Platform, args: &Args, mut region: Region) -> ! {
    let nsid = args.num("ns", 1) as u32;
    let mut n = match Nvme::init(&mut region, nsid) {
        Ok(n) => n,
        Err(e) => {
            println!("nvme-perf: FAIL init: {}", e);
            plat.exit(1)
        }
    };
    let rw = args.get("rw").unwrap_or("randread");
    let (write, random) = match rw {
        "randread" => (false, true),
        "randwrite" => (true, true),
        "read" => (false, false),
        "write" => (true, false),
        _ => {
            println!("nvme-perf: FAIL rw={} (randread|randwrite|read|write)", rw);
            plat.exit(2)
        }
    };
    let bs = (args.num("bs", 4096) as u32).max(n.block);
    if bs % n.block != 0 || bs > n.max_transfer {
        println!("nvme-perf: FAIL bs={} (block {}, max transfer {})", bs, n.block, n.max_transfer);
        plat.exit(2)
    }
    let qd = args.num("qd", 1).clamp(1, 4095) as u32;
    let secs = args.num("secs", 5).max(1);
    let queues = args.num("queues", 1).clamp(1, super::MAX_QUEUES as u64) as usize;
    let queues = match n.create_io_queues(&mut region, queues, qd + 1) {
        Ok(q) => q,
        Err(e) => {
            println!("nvme-perf: FAIL {}", e);
            plat.exit(1)
        }
    };
    let qd = qd.min(n.io[0].size - 1);
    let slots = queues * qd as usize;
    let per_unit = (bs / n.block) as u64;
    let units = n.ns_blocks / per_unit;
    let (Some(bufs), Some(lists), Some(starts), Some(hist)) = (
        region.alloc(slots as u64 * bs as u64),
        region.alloc(if bs as u64 > 2 * PAGE { slots as u64 * PAGE } else { 0 }),
        region.alloc(slots as u64 * 8),
        region.alloc(BINS as u64 * 4),
    ) else {
        println!("nvme-perf: FAIL out of memory for {} x {} byte buffers", slots, bs);
        plat.exit(1)
    };
    let starts = unsafe { core::slice::from_raw_parts_mut(starts as *mut u64, slots) };
    let hist = unsafe { core::slice::from_raw_parts_mut(hist as *mut u32, BINS) };
    let buf = |i: usize| bufs + i as u64 * bs as u64;
    let list = |i: usize| if bs as u64 > 2 * PAGE { lists + i as u64 * PAGE } else { 0 };
    let mut rng = Rng(0x853c_49e6_748f_ea9b);
    let mut seq_unit = 0u64;
    let mut next_unit = |rng: &mut Rng| {
        if random {
            rng.next() % units
        } else {
            seq_unit = (seq_unit + 1) % units;
            seq_unit
        }
    };
    println!("nvme-perf: rw={} bs={} qd={} queues={} secs={} ns{} ({} blocks)", rw, bs, qd, queues, secs, nsid, n.ns_blocks);
    let t0 = plat.now_ns();
    let end = t0 + secs * 1_000_000_000;
    for q in 0..queues {
        for i in 0..qd as usize {
            let idx = q * qd as usize + i;
            let cmd = n.rw(write, i as u16, next_unit(&mut rng) * per_unit, buf(idx), bs, list(idx));
            starts[idx] = plat.now_ns();
            n.push_io(q, &cmd);
        }
        n.kick_io(q);
    }
    let mut ios = 0u64;
    let mut running = true;
    let mut outstanding = slots as u64;
    while outstanding > 0 {
        for q in 0..queues {
            let mut any = false;
            while let Some(c) = n.poll_io(q) {
                any = true;
                let idx = q * qd as usize + c.cid as usize;
                if c.status != 0 || c.cid as u32 >= qd {
                    println!("nvme-perf: FAIL status {:#x} cid {}", c.status, c.cid);
                    plat.exit(1)
                }
                let now = plat.now_ns();
                if running {
                    hist[bin(now - starts[idx])] += 1;
                    ios += 1;
                    if now >= end {
                        running = false;
                    }
                }
                if running {
                    let cmd = n.rw(write, c.cid, next_unit(&mut rng) * per_unit, buf(idx), bs, list(idx));
                    starts[idx] = plat.now_ns();
                    n.push_io(q, &cmd);
                } else {
                    outstanding -= 1;
                }
            }
            if any {
                n.kick_io(q);
            }
        }
    }
    let elapsed = plat.now_ns().saturating_sub(t0).max(1);
    let iops = ios * 1_000_000_000 / elapsed;
    let p50 = percentile(hist, ios, 50);
    let p99 = percentile(hist, ios, 99);
    println!(
        "nvme-perf: rw={} bs={} qd={} queues={} ios={} iops={} lat_p50_us={}.{:02} lat_p99_us={}.{:02}",
        rw,
        bs,
        qd,
        queues,
        ios,
        iops,
        p50 / 1000,
        (p50 % 1000) / 10,
        p99 / 1000,
        (p99 % 1000) / 10
    );
    plat.exit(0)
}
