//! One JSON message with file descriptors beside it (SCM_RIGHTS), over a
//! unix SOCK_SEQPACKET socket: the control protocol of rnicd and its
//! clients, and the vmm's RAM-client protocol for postcopy.
//!
//! A message is one datagram: the receiver gets all of it or learns that
//! it did not. A datagram longer than the receive buffer, or with more
//! descriptors than [`MAX_FDS`], is an error ([`Error::Truncated`],
//! [`Error::ControlTruncated`]), never a cut-off message taken as whole;
//! descriptors that did arrive with it are closed.

use std::io::IoSlice;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};

use nix::errno::Errno;
use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags, UnixAddr};
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Largest message (bytes of JSON) either side sends or accepts.
pub const MAX_MSG: usize = 64 * 1024;
/// Most descriptors one message carries.
pub const MAX_FDS: usize = 4;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("message of {0} bytes is larger than {MAX_MSG}")]
    TooLarge(usize),
    #[error("{n} file descriptors in one message (at most {MAX_FDS})")]
    TooManyFds { n: usize },
    #[error("message truncated: longer than the {0}-byte receive buffer")]
    Truncated(usize),
    /// The message's descriptors did not all arrive: the receiver had no
    /// free descriptor numbers left (or the sender passed more than
    /// SCM_MAX_FD). Its bytes did; what descriptors came were closed.
    #[error("control data truncated: the receiver could not take the message's descriptors")]
    ControlTruncated,
    #[error("bad message: {0}")]
    Json(#[from] serde_json::Error),
    #[error("{0}")]
    Os(#[from] Errno),
}

impl Error {
    /// A nonblocking socket had no message.
    pub fn would_block(&self) -> bool {
        matches!(self, Error::Os(Errno::EAGAIN))
    }
}

pub type Result<T> = std::result::Result<T, Error>;

/// Sends `msg` as one message with `fds` beside it.
pub fn send<T: Serialize + ?Sized>(sock: impl AsFd, msg: &T, fds: &[RawFd]) -> Result<()> {
    let bytes = serde_json::to_vec(msg)?;
    send_bytes(sock, &bytes, fds)
}

/// Sends `bytes` (any payload, not necessarily JSON) as one message.
pub fn send_bytes(sock: impl AsFd, bytes: &[u8], fds: &[RawFd]) -> Result<()> {
    if bytes.len() > MAX_MSG {
        return Err(Error::TooLarge(bytes.len()));
    }
    if fds.len() > MAX_FDS {
        return Err(Error::TooManyFds { n: fds.len() });
    }
    let iov = [IoSlice::new(bytes)];
    let rights = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage] = if fds.is_empty() { &[] } else { &rights };
    // A socket with a send timeout (SO_SNDTIMEO) is not restarted after a
    // signal handler, SA_RESTART or not: EINTR, nothing sent; send again.
    loop {
        match sendmsg::<UnixAddr>(sock.as_fd().as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None) {
            Err(Errno::EINTR) => continue,
            r => return r.map(|_| ()).map_err(Error::from),
        }
    }
}

/// The most descriptors one SCM_RIGHTS message can carry (the kernel's
/// SCM_MAX_FD): the receive buffer has room for all of them, so that
/// descriptors beyond [`MAX_FDS`] are received, closed and reported
/// instead of being left open by a truncated control part.
const SCM_MAX_FD: usize = 253;
/// The control part's buffer, in words (aligned as a cmsghdr): room for
/// SCM_MAX_FD descriptors and a timestamp, each with its 16-byte header.
const CONTROL_WORDS: usize = 160;
const _: () = assert!(CONTROL_WORDS * 8 >= 16 + SCM_MAX_FD * 4 + 4 + 16 + 16);

/// Receives one message into `buf`: its length and the descriptors that
/// came with it (owned, close-on-exec). `None` when the peer closed the
/// connection (an empty message without descriptors).
pub fn recv(sock: impl AsFd, buf: &mut [u8]) -> Result<Option<(usize, Vec<OwnedFd>)>> {
    Ok(recv_stamped(sock, buf)?.map(|r| (r.len, r.fds)))
}

/// One message [`recv_stamped`] received.
pub struct Received {
    pub len: usize,
    pub fds: Vec<OwnedFd>,
    /// When the kernel queued it (wall clock), on a socket with
    /// `SO_TIMESTAMPNS` set; the receiver's delay is the time since.
    pub queued_at: Option<std::time::SystemTime>,
}

/// [`recv`], with the message's arrival time when the socket records it.
///
/// The control part is read with libc's CMSG macros rather than nix's
/// iterator, which refuses a message flagged MSG_CTRUNC: a receiver out of
/// descriptors (EMFILE) gets some of them, or none, and that flag; the
/// kernel's headers then count what it did install, and those must be
/// taken (and closed), not leaked.
pub fn recv_stamped(sock: impl AsFd, buf: &mut [u8]) -> Result<Option<Received>> {
    let room = buf.len();
    let mut cbuf = [0u64; CONTROL_WORDS];
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: a zeroed msghdr is valid; its pointers are set below to
    // buffers that outlive the call.
    let mut mh: libc::msghdr = unsafe { std::mem::zeroed() };
    mh.msg_iov = &mut iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cbuf.as_mut_ptr().cast();
    mh.msg_controllen = std::mem::size_of_val(&cbuf);
    // SAFETY: recvmsg into the buffers described by `mh`. EINTR (a signal
    // handler ran; a socket with SO_RCVTIMEO is not restarted) took
    // nothing: receive again.
    let n = loop {
        let n = unsafe { libc::recvmsg(sock.as_fd().as_raw_fd(), &mut mh, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n;
        }
        match Errno::last() {
            Errno::EINTR => continue,
            e => return Err(e.into()),
        }
    };
    let mut fds = Vec::new();
    let mut queued_at = None;
    // SAFETY: walking the control part the kernel just wrote (msg_controllen
    // says how much); every header's length covers its data.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&mh);
        while !c.is_null() {
            let data = libc::CMSG_DATA(c);
            let len = ((*c).cmsg_len as usize).saturating_sub(data as usize - c as usize);
            match ((*c).cmsg_level, (*c).cmsg_type) {
                (libc::SOL_SOCKET, libc::SCM_RIGHTS) => {
                    // Owned at once: closed on any error below.
                    let raw = data.cast::<RawFd>();
                    fds.extend((0..len / std::mem::size_of::<RawFd>()).map(|i| OwnedFd::from_raw_fd(raw.add(i).read_unaligned())));
                }
                (libc::SOL_SOCKET, libc::SCM_TIMESTAMPNS) if len >= std::mem::size_of::<libc::timespec>() => {
                    let ts = data.cast::<libc::timespec>().read_unaligned();
                    queued_at = Some(std::time::UNIX_EPOCH + std::time::Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32));
                }
                _ => {}
            }
            c = libc::CMSG_NXTHDR(&mh, c);
        }
    }
    if mh.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(Error::ControlTruncated);
    }
    if mh.msg_flags & libc::MSG_TRUNC != 0 {
        return Err(Error::Truncated(room));
    }
    if fds.len() > MAX_FDS {
        return Err(Error::TooManyFds { n: fds.len() });
    }
    let n = n as usize;
    if n == 0 && fds.is_empty() {
        return Ok(None);
    }
    Ok(Some(Received { len: n, fds, queued_at }))
}

/// Receives one message and parses it as `T`; `None` when the peer closed.
pub fn recv_json<T: DeserializeOwned>(sock: impl AsFd) -> Result<Option<(T, Vec<OwnedFd>)>> {
    let mut buf = vec![0u8; MAX_MSG];
    let Some((n, fds)) = recv(sock, &mut buf)? else { return Ok(None) };
    Ok(Some((serde_json::from_slice(&buf[..n])?, fds)))
}
