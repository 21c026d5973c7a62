//! `workload=pvrdma`: the guest side of the RDMA workloads checked against
//! a bare-metal peer (`transit rdma peer`; the protocol is described in
//! crates/verbs/src/peer.rs, keep both in step).
//!
//! `workload=pvrdma gid=A.B.C.D [run=stream,ring,table,atomic] [count=N]
//! [qps=N] [bigwrite=SIZE] [bigrounds=R] [size=256] [slots=16] [rec=128]
//! [rows=8] [scatter=1] [srq=0] [pvrdma_mem=ADDR]`
//!
//! The guest brings the device up, creates `qps` RC QPs (default: one per
//! workload; QP i runs workload i mod the number of workloads named, each
//! with its own buffers and checks), plus one for the big WRITE when
//! `bigwrite` is given, publishes its IDs in the mailbox, waits for the
//! peer's, connects, says hello on every QP and runs every workload at
//! once: `count` of each per QP (0: without end). Progress (everything
//! checked so far) goes to the platform page, violations to the console;
//! with a count it ends with a `pvrdma: PASS` or `FAIL` line on the
//! console and in the mailbox, and keeps the device up for the peer
//! (`exit=1`: ends the VM with exit status 0 or 1).
//!
//! The workloads' buffer is one MR over scattered guest pages (`scatter=0`:
//! one run of pages): see [`Layout`].
//!
//! `srq=1`: every stream QP takes its receives from one shared receive
//! queue, which holds all their receive buffers (a receive's wr_id is its
//! buffer's address); whichever QP a message arrives at uses the next one,
//! and the guest checks each message against the sequence of the QP it
//! arrived at before posting the buffer back to the SRQ.

use super::{Cq, Device, Op, Qp, Remote, Srq};
use crate::args::Args;
use crate::hw::Platform;
use crate::mailbox::{Mailbox, TextBuf};
use crate::nvme::Region;
use core::fmt::Write;
use core::sync::atomic::{fence, AtomicU64, Ordering};
use pvrdma_abi::ib::{wc_flags, wc_opcode, wc_status};

const HELLO: u64 = 0x5256_504f_4c4c_4548;
const STREAM_TO_PEER: u64 = 1 << 60;
const STREAM_TO_GUEST: u64 = 2 << 60;
const RING: u64 = 3 << 60;
const TABLE: u64 = 4 << 60;
const BIG: u64 = 5 << 60;
const ROW: u64 = 64;
const DEPTH: u64 = 32;
const HELLO_WR: u64 = u64::MAX;
const MAX_QPS: u64 = 256;
/// Each QP's private words: 32 sources of small writes, the atomic result,
/// the big WRITE's acknowledgement, then the hello.
const WORDS: u64 = 64 * 8;
const PSN_STEP: u32 = 0x100;
/// A QP with work left and no completion for this long (guest clock, which
/// stands still while the VM is stopped) is stuck: the run fails naming it.
/// Longer than rnicd takes to give up on an unanswered request (7 retries
/// of a backed-off 67 ms timeout, about 13 s) and than the peer's `--stall`
/// of 60 s, so a failure there is reported as what it is.
const WATCHDOG_NS: u64 = 90_000_000_000;
/// Workload rounds between two looks of the watchdog (each reads the
/// clock, an exit to the vmm).
const WATCHDOG_EVERY: u64 = 4096;

fn pattern(seed: u64, j: u64) -> u64 {
    seed.wrapping_add(j).wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(17) ^ j
}

const PAGE: u64 = 4096;
/// Most runs of pages the scattered buffer is cut into (the device takes 2048).
const MAX_RUNS: u64 = 1024;
/// Where the scattered buffer's MR starts in I/O virtual addresses (outside
/// guest RAM: a guest access that forgot to translate faults loudly).
const SCATTERED_IOVA: u64 = 0x4000_0000_0000;

/// The workloads' buffer as it lies in guest RAM: runs of `run` bytes of
/// pages, each followed by a one-page hole, so its MR is scattered over
/// guest pages as a Linux user buffer is (CREATE_MR gets one page
/// directory entry per page, the device and rnicd see many runs). Peers and
/// SGEs use the MR's addresses, from `iova`; the guest reaches a word
/// through [`phys`]. Set once at bring-up (one vCPU drives the workloads).
struct Layout {
    iova: AtomicU64,
    len: AtomicU64,
    phys: AtomicU64,
    run: AtomicU64,
}

static LAYOUT: Layout = Layout { iova: AtomicU64::new(0), len: AtomicU64::new(0), phys: AtomicU64::new(0), run: AtomicU64::new(PAGE) };

/// The guest-physical address of the buffer's I/O virtual address `a`
/// (other addresses are their own). Words never cross a page: every
/// offset in the buffer is a multiple of 8.
fn phys(a: u64) -> u64 {
    let (iova, len) = (LAYOUT.iova.load(Ordering::Relaxed), LAYOUT.len.load(Ordering::Relaxed));
    match a.checked_sub(iova) {
        Some(off) if off < len => {
            let run = LAYOUT.run.load(Ordering::Relaxed);
            LAYOUT.phys.load(Ordering::Relaxed) + off / run * (run + PAGE) + off % run
        }
        _ => a,
    }
}

fn rd64(a: u64) -> u64 {
    let a = phys(a);
    // SAFETY: identity-mapped guest RAM of our buffer.
    unsafe { core::ptr::read_volatile(a as *const u64) }
}

fn wr64(a: u64, v: u64) {
    let a = phys(a);
    // SAFETY: as above.
    unsafe { core::ptr::write_volatile(a as *mut u64, v) }
}

fn fill(at: u64, first: u64, seed: u64, len: u64) {
    wr64(at, first);
    for j in 1..len / 8 {
        wr64(at + 8 * j, pattern(seed, j));
    }
}

/// The first word that differs, if any.
fn check(at: u64, first: u64, seed: u64, len: u64) -> Option<u64> {
    (0..len / 8).find(|&j| rd64(at + 8 * j) != if j == 0 { first } else { pattern(seed, j) })
}

pub(super) fn parse_num(s: &str) -> Option<u64> {
    match s.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16).ok(),
        None => s.parse().ok(),
    }
}

pub(super) fn parse_ip(s: &str) -> Option<[u8; 4]> {
    let mut ip = [0u8; 4];
    let mut parts = s.split('.');
    for b in ip.iter_mut() {
        *b = parts.next()?.parse().ok()?;
    }
    parts.next().is_none().then_some(ip)
}

/// The `n`-th number of a list of numbers and ranges (`17-40,45`), as both
/// sides write QPNs.
fn nth_in_ranges(list: &str, mut n: u64) -> Option<u64> {
    for part in list.split(',') {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (parse_num(a)?, parse_num(b)?),
            None => (parse_num(part)?, parse_num(part)?),
        };
        let len = b.checked_sub(a)? + 1;
        if n < len {
            return Some(a + n);
        }
        n -= len;
    }
    None
}

/// Writes `nums` as a list of numbers and ranges.
fn write_ranges<const N: usize>(out: &mut TextBuf<N>, mut nums: impl Iterator<Item = u64>) {
    let Some(mut start) = nums.next() else { return };
    let (mut end, mut first) = (start, true);
    let flush = |out: &mut TextBuf<N>, a: u64, b: u64, first: &mut bool| {
        let sep = if *first { "" } else { "," };
        *first = false;
        let _ = if a == b { write!(out, "{sep}{a}") } else { write!(out, "{sep}{a}-{b}") };
    };
    for n in nums {
        if n == end + 1 {
            end = n;
        } else {
            flush(out, start, end, &mut first);
            (start, end) = (n, n);
        }
    }
    flush(out, start, end, &mut first);
}

/// The peer's `key=value` words.
pub(super) struct PeerInfo<'a>(pub(super) &'a str);

impl PeerInfo<'_> {
    pub(super) fn get(&self, key: &str) -> Option<&str> {
        self.0.split_ascii_whitespace().find_map(|w| w.split_once('=').filter(|(k, _)| *k == key).map(|(_, v)| v))
    }
    pub(super) fn num(&self, key: &str) -> Option<u64> {
        self.get(key).and_then(parse_num)
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Stream,
    Ring,
    Table,
    Atomic,
    Big,
}

const KINDS: [(Kind, &str); 4] = [(Kind::Stream, "stream"), (Kind::Ring, "ring"), (Kind::Table, "table"), (Kind::Atomic, "atomic")];

/// One QP running one workload, with its buffers and progress.
struct Inst {
    kind: Kind,
    /// Its index among the QPs of its kind: it selects the ring and table
    /// here and the credit, counter and ops words on the peer.
    k: u64,
    qp: Qp,
    cq: Cq,
    psn: u32,
    rx: u64,
    tx: u64,
    ring: u64,
    table: u64,
    words: u64,
    tx_next: u64,
    tx_done: u64,
    rx_expect: u64,
    ring_expect: u64,
    table_updates: u64,
    atomic_i: u64,
    atomic_busy: bool,
    /// The next of the 32 source words for small RDMA writes to the peer.
    word: u64,
    big_round: u64,
    big_busy: bool,
    /// Completions taken from its CQ (table QPs: updates made): what the
    /// watchdog watches move.
    events: u64,
    /// `events` at the watchdog's last look, and when it last moved (ns).
    seen_events: u64,
    seen_at: u64,
}

impl Inst {
    fn hello(&self) -> u64 {
        self.words + WORDS
    }
    fn result_word(&self) -> u64 {
        self.words + 32 * 8
    }
    fn ack_word(&self) -> u64 {
        self.words + 33 * 8
    }
}

/// Sizes of the workloads' buffers.
struct Sizes {
    size: u64,
    slots: u64,
    rec: u64,
    rows: u64,
    big: u64,
    big_rounds: u64,
}

struct Run {
    plat: Platform,
    violations: u64,
    checked: u64,
    /// The run cannot go on (an error completion, a QP without progress):
    /// it ends at once with FAIL.
    fatal: bool,
}

impl Run {
    fn violation(&mut self, args: core::fmt::Arguments) {
        self.violations += 1;
        if self.violations <= 32 {
            println!("pvrdma: VIOLATION {}", args);
        }
    }
    fn checked(&mut self) {
        self.checked += 1;
        self.plat.progress(self.checked);
    }
}

pub(super) fn fail(plat: Platform, what: &str, e: super::Error) -> ! {
    println!("pvrdma: FAIL {}: {:?}", what, e);
    plat.exit(1)
}

pub fn run(plat: Platform, args: &Args, boot: &crate::boot::BootInfo) -> ! {
    let Some(gid) = args.get("gid").and_then(parse_ip) else {
        println!("pvrdma: FAIL give the VM's GID as gid=A.B.C.D (the --pvrdma gid= of the vmm)");
        plat.exit(2)
    };
    let wanted = args.get("run").unwrap_or("stream,ring,table,atomic");
    let count = args.num("count", 1000);
    let mut s = bring_up(plat, args, boot, gid, wanted, count);
    let targets = exchange_ids(plat, &mut s, gid, wanted, count);
    post_first(plat, &s);
    println!("pvrdma: connected, running {} on {} QPs with count={}", wanted, s.insts.len(), count);

    let mut w = Workloads {
        plat,
        sz: &s.sz,
        mr: &s.mr,
        big_mr: s.big_mr.as_ref(),
        srq: s.srq.as_ref(),
        t: targets,
        count,
        r: Run { plat, violations: 0, checked: 0, fatal: false },
    };
    let mut rounds = 0u64;
    loop {
        rounds += 1;
        if rounds.is_multiple_of(WATCHDOG_EVERY) {
            w.watchdog(s.insts);
        }
        if w.r.fatal {
            break;
        }
        let mut all_done = true;
        for i in s.insts.iter_mut() {
            if w.done(i) {
                continue;
            }
            all_done = false;
            match i.kind {
                Kind::Stream => w.stream_step(i),
                Kind::Ring => w.ring_step(i),
                Kind::Table => w.table_step(i),
                Kind::Atomic => w.atomic_step(i),
                Kind::Big => w.big_step(i),
            }
        }
        if all_done {
            break;
        }
    }
    let ok = w.report(&mut s.mb, s.insts);
    after_run(plat, args, s.insts, ok)
}

/// Everything the workloads share once the device is up: one buffer, one
/// MR over it, the QPs (each with its CQ).
struct Setup {
    mb: Mailbox,
    dev: Device,
    mr: super::Mr,
    big_mr: Option<super::Mr>,
    srq: Option<Srq>,
    sz: Sizes,
    ring_base: u64,
    table_base: u64,
    insts: &'static mut [Inst],
}

fn bring_up(plat: Platform, args: &Args, boot: &crate::boot::BootInfo, gid: [u8; 4], wanted: &str, count: u64) -> Setup {
    let big = args.num("bigwrite", 0).min(1 << 30) & !4095;
    let sz = Sizes {
        size: args.num("size", 256).clamp(16, 4096) & !7,
        slots: args.num("slots", 16).clamp(2, 256),
        rec: args.num("rec", 128).clamp(16, 4096) & !7,
        rows: args.num("rows", 8).clamp(1, 1024),
        big,
        big_rounds: args.num("bigrounds", if count == 0 { 0 } else { 2 }),
    };
    let kinds: TextBuf<64> = kinds_of(wanted);
    let nkinds = kinds.len as u64;
    if nkinds == 0 && big == 0 {
        println!("pvrdma: FAIL run= names no workload (stream, ring, table, atomic) and there is no bigwrite=");
        plat.exit(2)
    }
    let nqps = if nkinds == 0 { 0 } else { args.num("qps", nkinds).clamp(1, MAX_QPS) };
    let start = args.num("pvrdma_mem", boot.firmware_end).max(boot.firmware_end);
    let mut region = Region { next: start, end: boot.ram_size };
    let Some(mb) = Mailbox::find(boot.mmio_base) else {
        println!("pvrdma: FAIL no mailbox page");
        plat.exit(1)
    };

    let mut dev = Device::init(plat, &mut region, gid).unwrap_or_else(|e| fail(plat, "bring-up", e));
    println!(
        "pvrdma: device version {} max_qp {} max_cqe {} max_sge {} atomics {:#x}",
        dev.version, dev.caps.max_qp, dev.caps.max_cqe, dev.caps.max_sge, dev.caps.atomic_ops
    );
    let port = dev.query_port().unwrap_or_else(|e| fail(plat, "QUERY_PORT", e));
    println!("pvrdma: port state {} active_mtu {}", port.state, port.active_mtu);
    let pd = dev.create_pd().unwrap_or_else(|e| fail(plat, "CREATE_PD", e));

    // One buffer: every ring, every table, then each QP's private part
    // (stream buffers for stream QPs, and everyone's words and hello).
    let kind_of = |i: u64| if i == nqps { Kind::Big } else { KINDS[kinds.buf[(i % nkinds) as usize] as usize].0 };
    let total = nqps + (big > 0) as u64;
    let count_of = |k: Kind| (0..total).filter(|&i| kind_of(i) == k).count() as u64;
    let private = |k: Kind| WORDS + 64 + if k == Kind::Stream { 2 * DEPTH * sz.size } else { 0 };
    let rings_len = count_of(Kind::Ring) * sz.slots * sz.rec;
    let tables_len = count_of(Kind::Table) * sz.rows * ROW;
    let len = rings_len + tables_len + (0..total).map(|i| private(kind_of(i))).sum::<u64>();
    let access = pvrdma_abi::ib::access::LOCAL_WRITE
        | pvrdma_abi::ib::access::REMOTE_WRITE
        | pvrdma_abi::ib::access::REMOTE_READ
        | pvrdma_abi::ib::access::REMOTE_ATOMIC;
    let mr = if args.num("scatter", 1) != 0 {
        let npages = len.div_ceil(PAGE);
        let run_pages = npages.div_ceil(MAX_RUNS).max(1);
        let runs = npages.div_ceil(run_pages);
        let at = region.alloc((npages + runs) * PAGE).unwrap_or_else(|| fail(plat, "memory", super::Error::NoMemory));
        LAYOUT.run.store(run_pages * PAGE, Ordering::Relaxed);
        LAYOUT.phys.store(at, Ordering::Relaxed);
        LAYOUT.len.store(len, Ordering::Relaxed);
        LAYOUT.iova.store(SCATTERED_IOVA, Ordering::Relaxed);
        println!("pvrdma: buffer of {len} bytes over {runs} runs of {run_pages} guest pages");
        dev.reg_mr_pages(&mut region, pd, SCATTERED_IOVA, len, access, |i| phys(SCATTERED_IOVA + i as u64 * PAGE))
    } else {
        let buf = region.alloc(len).unwrap_or_else(|| fail(plat, "memory", super::Error::NoMemory));
        dev.reg_mr(&mut region, pd, buf, len, access)
    };
    let mr = mr.unwrap_or_else(|e| fail(plat, "CREATE_MR", e));
    let buf = mr.addr;
    let big_mr = (big > 0).then(|| {
        let at = region.alloc(big).unwrap_or_else(|| fail(plat, "memory for bigwrite", super::Error::NoMemory));
        // Filled once: only word 0 (the round) changes from round to round;
        // the peer clears what it verified, so a lost part shows.
        fill(at, 0, BIG, big);
        dev.reg_mr(&mut region, pd, at, big, pvrdma_abi::ib::access::LOCAL_WRITE).unwrap_or_else(|e| fail(plat, "CREATE_MR", e))
    });

    // srq=1: one SRQ for every stream QP's receive buffers.
    let streams = count_of(Kind::Stream);
    let srq_depth = (streams * DEPTH).next_power_of_two();
    let srq = (args.num("srq", 0) != 0 && streams > 0).then(|| {
        let depth = srq_depth;
        if depth > dev.caps.max_srq_wr as u64 {
            println!("pvrdma: FAIL srq=1 with {streams} stream QPs needs {depth} SRQ WQEs, the device has {}", dev.caps.max_srq_wr);
            plat.exit(2)
        }
        let srq = dev.create_srq(&mut region, pd, depth as u32, 1).unwrap_or_else(|e| fail(plat, "CREATE_SRQ", e));
        println!("pvrdma: {streams} stream QPs share SRQ {} of {depth} WQEs", srq.handle);
        srq
    });
    let arr =
        region.alloc(total.max(1) * core::mem::size_of::<Inst>() as u64).unwrap_or_else(|| fail(plat, "memory", super::Error::NoMemory));
    let (ring_base, table_base) = (buf, buf + rings_len);
    let mut next_private = table_base + tables_len;
    let mut per_kind = [0u64; 5];
    for i in 0..total {
        let kind = kind_of(i);
        let k = per_kind[kind as usize];
        per_kind[kind as usize] += 1;
        let depth = if kind == Kind::Ring { (sz.slots as u32).max(DEPTH as u32) } else { DEPTH as u32 };
        // Room for every completion the QP can have outstanding: its whole
        // send queue and every receive that can land on it, which on the
        // SRQ is every receive of the SRQ. A CQ that overruns loses its
        // completions and takes no more (the device raises CQ_ERR).
        let on_srq = srq.is_some() && kind == Kind::Stream;
        let recvs = if on_srq { srq_depth as u32 } else { 2 * depth };
        let cq = dev.create_cq(&mut region, (2 * depth + recvs).next_power_of_two()).unwrap_or_else(|e| fail(plat, "CREATE_CQ", e));
        let qp = match &srq {
            Some(srq) if kind == Kind::Stream => dev.create_qp_on_srq(&mut region, pd, &cq, &cq, 2 * depth, 1, srq),
            _ => dev.create_qp(&mut region, pd, &cq, &cq, 2 * depth, 1),
        };
        let qp = qp.unwrap_or_else(|e| fail(plat, "CREATE_QP", e));
        let p = next_private;
        next_private += private(kind);
        let inst = Inst {
            kind,
            k,
            qp,
            cq,
            psn: (0x1000 + i as u32 * PSN_STEP) & 0xff_ffff,
            words: p,
            rx: p + WORDS + 64,
            tx: p + WORDS + 64 + DEPTH * sz.size,
            ring: ring_base + k * sz.slots * sz.rec,
            table: table_base + k * sz.rows * ROW,
            tx_next: 0,
            tx_done: 0,
            rx_expect: 0,
            ring_expect: 0,
            table_updates: 0,
            atomic_i: 0,
            atomic_busy: false,
            word: 0,
            big_round: 0,
            big_busy: false,
            events: 0,
            seen_events: 0,
            seen_at: 0,
        };
        // SAFETY: `arr` is fresh RAM for `total` Insts that nothing else uses.
        unsafe { core::ptr::write((arr as *mut Inst).add(i as usize), inst) };
    }
    // SAFETY: all `total` elements were written above; the RAM is never freed.
    let insts = unsafe { core::slice::from_raw_parts_mut(arr as *mut Inst, total as usize) };
    Setup { mb, dev, mr, big_mr, srq, sz, ring_base, table_base, insts }
}

/// The indices into KINDS of the workloads `run=` names, in its order.
fn kinds_of(wanted: &str) -> TextBuf<64> {
    let mut out = TextBuf::<64>::new();
    for w in wanted.split(',') {
        if let Some(i) = KINDS.iter().position(|(_, n)| *n == w) {
            if out.len < 64 {
                out.buf[out.len] = i as u8;
                out.len += 1;
            }
        }
    }
    out
}

/// Where the workloads write and operate on the peer's side.
struct Targets {
    rkey: u32,
    credit_at: u64,
    counter_at: u64,
    ops_at: u64,
    big_at: u64,
    big_rkey: u32,
}

/// Publishes our IDs, waits for the peer's (once each) and connects every QP.
fn exchange_ids(plat: Platform, s: &mut Setup, gid: [u8; 4], wanted: &str, count: u64) -> Targets {
    let (sz, mr) = (&s.sz, &s.mr);
    let nqps = s.insts.iter().filter(|i| i.kind != Kind::Big).count();
    let mut me = TextBuf::<0x700>::new();
    let _ = write!(me, "gid={}.{}.{}.{} count={} size={}", gid[0], gid[1], gid[2], gid[3], count, sz.size);
    if nqps > 0 {
        let _ = write!(me, " run={} qps={} psn={:#x} qpn=", wanted, nqps, s.insts[0].psn);
        write_ranges(&mut me, s.insts.iter().filter(|i| i.kind != Kind::Big).map(|i| i.qp.qpn as u64));
        let _ = write!(me, " ring.addr={:#x} ring.rkey={} ring.slots={} ring.rec={}", s.ring_base, mr.rkey, sz.slots, sz.rec);
        let _ = write!(me, " table.addr={:#x} table.rkey={} table.rows={}", s.table_base, mr.rkey, sz.rows);
    }
    if let Some(b) = s.insts.iter().find(|i| i.kind == Kind::Big) {
        let _ = write!(me, " big.qpn={} big.psn={} big.len={} big.rounds={}", b.qp.qpn, b.psn, sz.big, sz.big_rounds);
    }
    for i in s.insts.iter() {
        if i.kind == Kind::Table {
            for r in 0..sz.rows {
                fill(i.table + r * ROW, 0, r << 32 | TABLE, ROW);
            }
        }
        wr64(i.hello(), HELLO);
        wr64(i.hello() + 8, 0);
    }
    if me.len >= me.buf.len() {
        println!("pvrdma: FAIL our IDs do not fit in the mailbox");
        plat.exit(1)
    }
    s.mb.publish(me.as_bytes());
    println!("pvrdma: published {}", core::str::from_utf8(me.as_bytes()).unwrap_or(""));

    let mut pbuf = [0u8; 0x700];
    let (_, plen) = s.mb.wait_host(0, &mut pbuf);
    let ptext = core::str::from_utf8(&pbuf[..plen]).unwrap_or("");
    println!("pvrdma: peer {}", ptext);
    let peer = PeerInfo(ptext);
    let Some(pgid) = peer.get("gid").and_then(parse_ip) else {
        println!("pvrdma: FAIL the peer's message has no gid=");
        plat.exit(1)
    };
    let (qpns, psn0) = (peer.get("qpn").unwrap_or(""), peer.num("psn").unwrap_or(0));
    let mut n = 0u64;
    for i in s.insts.iter() {
        let (qpn, psn) = if i.kind == Kind::Big {
            (peer.num("big.qpn"), peer.num("big.psn").unwrap_or(0))
        } else {
            n += 1;
            (nth_in_ranges(qpns, n - 1), psn0 + (n - 1) * PSN_STEP as u64)
        };
        let Some(qpn) = qpn else {
            println!("pvrdma: FAIL the peer's message has no QPN for our QP {}", i.qp.qpn);
            plat.exit(1)
        };
        let remote = Remote { gid: pgid, qpn: qpn as u32, psn: psn as u32 & 0xff_ffff, my_psn: i.psn };
        s.dev.connect(&i.qp, &remote).unwrap_or_else(|e| fail(plat, "MODIFY_QP", e));
    }
    Targets {
        rkey: peer.num("rkey").unwrap_or(0) as u32,
        credit_at: peer.num("ring.credit").unwrap_or(0),
        counter_at: peer.num("atomic.counter").unwrap_or(0),
        ops_at: peer.num("atomic.ops").unwrap_or(0),
        big_at: peer.num("big.addr").unwrap_or(0),
        big_rkey: peer.num("big.rkey").unwrap_or(0) as u32,
    }
}

/// Receives before hellos: the peer starts the moment it hears one.
fn post_first(plat: Platform, s: &Setup) {
    let (sz, mr) = (&s.sz, &s.mr);
    for i in s.insts.iter() {
        match i.kind {
            Kind::Stream => {
                for k in 0..DEPTH {
                    let at = i.rx + k * sz.size;
                    let sge = mr.sge(at, sz.size as u32);
                    let r = match &s.srq {
                        Some(srq) => srq.post_recv(at, &[sge]),
                        None => i.qp.post_recv(k, &[sge]),
                    };
                    r.unwrap_or_else(|e| fail(plat, "post_recv", e));
                }
            }
            Kind::Ring => {
                for k in 0..sz.slots {
                    i.qp.post_recv(k, &[]).unwrap_or_else(|e| fail(plat, "post_recv", e));
                }
            }
            Kind::Big => i.qp.post_recv(0, &[mr.sge(i.ack_word(), 8)]).unwrap_or_else(|e| fail(plat, "post_recv", e)),
            _ => {}
        }
        i.qp.post_send(HELLO_WR, Op::Send, &[mr.sge(i.hello(), 16)], true).unwrap_or_else(|e| fail(plat, "hello", e));
    }
}

/// What every workload step shares; each step posts what it may without
/// waiting and drains its CQ, so all QPs advance together in one loop.
struct Workloads<'a> {
    plat: Platform,
    sz: &'a Sizes,
    mr: &'a super::Mr,
    big_mr: Option<&'a super::Mr>,
    /// srq=1: the stream QPs' shared receive queue.
    srq: Option<&'a Srq>,
    t: Targets,
    count: u64,
    r: Run,
}

impl Workloads<'_> {
    /// Whether the x-th operation is still to do (count 0: without end).
    fn n_or_inf(&self, x: u64) -> bool {
        self.count == 0 || x < self.count
    }

    fn done(&self, i: &Inst) -> bool {
        match i.kind {
            Kind::Stream => !self.n_or_inf(i.tx_done) && !self.n_or_inf(i.rx_expect),
            Kind::Ring => !self.n_or_inf(i.ring_expect),
            Kind::Table => !self.n_or_inf(i.table_updates),
            Kind::Atomic => !self.n_or_inf(i.atomic_i),
            Kind::Big => self.sz.big_rounds != 0 && i.big_round >= self.sz.big_rounds,
        }
    }

    /// A word of the QP's own holding `v`, as the source of an 8-byte write.
    fn next_word(i: &mut Inst, v: u64) -> u64 {
        let src = i.words + (i.word % 32) * 8;
        i.word += 1;
        wr64(src, v);
        src
    }

    fn stream_step(&mut self, c: &mut Inst) {
        let (plat, sz, mr) = (self.plat, self.sz, self.mr);
        while self.n_or_inf(c.tx_next) && c.tx_next - c.tx_done < DEPTH {
            let tx_next = c.tx_next;
            let at = c.tx + (tx_next % DEPTH) * sz.size;
            fill(at, tx_next, tx_next | STREAM_TO_PEER, sz.size);
            let op = if tx_next % 2 == 1 { Op::SendImm(tx_next as u32) } else { Op::Send };
            if c.qp.post_send(tx_next, op, &[mr.sge(at, sz.size as u32)], true).is_err() {
                break;
            }
            c.tx_next += 1;
        }
        while let Some(w) = poll(plat, c) {
            if w.status != wc_status::SUCCESS {
                return self.error_completion(c, &w);
            }
            if w.opcode == wc_opcode::SEND {
                if w.wr_id != HELLO_WR {
                    c.tx_done += 1;
                }
                continue;
            }
            // On the SRQ a receive's wr_id is its buffer, which may have
            // been posted by another stream QP.
            let at = if self.srq.is_some() { w.wr_id } else { c.rx + (w.wr_id % DEPTH) * sz.size };
            let seq = rd64(at);
            let rx_expect = c.rx_expect;
            if seq != rx_expect {
                self.r.violation(format_args!("stream {}: message {} arrived, expected {}", c.k, seq, rx_expect));
            } else if let Some(j) = check(at, seq, seq | STREAM_TO_GUEST, sz.size) {
                self.r.violation(format_args!("stream {}: message {} word {} differs", c.k, seq, j));
            } else if (seq % 2 == 1) != (w.wc_flags & wc_flags::WITH_IMM != 0) || seq % 2 == 1 && u32::from_be(w.imm_data) != seq as u32 {
                self.r.violation(format_args!("stream {}: message {} immediate {:#x}", c.k, seq, w.imm_data));
            } else {
                self.r.checked();
            }
            c.rx_expect = seq + 1;
            let r = match self.srq {
                Some(srq) => srq.post_recv(at, &[mr.sge(at, sz.size as u32)]),
                None => c.qp.post_recv(w.wr_id, &[mr.sge(at, sz.size as u32)]),
            };
            r.unwrap_or_else(|e| fail(plat, "post_recv", e));
        }
    }

    fn ring_step(&mut self, c: &mut Inst) {
        let (plat, sz, mr) = (self.plat, self.sz, self.mr);
        while let Some(w) = poll(plat, c) {
            if w.status != wc_status::SUCCESS {
                return self.error_completion(c, &w);
            }
            if w.opcode != wc_opcode::RECV_RDMA_WITH_IMM {
                continue;
            }
            let ring_expect = c.ring_expect;
            let k = u32::from_be(w.imm_data) as u64;
            let at = c.ring + (ring_expect % sz.slots) * sz.rec;
            if k != ring_expect as u32 as u64 {
                self.r.violation(format_args!("ring {}: record {} notified, expected {}", c.k, k, ring_expect));
            } else if let Some(j) = check(at, ring_expect, ring_expect | RING, sz.rec) {
                self.r.violation(format_args!("ring {}: record {} word {} differs", c.k, ring_expect, j));
            } else {
                self.r.checked();
            }
            c.ring_expect += 1;
            c.qp.post_recv(0, &[]).unwrap_or_else(|e| fail(plat, "post_recv", e));
            // Credit back every half ring, and at the very end.
            if c.ring_expect.is_multiple_of((sz.slots / 2).max(1)) || c.ring_expect == self.count {
                let src = Self::next_word(c, c.ring_expect);
                let credit = Op::Write { raddr: self.t.credit_at + 8 * c.k, rkey: self.t.rkey };
                let _ = c.qp.post_send(1, credit, &[mr.sge(src, 8)], true);
            }
        }
    }

    fn table_step(&mut self, c: &mut Inst) {
        // One seqlock update: odd version, data, even version.
        let row = c.table_updates % self.sz.rows;
        let at = c.table + row * ROW;
        let v = rd64(at);
        wr64(at, v + 1);
        fence(Ordering::SeqCst);
        for j in 1..ROW / 8 {
            wr64(at + 8 * j, pattern(row << 32 | (v + 2) | TABLE, j));
        }
        fence(Ordering::SeqCst);
        wr64(at, v + 2);
        c.table_updates += 1;
        c.events += 1;
        while let Some(w) = poll(self.plat, c) {
            if w.status != wc_status::SUCCESS {
                return self.error_completion(c, &w);
            }
        }
    }

    fn atomic_step(&mut self, c: &mut Inst) {
        let (plat, mr) = (self.plat, self.mr);
        let (rkey, counter_at, ops_at) = (self.t.rkey, self.t.counter_at + 8 * c.k, self.t.ops_at + 8 * c.k);
        if !c.atomic_busy && self.n_or_inf(c.atomic_i) {
            let atomic_i = c.atomic_i;
            let op = if atomic_i.is_multiple_of(2) {
                Op::FetchAdd { raddr: counter_at, rkey, add: 1 }
            } else {
                Op::CmpSwap { raddr: counter_at, rkey, compare: atomic_i, swap: atomic_i + 1 }
            };
            c.atomic_busy = c.qp.post_send(2, op, &[mr.sge(c.result_word(), 8)], true).is_ok();
        }
        while let Some(w) = poll(plat, c) {
            if w.status != wc_status::SUCCESS {
                return self.error_completion(c, &w);
            }
            if w.wr_id != 2 {
                continue;
            }
            let old = rd64(c.result_word());
            if old != c.atomic_i {
                self.r.violation(format_args!("atomic {}: operation {} returned {}", c.k, c.atomic_i, old));
            } else {
                self.r.checked();
            }
            c.atomic_i += 1;
            c.atomic_busy = false;
            let src = Self::next_word(c, c.atomic_i);
            let _ = c.qp.post_send(3, Op::Write { raddr: ops_at, rkey }, &[mr.sge(src, 8)], true);
        }
    }

    /// Round r: the whole buffer (word 0 = r) in one RDMA WRITE with
    /// immediate r; the peer verifies and clears it, then SENDs r back,
    /// and only then does round r + 1 start.
    fn big_step(&mut self, c: &mut Inst) {
        let (plat, mr) = (self.plat, self.mr);
        let Some(big) = self.big_mr else { return };
        if !c.big_busy {
            let r = c.big_round;
            wr64(big.addr, r);
            fence(Ordering::SeqCst);
            let op = Op::WriteImm { raddr: self.t.big_at, rkey: self.t.big_rkey, imm: r as u32 };
            c.big_busy = c.qp.post_send(4, op, &[big.sge(big.addr, big.len as u32)], true).is_ok();
        }
        while let Some(w) = poll(plat, c) {
            if w.status != wc_status::SUCCESS {
                return self.error_completion(c, &w);
            }
            if w.opcode != wc_opcode::RECV {
                continue;
            }
            let ack = rd64(c.ack_word());
            if ack != c.big_round {
                self.r.violation(format_args!("big: round {} acknowledged as {}", c.big_round, ack));
            } else {
                self.r.checked();
            }
            c.big_round += 1;
            c.big_busy = false;
            c.qp.post_recv(0, &[mr.sge(c.ack_word(), 8)]).unwrap_or_else(|e| fail(plat, "post_recv", e));
        }
    }

    /// An error completion: the QP is in ERR and its workload cannot
    /// finish, so the run ends now, naming the QP and the status.
    fn error_completion(&mut self, c: &Inst, w: &pvrdma_abi::Cqe) {
        self.fail_qp(c, format_args!("completion of wr {:#x} opcode {} status {}", w.wr_id, w.opcode, w.status));
    }

    /// Ends the run with a FAIL line naming QP `c`, its workload's state
    /// and `why`.
    fn fail_qp(&mut self, c: &Inst, why: core::fmt::Arguments) {
        let mut what = TextBuf::<160>::new();
        describe(&mut what, c, self.sz);
        println!("pvrdma: FAIL QP {} (handle {}, {}): {}", c.qp.qpn, c.qp.handle, core::str::from_utf8(what.as_bytes()).unwrap_or(""), why);
        self.r.violations += 1;
        self.r.fatal = true;
    }

    /// Fails the run if a QP with work left has completed nothing for
    /// WATCHDOG_NS: a stuck QP ends in a FAIL that names it, not a hang.
    fn watchdog(&mut self, insts: &mut [Inst]) {
        let now = self.plat.now_ns();
        for i in insts.iter_mut() {
            if i.events != i.seen_events || i.seen_at == 0 {
                (i.seen_events, i.seen_at) = (i.events, now);
                continue;
            }
            if self.done(i) || now.saturating_sub(i.seen_at) < WATCHDOG_NS {
                continue;
            }
            self.fail_qp(i, format_args!("no completion for {} s", (now - i.seen_at) / 1_000_000_000));
        }
    }

    /// The result to the console and the mailbox; whether it passed.
    fn report(&self, mb: &mut Mailbox, insts: &[Inst]) -> bool {
        let ok = self.r.violations == 0;
        let sum = |f: fn(&Inst) -> u64| insts.iter().map(f).sum::<u64>();
        let mut res = TextBuf::<256>::new();
        let _ = write!(
            res,
            "pvrdma: {} checked={} violations={} qps={} stream={} ring={} table={} atomic={} big={}",
            if ok { "PASS" } else { "FAIL" },
            self.r.checked,
            self.r.violations,
            insts.len(),
            sum(|i| i.rx_expect),
            sum(|i| i.ring_expect),
            sum(|i| i.table_updates),
            sum(|i| i.atomic_i),
            sum(|i| i.big_round),
        );
        println!("{}", core::str::from_utf8(res.as_bytes()).unwrap_or(""));
        mb.publish(res.as_bytes());
        ok
    }
}

/// The next completion of the QP's CQ, counted as progress.
fn poll(plat: Platform, c: &mut Inst) -> Option<pvrdma_abi::Cqe> {
    let w = c.cq.poll().unwrap_or_else(|e| fail(plat, "poll", e));
    c.events += w.is_some() as u64;
    w
}

/// The QP's workload and where it stands, for a FAIL line.
fn describe<const N: usize>(out: &mut TextBuf<N>, i: &Inst, sz: &Sizes) {
    let _ = match i.kind {
        Kind::Stream => write!(out, "stream {}: sent {} completed {} received {}", i.k, i.tx_next, i.tx_done, i.rx_expect),
        Kind::Ring => write!(out, "ring {}: records {}", i.k, i.ring_expect),
        Kind::Table => write!(out, "table {}: updates {}", i.k, i.table_updates),
        Kind::Atomic => write!(out, "atomic {}: operations {} busy {}", i.k, i.atomic_i, i.atomic_busy),
        Kind::Big => write!(out, "big: round {} of {} busy {}", i.big_round, sz.big_rounds, i.big_busy),
    };
}

/// The device stays up (the peer may still be finishing: its last ACKs and
/// table reads need this side), unless `exit=1` asks the firmware to end
/// the VM.
fn after_run(plat: Platform, args: &Args, insts: &[Inst], ok: bool) -> ! {
    if args.get("exit") == Some("1") {
        let t0 = plat.now_ns();
        while plat.now_ns() - t0 < 500_000_000 {
            for i in insts {
                let _ = i.cq.poll();
            }
        }
        plat.exit(if ok { 0 } else { 1 })
    }
    loop {
        for i in insts {
            while let Ok(Some(w)) = i.cq.poll() {
                if w.status != wc_status::SUCCESS {
                    println!("pvrdma: after the run, QP {} completion {:#x} status {}", i.qp.qpn, w.wr_id, w.status);
                }
            }
        }
    }
}
