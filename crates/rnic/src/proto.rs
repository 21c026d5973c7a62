//! The control protocol between a client (the verbs crate) and rnicd.
//!
//! One SOCK_SEQPACKET unix connection per client; each message is one JSON
//! object, file descriptors (memfds, eventfds) travel as SCM_RIGHTS beside it.
//! The data path does not use this socket: it uses the shared rings.

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use anyhow::{bail, Context as _};
use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};
use serde::{Deserialize, Serialize};

use crate::types::{DeviceAttr, PortAttr, QpAttr, QpCap};

pub const MAX_MSG: usize = 64 * 1024;
pub const MAX_FDS: usize = 4;
pub const PROTO_VERSION: u32 = 1;
/// Most QPNs in one batched request.
pub const MAX_BATCH: usize = 4096;
/// Most QP states in one QueryQpStates reply (it must fit in MAX_MSG).
pub const MAX_QUERY_BATCH: usize = 48;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Request {
    /// First message; carries the client's doorbell eventfd.
    /// `namespace`: the GID (IPv4 address) of the RDMA namespace the client
    /// works in; none means the daemon's own address. A namespace is created
    /// on first use and goes away with its last client.
    Hello {
        version: u32,
        #[serde(default)]
        namespace: Option<std::net::Ipv4Addr>,
    },
    QueryDevice,
    QueryPort {
        port: u8,
    },
    QueryGid {
        port: u8,
        index: u32,
    },
    AllocPd,
    DeallocPd {
        pd: u32,
    },
    /// Carries the memfd; `fd_offset` is where `iova` lives in it.
    /// `key`: the lkey/rkey the caller wants (refused if taken in the namespace).
    RegMr {
        pd: u32,
        iova: u64,
        len: u64,
        access: u32,
        fd_offset: u64,
        #[serde(default)]
        key: Option<u32>,
    },
    DeregMr {
        lkey: u32,
    },
    /// Starts (clearing) a write trace of the MR with blocks of `granularity`
    /// bytes (a power of two >= 512); 0 stops it.
    TraceMr {
        lkey: u32,
        granularity: u64,
    },
    /// Returns the MR's dirty blocks since the last fetch and clears them.
    FetchTrace {
        lkey: u32,
    },
    /// Carries the channel's eventfd.
    CreateCompChannel,
    DestroyCompChannel {
        channel: u32,
    },
    /// Carries the CQ ring memfd.
    CreateCq {
        cap: u32,
        channel: Option<u32>,
    },
    DestroyCq {
        cq: u32,
    },
    /// Carries the SQ ring memfd then the RQ ring memfd.
    /// `qpn`: the QPN the caller wants (refused if taken in the namespace).
    CreateQp {
        pd: u32,
        send_cq: u32,
        recv_cq: u32,
        cap: QpCap,
        sq_sig_all: bool,
        sq_slots: u32,
        rq_slots: u32,
        #[serde(default)]
        qpn: Option<u32>,
        /// Create-suspended: the QP starts from this state (its QPN unless
        /// `qpn` says otherwise) and stays suspended until ResumeQp.
        #[serde(default)]
        restore: Option<Box<crate::qp::QpSnapshot>>,
    },
    ModifyQp {
        qpn: u32,
        attr: QpAttr,
        mask: u32,
    },
    QueryQp {
        qpn: u32,
    },
    DestroyQp {
        qpn: u32,
    },
    /// Stop all processing and host memory access; the peer sees RNR NAKs.
    SuspendQp {
        qpn: u32,
    },
    /// The runtime state of a suspended QP.
    QueryQpState {
        qpn: u32,
    },
    ResumeQp {
        qpn: u32,
    },
    /// Batched forms for moving many QPs at once (all checked first, then
    /// applied; at most MAX_BATCH QPNs; query replies are one message, so
    /// clients ask for at most MAX_QUERY_BATCH states at a time).
    SuspendQps {
        qpns: Vec<u32>,
    },
    QueryQpStates {
        qpns: Vec<u32>,
    },
    ResumeQps {
        qpns: Vec<u32>,
    },
    /// Create-suspended in two steps, for many QPs: QPs created ahead (with
    /// the QPNs of the states, still in RESET) take these states and become
    /// suspended. At most MAX_QUERY_BATCH states per request.
    RestoreQps {
        states: Vec<crate::qp::QpSnapshot>,
    },
    Stats,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Reply {
    Hello { gid: std::net::Ipv4Addr, client: u64 },
    Device(DeviceAttr),
    Port(PortAttr),
    Gid(std::net::Ipv4Addr),
    Pd(u32),
    Mr { lkey: u32, rkey: u32 },
    Channel(u32),
    Cq(u32),
    Qp { qpn: u32, cap: QpCap },
    QpInfo { attr: QpAttr, cap: QpCap },
    QpState(Box<crate::qp::QpSnapshot>),
    QpStates(Vec<crate::qp::QpSnapshot>),
    Trace(crate::trace::TraceReport),
    Stats(serde_json::Value),
    Ok,
}

pub type Response = Result<Reply, String>;

/// Sends one message with optional fds.
pub fn send_msg<T: Serialize>(sock: RawFd, msg: &T, fds: &[RawFd]) -> anyhow::Result<()> {
    let bytes = serde_json::to_vec(msg)?;
    if bytes.len() > MAX_MSG {
        bail!("control message too large");
    }
    let iov = [IoSlice::new(&bytes)];
    let cmsg = [ControlMessage::ScmRights(fds)];
    let cm: &[ControlMessage] = if fds.is_empty() { &[] } else { &cmsg };
    sendmsg::<()>(sock, &iov, cm, MsgFlags::MSG_NOSIGNAL, None).context("send control message")?;
    Ok(())
}

/// Receives one message; `Ok(None)` on orderly close. Any fds come back owned.
pub fn recv_msg(sock: RawFd, buf: &mut [u8]) -> anyhow::Result<Option<(usize, Vec<OwnedFd>)>> {
    let mut cbuf = nix::cmsg_space!([RawFd; MAX_FDS]);
    let mut iov = [IoSliceMut::new(buf)];
    let msg = recvmsg::<()>(sock, &mut iov, Some(&mut cbuf), MsgFlags::MSG_CMSG_CLOEXEC).context("receive control message")?;
    let mut fds = Vec::new();
    for c in msg.cmsgs().context("control data")? {
        if let ControlMessageOwned::ScmRights(v) = c {
            // SAFETY: the kernel just installed these descriptors for us.
            fds.extend(v.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }));
        }
    }
    let n = msg.bytes;
    if msg.flags.contains(MsgFlags::MSG_TRUNC) || msg.flags.contains(MsgFlags::MSG_CTRUNC) {
        bail!("control message truncated");
    }
    if n == 0 && fds.is_empty() {
        return Ok(None);
    }
    Ok(Some((n, fds)))
}

/// Creates a nonblocking-or-not eventfd.
pub fn eventfd(nonblock: bool) -> anyhow::Result<OwnedFd> {
    let flags = libc::EFD_CLOEXEC | if nonblock { libc::EFD_NONBLOCK } else { 0 };
    // SAFETY: plain syscall.
    let fd = unsafe { libc::eventfd(0, flags) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("eventfd");
    }
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

pub fn eventfd_signal(fd: &impl AsRawFd) {
    let one: u64 = 1;
    // SAFETY: writing 8 bytes to an eventfd.
    unsafe { libc::write(fd.as_raw_fd(), &one as *const u64 as *const libc::c_void, 8) };
}

/// Reads (and so clears) an eventfd; returns the count or 0.
pub fn eventfd_drain(fd: &impl AsRawFd) -> u64 {
    let mut v: u64 = 0;
    // SAFETY: reading 8 bytes from an eventfd.
    let n = unsafe { libc::read(fd.as_raw_fd(), &mut v as *mut u64 as *mut libc::c_void, 8) };
    if n == 8 {
        v
    } else {
        0
    }
}
