//! One io_uring per controller for file-backed reads and writes.
//!
//! Submissions and reaping happen under the controller lock (vCPU thread or
//! completion worker); only the blocking wait for completions runs without
//! it, so the ring's two queues each have one user at a time.

use io_uring::{opcode, types, IoUring};
use std::io;

/// user_data of the no-op that tells the worker to stop.
pub const STOP_TAG: u64 = u64::MAX;
/// user_data of the no-op that wakes a worker waiting on the ring.
pub const WAKE_TAG: u64 = u64::MAX - 1;

pub struct Uring {
    ring: IoUring,
}

impl Uring {
    pub fn new(entries: u32) -> io::Result<Uring> {
        Ok(Uring { ring: IoUring::new(entries)? })
    }

    /// Queue a vectored read or write; false when the submission ring is full.
    ///
    /// # Safety
    /// `iov` must stay valid until the completion for `tag` is reaped.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn push_rw(&self, write: bool, fd: i32, iov: *const libc::iovec, n: u32, off: u64, dsync: bool, tag: u64) -> bool {
        let flags = if dsync { libc::RWF_DSYNC } else { 0 };
        // One segment (the common 4 KiB case) skips the kernel's iovec import.
        let e = match (write, n) {
            (true, 1) => {
                opcode::Write::new(types::Fd(fd), (*iov).iov_base as *const u8, (*iov).iov_len as u32).offset(off).rw_flags(flags).build()
            }
            (false, 1) => opcode::Read::new(types::Fd(fd), (*iov).iov_base as *mut u8, (*iov).iov_len as u32).offset(off).build(),
            (true, _) => opcode::Writev::new(types::Fd(fd), iov, n).offset(off).rw_flags(flags).build(),
            (false, _) => opcode::Readv::new(types::Fd(fd), iov, n).offset(off).build(),
        };
        let mut sq = self.ring.submission_shared();
        let ok = sq.push(&e.user_data(tag)).is_ok();
        sq.sync();
        ok
    }

    pub fn push_stop(&self) {
        self.push_nop(STOP_TAG);
    }

    /// Make a waiter on the ring return (its no-op completes at once).
    pub fn push_wake(&self) {
        self.push_nop(WAKE_TAG);
    }

    fn push_nop(&self, tag: u64) {
        // SAFETY: only called under the controller lock, like every push.
        unsafe {
            let mut sq = self.ring.submission_shared();
            let _ = sq.push(&opcode::Nop::new().build().user_data(tag));
            sq.sync();
        }
        let _ = self.submit();
    }

    /// Whether pushed entries still wait for a submit call.
    pub fn has_unsubmitted(&self) -> bool {
        // SAFETY: under the controller lock, like every push.
        let mut sq = unsafe { self.ring.submission_shared() };
        sq.sync();
        !sq.is_empty()
    }

    pub fn submit(&self) -> io::Result<usize> {
        loop {
            match self.ring.submitter().submit() {
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                // EBUSY: completions must be reaped first; the caller reaps.
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => return Ok(0),
                r => return r,
            }
        }
    }

    /// Take every finished request.
    pub fn reap(&self, mut f: impl FnMut(u64, i32)) {
        // SAFETY: callers hold the controller lock, so nobody else reaps.
        let mut cq = unsafe { self.ring.completion_shared() };
        cq.sync();
        for c in &mut cq {
            f(c.user_data(), c.result());
        }
    }

    /// Block until at least one completion is ready (no lock held).
    pub fn wait(&self) {
        // SAFETY: to_submit = 0, so this touches neither queue.
        let _ = unsafe { self.ring.submitter().enter::<libc::sigset_t>(0, 1, IORING_ENTER_GETEVENTS, None) };
    }
}

/// From linux/io_uring.h.
const IORING_ENTER_GETEVENTS: u32 = 1;
