//! rnicd's file descriptors. Clients pass memfds and eventfds with their
//! requests; control sockets, doorbells and completion channels stay open
//! in rnicd as long as their clients keep them. A daemon out of
//! descriptors can neither accept a client nor receive a request that
//! carries one (the kernel drops them and flags the message), so rnicd
//! keeps a reserve: requests that pass descriptors are refused while fewer
//! than [`OBJECT_RESERVE`] are free, new clients while fewer than
//! [`CLIENT_RESERVE`] are. Each client's completion channels are bounded
//! too (`--max-channels-per-client`), so that one program cannot take
//! them all, and rnicd's own per-port send sockets leave the reserve
//! alone (their packets leave from a fallback socket instead).

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};

use tracing::{info, warn};

/// Free descriptors below which a request that passes descriptors is
/// refused (its descriptors are closed; the client keeps its connection).
pub const OBJECT_RESERVE: u64 = 64;
/// Free descriptors below which a new client is turned away, with an error
/// as the answer to its hello. Smaller than [`OBJECT_RESERVE`]: a client
/// still connects (and can query and close objects) when objects are
/// refused.
pub const CLIENT_RESERVE: u64 = 16;
/// Completion channels one client may hold by default (each is an eventfd
/// in rnicd). A libibverbs program makes one per context or per thread.
pub const DEFAULT_MAX_CHANNELS_PER_CLIENT: usize = 1024;

/// The descriptor limit rnicd runs under (a process-wide resource, so a
/// process-wide value); 0 until [`raise_limit`] ran: then nothing is short.
static LIMIT: AtomicU64 = AtomicU64::new(0);

/// Raises the soft RLIMIT_NOFILE to the hard one (as service managers do
/// for daemons) and keeps the limit now in force.
pub fn raise_limit() {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: plain system calls on local structs.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
        warn!("getrlimit(RLIMIT_NOFILE) failed; descriptors are not watched");
        return;
    }
    if r.rlim_cur < r.rlim_max {
        let raised = libc::rlimit { rlim_cur: r.rlim_max, rlim_max: r.rlim_max };
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            r.rlim_cur = r.rlim_max;
        }
    }
    info!("descriptor limit {}", r.rlim_cur);
    LIMIT.store(r.rlim_cur, Ordering::Relaxed);
}

pub fn limit() -> u64 {
    LIMIT.load(Ordering::Relaxed)
}

/// Whether fewer than `reserve` descriptors are free, judged from the
/// highest of descriptors just received, accepted or made: the kernel
/// gives the lowest free number, so every number below it is in use.
pub fn short(newest: RawFd, reserve: u64) -> bool {
    short_under(limit(), newest, reserve)
}

fn short_under(limit: u64, newest: RawFd, reserve: u64) -> bool {
    let in_use = u64::try_from(newest).map_or(0, |fd| fd + 1);
    limit != 0 && limit.saturating_sub(in_use) < reserve
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_counts_every_lower_number_as_in_use() {
        assert!(!short_under(1000, 3, OBJECT_RESERVE));
        assert!(!short_under(1000, 1000 - 65, OBJECT_RESERVE), "64 free");
        assert!(short_under(1000, 1000 - 64, OBJECT_RESERVE), "63 free");
        assert!(!short_under(1000, 1000 - 64, CLIENT_RESERVE));
        assert!(short_under(1000, 999, CLIENT_RESERVE));
        assert!(!short_under(0, 999, CLIENT_RESERVE), "an unknown limit is never short");
    }
}
