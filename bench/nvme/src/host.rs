//! Host-side load generators: the device through the driver harness, and
//! plain io_uring on the same file. Both keep their state between slices, so
//! the bench can alternate them in short slices and a stall of the shared
//! disk (writeback, journal commit) lands on both sides alike.

use devices::nvme::harness::{setup, HostDriver};
use devices::nvme::spec::Command;
use io_uring::{opcode, types, IoUring};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::{Duration, Instant};

pub const BS: usize = 4096;

/// Work done by one side, summed over its slices.
#[derive(Default)]
pub struct Tally {
    pub ops: u64,
    pub wall_ns: u64,
    pub cpu_ns: u64,
    pub lat_ns: Vec<u32>,
    /// (ops, wall ns, cpu ns) of each slice.
    pub slices: Vec<(u64, u64, u64)>,
}

impl Tally {
    pub fn iops(&self) -> f64 {
        self.ops as f64 / (self.wall_ns.max(1) as f64 / 1e9)
    }
    /// Operations per second of CPU time the whole process (every thread:
    /// driver, device worker, io_uring's kernel workers) used.
    pub fn cpu_iops(&self) -> f64 {
        self.ops as f64 / (self.cpu_ns.max(1) as f64 / 1e9)
    }

    fn end_slice(&mut self, ops0: u64, t0: Instant, cpu0: u64) {
        let (ops, wall, cpu) = (self.ops - ops0, t0.elapsed().as_nanos() as u64, cpu_ns() - cpu0);
        self.wall_ns += wall;
        self.cpu_ns += cpu;
        self.slices.push((ops, wall, cpu));
    }
}

/// CPU time of this process (all threads), ns.
pub fn cpu_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: plain syscall filling a timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// The shape of one run: 4 KiB random reads or writes, `queues` queues each
/// kept `qd` deep by one thread, over `blocks` 4 KiB blocks.
#[derive(Clone, Copy)]
pub struct Load {
    pub write: bool,
    pub qd: u32,
    pub queues: u32,
    pub blocks: u64,
}

impl Load {
    pub fn pattern(&self) -> &'static str {
        if self.write {
            "randwrite"
        } else {
            "randread"
        }
    }
}

/// The driver's poll loop, the same on both sides: after a few microseconds
/// without a completion it yields the CPU on every empty poll, so that on a
/// host with fewer free CPUs than runnable threads the spinning driver does
/// not keep the threads doing the I/O (the device's worker, io_uring's kernel
/// workers) waiting for the end of its time slice. Fast completions (page
/// cache reads) arrive before the first yield.
struct IdlePoll {
    since: Instant,
}

impl IdlePoll {
    const SPIN: Duration = Duration::from_micros(5);

    fn new() -> IdlePoll {
        IdlePoll { since: Instant::now() }
    }

    fn after_poll(&mut self, completions: usize) {
        if completions > 0 {
            self.since = Instant::now();
        } else if self.since.elapsed() > Self::SPIN {
            std::thread::yield_now();
        }
    }
}

/// One slice: fill every queue, keep it full for `dur`, then let the last
/// requests finish. Wall and CPU time cover all of it (ramp and drain), the
/// same way for both sides.
pub trait Side {
    fn slice(&mut self, dur: Duration, into: &mut Tally);
}

/// The device alone through the host-side driver harness.
pub struct DeviceSide {
    d: HostDriver,
    load: Load,
    bufs: Vec<u64>,
    started: Vec<Instant>,
    rng: Rng,
    out: Vec<devices::nvme::spec::Completion>,
}

impl DeviceSide {
    pub fn new(spec: &str, load: Load, prefill_memory: bool) -> DeviceSide {
        let mut d: HostDriver = setup(spec, 512 << 20);
        d.create_io_queues(load.queues as u16, 4096).unwrap();
        let n = (load.queues * load.qd) as usize;
        let bufs: Vec<u64> = (0..n).map(|_| d.alloc(BS as u64)).collect();
        // Same buffer contents as the io_uring side (and no first-touch
        // faults inside the measurement).
        for &b in &bufs {
            d.write_mem(b, &[0x5a; BS]);
        }
        if prefill_memory {
            // Touch every page of a memory namespace once, so the run measures
            // the device rather than the host's first-touch page faults.
            let nlb = (BS / 512) as u32;
            for b in 0..load.blocks {
                let c = d.rw_cmd(true, 1, b * nlb as u64, nlb, bufs[0], BS, None);
                assert!(d.io_cmd(1, c).status.is_success());
            }
        }
        DeviceSide { d, load, bufs, started: vec![Instant::now(); n], rng: Rng(0x1234_5678_9abc_def1), out: Vec::with_capacity(64) }
    }

    fn submit(&mut self, q: usize, slot: u32) {
        let nlb = (BS / 512) as u32;
        let lba = (self.rng.next() % self.load.blocks) * nlb as u64;
        let idx = ((q as u32 - 1) * self.load.qd + slot) as usize;
        let mut c: Command = self.d.rw_cmd(self.load.write, 1, lba, nlb, self.bufs[idx], BS, None);
        c.cid = slot as u16;
        self.started[idx] = Instant::now();
        self.d.push(q, &c);
    }
}

impl Side for DeviceSide {
    #[allow(clippy::needless_range_loop)] // q indexes queues and their counters alike
    fn slice(&mut self, dur: Duration, t: &mut Tally) {
        let (qd, queues) = (self.load.qd, self.load.queues as usize);
        let ops0 = t.ops;
        let t0 = Instant::now();
        let cpu0 = cpu_ns();
        for q in 1..=queues {
            for s in 0..qd {
                self.submit(q, s);
            }
            self.d.ring(q);
        }
        let mut inflight = vec![qd as usize; queues + 1];
        let mut left = queues * qd as usize;
        let mut refill = true;
        let mut spins = 0u64;
        let mut got = 0usize;
        let mut idle = IdlePoll::new();
        while left > 0 {
            for q in 1..=queues {
                if inflight[q] == 0 {
                    continue;
                }
                self.out.clear();
                let mut out = std::mem::take(&mut self.out);
                self.d.poll_many(q, inflight[q], &mut out);
                let now = Instant::now();
                for c in &out {
                    assert!(c.status.is_success(), "I/O failed: {:?}", c.status);
                    let idx = (q as u32 - 1) * qd + c.cid as u32;
                    t.lat_ns.push(now.duration_since(self.started[idx as usize]).as_nanos() as u32);
                    if refill {
                        self.submit(q, c.cid as u32);
                    }
                }
                t.ops += out.len() as u64;
                got += out.len();
                if refill && !out.is_empty() {
                    self.d.ring(q);
                } else {
                    inflight[q] -= out.len();
                    left -= out.len();
                }
                self.out = out;
            }
            spins += 1;
            idle.after_poll(got);
            got = 0;
            if refill && spins & 63 == 0 && t0.elapsed() > dur {
                refill = false;
            }
        }
        t.end_slice(ops0, t0, cpu0);
    }
}

/// Plain io_uring on the same file: `queues` rings each kept `qd` deep,
/// one thread, the same requests (non-vectored 4 KiB Read/Write, no sync
/// flags: the device's volatile write cache is on, so it adds none either).
pub struct UringSide {
    _file: File,
    fd: i32,
    load: Load,
    rings: Vec<IoUring>,
    bufs: Vec<Vec<u8>>,
    started: Vec<Instant>,
    rng: Rng,
    finished: Vec<usize>,
}

impl UringSide {
    pub fn new(path: &Path, load: Load) -> UringSide {
        let file = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
        let fd = file.as_raw_fd();
        let rings = (0..load.queues).map(|_| IoUring::new(load.qd.next_power_of_two().max(8)).unwrap()).collect();
        let n = (load.queues * load.qd) as usize;
        UringSide {
            _file: file,
            fd,
            load,
            rings,
            bufs: (0..n).map(|_| vec![0x5au8; BS]).collect(),
            started: vec![Instant::now(); n],
            // Not the device's sequence: neither side should find the pages
            // the other just wrote still dirty.
            rng: Rng(0x0fed_cba9_8765_4321),
            finished: Vec::with_capacity(64),
        }
    }

    fn push(&mut self, q: usize, idx: usize) {
        let off = (self.rng.next() % self.load.blocks) * BS as u64;
        let buf = &mut self.bufs[idx];
        let e = if self.load.write {
            opcode::Write::new(types::Fd(self.fd), buf.as_ptr(), BS as u32).offset(off).build()
        } else {
            opcode::Read::new(types::Fd(self.fd), buf.as_mut_ptr(), BS as u32).offset(off).build()
        };
        self.started[idx] = Instant::now();
        // SAFETY: the buffer outlives the request: every slice waits for all
        // of its requests before returning.
        unsafe { self.rings[q].submission().push(&e.user_data(idx as u64)).unwrap() };
    }
}

impl Side for UringSide {
    #[allow(clippy::needless_range_loop)] // q indexes rings and their counters alike
    fn slice(&mut self, dur: Duration, t: &mut Tally) {
        let (qd, queues) = (self.load.qd as usize, self.load.queues as usize);
        let ops0 = t.ops;
        let t0 = Instant::now();
        let cpu0 = cpu_ns();
        for q in 0..queues {
            for s in 0..qd {
                self.push(q, q * qd + s);
            }
            self.rings[q].submit().unwrap();
        }
        let mut inflight = vec![qd; queues];
        let mut left = queues * qd;
        let mut refill = true;
        let mut spins = 0u64;
        let mut got = 0usize;
        let mut idle = IdlePoll::new();
        while left > 0 {
            for q in 0..queues {
                if inflight[q] == 0 {
                    continue;
                }
                let mut finished = std::mem::take(&mut self.finished);
                finished.clear();
                finished.extend(self.rings[q].completion().map(|c| {
                    assert_eq!(c.result(), BS as i32, "io_uring I/O failed");
                    c.user_data() as usize
                }));
                let now = Instant::now();
                for &idx in &finished {
                    t.lat_ns.push(now.duration_since(self.started[idx]).as_nanos() as u32);
                    if refill {
                        self.push(q, idx);
                    }
                }
                t.ops += finished.len() as u64;
                got += finished.len();
                if refill && !finished.is_empty() {
                    self.rings[q].submit().unwrap();
                } else {
                    inflight[q] -= finished.len();
                    left -= finished.len();
                }
                self.finished = finished;
            }
            spins += 1;
            idle.after_poll(got);
            got = 0;
            if refill && spins & 63 == 0 && t0.elapsed() > dur {
                refill = false;
            }
        }
        t.end_slice(ops0, t0, cpu0);
    }
}

pub fn percentiles(lat_ns: &mut [u32]) -> (f64, f64) {
    if lat_ns.is_empty() {
        return (0.0, 0.0);
    }
    lat_ns.sort_unstable();
    let at = |p: f64| lat_ns[((lat_ns.len() as f64 * p) as usize).min(lat_ns.len() - 1)] as f64 / 1000.0;
    (at(0.50), at(0.99))
}
