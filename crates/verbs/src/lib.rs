//! The client side of rnicd: a Rust verbs API shaped after libibverbs.
//!
//! ```text
//! let ctx = Context::open(None)?;            // ibv_open_device
//! let pd = ctx.alloc_pd()?;                  // ibv_alloc_pd
//! let buf = MemBuf::new(1 << 20)?;           // memfd-backed memory rnicd can map
//! let mr = pd.reg_mr(&buf, 0, buf.len(), access::LOCAL_WRITE | access::REMOTE_WRITE)?;
//! let cq = ctx.create_cq(256, None)?;        // ibv_create_cq
//! let qp = pd.create_qp(&QpInitAttr::new(&cq, &cq))?;
//! qp.connect(&remote, &ConnectOpts::default())?;   // INIT -> RTR -> RTS
//! qp.post_send(&[SendWr::write(1, &[mr.sge(0, 4096)], raddr, rkey)])?;
//! cq.poll(&mut wcs)?;
//! ```
//!
//! Control calls go over rnicd's unix socket; posting and polling only touch
//! shared-memory rings (plus one eventfd write per post call as doorbell).

use std::net::Ipv4Addr;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use nix::sys::socket::{socket, AddressFamily, SockFlag, SockType};
use rnic::mem::{sealed_memfd, Mapping};
use rnic::proto::{self, Reply, Request};
use rnic::ring::{ring_bytes, Cqe, RecvWqe, Ring, SendWqe, MAX_INLINE, MAX_SGE, NOTIFY_NEXT, NOTIFY_SOLICITED};

pub use batch::{Made, NewObject};
pub use rnic::async_events::{AsyncEvent, AsyncKind};
/// The link's MTU and the path MTU it carries whole (the port's active MTU).
pub use rnic::link;
pub use rnic::mem::MAX_REGION_RUNS;
/// A UD receive buffer starts with this many bytes of GRH.
pub use rnic::qp::ud::GRH_LEN;
pub use rnic::qp::{QpRuntime, QpSnapshot, QP_SNAPSHOT_VERSION};
pub use rnic::ring::Sge;
pub use rnic::trace::TraceReport;
pub use rnic::types::{
    access, mask, send_flags, wc_flags, DeviceAttr, Mtu, PortAttr, QpAttr, QpCap, QpState, QpType, WcOpcode, WcStatus, WrOpcode,
};
pub use srq::{Srq, SrqAttr, SrqSnapshot, MAX_SRQ, MAX_SRQ_SGE, MAX_SRQ_WR, SRQ_SNAPSHOT_VERSION};

mod batch;
pub mod mkeys;
pub mod pace;
pub mod peer;
pub mod placement;
pub mod proc_maps;
pub mod rcache;
mod srq;
pub mod tools;

struct Inner {
    sock: OwnedFd,
    /// One request at a time: the reply buffer, and whether
    /// [`Context::close`] ended the connection (requests then fail at once).
    conn: Mutex<Conn>,
    doorbell: OwnedFd,
    /// Which QPs rang (`rnic::doorbell`), shared with rnicd.
    doorbell_page: rnic::doorbell::DoorbellPage,
    gid: Ipv4Addr,
    sock_path: PathBuf,
    /// rnicd's ID of this connection (what another client grants keys to).
    client: u64,
    /// Where rnicd runs: posting threads may keep off its CPU (placement.rs).
    rnicd_cpu: placement::RnicdCpu,
}

struct Conn {
    buf: Vec<u8>,
    closed: bool,
}

/// Makes each send and receive of a control request on `sock` wait at most
/// `limit` (SO_SNDTIMEO, SO_RCVTIMEO).
fn set_call_timeout(sock: &OwnedFd, limit: Duration) -> anyhow::Result<()> {
    // A zero timeval means no timeout at all, and a negative one is refused.
    if limit < Duration::from_millis(1) || limit > Duration::from_secs(1 << 31) {
        bail!("a call timeout must be 1 ms to 2^31 s, not {limit:?}");
    }
    let tv = nix::sys::time::TimeVal::new(limit.as_secs() as _, limit.subsec_micros() as _);
    nix::sys::socket::setsockopt(sock, nix::sys::socket::sockopt::ReceiveTimeout, &tv).context("SO_RCVTIMEO")?;
    nix::sys::socket::setsockopt(sock, nix::sys::socket::sockopt::SendTimeout, &tv).context("SO_SNDTIMEO")?;
    Ok(())
}

/// Longest a control request waits to be sent and answered by default
/// ([`Context::set_call_timeout`]). rnicd answers
/// every request from its event loop without waiting for anything, so one
/// that takes this long means a stopped or stuck rnicd: the request fails
/// and the connection closes, instead of the program (or the drop of its
/// objects) waiting for good.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(60);

impl Inner {
    /// One request and its reply. Either, if larger than a datagram,
    /// travels in a memfd (`rnic::proto::spill`): a batch over hundreds of QPs is
    /// one round trip.
    fn call(&self, req: &Request, fds: &[RawFd]) -> anyhow::Result<Reply> {
        let mut conn = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        if conn.closed {
            bail!("the connection to rnicd was closed");
        }
        let binary = rnic::proto::spill::Format::for_request(req);
        let format = binary.unwrap_or_default();
        let bytes = format.encode(req)?;
        if binary.is_some() || rnic::proto::spill::needed(&bytes) {
            let spilled = rnic::proto::spill::write(&bytes)?;
            let fds: Vec<RawFd> = fds.iter().copied().chain([spilled.as_raw_fd()]).collect();
            fdmsg::send(&self.sock, &Request::Spilled { len: bytes.len() as u64, format }, &fds)
        } else {
            fdmsg::send_bytes(&self.sock, &bytes, fds)
        }
        .map_err(|e| self.unanswered(&mut conn.closed, e, "send control message"))?;
        let received = fdmsg::recv(&self.sock, &mut conn.buf);
        let (n, mut rfds) = received
            .map_err(|e| self.unanswered(&mut conn.closed, e, "receive control message"))?
            .context("rnicd closed the connection")?;
        let buf = &conn.buf;
        let mut r: proto::Response = serde_json::from_slice(&buf[..n]).context("bad reply from rnicd")?;
        if let Ok(Reply::Spilled { len, format }) = r {
            let fd = rfds.pop().context("a spilled reply without its memfd")?;
            r = format.decode(&rnic::proto::spill::read(fd, len)?).context("bad spilled reply from rnicd")?;
        }
        r.map_err(|e| anyhow!("rnicd: {e}"))
    }

    /// A send or receive error of a call. One that timed out (rnicd did
    /// not take or answer the request within [`CALL_TIMEOUT`]) ends the
    /// connection: a late answer would be taken for the next request's.
    fn unanswered(&self, closed: &mut bool, e: fdmsg::Error, what: &str) -> anyhow::Error {
        if !e.would_block() {
            return anyhow::Error::new(e).context(what.to_string());
        }
        *closed = true;
        let _ = nix::sys::socket::shutdown(self.sock.as_raw_fd(), nix::sys::socket::Shutdown::Both);
        let limit = nix::sys::socket::getsockopt(&self.sock, nix::sys::socket::sockopt::ReceiveTimeout)
            .map_or(CALL_TIMEOUT, |t| Duration::new(t.tv_sec() as u64, t.tv_usec() as u32 * 1000));
        anyhow!("rnicd did not answer within {limit:?} ({what}); the connection to it is closed")
    }

    /// A `Drop`'s destroy request. After [`Context::close`] rnicd has
    /// dropped every object of the connection with it: nothing is sent,
    /// and no error value is made (under `RUST_BACKTRACE` each captured a
    /// backtrace, tens of microseconds an object: at 256 QPs that doubled
    /// a migrated device's close).
    fn destroy(&self, req: &Request) {
        if self.conn.lock().unwrap_or_else(|e| e.into_inner()).closed {
            return;
        }
        let _ = self.call(req, &[]);
    }

    /// QP `qpn` posted: its bit, then the eventfd unless the bit was
    /// still set from a doorbell rnicd has not taken (`rnic::doorbell`).
    fn ring_doorbell(&self, qpn: u32) {
        if self.doorbell_page.mark(qpn) {
            rnic::eventfd::signal(&self.doorbell);
        }
    }
}

/// An open rnicd device (ibv_context).
#[derive(Clone)]
pub struct Context {
    inner: Arc<Inner>,
}

/// Finds the control socket: `TRANSIT_RNICD_SOCK`, else the default socket of
/// an rnicd serving one of this network namespace's addresses.
pub fn find_socket() -> anyhow::Result<PathBuf> {
    if let Ok(p) = std::env::var("TRANSIT_RNICD_SOCK") {
        return Ok(PathBuf::from(p));
    }
    let mut found = Vec::new();
    for a in nix::ifaddrs::getifaddrs()? {
        if let Some(ip) = a.address.as_ref().and_then(|s| s.as_sockaddr_in().map(|x| x.ip())) {
            let p = rnic::daemon::default_socket_path(ip);
            if p.exists() {
                found.push((ip.is_loopback(), p));
            }
        }
    }
    found.sort();
    found
        .into_iter()
        .next()
        .map(|x| x.1)
        .context("no rnicd found in this network namespace (start `transit rnicd`, or set TRANSIT_RNICD_SOCK)")
}

impl Context {
    /// Connects to rnicd at `path` (or the one found by [`find_socket`]).
    pub fn open(path: Option<&Path>) -> anyhow::Result<Context> {
        Self::open_in(path, None)
    }

    /// Connects to rnicd inside the RDMA namespace of `gid` (created on first
    /// use, gone with its last client). Inside a namespace every QPN and key
    /// is free for the caller to choose; namespaces never see each other.
    pub fn open_namespace(path: Option<&Path>, gid: Ipv4Addr) -> anyhow::Result<Context> {
        Self::open_in(path, Some(gid))
    }

    fn open_in(path: Option<&Path>, namespace: Option<Ipv4Addr>) -> anyhow::Result<Context> {
        let path = match path {
            Some(p) => p.to_path_buf(),
            None => find_socket()?,
        };
        let sock = socket(AddressFamily::Unix, SockType::SeqPacket, SockFlag::SOCK_CLOEXEC, None).context("socket")?;
        let ua = nix::sys::socket::UnixAddr::new(&path)?;
        nix::sys::socket::connect(sock.as_raw_fd(), &ua).with_context(|| format!("connect to rnicd at {}", path.display()))?;
        set_call_timeout(&sock, CALL_TIMEOUT)?;
        let doorbell = rnic::eventfd::create(true)?;
        let rnicd_cpu = placement::RnicdCpu::of_peer(&sock);
        let (doorbell_page, page_fd) = rnic::doorbell::DoorbellPage::create()?;
        let mut inner = Inner {
            sock,
            conn: Mutex::new(Conn { buf: vec![0u8; fdmsg::MAX_MSG], closed: false }),
            doorbell,
            doorbell_page,
            gid: Ipv4Addr::UNSPECIFIED,
            sock_path: path,
            client: 0,
            rnicd_cpu,
        };
        // The doorbell page, then the eventfd (rnicd takes the last fd as the eventfd).
        let hello_fds = [page_fd.as_raw_fd(), inner.doorbell.as_raw_fd()];
        match inner.call(&Request::Hello { version: proto::PROTO_VERSION, namespace }, &hello_fds)? {
            Reply::Hello { gid, client } => (inner.gid, inner.client) = (gid, client),
            r => bail!("unexpected reply {r:?}"),
        }
        Ok(Context { inner: Arc::new(inner) })
    }

    /// Ends the connection: rnicd releases every object it made at once
    /// (and closes the namespace with its last client), as when the process
    /// exits. Objects still held then drop without a request each, which
    /// for hundreds of QPs, CQs and MRs is hundreds of round trips saved.
    /// Every later request on this context fails.
    pub fn close(&self) {
        let mut conn = self.inner.conn.lock().unwrap_or_else(|e| e.into_inner());
        conn.closed = true;
        let _ = nix::sys::socket::shutdown(self.inner.sock.as_raw_fd(), nix::sys::socket::Shutdown::Both);
    }

    /// How long each control request may wait to be sent and answered
    /// ([`CALL_TIMEOUT`] by default) before it fails and the connection
    /// closes.
    pub fn set_call_timeout(&self, limit: Duration) -> anyhow::Result<()> {
        set_call_timeout(&self.inner.sock, limit)
    }

    /// rnicd's ID of this connection: what another client names when it
    /// grants this one access to a key (mkeys::KeyGrant).
    pub fn client_id(&self) -> u64 {
        self.inner.client
    }

    pub fn socket_path(&self) -> &Path {
        &self.inner.sock_path
    }

    /// Whether rnicd's event loop runs under a real-time policy (`rnicd
    /// --sched-fifo`), as seen when this context opened: it then preempts
    /// any program on its CPU, so a program waiting on a CQ need not sleep
    /// to leave it room (the drop-in's `ibv_poll_cq` then yields instead
    /// of napping; pace.rs).
    pub fn rnicd_realtime(&self) -> bool {
        self.inner.rnicd_cpu.realtime
    }

    /// The port's GID: the IPv4 address rnicd serves.
    pub fn gid(&self) -> Ipv4Addr {
        self.inner.gid
    }

    /// Makes rnicd a postcopy RAM client of a vmm: `sock` is the end of a
    /// RAM-client socket that vmm admitted (`RamClients::pair`). In an
    /// incoming postcopy, rnicd's accesses to that VM's guest RAM then wait
    /// for pages not yet migrated. Returns the guest RAM size.
    pub fn join_ram_client(&self, sock: OwnedFd) -> anyhow::Result<u64> {
        match self.inner.call(&Request::JoinRamClient, &[sock.as_raw_fd()])? {
            Reply::RamClient { ram_bytes } => Ok(ram_bytes),
            r => bail!("unexpected reply {r:?}"),
        }
    }

    pub fn query_device(&self) -> anyhow::Result<DeviceAttr> {
        match self.inner.call(&Request::QueryDevice, &[])? {
            Reply::Device(d) => Ok(d),
            r => bail!("unexpected reply {r:?}"),
        }
    }

    pub fn query_port(&self, port: u8) -> anyhow::Result<PortAttr> {
        match self.inner.call(&Request::QueryPort { port }, &[])? {
            Reply::Port(p) => Ok(p),
            r => bail!("unexpected reply {r:?}"),
        }
    }

    pub fn query_gid(&self, port: u8, index: u32) -> anyhow::Result<Ipv4Addr> {
        match self.inner.call(&Request::QueryGid { port, index }, &[])? {
            Reply::Gid(g) => Ok(g),
            r => bail!("unexpected reply {r:?}"),
        }
    }

    /// rnicd's counters (drops, retransmissions, NAKs...).
    pub fn stats(&self) -> anyhow::Result<serde_json::Value> {
        match self.inner.call(&Request::Stats, &[])? {
            Reply::Stats(s) => Ok(s),
            r => bail!("unexpected reply {r:?}"),
        }
    }

    /// The transport state of every QP and SRQ of rnicd, one object per
    /// namespace (`transit rdma qps`).
    pub fn dump_qps(&self) -> anyhow::Result<serde_json::Value> {
        match self.inner.call(&Request::DumpQps, &[])? {
            Reply::QpDump(s) => Ok(s),
            r => bail!("unexpected reply {r:?}"),
        }
    }

    /// Makes this host answer for the namespace's GID (rnicd adds the
    /// address and announces it). Claim only after the previous host
    /// released it: two hosts must never answer for one GID.
    pub fn claim_gid(&self) -> anyhow::Result<()> {
        match self.inner.call(&Request::ClaimGid, &[])? {
            Reply::Ok => Ok(()),
            r => bail!("unexpected reply {r:?}"),
        }
    }

    /// This host stops answering for the namespace's GID.
    pub fn release_gid(&self) -> anyhow::Result<()> {
        match self.inner.call(&Request::ReleaseGid, &[])? {
            Reply::Ok => Ok(()),
            r => bail!("unexpected reply {r:?}"),
        }
    }

    /// One request per `max` of `items` (each made by `request`), in
    /// order; `take` turns each reply into its results, or hands back a
    /// reply it does not expect.
    pub(crate) fn chunked<T, R>(
        &self,
        items: &[T],
        max: usize,
        request: impl Fn(&[T]) -> Request,
        take: impl Fn(&[T], Reply) -> Result<Vec<R>, Reply>,
    ) -> anyhow::Result<Vec<R>> {
        let mut out = Vec::new();
        for chunk in items.chunks(max) {
            match take(chunk, self.inner.call(&request(chunk), &[])?) {
                Ok(v) => out.extend(v),
                Err(r) => bail!("unexpected reply {r:?}"),
            }
        }
        Ok(out)
    }

    /// Suspends many QPs in one request (see [`Qp::suspend`]).
    pub fn suspend_qps(&self, qps: &[&Qp]) -> anyhow::Result<()> {
        self.chunked(qps, proto::MAX_BATCH, |c| Request::SuspendQps { qpns: qpns(c) }, ok_reply).map(drop)
    }

    /// Suspends those of `qps` that are connected (RTR, RTS, SQD) in one
    /// request per MAX_BATCH QPs and leaves the others alone; returns the
    /// QPNs it suspended.
    pub fn suspend_connected(&self, qps: &[&Qp]) -> anyhow::Result<Vec<u32>> {
        self.chunked(
            qps,
            proto::MAX_BATCH,
            |c| Request::SuspendConnected { qpns: qpns(c) },
            |_, r| match r {
                Reply::Qpns(v) => Ok(v),
                r => Err(r),
            },
        )
    }

    /// [`Context::suspend_connected`] and [`Context::query_qp_states`] in
    /// one pass: the states of the QPs it suspended (each names its QPN).
    /// A suspended QP's state does not change until it resumes.
    pub fn suspend_connected_states(&self, qps: &[&Qp]) -> anyhow::Result<Vec<QpSnapshot>> {
        self.chunked(
            qps,
            proto::MAX_BATCH,
            |c| Request::SuspendConnectedStates { qpns: qpns(c) },
            |_, r| match r {
                Reply::QpStates(v) => Ok(v),
                r => Err(r),
            },
        )
    }

    /// [`Context::suspend_connected_states`], then
    /// [`Context::fetch_traces`] of `mrs`, in one request when both fit in
    /// one (MAX_BATCH QPs, MAX_TRACE_BATCH MRs): a migration's source
    /// pauses its device and takes the last traces in one round trip.
    pub fn suspend_and_fetch_traces(&self, qps: &[&Qp], mrs: &[&Mr]) -> anyhow::Result<(Vec<QpSnapshot>, Vec<TraceReport>)> {
        if qps.len() > proto::MAX_BATCH || mrs.len() > proto::MAX_TRACE_BATCH {
            let states = self.suspend_connected_states(qps)?;
            return Ok((states, self.fetch_traces(mrs)?));
        }
        let request = Request::SuspendAndFetchTraces { qpns: qpns(qps), lkeys: mrs.iter().map(|m| m.lkey).collect() };
        match self.inner.call(&request, &[])? {
            Reply::Suspended { states, traces } if traces.len() == mrs.len() => Ok((states, traces)),
            r => bail!("unexpected reply {r:?}"),
        }
    }

    /// The states of many suspended QPs, in their order (see [`Qp::query_state`]).
    pub fn query_qp_states(&self, qps: &[&Qp]) -> anyhow::Result<Vec<QpSnapshot>> {
        self.chunked(
            qps,
            proto::MAX_QUERY_BATCH,
            |c| Request::QueryQpStates { qpns: qpns(c) },
            |c, r| match r {
                Reply::QpStates(v) if v.len() == c.len() => Ok(v),
                r => Err(r),
            },
        )
    }

    /// Create-suspended for many QPs made ahead: each state goes to the QP
    /// with its QPN (made with [`Pd::create_qp_with_qpn`], still in RESET),
    /// which becomes suspended. Repost WRs, then [`Context::resume_qps`].
    pub fn restore_qps(&self, states: &[QpSnapshot]) -> anyhow::Result<()> {
        self.chunked(states, proto::MAX_QUERY_BATCH, |c| Request::RestoreQps { states: c.to_vec() }, ok_reply).map(drop)
    }

    /// Loads each state into the QP of its QPN, made with
    /// [`NewObject::QpAwaitingState`] and still without a state, which
    /// stays suspended: repost WRs, then [`Context::resume_qps`]. Each
    /// request (MAX_QUERY_BATCH states) is checked whole before any QP
    /// takes its state; any other QP (one that ran, one loaded already) is
    /// refused.
    pub fn load_qp_states(&self, states: &[QpSnapshot]) -> anyhow::Result<()> {
        self.chunked(states, proto::MAX_QUERY_BATCH, |c| Request::LoadQpStates { states: c.to_vec() }, ok_reply).map(drop)
    }

    /// Resumes many QPs in one request (see [`Qp::resume`]).
    pub fn resume_qps(&self, qps: &[&Qp]) -> anyhow::Result<()> {
        self.chunked(qps, proto::MAX_BATCH, |c| Request::ResumeQps { qpns: qpns(c) }, ok_reply).map(drop)
    }

    /// [`claim_gid`](Self::claim_gid), then [`resume_qps`](Self::resume_qps),
    /// the claim riding on the first resume request: a migration's
    /// destination does both inside its downtime, and each request is a
    /// round trip to rnicd. A claim that fails resumes nothing.
    pub fn claim_gid_and_resume_qps(&self, qps: &[&Qp]) -> anyhow::Result<()> {
        let (first, rest) = qps.split_at(qps.len().min(proto::MAX_BATCH));
        match self.inner.call(&Request::ClaimGidAndResumeQps { qpns: qpns(first) }, &[])? {
            Reply::Ok => self.resume_qps(rest),
            r => bail!("unexpected reply {r:?}"),
        }
    }

    /// Asks rnicd to queue this client's asynchronous events and signal
    /// the eventfd `fd` when it does (rnic::async_events).
    pub fn open_async(&self, fd: RawFd) -> anyhow::Result<()> {
        match self.inner.call(&Request::OpenAsync, &[fd])? {
            Reply::Ok => Ok(()),
            r => bail!("unexpected reply {r:?}"),
        }
    }

    /// Takes the asynchronous events rnicd queued for this client.
    pub fn fetch_async(&self) -> anyhow::Result<Vec<AsyncEvent>> {
        match self.inner.call(&Request::FetchAsync, &[])? {
            Reply::AsyncEvents(v) => Ok(v),
            r => bail!("unexpected reply {r:?}"),
        }
    }

    pub fn alloc_pd(&self) -> anyhow::Result<Pd> {
        match self.inner.call(&Request::AllocPd, &[])? {
            Reply::Pd(h) => Ok(Pd { ctx: self.clone(), handle: h }),
            r => bail!("unexpected reply {r:?}"),
        }
    }

    pub fn create_comp_channel(&self) -> anyhow::Result<CompChannel> {
        let efd = rnic::eventfd::create(false)?;
        match self.inner.call(&Request::CreateCompChannel, &[efd.as_raw_fd()])? {
            Reply::Channel(h) => Ok(CompChannel { ctx: self.clone(), handle: h, efd, edge: std::sync::OnceLock::new() }),
            r => bail!("unexpected reply {r:?}"),
        }
    }

    /// Creates a CQ of at least `cqe` entries, optionally tied to a channel.
    pub fn create_cq(&self, cqe: u32, channel: Option<&CompChannel>) -> anyhow::Result<Cq> {
        let cap = cqe.max(1).next_power_of_two();
        let len = ring_bytes::<Cqe>(cap);
        let fd = sealed_memfd("transit-cq", len)?;
        let map = Mapping::map(&fd, 0, len)?;
        // SAFETY: the mapping has `len` bytes and is kept in the Cq.
        let ring = unsafe { Ring::new(map.ptr(), len, cap) }.context("ring")?;
        match self.inner.call(&Request::CreateCq { cap, channel: channel.map(|c| c.handle) }, &[fd.as_raw_fd()])? {
            Reply::Cq(h) => {
                Ok(Cq { ctx: self.clone(), handle: h, ring: Mutex::new(ring), held: Default::default(), map: Mutex::new(map), cap })
            }
            r => bail!("unexpected reply {r:?}"),
        }
    }
}

/// Memory that rnicd can map: a sealed memfd mapped into this process.
pub struct MemBuf {
    fd: OwnedFd,
    map: Mapping,
}

impl MemBuf {
    /// Allocates `len` zeroed bytes (rounded up to pages).
    pub fn new(len: usize) -> anyhow::Result<MemBuf> {
        let len = len.max(1).div_ceil(4096) * 4096;
        let fd = sealed_memfd("transit-mr", len)?;
        let map = Mapping::map(&fd, 0, len)?;
        Ok(MemBuf { fd, map })
    }
    /// Wraps an existing memfd, mapped whole: memory another part of this
    /// process owns (a VM's guest RAM) that rnicd then reaches directly, with
    /// no copy. rnicd maps only memfds that cannot shrink, so the memfd must
    /// carry F_SEAL_SHRINK (checked here too, for a clear error).
    pub fn from_memfd(fd: OwnedFd) -> anyhow::Result<MemBuf> {
        // SAFETY: fcntl/fstat on an fd we own.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            bail!("the memfd must be sealed with F_SEAL_SHRINK for rnicd to map it");
        }
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } < 0 {
            return Err(std::io::Error::last_os_error()).context("fstat");
        }
        let len = st.st_size as usize;
        if len == 0 || !len.is_multiple_of(4096) {
            bail!("the memfd's size {len} is not a positive number of pages");
        }
        let map = Mapping::map(&fd, 0, len)?;
        Ok(MemBuf { fd, map })
    }
    pub fn len(&self) -> usize {
        self.map.len()
    }
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
    /// The virtual address of byte 0 (what a peer puts in remote_addr).
    /// The memfd (for [`NewObject::Mr`], which names memory by descriptor).
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    pub fn addr(&self) -> u64 {
        self.map.ptr() as u64
    }
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.ptr()
    }
    /// A copy of `len` bytes at `off` (the NIC may write concurrently, so no
    /// long-lived references are handed out).
    pub fn read(&self, off: usize, len: usize) -> Vec<u8> {
        assert!(off + len <= self.len(), "read out of bounds");
        let mut v = vec![0u8; len];
        // SAFETY: bounds checked above.
        unsafe { std::ptr::copy_nonoverlapping(self.map.ptr().add(off), v.as_mut_ptr(), len) };
        v
    }
    pub fn write(&self, off: usize, data: &[u8]) {
        assert!(off + data.len() <= self.len(), "write out of bounds");
        // SAFETY: bounds checked above.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.map.ptr().add(off), data.len()) };
    }
    pub fn read_u64(&self, off: usize) -> u64 {
        u64::from_ne_bytes(self.read(off, 8).try_into().unwrap())
    }
    pub fn write_u64(&self, off: usize, v: u64) {
        self.write(off, &v.to_ne_bytes())
    }
    pub fn fill(&self, byte: u8) {
        // SAFETY: whole mapping.
        unsafe { std::ptr::write_bytes(self.map.ptr(), byte, self.len()) };
    }
}

pub struct Pd {
    ctx: Context,
    handle: u32,
}

impl Pd {
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// Registers `len` bytes of `buf` from `off` with `access` (ibv_reg_mr).
    pub fn reg_mr(&self, buf: &MemBuf, off: usize, len: usize, access: u32) -> anyhow::Result<Mr> {
        self.reg_mr_keyed(buf, off, len, access, None, None)
    }

    /// Registers with a chosen key and I/O virtual address: what restoring a
    /// migrated namespace needs (the peer keeps using the old rkey and addresses).
    pub fn reg_mr_at(&self, buf: &MemBuf, off: usize, len: usize, access: u32, key: Option<u32>, iova: u64) -> anyhow::Result<Mr> {
        self.reg_mr_keyed(buf, off, len, access, key, Some(iova))
    }

    /// Like [`Pd::reg_mr`] with a caller-chosen lkey = rkey (refused if the
    /// namespace already has an MR with that key).
    pub fn reg_mr_with_key(&self, buf: &MemBuf, off: usize, len: usize, access: u32, key: u32) -> anyhow::Result<Mr> {
        self.reg_mr_keyed(buf, off, len, access, Some(key), None)
    }

    /// Registers `len` bytes that live at `fd_offset` of the sealed memfd
    /// `fd` (any memfd the caller made, not only a [`MemBuf`]), addressed by
    /// peers as `iova`. The drop-in libibverbs registers ordinary process
    /// memory this way after moving it onto its memfd.
    pub fn reg_mr_fd(&self, fd: RawFd, fd_offset: u64, len: usize, access: u32, iova: u64) -> anyhow::Result<Mr> {
        self.reg_mr_fd_keyed(fd, fd_offset, len, access, iova, None)
    }

    /// [`Pd::reg_mr_fd`] with the lkey/rkey `key` when given (refused if
    /// taken): the drop-in's `ibv_rereg_mr` keeps an MR's keys this way.
    pub fn reg_mr_fd_keyed(&self, fd: RawFd, fd_offset: u64, len: usize, access: u32, iova: u64, key: Option<u32>) -> anyhow::Result<Mr> {
        let req = Request::RegMr { pd: self.handle, iova, len: len as u64, access, fd_offset, key };
        match self.ctx.inner.call(&req, &[fd])? {
            Reply::Mr { lkey, rkey } => Ok(Mr { ctx: self.ctx.clone(), lkey, rkey, addr: iova, len }),
            r => bail!("unexpected reply {r:?}"),
        }
    }

    /// Registers the runs `(offset, len)` of `buf`, laid end to end from
    /// `iova`, as one region (a scattered region, as a VM's pages are):
    /// at most `rnic::mem::MAX_REGION_RUNS` runs, boundaries between runs
    /// on pages, `iova` with the page offset of the first run.
    pub fn reg_mr_runs(&self, buf: &MemBuf, runs: &[(u64, u64)], access: u32, key: Option<u32>, iova: u64) -> anyhow::Result<Mr> {
        let len = runs.iter().try_fold(0u64, |n, r| n.checked_add(r.1)).context("MR length overflows")?;
        let req = Request::RegMrRuns { pd: self.handle, iova, access, runs: runs.to_vec(), key };
        match self.ctx.inner.call(&req, &[buf.fd.as_raw_fd()])? {
            Reply::Mr { lkey, rkey } => Ok(Mr { ctx: self.ctx.clone(), lkey, rkey, addr: iova, len: len as usize }),
            r => bail!("unexpected reply {r:?}"),
        }
    }

    fn reg_mr_keyed(&self, buf: &MemBuf, off: usize, len: usize, access: u32, key: Option<u32>, iova: Option<u64>) -> anyhow::Result<Mr> {
        if off.checked_add(len).is_none_or(|e| e > buf.len()) {
            bail!("MR range outside the buffer");
        }
        let iova = iova.unwrap_or(buf.addr() + off as u64);
        let req = Request::RegMr { pd: self.handle, iova, len: len as u64, access, fd_offset: off as u64, key };
        match self.ctx.inner.call(&req, &[buf.fd.as_raw_fd()])? {
            Reply::Mr { lkey, rkey } => Ok(Mr { ctx: self.ctx.clone(), lkey, rkey, addr: iova, len }),
            r => bail!("unexpected reply {r:?}"),
        }
    }

    pub fn create_qp(&self, init: &QpInitAttr) -> anyhow::Result<Qp> {
        self.create_qp_numbered(init, None, None)
    }

    /// Create-suspended (seed 000): a QP with the creation attributes `init`
    /// and the runtime state of a QP suspended elsewhere, same QPN. It does
    /// nothing until [`Qp::resume`]; repost the WRs first (see
    /// `QpRuntime::sq_retired`).
    pub fn create_qp_suspended(&self, init: &QpInitAttr, state: &QpSnapshot) -> anyhow::Result<Qp> {
        self.create_qp_numbered(init, Some(state.qpn), Some(Box::new(state.clone())))
    }

    /// Like [`Pd::create_qp`] with a caller-chosen QPN (refused if taken in
    /// the namespace).
    pub fn create_qp_with_qpn(&self, init: &QpInitAttr, qpn: u32) -> anyhow::Result<Qp> {
        self.create_qp_numbered(init, Some(qpn), None)
    }

    fn create_qp_numbered(&self, init: &QpInitAttr, qpn: Option<u32>, restore: Option<Box<QpSnapshot>>) -> anyhow::Result<Qp> {
        let cap = init.cap;
        if cap.max_send_sge as usize > MAX_SGE || cap.max_recv_sge as usize > MAX_SGE || cap.max_inline_data as usize > MAX_INLINE {
            bail!("at most {MAX_SGE} SGEs and {MAX_INLINE} bytes inline");
        }
        let sq_slots = cap.max_send_wr.max(1).next_power_of_two();
        let rq_slots = cap.max_recv_wr.max(1).next_power_of_two();
        let sql = ring_bytes::<SendWqe>(sq_slots);
        let rql = ring_bytes::<RecvWqe>(rq_slots);
        let sqfd = sealed_memfd("transit-sq", sql)?;
        let rqfd = sealed_memfd("transit-rq", rql)?;
        let (sqm, rqm) = match init.rings_at {
            // SAFETY: the caller gave us these ranges for the QP's life.
            Some((s, r)) => unsafe { (Mapping::map_at(&sqfd, 0, sql, s as *mut u8)?, Mapping::map_at(&rqfd, 0, rql, r as *mut u8)?) },
            None => (Mapping::map(&sqfd, 0, sql)?, Mapping::map(&rqfd, 0, rql)?),
        };
        sqm.populate_first(rnic::ring::FIRST_USE_BYTES);
        rqm.populate_first(rnic::ring::FIRST_USE_BYTES);
        // SAFETY: mappings of the right size, kept in the Qp.
        let sq = unsafe { Ring::new(sqm.ptr(), sql, sq_slots) }.context("ring")?;
        let rq = unsafe { Ring::new(rqm.ptr(), rql, rq_slots) }.context("ring")?;
        let req = Request::CreateQp {
            pd: self.handle,
            send_cq: init.send_cq,
            recv_cq: init.recv_cq,
            cap,
            sq_sig_all: init.sq_sig_all,
            sq_slots,
            rq_slots,
            qpn,
            restore,
            qp_type: init.qp_type,
        };
        match self.ctx.inner.call(&req, &[sqfd.as_raw_fd(), rqfd.as_raw_fd()])? {
            Reply::Qp { qpn, cap } => Ok(Qp { ctx: self.ctx.clone(), qpn, cap, sq: Mutex::new(sq), rq: Mutex::new(rq), _maps: (sqm, rqm) }),
            r => bail!("unexpected reply {r:?}"),
        }
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        self.ctx.inner.destroy(&Request::DeallocPd { pd: self.handle });
    }
}

pub struct Mr {
    ctx: Context,
    pub lkey: u32,
    pub rkey: u32,
    pub addr: u64,
    pub len: usize,
}

impl Mr {
    /// An SGE covering `len` bytes at offset `off` of this region.
    pub fn sge(&self, off: usize, len: usize) -> Sge {
        Sge { addr: self.addr + off as u64, length: len as u32, lkey: self.lkey }
    }

    /// Starts (or restarts, clearing) a write trace: rnicd records which
    /// `granularity`-byte blocks it writes into (WRITE, SEND, READ
    /// responses, atomics).
    pub fn start_trace(&self, granularity: u64) -> anyhow::Result<()> {
        match self.ctx.inner.call(&Request::TraceMr { lkey: self.lkey, granularity }, &[])? {
            Reply::Ok => Ok(()),
            r => bail!("unexpected reply {r:?}"),
        }
    }

    pub fn stop_trace(&self) -> anyhow::Result<()> {
        match self.ctx.inner.call(&Request::TraceMr { lkey: self.lkey, granularity: 0 }, &[])? {
            Reply::Ok => Ok(()),
            r => bail!("unexpected reply {r:?}"),
        }
    }

    /// Dirty blocks since the last fetch (offsets from the MR start), cleared
    /// in the same step; `all_dirty` when rnicd cannot be precise.
    pub fn fetch_trace(&self) -> anyhow::Result<TraceReport> {
        match self.ctx.inner.call(&Request::FetchTrace { lkey: self.lkey }, &[])? {
            Reply::Trace(t) => Ok(t),
            r => bail!("unexpected reply {r:?}"),
        }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        self.ctx.inner.destroy(&Request::DeregMr { lkey: self.lkey });
    }
}

pub struct CompChannel {
    ctx: Context,
    handle: u32,
    efd: OwnedFd,
    /// An epoll instance watching `efd` edge-triggered, for `Cq::poll_or_wait`.
    edge: std::sync::OnceLock<Epoll>,
}

impl CompChannel {
    /// Waits for a CQ event (ibv_get_cq_event); false on timeout.
    pub fn get_cq_event(&self, timeout: Option<Duration>) -> anyhow::Result<bool> {
        let mut pfd = [PollFd::new(self.efd.as_fd(), PollFlags::POLLIN)];
        let ms = timeout.map_or(PollTimeout::NONE, |t| PollTimeout::try_from(t).unwrap_or(PollTimeout::MAX));
        if poll(&mut pfd, ms).context("poll")? == 0 {
            return Ok(false);
        }
        rnic::eventfd::drain(&self.efd);
        Ok(true)
    }
    pub fn fd(&self) -> RawFd {
        self.efd.as_raw_fd()
    }

    /// A waiter of its own on this channel: an edge-triggered epoll that
    /// never reads the eventfd, so several threads, each with its waiter,
    /// all see every event rnicd raises (a thread that drained the eventfd
    /// would hide it from the others).
    pub fn waiter(&self) -> anyhow::Result<ChannelWaiter> {
        let ep = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).context("epoll_create1")?;
        ep.add(&self.efd, EpollEvent::new(EpollFlags::EPOLLIN | EpollFlags::EPOLLET, 0)).context("epoll_ctl")?;
        // Level-triggered: while the waiter is interrupted every wait ends.
        let brk = rnic::eventfd::create(true).context("eventfd")?;
        ep.add(&brk, EpollEvent::new(EpollFlags::EPOLLIN, 1)).context("epoll_ctl")?;
        Ok(ChannelWaiter { ep, brk, interrupted: std::sync::atomic::AtomicBool::new(false) })
    }

    /// Waits for the next channel event without reading the eventfd: an
    /// edge-triggered epoll reports every write rnicd makes after the last
    /// wait, whatever the count, so a wakeup costs one syscall, not a poll
    /// and a read. May report an event that an earlier arm raised: callers
    /// poll their CQ after it anyway. False on timeout.
    fn wait_edge(&self, timeout: Duration) -> anyhow::Result<bool> {
        let ep = match self.edge.get() {
            Some(ep) => ep,
            None => {
                let ep = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).context("epoll_create1")?;
                ep.add(&self.efd, EpollEvent::new(EpollFlags::EPOLLIN | EpollFlags::EPOLLET, 0)).context("epoll_ctl")?;
                let _ = self.edge.set(ep);
                self.edge.get().expect("just set")
            }
        };
        let ms = EpollTimeout::try_from(timeout).unwrap_or(EpollTimeout::MAX);
        let mut ev = [EpollEvent::empty()];
        match ep.wait(&mut ev, ms) {
            Ok(n) => Ok(n > 0),
            Err(nix::errno::Errno::EINTR) => Ok(false),
            Err(e) => Err(e).context("epoll_wait"),
        }
    }
}

/// One thread's view of a completion channel (`CompChannel::waiter`).
pub struct ChannelWaiter {
    ep: Epoll,
    /// Signalled by [`ChannelWaiter::interrupt`], cleared by
    /// [`ChannelWaiter::clear_interrupt`].
    brk: OwnedFd,
    interrupted: std::sync::atomic::AtomicBool,
}

impl ChannelWaiter {
    /// Waits for a channel event raised since the last wait (or since the
    /// waiter was made); false on timeout, signal or while interrupted. An
    /// event may belong to an earlier arm or another CQ of the channel:
    /// callers look at their CQ afterwards anyway.
    /// epoll counts in milliseconds: a timeout is rounded up to the next
    /// one (rounding down would make a sub-millisecond wait a spin).
    pub fn wait(&self, timeout: Duration) -> anyhow::Result<bool> {
        if self.is_interrupted() {
            return Ok(false);
        }
        let ms = Duration::from_millis(timeout.as_micros().div_ceil(1000) as u64);
        let ms = EpollTimeout::try_from(ms).unwrap_or(EpollTimeout::MAX);
        let mut ev = [EpollEvent::empty()];
        match self.ep.wait(&mut ev, ms) {
            Ok(n) => Ok(n > 0 && ev[0].data() == 0),
            Err(nix::errno::Errno::EINTR) => Ok(false),
            Err(e) => Err(e).context("epoll_wait"),
        }
    }

    /// Ends every wait of this waiter, those under way and those to come,
    /// until [`ChannelWaiter::clear_interrupt`]: a thread that must not
    /// sleep now (a vCPU being stopped) returns at once.
    pub fn interrupt(&self) {
        self.interrupted.store(true, Ordering::Release);
        rnic::eventfd::signal(&self.brk);
    }

    /// Waits sleep again.
    pub fn clear_interrupt(&self) {
        self.interrupted.store(false, Ordering::Release);
        rnic::eventfd::drain(&self.brk);
    }

    pub fn is_interrupted(&self) -> bool {
        self.interrupted.load(Ordering::Acquire)
    }
}

impl Drop for CompChannel {
    fn drop(&mut self) {
        self.ctx.inner.destroy(&Request::DestroyCompChannel { channel: self.handle });
    }
}

/// A work completion (ibv_wc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Wc {
    pub wr_id: u64,
    pub status: WcStatus,
    pub opcode: WcOpcode,
    pub byte_len: u32,
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: u8,
}

impl Default for Wc {
    fn default() -> Self {
        Wc { wr_id: 0, status: WcStatus::Success, opcode: WcOpcode::Send, byte_len: 0, imm_data: 0, qp_num: 0, src_qp: 0, wc_flags: 0 }
    }
}

pub struct Cq {
    ctx: Context,
    handle: u32,
    ring: Mutex<Ring<Cqe>>,
    /// Completions taken off the ring by `discard_qp` and not yet polled,
    /// handed out before the ring's (lock order: ring, then held).
    held: Mutex<std::collections::VecDeque<Cqe>>,
    /// The ring's memory (replaced with the ring by `resize`).
    map: Mutex<Mapping>,
    /// The ring's size at creation (`resize` may change it).
    pub cap: u32,
}

impl Cq {
    /// rnicd's handle of this CQ (the object of its asynchronous events).
    pub fn handle(&self) -> u32 {
        self.handle
    }

    /// ibv_resize_cq: moves the CQ to a new ring of at least `cqe` entries
    /// and returns its size. Completions left in the old ring are handed
    /// out first, then the new ring's.
    pub fn resize(&self, cqe: u32) -> anyhow::Result<u32> {
        let cap = cqe.max(1).next_power_of_two();
        let len = ring_bytes::<Cqe>(cap);
        let fd = sealed_memfd("transit-cq", len)?;
        let map = Mapping::map(&fd, 0, len)?;
        // SAFETY: the mapping has `len` bytes and is kept beside the ring.
        let ring = unsafe { Ring::new(map.ptr(), len, cap) }.context("ring")?;
        let mut r = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        match self.ctx.inner.call(&Request::ResizeCq { cq: self.handle, cap }, &[fd.as_raw_fd()])? {
            Reply::Ok => {}
            r => bail!("unexpected reply {r:?}"),
        }
        // rnicd writes no more into the old ring: what is there comes first.
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        while let Some(c) = r.pop() {
            held.push_back(c);
        }
        let lost = r.header().error.load(Ordering::Acquire);
        ring.header().error.fetch_or(lost, Ordering::AcqRel);
        *r = ring;
        *self.map.lock().unwrap_or_else(|e| e.into_inner()) = map;
        Ok(cap)
    }

    /// The completions the CQ holds once rnicd has taken what its QPs
    /// posted and completed what needs no peer (UD sends, flushes; rnicd's
    /// SettleCq): what ibv_resize_cq weighs a shrink against. WRs waiting
    /// for a peer's answer are not counted, as on a hardware CQ.
    pub fn settled(&self) -> anyhow::Result<u32> {
        match self.ctx.inner.call(&Request::SettleCq { cq: self.handle }, &[])? {
            Reply::Ok => Ok(self.ready()),
            r => bail!("unexpected reply {r:?}"),
        }
    }

    /// Completions in the ring not yet polled.
    pub fn ready(&self) -> u32 {
        let r = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        r.ready() + self.held.lock().unwrap_or_else(|e| e.into_inner()).len() as u32
    }

    /// Drops the unpolled completions of QP `qpn`, as kernel drivers clean
    /// a CQ when a QP of theirs goes to RESET; the others stay in order.
    pub fn discard_qp(&self, qpn: u32) {
        let mut r = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        while let Some(c) = r.pop() {
            held.push_back(c);
        }
        held.retain(|c| c.qp_num != qpn);
    }

    /// ibv_poll_cq: fills `wc` with up to `wc.len()` completions.
    pub fn poll(&self, wc: &mut [Wc]) -> anyhow::Result<usize> {
        let mut r = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        if r.header().error.load(Ordering::Acquire) != 0 {
            bail!("CQ overrun: completions were lost");
        }
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        let mut n = 0;
        while n < wc.len() {
            let Some(c) = held.pop_front().or_else(|| r.pop()) else { break };
            wc[n] = Wc {
                wr_id: c.wr_id,
                status: WcStatus::from_u8(c.status),
                opcode: WcOpcode::from_u8(c.opcode),
                byte_len: c.byte_len,
                imm_data: c.imm,
                qp_num: c.qp_num,
                src_qp: c.src_qp,
                wc_flags: c.wc_flags,
            };
            n += 1;
        }
        Ok(n)
    }

    /// ibv_req_notify_cq: the channel fires on the next (solicited) completion.
    pub fn req_notify(&self, solicited_only: bool) {
        let r = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        r.header().notify.store(if solicited_only { NOTIFY_SOLICITED } else { NOTIFY_NEXT }, Ordering::Release);
        // Store (arm) then load (poll) against rnicd's store (CQE) then load
        // (arm flag): without a full fence both sides may miss each other.
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    /// Whether the CQ is still armed (req_notify called, no event raised
    /// since): rnicd clears the arm when it signals the channel, so a CQ
    /// sharing a channel with others can tell that the event was its own.
    pub fn armed(&self) -> bool {
        let r = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        r.header().notify.load(Ordering::Acquire) != rnic::ring::NOTIFY_NONE
    }

    /// Polls for completions, spinning (without yielding) for up to `spin`,
    /// then arms `channel` and sleeps on it until a completion arrives or
    /// `timeout` passes (then returns 0). The CQ must have been created with
    /// `channel`. Spinning catches a completion that is microseconds away
    /// without a wakeup; sleeping leaves the CPU to rnicd and the peer,
    /// which on a small host is what a ping-pong waits for.
    pub fn poll_or_wait(&self, wc: &mut [Wc], channel: &CompChannel, spin: Duration, timeout: Duration) -> anyhow::Result<usize> {
        self.poll_or_wait_for(wc, channel, spin, timeout, false)
    }

    /// As [`Cq::poll_or_wait`], woken only by a solicited completion (or
    /// an error one): completions of unsolicited messages wait in the CQ
    /// for the next solicited one, or for `timeout`, and then come
    /// together, so that a receiver of a stream of messages wakes once per
    /// several of them.
    pub fn poll_or_wait_solicited(&self, wc: &mut [Wc], channel: &CompChannel, timeout: Duration) -> anyhow::Result<usize> {
        self.poll_or_wait_for(wc, channel, Duration::ZERO, timeout, true)
    }

    fn poll_or_wait_for(
        &self,
        wc: &mut [Wc],
        channel: &CompChannel,
        spin: Duration,
        timeout: Duration,
        solicited_only: bool,
    ) -> anyhow::Result<usize> {
        let t0 = std::time::Instant::now();
        loop {
            let n = self.poll(wc)?;
            if n > 0 {
                return Ok(n);
            }
            if t0.elapsed() >= spin {
                break;
            }
            std::hint::spin_loop();
        }
        loop {
            self.req_notify(solicited_only);
            // A completion that landed before the arm raised no event: poll again.
            let n = self.poll(wc)?;
            if n > 0 {
                return Ok(n);
            }
            let left = timeout.saturating_sub(t0.elapsed());
            if left.is_zero() || !channel.wait_edge(left.max(Duration::from_millis(1)))? {
                return self.poll(wc);
            }
        }
    }

    /// Polls until `n` completions arrived or `timeout` passed (tests, tools).
    pub fn wait(&self, n: usize, timeout: Duration) -> anyhow::Result<Vec<Wc>> {
        let t0 = std::time::Instant::now();
        let mut out = Vec::with_capacity(n);
        let mut buf = [Wc::default(); 64];
        let mut spins = 0u32;
        while out.len() < n {
            let k = self.poll(&mut buf[..(n - out.len()).min(64)])?;
            out.extend_from_slice(&buf[..k]);
            if k == 0 {
                spins += 1;
                if spins > 1000 {
                    std::thread::sleep(Duration::from_micros(50));
                } else {
                    std::hint::spin_loop();
                }
                if t0.elapsed() > timeout {
                    bail!("timed out with {} of {n} completions", out.len());
                }
            } else {
                spins = 0;
            }
        }
        Ok(out)
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        self.ctx.inner.destroy(&Request::DestroyCq { cq: self.handle });
    }
}

pub struct QpInitAttr {
    pub send_cq: u32,
    pub recv_cq: u32,
    pub cap: QpCap,
    pub sq_sig_all: bool,
    pub qp_type: QpType,
    /// Where to map the send and receive rings instead of where the kernel
    /// chooses: page-aligned addresses of memory the caller owns, of
    /// [`qp_ring_bytes`] each (the ibverbs drop-in's parent-domain
    /// allocators). The pages there are replaced; after the QP is dropped
    /// the ranges are unmapped and the caller maps them again.
    pub rings_at: Option<(usize, usize)>,
}

/// The bytes of a QP's send and receive rings for `cap`.
pub fn qp_ring_bytes(cap: &QpCap) -> (usize, usize) {
    let sq_slots = cap.max_send_wr.max(1).next_power_of_two();
    let rq_slots = cap.max_recv_wr.max(1).next_power_of_two();
    (ring_bytes::<SendWqe>(sq_slots), ring_bytes::<RecvWqe>(rq_slots))
}

impl QpInitAttr {
    pub fn new(send_cq: &Cq, recv_cq: &Cq) -> QpInitAttr {
        QpInitAttr {
            send_cq: send_cq.handle,
            recv_cq: recv_cq.handle,
            cap: QpCap { max_send_wr: 256, max_recv_wr: 256, max_send_sge: 4, max_recv_sge: 4, max_inline_data: 128 },
            sq_sig_all: false,
            qp_type: QpType::Rc,
            rings_at: None,
        }
    }
}

/// Where a UD send goes (the address handle, remote QPN and Q_Key of
/// ibv_send_wr's `wr.ud`). A `qkey` with the high bit set sends the QP's own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UdDest {
    pub gid: Ipv4Addr,
    pub qpn: u32,
    pub qkey: u32,
}

/// A send work request (ibv_send_wr); `inline` carries inline data instead of SGEs.
#[derive(Clone, Copy, Debug)]
pub struct SendWr<'a> {
    pub wr_id: u64,
    pub opcode: WrOpcode,
    pub flags: u8,
    pub sg_list: &'a [Sge],
    pub inline: Option<&'a [u8]>,
    /// Immediate data (host order), or the rkey to invalidate for SendInv.
    pub imm: u32,
    pub remote_addr: u64,
    pub rkey: u32,
    pub compare_add: u64,
    pub swap: u64,
    /// UD QPs: the destination (required there, ignored by RC QPs).
    pub ud: Option<UdDest>,
}

impl<'a> SendWr<'a> {
    pub fn new(wr_id: u64, opcode: WrOpcode, sg_list: &'a [Sge]) -> SendWr<'a> {
        SendWr {
            wr_id,
            opcode,
            flags: send_flags::SIGNALED,
            sg_list,
            inline: None,
            imm: 0,
            remote_addr: 0,
            rkey: 0,
            compare_add: 0,
            swap: 0,
            ud: None,
        }
    }
    /// A UD SEND to `dest`.
    pub fn send_to(wr_id: u64, sg: &'a [Sge], dest: UdDest) -> Self {
        SendWr { ud: Some(dest), ..Self::new(wr_id, WrOpcode::Send, sg) }
    }
    pub fn send(wr_id: u64, sg: &'a [Sge]) -> Self {
        Self::new(wr_id, WrOpcode::Send, sg)
    }
    pub fn write(wr_id: u64, sg: &'a [Sge], remote_addr: u64, rkey: u32) -> Self {
        SendWr { remote_addr, rkey, ..Self::new(wr_id, WrOpcode::RdmaWrite, sg) }
    }
    pub fn read(wr_id: u64, sg: &'a [Sge], remote_addr: u64, rkey: u32) -> Self {
        SendWr { remote_addr, rkey, ..Self::new(wr_id, WrOpcode::RdmaRead, sg) }
    }
    pub fn cmp_swap(wr_id: u64, sg: &'a [Sge], remote_addr: u64, rkey: u32, compare: u64, swap: u64) -> Self {
        SendWr { remote_addr, rkey, compare_add: compare, swap, ..Self::new(wr_id, WrOpcode::AtomicCmpSwp, sg) }
    }
    pub fn fetch_add(wr_id: u64, sg: &'a [Sge], remote_addr: u64, rkey: u32, add: u64) -> Self {
        SendWr { remote_addr, rkey, compare_add: add, ..Self::new(wr_id, WrOpcode::AtomicFetchAdd, sg) }
    }
    pub fn with_imm(mut self, imm: u32) -> Self {
        self.imm = imm;
        self.opcode = match self.opcode {
            WrOpcode::Send => WrOpcode::SendImm,
            WrOpcode::RdmaWrite => WrOpcode::RdmaWriteImm,
            o => o,
        };
        self
    }
    pub fn with_inline(mut self, data: &'a [u8]) -> Self {
        self.inline = Some(data);
        self.flags |= send_flags::INLINE;
        self
    }
    /// Sets the solicited event bit of the message's last packet: a
    /// receiver waiting for solicited completions only wakes for it.
    pub fn solicited(mut self) -> Self {
        self.flags |= send_flags::SOLICITED;
        self
    }
    pub fn unsignaled(mut self) -> Self {
        self.flags &= !send_flags::SIGNALED;
        self
    }
    pub fn with_flags(mut self, f: u8) -> Self {
        self.flags |= f;
        self
    }
}

/// A receive work request (ibv_recv_wr).
#[derive(Clone, Copy, Debug)]
pub struct RecvWr<'a> {
    pub wr_id: u64,
    pub sg_list: &'a [Sge],
}

/// One WR of a send chain for [`Qp::try_post_send`]: an ordinary WR, or a
/// key-table one (as [`Qp::post_key_ops`] posts them).
#[derive(Clone, Copy, Debug)]
pub enum SendOp<'a> {
    Wr(SendWr<'a>),
    Key(mkeys::KeyOp<'a>),
}

/// A post that stopped short ([`Qp::try_post_send`], [`Qp::try_post_recv`],
/// [`Srq::try_post_recv`]): the first `posted` WRs are queued, the others
/// are not.
#[derive(Debug)]
pub struct PostError {
    /// WRs queued (those before the one that stopped the post).
    pub posted: usize,
    /// The queue was full; else WR `posted` was refused (`error` says why).
    pub full: bool,
    pub error: anyhow::Error,
}

impl PostError {
    fn stopped(posted: usize, stop: Stop, queue: &str) -> PostError {
        match stop {
            Stop::Full => PostError { posted, full: true, error: anyhow!("{queue} full") },
            Stop::Refused(error) => PostError { posted, full: false, error },
        }
    }
}

impl std::fmt::Display for PostError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#} ({} WRs posted)", self.error, self.posted)
    }
}

impl std::error::Error for PostError {}

/// Why a post stopped (a full queue's error is made once the lock is let
/// go).
enum Stop {
    Full,
    Refused(anyhow::Error),
}

/// Free slots of a receive queue `depth` WRs deep: the ring is a power of
/// two, at least `depth`, and the rest of it is not the queue's. rnicd
/// takes a receive from the ring only when a message needs it, so the
/// ring holds exactly the receives not yet used.
fn queue_room<T: Copy>(ring: &Ring<T>, depth: u32) -> u32 {
    ring.free_slots().saturating_sub(ring.cap() - depth.min(ring.cap()))
}

/// Free slots of a send queue `depth` WRs deep: a WR holds its slot from
/// its post until rnicd is done with it (it completed, signaled or not, or
/// was flushed), as on hardware, not only until rnicd takes it from the
/// ring, which it does at once.
fn send_queue_room(ring: &Ring<SendWqe>, depth: u32) -> u32 {
    ring.free_slots().min(depth.saturating_sub(ring.outstanding()))
}

/// Pushes the receive WQEs of `wrs` in order into `ring` (a QP's or an
/// SRQ's, locked by the caller): at most `room`, each with at most
/// `max_sge` SGEs. Returns how many went in, and why it stopped if it did.
fn push_recv_wqes(ring: &mut Ring<RecvWqe>, wrs: &[RecvWr], max_sge: u32, room: usize) -> (usize, Option<Stop>) {
    for (posted, wr) in wrs.iter().enumerate() {
        if wr.sg_list.len() > max_sge as usize {
            return (posted, Some(Stop::Refused(anyhow!("{} SGEs exceed max_recv_sge {max_sge}", wr.sg_list.len()))));
        }
        let mut r = RecvWqe { wr_id: wr.wr_id, num_sge: wr.sg_list.len() as u32, ..Default::default() };
        r.sge[..wr.sg_list.len()].copy_from_slice(wr.sg_list);
        if posted == room || !ring.push(&r) {
            return (posted, Some(Stop::Full));
        }
    }
    (wrs.len(), None)
}

/// What the peer tells us out of band to connect a QP.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct QpEndpoint {
    pub gid: Ipv4Addr,
    pub qpn: u32,
    pub psn: u32,
}

#[derive(Clone, Copy, Debug)]
pub struct ConnectOpts {
    /// The largest path MTU wanted. An IB size (256..4096) is capped at the
    /// port's active MTU, so that packets fit the link whole (the default,
    /// 4096, thus takes the port's); the software-link sizes above 4096
    /// are taken as asked, for rnicd peers that want IP to fragment.
    pub mtu: Mtu,
    pub access: u32,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub min_rnr_timer: u8,
    pub max_rd_atomic: u8,
    pub sq_psn: u32,
}

impl Default for ConnectOpts {
    fn default() -> Self {
        ConnectOpts {
            mtu: Mtu::M4096,
            access: access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            max_rd_atomic: 16,
            sq_psn: 0,
        }
    }
}

pub struct Qp {
    ctx: Context,
    pub qpn: u32,
    pub cap: QpCap,
    sq: Mutex<Ring<SendWqe>>,
    rq: Mutex<Ring<RecvWqe>>,
    _maps: (Mapping, Mapping),
}

impl Qp {
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// ibv_modify_qp.
    pub fn modify(&self, attr: &QpAttr, mask: u32) -> anyhow::Result<()> {
        match self.ctx.inner.call(&Request::ModifyQp { qpn: self.qpn, attr: *attr, mask }, &[])? {
            Reply::Ok => Ok(()),
            r => bail!("unexpected reply {r:?}"),
        }
    }

    /// ibv_query_qp.
    pub fn query(&self) -> anyhow::Result<(QpAttr, QpCap)> {
        match self.ctx.inner.call(&Request::QueryQp { qpn: self.qpn }, &[])? {
            Reply::QpInfo { attr, cap } => Ok((attr, cap)),
            r => bail!("unexpected reply {r:?}"),
        }
    }

    /// Suspend: rnicd stops processing this QP and touching its memory;
    /// the peer sees RNR NAKs (and keeps retrying with rnr_retry 7).
    pub fn suspend(&self) -> anyhow::Result<()> {
        match self.ctx.inner.call(&Request::SuspendQp { qpn: self.qpn }, &[])? {
            Reply::Ok => Ok(()),
            r => bail!("unexpected reply {r:?}"),
        }
    }

    /// Query-suspended: the runtime state (docs/rdma-migration.md).
    pub fn query_state(&self) -> anyhow::Result<QpSnapshot> {
        match self.ctx.inner.call(&Request::QueryQpState { qpn: self.qpn }, &[])? {
            Reply::QpState(s) => Ok(*s),
            r => bail!("unexpected reply {r:?}"),
        }
    }

    /// Resume a suspended or created-suspended QP.
    pub fn resume(&self) -> anyhow::Result<()> {
        match self.ctx.inner.call(&Request::ResumeQp { qpn: self.qpn }, &[])? {
            Reply::Ok => Ok(()),
            r => bail!("unexpected reply {r:?}"),
        }
    }

    pub fn state(&self) -> anyhow::Result<QpState> {
        Ok(self.query()?.0.qp_state)
    }

    /// Our side of the out-of-band exchange.
    pub fn endpoint(&self, psn: u32) -> QpEndpoint {
        QpEndpoint { gid: self.ctx.gid(), qpn: self.qpn, psn }
    }

    /// RESET -> INIT -> RTR -> RTS towards `remote`, as every verbs program does.
    pub fn connect(&self, remote: &QpEndpoint, o: &ConnectOpts) -> anyhow::Result<()> {
        let mut a = self.init_then_rtr(remote, o, true)?;
        a.qp_state = QpState::Rts;
        a.sq_psn = o.sq_psn;
        a.timeout = o.timeout;
        a.retry_cnt = o.retry_cnt;
        a.rnr_retry = o.rnr_retry;
        a.max_rd_atomic = o.max_rd_atomic;
        self.modify(&a, mask::STATE | mask::SQ_PSN | mask::TIMEOUT | mask::RETRY_CNT | mask::RNR_RETRY | mask::MAX_QP_RD_ATOMIC)
    }

    /// RESET -> INIT -> RTR towards `remote`; with `rc`, RTR also sets the
    /// responder's READ/atomic depth and RNR timer, which UC refuses.
    fn init_then_rtr(&self, remote: &QpEndpoint, o: &ConnectOpts, rc: bool) -> anyhow::Result<QpAttr> {
        let mut a = QpAttr { qp_state: QpState::Init, qp_access_flags: o.access, port_num: 1, ..Default::default() };
        self.modify(&a, mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::ACCESS_FLAGS)?;
        a.qp_state = QpState::Rtr;
        a.path_mtu = self.path_mtu(o.mtu)?;
        a.dest_gid = remote.gid;
        a.dest_qp_num = remote.qpn;
        a.rq_psn = remote.psn;
        let mut m = mask::STATE | mask::AV | mask::PATH_MTU | mask::DEST_QPN | mask::RQ_PSN;
        if rc {
            a.max_dest_rd_atomic = o.max_rd_atomic;
            a.min_rnr_timer = o.min_rnr_timer;
            m |= mask::MAX_DEST_RD_ATOMIC | mask::MIN_RNR_TIMER;
        }
        self.modify(&a, m)?;
        Ok(a)
    }

    /// The path MTU `connect` sets for `wanted` (see [`ConnectOpts::mtu`]).
    fn path_mtu(&self, wanted: Mtu) -> anyhow::Result<Mtu> {
        if wanted.bytes() > Mtu::M4096.bytes() {
            return Ok(wanted);
        }
        let active = self.ctx.query_port(1)?.active_mtu;
        Ok(if active.bytes() < wanted.bytes() { active } else { wanted })
    }

    /// A UC QP from RESET to RTS towards `remote`: INIT, RTR and RTS with
    /// UC's attributes (RC's without retransmission, RNR and READ/atomic
    /// ones: Linux's `qp_state_table` refuses those on UC).
    pub fn uc_connect(&self, remote: &QpEndpoint, o: &ConnectOpts) -> anyhow::Result<()> {
        let mut a = self.init_then_rtr(remote, o, false)?;
        a.qp_state = QpState::Rts;
        a.sq_psn = o.sq_psn;
        self.modify(&a, mask::STATE | mask::SQ_PSN)
    }

    /// A UD QP from RESET to RTS as UD programs do: INIT with P_Key index
    /// 0, port 1 and `qkey`, RTR, then RTS sending from `sq_psn`.
    pub fn ud_activate(&self, qkey: u32, sq_psn: u32) -> anyhow::Result<()> {
        let mut a = QpAttr { qp_state: QpState::Init, port_num: 1, qkey, ..Default::default() };
        self.modify(&a, mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::QKEY)?;
        a.qp_state = QpState::Rtr;
        self.modify(&a, mask::STATE)?;
        a.qp_state = QpState::Rts;
        a.sq_psn = sq_psn;
        self.modify(&a, mask::STATE | mask::SQ_PSN)
    }

    /// Send WRs the queue takes now: rnicd frees a slot only when it has
    /// taken the WQE, so a producer that may outrun it (a device posting
    /// what its guest queued) asks before it consumes its own queue.
    pub fn send_room(&self) -> u32 {
        self.sq.lock().unwrap_or_else(|e| e.into_inner()).free_slots()
    }

    /// ibv_post_send: queues the WRs in order, then rings the doorbell once.
    /// Fails (posting nothing more) when the send queue is full.
    pub fn post_send(&self, wrs: &[SendWr]) -> anyhow::Result<()> {
        self.post_send_inner(wrs, true)
    }

    /// Posts send WRs without ringing the doorbell, for a suspended QP:
    /// rnicd reads its rings when it resumes (as [`Qp::post_recv_quiet`]).
    pub fn post_send_quiet(&self, wrs: &[SendWr]) -> anyhow::Result<()> {
        self.post_send_inner(wrs, false)
    }

    fn post_send_inner(&self, wrs: &[SendWr], doorbell: bool) -> anyhow::Result<()> {
        self.push_sends(wrs, |wr| self.send_wqe(wr), doorbell, false, false).map_err(|e| e.error)
    }

    /// ibv_post_send as a driver posts a chain: its WRs, ordinary and
    /// key-table ones, go in order under one hold of the send queue's lock
    /// with one doorbell, into a queue `max_send_wr` deep (not the ring's
    /// power of two), so that threads posting to one QP at once never
    /// split each other's chains or overfill the queue. Stops at the first
    /// WR that does not fit or is refused; the error says how many went in.
    /// With `whole`, a chain that does not fit whole is not posted at all
    /// (ibv_wr_complete).
    pub fn try_post_send(&self, ops: &[SendOp], whole: bool) -> Result<(), PostError> {
        let wqe = |op: &SendOp| match op {
            SendOp::Wr(wr) => self.send_wqe(wr),
            SendOp::Key(k) => k.wqe(),
        };
        self.push_sends(ops, wqe, true, true, whole)
    }

    /// Pushes the WQEs of `items` in order, the send ring locked, until one
    /// does not fit (in the ring, or in `max_send_wr` if `capped`) or is
    /// refused; with `whole`, none unless all fit.
    fn push_sends<T>(
        &self,
        items: &[T],
        wqe: impl Fn(&T) -> anyhow::Result<SendWqe>,
        doorbell: bool,
        capped: bool,
        whole: bool,
    ) -> Result<(), PostError> {
        let mut ring = self.sq.lock().unwrap_or_else(|e| e.into_inner());
        let room = if capped { send_queue_room(&ring, self.cap.max_send_wr) } else { ring.free_slots() } as usize;
        let mut posted = 0;
        let mut stop = None;
        if whole && items.len() > room {
            stop = Some(Stop::Full);
        } else {
            for item in items {
                if posted == room {
                    stop = Some(Stop::Full);
                    break;
                }
                match wqe(item) {
                    Ok(w) if ring.push(&w) => posted += 1,
                    Ok(_) => {
                        stop = Some(Stop::Full);
                        break;
                    }
                    Err(e) => {
                        stop = Some(Stop::Refused(e));
                        break;
                    }
                }
            }
        }
        self.finish_post(ring, posted, doorbell);
        match stop {
            None => Ok(()),
            Some(s) => Err(PostError::stopped(posted, s, "send queue")),
        }
    }

    /// The WQE of an ordinary send WR.
    fn send_wqe(&self, wr: &SendWr) -> anyhow::Result<SendWqe> {
        if wr.opcode.is_local() {
            // A bind's ranges do not fit an SGE list's limits: its own call builds it.
            bail!("{:?} is posted with Qp::post_key_ops", wr.opcode);
        }
        let mut w = SendWqe {
            wr_id: wr.wr_id,
            opcode: wr.opcode as u8,
            flags: wr.flags,
            imm: wr.imm,
            remote_addr: wr.remote_addr,
            rkey: wr.rkey,
            compare_add: wr.compare_add,
            swap: wr.swap,
            ..Default::default()
        };
        if let Some(d) = wr.ud {
            w.ud_dest = u32::from(d.gid);
            w.ud_qpn = d.qpn;
            w.ud_qkey = d.qkey;
        }
        if let Some(d) = wr.inline {
            let operand = wr.opcode == WrOpcode::AtomicWrite && d.len() == 8;
            if (d.len() > self.cap.max_inline_data as usize && !operand) || wr.opcode.is_read_or_atomic() {
                bail!("inline data of {} bytes exceeds max_inline_data {}", d.len(), self.cap.max_inline_data);
            }
            w.inline[..d.len()].copy_from_slice(d);
            w.inline_len = d.len() as u32;
            w.flags |= send_flags::INLINE;
        } else {
            if wr.sg_list.len() > self.cap.max_send_sge as usize {
                bail!("{} SGEs exceed max_send_sge {}", wr.sg_list.len(), self.cap.max_send_sge);
            }
            w.num_sge = wr.sg_list.len() as u8;
            w.sge[..wr.sg_list.len()].copy_from_slice(wr.sg_list);
            w.flags &= !send_flags::INLINE;
        }
        Ok(w)
    }

    /// The end of a post of `n` WQEs, the ring still locked: the doorbell
    /// (if `doorbell` and rnicd is not polling the ring: while it polls,
    /// after recent activity, it sees the WQEs without one, a syscall and a
    /// wake-up saved per post); then, the lock let go, the posting thread
    /// moves off rnicd's CPU the first time (`placement`).
    fn finish_post<T: Copy>(&self, ring: std::sync::MutexGuard<'_, Ring<T>>, n: usize, doorbell: bool) {
        if n > 0 && doorbell && ring.needs_doorbell() {
            self.ctx.inner.ring_doorbell(self.qpn);
        }
        drop(ring);
        if n > 0 {
            self.ctx.inner.rnicd_cpu.keep_off();
        }
    }

    /// ibv_post_recv.
    pub fn post_recv(&self, wrs: &[RecvWr]) -> anyhow::Result<()> {
        self.post_recv_inner(wrs, true)
    }

    /// Posts receive WRs without ringing the doorbell: for a suspended QP
    /// (rnicd reads its rings when it resumes) or a QP in RESET, where a
    /// doorbell only wakes rnicd for nothing. Reposting the WRs of 1,000
    /// moved QPs this way saves 1,000 doorbells (10-20 ms) on the move's
    /// critical path.
    pub fn post_recv_quiet(&self, wrs: &[RecvWr]) -> anyhow::Result<()> {
        self.post_recv_inner(wrs, false)
    }

    fn post_recv_inner(&self, wrs: &[RecvWr], doorbell: bool) -> anyhow::Result<()> {
        self.push_recvs(wrs, doorbell, false).map_err(|e| e.error)
    }

    /// ibv_post_recv as a driver posts a chain: in order under one hold of
    /// the receive queue's lock, into a queue `max_recv_wr` deep (not the
    /// ring's power of two), so that threads posting to one QP at once
    /// never overfill it. Stops at the first WR that does not fit or is
    /// refused; the error says how many went in.
    pub fn try_post_recv(&self, wrs: &[RecvWr]) -> Result<(), PostError> {
        self.push_recvs(wrs, true, true)
    }

    fn push_recvs(&self, wrs: &[RecvWr], doorbell: bool, capped: bool) -> Result<(), PostError> {
        let mut ring = self.rq.lock().unwrap_or_else(|e| e.into_inner());
        let room = if capped { queue_room(&ring, self.cap.max_recv_wr) } else { ring.free_slots() } as usize;
        let (posted, stop) = push_recv_wqes(&mut ring, wrs, self.cap.max_recv_sge, room);
        self.finish_post(ring, posted, doorbell);
        match stop {
            None => Ok(()),
            Some(s) => Err(PostError::stopped(posted, s, "receive queue")),
        }
    }

    /// Free slots in the send ring now (for pipelining tools).
    pub fn send_slots(&self) -> u32 {
        queue_room(&self.sq.lock().unwrap_or_else(|e| e.into_inner()), self.cap.max_send_wr)
    }

    /// Free slots in the receive ring now: a caller posting a chain can
    /// tell which WR would overflow the queue before posting any.
    pub fn recv_slots(&self) -> u32 {
        queue_room(&self.rq.lock().unwrap_or_else(|e| e.into_inner()), self.cap.max_recv_wr)
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        self.ctx.inner.destroy(&Request::DestroyQp { qpn: self.qpn });
    }
}

/// The QPNs of `qps`, for a batched request.
fn qpns(qps: &[&Qp]) -> Vec<u32> {
    qps.iter().map(|q| q.qpn).collect()
}

/// For [`Context::chunked`]: a request answered with `Ok` alone.
fn ok_reply<T>(_: &[T], r: Reply) -> Result<Vec<()>, Reply> {
    match r {
        Reply::Ok => Ok(Vec::new()),
        r => Err(r),
    }
}
