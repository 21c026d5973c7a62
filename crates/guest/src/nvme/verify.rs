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
pub fn run(plat: Platform, args: &Args, region: Region) -> ! {
    let mut v = Verify::set_up(plat, args, region);
    v.start_all();
    let mut stall = Stall::new(plat, args.num("stall", 30));
    loop {
        stall.watch(&v);
        for q in 0..v.queues {
            if v.complete(q) {
                v.n.kick_io(q);
                stall.progressed = true;
            }
        }
        v.report_progress();
        if v.max_ops != 0 && v.verified >= v.max_ops {
            plat.progress(v.verified);
            println!("nvme-verify: PASS {} blocks verified, {} writes", v.verified, v.writes);
            plat.exit(0);
        }
    }
}

/// The controller, the slots in flight and the book-keeping of what every
/// block should hold.
struct Verify {
    plat: Platform,
    n: Nvme,
    bs: u32,
    qd: u32,
    queues: usize,
    per_unit: u64,
    units: u64,
    total_slots: usize,
    max_ops: u64,
    /// Sequence number last written to each block (0: never written).
    expected: &'static mut [u32],
    /// One bit per block with a command in flight.
    busy: &'static mut [u64],
    slots: &'static mut [Slot],
    rng: Rng,
    next_seq: u32,
    verified: u64,
    writes: u64,
    last_report: u64,
    last_check: u64,
}

impl Verify {
    fn set_up(plat: Platform, args: &Args, mut region: Region) -> Verify {
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
        Verify {
            plat,
            n,
            bs,
            qd,
            queues,
            per_unit,
            units,
            total_slots,
            max_ops,
            expected,
            busy,
            slots,
            rng: Rng(plat.now_ns() | 1),
            next_seq: 1,
            verified: 0,
            writes: 0,
            last_report: plat.now_ns(),
            last_check: 0,
        }
    }

    /// Fills every queue to its depth.
    fn start_all(&mut self) {
        for q in 0..self.queues {
            for i in 0..self.qd as usize {
                let idx = q * self.qd as usize + i;
                self.start_slot(q, i as u16, idx);
            }
            self.n.kick_io(q);
        }
    }

    /// Starts the next command on slot `idx` (queue `q`, command ID `cid`).
    fn start_slot(&mut self, q: usize, cid: u16, idx: usize) {
        start(
            &mut self.n,
            q,
            cid,
            &mut self.slots[idx],
            self.expected,
            self.busy,
            self.units,
            self.per_unit,
            self.bs,
            &mut self.rng,
            &mut self.next_seq,
        );
    }

    /// Handles every completion on queue `q`: a written block is read back,
    /// a read block is checked and its slot starts the next command.
    /// Whether anything completed.
    fn complete(&mut self, q: usize) -> bool {
        let (plat, bs, per_unit, qd) = (self.plat, self.bs, self.per_unit, self.qd);
        let mut completed = false;
        while let Some(c) = self.n.poll_io(q) {
            completed = true;
            if c.cid as u32 >= qd {
                fail(plat, format_args!("completion with unknown cid {} on queue {}", c.cid, q + 1));
            }
            let idx = q * qd as usize + c.cid as usize;
            let s = &mut self.slots[idx];
            if c.status != 0 {
                fail(plat, format_args!("status {:#x} for block {} (queue {}, cid {})", c.status, s.unit, q + 1, c.cid));
            }
            match s.state {
                State::Write => {
                    self.expected[s.unit as usize] = s.seq;
                    self.writes += 1;
                    // Poison the buffer so a read that moves no data fails.
                    unsafe { core::ptr::write_bytes(s.buf as *mut u8, 0xee, bs as usize) };
                    s.state = State::ReadBack;
                    let cmd = self.n.rw(false, c.cid, s.unit * per_unit, s.buf, bs, s.list);
                    self.n.push_io(q, &cmd);
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
                    self.verified += 1;
                    self.busy[(s.unit / 64) as usize] &= !(1 << (s.unit % 64));
                    s.state = State::Idle;
                    self.start_slot(q, c.cid, idx);
                }
                State::Idle => fail(plat, format_args!("completion for an idle slot (cid {})", c.cid)),
            }
        }
        completed
    }

    /// Every 256 verified blocks: progress to the platform page, controller
    /// events, and a console line at most every 5 s.
    fn report_progress(&mut self) {
        if self.verified - self.last_check >= 256 {
            self.last_check = self.verified;
            self.plat.progress(self.verified);
            self.n.check_events();
            let now = self.plat.now_ns();
            if now - self.last_report > 5_000_000_000 {
                println!("nvme-verify: {} blocks verified, {} writes", self.verified, self.writes);
                self.last_report = now;
            }
        }
    }
}

/// A command that never completes is a lost write or read: after `stall`
/// seconds without any completion, fail instead of hanging.
struct Stall {
    plat: Platform,
    limit_ns: u64,
    spins: u64,
    /// Set by the loop when a queue had completions since the last look.
    progressed: bool,
    last_completion: u64,
}

impl Stall {
    fn new(plat: Platform, stall_s: u64) -> Stall {
        Stall { plat, limit_ns: stall_s.max(1) * 1_000_000_000, spins: 0, progressed: false, last_completion: plat.now_ns() }
    }

    /// Looks at the clock (and the controller's fatal bit) every 4096 spins
    /// only: reading them is slow next to polling a queue.
    fn watch(&mut self, v: &Verify) {
        self.spins += 1;
        if !self.spins.is_multiple_of(4096) {
            return;
        }
        let plat = self.plat;
        if v.n.fatal() {
            fail(plat, format_args!("controller fatal status (CSTS.CFS) after {} blocks", v.verified));
        }
        let now = plat.now_ns();
        if self.progressed {
            self.last_completion = now;
            self.progressed = false;
        } else if now.saturating_sub(self.last_completion) > self.limit_ns {
            fail(
                plat,
                format_args!(
                    "no completion for {} s with {} commands outstanding ({} blocks verified)",
                    self.limit_ns / 1_000_000_000,
                    v.total_slots,
                    v.verified
                ),
            );
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
