//! `transit-mkeys`: the measuring side of bench/mkeys (docs/mkeys.md).
//!
//! - `ops`: cost per operation on one host for a range of sizes: reg_mr +
//!   dereg_mr, an indirect key's rebind + invalidate (pipelined, and one
//!   waited-for pair), measured in rounds that alternate the sizes (median
//!   and 99th percentile), then alias creation, rcache hit and miss.
//! - `alltoallv`: one rank of an alltoallv-like exchange between the ranks
//!   of two hosts: every iteration each rank allocates fresh send and
//!   receive buffers, makes them reachable (registering them, binding pool
//!   keys to them, or through the rcache), sends each peer the key of its
//!   slot, WRITEs its data into the peers' slots, and waits for theirs.
//!
//! Each prints one JSON line.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use clap::{Parser, Subcommand};
use verbs::mkeys::{AliasCache, KeyGrant, KeyPool};
use verbs::rcache::Rcache;
use verbs::*;

#[derive(Parser)]
#[command(name = "transit-mkeys", about = "memory key benchmarks (bench/mkeys)")]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Cost per operation (one host).
    Ops {
        #[arg(long)]
        sock: PathBuf,
        /// Sizes in bytes.
        #[arg(long, value_delimiter = ',', default_value = "16384,1048576,67108864,1073741824")]
        sizes: Vec<u64>,
        /// Repetitions per row (the largest sizes take fewer for the rcache miss).
        #[arg(long, default_value_t = 200)]
        iters: usize,
    },
    /// One rank of the alltoallv-like exchange.
    Alltoallv {
        #[arg(long)]
        sock: PathBuf,
        /// Host 0 ranks connect; host 1 ranks listen.
        #[arg(long)]
        host: u8,
        #[arg(long)]
        rank: u16,
        /// Ranks per host.
        #[arg(long)]
        ranks: u16,
        /// Host 1's address (host 0 ranks connect to it).
        #[arg(long)]
        peer: Option<Ipv4Addr>,
        #[arg(long, default_value_t = 18700)]
        port: u16,
        #[arg(long, value_delimiter = ',', default_value = "16384,32768")]
        sizes: Vec<usize>,
        #[arg(long, default_value_t = 300)]
        iters: usize,
    },
}

fn main() {
    let a = Args::parse();
    let r = match a.cmd {
        Cmd::Ops { sock, sizes, iters } => ops(&sock, &sizes, iters),
        Cmd::Alltoallv { sock, host, rank, ranks, peer, port, sizes, iters } => {
            alltoallv(&sock, host, rank, ranks, peer, port, &sizes, iters)
        }
    };
    if let Err(e) = r {
        eprintln!("transit-mkeys: error: {e:#}");
        std::process::exit(1);
    }
}

const RW: u32 = access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ;

/// Rounds of each measurement; the row is their median (single rounds
/// swing several-fold on a loaded host).
const ROUNDS: usize = 5;

fn median_of(mut f: impl FnMut() -> anyhow::Result<f64>) -> anyhow::Result<f64> {
    let mut v = (0..ROUNDS).map(|_| f()).collect::<anyhow::Result<Vec<f64>>>()?;
    v.sort_by(|a, b| a.total_cmp(b));
    Ok(v[ROUNDS / 2])
}

fn us_per(t: Instant, n: usize) -> f64 {
    t.elapsed().as_secs_f64() * 1e6 / n.max(1) as f64
}

/// Anonymous memory of `len` bytes, touched (so a registration has pages to move).
fn anon(len: usize) -> anyhow::Result<u64> {
    // SAFETY: fresh anonymous memory.
    let p = unsafe {
        libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
    };
    if p == libc::MAP_FAILED {
        bail!("mmap {len}: {}", std::io::Error::last_os_error());
    }
    // SAFETY: our mapping.
    unsafe { std::ptr::write_bytes(p as *mut u8, 1, len) };
    Ok(p as u64)
}

fn unmap(addr: u64, len: usize) {
    // SAFETY: a mapping made by anon().
    unsafe { libc::munmap(addr as *mut libc::c_void, len) };
}

/// Quantile `q` (0..=1) of `v` (sorted in place).
fn quantile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// Bind + invalidation pairs per timed batch of the pipelined rebind: one
/// doorbell and one wait per batch, as a pool's user posts an iteration's
/// binds together (the wait, a wake-up of rnicd and of us, is spread over
/// the batch).
const REBIND_BATCH: usize = 512;

/// reg_mr + dereg_mr and an indirect key's rebind + invalidate at every
/// size, measured in `rounds` rounds that visit the sizes in turn (each
/// round starting at another size), so that load on the host falls on all
/// sizes alike and the baseline runs beside the rebind. Rows give the
/// median and the 99th percentile over rounds.
fn interleaved_rows(pd: &Pd, pool: &KeyPool, sizes: &[u64], rounds: usize) -> anyhow::Result<Vec<serde_json::Value>> {
    // The buffers are not touched: neither a registration nor a bind in
    // rnicd reads or maps pages one by one (docs/mkeys.md).
    let bufs = sizes.iter().map(|&s| MemBuf::new(s as usize)).collect::<anyhow::Result<Vec<_>>>()?;
    let mrs = bufs.iter().map(|b| pd.reg_mr(b, 0, b.len(), RW)).collect::<anyhow::Result<Vec<_>>>()?;
    let keys = sizes.iter().map(|_| pool.make_key()).collect::<anyhow::Result<Vec<_>>>()?;
    let mut reg = vec![Vec::with_capacity(rounds); sizes.len()];
    let mut rebind = vec![Vec::with_capacity(rounds); sizes.len()];
    let mut sync = vec![Vec::with_capacity(rounds); sizes.len()];
    for r in 0..rounds {
        for j in 0..sizes.len() {
            let i = (r + j) % sizes.len();
            let t = Instant::now();
            drop(pd.reg_mr(&bufs[i], 0, bufs[i].len(), RW)?);
            reg[i].push(us_per(t, 1));
            let range = [mrs[i].sge(0, bufs[i].len())];
            let t = Instant::now();
            pool.churn(&keys[i], &range, RW, REBIND_BATCH)?;
            rebind[i].push(us_per(t, REBIND_BATCH));
            let t = Instant::now();
            drop(pool.get(&range, RW)?);
            sync[i].push(us_per(t, 1));
        }
    }
    let mut rows = Vec::new();
    for (op, per_size) in [("reg_mr+dereg_mr", reg), ("rebind+invalidate", rebind), ("rebind+invalidate_sync", sync)] {
        for (&size, mut v) in sizes.iter().zip(per_size) {
            let (med, p99) = (quantile(&mut v, 0.5), quantile(&mut v, 0.99));
            eprintln!("{op:>22} {size:>11} B {med:>10.2} us (p99 {p99:.2}, {rounds} rounds)");
            let r3 = |x: f64| (x * 1000.0).round() / 1000.0;
            rows.push(serde_json::json!({"op": op, "size": size, "us": r3(med), "p99": r3(p99), "rounds": rounds}));
        }
    }
    Ok(rows)
}

fn ops(sock: &std::path::Path, sizes: &[u64], iters: usize) -> anyhow::Result<()> {
    let ctx = Context::open(Some(sock))?;
    let pd = ctx.alloc_pd()?;
    let agent = Context::open(Some(sock))?;
    let apd = agent.alloc_pd()?;
    let pool = KeyPool::new(&pd, 1, 1)?;
    let mut rows = interleaved_rows(&pd, &pool, sizes, 2 * iters)?;
    let mut row = |op: &str, size: u64, us: f64| {
        eprintln!("{op:>22} {size:>11} B {us:>10.2} us");
        rows.push(serde_json::json!({"op": op, "size": size, "us": (us * 1000.0).round() / 1000.0}));
    };
    for &size in sizes {
        let buf = MemBuf::new(size as usize)?;
        buf.fill(1);
        let mr = pd.reg_mr(&buf, 0, size as usize, RW)?;
        // Alias creation (the owner granted once; made, then dropped untimed).
        mr.grant(agent.client_id())?;
        let cache_owner = ctx.client_id();
        let us = median_of(|| {
            let t = Instant::now();
            let mut aliases = Vec::with_capacity(iters / ROUNDS);
            for _ in 0..iters / ROUNDS {
                aliases.push(apd.create_alias(cache_owner, mr.lkey)?);
            }
            Ok(us_per(t, iters / ROUNDS))
        })?;
        row("alias_create", size, us);
        let cache = AliasCache::new(&apd)?;
        cache.get(cache_owner, mr.lkey)?;
        let t = Instant::now();
        for _ in 0..iters * 100 {
            cache.get(cache_owner, mr.lkey)?;
        }
        row("alias_cache_hit", size, us_per(t, iters * 100));
        drop(mr);
        drop(buf);
        // rcache: a miss moves the pages onto the cache's memfd and
        // registers; a hit finds the region.
        let rc = Rcache::new(&pd, RW, 16, 1 << 40)?;
        let miss_iters = if size >= 1 << 30 {
            2
        } else if size >= 64 << 20 {
            5
        } else {
            iters.min(100)
        };
        let (mut miss_us, mut hit_us) = (0.0, 0.0);
        for m in 0..miss_iters {
            let a = anon(size as usize)?;
            let t = Instant::now();
            let r = rc.register(a, size)?;
            miss_us += t.elapsed().as_secs_f64() * 1e6;
            if m == 0 {
                let t = Instant::now();
                for _ in 0..iters * 10 {
                    drop(rc.register(a + 4096, size / 2)?);
                }
                hit_us = us_per(t, iters * 10);
            }
            drop(r);
            unmap(a, size as usize);
            rc.sync();
        }
        row("rcache_miss", size, miss_us / miss_iters as f64);
        row("rcache_hit", size, hit_us);
    }
    println!("{}", serde_json::json!({ "rows": rows }));
    Ok(())
}

/// How a rank makes its fresh buffers reachable.
#[derive(Clone, Copy, Debug)]
enum Mode {
    Register,
    Pool,
    Rcache,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Register => "register",
            Mode::Pool => "pool",
            Mode::Rcache => "rcache",
        }
    }
}

/// One connection of a rank to a rank of the other host.
struct Link {
    qp: Qp,
}

/// Slots of the buffer arena a rank cycles through, as malloc reuses freed
/// blocks: "fresh" buffers at addresses seen before.
const SLOTS: usize = 4;

#[allow(clippy::too_many_arguments)]
fn alltoallv(
    sock: &std::path::Path,
    host: u8,
    rank: u16,
    ranks: u16,
    peer: Option<Ipv4Addr>,
    port: u16,
    sizes: &[usize],
    iters: usize,
) -> anyhow::Result<()> {
    let ctx = Context::open(Some(sock))?;
    let pd = ctx.alloc_pd()?;
    let n = ranks as usize;
    let depth = 64u32;
    // One CQ for sends and receives, with a channel to sleep on: a rank
    // spinning on a small host takes the CPU that rnicd and its peers need.
    let channel = ctx.create_comp_channel()?;
    let cq = ctx.create_cq(4096, Some(&channel))?;
    // Small control messages (peer's slot address + rkey) land here.
    let ctl = MemBuf::new(n * 64 * depth as usize)?;
    let ctl_mr = pd.reg_mr(&ctl, 0, ctl.len(), RW)?;
    let mut links = Vec::with_capacity(n);
    for p in 0..n {
        let mut init = QpInitAttr::new(&cq, &cq);
        init.cap.max_send_wr = depth * 2;
        init.cap.max_recv_wr = depth;
        init.cap.max_inline_data = 64;
        let qp = pd.create_qp(&init)?;
        // Out of band: host 0 rank r connects to host 1 rank p's port.
        let mut s = if host == 0 {
            let addr = peer.context("--peer is needed on host 0")?;
            let t0 = Instant::now();
            loop {
                match TcpStream::connect((addr, port + p as u16)) {
                    Ok(s) => break s,
                    Err(_) if t0.elapsed() < Duration::from_secs(30) => std::thread::sleep(Duration::from_millis(50)),
                    Err(e) => return Err(e).context("connect to the peer rank"),
                }
            }
        } else {
            let l = LISTENER.with(|l| -> anyhow::Result<TcpListener> {
                if l.borrow().is_none() {
                    *l.borrow_mut() = Some(TcpListener::bind(("0.0.0.0", port + rank))?);
                }
                Ok(l.borrow().as_ref().unwrap().try_clone()?)
            })?;
            l.accept()?.0
        };
        let me = serde_json::to_vec(&(qp.endpoint(0), rank))?;
        s.write_all(&(me.len() as u32).to_le_bytes())?;
        s.write_all(&me)?;
        let mut len = [0u8; 4];
        s.read_exact(&mut len)?;
        let mut theirs = vec![0u8; u32::from_le_bytes(len) as usize];
        s.read_exact(&mut theirs)?;
        let (ep, _their_rank): (QpEndpoint, u16) = serde_json::from_slice(&theirs)?;
        qp.connect(&ep, &ConnectOpts { mtu: Mtu::M4096, ..Default::default() })?;
        // Both sides connected before anyone sends.
        s.write_all(&[1])?;
        s.read_exact(&mut [0u8])?;
        links.push(Link { qp });
    }
    // Receives for control messages: slot k of link p at (p * depth + k) * 64.
    for (p, l) in links.iter().enumerate() {
        for k in 0..depth as usize {
            let off = (p * depth as usize + k) * 64;
            l.qp.post_recv(&[RecvWr { wr_id: (p * depth as usize + k) as u64, sg_list: &[ctl_mr.sge(off, 64)] }])?;
        }
    }
    let max = *sizes.iter().max().unwrap_or(&16384);
    let slot_bytes = 2 * n * max;
    // The arena the pool binds into: one MR registered once (as UCX on
    // BlueField registers its heap once and hands out indirect keys).
    let arena = MemBuf::new(SLOTS * slot_bytes)?;
    let arena_mr = pd.reg_mr(&arena, 0, arena.len(), RW)?;
    let pool = KeyPool::new(&pd, 2 * SLOTS, 1)?;
    // Ordinary memory for the rcache (malloc-like slots).
    let heap = anon(SLOTS * slot_bytes)?;
    let rc = Rcache::new(&pd, RW, 64, 1 << 30)?;
    let mut results = Vec::new();
    let mut r = Rank {
        n,
        links: &links,
        cq: &cq,
        channel: &channel,
        ctl: &ctl,
        ctl_mr: &ctl_mr,
        pd: &pd,
        arena: &arena,
        arena_mr: &arena_mr,
        pool: &pool,
        heap,
        rc: &rc,
        slot_bytes,
        depth,
        early: Vec::new(),
    };
    for mode in [Mode::Register, Mode::Pool, Mode::Rcache] {
        for &size in sizes {
            let warm = iters / 10;
            let mut t = Instant::now();
            for it in 0..iters + warm {
                if it == warm {
                    t = Instant::now();
                }
                r.iteration(mode, it, size)?;
            }
            let us = us_per(t, iters);
            eprintln!("host {host} rank {rank}: {:>8} {size:>6} B {us:>9.1} us/iter", mode.name());
            results.push(serde_json::json!({"mode": mode.name(), "size": size, "us_per_iter": (us * 10.0).round() / 10.0}));
        }
    }
    println!("{}", serde_json::json!({ "host": host, "rank": rank, "alltoallv": results, "rcache": rc.stats() }));
    Ok(())
}

thread_local! {
    static LISTENER: std::cell::RefCell<Option<TcpListener>> = const { std::cell::RefCell::new(None) };
}

/// An iteration's registrations, kept until it ends (then released).
#[allow(dead_code)]
enum Held<'a> {
    Mrs(Mr, Mr),
    Keys(&'a KeyPool, Vec<verbs::mkeys::PooledKey<'a>>),
    Regs(verbs::rcache::Registration<'a>, verbs::rcache::Registration<'a>),
}

/// What a rank keeps between iterations.
struct Rank<'a> {
    n: usize,
    links: &'a [Link],
    cq: &'a Cq,
    channel: &'a CompChannel,
    ctl: &'a MemBuf,
    ctl_mr: &'a Mr,
    pd: &'a Pd,
    arena: &'a MemBuf,
    arena_mr: &'a Mr,
    pool: &'a KeyPool,
    heap: u64,
    rc: &'a Rcache,
    slot_bytes: usize,
    depth: u32,
    /// Slot announcements of a later iteration that came early: (iteration, link, address, rkey).
    early: Vec<(u32, usize, u64, u32)>,
}

impl Rank<'_> {
    /// One alltoallv iteration: fresh buffers made reachable per `mode`,
    /// slot announcements out, WRITEs with immediate to every peer, and
    /// every peer's WRITE in; then the received data is checked.
    fn iteration(&mut self, mode: Mode, it: usize, size: usize) -> anyhow::Result<()> {
        let n = self.n;
        let slot = it % SLOTS;
        let fill = (it as u8).wrapping_add(1);
        let half = n * size;
        // Fresh buffers: the send half then the receive half of this iteration's slot.
        let base = match mode {
            Mode::Register | Mode::Pool => self.arena.addr() + (slot * self.slot_bytes) as u64,
            Mode::Rcache => self.heap + (slot * self.slot_bytes) as u64,
        };
        // SAFETY: both halves lie inside the arena or the heap mapping.
        unsafe {
            std::ptr::write_bytes(base as *mut u8, fill, half);
            std::ptr::write_bytes((base + half as u64) as *mut u8, 0, half);
        }
        let off = (base - self.arena.addr()) as usize;
        let (lkey, rkey, _keep) = match mode {
            Mode::Register => {
                let send = self.pd.reg_mr(self.arena, off, half, RW)?;
                let recv = self.pd.reg_mr(self.arena, off + half, half, RW)?;
                (send.lkey, recv.rkey, Held::Mrs(send, recv))
            }
            Mode::Pool => {
                let lists = [self.arena_mr.sge(off, half), self.arena_mr.sge(off + half, half)];
                let keys = self.pool.get_many(&[&lists[..1], &lists[1..]], RW)?;
                (keys[0].key(), keys[1].key(), Held::Keys(self.pool, keys))
            }
            Mode::Rcache => {
                let send = self.rc.register(base, half as u64)?;
                let recv = self.rc.register(base + half as u64, half as u64)?;
                (send.lkey, recv.rkey, Held::Regs(send, recv))
            }
        };
        // Tell each peer where its slot is: (iteration, address, rkey), inline.
        for (p, l) in self.links.iter().enumerate() {
            let mut msg = [0u8; 16];
            msg[..4].copy_from_slice(&(it as u32).to_le_bytes());
            msg[4..12].copy_from_slice(&(base + (half + p * size) as u64).to_le_bytes());
            msg[12..].copy_from_slice(&rkey.to_le_bytes());
            l.qp.post_send(&[SendWr::send(u64::MAX, &[]).with_inline(&msg).unsignaled()])?;
        }
        let mut targets: Vec<(usize, u64, u32)> = Vec::new();
        self.early.retain(|&(i, p, a, k)| {
            if i as usize == it {
                targets.push((p, a, k));
            }
            i as usize != it
        });
        let (mut got_data, mut written, mut announced) = (0, 0, 0);
        let mut wc = [Wc::default(); 64];
        while announced < n || got_data < n || written < n {
            for (p, addr, rk) in targets.drain(..) {
                let sge = [Sge { addr: base + (p * size) as u64, length: size as u32, lkey }];
                self.links[p].qp.post_send(&[SendWr::write(it as u64, &sge, addr, rk).with_imm(it as u32)])?;
                announced += 1;
            }
            let k = self.cq.poll_or_wait(&mut wc, self.channel, Duration::from_micros(20), Duration::from_secs(60))?;
            if k == 0 {
                bail!("iteration {it} timed out");
            }
            for w in &wc[..k] {
                if w.status != WcStatus::Success {
                    bail!("completion failed: {w:?}");
                }
                if w.opcode == WcOpcode::RdmaWrite {
                    written += 1;
                    continue;
                }
                let p = w.wr_id as usize / self.depth as usize;
                let off = w.wr_id as usize * 64;
                let m = self.ctl.read(off, 16);
                // Read first, then give the buffer back.
                self.links[p].qp.post_recv(&[RecvWr { wr_id: w.wr_id, sg_list: &[self.ctl_mr.sge(off, 64)] }])?;
                if w.opcode == WcOpcode::RecvRdmaWithImm {
                    got_data += 1;
                    continue;
                }
                let i = u32::from_le_bytes(m[..4].try_into().unwrap());
                let addr = u64::from_le_bytes(m[4..12].try_into().unwrap());
                let rk = u32::from_le_bytes(m[12..].try_into().unwrap());
                if i as usize == it {
                    targets.push((p, addr, rk));
                } else {
                    self.early.push((i, p, addr, rk));
                }
            }
        }
        // Pool keys go back with one wait for both invalidations.
        if let Held::Keys(pool, keys) = _keep {
            pool.put_many(keys)?;
        }
        // Every peer's data arrived whole (peers fill with the same value).
        // SAFETY: the receive half of this slot.
        let recv = unsafe { std::slice::from_raw_parts((base + half as u64) as *const u8, half) };
        if recv.iter().any(|&b| b != fill) {
            bail!("iteration {it}: received data is wrong");
        }
        Ok(())
    }
}
