//! `workload=pvrdma`: the guest side of the RDMA workloads checked against
//! a bare-metal peer (`transit rdma peer`; the protocol is described in
//! crates/verbs/src/peer.rs, keep both in step).
//!
//! `workload=pvrdma gid=A.B.C.D [run=stream,ring,table,atomic] [count=N]
//! [size=256] [slots=16] [rec=128] [rows=8] [pvrdma_mem=ADDR]`
//!
//! The guest brings the device up, creates one QP per workload, publishes
//! its IDs in the mailbox, waits for the peer's, connects, says hello on
//! every QP and runs every workload at once: `count` of each (0: without
//! end). Progress (everything checked so far) goes to the platform page,
//! violations to the console; with a count it ends with a `pvrdma: PASS`
//! or `FAIL` line on the console and in the mailbox, and keeps the device
//! up for the peer (`exit=1`: ends the VM with exit status 0 or 1).

use super::{Cq, Device, Op, Qp, Remote};
use crate::args::Args;
use crate::hw::Platform;
use crate::mailbox::{Mailbox, TextBuf};
use crate::nvme::Region;
use core::fmt::Write;
use core::sync::atomic::{fence, Ordering};
use pvrdma_abi::ib::{wc_flags, wc_opcode, wc_status};

const HELLO: u64 = 0x5256_504f_4c4c_4548;
const STREAM_TO_PEER: u64 = 1 << 60;
const STREAM_TO_GUEST: u64 = 2 << 60;
const RING: u64 = 3 << 60;
const TABLE: u64 = 4 << 60;
const ROW: u64 = 64;
const DEPTH: u64 = 32;
const HELLO_WR: u64 = u64::MAX;

fn pattern(seed: u64, j: u64) -> u64 {
    seed.wrapping_add(j).wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(17) ^ j
}

fn rd64(a: u64) -> u64 {
    // SAFETY: identity-mapped guest RAM of our buffer.
    unsafe { core::ptr::read_volatile(a as *const u64) }
}

fn wr64(a: u64, v: u64) {
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

fn parse_num(s: &str) -> Option<u64> {
    match s.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16).ok(),
        None => s.parse().ok(),
    }
}

fn parse_ip(s: &str) -> Option<[u8; 4]> {
    let mut ip = [0u8; 4];
    let mut parts = s.split('.');
    for b in ip.iter_mut() {
        *b = parts.next()?.parse().ok()?;
    }
    parts.next().is_none().then_some(ip)
}

/// The peer's `key=value` words.
struct PeerInfo<'a>(&'a str);

impl PeerInfo<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.split_ascii_whitespace().find_map(|w| w.split_once('=').filter(|(k, _)| *k == key).map(|(_, v)| v))
    }
    fn num(&self, key: &str) -> Option<u64> {
        self.get(key).and_then(parse_num)
    }
}

struct Chan {
    name: &'static str,
    qp: Qp,
    cq: Cq,
    psn: u32,
}

/// Offsets in the one registered buffer.
struct Layout {
    size: u64,
    slots: u64,
    rec: u64,
    rows: u64,
    rx: u64,
    tx: u64,
    ring: u64,
    table: u64,
    words: u64,
    hello: u64,
    len: u64,
}

impl Layout {
    fn new(base: u64, size: u64, slots: u64, rec: u64, rows: u64) -> Layout {
        let rx = base;
        let tx = rx + DEPTH * size;
        let ring = tx + DEPTH * size;
        let table = ring + slots * rec;
        let words = table + rows * ROW;
        let hello = words + 64 * 8;
        Layout { size, slots, rec, rows, rx, tx, ring, table, words, hello, len: hello + 64 - base }
    }
}

struct Run {
    plat: Platform,
    violations: u64,
    checked: u64,
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

fn fail(plat: Platform, what: &str, e: super::Error) -> ! {
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
    let mut s = bring_up(plat, args, boot, gid, wanted);
    let targets = exchange_ids(plat, &mut s, gid, count);
    post_first(plat, &s);
    println!("pvrdma: connected, running {} with count={}", wanted, count);

    let mut w = Workloads::new(plat, &s.lay, &s.mr, targets, count);
    let [stream, ring, table, atomic] = &s.chans;
    loop {
        let stream_done = stream.is_none() || !w.n_or_inf(w.tx_done) && !w.n_or_inf(w.rx_expect);
        let ring_done = ring.is_none() || !w.n_or_inf(w.ring_expect);
        let atomic_done = atomic.is_none() || !w.n_or_inf(w.atomic_i);
        let table_done = table.is_none() || !w.n_or_inf(w.table_updates);
        if stream_done && ring_done && atomic_done && table_done {
            break;
        }
        if let Some(c) = stream {
            w.stream_step(c);
        }
        if let Some(c) = ring {
            w.ring_step(c);
        }
        if let Some(c) = table {
            w.table_step(c);
        }
        if let Some(c) = atomic {
            w.atomic_step(c);
        }
    }
    let ok = w.report(&mut s.mb);
    after_run(plat, args, &s.chans, ok)
}

/// Everything the workloads share once the device is up: one buffer, one
/// MR over it, one QP (with its CQ) per wanted workload.
struct Setup {
    mb: Mailbox,
    dev: Device,
    mr: super::Mr,
    lay: Layout,
    chans: [Option<Chan>; 4],
}

fn bring_up(plat: Platform, args: &Args, boot: &crate::boot::BootInfo, gid: [u8; 4], wanted: &str) -> Setup {
    let lay_size = args.num("size", 256).clamp(16, 4096) & !7;
    let slots = args.num("slots", 16).clamp(2, 256);
    let rec = args.num("rec", 128).clamp(16, 4096) & !7;
    let rows = args.num("rows", 8).clamp(1, 1024);
    let start = args.num("pvrdma_mem", boot.firmware_end).max(boot.firmware_end);
    let mut region = Region { next: start, end: boot.ram_size };
    let mb = match Mailbox::find(boot.mmio_base) {
        Some(m) => m,
        None => {
            println!("pvrdma: FAIL no mailbox page");
            plat.exit(1)
        }
    };

    let mut dev = Device::init(plat, &mut region, gid).unwrap_or_else(|e| fail(plat, "bring-up", e));
    println!(
        "pvrdma: device version {} max_qp {} max_cqe {} max_sge {} atomics {:#x}",
        dev.version, dev.caps.max_qp, dev.caps.max_cqe, dev.caps.max_sge, dev.caps.atomic_ops
    );
    let port = dev.query_port().unwrap_or_else(|e| fail(plat, "QUERY_PORT", e));
    println!("pvrdma: port state {} active_mtu {}", port.state, port.active_mtu);
    let pd = dev.create_pd().unwrap_or_else(|e| fail(plat, "CREATE_PD", e));
    let lay0 = Layout::new(0, lay_size, slots, rec, rows);
    let buf = region.alloc(lay0.len).unwrap_or_else(|| fail(plat, "memory", super::Error::NoMemory));
    let lay = Layout::new(buf, lay_size, slots, rec, rows);
    let access = pvrdma_abi::ib::access::LOCAL_WRITE
        | pvrdma_abi::ib::access::REMOTE_WRITE
        | pvrdma_abi::ib::access::REMOTE_READ
        | pvrdma_abi::ib::access::REMOTE_ATOMIC;
    let mr = dev.reg_mr(&mut region, pd, buf, lay.len, access).unwrap_or_else(|e| fail(plat, "CREATE_MR", e));

    let mut chans: [Option<Chan>; 4] = [None, None, None, None];
    for (i, name) in ["stream", "ring", "table", "atomic"].into_iter().enumerate() {
        if !wanted.split(',').any(|w| w == name) {
            continue;
        }
        let cq = dev.create_cq(&mut region, 4 * DEPTH as u32).unwrap_or_else(|e| fail(plat, "CREATE_CQ", e));
        let depth = if name == "ring" { (slots as u32).max(DEPTH as u32) } else { DEPTH as u32 };
        let qp = dev.create_qp(&mut region, pd, &cq, &cq, 2 * depth, 1).unwrap_or_else(|e| fail(plat, "CREATE_QP", e));
        chans[i] = Some(Chan { name, qp, cq, psn: 0x1000 * (i as u32 + 1) });
    }
    Setup { mb, dev, mr, lay, chans }
}

/// Where the workloads write and operate on the peer's side.
struct Targets {
    rkey: u32,
    credit_at: u64,
    counter_at: u64,
    ops_at: u64,
}

/// Publishes our IDs, waits for the peer's (once each) and connects every QP.
fn exchange_ids(plat: Platform, s: &mut Setup, gid: [u8; 4], count: u64) -> Targets {
    let (lay, mr) = (&s.lay, &s.mr);
    let mut me = TextBuf::<0x700>::new();
    let _ = write!(me, "gid={}.{}.{}.{} count={} size={}", gid[0], gid[1], gid[2], gid[3], count, lay.size);
    for c in s.chans.iter().flatten() {
        let _ = write!(me, " {}.qpn={} {}.psn={}", c.name, c.qp.qpn, c.name, c.psn);
    }
    let _ = write!(me, " ring.addr={:#x} ring.rkey={} ring.slots={} ring.rec={}", lay.ring, mr.rkey, lay.slots, lay.rec);
    let _ = write!(me, " table.addr={:#x} table.rkey={} table.rows={}", lay.table, mr.rkey, lay.rows);
    for r in 0..lay.rows {
        fill(lay.table + r * ROW, 0, r << 32 | TABLE, ROW);
    }
    wr64(lay.hello, HELLO);
    wr64(lay.hello + 8, 0);
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
    for c in s.chans.iter().flatten() {
        let mut k = TextBuf::<32>::new();
        let _ = write!(k, "{}.qpn", c.name);
        let qpn = peer.num(core::str::from_utf8(k.as_bytes()).unwrap()).unwrap_or(0) as u32;
        let mut k = TextBuf::<32>::new();
        let _ = write!(k, "{}.psn", c.name);
        let psn = peer.num(core::str::from_utf8(k.as_bytes()).unwrap()).unwrap_or(0) as u32;
        s.dev.connect(&c.qp, &Remote { gid: pgid, qpn, psn, my_psn: c.psn }).unwrap_or_else(|e| fail(plat, "MODIFY_QP", e));
    }
    Targets {
        rkey: peer.num("rkey").unwrap_or(0) as u32,
        credit_at: peer.num("ring.credit").unwrap_or(0),
        counter_at: peer.num("atomic.counter").unwrap_or(0),
        ops_at: peer.num("atomic.ops").unwrap_or(0),
    }
}

/// Receives before hellos: the peer starts the moment it hears one.
fn post_first(plat: Platform, s: &Setup) {
    let (lay, mr) = (&s.lay, &s.mr);
    let [stream, ring, _, _] = &s.chans;
    if let Some(c) = stream {
        for k in 0..DEPTH {
            c.qp.post_recv(k, &[mr.sge(lay.rx + k * lay.size, lay.size as u32)]).unwrap_or_else(|e| fail(plat, "post_recv", e));
        }
    }
    if let Some(c) = ring {
        for k in 0..lay.slots {
            c.qp.post_recv(k, &[]).unwrap_or_else(|e| fail(plat, "post_recv", e));
        }
    }
    for c in s.chans.iter().flatten() {
        c.qp.post_send(HELLO_WR, Op::Send, &[mr.sge(lay.hello, 16)], true).unwrap_or_else(|e| fail(plat, "hello", e));
    }
}

/// The running workloads' counters; each step posts what it may without
/// waiting and drains its CQ, so all four advance together in one loop.
struct Workloads<'a> {
    plat: Platform,
    lay: &'a Layout,
    mr: &'a super::Mr,
    t: Targets,
    count: u64,
    r: Run,
    tx_next: u64,
    tx_done: u64,
    rx_expect: u64,
    ring_expect: u64,
    table_updates: u64,
    atomic_i: u64,
    atomic_busy: bool,
    /// The next of the 32 source words for small RDMA writes to the peer.
    word: u64,
    result_word: u64,
}

impl<'a> Workloads<'a> {
    fn new(plat: Platform, lay: &'a Layout, mr: &'a super::Mr, t: Targets, count: u64) -> Self {
        Workloads {
            plat,
            lay,
            mr,
            t,
            count,
            r: Run { plat, violations: 0, checked: 0 },
            tx_next: 0,
            tx_done: 0,
            rx_expect: 0,
            ring_expect: 0,
            table_updates: 0,
            atomic_i: 0,
            atomic_busy: false,
            word: 0,
            result_word: lay.words + 63 * 8,
        }
    }

    /// Whether the x-th operation is still to do (count 0: without end).
    fn n_or_inf(&self, x: u64) -> bool {
        self.count == 0 || x < self.count
    }

    /// A word of ours holding `v`, as the source of an 8-byte write.
    fn next_word(&mut self, v: u64) -> u64 {
        let src = self.lay.words + (self.word % 32) * 8;
        self.word += 1;
        wr64(src, v);
        src
    }

    fn stream_step(&mut self, c: &Chan) {
        let (plat, lay, mr) = (self.plat, self.lay, self.mr);
        while self.n_or_inf(self.tx_next) && self.tx_next - self.tx_done < DEPTH {
            let tx_next = self.tx_next;
            let at = lay.tx + (tx_next % DEPTH) * lay.size;
            fill(at, tx_next, tx_next | STREAM_TO_PEER, lay.size);
            let op = if tx_next % 2 == 1 { Op::SendImm(tx_next as u32) } else { Op::Send };
            if c.qp.post_send(tx_next, op, &[mr.sge(at, lay.size as u32)], true).is_err() {
                break;
            }
            self.tx_next += 1;
        }
        while let Some(w) = c.cq.poll().unwrap_or_else(|e| fail(plat, "poll", e)) {
            if w.status != wc_status::SUCCESS {
                self.r.violation(format_args!("stream: completion {:#x} status {}", w.wr_id, w.status));
                continue;
            }
            if w.opcode == wc_opcode::SEND {
                if w.wr_id != HELLO_WR {
                    self.tx_done += 1;
                }
                continue;
            }
            let at = lay.rx + (w.wr_id % DEPTH) * lay.size;
            let seq = rd64(at);
            let rx_expect = self.rx_expect;
            if seq != rx_expect {
                self.r.violation(format_args!("stream: message {} arrived, expected {}", seq, rx_expect));
            } else if let Some(j) = check(at, seq, seq | STREAM_TO_GUEST, lay.size) {
                self.r.violation(format_args!("stream: message {} word {} differs", seq, j));
            } else if (seq % 2 == 1) != (w.wc_flags & wc_flags::WITH_IMM != 0) || seq % 2 == 1 && u32::from_be(w.imm_data) != seq as u32 {
                self.r.violation(format_args!("stream: message {} immediate {:#x}", seq, w.imm_data));
            } else {
                self.r.checked();
            }
            self.rx_expect = seq + 1;
            c.qp.post_recv(w.wr_id, &[mr.sge(at, lay.size as u32)]).unwrap_or_else(|e| fail(plat, "post_recv", e));
        }
    }

    fn ring_step(&mut self, c: &Chan) {
        let (plat, lay, mr) = (self.plat, self.lay, self.mr);
        while let Some(w) = c.cq.poll().unwrap_or_else(|e| fail(plat, "poll", e)) {
            if w.status != wc_status::SUCCESS {
                self.r.violation(format_args!("ring: completion {:#x} status {}", w.wr_id, w.status));
                continue;
            }
            if w.opcode != wc_opcode::RECV_RDMA_WITH_IMM {
                continue;
            }
            let ring_expect = self.ring_expect;
            let k = u32::from_be(w.imm_data) as u64;
            let at = lay.ring + (ring_expect % lay.slots) * lay.rec;
            if k != ring_expect as u32 as u64 {
                self.r.violation(format_args!("ring: record {} notified, expected {}", k, ring_expect));
            } else if let Some(j) = check(at, ring_expect, ring_expect | RING, lay.rec) {
                self.r.violation(format_args!("ring: record {} word {} differs", ring_expect, j));
            } else {
                self.r.checked();
            }
            self.ring_expect += 1;
            c.qp.post_recv(0, &[]).unwrap_or_else(|e| fail(plat, "post_recv", e));
            // Credit back every half ring, and at the very end.
            if self.ring_expect.is_multiple_of((lay.slots / 2).max(1)) || self.ring_expect == self.count {
                let src = self.next_word(self.ring_expect);
                let _ = c.qp.post_send(1, Op::Write { raddr: self.t.credit_at, rkey: self.t.rkey }, &[mr.sge(src, 8)], true);
            }
        }
    }

    fn table_step(&mut self, c: &Chan) {
        // One seqlock update: odd version, data, even version.
        let lay = self.lay;
        let row = self.table_updates % lay.rows;
        let at = lay.table + row * ROW;
        let v = rd64(at);
        wr64(at, v + 1);
        fence(Ordering::SeqCst);
        for j in 1..ROW / 8 {
            wr64(at + 8 * j, pattern(row << 32 | (v + 2) | TABLE, j));
        }
        fence(Ordering::SeqCst);
        wr64(at, v + 2);
        self.table_updates += 1;
        while let Some(w) = c.cq.poll().unwrap_or_else(|e| fail(self.plat, "poll", e)) {
            if w.status != wc_status::SUCCESS {
                self.r.violation(format_args!("table: completion {:#x} status {}", w.wr_id, w.status));
            }
        }
    }

    fn atomic_step(&mut self, c: &Chan) {
        let (plat, mr, t) = (self.plat, self.mr, &self.t);
        let (rkey, counter_at, ops_at) = (t.rkey, t.counter_at, t.ops_at);
        if !self.atomic_busy && self.n_or_inf(self.atomic_i) {
            let atomic_i = self.atomic_i;
            let op = if atomic_i.is_multiple_of(2) {
                Op::FetchAdd { raddr: counter_at, rkey, add: 1 }
            } else {
                Op::CmpSwap { raddr: counter_at, rkey, compare: atomic_i, swap: atomic_i + 1 }
            };
            self.atomic_busy = c.qp.post_send(2, op, &[mr.sge(self.result_word, 8)], true).is_ok();
        }
        while let Some(w) = c.cq.poll().unwrap_or_else(|e| fail(plat, "poll", e)) {
            if w.status != wc_status::SUCCESS {
                self.r.violation(format_args!("atomic: completion {:#x} status {}", w.wr_id, w.status));
                continue;
            }
            if w.wr_id != 2 {
                continue;
            }
            let old = rd64(self.result_word);
            if old != self.atomic_i {
                self.r.violation(format_args!("atomic: operation {} returned {}", self.atomic_i, old));
            } else {
                self.r.checked();
            }
            self.atomic_i += 1;
            self.atomic_busy = false;
            let src = self.next_word(self.atomic_i);
            let _ = c.qp.post_send(3, Op::Write { raddr: ops_at, rkey }, &[mr.sge(src, 8)], true);
        }
    }

    /// The result to the console and the mailbox; whether it passed.
    fn report(&self, mb: &mut Mailbox) -> bool {
        let ok = self.r.violations == 0;
        let mut res = TextBuf::<256>::new();
        let _ = write!(
            res,
            "pvrdma: {} checked={} violations={} stream={} ring={} table={} atomic={}",
            if ok { "PASS" } else { "FAIL" },
            self.r.checked,
            self.r.violations,
            self.rx_expect,
            self.ring_expect,
            self.table_updates,
            self.atomic_i
        );
        println!("{}", core::str::from_utf8(res.as_bytes()).unwrap_or(""));
        mb.publish(res.as_bytes());
        ok
    }
}

/// The device stays up (the peer may still be finishing: its last ACKs and
/// table reads need this side), unless `exit=1` asks the firmware to end
/// the VM.
fn after_run(plat: Platform, args: &Args, chans: &[Option<Chan>; 4], ok: bool) -> ! {
    if args.get("exit") == Some("1") {
        let t0 = plat.now_ns();
        while plat.now_ns() - t0 < 500_000_000 {
            for c in chans.iter().flatten() {
                let _ = c.cq.poll();
            }
        }
        plat.exit(if ok { 0 } else { 1 })
    }
    loop {
        for c in chans.iter().flatten() {
            while let Ok(Some(w)) = c.cq.poll() {
                if w.status != wc_status::SUCCESS {
                    println!("pvrdma: after the run, {} completion {:#x} status {}", c.name, w.wr_id, w.status);
                }
            }
        }
    }
}
