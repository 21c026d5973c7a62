//! `workload=nvme-verify [qd=32] [queues=1] [bs=4096] [blocks=N] [ops=N] [ns=1] [stall=30]`
//!
//! Writes blocks tagged with their number and a sequence number, reads them
//! back and checks every byte; also re-reads older blocks. Runs forever
//! (or until `ops` blocks were verified). Any mismatch or error status
//! prints "nvme-verify: FAIL ..." and exits 1, and so does `stall` seconds
//! (guest time) without any completion.

use super::{Nvme, Region, Rng, PAGE};
use crate::args::Args;
use crate::hw::Platform;

#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum State {
    Idle = 0,
    Write = 1,
    ReadBack = 2,
    ReRead = 3,
}

#[derive(Clone, Copy)]
#[repr(C)]
struct Slot {
    unit: u64,
    seq: u32,
    state: State,
    buf: u64,
    list: u64,
}

fn word(unit: u64, seq: u32, i: usize) -> u64 {
    match i {
        0 => unit,
        1 => seq as u64,
        _ => (unit.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (seq as u64).wrapping_mul(0xc2b2_ae3d_27d4_eb4f) ^ i as u64)
            .wrapping_mul(0xff51_afd7_ed55_8ccd),
    }
}

fn fill(buf: u64, bs: u32, unit: u64, seq: u32) {
    let p = buf as *mut u64;
    for i in 0..(bs / 8) as usize {
        unsafe { p.add(i).write_volatile(word(unit, seq, i)) };
    }
}

/// First differing word, if any.
fn check(buf: u64, bs: u32, unit: u64, seq: u32) -> Option<(usize, u64)> {
    let p = buf as *const u64;
    (0..(bs / 8) as usize).find_map(|i| {
        let v = unsafe { p.add(i).read_volatile() };
        (v != word(unit, seq, i)).then_some((i, v))
    })
}

fn fail(plat: Platform, what: core::fmt::Arguments) -> ! {
    println!("nvme-verify: FAIL {}", what);
    plat.exit(1)
}

pub fn run(plat: Platform, args: &Args, mut region: Region) -> ! {
    let nsid = args.num("ns", 1) as u32;
    let mut n = match Nvme::init(&mut region, nsid) {
        Ok(n) => n,
        Err(e) => fail(plat, format_args!("init: {}", e)),
    };
    let bs = (args.num("bs", 4096) as u32).max(n.block);
    if bs % n.block != 0 || bs > n.max_transfer || bs % 8 != 0 {
        fail(plat, format_args!("bs={} does not fit block size {} / max transfer {}", bs, n.block, n.max_transfer));
    }
    let qd = args.num("qd", 32).clamp(1, 4095) as u32;
    let queues = args.num("queues", 1).clamp(1, super::MAX_QUEUES as u64) as usize;
    let queues = match n.create_io_queues(&mut region, queues, qd + 1) {
        Ok(q) => q,
        Err(e) => fail(plat, format_args!("{}", e)),
    };
    let qd = qd.min(n.io[0].size - 1);
    let per_unit = (bs / n.block) as u64;
    let units = args.num("blocks", n.ns_blocks / per_unit).min(n.ns_blocks / per_unit);
    let total_slots = queues * qd as usize;
    if units < total_slots as u64 * 2 {
        fail(plat, format_args!("{} blocks is too few for {} commands in flight", units, total_slots));
    }
    // Book-keeping lives in the region too: sequence per block, busy bits, slots.
    let Some(exp) = region.alloc(units * 4) else { fail(plat, format_args!("out of memory for {} blocks", units)) };
    let Some(busy) = region.alloc(units.div_ceil(64) * 8) else { fail(plat, format_args!("out of memory")) };
    let Some(slots_mem) = region.alloc((total_slots * core::mem::size_of::<Slot>()) as u64) else {
        fail(plat, format_args!("out of memory"))
    };
    let expected = unsafe { core::slice::from_raw_parts_mut(exp as *mut u32, units as usize) };
    let busy = unsafe { core::slice::from_raw_parts_mut(busy as *mut u64, units.div_ceil(64) as usize) };
    let slots = unsafe { core::slice::from_raw_parts_mut(slots_mem as *mut Slot, total_slots) };
    for s in slots.iter_mut() {
        let Some(buf) = region.alloc(bs as u64) else { fail(plat, format_args!("out of memory for buffers")) };
        let list = if bs as u64 > 2 * PAGE { region.alloc(PAGE).unwrap_or(0) } else { 0 };
        *s = Slot { unit: 0, seq: 0, state: State::Idle, buf, list };
    }
    let (passed, failed) = super::check::run(&mut n, &mut region);
    if failed != 0 {
        fail(plat, format_args!("command check: {} of {} checks wrong", failed, passed + failed));
    }
    println!("nvme-verify: command check passed ({} checks)", passed);
    n.arm_events();
    let max_ops = args.num("ops", 0);
    println!(
        "nvme-verify: ns{} {} blocks of {} bytes, {} queue(s) x qd {}, {}",
        nsid,
        units,
        bs,
        queues,
        qd,
        if max_ops == 0 { "forever" } else { "bounded" }
    );

    let mut rng = Rng(plat.now_ns() | 1);
    let mut next_seq = 1u32;
    let mut verified = 0u64;
    let mut writes = 0u64;
    let mut last_report = plat.now_ns();
    let mut last_check = 0u64;
    for q in 0..queues {
        for i in 0..qd as usize {
            let idx = q * qd as usize + i;
            start(&mut n, q, i as u16, &mut slots[idx], expected, busy, units, per_unit, bs, &mut rng, &mut next_seq);
        }
        n.kick_io(q);
    }
    // A command that never completes is a lost write or read: after this
    // long without any completion, fail instead of hanging.
    let stall_ns = args.num("stall", 30).max(1) * 1_000_000_000;
    let mut spins = 0u64;
    let mut progressed = false;
    let mut last_completion = plat.now_ns();
    loop {
        spins += 1;
        if spins.is_multiple_of(4096) {
            if n.fatal() {
                fail(plat, format_args!("controller fatal status (CSTS.CFS) after {} blocks", verified));
            }
            let now = plat.now_ns();
            if progressed {
                last_completion = now;
                progressed = false;
            } else if now.saturating_sub(last_completion) > stall_ns {
                fail(
                    plat,
                    format_args!(
                        "no completion for {} s with {} commands outstanding ({} blocks verified)",
                        stall_ns / 1_000_000_000,
                        total_slots,
                        verified
                    ),
                );
            }
        }
        for q in 0..queues {
            let mut completed = false;
            while let Some(c) = n.poll_io(q) {
                completed = true;
                if c.cid as u32 >= qd {
                    fail(plat, format_args!("completion with unknown cid {} on queue {}", c.cid, q + 1));
                }
                let s = &mut slots[q * qd as usize + c.cid as usize];
                if c.status != 0 {
                    fail(plat, format_args!("status {:#x} for block {} (queue {}, cid {})", c.status, s.unit, q + 1, c.cid));
                }
                match s.state {
                    State::Write => {
                        expected[s.unit as usize] = s.seq;
                        writes += 1;
                        // Poison the buffer so a read that moves no data fails.
                        unsafe { core::ptr::write_bytes(s.buf as *mut u8, 0xee, bs as usize) };
                        s.state = State::ReadBack;
                        let cmd = n.rw(false, c.cid, s.unit * per_unit, s.buf, bs, s.list);
                        n.push_io(q, &cmd);
                    }
                    State::ReadBack | State::ReRead => {
                        if let Some((i, got)) = check(s.buf, bs, s.unit, s.seq) {
                            let p = s.buf as *const u64;
                            let hdr = unsafe { (p.read_volatile(), p.add(1).read_volatile()) };
                            let what = if s.state == State::ReadBack { "just written" } else { "re-read" };
                            fail(
                                plat,
                                format_args!(
                                    "block {} expected seq {} ({}), word {} = {:#x}; block header says block {} seq {}",
                                    s.unit, s.seq, what, i, got, hdr.0, hdr.1
                                ),
                            );
                        }
                        verified += 1;
                        busy[(s.unit / 64) as usize] &= !(1 << (s.unit % 64));
                        s.state = State::Idle;
                        start(&mut n, q, c.cid, s, expected, busy, units, per_unit, bs, &mut rng, &mut next_seq);
                    }
                    State::Idle => fail(plat, format_args!("completion for an idle slot (cid {})", c.cid)),
                }
            }
            if completed {
                n.kick_io(q);
                progressed = true;
            }
        }
        if verified - last_check >= 256 {
            last_check = verified;
            plat.progress(verified);
            n.check_events();
            let now = plat.now_ns();
            if now - last_report > 5_000_000_000 {
                println!("nvme-verify: {} blocks verified, {} writes", verified, writes);
                last_report = now;
            }
        }
        if max_ops != 0 && verified >= max_ops {
            plat.progress(verified);
            println!("nvme-verify: PASS {} blocks verified, {} writes", verified, writes);
            plat.exit(0);
        }
    }
}

/// Start the next command on an idle slot: a new write, or a re-read of a
/// block written earlier.
#[allow(clippy::too_many_arguments)]
fn start(
    n: &mut Nvme,
    q: usize,
    cid: u16,
    s: &mut Slot,
    expected: &mut [u32],
    busy: &mut [u64],
    units: u64,
    per_unit: u64,
    bs: u32,
    rng: &mut Rng,
    next_seq: &mut u32,
) {
    let mut unit = rng.next() % units;
    while busy[(unit / 64) as usize] & (1 << (unit % 64)) != 0 {
        unit = (unit + 1) % units;
    }
    busy[(unit / 64) as usize] |= 1 << (unit % 64);
    s.unit = unit;
    let cmd = if expected[unit as usize] != 0 && rng.next().is_multiple_of(4) {
        s.seq = expected[unit as usize];
        s.state = State::ReRead;
        unsafe { core::ptr::write_bytes(s.buf as *mut u8, 0xee, bs as usize) };
        n.rw(false, cid, unit * per_unit, s.buf, bs, s.list)
    } else {
        s.seq = *next_seq;
        *next_seq = next_seq.wrapping_add(1).max(1);
        s.state = State::Write;
        fill(s.buf, bs, unit, s.seq);
        n.rw(true, cid, unit * per_unit, s.buf, bs, s.list)
    };
    n.push_io(q, &cmd);
}
