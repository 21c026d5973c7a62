//! How far apart two CPUs of this machine are: the round trip of one cache
//! line between them.
//!
//! Why benches measure it: this machine is itself a virtual machine, and its
//! hypervisor places the two vCPUs on physical cores that share a
//! last-level cache or not, and moves them now and then. Measured here, a
//! line goes back and forth in 65-90 ns when they share one and in
//! 320-350 ns when they do not, and every figure that hands data from one
//! CPU to the other follows: rnicd's RDMA WRITE of 64 KiB between two
//! testbed hosts ran at 22-23 Gb/s in the first state and 9-10 in
//! the second (docs/ibverbs.md, "The two bandwidth levels"). The state
//! lasts from seconds to minutes, so a bench that compares two programs
//! records it around each run and compares runs in the same state.

use anyhow::{bail, Result};
use nix::sched::{sched_setaffinity, CpuSet};
use nix::unistd::Pid;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A round trip below this means the two CPUs share a cache (65-90 ns
/// here), above it that they do not (320-350 ns).
pub const SHARED_CACHE_RTT: Duration = Duration::from_nanos(200);

/// Where a bench's run took place, from the round trips measured before
/// and after it.
pub fn cache_state(before: Duration, after: Duration) -> &'static str {
    match (before < SHARED_CACHE_RTT, after < SHARED_CACHE_RTT) {
        (true, true) => "shared",
        (false, false) => "split",
        _ => "moved",
    }
}

/// The round trip between CPUs 0 and 1 now (20,000 round trips, a few
/// ms), for benches to record around a run; None on a machine with one CPU.
pub fn rtt_now() -> Option<Duration> {
    cache_line_round_trip(0, 1, 20_000).ok()
}

/// The line the two threads pass back and forth, alone in its cache line.
#[repr(align(128))]
struct Line(AtomicU64);

fn pin_to(cpu: usize) -> Result<()> {
    let mut set = CpuSet::new();
    set.set(cpu)?;
    sched_setaffinity(Pid::from_raw(0), &set)?;
    Ok(())
}

/// The mean round trip of a cache line between CPUs `a` and `b`, over
/// `iters` round trips: a thread on `a` writes an odd number, one on `b`
/// answers with the next even one. Both threads spin, so the two CPUs are
/// busy for the whole measurement (about `iters` x 350 ns at most).
pub fn cache_line_round_trip(a: usize, b: usize, iters: u64) -> Result<Duration> {
    // The machine's CPUs, not the ones this process may run on now (a
    // bench may run it under taskset).
    // SAFETY: sysconf has no preconditions.
    let cpus = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }.max(1) as usize;
    if a == b || a.max(b) >= cpus {
        bail!("cpu-rtt needs two different CPUs below {cpus}, not {a} and {b}");
    }
    if iters == 0 {
        bail!("cpu-rtt needs at least one round trip");
    }
    let line = Line(AtomicU64::new(0));
    let line = &line;
    std::thread::scope(|s| {
        let answerer = s.spawn(move || -> Result<()> {
            pin_or_abort(b, line)?;
            for i in 0..iters {
                if !wait_for(line, 2 * i + 1) {
                    return Ok(());
                }
                line.0.store(2 * i + 2, Ordering::Release);
            }
            Ok(())
        });
        let asker = s.spawn(move || -> Result<Option<Duration>> {
            pin_or_abort(a, line)?;
            let start = Instant::now();
            for i in 0..iters {
                line.0.store(2 * i + 1, Ordering::Release);
                if !wait_for(line, 2 * i + 2) {
                    return Ok(None);
                }
            }
            Ok(Some(start.elapsed() / iters as u32))
        });
        let rtt = asker.join().expect("asker thread");
        answerer.join().expect("answerer thread")?;
        Ok(rtt?.expect("the answerer ends early only when it fails"))
    })
}

/// Written by a thread that cannot run on its CPU, so that the other one
/// stops waiting for it.
const ABORT: u64 = u64::MAX;

fn pin_or_abort(cpu: usize, line: &Line) -> Result<()> {
    pin_to(cpu).map_err(|e| {
        line.0.store(ABORT, Ordering::Release);
        e.context(format!("cannot run on CPU {cpu}"))
    })
}

/// Spins until the line holds `want`; false if the other thread gave up.
fn wait_for(line: &Line, want: u64) -> bool {
    loop {
        match line.0.load(Ordering::Acquire) {
            v if v == want => return true,
            ABORT => return false,
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_round_trip_between_two_cpus_takes_some_time() {
        // SAFETY: sysconf has no preconditions.
        if unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) } < 2 {
            return;
        }
        let rtt = cache_line_round_trip(0, 1, 10_000).unwrap();
        assert!(rtt > Duration::ZERO);
    }

    #[test]
    fn the_same_cpu_twice_or_a_missing_one_is_refused() {
        assert!(cache_line_round_trip(0, 0, 10).is_err());
        assert!(cache_line_round_trip(0, 4096, 10).is_err());
        assert!(cache_line_round_trip(0, 1, 0).is_err());
    }
}
