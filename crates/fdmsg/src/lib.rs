//! One JSON message with file descriptors beside it (SCM_RIGHTS), over a
//! unix SOCK_SEQPACKET socket: the control protocol of rnicd and its
//! clients, and the vmm's RAM-client protocol for postcopy.
//!
//! A message is one datagram: the receiver gets all of it or learns that
//! it did not. A datagram longer than the receive buffer, or with more
//! descriptors than [`MAX_FDS`], is an error ([`Error::Truncated`],
//! [`Error::ControlTruncated`]), never a cut-off message taken as whole;
//! descriptors that did arrive with it are closed.

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};

use nix::errno::Errno;
use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags, UnixAddr};
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
    #[error("control data truncated")]
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
    sendmsg::<UnixAddr>(sock.as_fd().as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None)?;
    Ok(())
}

/// The most descriptors one SCM_RIGHTS message can carry (the kernel's
/// SCM_MAX_FD): the receive buffer has room for all of them, so that
/// descriptors beyond [`MAX_FDS`] are received, closed and reported
/// instead of being left open by a truncated control part.
const SCM_MAX_FD: usize = 253;

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
pub fn recv_stamped(sock: impl AsFd, buf: &mut [u8]) -> Result<Option<Received>> {
    let room = buf.len();
    let mut cbuf = nix::cmsg_space!([RawFd; SCM_MAX_FD], nix::sys::time::TimeSpec);
    let mut iov = [IoSliceMut::new(buf)];
    let msg = recvmsg::<UnixAddr>(sock.as_fd().as_raw_fd(), &mut iov, Some(&mut cbuf), MsgFlags::MSG_CMSG_CLOEXEC)?;
    if msg.flags.contains(MsgFlags::MSG_CTRUNC) {
        return Err(Error::ControlTruncated);
    }
    let mut fds = Vec::new();
    let mut queued_at = None;
    for c in msg.cmsgs()? {
        match c {
            ControlMessageOwned::ScmRights(v) => {
                // SAFETY: the kernel just installed these descriptors for us;
                // owning them at once closes them on any error below.
                fds.extend(v.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }));
            }
            ControlMessageOwned::ScmTimestampns(ts) => {
                queued_at = Some(std::time::UNIX_EPOCH + std::time::Duration::new(ts.tv_sec() as u64, ts.tv_nsec() as u32));
            }
            _ => {}
        }
    }
    if msg.flags.contains(MsgFlags::MSG_TRUNC) {
        return Err(Error::Truncated(room));
    }
    if fds.len() > MAX_FDS {
        return Err(Error::TooManyFds { n: fds.len() });
    }
    if msg.bytes == 0 && fds.is_empty() {
        return Ok(None);
    }
    Ok(Some(Received { len: msg.bytes, fds, queued_at }))
}

/// Receives one message and parses it as `T`; `None` when the peer closed.
pub fn recv_json<T: DeserializeOwned>(sock: impl AsFd) -> Result<Option<(T, Vec<OwnedFd>)>> {
    let mut buf = vec![0u8; MAX_MSG];
    let Some((n, fds)) = recv(sock, &mut buf)? else { return Ok(None) };
    Ok(Some((serde_json::from_slice(&buf[..n])?, fds)))
}
