//! `transit rdma peer`: the bare-metal side of the guest's RDMA workloads.
//!
//! The guest (crates/guest/src/pvrdma/workloads.rs) and this peer check each
//! other; the protocol below is the contract between them. The guest has no
//! TCP/IP stack, so each side states its IDs once, as one line of
//! `key=value` words carried by the VM's mailbox:
//!
//! - the guest: `gid=`, `size=`, `count=`, its QPs as `qps=N run=W,W,..
//!   qpn=LIST psn=P` (QP i runs workload i mod the number named, with its
//!   own buffers and checks, and starts at PSN P + i * [`PSN_STEP`]; LIST
//!   is numbers and ranges such as `17-48`) or, one QP per workload, as
//!   `W.qpn= W.psn=`; plus `ring.addr= ring.rkey= ring.slots= ring.rec=`,
//!   `table.addr= table.rkey= table.rows=` (the k-th ring or table QP's
//!   ring or table follows the k-1 before it), and for the big WRITE
//!   `big.qpn= big.psn= big.len= big.rounds=`;
//! - the peer (this program's first line of output): `gid= rkey=`, its QPs
//!   in the guest's form (`qpn=LIST psn=P`, or `W.qpn= W.psn=`), and
//!   `ring.credit= atomic.counter= atomic.ops=`, the first of one u64 per
//!   ring or atomic QP (addresses in the peer's region `rkey`), and
//!   `big.addr= big.rkey=`.
//!
//! A workload runs when the guest names a QP for it. Neither side is told
//! anything later: after a move the guest keeps its GID, QPNs and keys.
//! Each guest QP first SENDs a 16-byte hello (word 0 = [`HELLO`]) once it
//! is in RTS with its receives posted; the peer starts that QP then. What
//! follows is per QP (`count` is per QP too):
//!
//! - **stream**: SEND/RECV both ways, `count` messages each (0: until
//!   `--duration`), `size` bytes: word 0 = sequence number, word j =
//!   `pattern(seq | STREAM_TO_PEER or STREAM_TO_GUEST, j)`. Odd sequence
//!   numbers go as SEND with immediate, imm = low 32 bits of the sequence.
//!   Each receiver checks exactly-once, in-order delivery and every word.
//! - **ring**: the peer RDMA-WRITEs record k (`rec` bytes: word 0 = k,
//!   word j = `pattern(k | RING, j)`) into slot k mod `slots` at
//!   `ring.addr`, with immediate k to notify. The guest checks every record
//!   and RDMA-WRITEs how many it has checked (u64) to `ring.credit`; the
//!   peer never has more than `slots` records unchecked.
//! - **table**: `rows` rows of 64 bytes at `table.addr`: word 0 = version
//!   (odd while the guest rewrites the row), words 1..8 =
//!   `pattern(row << 32 | version | TABLE, j)`. The guest rewrites rows
//!   round-robin; the peer RDMA-READs the version, the row and the version
//!   again, in order on one QP (a seqlock reader). Equal even versions with
//!   other data are a torn read; a version lower than one seen before went
//!   backwards. Both are violations.
//! - **atomic**: a counter at `atomic.counter`. The guest's operation i is
//!   fetch-and-add 1 (i even) or compare-and-swap i -> i+1 (i odd), and must
//!   return i; after it, the guest RDMA-WRITEs i+1 to `atomic.ops`. The
//!   peer checks ops <= counter <= ops + 1 while it runs, and
//!   counter == ops == `count` at the end.
//! - **big**: round r: the guest RDMA-WRITEs `big.len` bytes (word 0 = r,
//!   word j = `pattern(BIG, j)`) to `big.addr` in one WRITE with immediate
//!   r. The peer checks every word, clears the buffer (so a part missing
//!   from a later round shows as zeros), and SENDs r (u64) back; the guest
//!   checks it and starts round r + 1. `big.rounds` rounds (0: without
//!   end).
//!
//! The report (last line of output, JSON) counts, per workload and in all,
//! what was verified, errors, lost and duplicated messages and error
//! completions, and times the longest gaps (see [`PeerReport::max_gap_ms`]).

use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use serde::Serialize;

use crate::*;

mod bench;

/// Word 0 of the hello each guest QP sends first ("HELLOPVR").
pub const HELLO: u64 = 0x5256_504f_4c4c_4548;
pub const STREAM_TO_PEER: u64 = 1 << 60;
pub const STREAM_TO_GUEST: u64 = 2 << 60;
pub const RING: u64 = 3 << 60;
pub const TABLE: u64 = 4 << 60;
pub const TABLE_ROW: usize = 64;

/// Word j of the data with seed `seed` (cheap enough for the emulated guest).
pub fn pattern(seed: u64, j: u64) -> u64 {
    seed.wrapping_add(j).wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(17) ^ j
}

/// A message or record of `len` bytes (a multiple of 8) with word 0 = `first`.
pub fn fill(first: u64, seed: u64, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len);
    v.extend_from_slice(&first.to_le_bytes());
    for j in 1..(len / 8) as u64 {
        v.extend_from_slice(&pattern(seed, j).to_le_bytes());
    }
    v
}

/// The index of the first word of `data` (word 0 = `first`) that differs.
pub fn check(data: &[u8], first: u64, seed: u64) -> Option<usize> {
    check_part(data, 0, first, seed)
}

/// [`check`] of a part of a message: `data` holds its words from index
/// `at` on; returns the message's index of the first that differs.
pub fn check_part(data: &[u8], at: usize, first: u64, seed: u64) -> Option<usize> {
    data.chunks_exact(8).enumerate().map(|(j, w)| (at + j, w)).find_map(|(j, w)| {
        let w = u64::from_le_bytes(w.try_into().unwrap());
        (w != if j == 0 { first } else { pattern(seed, j as u64) }).then_some(j)
    })
}

/// `key=value` words, as both sides write them.
#[derive(Debug, Default, Clone)]
pub struct Info(pub BTreeMap<String, String>);

impl Info {
    pub fn parse(text: &str) -> Info {
        Info(text.split_ascii_whitespace().filter_map(|w| w.split_once('=')).map(|(k, v)| (k.into(), v.into())).collect())
    }
    pub fn has(&self, k: &str) -> bool {
        self.0.contains_key(k)
    }
    pub fn num(&self, k: &str) -> anyhow::Result<u64> {
        let v = self.0.get(k).with_context(|| format!("the guest did not say {k}="))?;
        let r = match v.strip_prefix("0x") {
            Some(h) => u64::from_str_radix(h, 16),
            None => v.parse(),
        };
        r.with_context(|| format!("{k}={v} is not a number"))
    }
    pub fn u32(&self, k: &str) -> anyhow::Result<u32> {
        u32::try_from(self.num(k)?).with_context(|| format!("{k} does not fit in 32 bits"))
    }
    pub fn gid(&self) -> anyhow::Result<Ipv4Addr> {
        self.0.get("gid").context("the guest did not say gid=")?.parse().context("gid= must be an IPv4 address")
    }
    pub fn set(&mut self, k: &str, v: impl std::fmt::Display) {
        self.0.insert(k.into(), v.to_string());
    }
    pub fn line(&self) -> String {
        self.0.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" ")
    }
}

#[derive(clap::Args, Clone, Debug)]
pub struct PeerArgs {
    /// The guest's IDs (`key=value` words, as `transit vm mailbox` prints
    /// them): a file, or `-` for standard input (its first line).
    #[arg(long)]
    pub guest: PathBuf,
    /// Also write this side's IDs (the first line of output) to this file.
    #[arg(long)]
    pub info_out: Option<PathBuf>,
    /// Stop after this many seconds (default: when every workload did its
    /// count). SIGINT or SIGTERM end the run the same way at any time.
    #[arg(long)]
    pub duration: Option<f64>,
    /// Give up if nothing completes for this many seconds.
    #[arg(long, default_value_t = 60.0)]
    pub stall: f64,
    /// Path MTU in bytes (the guest firmware's QPs use 1024).
    #[arg(long, default_value_t = 1024)]
    pub mtu: usize,
    /// Local ACK timeout (4.096 us * 2^t). Retries are 7 of these: use 20 or
    /// more when the guest may be away for seconds (save on one host,
    /// restore on another).
    #[arg(long, default_value_t = 16)]
    pub timeout: u8,
    /// Table reads (seqlock triples) to do; 0: as many as fit in the run.
    #[arg(long, default_value_t = 0)]
    pub table_reads: u64,
    #[arg(long)]
    pub sock: Option<PathBuf>,
    /// Print a progress line (JSON: `{"progress":{WORKLOAD:verified,..}}`)
    /// every this many seconds, so a caller can end the run (SIGTERM) once
    /// it has seen what it needs; the report stays the last line.
    #[arg(long)]
    pub progress: Option<f64>,
}

/// What one workload verified.
#[derive(Serialize, Default, Debug, Clone)]
pub struct WorkloadReport {
    /// Messages, records, consistent rows or atomic results checked whole.
    pub verified: u64,
    pub bytes_verified: u64,
    /// What this side put on the wire (messages sent, records written, reads).
    pub issued: u64,
    pub errors: u64,
    pub lost: u64,
    pub duplicated: u64,
    /// Longest time between two completions of one QP of this workload
    /// (for atomic: two moves of its counter), ms, over the whole run: a
    /// diagnostic of single QPs, which at hundreds of QPs on a busy host
    /// also measures how the peer and the guest take turns among them.
    pub max_gap_ms: f64,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub detail: BTreeMap<String, u64>,
    /// QPs running this workload, and how many of them did their count.
    pub qps: usize,
    pub qps_done: usize,
    pub done: bool,
}

#[derive(Serialize, Debug, Default)]
pub struct PeerReport {
    pub ok: bool,
    pub seconds: f64,
    /// QPs connected to the guest.
    pub qps: usize,
    pub messages_verified: u64,
    pub bytes_verified: u64,
    pub errors: u64,
    pub lost: u64,
    pub duplicated: u64,
    pub error_completions: u64,
    /// The connection's longest stall, ms: the longest time in which no QP
    /// of the peer completed anything (a send, a receive, a READ, or an
    /// atomic counter that moved), from the moment every QP has started
    /// (its hello arrived) until the run is told to end. This is what a
    /// user of all the connections sees during a migration's blackout, and
    /// the same measure with and without one.
    pub max_gap_ms: f64,
    /// The longest such time of any single QP (the largest of the
    /// workloads' `max_gap_ms`).
    pub max_qp_gap_ms: f64,
    /// The connection's longest stalls of 1 ms or more (at most
    /// [`LONG_GAPS`], longest first), each with the wall-clock time it began: which of them a
    /// migration's switch caused is told by when it happened, where the
    /// longest of a whole run on a busy host may be the scheduler's.
    pub long_gaps: Vec<Gap>,
    pub workloads: BTreeMap<String, WorkloadReport>,
    /// The first violations, in words.
    pub violations: Vec<String>,
}

/// A stall of the whole connection: no QP completed anything.
#[derive(Serialize, Debug, Default, Clone, Copy)]
pub struct Gap {
    /// When it began (the last completion before it), ms since the Unix
    /// epoch: comparable with the times other processes of the host log.
    pub start_unix_ms: f64,
    pub ms: f64,
    /// The workload whose completion ended it.
    pub ended_by: &'static str,
}

/// How many of the connection's longest stalls a report lists: enough that
/// a migration's stall is among them even when a loaded host made many
/// longer ones elsewhere in the run.
pub const LONG_GAPS: usize = 512;

/// Stalls shorter than this are the connection's ordinary pace (one
/// completion after another), not stalls: the report does not list them.
const MIN_LISTED_GAP_MS: f64 = 1.0;

const MAX_VIOLATIONS: usize = 32;
const STREAM_DEPTH: usize = 64;
const RING_WINDOW: usize = 32;
const SMALL: usize = 64;
/// Most QPs one run connects (the guest's `qps=` is at most this).
pub const MAX_QPS: usize = 256;
/// Starting PSNs of consecutive QPs are this far apart (`psn=` is the first).
pub const PSN_STEP: u32 = 0x100;
/// Word 1.. of the big WRITE's data: `pattern(BIG, j)`; word 0 is the round.
pub const BIG: u64 = 5 << 60;
/// The most a big WRITE may be.
pub const MAX_BIG: u64 = 1 << 30;
/// Bytes of a big WRITE's round the peer checks and clears per pass of its
/// loop. Checking a 64 MiB round whole takes the peer's one thread a few
/// hundred ms, and every QP's completions wait meanwhile: a stall of the
/// peer program that its gaps would count as the connection's. A MiB is
/// about a ms.
const BIG_CHECK_CHUNK: usize = 1 << 20;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Kind {
    Stream,
    Ring,
    Table,
    Atomic,
    Big,
}

impl Kind {
    pub const WORKLOADS: [Kind; 4] = [Kind::Stream, Kind::Ring, Kind::Table, Kind::Atomic];
    pub fn name(self) -> &'static str {
        match self {
            Kind::Stream => "stream",
            Kind::Ring => "ring",
            Kind::Table => "table",
            Kind::Atomic => "atomic",
            Kind::Big => "big",
        }
    }
    pub fn parse(s: &str) -> Option<Kind> {
        Kind::WORKLOADS.into_iter().find(|k| k.name() == s)
    }
}

/// Numbers and ranges (`17-40,45`), as both sides write QPN lists.
pub fn parse_ranges(s: &str) -> anyhow::Result<Vec<u32>> {
    let mut out = Vec::new();
    for part in s.split(',').filter(|p| !p.is_empty()) {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let (a, b): (u32, u32) = (a.parse().with_context(|| format!("{part:?}"))?, b.parse().with_context(|| format!("{part:?}"))?);
        if b < a || (b - a) as usize >= MAX_QPS || out.len() + (b - a) as usize >= MAX_QPS {
            bail!("QPN list {s:?}: more than {MAX_QPS} QPs or a range backwards");
        }
        out.extend(a..=b);
    }
    Ok(out)
}

/// `nums` as numbers and ranges.
pub fn write_ranges(nums: &[u32]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < nums.len() {
        let mut j = i;
        while j + 1 < nums.len() && nums[j + 1] == nums[j].wrapping_add(1) {
            j += 1;
        }
        parts.push(if i == j { nums[i].to_string() } else { format!("{}-{}", nums[i], nums[j]) });
        i = j + 1;
    }
    parts.join(",")
}

/// One guest QP as its IDs name it: the workload it runs, and where it is.
#[derive(Debug, Clone)]
pub struct GuestQp {
    pub kind: Kind,
    pub qpn: u32,
    pub psn: u32,
}

/// The guest's QPs, in its order: either `qps=N run=W,.. qpn=LIST psn=P`
/// (QP i runs workload i mod the number named, PSN P + i * PSN_STEP) or
/// one `W.qpn= W.psn=` per workload; plus `big.qpn= big.psn=`.
pub fn guest_qps(g: &Info) -> anyhow::Result<Vec<GuestQp>> {
    let mut out = Vec::new();
    if g.has("qps") {
        let n = g.num("qps")? as usize;
        let kinds: Vec<Kind> = g.0.get("run").map(|r| r.split(',').filter_map(Kind::parse).collect()).unwrap_or_default();
        let qpns = parse_ranges(g.0.get("qpn").map(String::as_str).unwrap_or(""))?;
        if n == 0 || n > MAX_QPS || kinds.is_empty() || qpns.len() != n {
            bail!("qps={n} with {} QPNs and {} workloads: 1..{MAX_QPS} QPs, one QPN each", qpns.len(), kinds.len());
        }
        let psn = g.u32("psn")?;
        for (i, qpn) in qpns.into_iter().enumerate() {
            out.push(GuestQp { kind: kinds[i % kinds.len()], qpn, psn: psn.wrapping_add(i as u32 * PSN_STEP) & 0xff_ffff });
        }
    } else {
        for kind in Kind::WORKLOADS {
            let w = kind.name();
            if g.has(&format!("{w}.qpn")) {
                out.push(GuestQp { kind, qpn: g.u32(&format!("{w}.qpn"))?, psn: g.u32(&format!("{w}.psn"))? & 0xff_ffff });
            }
        }
    }
    if g.has("big.qpn") {
        out.push(GuestQp { kind: Kind::Big, qpn: g.u32("big.qpn")?, psn: g.u32("big.psn")? & 0xff_ffff });
    }
    Ok(out)
}

/// Offsets in the peer's one registered region; every QP has its own part.
struct Layout {
    size: usize,
    rec: usize,
    stream: usize,
    hello: usize,
    ring_tx: usize,
    table_rx: usize,
    words: usize,
    n_ring: usize,
    n_atomic: usize,
    len: usize,
}

const TABLE_RX: usize = 2 * SMALL + TABLE_ROW;

impl Layout {
    fn new(size: usize, rec: usize, qps: &[GuestQp]) -> Layout {
        let n = |k| qps.iter().filter(|q| q.kind == k).count();
        let (n_stream, n_ring, n_table, n_atomic) = (n(Kind::Stream), n(Kind::Ring), n(Kind::Table), n(Kind::Atomic));
        let stream = 0;
        let hello = stream + n_stream * 2 * STREAM_DEPTH * size;
        let ring_tx = hello + qps.len() * SMALL;
        let table_rx = ring_tx + n_ring * RING_WINDOW * rec;
        let words = table_rx + n_table * TABLE_RX;
        let len = words + 8 * (n_ring + 2 * n_atomic) + 8;
        Layout { size, rec, stream, hello, ring_tx, table_rx, words, n_ring, n_atomic, len }
    }
    fn stream_rx(&self, k: usize, slot: usize) -> usize {
        self.stream + (k * 2 * STREAM_DEPTH + slot) * self.size
    }
    fn stream_tx(&self, k: usize, slot: usize) -> usize {
        self.stream_rx(k, STREAM_DEPTH + slot)
    }
    fn ring_tx(&self, k: usize, slot: usize) -> usize {
        self.ring_tx + (k * RING_WINDOW + slot) * self.rec
    }
    fn table_rx(&self, k: usize) -> usize {
        self.table_rx + k * TABLE_RX
    }
    /// The credit words of the ring QPs, one each.
    fn credit(&self, k: usize) -> usize {
        self.words + 8 * k
    }
    fn counter(&self, k: usize) -> usize {
        self.words + 8 * (self.n_ring + k)
    }
    fn ops(&self, k: usize) -> usize {
        self.words + 8 * (self.n_ring + self.n_atomic + k)
    }
    /// The big WRITE's acknowledgement (the round, SENT back).
    fn big_ack(&self) -> usize {
        self.words + 8 * (self.n_ring + 2 * self.n_atomic)
    }
}

/// One QP running one workload, with its CQ, timing and progress.
struct Chan {
    kind: Kind,
    /// Its index among the QPs of its kind.
    k: usize,
    /// Its index among all QPs (selects its hello buffer).
    idx: usize,
    qp: Qp,
    cq: Cq,
    started: bool,
    last: Option<Instant>,
    st: State,
}

impl Chan {
    fn completed(&mut self, now: Instant, rep: &mut WorkloadReport) {
        if let Some(t) = self.last {
            rep.max_gap_ms = rep.max_gap_ms.max(now.duration_since(t).as_secs_f64() * 1e3);
        }
        self.last = Some(now);
    }
}

// wr_id tags: the kind of work in the top byte.
const TAG_HELLO: u64 = 1 << 56;
const TAG_DATA: u64 = 2 << 56;
const TAG_SEND: u64 = 3 << 56;
const TAG_MASK: u64 = 0xff << 56;

/// The peer's side of the big WRITE: the buffer the guest writes into.
struct BigTarget {
    buf: MemBuf,
    mr: Mr,
    len: usize,
    rounds: u64,
    /// [`BIG_CHECK_CHUNK`] zero bytes, to clear the buffer with.
    zeros: Vec<u8>,
}

/// A big WRITE's round that arrived, checked and cleared a chunk per pass.
struct BigCheck {
    round: u64,
    /// The next byte to check.
    next: usize,
    /// What was wrong with it, first thing found.
    bad: Option<String>,
}

struct Peer {
    buf: MemBuf,
    mr: Mr,
    lay: Layout,
    big: Option<BigTarget>,
    rep: PeerReport,
    count: u64,
    deadline: Option<Instant>,
    /// Whether completions time the connection's stall now (every QP
    /// started, the run not told to end).
    timing: bool,
    /// The last completion on any QP while timing.
    last_any: Option<Instant>,
}

impl Peer {
    fn violation(&mut self, kind: Kind, k: usize, msg: String) {
        self.rep.workloads.get_mut(kind.name()).unwrap().errors += 1;
        if self.rep.violations.len() < MAX_VIOLATIONS {
            self.rep.violations.push(format!("{} {k}: {msg}", kind.name()));
        }
    }

    fn wl(&mut self, kind: Kind) -> &mut WorkloadReport {
        self.rep.workloads.get_mut(kind.name()).unwrap()
    }

    /// A completion on QP `c`: times its own gap and the connection's.
    fn completed(&mut self, c: &mut Chan) {
        let now = Instant::now();
        c.completed(now, self.rep.workloads.get_mut(c.kind.name()).unwrap());
        if self.timing {
            if let Some(t) = self.last_any {
                let ms = now.duration_since(t).as_secs_f64() * 1e3;
                self.rep.max_gap_ms = self.rep.max_gap_ms.max(ms);
                self.note_gap(now, ms, c.kind.name());
            }
            self.last_any = Some(now);
        }
    }

    /// Keeps the stall of `ms` that ended `now` if it is among the longest.
    fn note_gap(&mut self, now: Instant, ms: f64, ended_by: &'static str) {
        let gaps = &mut self.rep.long_gaps;
        if ms < MIN_LISTED_GAP_MS || gaps.len() == LONG_GAPS && gaps.last().is_some_and(|g| g.ms >= ms) {
            return;
        }
        let since_epoch = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let start_unix_ms = since_epoch.as_secs_f64() * 1e3 - now.elapsed().as_secs_f64() * 1e3 - ms;
        let at = gaps.partition_point(|g| g.ms >= ms);
        gaps.insert(at, Gap { start_unix_ms, ms, ended_by });
        gaps.truncate(LONG_GAPS);
    }

    /// A completion that is not a success: the QP is in error from here on.
    fn bad_completion(&mut self, kind: Kind, k: usize, wc: &Wc) {
        self.rep.error_completions += 1;
        self.violation(kind, k, format!("completion {:#x} failed: {:?} (opcode {:?})", wc.wr_id, wc.status, wc.opcode));
    }

    fn running(&self) -> bool {
        self.deadline.is_none_or(|d| Instant::now() < d) && !STOP.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn hello_sge(&self, i: usize) -> Sge {
        self.mr.sge(self.lay.hello + i * SMALL, SMALL)
    }
}

/// Set by SIGINT or SIGTERM: the run ends as at the end of `--duration`
/// (nothing new is posted, what is in flight drains, the report follows).
static STOP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn stop_on_signal(_: libc::c_int) {
    STOP.store(true, std::sync::atomic::Ordering::Relaxed);
}

pub fn run(a: PeerArgs) -> anyhow::Result<()> {
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, stop_on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, stop_on_signal as *const () as libc::sighandler_t);
    }
    let text = if a.guest.as_os_str() == "-" {
        let mut l = String::new();
        std::io::stdin().lock().read_line(&mut l)?;
        l
    } else {
        std::fs::read_to_string(&a.guest).with_context(|| format!("reading {}", a.guest.display()))?
    };
    let g = Info::parse(&text);
    let publish = |line: &str| {
        println!("{line}");
        let _ = std::io::stdout().flush();
        if let Some(f) = &a.info_out {
            std::fs::write(f, format!("{line}\n")).with_context(|| format!("writing {}", f.display()))?;
        }
        Ok(())
    };
    if g.has("bench") {
        return bench::serve(&a, &g, publish);
    }
    let rep = serve(&a, &g, publish)?;
    println!("{}", serde_json::to_string(&rep)?);
    if !rep.ok {
        bail!(
            "verification failed: {} errors, {} lost, {} duplicated, {} error completions",
            rep.errors,
            rep.lost,
            rep.duplicated,
            rep.error_completions
        );
    }
    Ok(())
}

/// Sets up every workload the guest named, hands this side's IDs to
/// `publish`, runs, and reports.
pub fn serve(a: &PeerArgs, g: &Info, publish: impl FnOnce(&str) -> anyhow::Result<()>) -> anyhow::Result<PeerReport> {
    let gid = g.gid()?;
    let qps = guest_qps(g)?;
    if qps.is_empty() {
        bail!("the guest named no workload (no qps=, stream.qpn, ring.qpn, table.qpn, atomic.qpn or big.qpn)");
    }
    let ctx = Context::open(a.sock.as_deref())?;
    let (size, rec, count) = guest_params(a, g, &qps)?;
    let lay = Layout::new(size, rec, &qps);
    let pd = ctx.alloc_pd()?;
    let buf = MemBuf::new(lay.len)?;
    let mr = pd.reg_mr(&buf, 0, buf.len(), access::ALL)?;
    let big = match qps.iter().any(|q| q.kind == Kind::Big) {
        false => None,
        true => {
            let len = g.num("big.len")?;
            if len == 0 || len > MAX_BIG {
                bail!("big.len={len}: a big WRITE is 1 byte to {MAX_BIG} bytes");
            }
            let b = MemBuf::new(len as usize)?;
            let m = pd.reg_mr(&b, 0, len as usize, access::LOCAL_WRITE | access::REMOTE_WRITE)?;
            Some(BigTarget { buf: b, mr: m, len: len as usize, rounds: g.num("big.rounds").unwrap_or(0), zeros: vec![0; BIG_CHECK_CHUNK] })
        }
    };
    let mtu = Mtu::from_bytes(a.mtu).context("MTU must be 256..4096")?;
    let opts = ConnectOpts { mtu, timeout: a.timeout, min_rnr_timer: 1, ..Default::default() };

    let mut me = Info::default();
    me.set("gid", ctx.gid());
    me.set("rkey", mr.rkey);
    me.set("ring.credit", format!("{:#x}", mr.addr + lay.credit(0) as u64));
    me.set("atomic.counter", format!("{:#x}", mr.addr + lay.counter(0) as u64));
    me.set("atomic.ops", format!("{:#x}", mr.addr + lay.ops(0) as u64));
    if let Some(b) = &big {
        me.set("big.addr", format!("{:#x}", b.mr.addr));
        me.set("big.rkey", b.mr.rkey);
    }
    let mut chans = open_channels(&ctx, &pd, g, &qps, gid, &opts, &mut me)?;
    let mut p = Peer { buf, mr, lay, big, rep: PeerReport::default(), count, deadline: None, timing: false, last_any: None };
    for c in &chans {
        p.rep.workloads.entry(c.kind.name().into()).or_default().qps += 1;
    }
    p.rep.qps = chans.len();
    post_first_receives(&p, &chans)?;
    publish(&me.line())?;

    let t0 = Instant::now();
    p.deadline = a.duration.map(|d| t0 + Duration::from_secs_f64(d));
    run_workloads(a, g, &mut p, &mut chans)?;
    for c in chans.iter_mut().filter(|c| c.kind == Kind::Atomic) {
        c.st.atomic_final(&mut p, c.k);
    }
    Ok(final_report(p.rep, t0))
}

/// The guest's stream message size, ring record size and count, checked
/// before anything is allocated for them.
fn guest_params(a: &PeerArgs, g: &Info, qps: &[GuestQp]) -> anyhow::Result<(usize, usize, u64)> {
    let has = |k| qps.iter().any(|q| q.kind == k);
    let size = if has(Kind::Stream) { g.num("size")? as usize } else { 64 };
    if !(16..=(1 << 20)).contains(&size) || size % 8 != 0 {
        bail!("size={size}: stream messages are 16 bytes to 1 MiB, a multiple of 8");
    }
    let rec = if has(Kind::Ring) { g.num("ring.rec")? as usize } else { 16 };
    if !(16..=(1 << 16)).contains(&rec) || rec % 8 != 0 {
        bail!("ring.rec={rec}: records are 16 bytes to 64 KiB, a multiple of 8");
    }
    if has(Kind::Ring) && g.num("ring.slots")? == 0 {
        bail!("ring.slots must be at least 1");
    }
    if has(Kind::Table) && g.num("table.rows")? == 0 {
        bail!("table.rows must be at least 1");
    }
    let count = g.num("count").unwrap_or(0);
    let endless_big = has(Kind::Big) && g.num("big.rounds").unwrap_or(0) == 0;
    if (count == 0 || endless_big) && a.duration.is_none() {
        bail!("the guest runs without end (count=0 or big.rounds=0): give --duration");
    }
    Ok((size, rec, count))
}

/// One QP (with its CQ) per guest QP, connected to it; their QPNs and PSNs
/// go into `me` in the form the guest used.
fn open_channels(
    ctx: &Context,
    pd: &Pd,
    g: &Info,
    qps: &[GuestQp],
    gid: Ipv4Addr,
    opts: &ConnectOpts,
    me: &mut Info,
) -> anyhow::Result<Vec<Chan>> {
    let mut chans = Vec::new();
    let psn0 = std::process::id().wrapping_mul(2654435761) & 0xff_ffff;
    let mut per_kind = [0usize; 5];
    let mut listed = Vec::new();
    for (i, q) in qps.iter().enumerate() {
        let cq = ctx.create_cq(4 * STREAM_DEPTH as u32 + 64, None)?;
        let mut init = QpInitAttr::new(&cq, &cq);
        init.cap.max_send_wr = (2 * STREAM_DEPTH) as u32;
        init.cap.max_recv_wr = (2 * STREAM_DEPTH) as u32;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        let qp = pd.create_qp(&init)?;
        let psn = psn0.wrapping_add(i as u32 * PSN_STEP) & 0xff_ffff;
        let remote = QpEndpoint { gid, qpn: q.qpn, psn: q.psn };
        let w = q.kind.name();
        qp.connect(&remote, &ConnectOpts { sq_psn: psn, ..*opts }).with_context(|| format!("connecting the {w} QP {i}"))?;
        if q.kind == Kind::Big || !g.has("qps") {
            me.set(&format!("{w}.qpn"), qp.qpn);
            me.set(&format!("{w}.psn"), psn);
        } else {
            if listed.is_empty() {
                me.set("psn", psn);
            }
            listed.push(qp.qpn);
        }
        let k = per_kind[q.kind as usize];
        per_kind[q.kind as usize] += 1;
        chans.push(Chan { kind: q.kind, k, idx: i, qp, cq, started: false, last: None, st: State::default() });
    }
    if !listed.is_empty() {
        me.set("qpn", write_ranges(&listed));
    }
    Ok(chans)
}

/// Receives first: the guest's hello may come the moment it learns our IDs.
fn post_first_receives(p: &Peer, chans: &[Chan]) -> anyhow::Result<()> {
    for c in chans {
        c.qp.post_recv(&[RecvWr { wr_id: TAG_HELLO, sg_list: &[p.hello_sge(c.idx)] }])?;
        match c.kind {
            Kind::Stream => {
                for slot in 0..STREAM_DEPTH {
                    let sge = p.mr.sge(p.lay.stream_rx(c.k, slot), p.lay.size);
                    c.qp.post_recv(&[RecvWr { wr_id: TAG_DATA | slot as u64, sg_list: &[sge] }])?;
                }
            }
            // The WRITE with immediate of every round consumes one.
            Kind::Big => c.qp.post_recv(&[RecvWr { wr_id: TAG_DATA, sg_list: &[] }])?,
            _ => {}
        }
    }
    Ok(())
}

/// Polls and posts until every workload is done, a completion failed, the
/// run's time is up and everything in flight drained, or nothing completed
/// for `--stall` seconds.
fn run_workloads(a: &PeerArgs, g: &Info, p: &mut Peer, chans: &mut [Chan]) -> anyhow::Result<()> {
    let stall = Duration::from_secs_f64(a.stall);
    let mut last_progress = Instant::now();
    let progress_every = a.progress.map(Duration::from_secs_f64);
    let mut last_line = Instant::now();
    let mut wcs = [Wc::default(); 32];
    loop {
        if progress_every.is_some_and(|e| last_line.elapsed() >= e) {
            print_progress(&p.rep);
            last_line = Instant::now();
        }
        let running = p.running();
        p.timing = running && chans.iter().all(|c| c.started);
        let mut progressed = poll_all(g, p, chans, &mut wcs)?;
        progressed |= post_all(a, g, p, chans, running)?;
        if progressed {
            last_progress = Instant::now();
        }
        if chans.iter().all(|c| c.st.done) || p.rep.error_completions > 0 {
            break;
        }
        if !running && chans.iter().all(|c| c.st.drained()) {
            break;
        }
        if last_progress.elapsed() > stall {
            let mut waiting: Vec<_> = chans.iter().filter(|c| !c.st.done).map(|c| c.kind.name()).collect();
            waiting.dedup();
            let msg = format!("nothing completed for {:.0} s; still waiting for {waiting:?}", a.stall);
            if p.rep.violations.len() < MAX_VIOLATIONS {
                p.rep.violations.push(msg);
            }
            p.rep.errors += 1;
            break;
        }
        if !progressed {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
    Ok(())
}

/// What each workload verified so far, as one line of JSON on stdout.
fn print_progress(rep: &PeerReport) {
    let verified: BTreeMap<&str, u64> = rep.workloads.iter().map(|(w, r)| (w.as_str(), r.verified)).collect();
    println!("{}", serde_json::json!({ "progress": verified }));
}

/// Handles every completion on every QP's CQ; whether there was any.
fn poll_all(g: &Info, p: &mut Peer, chans: &mut [Chan], wcs: &mut [Wc]) -> anyhow::Result<bool> {
    let mut progressed = false;
    for c in chans.iter_mut() {
        let n = c.cq.poll(wcs)?;
        for wc in &wcs[..n] {
            progressed = true;
            p.completed(c);
            if wc.status != WcStatus::Success {
                p.bad_completion(c.kind, c.k, wc);
                continue;
            }
            if wc.wr_id & TAG_MASK == TAG_HELLO {
                let got = p.buf.read(p.lay.hello + c.idx * SMALL, 8);
                if wc.byte_len != 16 || u64::from_le_bytes(got.try_into().unwrap()) != HELLO {
                    p.violation(c.kind, c.k, format!("the first message was not a hello ({} bytes)", wc.byte_len));
                }
                c.started = true;
                continue;
            }
            match c.kind {
                Kind::Stream => State::stream_completion(p, c, wc)?,
                Kind::Ring => c.st.ring_completion(p, c.k, wc),
                Kind::Table => c.st.table_completion(p, g, c.k, wc),
                Kind::Big => State::big_completion(p, c, wc)?,
                Kind::Atomic => p.violation(c.kind, c.k, format!("unexpected completion {wc:?}")),
            }
        }
    }
    Ok(progressed)
}

/// Posts the next work of every started QP not yet done; whether any moved.
fn post_all(a: &PeerArgs, g: &Info, p: &mut Peer, chans: &mut [Chan], running: bool) -> anyhow::Result<bool> {
    let mut progressed = false;
    for c in chans.iter_mut() {
        if !c.started || c.st.done {
            continue;
        }
        progressed |= match c.kind {
            Kind::Stream => c.st.stream_post(p, &c.qp, c.k, running)?,
            Kind::Ring => c.st.ring_post(p, g, &c.qp, c.k, running)?,
            Kind::Table => c.st.table_post(p, g, &c.qp, c.k, running, a.table_reads)?,
            Kind::Big => {
                let moved = State::big_check_step(p, c)?;
                let b = p.big.as_ref().unwrap();
                // Done once the last round's acknowledgement has arrived
                // (its SEND completed), not when it was posted: this
                // process ending destroys its QPs, and a SEND still in
                // flight or in an RNR wait would never reach the guest,
                // which waits for it without end.
                c.st.done = b.rounds > 0 && c.st.big_acked >= b.rounds;
                moved
            }
            Kind::Atomic => {
                // The peer completes nothing here: the counter moving is the event.
                let moved = c.st.atomic_check(p, c.k);
                if moved {
                    p.completed(c);
                }
                moved
            }
        };
    }
    Ok(progressed)
}

/// Totals over the workloads, and the verdict.
fn final_report(mut rep: PeerReport, t0: Instant) -> PeerReport {
    rep.seconds = t0.elapsed().as_secs_f64();
    for r in rep.workloads.values_mut() {
        rep.messages_verified += r.verified;
        rep.bytes_verified += r.bytes_verified;
        rep.errors += r.errors;
        rep.lost += r.lost;
        rep.duplicated += r.duplicated;
        rep.max_qp_gap_ms = rep.max_qp_gap_ms.max(r.max_gap_ms);
        r.done = r.qps_done == r.qps;
    }
    rep.ok = rep.errors == 0 && rep.lost == 0 && rep.duplicated == 0 && rep.error_completions == 0 && rep.messages_verified > 0;
    rep
}

/// One QP's progress.
#[derive(Default)]
struct State {
    done: bool,
    // stream
    rx_expect: u64,
    tx_next: u64,
    tx_done: u64,
    // ring
    ring_next: u64,
    ring_done: u64,
    ring_credit: u64,
    // table
    table_next_row: u64,
    table_inflight: bool,
    table_seen: BTreeMap<u64, u64>,
    table_reads: u64,
    // atomic
    atomic_last: u64,
    atomic_verified: u64,
    // big
    big_rounds: u64,
    /// Rounds whose acknowledgement SEND completed.
    big_acked: u64,
    big_check: Option<BigCheck>,
}

impl State {
    fn drained(&self) -> bool {
        self.tx_done == self.tx_next
            && self.ring_done == self.ring_next
            && !self.table_inflight
            && self.big_check.is_none()
            && self.big_acked == self.big_rounds
    }

    fn stream_completion(p: &mut Peer, c: &mut Chan, wc: &Wc) -> anyhow::Result<()> {
        let (st, k) = (&mut c.st, c.k);
        if wc.wr_id & TAG_MASK == TAG_SEND {
            st.tx_done += 1;
            p.wl(Kind::Stream).issued += 1;
            return Ok(());
        }
        let slot = (wc.wr_id & !TAG_MASK) as usize;
        let off = p.lay.stream_rx(k, slot);
        let size = p.lay.size;
        let data = p.buf.read(off, size);
        let seq = u64::from_le_bytes(data[..8].try_into().unwrap());
        let expect = st.rx_expect;
        let imm = wc.wc_flags & wc_flags::WITH_IMM != 0;
        if wc.byte_len as usize != size {
            p.violation(Kind::Stream, k, format!("message {seq} has {} bytes, not {size}", wc.byte_len));
        } else if seq < expect {
            p.wl(Kind::Stream).duplicated += 1;
            p.violation(Kind::Stream, k, format!("message {seq} again (expected {expect})"));
        } else {
            if seq > expect {
                p.wl(Kind::Stream).lost += seq - expect;
                p.violation(Kind::Stream, k, format!("messages {expect}..{seq} never came"));
            }
            if imm != (seq % 2 == 1) || (imm && wc.imm_data != seq as u32) {
                p.violation(
                    Kind::Stream,
                    k,
                    format!("message {seq}: immediate {imm} {:#x} (odd messages carry their number)", wc.imm_data),
                );
            }
            match check(&data, seq, seq | STREAM_TO_PEER) {
                Some(j) => p.violation(Kind::Stream, k, format!("message {seq}: word {j} differs")),
                None => {
                    let r = p.wl(Kind::Stream);
                    r.verified += 1;
                    r.bytes_verified += size as u64;
                }
            }
            st.rx_expect = seq + 1;
        }
        let sge = p.mr.sge(off, size);
        c.qp.post_recv(&[RecvWr { wr_id: wc.wr_id, sg_list: &[sge] }])?;
        Ok(())
    }

    fn stream_post(&mut self, p: &mut Peer, qp: &Qp, k: usize, running: bool) -> anyhow::Result<bool> {
        let mut posted = false;
        let size = p.lay.size;
        while running && (p.count == 0 || self.tx_next < p.count) && self.tx_next - self.tx_done < STREAM_DEPTH as u64 {
            let seq = self.tx_next;
            let off = p.lay.stream_tx(k, (seq % STREAM_DEPTH as u64) as usize);
            p.buf.write(off, &fill(seq, seq | STREAM_TO_GUEST, size));
            let sge = [p.mr.sge(off, size)];
            let mut wr = SendWr::send(TAG_SEND | seq, &sge);
            if seq % 2 == 1 {
                wr = wr.with_imm(seq as u32);
            }
            qp.post_send(&[wr])?;
            self.tx_next += 1;
            posted = true;
        }
        let done = p.count > 0 && self.tx_done == p.count && self.rx_expect == p.count;
        self.set_done(p, Kind::Stream, done);
        Ok(posted)
    }

    /// Marks this QP done once, counting it in its workload's report.
    fn set_done(&mut self, p: &mut Peer, kind: Kind, done: bool) {
        if done && !self.done {
            self.done = true;
            p.wl(kind).qps_done += 1;
        }
    }

    fn ring_completion(&mut self, p: &mut Peer, k: usize, wc: &Wc) {
        if wc.opcode != WcOpcode::RdmaWrite {
            p.violation(Kind::Ring, k, format!("unexpected completion {wc:?}"));
            return;
        }
        self.ring_done += 1;
        p.wl(Kind::Ring).issued += 1;
    }

    fn ring_post(&mut self, p: &mut Peer, g: &Info, qp: &Qp, k: usize, running: bool) -> anyhow::Result<bool> {
        let slots = g.num("ring.slots")?;
        let rec = p.lay.rec;
        let (addr, rkey) = (g.num("ring.addr")? + k as u64 * slots * rec as u64, g.u32("ring.rkey")?);
        let credit = p.buf.read_u64(p.lay.credit(k));
        if credit > self.ring_next {
            let msg = format!("the guest says it checked {credit} records of {} written", self.ring_next);
            p.violation(Kind::Ring, k, msg);
            return Ok(false);
        }
        // Records the guest checked are what the ring verified end to end.
        if credit > self.ring_credit {
            let r = p.wl(Kind::Ring);
            r.bytes_verified += (credit - self.ring_credit) * rec as u64;
            r.verified += credit - self.ring_credit;
            self.ring_credit = credit;
        }
        self.set_done(p, Kind::Ring, p.count > 0 && credit == p.count);
        let mut posted = false;
        while running
            && (p.count == 0 || self.ring_next < p.count)
            && self.ring_next - credit < slots
            && self.ring_next - self.ring_done < RING_WINDOW as u64
        {
            let n = self.ring_next;
            let off = p.lay.ring_tx(k, (n % RING_WINDOW as u64) as usize);
            p.buf.write(off, &fill(n, n | RING, rec));
            let sge = [p.mr.sge(off, rec)];
            let wr = SendWr::write(TAG_DATA | n, &sge, addr + (n % slots) * rec as u64, rkey).with_imm(n as u32);
            qp.post_send(&[wr])?;
            self.ring_next += 1;
            posted = true;
        }
        Ok(posted)
    }

    fn table_post(&mut self, p: &mut Peer, g: &Info, qp: &Qp, k: usize, running: bool, reads: u64) -> anyhow::Result<bool> {
        let done = reads > 0 && self.table_reads >= reads || p.count > 0 && reads == 0 && self.table_reads >= p.count;
        self.set_done(p, Kind::Table, done);
        if self.table_inflight || !running || self.done {
            return Ok(false);
        }
        let rows = g.num("table.rows")?;
        let addr = g.num("table.addr")? + k as u64 * rows * TABLE_ROW as u64;
        let rkey = g.u32("table.rkey")?;
        let row = self.table_next_row % rows;
        let ra = addr + row * TABLE_ROW as u64;
        let t = p.lay.table_rx(k);
        let (s1, s2, s3) = ([p.mr.sge(t, 8)], [p.mr.sge(t + SMALL, TABLE_ROW)], [p.mr.sge(t + 8, 8)]);
        // Three READs in order on one QP: version, row, version (a seqlock reader).
        qp.post_send(&[
            SendWr::read(TAG_DATA, &s1, ra, rkey).unsignaled(),
            SendWr::read(TAG_DATA | 1, &s2, ra, rkey).unsignaled(),
            SendWr::read(TAG_DATA | 2, &s3, ra, rkey),
        ])?;
        self.table_inflight = true;
        Ok(true)
    }

    fn table_completion(&mut self, p: &mut Peer, g: &Info, k: usize, wc: &Wc) {
        self.table_inflight = false;
        if wc.opcode != WcOpcode::RdmaRead {
            p.violation(Kind::Table, k, format!("unexpected completion {wc:?}"));
            return;
        }
        self.table_reads += 1;
        let rows = g.num("table.rows").unwrap_or(1).max(1);
        let row = self.table_next_row % rows;
        self.table_next_row += 1;
        let t = p.lay.table_rx(k);
        let (v1, v3) = (p.buf.read_u64(t), p.buf.read_u64(t + 8));
        let data = p.buf.read(t + SMALL, TABLE_ROW);
        p.wl(Kind::Table).issued += 1;
        let seen = self.table_seen.entry(row).or_insert(0);
        if v1 < *seen || v3 < v1 {
            let msg = format!("row {row}: version went backwards ({} seen, then {v1}, {v3})", *seen);
            p.violation(Kind::Table, k, msg);
            return;
        }
        *seen = v3;
        if v1 != v3 || v1 % 2 == 1 {
            *p.wl(Kind::Table).detail.entry("busy".into()).or_insert(0) += 1;
            return;
        }
        match check(&data, v1, row << 32 | v1 | TABLE) {
            None => {
                let r = p.wl(Kind::Table);
                r.verified += 1;
                r.bytes_verified += TABLE_ROW as u64;
            }
            Some(j) => {
                *p.wl(Kind::Table).detail.entry("torn".into()).or_insert(0) += 1;
                p.violation(Kind::Table, k, format!("row {row} version {v1}: torn read (word {j} differs)"));
            }
        }
    }

    /// Sandwich check: ops(t1) <= counter(t2) <= ops(t3) + 1.
    fn atomic_check(&mut self, p: &mut Peer, k: usize) -> bool {
        let ops1 = p.buf.read_u64(p.lay.ops(k));
        let counter = p.buf.read_u64(p.lay.counter(k));
        let ops3 = p.buf.read_u64(p.lay.ops(k));
        let moved = counter != self.atomic_last;
        if counter < ops1 || counter > ops3 + 1 || counter < self.atomic_last {
            let msg = format!("counter {counter} with {ops1}..{ops3} operations done (last {})", self.atomic_last);
            self.atomic_last = counter;
            p.violation(Kind::Atomic, k, msg);
            return moved;
        }
        if counter > self.atomic_verified {
            let r = p.wl(Kind::Atomic);
            r.bytes_verified += 8 * (counter - self.atomic_verified);
            r.verified += counter - self.atomic_verified;
            self.atomic_verified = counter;
        }
        self.atomic_last = counter;
        self.set_done(p, Kind::Atomic, p.count > 0 && ops3 == p.count && counter == p.count);
        moved
    }

    fn atomic_final(&mut self, p: &mut Peer, k: usize) {
        self.atomic_check(p, k);
        let (counter, ops) = (p.buf.read_u64(p.lay.counter(k)), p.buf.read_u64(p.lay.ops(k)));
        let r = p.wl(Kind::Atomic);
        *r.detail.entry("counter".into()).or_insert(0) += counter;
        *r.detail.entry("ops".into()).or_insert(0) += ops;
        if p.count > 0 && p.deadline.is_none() && (counter != p.count || ops != p.count) {
            p.violation(Kind::Atomic, k, format!("ended with counter {counter} and {ops} operations, not {}", p.count));
        }
    }

    /// The guest's WRITE with immediate of round r arrived whole: its
    /// completion is checked here, its words by [`State::big_check_step`].
    /// Our acknowledgement's completion counts the round as delivered.
    fn big_completion(p: &mut Peer, c: &mut Chan, wc: &Wc) -> anyhow::Result<()> {
        if wc.wr_id & TAG_MASK == TAG_SEND {
            c.st.big_acked += 1;
            return Ok(());
        }
        let r = c.st.big_rounds;
        if c.st.big_check.is_some() {
            p.violation(Kind::Big, c.k, format!("round {r}: another WRITE arrived before the round was acknowledged"));
            return Ok(());
        }
        let imm = wc.wc_flags & wc_flags::WITH_IMM != 0;
        let bad = if wc.opcode != WcOpcode::RecvRdmaWithImm || !imm {
            Some(format!("round {r}: completion {:?} without an immediate", wc.opcode))
        } else if wc.imm_data != r as u32 {
            Some(format!("round {r}: immediate {}", wc.imm_data))
        } else {
            None
        };
        c.st.big_check = Some(BigCheck { round: r, next: 0, bad });
        Ok(())
    }

    /// Checks the next chunk of the round that arrived (word 0 = r, the
    /// rest `pattern(BIG, j)`) and clears it, so that a part missing from
    /// the next round shows as zeros; after the last chunk, counts the
    /// round and SENDs r back. Whether there was a chunk to check.
    fn big_check_step(p: &mut Peer, c: &mut Chan) -> anyhow::Result<bool> {
        let Some(mut chk) = c.st.big_check.take() else {
            return Ok(false);
        };
        let b = p.big.as_ref().unwrap();
        let (start, end) = (chk.next, (chk.next + BIG_CHECK_CHUNK).min(b.len));
        if chk.bad.is_none() {
            let data = b.buf.read(start, end - start);
            if let Some(j) = check_part(&data, start / 8, chk.round, BIG) {
                chk.bad = Some(format!("round {}: word {j} of {} differs", chk.round, b.len / 8));
            }
        }
        b.buf.write(start, &b.zeros[..end - start]);
        chk.next = end;
        if end < b.len {
            c.st.big_check = Some(chk);
            return Ok(true);
        }
        let (r, len) = (chk.round, b.len as u64);
        match chk.bad {
            Some(msg) => p.violation(Kind::Big, c.k, msg),
            None => {
                let w = p.wl(Kind::Big);
                w.verified += 1;
                w.bytes_verified += len;
            }
        }
        p.wl(Kind::Big).issued += 1;
        c.st.big_rounds += 1;
        c.qp.post_recv(&[RecvWr { wr_id: TAG_DATA, sg_list: &[] }])?;
        p.buf.write_u64(p.lay.big_ack(), r);
        let sge = [p.mr.sge(p.lay.big_ack(), 8)];
        c.qp.post_send(&[SendWr::send(TAG_SEND | r, &sge)])?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A big WRITE's round checked a chunk at a time finds what a check of
    /// the whole finds, at the same word.
    #[test]
    fn a_message_checked_in_parts_finds_the_word_that_differs() {
        let mut msg = fill(7, BIG, 4096);
        let parts = |m: &[u8]| m.chunks(1024).enumerate().find_map(|(i, c)| check_part(c, i * 128, 7, BIG));
        assert_eq!(parts(&msg), None);
        assert_eq!(check(&msg, 7, BIG), None);
        msg[300 * 8] ^= 1;
        assert_eq!(parts(&msg), Some(300));
        assert_eq!(check(&msg, 7, BIG), Some(300));
        msg[0] ^= 1;
        assert_eq!(parts(&msg), Some(0), "word 0 is the round");
    }
}
