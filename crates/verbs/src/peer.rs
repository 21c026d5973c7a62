//! `transit rdma peer`: the bare-metal side of the guest's RDMA workloads.
//!
//! The guest (crates/guest/src/pvrdma/workloads.rs) and this peer check each
//! other; the protocol below is the contract between them. The guest has no
//! TCP/IP stack, so each side states its IDs once, as one line of
//! `key=value` words carried by the VM's mailbox:
//!
//! - the guest: `gid=`, and per workload `W.qpn=` `W.psn=` plus
//!   `ring.addr= ring.rkey= ring.slots= ring.rec=`,
//!   `table.addr= table.rkey= table.rows=`, and `size=` `count=`;
//! - the peer (this program's first line of output): `gid= rkey=`, per
//!   workload `W.qpn= W.psn=`, and `ring.credit= atomic.counter= atomic.ops=`
//!   (addresses in the peer's region `rkey`).
//!
//! A workload runs when the guest names its QPN. Neither side is told
//! anything later: after a move the guest keeps its GID, QPNs and keys.
//! Each guest QP first SENDs a 16-byte hello (word 0 = [`HELLO`]) once it
//! is in RTS with its receives posted; the peer starts that workload then.
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
//!
//! The report (last line of output, JSON) counts, per workload and in all,
//! what was verified, errors, lost and duplicated messages, error
//! completions and the longest time between two completions of a workload.

use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use serde::Serialize;

use crate::*;

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
    data.chunks_exact(8).enumerate().position(|(j, w)| {
        let w = u64::from_le_bytes(w.try_into().unwrap());
        w != if j == 0 { first } else { pattern(seed, j as u64) }
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
    /// Stop after this many seconds (default: when every workload did its count).
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
    /// Longest time between two completions of this workload (for atomic:
    /// two moves of the counter), ms.
    pub max_gap_ms: f64,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub detail: BTreeMap<String, u64>,
    pub done: bool,
}

#[derive(Serialize, Debug, Default)]
pub struct PeerReport {
    pub ok: bool,
    pub seconds: f64,
    pub messages_verified: u64,
    pub bytes_verified: u64,
    pub errors: u64,
    pub lost: u64,
    pub duplicated: u64,
    pub error_completions: u64,
    pub max_gap_ms: f64,
    pub workloads: BTreeMap<String, WorkloadReport>,
    /// The first violations, in words.
    pub violations: Vec<String>,
}

const MAX_VIOLATIONS: usize = 32;
const STREAM_DEPTH: usize = 64;
const RING_WINDOW: usize = 32;
const SMALL: usize = 64;

/// Offsets in the peer's one registered region.
struct Layout {
    stream_rx: usize,
    stream_tx: usize,
    hello: usize,
    ring_tx: usize,
    table_rx: usize,
    words: usize,
    len: usize,
}

impl Layout {
    fn new(size: usize, rec: usize) -> Layout {
        let stream_rx = 0;
        let stream_tx = stream_rx + STREAM_DEPTH * size;
        let hello = stream_tx + STREAM_DEPTH * size;
        let ring_tx = hello + 4 * SMALL;
        let table_rx = ring_tx + RING_WINDOW * rec;
        let words = table_rx + 2 * SMALL + TABLE_ROW;
        Layout { stream_rx, stream_tx, hello, ring_tx, table_rx, words, len: words + 3 * 8 }
    }
    fn credit(&self) -> usize {
        self.words
    }
    fn counter(&self) -> usize {
        self.words + 8
    }
    fn ops(&self) -> usize {
        self.words + 16
    }
}

/// One workload's QP with its CQ and timing.
struct Chan {
    qp: Qp,
    cq: Cq,
    started: bool,
    last: Option<Instant>,
}

impl Chan {
    fn completed(&mut self, rep: &mut WorkloadReport) {
        let now = Instant::now();
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

struct Peer {
    buf: MemBuf,
    mr: Mr,
    lay: Layout,
    rep: PeerReport,
    size: usize,
    count: u64,
    deadline: Option<Instant>,
}

impl Peer {
    fn violation(&mut self, w: &str, msg: String) {
        self.rep.workloads.get_mut(w).unwrap().errors += 1;
        if self.rep.violations.len() < MAX_VIOLATIONS {
            self.rep.violations.push(format!("{w}: {msg}"));
        }
    }

    /// A completion that is not a success: the QP is in error from here on.
    fn bad_completion(&mut self, w: &str, wc: &Wc) {
        self.rep.error_completions += 1;
        self.violation(w, format!("completion {:#x} failed: {:?} (opcode {:?})", wc.wr_id, wc.status, wc.opcode));
    }

    fn running(&self) -> bool {
        self.deadline.is_none_or(|d| Instant::now() < d)
    }

    fn hello_sge(&self, i: usize) -> Sge {
        self.mr.sge(self.lay.hello + i * SMALL, SMALL)
    }
}

pub fn run(a: PeerArgs) -> anyhow::Result<()> {
    let text = if a.guest.as_os_str() == "-" {
        let mut l = String::new();
        std::io::stdin().lock().read_line(&mut l)?;
        l
    } else {
        std::fs::read_to_string(&a.guest).with_context(|| format!("reading {}", a.guest.display()))?
    };
    let g = Info::parse(&text);
    let rep = serve(&a, &g, |line| {
        println!("{line}");
        let _ = std::io::stdout().flush();
        if let Some(f) = &a.info_out {
            std::fs::write(f, format!("{line}\n")).with_context(|| format!("writing {}", f.display()))?;
        }
        Ok(())
    })?;
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
    let ctx = Context::open(a.sock.as_deref())?;
    let (size, rec, count) = guest_params(a, g)?;
    let lay = Layout::new(size, rec);
    let pd = ctx.alloc_pd()?;
    let buf = MemBuf::new(lay.len)?;
    let mr = pd.reg_mr(&buf, 0, buf.len(), access::ALL)?;
    let mtu = Mtu::from_bytes(a.mtu).context("MTU must be 256..4096")?;
    let opts = ConnectOpts { mtu, timeout: a.timeout, min_rnr_timer: 1, ..Default::default() };

    let mut me = Info::default();
    me.set("gid", ctx.gid());
    me.set("rkey", mr.rkey);
    me.set("ring.credit", format!("{:#x}", mr.addr + lay.credit() as u64));
    me.set("atomic.counter", format!("{:#x}", mr.addr + lay.counter() as u64));
    me.set("atomic.ops", format!("{:#x}", mr.addr + lay.ops() as u64));
    let mut chans = open_channels(&ctx, &pd, g, gid, &opts, &mut me)?;
    if chans.is_empty() {
        bail!("the guest named no workload (no stream.qpn, ring.qpn, table.qpn or atomic.qpn)");
    }
    let mut p = Peer { buf, mr, lay, rep: PeerReport::default(), size, count, deadline: None };
    for &w in chans.keys() {
        p.rep.workloads.insert(w.into(), WorkloadReport::default());
    }
    post_first_receives(&p, &chans)?;
    publish(&me.line())?;

    let t0 = Instant::now();
    p.deadline = a.duration.map(|d| t0 + Duration::from_secs_f64(d));
    let mut st = run_workloads(a, g, &mut p, &mut chans)?;
    st.atomic_final(&mut p, chans.contains_key("atomic"));
    Ok(final_report(p.rep, t0))
}

/// The guest's stream message size, ring record size and count, checked
/// before anything is allocated for them.
fn guest_params(a: &PeerArgs, g: &Info) -> anyhow::Result<(usize, usize, u64)> {
    let size = if g.has("stream.qpn") { g.num("size")? as usize } else { 64 };
    if !(16..=(1 << 20)).contains(&size) || size % 8 != 0 {
        bail!("size={size}: stream messages are 16 bytes to 1 MiB, a multiple of 8");
    }
    let rec = if g.has("ring.qpn") { g.num("ring.rec")? as usize } else { 16 };
    if !(16..=(1 << 16)).contains(&rec) || rec % 8 != 0 {
        bail!("ring.rec={rec}: records are 16 bytes to 64 KiB, a multiple of 8");
    }
    if g.has("ring.qpn") && g.num("ring.slots")? == 0 {
        bail!("ring.slots must be at least 1");
    }
    if g.has("table.qpn") && g.num("table.rows")? == 0 {
        bail!("table.rows must be at least 1");
    }
    let count = g.num("count").unwrap_or(0);
    if count == 0 && a.duration.is_none() {
        bail!("the guest runs without end (count=0): give --duration");
    }
    Ok((size, rec, count))
}

/// One QP (with its CQ) per workload the guest named, connected to the
/// guest's; their QPNs and PSNs go into `me`.
fn open_channels(
    ctx: &Context,
    pd: &Pd,
    g: &Info,
    gid: Ipv4Addr,
    opts: &ConnectOpts,
    me: &mut Info,
) -> anyhow::Result<BTreeMap<&'static str, Chan>> {
    let mut chans: BTreeMap<&'static str, Chan> = BTreeMap::new();
    for (i, w) in ["atomic", "ring", "stream", "table"].into_iter().enumerate() {
        if !g.has(&format!("{w}.qpn")) {
            continue;
        }
        let cq = ctx.create_cq(4 * STREAM_DEPTH as u32 + 64, None)?;
        let mut init = QpInitAttr::new(&cq, &cq);
        init.cap.max_send_wr = (2 * STREAM_DEPTH) as u32;
        init.cap.max_recv_wr = (2 * STREAM_DEPTH) as u32;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        let qp = pd.create_qp(&init)?;
        let psn = (std::process::id().wrapping_mul(2654435761).wrapping_add(i as u32 * 0x1234)) & 0xff_ffff;
        let remote = QpEndpoint { gid, qpn: g.u32(&format!("{w}.qpn"))?, psn: g.u32(&format!("{w}.psn"))? & 0xff_ffff };
        qp.connect(&remote, &ConnectOpts { sq_psn: psn, ..*opts }).with_context(|| format!("connecting the {w} QP"))?;
        me.set(&format!("{w}.qpn"), qp.qpn);
        me.set(&format!("{w}.psn"), psn);
        chans.insert(w, Chan { qp, cq, started: false, last: None });
    }
    Ok(chans)
}

/// Receives first: the guest's hello may come the moment it learns our IDs.
fn post_first_receives(p: &Peer, chans: &BTreeMap<&'static str, Chan>) -> anyhow::Result<()> {
    for (i, (w, c)) in chans.iter().enumerate() {
        c.qp.post_recv(&[RecvWr { wr_id: TAG_HELLO | i as u64, sg_list: &[p.hello_sge(i)] }])?;
        if *w == "stream" {
            for k in 0..STREAM_DEPTH {
                let sge = p.mr.sge(p.lay.stream_rx + k * p.size, p.size);
                c.qp.post_recv(&[RecvWr { wr_id: TAG_DATA | k as u64, sg_list: &[sge] }])?;
            }
        }
    }
    Ok(())
}

/// Polls and posts until every workload is done, a completion failed, the
/// run's time is up and everything in flight drained, or nothing completed
/// for `--stall` seconds.
fn run_workloads(a: &PeerArgs, g: &Info, p: &mut Peer, chans: &mut BTreeMap<&'static str, Chan>) -> anyhow::Result<State> {
    let stall = Duration::from_secs_f64(a.stall);
    let mut st = State::default();
    let hello_idx: BTreeMap<&str, usize> = chans.keys().enumerate().map(|(i, w)| (*w, i)).collect();
    let mut last_progress = Instant::now();
    let mut wcs = [Wc::default(); 32];
    loop {
        let mut progressed = poll_all(g, p, &mut st, chans, &hello_idx, &mut wcs)?;
        let running = p.running();
        progressed |= post_all(a, g, p, &mut st, chans, running)?;
        if progressed {
            last_progress = Instant::now();
        }
        let all_done = p.rep.workloads.values().all(|r| r.done);
        if all_done || p.rep.error_completions > 0 {
            break;
        }
        if !running && st.drained(chans) {
            break;
        }
        if last_progress.elapsed() > stall {
            let waiting: Vec<_> = p.rep.workloads.iter().filter(|(_, r)| !r.done).map(|(w, _)| w.clone()).collect();
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
    Ok(st)
}

/// Handles every completion on every workload's CQ; whether there was any.
fn poll_all(
    g: &Info,
    p: &mut Peer,
    st: &mut State,
    chans: &mut BTreeMap<&'static str, Chan>,
    hello_idx: &BTreeMap<&str, usize>,
    wcs: &mut [Wc],
) -> anyhow::Result<bool> {
    let mut progressed = false;
    for (w, c) in chans.iter_mut() {
        let n = c.cq.poll(wcs)?;
        for wc in &wcs[..n] {
            progressed = true;
            c.completed(p.rep.workloads.get_mut(*w).unwrap());
            if wc.status != WcStatus::Success {
                p.bad_completion(w, wc);
                continue;
            }
            if wc.wr_id & TAG_MASK == TAG_HELLO {
                let got = p.buf.read(p.lay.hello + hello_idx[w] * SMALL, 8);
                if wc.byte_len != 16 || u64::from_le_bytes(got.try_into().unwrap()) != HELLO {
                    p.violation(w, format!("the first message was not a hello ({} bytes)", wc.byte_len));
                }
                c.started = true;
                continue;
            }
            match *w {
                "stream" => st.stream_completion(p, c, wc)?,
                "ring" => st.ring_completion(p, wc),
                "table" => st.table_completion(p, g, wc),
                _ => p.violation(w, format!("unexpected completion {wc:?}")),
            }
        }
    }
    Ok(progressed)
}

/// Posts the next work of every started workload not yet done; whether
/// any moved.
fn post_all(
    a: &PeerArgs,
    g: &Info,
    p: &mut Peer,
    st: &mut State,
    chans: &mut BTreeMap<&'static str, Chan>,
    running: bool,
) -> anyhow::Result<bool> {
    let mut progressed = false;
    for (w, c) in chans.iter_mut() {
        if !c.started || p.rep.workloads[*w].done {
            continue;
        }
        progressed |= match *w {
            "stream" => st.stream_post(p, c, running)?,
            "ring" => st.ring_post(p, g, c, running)?,
            "table" => st.table_post(p, g, c, running, a.table_reads)?,
            _ => {
                // The peer completes nothing here: the counter moving is the event.
                let moved = st.atomic_check(p, running);
                if moved {
                    c.completed(p.rep.workloads.get_mut("atomic").unwrap());
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
    for r in rep.workloads.values() {
        rep.messages_verified += r.verified;
        rep.bytes_verified += r.bytes_verified;
        rep.errors += r.errors;
        rep.lost += r.lost;
        rep.duplicated += r.duplicated;
        rep.max_gap_ms = rep.max_gap_ms.max(r.max_gap_ms);
    }
    rep.ok = rep.errors == 0 && rep.lost == 0 && rep.duplicated == 0 && rep.error_completions == 0 && rep.messages_verified > 0;
    rep
}

/// Per-workload progress of the run.
#[derive(Default)]
struct State {
    // stream
    rx_expect: u64,
    tx_next: u64,
    tx_done: u64,
    // ring
    ring_next: u64,
    ring_done: u64,
    // table
    table_next_row: u64,
    table_inflight: bool,
    table_seen: BTreeMap<u64, u64>,
    table_reads: u64,
    // atomic
    atomic_last: u64,
}

impl State {
    fn drained(&self, chans: &BTreeMap<&'static str, Chan>) -> bool {
        (!chans.contains_key("stream") || self.tx_done == self.tx_next)
            && (!chans.contains_key("ring") || self.ring_done == self.ring_next)
            && !self.table_inflight
    }

    fn stream_completion(&mut self, p: &mut Peer, c: &Chan, wc: &Wc) -> anyhow::Result<()> {
        if wc.wr_id & TAG_MASK == TAG_SEND {
            self.tx_done += 1;
            p.rep.workloads.get_mut("stream").unwrap().issued += 1;
            return Ok(());
        }
        let k = (wc.wr_id & !TAG_MASK) as usize;
        let off = p.lay.stream_rx + k * p.size;
        let data = p.buf.read(off, p.size);
        let seq = u64::from_le_bytes(data[..8].try_into().unwrap());
        let expect = self.rx_expect;
        let imm = wc.wc_flags & wc_flags::WITH_IMM != 0;
        if wc.byte_len as usize != p.size {
            p.violation("stream", format!("message {seq} has {} bytes, not {}", wc.byte_len, p.size));
        } else if seq < expect {
            p.rep.workloads.get_mut("stream").unwrap().duplicated += 1;
            p.violation("stream", format!("message {seq} again (expected {expect})"));
        } else {
            if seq > expect {
                p.rep.workloads.get_mut("stream").unwrap().lost += seq - expect;
                p.violation("stream", format!("messages {expect}..{seq} never came"));
            }
            if imm != (seq % 2 == 1) || (imm && wc.imm_data != seq as u32) {
                p.violation("stream", format!("message {seq}: immediate {imm} {:#x} (odd messages carry their number)", wc.imm_data));
            }
            match check(&data, seq, seq | STREAM_TO_PEER) {
                Some(j) => p.violation("stream", format!("message {seq}: word {j} differs")),
                None => {
                    let r = p.rep.workloads.get_mut("stream").unwrap();
                    r.verified += 1;
                    r.bytes_verified += p.size as u64;
                }
            }
            self.rx_expect = seq + 1;
        }
        let sge = p.mr.sge(off, p.size);
        c.qp.post_recv(&[RecvWr { wr_id: wc.wr_id, sg_list: &[sge] }])?;
        Ok(())
    }

    fn stream_post(&mut self, p: &mut Peer, c: &Chan, running: bool) -> anyhow::Result<bool> {
        let mut posted = false;
        while running && (p.count == 0 || self.tx_next < p.count) && self.tx_next - self.tx_done < STREAM_DEPTH as u64 {
            let seq = self.tx_next;
            let slot = (seq % STREAM_DEPTH as u64) as usize;
            let off = p.lay.stream_tx + slot * p.size;
            p.buf.write(off, &fill(seq, seq | STREAM_TO_GUEST, p.size));
            let sge = [p.mr.sge(off, p.size)];
            let mut wr = SendWr::send(TAG_SEND | seq, &sge);
            if seq % 2 == 1 {
                wr = wr.with_imm(seq as u32);
            }
            c.qp.post_send(&[wr])?;
            self.tx_next += 1;
            posted = true;
        }
        let r = p.rep.workloads.get_mut("stream").unwrap();
        r.detail.insert("sent".into(), self.tx_done);
        r.detail.insert("received".into(), self.rx_expect);
        r.done = p.count > 0 && self.tx_done == p.count && self.rx_expect == p.count;
        Ok(posted)
    }

    fn ring_completion(&mut self, p: &mut Peer, wc: &Wc) {
        if wc.opcode != WcOpcode::RdmaWrite {
            p.violation("ring", format!("unexpected completion {wc:?}"));
            return;
        }
        self.ring_done += 1;
        p.rep.workloads.get_mut("ring").unwrap().issued += 1;
    }

    fn ring_post(&mut self, p: &mut Peer, g: &Info, c: &Chan, running: bool) -> anyhow::Result<bool> {
        let slots = g.num("ring.slots")?;
        let rec = g.num("ring.rec")? as usize;
        let (addr, rkey) = (g.num("ring.addr")?, g.u32("ring.rkey")?);
        let credit = p.buf.read_u64(p.lay.credit());
        let r = p.rep.workloads.get_mut("ring").unwrap();
        if credit > self.ring_next {
            let msg = format!("the guest says it checked {credit} records of {} written", self.ring_next);
            r.detail.insert("checked_by_guest".into(), credit);
            p.violation("ring", msg);
            return Ok(false);
        }
        // Records the guest checked are what the ring verified end to end.
        if credit > r.verified {
            r.bytes_verified += (credit - r.verified) * rec as u64;
            r.verified = credit;
        }
        r.detail.insert("checked_by_guest".into(), credit);
        r.done = p.count > 0 && credit == p.count;
        let mut posted = false;
        while running
            && (p.count == 0 || self.ring_next < p.count)
            && self.ring_next - credit < slots
            && self.ring_next - self.ring_done < RING_WINDOW as u64
        {
            let k = self.ring_next;
            let off = p.lay.ring_tx + (k % RING_WINDOW as u64) as usize * rec;
            p.buf.write(off, &fill(k, k | RING, rec));
            let sge = [p.mr.sge(off, rec)];
            let wr = SendWr::write(TAG_DATA | k, &sge, addr + (k % slots) * rec as u64, rkey).with_imm(k as u32);
            c.qp.post_send(&[wr])?;
            self.ring_next += 1;
            posted = true;
        }
        Ok(posted)
    }

    fn table_post(&mut self, p: &mut Peer, g: &Info, c: &Chan, running: bool, reads: u64) -> anyhow::Result<bool> {
        let r = p.rep.workloads.get_mut("table").unwrap();
        r.done = reads > 0 && self.table_reads >= reads || p.count > 0 && reads == 0 && self.table_reads >= p.count;
        if self.table_inflight || !running || r.done {
            return Ok(false);
        }
        let rows = g.num("table.rows")?;
        let (addr, rkey) = (g.num("table.addr")?, g.u32("table.rkey")?);
        let row = self.table_next_row % rows;
        let ra = addr + row * TABLE_ROW as u64;
        let t = p.lay.table_rx;
        let (s1, s2, s3) = ([p.mr.sge(t, 8)], [p.mr.sge(t + SMALL, TABLE_ROW)], [p.mr.sge(t + 8, 8)]);
        // Three READs in order on one QP: version, row, version (a seqlock reader).
        c.qp.post_send(&[
            SendWr::read(TAG_DATA, &s1, ra, rkey).unsignaled(),
            SendWr::read(TAG_DATA | 1, &s2, ra, rkey).unsignaled(),
            SendWr::read(TAG_DATA | 2, &s3, ra, rkey),
        ])?;
        self.table_inflight = true;
        Ok(true)
    }

    fn table_completion(&mut self, p: &mut Peer, g: &Info, wc: &Wc) {
        self.table_inflight = false;
        if wc.opcode != WcOpcode::RdmaRead {
            p.violation("table", format!("unexpected completion {wc:?}"));
            return;
        }
        self.table_reads += 1;
        let rows = g.num("table.rows").unwrap_or(1).max(1);
        let row = self.table_next_row % rows;
        self.table_next_row += 1;
        let t = p.lay.table_rx;
        let (v1, v3) = (p.buf.read_u64(t), p.buf.read_u64(t + 8));
        let data = p.buf.read(t + SMALL, TABLE_ROW);
        let r = p.rep.workloads.get_mut("table").unwrap();
        r.issued += 1;
        let seen = self.table_seen.entry(row).or_insert(0);
        if v1 < *seen || v3 < v1 {
            let msg = format!("row {row}: version went backwards ({} seen, then {v1}, {v3})", *seen);
            p.violation("table", msg);
            return;
        }
        *seen = v3;
        if v1 != v3 || v1 % 2 == 1 {
            *r.detail.entry("busy".into()).or_insert(0) += 1;
            return;
        }
        match check(&data, v1, row << 32 | v1 | TABLE) {
            None => {
                r.verified += 1;
                r.bytes_verified += TABLE_ROW as u64;
            }
            Some(j) => {
                *r.detail.entry("torn".into()).or_insert(0) += 1;
                p.violation("table", format!("row {row} version {v1}: torn read (word {j} differs)"));
            }
        }
    }

    /// Sandwich check: ops(t1) <= counter(t2) <= ops(t3) + 1.
    fn atomic_check(&mut self, p: &mut Peer, _running: bool) -> bool {
        let ops1 = p.buf.read_u64(p.lay.ops());
        let counter = p.buf.read_u64(p.lay.counter());
        let ops3 = p.buf.read_u64(p.lay.ops());
        let r = p.rep.workloads.get_mut("atomic").unwrap();
        let moved = counter != self.atomic_last;
        if counter < ops1 || counter > ops3 + 1 || counter < self.atomic_last {
            let msg = format!("counter {counter} with {ops1}..{ops3} operations done (last {})", self.atomic_last);
            self.atomic_last = counter;
            p.violation("atomic", msg);
            return moved;
        }
        if counter > r.verified {
            r.bytes_verified += 8 * (counter - r.verified);
            r.verified = counter;
        }
        self.atomic_last = counter;
        r.done = p.count > 0 && ops3 == p.count && counter == p.count;
        moved
    }

    fn atomic_final(&mut self, p: &mut Peer, present: bool) {
        if !present {
            return;
        }
        self.atomic_check(p, false);
        let (counter, ops) = (p.buf.read_u64(p.lay.counter()), p.buf.read_u64(p.lay.ops()));
        let r = p.rep.workloads.get_mut("atomic").unwrap();
        r.detail.insert("counter".into(), counter);
        r.detail.insert("ops".into(), ops);
        if p.count > 0 && p.deadline.is_none() && (counter != p.count || ops != p.count) {
            p.violation("atomic", format!("ended with counter {counter} and {ops} operations, not {}", p.count));
        }
    }
}
