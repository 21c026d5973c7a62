//! Eventfds as rnicd and its clients use them: doorbells (client -> rnicd)
//! and completion channels (rnicd -> client). rnicd gets the client's
//! descriptors over the control socket, so signal and drain take any fd.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};

/// Creates a close-on-exec eventfd, nonblocking or not.
pub fn create(nonblock: bool) -> nix::Result<OwnedFd> {
    let flags = if nonblock { EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK } else { EfdFlags::EFD_CLOEXEC };
    Ok(EventFd::from_flags(flags)?.into())
}

/// Adds one to the counter. A full counter (2^64 - 2 pending events) or a
/// closed peer loses nothing that matters: the reader wakes either way.
/// The descriptor is the client's, blocking or not as the client chose (it
/// shares the file description, so rnicd cannot make it nonblocking for
/// good): rnicd writes only when a write cannot wait.
pub fn signal(fd: impl AsFd) {
    if ready_now(fd.as_fd(), PollFlags::POLLOUT) {
        let _ = nix::unistd::write(fd, &1u64.to_ne_bytes());
    }
}

/// Reads (and so clears) the counter; 0 if nothing was pending. As
/// [`signal`], it reads only when a read cannot wait (the client may have
/// read the counter itself since it was seen readable).
pub fn drain(fd: impl AsFd) -> u64 {
    if !ready_now(fd.as_fd(), PollFlags::POLLIN) {
        return 0;
    }
    let mut v = [0u8; 8];
    match nix::unistd::read(fd.as_fd().as_raw_fd(), &mut v) {
        Ok(8) => u64::from_ne_bytes(v),
        _ => 0,
    }
}

/// Whether `fd` is ready for `what` at once (a poll that does not wait).
fn ready_now(fd: BorrowedFd, what: PollFlags) -> bool {
    let mut p = [PollFd::new(fd, what)];
    matches!(poll(&mut p, PollTimeout::ZERO), Ok(1)) && p[0].revents().is_some_and(|r| r.contains(what))
}
