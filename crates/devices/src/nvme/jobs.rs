//! Buffered file writes done by the completion worker itself.
//!
//! io_uring cannot finish a buffered write without blocking on file systems
//! that lack non-blocking buffered writes (ext4 answers RWF_NOWAIT with
//! EOPNOTSUPP), so it hands every such write to one of its own kernel worker
//! threads, whose completion then has to wake the controller's worker to
//! post the NVMe completion: two thread hand-offs per write. The worker
//! doing the same `pwritev2` itself takes one. O_DIRECT writes and all
//! reads stay on io_uring (reads from the page cache finish inline).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

/// `result` while the worker's write is still under way.
const RUNNING: i64 = i64::MIN;

#[derive(Default)]
pub struct WriteJobs {
    /// In-flight slots waiting for the worker.
    pub queue: VecDeque<u32>,
    /// The slot the worker is writing with the controller lock released.
    pub running: Option<u32>,
    /// That write's result (bytes or -errno), published without the lock so
    /// a drain holding the lock can finish the request itself.
    pub result: Arc<AtomicI64>,
}

impl WriteJobs {
    pub fn start(&mut self, slot: u32) {
        self.running = Some(slot);
        self.result.store(RUNNING, Ordering::Release);
    }

    /// The running write's result, if it has one; it is then no longer running.
    pub fn take_finished(&mut self) -> Option<(u32, i32)> {
        let slot = self.running?;
        let r = self.result.load(Ordering::Acquire);
        if r == RUNNING {
            return None;
        }
        self.running = None;
        Some((slot, r as i32))
    }
}

pub fn publish(result: &AtomicI64, res: i32) {
    result.store(res as i64, Ordering::Release);
}

/// A positional vectored write; bytes written or -errno.
///
/// # Safety
/// `iov` must point to `n` iovecs over readable memory.
pub unsafe fn pwritev(fd: i32, iov: *const libc::iovec, n: usize, off: u64, dsync: bool) -> i32 {
    let flags = if dsync { libc::RWF_DSYNC } else { 0 };
    loop {
        let r = libc::pwritev2(fd, iov, n as i32, off as libc::off_t, flags);
        if r >= 0 {
            return r as i32;
        }
        let e = std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO);
        if e != libc::EINTR {
            return -e;
        }
    }
}
