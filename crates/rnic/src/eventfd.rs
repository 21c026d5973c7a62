//! Eventfds as rnicd and its clients use them: doorbells (client -> rnicd)
//! and completion channels (rnicd -> client). rnicd gets the client's
//! descriptors over the control socket, so signal and drain take any fd.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use nix::sys::eventfd::{EfdFlags, EventFd};

/// Creates a close-on-exec eventfd, nonblocking or not.
pub fn create(nonblock: bool) -> nix::Result<OwnedFd> {
    let flags = if nonblock { EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK } else { EfdFlags::EFD_CLOEXEC };
    Ok(EventFd::from_flags(flags)?.into())
}

/// Adds one to the counter. A full counter (2^64 - 2 pending events) or a
/// closed peer loses nothing that matters: the reader wakes either way.
pub fn signal(fd: impl AsFd) {
    let _ = nix::unistd::write(fd, &1u64.to_ne_bytes());
}

/// Reads (and so clears) the counter; 0 if nothing was pending.
pub fn drain(fd: impl AsFd) -> u64 {
    let mut v = [0u8; 8];
    match nix::unistd::read(fd.as_fd().as_raw_fd(), &mut v) {
        Ok(8) => u64::from_ne_bytes(v),
        _ => 0,
    }
}
