//! The rnicd process: owns UDP port 4791 of one address, serves local
//! clients on a unix SOCK_SEQPACKET socket, and runs the engine in a single
//! event loop (no locks on the data path).

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use nix::sched::sched_yield;
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags};
use nix::sys::signal::{signal, SigHandler, Signal};
use nix::sys::socket::{
    accept4, bind, getsockname, listen, setsockopt, socket, sockopt, AddressFamily, Backlog, SockFlag, SockType, SockaddrIn, UnixAddr,
};
use tracing::{info, warn};

use crate::doorbell::DoorbellPage;
use crate::engine::Engine;
use crate::eventfd;
use crate::objects::{ClientId, OutPkt};
use crate::proto::{self, Reply, Request, Response};
use crate::wire::{self, Flow, ROCE_PORT};

mod descriptors;
mod spin;

pub use descriptors::DEFAULT_MAX_CHANNELS_PER_CLIENT;
use descriptors::{CLIENT_RESERVE, OBJECT_RESERVE};

/// Most datagrams one receive pass takes (then the engine transmits).
const RX_BATCH: usize = 64;
/// Datagrams per recvmmsg: with GRO each holds up to 64 KiB, and 8 of them
/// (512 KiB) stay in the L2 cache between the kernel's copy and the ICRC
/// check and placement that read them again.
const RX_CHUNK: usize = 8;
const RX_BUF: usize = 65536;
const TX_BUDGET: usize = 256;
/// Packet work between looks at the control side within a round
/// (`ControlWatch`).
const CONTROL_LOOK: Duration = Duration::from_micros(100);
/// Longest the event loop keeps polling after the last activity (the
/// spin adapts below it: `spin::Spin`).
const SPIN: Duration = Duration::from_micros(200);
/// The longest wait a spin is worth (`spin::Spin`): about twice what a
/// sleep in epoll and a wake-up cost here in latency and CPU together
/// (docs/rnic.md, "Process model").
const SPIN_WORTH: Duration = Duration::from_micros(50);
/// Longest sleep in epoll without a timer due (a stop request is seen
/// this late at most).
const IDLE_WAIT: Duration = Duration::from_millis(100);
/// Timer slack of the event loop's thread: its sleeps until a QP timer
/// end within this of the deadline (the default slack is 50 µs).
const TIMER_SLACK_NS: libc::c_ulong = 1000;
const SOL_UDP: i32 = 17;
const UDP_SEGMENT: i32 = 103;
const UDP_GRO: i32 = 104;
/// Most segments of one UDP GSO send (and 64 KiB in all); segment j is
/// sealed for IP id j.
const GSO_MAX_SEGS: usize = 60;
const TOKEN_LISTEN: u64 = 1;
/// The control epoll (listener, client sockets, doorbells) inside the main one.
const TOKEN_CTL: u64 = 1 << 61;
/// While polling, epoll_wait runs every this many rounds; the UDP sockets
/// of up to DIRECT_RX_MAX_NS namespaces are read directly in the others.
const EPOLL_EVERY: u32 = 8;
const DIRECT_RX_MAX_NS: usize = 4;

/// Default control socket of the rnicd serving `addr`.
pub fn default_socket_path(addr: Ipv4Addr) -> PathBuf {
    PathBuf::from(format!("/run/transit/rnicd-{addr}.sock"))
}

/// First non-loopback IPv4 address of this network namespace.
pub fn first_local_ipv4() -> Option<Ipv4Addr> {
    let addrs = nix::ifaddrs::getifaddrs().ok()?;
    let mut lo = None;
    for a in addrs {
        let Some(sin) = a.address.as_ref().and_then(|s| s.as_sockaddr_in().map(|x| x.ip())) else { continue };
        if sin.is_loopback() {
            lo.get_or_insert(sin);
        } else {
            return Some(sin);
        }
    }
    lo
}

/// IP_MTU_DISCOVER, which nix has no option for.
fn set_mtu_discover(fd: &OwnedFd, mode: i32) -> std::io::Result<()> {
    // SAFETY: setsockopt with an int option on a valid socket.
    let r =
        unsafe { libc::setsockopt(fd.as_raw_fd(), libc::IPPROTO_IP, libc::IP_MTU_DISCOVER, &mode as *const i32 as *const libc::c_void, 4) };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn sockaddr(ip: Ipv4Addr, port: u16) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr { s_addr: u32::from(ip).to_be() },
        sin_zero: [0; 8],
    }
}

/// A UDP socket bound to `ip:port`; `df` selects DF with IP id 0 (so the
/// ICRC's pseudo header matches the wire) or kernel fragmentation.
fn udp_socket(ip: Ipv4Addr, port: u16, df: bool, reuse: bool) -> anyhow::Result<OwnedFd> {
    let fd = socket(AddressFamily::Inet, SockType::Datagram, SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK, None).context("socket")?;
    if reuse {
        setsockopt(&fd, sockopt::ReuseAddr, &true)?;
        setsockopt(&fd, sockopt::ReusePort, &true)?;
    }
    // A namespace may be created (suspended) before its address moves here.
    setsockopt(&fd, sockopt::IpFreebind, &true)?;
    set_mtu_discover(&fd, if df { libc::IP_PMTUDISC_PROBE } else { libc::IP_PMTUDISC_DONT })?;
    // Forcing needs CAP_NET_ADMIN; without it, as much as the limits allow.
    if setsockopt(&fd, sockopt::RcvBufForce, &SOCKET_BUF).is_err() {
        let _ = setsockopt(&fd, sockopt::RcvBuf, &SOCKET_BUF);
    }
    if setsockopt(&fd, sockopt::SndBufForce, &SOCKET_BUF).is_err() {
        let _ = setsockopt(&fd, sockopt::SndBuf, &SOCKET_BUF);
    }
    bind(fd.as_raw_fd(), &SockaddrIn::from(SocketAddrV4::new(ip, port))).with_context(|| format!("bind udp {ip}:{port}"))?;
    Ok(fd)
}

/// After the local qdisc refused a send (ENOBUFS), try again this much later
/// (at 100 Mbit/s the queue sends about 6 KB meanwhile).
const REFUSED_RETRY: Duration = Duration::from_micros(500);
/// Packets refused for this long are dropped: the transport resends them.
const HELD_MAX: Duration = Duration::from_millis(100);

/// Socket buffers of the UDP sockets (bytes).
const SOCKET_BUF: usize = 16 << 20;

struct Client {
    sock: OwnedFd,
    doorbell: Option<OwnedFd>,
    /// Which QPs rang (`crate::doorbell`); without it a doorbell looks at
    /// every QP of the client.
    doorbell_page: Option<DoorbellPage>,
    /// The namespace (GID) the client works in, set by its Hello.
    ns: Ipv4Addr,
}

/// One RDMA namespace: its engine (objects keyed by QPN/key inside it), its
/// own UDP socket on the namespace's GID and its own send sockets, so that
/// packets of two namespaces never meet.
struct Namespace {
    engine: Engine,
    udp: OwnedFd,
    senders: Senders,
    /// Packets the local qdisc refused (ENOBUFS), and what the engine made
    /// since, in order: they go first once `retry_at` passes.
    held: Vec<OutPkt>,
    /// When the first of `held` was refused, and when to try again.
    held_since: Instant,
    retry_at: Instant,
    /// Its owner claimed the GID here (rnicd added the address): it is
    /// released when the namespace closes, so a host whose VM went away
    /// (or died) stops answering for it.
    claimed: bool,
    /// Peers whose neighbour entry `prepare_ahead` made: a QP built ahead
    /// names its peer when made and again when its state is loaded (at
    /// the switch, where a netlink round trip per peer is downtime). An
    /// entry once made stays usable (a stale one still sends while it is
    /// confirmed again).
    warmed: std::collections::HashSet<Ipv4Addr>,
}

/// Epoll tokens of namespace UDP sockets: this bit plus the GID.
const TOKEN_NS: u64 = 1 << 62;
/// Most namespaces one rnicd serves (each holds sockets and tables).
const MAX_NAMESPACES: usize = 1024;

impl Namespace {
    /// The namespace goes with its last client. Its sockets close now (a
    /// namespace for the same GID, a VM that comes back, binds the same
    /// ports); the engine, with every ring and memory region it maps, goes
    /// off the event loop.
    fn close(self) {
        let Namespace { engine, udp, senders, .. } = self;
        drop((udp, senders));
        release_off_loop(engine);
    }

    fn open(gid: Ipv4Addr, gso: bool) -> anyhow::Result<Namespace> {
        let udp =
            udp_socket(gid, ROCE_PORT, true, false).with_context(|| format!("UDP {gid}:{ROCE_PORT} (is another rnicd serving it?)"))?;
        if gso {
            setsockopt(&udp, sockopt::UdpGroSegment, &true).context("UDP_GRO")?;
        }
        // Each datagram's arrival time, for round trips that leave out how
        // late rnicd got to it (`recv_chunk`).
        setsockopt(&udp, sockopt::ReceiveTimestampns, &true).context("SO_TIMESTAMPNS")?;
        let senders = Senders::new(gid, gso)?;
        let mut engine = Engine::new(gid);
        engine.set_active_mtu(crate::link::path_mtu_from(gid));
        engine.tx.in_place = std::env::var("RNICD_IN_PLACE_TX").map_or(true, |v| v != "0");
        let now = Instant::now();
        Ok(Namespace { engine, udp, senders, held: Vec::new(), held_since: now, retry_at: now, claimed: false, warmed: Default::default() })
    }

    /// Receives and transmits; returns (packets received, packets sent, more work pending).
    /// Ends early, after a transmit, once `control` sees a control event waiting.
    fn pump(&mut self, udp_ready: bool, rxbufs: &mut [Vec<u8>], control: &mut ControlWatch) -> (usize, usize, bool) {
        let (mut got, mut sent, mut more) = (0, 0, false);
        for _ in 0..4 {
            let k = if udp_ready { recv_batch(&self.udp, rxbufs, &mut self.engine, control) } else { 0 };
            got += k;
            if k > 0 {
                // Coalesced ACKs of streams go with this batch's transmit.
                self.engine.end_of_receive_pass(Instant::now());
            }
            // Transmit after every receive batch: the ACKs (and READ
            // responses) it produced leave at once, so the peer's window
            // keeps moving while we are still receiving.
            let (s, m) = self.transmit();
            sent += s;
            more = m;
            if k < RX_BATCH || control.waiting {
                break;
            }
        }
        (got, sent, more)
    }

    /// Runs timers and sends what the engine has to send; returns (packets
    /// sent, more work pending).
    ///
    /// While the qdisc holds refused packets, the engine makes no new ones
    /// (its timers still run): they would only queue behind the held ones,
    /// unbounded. The loop sleeps until `retry_at` (see `next_deadline`).
    fn transmit(&mut self) -> (usize, bool) {
        let now = Instant::now();
        let holding = !self.held.is_empty();
        let more = self.engine.poll_tx(if holding { 0 } else { TX_BUDGET }, now) && !holding;
        self.purge_rewound();
        let mut pkts = std::mem::take(&mut self.engine.tx.pkts);
        let had_held = !self.held.is_empty();
        if had_held {
            let mut new = std::mem::replace(&mut pkts, std::mem::take(&mut self.held));
            pkts.append(&mut new);
            if now < self.retry_at {
                self.held = pkts;
                return (0, false);
            }
        }
        if pkts.is_empty() {
            return (0, more);
        }
        let sent = self.senders.send(&mut pkts, &mut self.engine.stats.send_errors);
        self.engine.stats.tx_packets += sent as u64;
        let mut rest = pkts.split_off(sent);
        if let Some(p) = rest.first() {
            // The qdisc's queue is full: the flow's windows shrink, and the
            // packets wait for it to drain (they are not lost, so nothing is
            // resent), unless it stays full so long that resending is better.
            self.engine.local_congestion(p.sport, p.dst);
            if sent > 0 || !had_held {
                self.held_since = now;
            }
            if now.duration_since(self.held_since) > HELD_MAX {
                self.engine.stats.send_errors += rest.len() as u64;
                pkts.append(&mut rest);
            } else {
                self.held = rest;
                self.retry_at = now + REFUSED_RETRY;
            }
        }
        for p in pkts {
            self.engine.tx.recycle(p);
        }
        (sent, more && self.held.is_empty())
    }

    /// A QP that went back N (timer, loss probe, NAK) sends its unacked
    /// requests again: its held copies of them would be duplicates behind
    /// the originals, so they go.
    fn purge_rewound(&mut self) {
        let rewound = std::mem::take(&mut self.engine.tx.rewound);
        if rewound.is_empty() || self.held.is_empty() {
            return;
        }
        let (keep, drop): (Vec<OutPkt>, Vec<OutPkt>) = std::mem::take(&mut self.held)
            .into_iter()
            .partition(|p| !rc_request_to(p.head()).is_some_and(|qpn| rewound.contains(&(p.dst, qpn))));
        self.held = keep;
        for p in drop {
            self.engine.tx.recycle(p);
        }
    }

    /// Opens the send sockets of the flows the engine made ready to resume
    /// (`engine::FlowAhead`) and warms the neighbour entries of their
    /// peers not warmed yet (`host`: rnicd's own address, whose link they
    /// are on).
    fn prepare_ahead(&mut self, host: Ipv4Addr) {
        if self.engine.ahead.is_empty() {
            return;
        }
        let mut peers = std::collections::HashSet::new();
        for f in std::mem::take(&mut self.engine.ahead) {
            self.senders.get(f.sport, false);
            peers.extend(f.peer.filter(|p| !self.warmed.contains(p)));
        }
        for peer in peers {
            match crate::neighbour::warm(host, peer) {
                Ok(_) => {
                    self.warmed.insert(peer);
                }
                Err(e) => warn!("{}: {e:#}", self.engine.gid),
            }
        }
    }

    /// When packets the qdisc refused are tried again, if any are held.
    fn retry_deadline(&self) -> Option<Instant> {
        (!self.held.is_empty()).then_some(self.retry_at)
    }
}

pub struct Config {
    pub addr: Ipv4Addr,
    pub sock: PathBuf,
    /// Batch equal-sized packets into UDP GSO sends (and accept GRO on
    /// receive): much cheaper per packet. The kernel gives segment k of a
    /// batch IP id k and each segment's ICRC is computed for that id, so the
    /// packets are valid RoCEv2 on the wire.
    pub gso: bool,
    /// Most completion channels one client may hold.
    pub max_channels_per_client: usize,
}

/// Link MTU assumed when the address is not on any interface yet.
const DEFAULT_LINK_MTU: usize = 1500;

/// The sockets that send from QPN-derived source ports.
struct Senders {
    addr: Ipv4Addr,
    gso: bool,
    /// Packets whose IP datagram fits go with DF (and GSO); larger ones are
    /// IP-fragmented. From the interface that holds `addr`: jumbo links
    /// carry 4096-byte path MTU packets whole, as on real RoCE fabrics.
    link_mtu: usize,
    /// Whether `link_mtu` came from an interface (else it is retried now and then).
    mtu_known: bool,
    mtu_checked: Instant,
    /// A DF send failed with EMSGSIZE: the link (or route) shrank.
    too_big: bool,
    /// A GSO send failed with EINVAL, which is also what a segment larger
    /// than the link gets: look whether the interface shrank.
    maybe_too_big: bool,
    socks: HashMap<(u16, bool), SendSock>,
    fallback_df: (OwnedFd, u16),
    fallback_frag: (OwnedFd, u16),
}

/// Where packets of one source port leave.
enum SendSock {
    Own(OwnedFd),
    /// The port is taken by another socket of this host (any program may
    /// bind an ephemeral port in 0xc000..): the packets leave from a
    /// fallback socket's port, and their ICRC must be computed for it.
    Fallback,
}

/// The local port a socket is bound to.
fn bound_port(fd: &OwnedFd) -> anyhow::Result<u16> {
    Ok(getsockname::<SockaddrIn>(fd.as_raw_fd()).context("getsockname")?.port())
}

/// The destination QPN of an RC request packet (a UDP payload starting at
/// its BTH); None for responses, other transports and short packets.
fn rc_request_to(pkt: &[u8]) -> Option<u32> {
    let op = wire::Opcode::from_u8(*pkt.first()?)?;
    let qpn = pkt.get(5..8)?;
    (op as u8 >> 5 == 0 && op.is_request()).then(|| u32::from_be_bytes([0, qpn[0], qpn[1], qpn[2]]))
}

/// Segment j of a GSO batch leaves with IP id j: its ICRC is sealed for
/// that id. Applied twice it undoes itself (an XOR), for a batch not sent.
fn seal_for_ip_ids(batch: &mut [OutPkt]) {
    for (j, p) in batch.iter_mut().enumerate().skip(1) {
        let delta = wire::ip_id_delta(p.len - 4, j as u16);
        for (b, d) in p.icrc_mut().iter_mut().zip(delta.to_le_bytes()) {
            *b ^= d;
        }
    }
}

/// A sending socket reports a packet its host's qdisc drops: with
/// IP_RECVERR, sendmsg returns ENOBUFS instead of success (Linux's
/// udp_send_skb hides it otherwise), so a full queue is seen at once, not
/// a round trip later as a sequence NAK. ICMP errors then queue on the
/// socket's error queue, which nothing reads; a small receive buffer
/// (nothing else arrives on a sending socket) bounds it.
fn report_local_drops(fd: &OwnedFd) -> anyhow::Result<()> {
    setsockopt(fd, sockopt::Ipv4RecvErr, &true).context("IP_RECVERR")?;
    setsockopt(fd, sockopt::RcvBuf, &4096).context("SO_RCVBUF")?;
    Ok(())
}

impl Senders {
    fn new(addr: Ipv4Addr, gso: bool) -> anyhow::Result<Senders> {
        let df = udp_socket(addr, 0, true, false)?;
        let frag = udp_socket(addr, 0, false, false)?;
        report_local_drops(&df)?;
        report_local_drops(&frag)?;
        let (pdf, pfrag) = (bound_port(&df)?, bound_port(&frag)?);
        let mtu = crate::link::interface_mtu(addr);
        info!("{addr}: link MTU {}", mtu.map_or("unknown, assuming 1500".into(), |m| m.to_string()));
        Ok(Senders {
            addr,
            gso,
            link_mtu: mtu.unwrap_or(DEFAULT_LINK_MTU),
            mtu_known: mtu.is_some(),
            mtu_checked: Instant::now(),
            too_big: false,
            maybe_too_big: false,
            socks: HashMap::new(),
            fallback_df: (df, pdf),
            fallback_frag: (frag, pfrag),
        })
    }

    /// The socket for packets built with source port `sport`, and the port
    /// they actually leave from.
    fn get(&mut self, sport: u16, big: bool) -> (RawFd, u16) {
        let s = self.socks.entry((sport, big)).or_insert_with(|| {
            match udp_socket(self.addr, sport, !big, true).and_then(|s| {
                report_local_drops(&s)?;
                Ok(s)
            }) {
                // Below the reserve the port's packets share a fallback
                // socket: the descriptors left are for clients' requests.
                Ok(s) if descriptors::short(s.as_raw_fd(), OBJECT_RESERVE * 2) => SendSock::Fallback,
                Ok(s) => SendSock::Own(s),
                Err(e) => {
                    warn!("{}: source port {sport} is taken ({e:#}); its packets leave from a fallback port", self.addr);
                    SendSock::Fallback
                }
            }
        });
        match s {
            SendSock::Own(fd) => (fd.as_raw_fd(), sport),
            SendSock::Fallback if big => (self.fallback_frag.0.as_raw_fd(), self.fallback_frag.1),
            SendSock::Fallback => (self.fallback_df.0.as_raw_fd(), self.fallback_df.1),
        }
    }

    /// Sends the batch with one sendmmsg per run of packets sharing a socket;
    /// with GSO, runs of equal-sized packets to one peer become one message.
    /// Returns how many packets went (or were dropped as unsendable) before
    /// the local qdisc refused one; that one and the rest were not sent.
    fn send(&mut self, pkts: &mut [OutPkt], errors: &mut u64) -> usize {
        self.refresh_mtu();
        let mut i = 0;
        while i < pkts.len() {
            let key = (pkts[i].sport, self.is_big(&pkts[i]));
            let mut j = i + 1;
            while j < pkts.len() && (pkts[j].sport, self.is_big(&pkts[j])) == key && j - i < 256 {
                j += 1;
            }
            let (fd, port) = self.get(key.0, key.1);
            if port != key.0 {
                // The ICRC covers the UDP source port: seal for the real one.
                for p in &mut pkts[i..j] {
                    p.gather_in_place();
                    let flow = Flow { src: self.addr, dst: p.dst, sport: port, dport: ROCE_PORT };
                    wire::reseal(&flow, &mut p.buf[..p.len]);
                }
            }
            let done = self.send_run(fd, &mut pkts[i..j], key.1, errors);
            if done < j - i {
                return i + done;
            }
            i = j;
        }
        pkts.len()
    }

    /// The address may reach an interface after we started (a namespace
    /// opened before its address moved here): look again once a second.
    /// A DF send refused as too big means the link or route shrank: take
    /// the interface's new MTU, or 1500 (or less) if it did not change; the
    /// transport resends the dropped packets, now fragmented.
    fn refresh_mtu(&mut self) {
        if self.too_big {
            self.too_big = false;
            let old = self.link_mtu;
            self.link_mtu = match crate::link::interface_mtu(self.addr) {
                Some(m) if m < old => m,
                _ if DEFAULT_LINK_MTU < old => DEFAULT_LINK_MTU,
                _ => 576,
            };
            self.mtu_known = true;
            warn!("{}: a packet was too big for the link; MTU {old} -> {}", self.addr, self.link_mtu);
        } else if std::mem::take(&mut self.maybe_too_big) {
            if let Some(m) = crate::link::interface_mtu(self.addr).filter(|m| *m < self.link_mtu) {
                warn!("{}: the link shrank; MTU {} -> {m}", self.addr, self.link_mtu);
                self.link_mtu = m;
            }
        } else if !self.mtu_known && self.mtu_checked.elapsed() > Duration::from_secs(1) {
            self.mtu_checked = Instant::now();
            if let Some(m) = crate::link::interface_mtu(self.addr) {
                info!("{}: link MTU {m}", self.addr);
                (self.link_mtu, self.mtu_known) = (m, true);
            }
        }
    }

    /// Whether the packet's IP datagram is larger than the link (it is then fragmented).
    fn is_big(&self, p: &OutPkt) -> bool {
        p.len + 28 > self.link_mtu
    }

    /// Sends one run; returns how many of its packets went before the
    /// local qdisc refused one (ENOBUFS), all if none was.
    fn send_run(&mut self, fd: RawFd, run: &mut [OutPkt], big: bool, errors: &mut u64) -> usize {
        // Group into messages: [start, end) ranges of the run.
        let mut groups: Vec<(usize, usize)> = Vec::with_capacity(run.len());
        let mut k = 0;
        while k < run.len() {
            let mut e = k + 1;
            if self.gso && !big {
                let mut total = run[k].len;
                while e < run.len()
                    && e - k < GSO_MAX_SEGS
                    && run[e].len == run[k].len
                    && run[e].dst == run[k].dst
                    && total + run[e].len < 65000
                {
                    total += run[e].len;
                    e += 1;
                }
            }
            seal_for_ip_ids(&mut run[k..e]);
            groups.push((k, e));
            k = e;
        }
        let addrs: Vec<libc::sockaddr_in> = groups.iter().map(|g| sockaddr(run[g.0].dst, ROCE_PORT)).collect();
        // Each packet is one iovec, or three with its payload in place;
        // a message's iovecs are consecutive.
        let mut iovs: Vec<libc::iovec> = Vec::with_capacity(run.len() * 3);
        let mut first_iov = Vec::with_capacity(groups.len() + 1);
        for &(a, b) in &groups {
            first_iov.push(iovs.len());
            for p in &run[a..b] {
                p.push_iovecs(&mut iovs);
            }
        }
        first_iov.push(iovs.len());
        let mut cbufs: Vec<[u64; 4]> = vec![[0u64; 4]; groups.len()];
        let mut hdrs: Vec<libc::mmsghdr> = Vec::with_capacity(groups.len());
        for (gi, &(a, b)) in groups.iter().enumerate() {
            // SAFETY: zeroed msghdr is valid; pointers set below outlive the call.
            let mut h: libc::mmsghdr = unsafe { std::mem::zeroed() };
            h.msg_hdr.msg_name = &addrs[gi] as *const _ as *mut libc::c_void;
            h.msg_hdr.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as u32;
            h.msg_hdr.msg_iov = &mut iovs[first_iov[gi]] as *mut libc::iovec;
            h.msg_hdr.msg_iovlen = first_iov[gi + 1] - first_iov[gi];
            if b - a > 1 {
                let cb = cbufs[gi].as_mut_ptr() as *mut u8;
                // SAFETY: the control buffer has room for one cmsg with a u16.
                unsafe {
                    h.msg_hdr.msg_control = cb as *mut libc::c_void;
                    h.msg_hdr.msg_controllen = libc::CMSG_SPACE(2) as usize;
                    let c = libc::CMSG_FIRSTHDR(&h.msg_hdr);
                    (*c).cmsg_level = SOL_UDP;
                    (*c).cmsg_type = UDP_SEGMENT;
                    (*c).cmsg_len = libc::CMSG_LEN(2) as usize;
                    std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut u16, run[a].len as u16);
                }
            }
            hdrs.push(h);
        }
        let mut off = 0;
        let mut retried = false;
        while off < hdrs.len() {
            // SAFETY: hdrs[off..] are valid mmsghdrs.
            let n = unsafe { libc::sendmmsg(fd, hdrs[off..].as_mut_ptr(), (hdrs.len() - off) as u32, 0) };
            if n <= 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::WouldBlock {
                    // Socket buffer full: wait briefly; the transport retransmits anyway.
                    let mut pfd = libc::pollfd { fd, events: libc::POLLOUT, revents: 0 };
                    // SAFETY: one pollfd.
                    unsafe { libc::poll(&mut pfd, 1, 5) };
                    continue;
                }
                match e.raw_os_error() {
                    // The qdisc's queue is full (reported with IP_RECVERR):
                    // the caller keeps this message and the rest. Unseal
                    // them, as they may be grouped otherwise next time.
                    Some(libc::ENOBUFS) => {
                        for &(a, b) in &groups[off..] {
                            seal_for_ip_ids(&mut run[a..b]);
                        }
                        return groups[off].0;
                    }
                    // An ICMP error of an earlier packet (IP_RECVERR reports
                    // them on the next send): this message was not tried.
                    Some(libc::ECONNREFUSED | libc::EHOSTUNREACH | libc::ENETUNREACH | libc::EHOSTDOWN) if !retried => {
                        retried = true;
                        continue;
                    }
                    // Either this message is larger than the route, or an
                    // earlier DF packet's "fragmentation needed" comes back
                    // now, on a message of any size that was then not
                    // tried: try once more before dropping it. Both say the
                    // path shrank.
                    Some(libc::EMSGSIZE) if !retried => {
                        self.too_big |= !big;
                        retried = true;
                        continue;
                    }
                    Some(libc::EMSGSIZE) if !big => self.too_big = true,
                    Some(libc::EINVAL) if !big => self.maybe_too_big = true,
                    _ => {}
                }
                // Unreachable peer, message too long...: drop it, count it.
                *errors += 1;
                off += 1;
                retried = false;
                continue;
            }
            off += n as usize;
            retried = false;
        }
        run.len()
    }
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

fn bind_control(path: &Path) -> anyhow::Result<OwnedFd> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    }
    // Bind under a temporary name then rename: the path appears only when ready.
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let fd =
        socket(AddressFamily::Unix, SockType::SeqPacket, SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK, None).context("unix socket")?;
    bind(fd.as_raw_fd(), &UnixAddr::new(&tmp)?).with_context(|| format!("bind {}", tmp.display()))?;
    listen(&fd, Backlog::new(128)?).context("listen")?;
    std::fs::rename(&tmp, path).with_context(|| format!("rename to {}", path.display()))?;
    Ok(fd)
}

/// Knobs of the event loop, from the environment (A/B experiments).
struct LoopKnobs {
    /// RNICD_RING_POLL=0: clients always ring the doorbell.
    ring_poll: bool,
    /// RNICD_DIRECT_RX=0: epoll every round while polling.
    direct_rx: bool,
    /// RNICD_LEAN_LOOP=0: loop again at once after any packet.
    lean_loop: bool,
    /// RNICD_CONTROL_FIRST=0: look at the control side only with the
    /// UDP sockets (every EPOLL_EVERY-th round while polling), to measure
    /// what serving it every round gains.
    control_first: bool,
    /// RNICD_CONTROL_LOOK_US: how much packet work (µs) a round does
    /// between looks at the control side (`ControlWatch`); 0: it looks
    /// only between rounds, for A/B runs.
    control_look: Duration,
    /// RNICD_SPIN_US: the longest the loop keeps polling after the last
    /// activity (the spin adapts below it).
    /// 0 by default under a real-time policy (`--sched-fifo`): a spinning
    /// real-time loop would keep ordinary processes (its clients, the peer)
    /// off its CPU, where sleeping costs nothing since its wake-up preempts.
    spin: Duration,
    /// RNICD_SPIN_WORTH_US: the longest wait a spin is worth; a spin that
    /// finds work later, or a wake-up later than that, shrinks the spin
    /// (RNICD_SPIN_WORTH_US=RNICD_SPIN_US: shrink only on wake-ups after
    /// the ceiling).
    spin_worth: Duration,
}

impl LoopKnobs {
    fn from_env() -> LoopKnobs {
        let on = |name: &str| std::env::var(name).map_or(true, |v| v != "0");
        // A duration in whole microseconds; unset or unparsable: the default.
        let micros = |name: &str| std::env::var(name).ok().and_then(|v| v.parse().ok()).map(Duration::from_micros);
        LoopKnobs {
            ring_poll: on("RNICD_RING_POLL"),
            direct_rx: on("RNICD_DIRECT_RX"),
            lean_loop: on("RNICD_LEAN_LOOP"),
            control_first: on("RNICD_CONTROL_FIRST"),
            control_look: micros("RNICD_CONTROL_LOOK_US").unwrap_or(CONTROL_LOOK),
            spin: micros("RNICD_SPIN_US").unwrap_or(if crate::loop_priority::realtime(0) { Duration::ZERO } else { SPIN }),
            spin_worth: micros("RNICD_SPIN_WORTH_US").unwrap_or(SPIN_WORTH),
        }
    }
}

/// The running daemon: its namespaces, clients, sockets and loop state.
struct Daemon {
    cfg: Config,
    knobs: LoopKnobs,
    nss: HashMap<Ipv4Addr, Namespace>,
    listener: OwnedFd,
    /// UDP sockets of the namespaces, and `ctl`.
    ep: Epoll,
    /// The control side alone: the listener, client sockets and doorbells.
    /// It is looked at every round, also in the rounds that skip `ep` to
    /// read UDP sockets directly, so a control request waits for at most
    /// one round of packet work, not EPOLL_EVERY of them.
    ctl: Epoll,
    /// Events of `ctl` when `ep` reported it.
    ctl_evs: Vec<EpollEvent>,
    clients: HashMap<ClientId, Client>,
    next_client: ClientId,
    /// The vmms it serves as a RAM client (`ramclient`).
    ram_clients: Arc<crate::ramclient::RamClients>,
    rxbufs: Vec<Vec<u8>>,
    ctlbuf: Vec<u8>,
    /// More to send, or a full receive batch: loop again at once.
    busy: bool,
    /// Whether clients were told that rnicd polls their rings.
    rings_polled: bool,
    rounds_without_epoll: u32,
    last_activity: Instant,
    spin: spin::Spin,
    sleeps: Sleeps,
}

/// How often the event loop slept in epoll, and how many of those sleeps
/// work ended (a packet, a doorbell, a control request) rather than a
/// timer: against the packets received, the wake-ups a packet costs.
/// In the stats as `loop_sleeps` and `loop_woken_by_work`, counted over
/// rnicd's life and all its namespaces.
#[derive(Debug, Clone, Copy, Default)]
struct Sleeps {
    sleeps: u64,
    woken_by_work: u64,
}

/// What one round found to do.
struct Round {
    /// This round reads UDP sockets directly instead of asking epoll.
    direct_rx: bool,
    /// Events epoll returned.
    events: usize,
    /// This round is a spin's: the activity it waits after.
    spin_since: Option<Instant>,
}

/// Runs rnicd until SIGINT/SIGTERM or `stop` is set.
pub fn run(cfg: Config, stop: Option<Arc<AtomicBool>>) -> anyhow::Result<()> {
    if stop.is_none() {
        // SAFETY: the handler only stores to an atomic.
        unsafe {
            signal(Signal::SIGINT, SigHandler::Handler(on_signal))?;
            signal(Signal::SIGTERM, SigHandler::Handler(on_signal))?;
            signal(Signal::SIGPIPE, SigHandler::SigIgn)?;
        }
    }
    // SAFETY: sets the calling thread's timer slack; no pointers.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, TIMER_SLACK_NS) };
    let mut d = Daemon::start(cfg)?;
    let mut evs = vec![EpollEvent::empty(); 64];
    while !(STOP.load(Ordering::Relaxed) || stop.as_ref().is_some_and(|s| s.load(Ordering::Relaxed))) {
        let round = d.wait(&mut evs);
        let udp_ready = d.dispatch(&evs[..round.events]);
        d.pump(&round, &udp_ready);
    }
    let _ = std::fs::remove_file(&d.cfg.sock);
    info!("rnicd stopped; event loop: {}", d.spin.counts.summary());
    Ok(())
}

impl Daemon {
    /// Opens the daemon's own namespace and the control socket.
    fn start(cfg: Config) -> anyhow::Result<Daemon> {
        descriptors::raise_limit();
        let mut nss = HashMap::new();
        let ns = Namespace::open(cfg.addr, cfg.gso)?;
        let listener = bind_control(&cfg.sock)?;
        let ep = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).context("epoll")?;
        let ctl = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).context("epoll")?;
        ep.add(&ns.udp, readable(TOKEN_NS | u64::from(u32::from(cfg.addr))))?;
        ctl.add(&listener, readable(TOKEN_LISTEN))?;
        ep.add(&ctl.0, readable(TOKEN_CTL))?;
        nss.insert(cfg.addr, ns);
        info!("rnicd serving {} (UDP {ROCE_PORT}), control socket {}", cfg.addr, cfg.sock.display());
        let knobs = LoopKnobs::from_env();
        Ok(Daemon {
            cfg,
            spin: spin::Spin::new(knobs.spin, knobs.spin_worth),
            sleeps: Sleeps::default(),
            knobs,
            nss,
            listener,
            ep,
            ctl,
            ctl_evs: vec![EpollEvent::empty(); 64],
            clients: HashMap::new(),
            next_client: 1,
            ram_clients: crate::ramclient::RamClients::new(),
            rxbufs: (0..RX_CHUNK).map(|_| vec![0u8; RX_BUF]).collect(),
            ctlbuf: vec![0u8; fdmsg::MAX_MSG],
            busy: false,
            rings_polled: false,
            rounds_without_epoll: 0,
            last_activity: Instant::now(),
        })
    }

    /// Decides whether this round polls, then waits for events (or not).
    fn wait(&mut self, evs: &mut [EpollEvent]) -> Round {
        // After activity, keep polling (politely) for a short while: the
        // next request of a ping-pong then finds us awake, not asleep in epoll.
        let spinning = !self.busy && self.last_activity.elapsed() < self.spin.limit();
        let spin_since = spinning.then_some(self.last_activity);
        if spinning {
            let _ = sched_yield();
        }
        let polling = self.poll_rings(self.busy || spinning);
        let timeout = if polling {
            Duration::ZERO
        } else {
            // QP timers are slept for to the microsecond (a responder's
            // delayed ACK is due within 100 µs of a request: a timeout in
            // whole milliseconds, rounded down, polled until it passed). A
            // refused packet's retry is rounded up to whole milliseconds.
            let now = Instant::now();
            let timers = self.nss.values().filter_map(|n| n.engine.next_deadline()).min().map(|d| d.saturating_duration_since(now));
            let retries = self
                .nss
                .values()
                .filter_map(|n| n.retry_deadline())
                .min()
                .map(|d| Duration::from_millis(d.saturating_duration_since(now).as_micros().div_ceil(1000).max(1) as u64));
            timers.into_iter().chain(retries).min().unwrap_or(IDLE_WAIT).min(IDLE_WAIT)
        };
        // While we poll, epoll is needed only for control sockets, new
        // clients and doorbells (which clients skip meanwhile): look every
        // EPOLL_EVERY-th round, and in between read the UDP sockets of a few
        // namespaces directly: one syscall per received packet, not two.
        let direct_rx = polling && self.knobs.direct_rx && self.nss.len() <= DIRECT_RX_MAX_NS && self.rounds_without_epoll < EPOLL_EVERY;
        let events = if direct_rx {
            self.rounds_without_epoll += 1;
            // Control first: a request must not wait behind the rounds of
            // packet work until the next look at `ep`.
            if self.knobs.control_first {
                self.ctl.wait(evs, 0u16).unwrap_or(0)
            } else {
                0
            }
        } else {
            self.rounds_without_epoll = 0;
            let n = epoll_wait_for(&self.ep, evs, timeout);
            if !timeout.is_zero() {
                self.sleeps.sleeps += 1;
                if n > 0 {
                    // Slept and woken by work (not a timer): would a longer
                    // spin have caught it?
                    self.spin.woken_after(self.last_activity.elapsed());
                    self.sleeps.woken_by_work += 1;
                }
            }
            n
        };
        if events == 0 && !timeout.is_zero() && self.knobs.ring_poll {
            for ns in self.nss.values_mut() {
                let late = ns.engine.poll_rings() as u64;
                ns.engine.stats.late_ring_wqes += late;
            }
        }
        Round { direct_rx, events, spin_since }
    }

    /// While polling, rnicd reads the QPs' rings itself and clients skip
    /// the doorbell; before sleeping, it says so and looks once more.
    /// Returns whether this round polls.
    fn poll_rings(&mut self, polling: bool) -> bool {
        if !self.knobs.ring_poll {
            return polling;
        }
        if polling != self.rings_polled {
            let found: usize = self.nss.values_mut().map(|ns| ns.engine.set_ring_polling(polling)).sum();
            self.rings_polled = polling;
            if found > 0 {
                self.last_activity = Instant::now();
                return true;
            }
        } else if polling {
            let found: usize = self.nss.values_mut().map(|ns| ns.engine.poll_rings()).sum();
            if found > 0 {
                self.last_activity = Instant::now();
            }
        }
        polling
    }

    /// Handles the events: new clients, doorbells, control messages; returns
    /// the namespaces whose UDP socket is readable.
    fn dispatch(&mut self, evs: &[EpollEvent]) -> Vec<Ipv4Addr> {
        let mut udp_ready = Vec::new();
        for token in evs.iter().map(|e| e.data()) {
            match token {
                t if t & TOKEN_NS != 0 => udp_ready.push(Ipv4Addr::from(t as u32)),
                TOKEN_CTL => {
                    let mut ctl_evs = std::mem::take(&mut self.ctl_evs);
                    let n = self.ctl.wait(&mut ctl_evs, 0u16).unwrap_or(0);
                    for t in ctl_evs[..n].iter().map(|e| e.data()) {
                        self.control_event(t);
                    }
                    self.ctl_evs = ctl_evs;
                }
                t => self.control_event(t),
            }
        }
        udp_ready
    }

    /// A new client, a doorbell or a client's control messages.
    fn control_event(&mut self, token: u64) {
        match token {
            TOKEN_LISTEN => self.accept_clients(),
            t if t & 1 == 1 => self.doorbell(t >> 1),
            t => {
                let id = t >> 1;
                let eps = Eps { udp: &self.ep, ctl: &self.ctl };
                let sleeps = self.sleeps;
                if !serve_client(&mut self.nss, &self.cfg, eps, &self.ram_clients, sleeps, &mut self.clients, id, &mut self.ctlbuf) {
                    self.client_gone(id);
                }
            }
        }
    }

    fn accept_clients(&mut self) {
        while let Ok(fd) = accept4(self.listener.as_raw_fd(), SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK) {
            // SAFETY: accept4 just returned this descriptor to us.
            let sock = unsafe { OwnedFd::from_raw_fd(fd) };
            // The last few descriptors stay for the clients already here
            // (a hello beyond CLIENT_RESERVE is refused with an answer).
            if descriptors::short(fd, CLIENT_RESERVE / 2) {
                warn!("out of descriptors (limit {}): turned a new client away", descriptors::limit());
                continue;
            }
            let id = self.next_client;
            self.next_client += 1;
            // Each request's arrival time: how long it lay in the socket
            // before the loop read it (`note_control_wait`).
            if let Err(e) = setsockopt(&sock, sockopt::ReceiveTimestampns, &true) {
                warn!("control socket without arrival times: {e}");
            }
            if self.ctl.add(&sock, readable(id << 1)).is_ok() {
                self.clients.insert(id, Client { sock, doorbell: None, doorbell_page: None, ns: self.cfg.addr });
            }
        }
    }

    fn doorbell(&mut self, id: ClientId) {
        if let Some(c) = self.clients.get(&id) {
            if let (Some(db), Some(ns)) = (c.doorbell.as_ref(), self.nss.get_mut(&c.ns)) {
                ns.engine.stats.doorbell_writes += eventfd::drain(db);
                match &c.doorbell_page {
                    Some(page) => ns.engine.doorbell_marked(id, page),
                    None => ns.engine.doorbell(id),
                }
            }
        }
    }

    /// A client went away: its objects go, and a namespace other than the
    /// daemon's own goes with its last client.
    fn client_gone(&mut self, id: ClientId) {
        let t0 = Instant::now();
        let Some(c) = self.clients.remove(&id) else { return };
        let _ = self.ctl.delete(&c.sock);
        if let Some(d) = &c.doorbell {
            let _ = self.ctl.delete(d);
        }
        if self.clients.is_empty() {
            info!("event loop while it had clients: {}", self.spin.counts.summary());
            self.spin.counts = Default::default();
        }
        let last = c.ns != self.cfg.addr && !self.clients.values().any(|o| o.ns == c.ns);
        if last {
            if let Some(ns) = self.nss.remove(&c.ns) {
                let _ = self.ep.delete(&ns.udp);
                if ns.claimed {
                    match crate::gid::release(c.ns) {
                        Ok(()) => info!("GID {} released with its namespace", c.ns),
                        Err(e) => warn!("releasing GID {}: {e:#}", c.ns),
                    }
                }
                ns.close();
                info!("namespace {} closed ({:.2} ms of the event loop)", c.ns, t0.elapsed().as_secs_f64() * 1e3);
            }
        } else if let Some(ns) = self.nss.get_mut(&c.ns) {
            let left = ns.engine.client_gone(id);
            ns.engine.stats.clients_gone += 1;
            release_off_loop(left);
        }
    }

    /// Receives and transmits in every namespace, and decides whether the
    /// next round starts at once.
    fn pump(&mut self, round: &Round, udp_ready: &[Ipv4Addr]) {
        let (mut got, mut sent, mut more) = (0, 0, false);
        let mut control = ControlWatch::new(&self.ctl, self.knobs.control_look);
        for (gid, ns) in self.nss.iter_mut() {
            let (g, t, m) = ns.pump(self.busy || round.direct_rx || udp_ready.contains(gid), &mut self.rxbufs, &mut control);
            got += g;
            sent += t;
            more |= m;
        }
        // A round cut short for a control event left packets in the
        // sockets: back at once, after the event.
        more |= control.waiting;
        // Busy (loop again at once, without yielding) only while there is
        // more to send or the socket had more than a batch. After an ordinary
        // receive or send the next packet cannot come before someone else
        // ran (the peer, or the client we woke): yield first, and let epoll
        // (level-triggered) say whether the socket has more, instead of an
        // empty recvmmsg per round.
        self.busy = more || (!self.knobs.lean_loop && (got > 0 || sent > 0)) || got >= RX_BATCH;
        if more || got > 0 || sent > 0 || round.events > 0 {
            self.last_activity = Instant::now();
        }
        if let Some(since) = round.spin_since {
            if self.last_activity == since {
                self.spin.empty_round();
            } else {
                self.spin.found_after(self.last_activity - since);
            }
        }
    }
}

/// Drops `what` on a thread of its own. Unmapping what a VM's namespace
/// maps (at 256 QPs, its rings and the guest RAM its MRs cover) took the
/// event loop 11-34 ms, a stall for every other client of this rnicd.
fn release_off_loop<T: Send + 'static>(what: T) {
    if let Err(e) = crate::loop_priority::spawn("rnicd-release", move || drop(what)) {
        // The closure, with `what`, was dropped here by then.
        warn!("no thread to release a closed client's objects on ({e}); released them in the event loop");
    }
}

/// epoll_wait with a timeout to the microsecond (epoll_pwait2).
fn epoll_wait_for(ep: &Epoll, evs: &mut [EpollEvent], timeout: Duration) -> usize {
    let ts = libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as libc::c_long };
    static UNSUPPORTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !UNSUPPORTED.load(std::sync::atomic::Ordering::Relaxed) {
        // SAFETY: EpollEvent is a transparent libc::epoll_event, and `evs`
        // outlives the call.
        let n = unsafe { libc::epoll_pwait2(ep.0.as_raw_fd(), evs.as_mut_ptr().cast(), evs.len() as i32, &ts, std::ptr::null()) };
        if n >= 0 {
            return n as usize;
        }
        let e = std::io::Error::last_os_error().raw_os_error();
        if e != Some(libc::ENOSYS) && e != Some(libc::EPERM) {
            return 0; // EINTR: no events this round
        }
        // Kernels before 5.11, or a seccomp profile older than the call:
        // milliseconds, rounded up so that a timer is never polled early
        // in a loop that does not sleep.
        tracing::info!("epoll_pwait2 unavailable: epoll_wait with millisecond timers");
        UNSUPPORTED.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    let ms = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
    // SAFETY: as above.
    let n = unsafe { libc::epoll_wait(ep.0.as_raw_fd(), evs.as_mut_ptr().cast(), evs.len() as i32, ms) };
    n.max(0) as usize
}

/// An epoll registration for input, with its token.
fn readable(token: u64) -> EpollEvent {
    EpollEvent::new(EpollFlags::EPOLLIN, token)
}

/// Receives and handles up to RX_BATCH datagrams, RX_CHUNK per recvmmsg;
/// fewer when `control` sees a control event waiting.
fn recv_batch(udp: &OwnedFd, bufs: &mut [Vec<u8>], engine: &mut Engine, control: &mut ControlWatch) -> usize {
    let mut got = 0;
    while got < RX_BATCH {
        let n = recv_chunk(udp, bufs, engine);
        got += n;
        if n < RX_CHUNK {
            break;
        }
        if control.look() {
            engine.stats.rx_passes_cut_for_control += 1;
            break;
        }
    }
    got
}

/// A control request waiting longer than this in its socket is logged
/// (info) with its name.
const CONTROL_WAIT_LOGGED: Duration = Duration::from_millis(1);

/// Counts how long a control request lay in its socket before the loop
/// read it: with the client's own time for the round trip, it tells a
/// request that waited for rnicd (busy, or without a CPU) from one whose
/// client waited for its answer. A migration's suspend, claim and resume
/// are downtime, so the slow ones are logged by name.
fn note_control_wait(engine: &mut Engine, queued_at: Option<std::time::SystemTime>, msg: &[u8]) {
    let Some(waited) = queued_at.and_then(|t| t.elapsed().ok()) else { return };
    let us = waited.as_micros() as u64;
    engine.stats.control_wait_us_total += us;
    engine.stats.control_wait_max_us = engine.stats.control_wait_max_us.max(us);
    if waited >= CONTROL_WAIT_LOGGED {
        engine.stats.control_waits_over_1ms += 1;
        info!("{}: control request {} waited {:.2} ms in its socket", engine.gid, request_name(msg), waited.as_secs_f64() * 1e3);
    }
}

/// The variant name at the start of a control request's JSON
/// (`{"SuspendQps":...}` or `"Stats"`), for logs.
fn request_name(msg: &[u8]) -> &str {
    let head = msg.strip_prefix(b"{").unwrap_or(msg).strip_prefix(b"\"").unwrap_or(b"");
    let end = head.iter().position(|&b| b == b'"').unwrap_or(0);
    std::str::from_utf8(&head[..end]).ok().filter(|n| !n.is_empty()).unwrap_or("(unnamed)")
}

/// Looks at the control side (client sockets, the listener, doorbells)
/// in the middle of a round of packet work, at most once per `every` of
/// it. A round is up to 4 receive batches of 64 datagrams per namespace,
/// and with GRO a datagram holds up to 64 KiB: under a peer's streams
/// one round can take milliseconds, and a control request that arrives
/// in it (a migration's suspend, a claim, a resume, all downtime) would
/// wait for its end. With the watch it waits for about `every` of packet
/// work and the transmit that follows; each namespace still gets one
/// receive call (up to RX_CHUNK datagrams) per round, so none is starved
/// by a chatty client.
struct ControlWatch<'a> {
    ctl: &'a Epoll,
    /// Zero: never look (control is served between rounds only).
    every: Duration,
    next: Instant,
    /// A control event is waiting: the round ends after its transmits.
    waiting: bool,
}

impl<'a> ControlWatch<'a> {
    fn new(ctl: &'a Epoll, every: Duration) -> ControlWatch<'a> {
        ControlWatch { ctl, every, next: Instant::now() + every, waiting: false }
    }

    /// Whether a control event is waiting, looked at (one `epoll_wait`
    /// that consumes nothing: the control epoll is level-triggered) at
    /// most once per `every`.
    fn look(&mut self) -> bool {
        if self.waiting || self.every.is_zero() {
            return self.waiting;
        }
        let now = Instant::now();
        if now < self.next {
            return false;
        }
        self.next = now + self.every;
        let mut ev = [EpollEvent::empty()];
        self.waiting = self.ctl.wait(&mut ev, 0u16).unwrap_or(0) > 0;
        self.waiting
    }
}

fn recv_chunk(udp: &OwnedFd, bufs: &mut [Vec<u8>], engine: &mut Engine) -> usize {
    // SAFETY: zeroed structs are valid; every pointer refers to live buffers.
    let mut addrs: [libc::sockaddr_in; RX_CHUNK] = unsafe { std::mem::zeroed() };
    // UDP_GRO's segment size and SCM_TIMESTAMPNS's arrival time.
    let mut cbufs = [[0u64; 8]; RX_CHUNK];
    let mut iovs: Vec<libc::iovec> =
        bufs.iter_mut().map(|b| libc::iovec { iov_base: b.as_mut_ptr() as *mut libc::c_void, iov_len: b.len() }).collect();
    let mut hdrs: [libc::mmsghdr; RX_CHUNK] = unsafe { std::mem::zeroed() };
    for k in 0..RX_CHUNK {
        hdrs[k].msg_hdr.msg_name = &mut addrs[k] as *mut _ as *mut libc::c_void;
        hdrs[k].msg_hdr.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as u32;
        hdrs[k].msg_hdr.msg_iov = &mut iovs[k];
        hdrs[k].msg_hdr.msg_iovlen = 1;
        hdrs[k].msg_hdr.msg_control = cbufs[k].as_mut_ptr() as *mut libc::c_void;
        hdrs[k].msg_hdr.msg_controllen = std::mem::size_of::<[u64; 8]>();
    }
    let n = unsafe { libc::recvmmsg(udp.as_raw_fd(), hdrs.as_mut_ptr(), RX_CHUNK as u32, libc::MSG_DONTWAIT, std::ptr::null_mut()) };
    if n <= 0 {
        return 0;
    }
    let now = Instant::now();
    let wall = std::time::SystemTime::now();
    for k in 0..n as usize {
        let len = hdrs[k].msg_len as usize;
        let src = Ipv4Addr::from(u32::from_be(addrs[k].sin_addr.s_addr));
        let sport = u16::from_be(addrs[k].sin_port);
        if hdrs[k].msg_hdr.msg_flags & libc::MSG_TRUNC != 0 {
            engine.stats.rx_malformed += 1;
            continue;
        }
        // A GRO-coalesced datagram carries several packets of `seg` bytes.
        let mut seg = len;
        let mut arrived = now;
        // SAFETY: walking the control messages the kernel wrote.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&hdrs[k].msg_hdr);
            while !c.is_null() {
                if (*c).cmsg_level == SOL_UDP && (*c).cmsg_type == UDP_GRO {
                    seg = std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const i32).max(1) as usize;
                } else if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_TIMESTAMPNS {
                    let ts = std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const libc::timespec);
                    arrived = arrival(now, wall, &ts);
                }
                c = libc::CMSG_NXTHDR(&hdrs[k].msg_hdr, c);
            }
        }
        if len == 0 {
            engine.stats.rx_malformed += 1;
            continue;
        }
        for chunk in bufs[k][..len].chunks(seg.max(1)) {
            engine.on_packet_at(chunk, src, sport, now, arrived);
        }
    }
    // WRITE payloads placed with streaming stores reach memory before the
    // ACKs for them leave (one fence per chunk, not per packet).
    crate::mem::fence_streamed();
    n as usize
}

/// The monotonic time of a kernel receive timestamp (wall clock), given
/// both clocks at `now`: at most a second back (a stamp older than that,
/// or from the future after a clock step, is taken as `now`).
fn arrival(now: Instant, wall: std::time::SystemTime, ts: &libc::timespec) -> Instant {
    let stamp = std::time::UNIX_EPOCH + Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32);
    match wall.duration_since(stamp) {
        Ok(age) if age < Duration::from_secs(1) => now.checked_sub(age).unwrap_or(now),
        _ => now,
    }
}

/// The daemon's two epolls: namespaces' UDP sockets, and the control side.
#[derive(Clone, Copy)]
struct Eps<'a> {
    udp: &'a Epoll,
    ctl: &'a Epoll,
}

/// Handles every pending control message of one client; false if it is gone.
#[allow(clippy::too_many_arguments)]
fn serve_client(
    nss: &mut HashMap<Ipv4Addr, Namespace>,
    cfg: &Config,
    eps: Eps,
    ram_clients: &Arc<crate::ramclient::RamClients>,
    sleeps: Sleeps,
    clients: &mut HashMap<ClientId, Client>,
    id: ClientId,
    buf: &mut [u8],
) -> bool {
    loop {
        let Some(c) = clients.get(&id) else { return false };
        let Some(engine) = nss.get_mut(&c.ns).map(|n| &mut n.engine) else { return false };
        let (n, fds) = match fdmsg::recv_stamped(&c.sock, buf) {
            Ok(Some(r)) => {
                note_control_wait(engine, r.queued_at, &buf[..r.len]);
                (r.len, r.fds)
            }
            Ok(None) => return false,
            Err(fdmsg::Error::ControlTruncated) => {
                // Out of descriptors as it arrived: the request is answered
                // (refused), and the client stays.
                engine.stats.descriptor_refusals += 1;
                if let Err(e) = send_response(&c.sock, &Err(out_of_descriptors())) {
                    warn!("client {id}: {e:#}");
                    return false;
                }
                continue;
            }
            Err(e) => {
                if e.would_block() {
                    return true;
                }
                engine.stats.bad_client_requests += 1;
                return false;
            }
        };
        engine.stats.control_requests += 1;
        // The highest descriptor received tells how many are in use; a
        // spilled request's memfd (closed once read) counts too.
        let short = |reserve| fds.iter().any(|f| descriptors::short(f.as_raw_fd(), reserve));
        let (short_for_objects, short_for_clients) = (short(OBJECT_RESERVE), short(CLIENT_RESERVE));
        let resp: Response = match parse_request(&buf[..n], fds) {
            Err(e) => {
                engine.stats.bad_client_requests += 1;
                Err(e)
            }
            Ok((Request::Hello { .. }, _)) if short_for_clients => {
                engine.stats.descriptor_refusals += 1;
                Err(out_of_descriptors())
            }
            Ok((Request::Hello { version, namespace }, fds)) => {
                let mut fds = fds;
                // The eventfd comes last; a doorbell page, if any, before it.
                let db = fds.pop();
                let page = fds.pop().map(|fd| DoorbellPage::map(&fd)).transpose();
                match (version == proto::PROTO_VERSION, db, page) {
                    (true, Some(_), Err(e)) => {
                        engine.stats.bad_client_requests += 1;
                        Err(format!("doorbell page: {e:#}"))
                    }
                    (true, Some(db), Ok(page)) if c.doorbell.is_none() && fds.is_empty() => {
                        let gid = namespace.unwrap_or(cfg.addr);
                        match enter_namespace(nss, cfg, eps.udp, gid) {
                            Err(e) => Err(format!("{e:#}")),
                            Ok(()) => {
                                let r = eps.ctl.add(&db, readable(id << 1 | 1));
                                if let Some(c) = clients.get_mut(&id) {
                                    c.doorbell = Some(db);
                                    c.doorbell_page = page;
                                    c.ns = gid;
                                }
                                if let Some(ns) = nss.get_mut(&gid) {
                                    ns.engine.stats.clients_connected += 1;
                                }
                                r.map(|_| Reply::Hello { gid, client: id }).map_err(|e| e.to_string())
                            }
                        }
                    }
                    _ => {
                        engine.stats.bad_client_requests += 1;
                        Err(format!(
                            "hello needs protocol version {}, one doorbell eventfd and at most one doorbell page",
                            proto::PROTO_VERSION
                        ))
                    }
                }
            }
            // Objects belong to the namespace a client joins with its
            // hello, and go with the client from there: made before it,
            // they would stay in the default namespace for good.
            Ok((req, _))
                if c.doorbell.is_none()
                    && !matches!(
                        req,
                        Request::QueryDevice | Request::QueryPort { .. } | Request::QueryGid { .. } | Request::Stats | Request::DumpQps
                    ) =>
            {
                engine.stats.bad_client_requests += 1;
                Err("say Hello first: a client's objects live in the namespace it joins".into())
            }
            Ok(_) if short_for_objects => {
                engine.stats.descriptor_refusals += 1;
                Err(out_of_descriptors())
            }
            Ok((Request::CreateCompChannel, _)) if engine.channels_of(id) >= cfg.max_channels_per_client => {
                engine.stats.descriptor_refusals += 1;
                Err(format!(
                    "this client holds {} completion channels, the most rnicd allows one client (--max-channels-per-client)",
                    cfg.max_channels_per_client
                ))
            }
            Ok((Request::JoinRamClient, fds)) => {
                let mut fds = fds;
                match (fds.pop(), fds.is_empty()) {
                    (Some(sock), true) => {
                        crate::ramclient::join(ram_clients, sock).map(|ram_bytes| Reply::RamClient { ram_bytes }).map_err(|e| {
                            engine.stats.bad_client_requests += 1;
                            format!("{e:#}")
                        })
                    }
                    _ => {
                        engine.stats.bad_client_requests += 1;
                        Err("JoinRamClient needs one socket".into())
                    }
                }
            }
            // The daemon's figures beside the namespace's own.
            Ok((Request::Stats, fds)) => engine
                .control(id, Request::Stats, fds)
                .map(|r| match r {
                    Reply::Stats(mut v) => {
                        v["ram_clients"] = ram_clients.joined().into();
                        v["ram_clients_in_postcopy"] = ram_clients.in_postcopy().into();
                        // The event loop's, for all its namespaces.
                        v["loop_sleeps"] = sleeps.sleeps.into();
                        v["loop_woken_by_work"] = sleeps.woken_by_work.into();
                        Reply::Stats(v)
                    }
                    r => r,
                })
                .map_err(|e| format!("{e:#}")),
            Ok((Request::DumpQps, _)) => {
                let now = Instant::now();
                let mut all: Vec<_> = nss.values().map(|n| n.engine.dump_qps(now)).collect();
                all.sort_by(|a, b| a["gid"].as_str().cmp(&b["gid"].as_str()));
                Ok(Reply::QpDump(all.into()))
            }
            Ok((req @ (Request::ClaimGid | Request::ReleaseGid), _)) => {
                let gid = c.ns;
                claim_or_release(nss, cfg, gid, matches!(req, Request::ClaimGid))
            }
            Ok((Request::ClaimGidAndResumeQps { qpns }, _)) => {
                let gid = c.ns;
                claim_or_release(nss, cfg, gid, true).and_then(|_| match nss.get_mut(&gid) {
                    Some(ns) => ns.engine.control(id, Request::ResumeQps { qpns }, Vec::new()).map_err(|e| format!("{e:#}")),
                    None => Err(format!("no namespace {gid}")),
                })
            }
            Ok((Request::CreateAlias { pd, owner, key, alias, owner_namespace: Some(g) }, _)) if g != c.ns => {
                alias_across(nss, c.ns, id, pd, (owner, key), g, alias)
            }
            Ok((req, fds)) => engine.control(id, req, fds).map_err(|e| {
                engine.stats.bad_client_requests += 1;
                format!("{e:#}")
            }),
        };
        let Some(c) = clients.get(&id) else { return false };
        // Before the answer: a migration's destination answers EarlyBuilt
        // once its QPs are made, and the switch follows; sockets still
        // being made then would delay its first request (LoadQpStates).
        if let Some(ns) = nss.get_mut(&c.ns) {
            ns.prepare_ahead(cfg.addr);
        }
        if let Err(e) = send_response(&c.sock, &resp) {
            warn!("client {id}: {e:#}");
            return false;
        }
    }
}

/// The answer to a request refused for want of descriptors.
fn out_of_descriptors() -> String {
    format!(
        "rnicd is short of file descriptors (limit {}): refused this request and closed its descriptors; \
         close unused objects, or raise rnicd's RLIMIT_NOFILE",
        descriptors::limit()
    )
}

/// A request and its descriptors; a spilled one (`Request::Spilled`) is
/// read from its memfd, the message's last descriptor.
fn parse_request(bytes: &[u8], mut fds: Vec<OwnedFd>) -> Result<(Request, Vec<OwnedFd>), String> {
    let req = serde_json::from_slice::<Request>(bytes).map_err(|e| format!("malformed request: {e}"))?;
    let Request::Spilled { len, format } = req else { return Ok((req, fds)) };
    let fd = fds.pop().ok_or("a spilled request needs its memfd")?;
    let bytes = crate::proto::spill::read(fd, len).map_err(|e| format!("{e:#}"))?;
    match format.decode::<Request>(&bytes).map_err(|e| format!("malformed spilled request: {e:#}"))? {
        Request::Spilled { .. } => Err("a spilled request inside a spilled request".into()),
        req => Ok((req, fds)),
    }
}

/// Sends `resp`, spilled into a memfd when it is larger than a datagram or
/// carries QP states or traces (`crate::proto::spill::Format::for_reply`).
fn send_response(sock: &OwnedFd, resp: &Response) -> anyhow::Result<()> {
    let binary = crate::proto::spill::Format::for_reply(resp);
    let format = binary.unwrap_or_default();
    let bytes = format.encode(resp)?;
    if binary.is_none() && !crate::proto::spill::needed(&bytes) {
        return Ok(fdmsg::send_bytes(sock, &bytes, &[])?);
    }
    // A reply that cannot be spilled (no memfd: EMFILE, ENOMEM) goes as an
    // error the client can read; failing the send would drop the client
    // and with it every object it holds.
    let fd = match crate::proto::spill::write(&bytes) {
        Ok(fd) => fd,
        Err(e) => {
            let err: Response = Err(format!("a reply of {} bytes could not be spilled: {e:#}", bytes.len()));
            return Ok(fdmsg::send(sock, &err, &[])?);
        }
    };
    let head: Response = Ok(Reply::Spilled { len: bytes.len() as u64, format });
    Ok(fdmsg::send(sock, &head, &[fd.as_raw_fd()])?)
}

/// An alias, in the caller's namespace `ns`, of `target` (owner, key) of
/// namespace `owner_ns` (crate::keys, foreign aliases): the owner's table
/// exports weak references to the key's memory and grant, the caller's
/// table keeps them.
fn alias_across(
    nss: &mut HashMap<Ipv4Addr, Namespace>,
    ns: Ipv4Addr,
    client: ClientId,
    pd: u32,
    target: (ClientId, u32),
    owner_ns: Ipv4Addr,
    alias: Option<u32>,
) -> Response {
    let export = match nss.get(&owner_ns) {
        Some(o) => o.engine.export_key(target.0, target.1, client),
        None => Err(format!("no namespace {owner_ns} in this rnicd")),
    };
    let Some(mine) = nss.get_mut(&ns) else { return Err(format!("no namespace {ns}")) };
    let r = export.and_then(|e| mine.engine.create_foreign_alias(client, pd, target, e, alias).map_err(|e| format!("{e:#}")));
    if r.is_err() {
        mine.engine.stats.bad_client_requests += 1;
    }
    r
}

/// A namespace's owner moves its GID to or away from this host.
fn claim_or_release(nss: &mut HashMap<Ipv4Addr, Namespace>, cfg: &Config, gid: Ipv4Addr, claim: bool) -> Response {
    if gid == cfg.addr {
        return Err(format!("{gid} is this rnicd's own address, not a namespace GID that moves"));
    }
    let Some(ns) = nss.get_mut(&gid) else { return Err(format!("no namespace {gid}")) };
    let r = if claim { crate::gid::claim(gid, cfg.addr).map(Some) } else { crate::gid::release(gid).map(|()| None) };
    match r {
        Ok(on) => {
            ns.claimed = claim;
            if let Some(on) = on {
                // The address is on an interface now: the port follows its link.
                ns.engine.set_active_mtu(crate::link::path_mtu_on(&on.name));
                info!("GID {gid} claimed on {}: active MTU {}", on.name, ns.engine.active_mtu.bytes());
            } else {
                info!("GID {gid} released");
            }
            Ok(Reply::Ok)
        }
        Err(e) => Err(format!("{e:#}")),
    }
}

/// Opens the namespace `gid` if it does not exist yet.
fn enter_namespace(nss: &mut HashMap<Ipv4Addr, Namespace>, cfg: &Config, ep: &Epoll, gid: Ipv4Addr) -> anyhow::Result<()> {
    if nss.contains_key(&gid) {
        return Ok(());
    }
    if gid.is_unspecified() || gid.is_multicast() || gid.is_broadcast() {
        bail!("{gid} cannot be a namespace GID");
    }
    if nss.len() >= MAX_NAMESPACES {
        bail!("this rnicd already serves {MAX_NAMESPACES} namespaces");
    }
    let ns = Namespace::open(gid, cfg.gso)?;
    ep.add(&ns.udp, readable(TOKEN_NS | u64::from(u32::from(gid))))?;
    info!("namespace {gid} opened");
    nss.insert(gid, ns);
    Ok(())
}

/// Convenience for tools: run rnicd in this process on a thread.
pub fn spawn(cfg: Config) -> anyhow::Result<(Arc<AtomicBool>, std::thread::JoinHandle<anyhow::Result<()>>)> {
    let stop = Arc::new(AtomicBool::new(false));
    let s2 = stop.clone();
    let path = cfg.sock.clone();
    let h = std::thread::spawn(move || run(cfg, Some(s2)));
    let t0 = Instant::now();
    while !path.exists() {
        if h.is_finished() || t0.elapsed() > Duration::from_secs(10) {
            bail!("rnicd did not start");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok((stop, h))
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::socket::{getsockopt, sendto, MsgFlags, SockProtocol};

    #[test]
    fn a_request_is_named_by_its_variant() {
        assert_eq!(request_name(br#"{"SuspendQps":{"qpns":[1,2]}}"#), "SuspendQps");
        assert_eq!(request_name(br#""Stats""#), "Stats");
        assert_eq!(request_name(b"garbage"), "(unnamed)");
        assert_eq!(request_name(b""), "(unnamed)");
        assert_eq!(request_name(br#"{"#), "(unnamed)");
    }

    /// The Internet checksum of `b`.
    fn inet_csum(b: &[u8]) -> u16 {
        let mut sum: u32 = b.chunks(2).map(|c| u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]) as u32).sum();
        while sum >> 16 != 0 {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        !(sum as u16)
    }

    /// Delivers to this host an ICMP "fragmentation needed" (next hop MTU
    /// `mtu`) about a UDP packet from `from` to `to`, as a router on the
    /// path would send it: the kernel sets it as the pending error of the
    /// socket bound to `from` (IP_RECVERR), which its next send returns.
    fn frag_needed(from: SocketAddrV4, to: SocketAddrV4, mtu: u16) {
        let mut inner = vec![0x45, 0, 0, 128, 0, 0, 0x40, 0, 64, libc::IPPROTO_UDP as u8, 0, 0];
        inner.extend(from.ip().octets());
        inner.extend(to.ip().octets());
        inner.extend(from.port().to_be_bytes());
        inner.extend(to.port().to_be_bytes());
        inner.extend([0, 108, 0, 0]);
        let mut icmp = vec![3, 4, 0, 0, 0, 0];
        icmp.extend(mtu.to_be_bytes());
        icmp.extend(inner);
        let c = inet_csum(&icmp);
        icmp[2..4].copy_from_slice(&c.to_be_bytes());
        let raw = socket(AddressFamily::Inet, SockType::Raw, SockFlag::SOCK_CLOEXEC, SockProtocol::Icmp).unwrap();
        sendto(raw.as_raw_fd(), &icmp, &SockaddrIn::from(SocketAddrV4::new(*from.ip(), 0)), MsgFlags::empty()).unwrap();
    }

    /// An earlier DF packet's "fragmentation needed", reported (with
    /// IP_RECVERR) on the send of a small packet, does not drop that
    /// packet: it is sent again at once, and arrives.
    #[test]
    fn a_deferred_fragmentation_needed_drops_no_small_packet() {
        // 127.0.0.2: the MTU the ICMP names (larger than any packet here)
        // is remembered for that address only, which nothing else uses.
        let to = SocketAddrV4::new(Ipv4Addr::new(127, 0, 0, 2), ROCE_PORT);
        let rx = std::net::UdpSocket::bind(to).expect("binding the RoCE port on 127.0.0.2");
        rx.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut senders = Senders::new(Ipv4Addr::LOCALHOST, false).unwrap();
        let (fd, port) = (senders.fallback_df.0.as_raw_fd(), senders.fallback_df.1);
        frag_needed(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port), to, 60_000);
        // The error is pending on the socket once the ICMP went through
        // the loopback.
        let mut pending = 0;
        for _ in 0..100 {
            pending = getsockopt(&senders.fallback_df.0, sockopt::SocketError).unwrap();
            if pending != 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(pending, libc::EMSGSIZE, "the ICMP left no pending error");
        // getsockopt(SO_ERROR) cleared it: set it again for the send.
        frag_needed(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port), to, 60_000);
        std::thread::sleep(Duration::from_millis(50));
        let mut pkt = OutPkt { buf: vec![0u8; 256], len: 64, dst: *to.ip(), sport: port, in_place: None };
        pkt.buf[..4].copy_from_slice(b"ping");
        let mut errors = 0;
        let sent = senders.send_run(fd, std::slice::from_mut(&mut pkt), false, &mut errors);
        assert_eq!((sent, errors), (1, 0), "the small packet went");
        let mut got = [0u8; 256];
        let n = rx.recv(&mut got).expect("the packet arrives");
        assert_eq!((n, &got[..4]), (64, &b"ping"[..]));
    }
}
