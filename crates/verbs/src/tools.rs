//! `transit rdma ...`: device info and perftest-style benchmarks.
//!
//! Like perftest, every benchmark is a server (no peer address) and a client
//! (with the server's address); they swap QPN, PSN, buffer address and rkey
//! over TCP, then measure. Latencies are one-way (round trip / 2).

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream, UdpSocket};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use serde::{Deserialize, Serialize};

use crate::pace::{self, Idle, Pace};
use crate::*;

#[derive(clap::Subcommand)]
pub enum RdmaCmd {
    /// Show the device, its port and GID (like ibv_devinfo).
    Devinfo {
        /// rnicd control socket (default: the rnicd of this network namespace).
        #[arg(long)]
        sock: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
    /// rnicd counters (drops, retransmissions, NAKs) as JSON.
    Stats {
        #[arg(long)]
        sock: Option<PathBuf>,
    },
    /// The transport state of every QP and SRQ of rnicd, in all its
    /// namespaces (PSNs, window, timers, queues) as JSON.
    Qps {
        #[arg(long)]
        sock: Option<PathBuf>,
    },
    /// RDMA WRITE bandwidth (ib_write_bw).
    WriteBw(PerfArgs),
    /// RDMA READ bandwidth (ib_read_bw).
    ReadBw(PerfArgs),
    /// SEND/RECV bandwidth (ib_send_bw).
    SendBw(PerfArgs),
    /// SEND/RECV ping-pong latency (ib_send_lat).
    SendLat(PerfArgs),
    /// RDMA WRITE ping-pong latency (ib_write_lat).
    WriteLat(PerfArgs),
    /// Baseline: UDP ping-pong latency between the same hosts, no RDMA.
    UdpLat(PerfArgs),
    /// The bare-metal side of a guest's RDMA workloads (stream, ring,
    /// table, atomic): learns the guest's IDs once, prints its own as the
    /// first line, verifies everything and prints a JSON report last.
    Peer(crate::peer::PeerArgs),
    /// Runs an unmodified libibverbs program (ibv_rc_pingpong, perftest...)
    /// on rnicd through the drop-in libibverbs.so.1 (docs/ibverbs.md).
    Exec {
        /// rnicd control socket (default: the rnicd of this network namespace).
        #[arg(long)]
        sock: Option<PathBuf>,
        /// Work in rnicd's RDMA namespace of this GID.
        #[arg(long)]
        namespace: Option<std::net::Ipv4Addr>,
        /// The program and its arguments (after `--`).
        #[arg(trailing_var_arg = true, required = true, allow_hyphen_values = true)]
        cmd: Vec<std::ffi::OsString>,
    },
}

#[derive(clap::Args, Clone, Debug)]
pub struct PerfArgs {
    /// Server address; without it this side is the server.
    pub peer: Option<String>,
    /// TCP port of the out-of-band exchange (UDP port for udp-lat).
    #[arg(long, default_value_t = 18515)]
    pub port: u16,
    /// Message size in bytes (default 65536 for bandwidth, 2 for latency).
    #[arg(long)]
    pub size: Option<usize>,
    /// Seconds to run a bandwidth test.
    #[arg(long, default_value_t = 2.0)]
    pub duration: f64,
    /// Round trips of a latency test.
    #[arg(long, default_value_t = 5000)]
    pub iters: usize,
    /// Path MTU in bytes: 256..4096, capped at the port's active MTU (what
    /// the link carries whole), or 8192/16384/32768 for software links, as asked.
    #[arg(long, default_value_t = 4096)]
    pub mtu: usize,
    /// Outstanding work requests.
    #[arg(long, default_value_t = 128)]
    pub tx_depth: u32,
    /// Receives a SEND test's receiver keeps posted: all posted before the
    /// first message, each reposted as its completion is polled (perftest's
    /// `-r`, whose default this is).
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(16..=16384))]
    pub rx_depth: u32,
    /// Local ACK timeout (IB code: 4.096 us * 2^t; 14 = 67 ms, the usual default).
    #[arg(long, default_value_t = 14)]
    pub timeout: u8,
    /// Minimum RNR timer both QPs announce in their RNR NAKs (IB code: 1 =
    /// 10 us; 12 = 640 us, what perftest sets): how long a sender waits
    /// when the receiver has no receive posted.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=31))]
    pub min_rnr_timer: u8,
    /// Latency tests: poll the receive CQ (send-lat) or buffer (write-lat)
    /// in a loop without yielding, as perftest does, instead of sleeping on
    /// the receive CQ's completion channel after TRANSIT_POLL_SPIN_US
    /// (default 0) of spinning. Only for hosts with a CPU per program
    /// besides rnicd's: where programs share CPUs, the spinner holds the
    /// CPU its peer needs for a whole time slice (milliseconds).
    #[arg(long)]
    pub busy_poll: bool,
    #[arg(long)]
    pub sock: Option<PathBuf>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize, Deserialize, Debug, Clone)]
struct Hello {
    test: String,
    ep: QpEndpoint,
    addr: u64,
    rkey: u32,
    size: usize,
    mtu: usize,
    iters: usize,
    tx_depth: u32,
    #[serde(default = "default_rx_depth")]
    rx_depth: u32,
    timeout: u8,
    #[serde(default = "default_min_rnr_timer")]
    min_rnr_timer: u8,
}

fn default_min_rnr_timer() -> u8 {
    1
}

/// What a client that does not send `rx_depth` had its server post.
fn default_rx_depth() -> u32 {
    256
}

/// One measured result (also the JSON the bench reads).
#[derive(Serialize, Debug, Default)]
pub struct Report {
    pub test: String,
    pub size: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gbps: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub msg_rate_mpps: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lat_p50_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lat_p99_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lat_avg_us: Option<f64>,
    pub iters: u64,
    pub seconds: f64,
    /// CPU seconds this tool process used while measuring.
    pub cpu_s: f64,
}

pub fn run(c: RdmaCmd) -> anyhow::Result<()> {
    match c {
        RdmaCmd::Devinfo { sock, json } => devinfo(sock, json),
        RdmaCmd::Stats { sock } => {
            let ctx = Context::open(sock.as_deref())?;
            println!("{}", serde_json::to_string_pretty(&ctx.stats()?)?);
            Ok(())
        }
        RdmaCmd::Qps { sock } => {
            let ctx = Context::open(sock.as_deref())?;
            println!("{}", serde_json::to_string_pretty(&ctx.dump_qps()?)?);
            Ok(())
        }
        RdmaCmd::WriteBw(a) => perf("write_bw", a),
        RdmaCmd::ReadBw(a) => perf("read_bw", a),
        RdmaCmd::SendBw(a) => perf("send_bw", a),
        RdmaCmd::SendLat(a) => perf("send_lat", a),
        RdmaCmd::WriteLat(a) => perf("write_lat", a),
        RdmaCmd::UdpLat(a) => udp_lat(a),
        RdmaCmd::Peer(a) => crate::peer::run(a),
        RdmaCmd::Exec { sock, namespace, cmd } => exec_dropin(sock, namespace, cmd),
    }
}

/// Where the drop-in libibverbs.so.1 is: `TRANSIT_IBVERBS_DIR`, else the
/// `ibverbs/` directory beside this binary (target/release/ibverbs).
fn dropin_dir() -> anyhow::Result<PathBuf> {
    let dir = match std::env::var_os("TRANSIT_IBVERBS_DIR") {
        Some(d) => PathBuf::from(d),
        None => std::env::current_exe()?.parent().context("binary without a directory")?.join("ibverbs"),
    };
    if !dir.join("libibverbs.so.1").exists() {
        bail!("no libibverbs.so.1 in {} (build it: cargo build --release -p ibverbs-dropin && target/release/ibverbs-link)", dir.display());
    }
    Ok(dir)
}

fn exec_dropin(sock: Option<PathBuf>, namespace: Option<std::net::Ipv4Addr>, cmd: Vec<std::ffi::OsString>) -> anyhow::Result<()> {
    use std::os::unix::process::CommandExt;
    let dir = dropin_dir()?;
    let mut path = std::ffi::OsString::from(&dir);
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH").filter(|p| !p.is_empty()) {
        path.push(":");
        path.push(old);
    }
    let mut c = std::process::Command::new(&cmd[0]);
    c.args(&cmd[1..]).env("LD_LIBRARY_PATH", path);
    // The program finds the same rnicd this tool would.
    c.env("TRANSIT_RNICD_SOCK", find_socket_or(sock)?);
    if let Some(ns) = namespace {
        c.env("TRANSIT_IBV_NAMESPACE", ns.to_string());
    }
    let err = c.exec();
    Err(err).with_context(|| format!("exec {}", cmd[0].to_string_lossy()))
}

fn find_socket_or(sock: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    match sock {
        Some(s) => Ok(s),
        None => crate::find_socket(),
    }
}

fn devinfo(sock: Option<PathBuf>, json: bool) -> anyhow::Result<()> {
    let ctx = Context::open(sock.as_deref())?;
    let d = ctx.query_device()?;
    let p = ctx.query_port(1)?;
    let gid = ctx.query_gid(1, 0)?;
    if json {
        let v = serde_json::json!({"device": d, "port": p, "gid": gid.to_string(), "socket": ctx.socket_path()});
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!("hca_id:\trnicd ({gid})");
    println!("\ttransport:\t\t\tInfiniBand (0), RoCE v2 over UDP 4791");
    println!("\tcontrol socket:\t\t\t{}", ctx.socket_path().display());
    println!("\tfw_ver:\t\t\t\t{}", d.fw_ver);
    println!(
        "\tnode_guid:\t\t\t{:04x}:{:04x}:{:04x}:{:04x}",
        d.node_guid >> 48,
        (d.node_guid >> 32) & 0xffff,
        (d.node_guid >> 16) & 0xffff,
        d.node_guid & 0xffff
    );
    println!("\tvendor_id:\t\t\t{:#06x}", d.vendor_id);
    println!("\tvendor_part_id:\t\t\t{}", d.vendor_part_id);
    println!("\tmax_mr_size:\t\t\t{:#x}", d.max_mr_size);
    println!("\tmax_qp:\t\t\t\t{}", d.max_qp);
    println!("\tmax_qp_wr:\t\t\t{}", d.max_qp_wr);
    println!("\tmax_sge:\t\t\t{}", d.max_sge);
    println!("\tmax_cq:\t\t\t\t{}", d.max_cq);
    println!("\tmax_cqe:\t\t\t{}", d.max_cqe);
    println!("\tmax_mr:\t\t\t\t{}", d.max_mr);
    println!("\tmax_pd:\t\t\t\t{}", d.max_pd);
    println!("\tmax_qp_rd_atom:\t\t\t{}", d.max_qp_rd_atom);
    println!("\tmax_qp_init_rd_atom:\t\t{}", d.max_qp_init_rd_atom);
    println!("\tmax_inline_data:\t\t{}", d.max_inline_data);
    println!("\tmax_msg_sz:\t\t\t{:#x}", d.max_msg_sz);
    println!("\tatomic_cap:\t\t\t{}", d.atomic_cap);
    println!("\t\tport:\t{}", p.port_num);
    println!("\t\t\tstate:\t\t\tPORT_{} (4)", p.state);
    println!("\t\t\tmax_mtu:\t\t{}", p.max_mtu.bytes());
    println!("\t\t\tactive_mtu:\t\t{}", p.active_mtu.bytes());
    println!("\t\t\tlink_layer:\t\t{}", p.link_layer);
    println!("\t\t\tGID[  0]:\t\t::ffff:{gid}, RoCE v2");
    Ok(())
}

fn cpu_seconds() -> f64 {
    // SAFETY: getrusage fills the struct.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    t(ru.ru_utime) + t(ru.ru_stime)
}

fn send_line<T: Serialize>(s: &mut TcpStream, v: &T) -> anyhow::Result<()> {
    let mut b = serde_json::to_vec(v)?;
    b.push(b'\n');
    s.write_all(&b)?;
    Ok(())
}

fn read_line<T: for<'a> Deserialize<'a>>(r: &mut BufReader<TcpStream>) -> anyhow::Result<T> {
    let mut l = String::new();
    if r.read_line(&mut l)? == 0 {
        bail!("peer closed the connection");
    }
    Ok(serde_json::from_str(&l)?)
}

struct Res {
    qp: Qp,
    mr: Mr,
    scq: Cq,
    rcq: Cq,
    /// Completion channel of `rcq`: latency tests sleep on it (unless --busy-poll).
    rchan: CompChannel,
    /// How a latency test's waits on `rcq` went: whether it yields or
    /// sleeps while waiting, as the drop-in's ibv_poll_cq decides.
    rpace: Pace,
    _pd: Pd,
    buf: MemBuf,
}

fn resources(ctx: &Context, size: usize, depth: u32, rx_depth: u32) -> anyhow::Result<Res> {
    let pd = ctx.alloc_pd()?;
    let scq = ctx.create_cq(depth * 2 + 64, None)?;
    let rchan = ctx.create_comp_channel()?;
    let rcq = ctx.create_cq(rx_depth.max(32) + 64, Some(&rchan))?;
    let mut init = QpInitAttr::new(&scq, &rcq);
    init.cap.max_send_wr = depth.max(16);
    init.cap.max_recv_wr = rx_depth.max(32);
    init.cap.max_send_sge = 1;
    init.cap.max_recv_sge = 1;
    init.cap.max_inline_data = 256;
    let qp = pd.create_qp(&init)?;
    // Two halves: one the peer writes into, one we send from.
    let buf = MemBuf::new(size.max(8) * 2)?;
    let mr = pd.reg_mr(&buf, 0, buf.len(), access::ALL)?;
    Ok(Res { qp, mr, scq, rcq, rchan, rpace: Pace::default(), _pd: pd, buf })
}

fn opts(h: &Hello) -> anyhow::Result<ConnectOpts> {
    Ok(ConnectOpts {
        mtu: Mtu::from_bytes(h.mtu).context("MTU must be 256..4096 or 8192/16384/32768")?,
        timeout: h.timeout,
        min_rnr_timer: h.min_rnr_timer,
        ..Default::default()
    })
}

fn perf(test: &str, a: PerfArgs) -> anyhow::Result<()> {
    let lat = test.ends_with("_lat");
    let size = a.size.unwrap_or(if lat { 2 } else { 65536 });
    if size > (1 << 30) {
        bail!("messages are at most 1 GiB");
    }
    let ctx = Context::open(a.sock.as_deref())?;
    let psn = std::process::id() & 0xffffff;
    match &a.peer {
        None => {
            let l = TcpListener::bind(("0.0.0.0", a.port)).with_context(|| format!("listen on TCP {}", a.port))?;
            eprintln!("waiting for a client on TCP port {} (GID {})", a.port, ctx.gid());
            let (s, _) = l.accept()?;
            s.set_nodelay(true)?;
            let mut r = BufReader::new(s.try_clone()?);
            let mut w = s;
            let ch: Hello = read_line(&mut r)?;
            if ch.test != test {
                bail!("client runs {}, this server {test}", ch.test);
            }
            let res = resources(&ctx, ch.size, ch.tx_depth, ch.rx_depth)?;
            let me = Hello { ep: res.qp.endpoint(psn), addr: res.mr.addr, rkey: res.mr.rkey, ..ch.clone() };
            res.qp.connect(&ch.ep, &ConnectOpts { sq_psn: psn, ..opts(&ch)? })?;
            send_line(&mut w, &me)?;
            serve(test, &res, &ch, LatWait::of(&a, &ctx), &mut r)?;
            Ok(())
        }
        Some(peer) => {
            let s = connect_retry(peer, a.port)?;
            s.set_nodelay(true)?;
            let mut r = BufReader::new(s.try_clone()?);
            let mut w = s;
            let res = resources(&ctx, size, a.tx_depth, a.rx_depth)?;
            let me = Hello {
                test: test.into(),
                ep: res.qp.endpoint(psn),
                addr: res.mr.addr,
                rkey: res.mr.rkey,
                size,
                mtu: a.mtu,
                iters: a.iters,
                tx_depth: a.tx_depth,
                rx_depth: a.rx_depth,
                timeout: a.timeout,
                min_rnr_timer: a.min_rnr_timer,
            };
            send_line(&mut w, &me)?;
            let sh: Hello = read_line(&mut r)?;
            res.qp.connect(&sh.ep, &ConnectOpts { sq_psn: psn, ..opts(&me)? })?;
            let rep = client(test, &res, &me, &sh, a.duration, LatWait::of(&a, &ctx))?;
            send_line(&mut w, &"done")?;
            let _ = read_line::<String>(&mut r);
            print_report(&rep, a.json);
            Ok(())
        }
    }
}

fn connect_retry(peer: &str, port: u16) -> anyhow::Result<TcpStream> {
    let t0 = Instant::now();
    loop {
        match TcpStream::connect((peer, port)) {
            Ok(s) => return Ok(s),
            Err(e) if t0.elapsed() < Duration::from_secs(10) => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(e).with_context(|| format!("connect to {peer}:{port}")),
        }
    }
}

fn print_report(r: &Report, json: bool) {
    if json {
        println!("{}", serde_json::to_string(r).unwrap());
        return;
    }
    if let Some(g) = r.gbps {
        println!(" {:<10} {:>10} {:>12} {:>16} {:>14}", "#bytes", "#iters", "BW[Gb/s]", "MsgRate[Mpps]", "CPU[s]");
        println!(" {:<10} {:>10} {:>12.3} {:>16.4} {:>14.3}", r.size, r.iters, g, r.msg_rate_mpps.unwrap_or(0.0), r.cpu_s);
    } else {
        println!(" {:<10} {:>10} {:>12} {:>12} {:>12}", "#bytes", "#iters", "t_p50[us]", "t_p99[us]", "t_avg[us]");
        println!(
            " {:<10} {:>10} {:>12.2} {:>12.2} {:>12.2}",
            r.size,
            r.iters,
            r.lat_p50_us.unwrap_or(0.0),
            r.lat_p99_us.unwrap_or(0.0),
            r.lat_avg_us.unwrap_or(0.0)
        );
    }
}

/// Polls `cq` once; spins politely (yield) so rnicd gets the CPU on small machines.
fn poll_some(cq: &Cq, wcs: &mut [Wc]) -> anyhow::Result<usize> {
    let n = cq.poll(wcs)?;
    for w in &wcs[..n] {
        if w.status != WcStatus::Success {
            bail!("work request {} failed: {:?}", w.wr_id, w.status);
        }
    }
    if n == 0 {
        std::thread::yield_now();
    }
    Ok(n)
}

/// How a latency test waits for the peer's message.
#[derive(Clone, Copy, Debug)]
enum LatWait {
    /// Poll the receive CQ (or, for WRITE, the buffer) in a loop without
    /// yielding or a system call, as perftest's ib_send_lat and
    /// ib_write_lat do: the message is seen the moment rnicd lands it, at
    /// the price of a CPU per side.
    Busy,
    /// Poll the receive CQ as the drop-in's ibv_poll_cq does for perftest
    /// (`verbs::pace`): yield after a few empty polls while the next
    /// message is due, else arm the CQ and sleep on its completion channel
    /// (after `spin` of spinning), the CPU left to rnicd and the peer.
    /// Beside a real-time rnicd (`nap` false) it only yields, as the
    /// drop-in's does there.
    Events { spin: Duration, nap: bool },
}

impl LatWait {
    fn of(a: &PerfArgs, ctx: &Context) -> Self {
        if a.busy_poll {
            return LatWait::Busy;
        }
        let us = std::env::var("TRANSIT_POLL_SPIN_US").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
        LatWait::Events { spin: Duration::from_micros(us), nap: !ctx.rnicd_realtime() }
    }
}

/// Waits for one receive completion (at most `timeout`; 0 if none came).
/// `Events` waits as the drop-in's ibv_poll_cq (`verbs::pace`): polls,
/// yielding after a few, while the next message of the ping-pong is due,
/// else (or after TRANSIT_POLL_SPIN_US of spinning) sleeps on the channel;
/// beside a real-time rnicd it only yields.
fn wait_recv(res: &Res, wcs: &mut [Wc], wait: LatWait, timeout: Duration) -> anyhow::Result<usize> {
    let n = match wait {
        // Spin for the whole timeout (poll_or_wait spins without yielding).
        LatWait::Busy => res.rcq.poll_or_wait(&mut wcs[..1], &res.rchan, timeout, timeout)?,
        LatWait::Events { spin, nap } => {
            let t0 = Instant::now();
            loop {
                let n = res.rcq.poll(&mut wcs[..1])?;
                if n > 0 {
                    break n;
                }
                match res.rpace.empty(pace::now_ns(), nap, true) {
                    Idle::Spin => std::hint::spin_loop(),
                    Idle::Yield if t0.elapsed() >= timeout => break 0,
                    Idle::Yield => std::thread::yield_now(),
                    Idle::Nap => break res.rcq.poll_or_wait(&mut wcs[..1], &res.rchan, spin, timeout.saturating_sub(t0.elapsed()))?,
                }
            }
        }
    };
    if n > 0 {
        res.rpace.found(pace::now_ns());
    }
    for w in &wcs[..n] {
        if w.status != WcStatus::Success {
            bail!("work request {} failed: {:?}", w.wr_id, w.status);
        }
    }
    Ok(n)
}

fn client(test: &str, res: &Res, me: &Hello, peer: &Hello, duration: f64, wait: LatWait) -> anyhow::Result<Report> {
    let size = me.size;
    let mut wcs = [Wc::default(); 64];
    let cpu0 = cpu_seconds();
    let mut rep = Report { test: test.into(), size, ..Default::default() };
    match test {
        "write_bw" | "read_bw" | "send_bw" => {
            let depth = me.tx_depth.max(2) as u64;
            let cq_mod = (depth / 4).clamp(1, 16);
            let depth = depth / cq_mod * cq_mod;
            let sg = [res.mr.sge(size.max(8), size)];
            let dst = [res.mr.sge(0, size)];
            let until = Duration::from_secs_f64(duration);
            let t0 = Instant::now();
            let (mut posted, mut done) = (0u64, 0u64);
            loop {
                let stop = t0.elapsed() >= until && posted % cq_mod == 0;
                while !stop && posted - done < depth {
                    let signaled = (posted + 1) % cq_mod == 0;
                    let mut wr = match test {
                        "write_bw" => SendWr::write(posted, &sg, peer.addr, peer.rkey),
                        "read_bw" => SendWr::read(posted, &dst, peer.addr, peer.rkey),
                        _ => SendWr::send(posted, &sg),
                    };
                    if !signaled {
                        wr = wr.unsignaled();
                    }
                    if size <= 256 && test != "read_bw" {
                        // SAFETY: the slice lies inside our buffer.
                        let d = unsafe { std::slice::from_raw_parts(res.buf.as_ptr().add(size.max(8)), size) };
                        wr = wr.with_inline(d);
                    }
                    if res.qp.post_send(&[wr]).is_err() {
                        break;
                    }
                    posted += 1;
                    if posted % cq_mod == 0 && posted - done >= depth {
                        break;
                    }
                }
                if stop && done == posted {
                    break;
                }
                let n = poll_some(&res.scq, &mut wcs)?;
                done += n as u64 * cq_mod;
            }
            let secs = t0.elapsed().as_secs_f64();
            rep.iters = done;
            rep.seconds = secs;
            rep.gbps = Some(done as f64 * size as f64 * 8.0 / secs / 1e9);
            rep.msg_rate_mpps = Some(done as f64 / secs / 1e6);
        }
        "send_lat" | "write_lat" => {
            let mut samples = Vec::with_capacity(me.iters);
            let sg = [res.mr.sge(size.max(8), size)];
            let recv_sg = [res.mr.sge(0, size.max(8))];
            let inline = size <= 256;
            if test == "send_lat" {
                for k in 0..16 {
                    res.qp.post_recv(&[RecvWr { wr_id: k, sg_list: &recv_sg }])?;
                }
            }
            let t_all = Instant::now();
            for i in 1..=me.iters as u64 {
                let t0 = Instant::now();
                if test == "send_lat" {
                    post_small(res, SendWr::send(i, &sg), size, inline, i)?;
                    if wait_recv(res, &mut wcs, wait, Duration::from_secs(10))? == 0 {
                        bail!("peer stopped answering");
                    }
                    res.qp.post_recv(&[RecvWr { wr_id: i, sg_list: &recv_sg }])?;
                } else {
                    post_small(res, SendWr::write(i, &sg, peer.addr, peer.rkey), size, inline, i)?;
                    wait_stamp(&res.buf, size, i, wait)?;
                }
                samples.push(t0.elapsed().as_secs_f64() * 1e6 / 2.0);
            }
            rep.seconds = t_all.elapsed().as_secs_f64();
            rep.iters = me.iters as u64;
            fill_lat(&mut rep, &mut samples);
        }
        _ => bail!("unknown test {test}"),
    }
    rep.cpu_s = cpu_seconds() - cpu0;
    Ok(rep)
}

/// Posts a latency message whose last 8 bytes (or fewer) carry the stamp
/// `i`, signaled, as perftest's latency tests post every message (one WR in
/// flight, so its CQ moderation is 1): a signaled message asks for an ACK
/// at once (AckReq), while most unsignaled ones leave it to the
/// responder's ACK timer, whose later packet and wakeups on both hosts
/// fall within the next round trip (2 B p50 1.3-2x that of signaled
/// messages, docs/ibverbs.md "Benchmark"). The completions of earlier
/// messages, there by the time the answer came, are reaped first without
/// waiting.
fn post_small(res: &Res, wr: SendWr, size: usize, inline: bool, i: u64) -> anyhow::Result<()> {
    reap_sends(res)?;
    let wr = wr.with_flags(send_flags::SIGNALED);
    let off = size.max(8);
    let stamp = i.to_le_bytes();
    let n = size.min(8);
    res.buf.write(off + size - n, &stamp[..n]);
    let wr = if inline {
        // SAFETY: inside our buffer.
        let d = unsafe { std::slice::from_raw_parts(res.buf.as_ptr().add(off), size) };
        wr.with_inline(d)
    } else {
        wr
    };
    loop {
        match res.qp.post_send(&[wr]) {
            Ok(()) => return Ok(()),
            Err(_) => {
                reap_sends(res)?;
                std::thread::yield_now();
            }
        }
    }
}

/// Takes the send completions that are there, failing on an error one.
fn reap_sends(res: &Res) -> anyhow::Result<()> {
    let mut w = [Wc::default(); 16];
    loop {
        let n = res.scq.poll(&mut w)?;
        if let Some(bad) = w[..n].iter().find(|c| c.status != WcStatus::Success) {
            bail!("send {} failed: {:?}", bad.wr_id, bad.status);
        }
        if n < w.len() {
            return Ok(());
        }
    }
}

/// Spins until the peer's WRITE put stamp `i` at the end of our receive
/// half, as ib_write_lat spins on its buffer's last byte. A WRITE raises no
/// completion at its target, so there is nothing to sleep on: `Events` only
/// yields between looks.
fn wait_stamp(buf: &MemBuf, size: usize, i: u64, wait: LatWait) -> anyhow::Result<()> {
    let n = size.min(8);
    let want = &i.to_le_bytes()[..n];
    let t0 = Instant::now();
    let mut got = [0u8; 8];
    loop {
        for (k, b) in got[..n].iter_mut().enumerate() {
            // SAFETY: inside the buffer; volatile because the NIC writes it.
            *b = unsafe { std::ptr::read_volatile(buf.as_ptr().add(size - n + k)) };
        }
        if &got[..n] == want {
            return Ok(());
        }
        if t0.elapsed() > Duration::from_secs(10) {
            bail!("peer stopped answering");
        }
        match wait {
            LatWait::Busy => std::hint::spin_loop(),
            LatWait::Events { .. } => std::thread::yield_now(),
        }
    }
}

fn fill_lat(rep: &mut Report, samples: &mut [f64]) {
    samples.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let pick = |q: f64| samples[((samples.len() as f64 - 1.0) * q).round() as usize];
    rep.lat_p50_us = Some(pick(0.5));
    rep.lat_p99_us = Some(pick(0.99));
    rep.lat_avg_us = Some(samples.iter().sum::<f64>() / samples.len() as f64);
}

/// The passive side: keeps receives posted or answers ping-pongs until "done".
fn serve(test: &str, res: &Res, h: &Hello, wait: LatWait, r: &mut BufReader<TcpStream>) -> anyhow::Result<()> {
    let size = h.size;
    let mut wcs = [Wc::default(); 64];
    r.get_ref().set_nonblocking(true)?;
    let done = |r: &mut BufReader<TcpStream>| -> bool {
        let mut l = String::new();
        match r.read_line(&mut l) {
            Ok(0) => true,
            Ok(_) => l.contains("done"),
            Err(_) => false,
        }
    };
    let recv_sg = [res.mr.sge(0, size.max(8))];
    let sg = [res.mr.sge(size.max(8), size)];
    match test {
        "write_bw" | "read_bw" => {
            while !done(r) {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        "send_bw" => {
            let depth = h.rx_depth.max(32) as u64;
            for k in 0..depth {
                res.qp.post_recv(&[RecvWr { wr_id: k, sg_list: &recv_sg }])?;
            }
            let mut k = 0u64;
            loop {
                let n = poll_some(&res.rcq, &mut wcs)?;
                for w in &wcs[..n] {
                    res.qp.post_recv(&[RecvWr { wr_id: w.wr_id, sg_list: &recv_sg }])?;
                }
                k += 1;
                if n == 0 && k.is_multiple_of(64) && done(r) {
                    break;
                }
            }
        }
        "send_lat" => {
            for k in 0..16 {
                res.qp.post_recv(&[RecvWr { wr_id: k, sg_list: &recv_sg }])?;
            }
            let inline = size <= 256;
            let mut i = 0u64;
            loop {
                let n = wait_recv(res, &mut wcs, wait, Duration::from_millis(20))?;
                if n == 1 {
                    i += 1;
                    res.qp.post_recv(&[RecvWr { wr_id: i, sg_list: &recv_sg }])?;
                    post_small(res, SendWr::send(i, &sg), size, inline, i)?;
                } else if (i == 0 || i as usize >= h.iters) && done(r) {
                    break;
                }
            }
        }
        "write_lat" => {
            let inline = size <= 256;
            for i in 1..=h.iters as u64 {
                wait_stamp(&res.buf, size, i, wait)?;
                post_small(res, SendWr::write(i, &sg, h.addr, h.rkey), size, inline, i)?;
            }
            while !done(r) {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        _ => bail!("unknown test {test}"),
    }
    r.get_ref().set_nonblocking(false)?;
    let _ = send_line(&mut r.get_ref().try_clone()?, &"bye");
    Ok(())
}

/// UDP ping-pong between the same hosts: the latency baseline.
fn udp_lat(a: PerfArgs) -> anyhow::Result<()> {
    let size = a.size.unwrap_or(2).max(1);
    let mut buf = vec![0u8; 65536];
    match &a.peer {
        None => {
            let s = UdpSocket::bind(("0.0.0.0", a.port))?;
            s.set_read_timeout(Some(Duration::from_secs(30)))?;
            loop {
                let (n, from) = match s.recv_from(&mut buf) {
                    Ok(x) => x,
                    Err(_) => return Ok(()),
                };
                if &buf[..n] == b"done" {
                    return Ok(());
                }
                s.send_to(&buf[..n], from)?;
            }
        }
        Some(peer) => {
            let s = UdpSocket::bind("0.0.0.0:0")?;
            s.connect((peer.as_str(), a.port))?;
            s.set_read_timeout(Some(Duration::from_millis(200)))?;
            let msg = vec![7u8; size];
            let cpu0 = cpu_seconds();
            let mut samples = Vec::with_capacity(a.iters);
            let t_all = Instant::now();
            let mut i = 0;
            while samples.len() < a.iters {
                let t0 = Instant::now();
                s.send(&msg)?;
                match s.recv(&mut buf) {
                    Ok(_) => samples.push(t0.elapsed().as_secs_f64() * 1e6 / 2.0),
                    Err(_) => {
                        i += 1;
                        if i > 50 {
                            bail!("no UDP echo from {peer}:{}", a.port);
                        }
                    }
                }
            }
            for _ in 0..3 {
                let _ = s.send(b"done");
            }
            let mut rep = Report { test: "udp_lat".into(), size, iters: a.iters as u64, ..Default::default() };
            rep.seconds = t_all.elapsed().as_secs_f64();
            fill_lat(&mut rep, &mut samples);
            rep.cpu_s = cpu_seconds() - cpu0;
            print_report(&rep, a.json);
            Ok(())
        }
    }
}
