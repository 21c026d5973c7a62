// SPDX-License-Identifier: GPL-2.0-or-later
//! How a poller waits when its CQ is empty: spin, yield, or nap.
//!
//! rnicd does the NIC's work on the host's CPUs, so a program spinning on
//! its CQ must leave it room: after a few empty polls in a row it yields,
//! and after fewer still, where it has a channel to sleep on, it arms the
//! CQ and naps. A CQ whose completions come in a stream (a bandwidth
//! test's, or a ping-pong's one per round trip) does not nap while the next
//! completion is due: a nap costs rnicd an eventfd write and the program a
//! wake-up per completion, on a ping-pong's critical path. The drop-in's
//! `ibv_poll_cq` waits so, and `transit-rdma send-lat` waits for its
//! messages so, so that perftest and transit-rdma wait alike.
//!
//! Every poll that returns completions, whichever way it found them (at
//! once, after arming, after a nap), must be reported to [`Pace::found`]:
//! a completion left out makes a stream look idle from then on, and an
//! idle-looking ping-pong naps in every round trip.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Nanoseconds on the monotonic clock (vDSO: no system call).
pub fn now_ns() -> u64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid timespec; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// Empty polls in a row after which ibv_poll_cq yields the CPU. A program
/// that spins on its CQ (as perftest and ibv_rc_pingpong do) would
/// otherwise starve rnicd, which does the NIC's work on the same CPUs: on a
/// loaded 2-CPU host a spinning ping-pong took 30 ms per round trip, and
/// 90 us when it yielded. A poll that finds completions never yields.
pub const SPINS_BEFORE_YIELD: u32 = 16;

/// Empty polls in a row after which a poller with a channel to sleep on
/// naps (the drop-in's ibv_poll_cq, on a CQ made without a completion
/// channel beside an rnicd under ordinary scheduling, sleeps on the
/// context's idle channel, which rnicd signals when
/// a completion lands in an armed CQ, for at most 1 ms, and then returns
/// what it finds). A program spinning on its CQ then costs the
/// CPU rnicd needs no more than one sleeping on a channel; a program whose
/// completions come in a steady stream never gets this far.
pub const SPINS_BEFORE_SLEEP: u32 = 4;

/// A CQ whose completions come in a stream does not nap between them: it
/// keeps polling (yielding) for up to twice the smoothed gap between the
/// polls that found completions, at most STREAM_SPIN_MAX_NS, before the
/// nap. Napping between the messages of a stream cost rnicd an eventfd
/// write and the program a wake-up per message (perftest's `ib_send_bw`
/// receiver: 7,000-10,000 CQ events in a 2-second run, 200-350 with the
/// spin). `TRANSIT_IBV_NO_STREAM_SPIN=1` turns it off in the drop-in, for
/// comparison.
pub const STREAM_SPIN_MAX_NS: u64 = 250_000;

/// What an empty poll does before it returns.
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
pub enum Idle {
    /// Return at once: the program polls again.
    Spin,
    /// sched_yield, then return.
    Yield,
    /// Arm the CQ, look once more, sleep on the idle channel.
    Nap,
}

/// One CQ's polling history (shared by the threads polling it).
#[derive(Default)]
pub struct Pace {
    /// Polls in a row that found nothing.
    empty: AtomicU32,
    /// When (ns on the monotonic clock) a poll last found completions, and
    /// the smoothed gap between such polls.
    last_found_ns: AtomicU64,
    gap_ns: AtomicU64,
}

impl Pace {
    /// A poll found completions at `now`.
    pub fn found(&self, now: u64) {
        self.empty.store(0, Ordering::Relaxed);
        let last = self.last_found_ns.swap(now, Ordering::Relaxed);
        if last != 0 {
            let gap = now.saturating_sub(last).min(10 * STREAM_SPIN_MAX_NS);
            let avg = self.gap_ns.load(Ordering::Relaxed);
            self.gap_ns.store(if avg == 0 { gap } else { (3 * avg + gap) / 4 }, Ordering::Relaxed);
        }
    }

    /// A poll found nothing at `now`: what it does next. `can_nap`: the CQ
    /// has the idle channel to sleep on; `stream_spin`: streams are told
    /// from idle CQs (off for comparison).
    pub fn empty(&self, now: u64, can_nap: bool, stream_spin: bool) -> Idle {
        let empty = self.empty.fetch_add(1, Ordering::Relaxed) + 1;
        if can_nap && empty >= SPINS_BEFORE_SLEEP && !(stream_spin && self.streaming(now)) {
            Idle::Nap
        } else if empty >= SPINS_BEFORE_YIELD {
            Idle::Yield
        } else {
            Idle::Spin
        }
    }

    /// Whether the next completion of a stream is still due at `now`: less
    /// than twice the usual gap (at most STREAM_SPIN_MAX_NS) since the last.
    fn streaming(&self, now: u64) -> bool {
        let last = self.last_found_ns.load(Ordering::Relaxed);
        let window = (2 * self.gap_ns.load(Ordering::Relaxed)).min(STREAM_SPIN_MAX_NS);
        last != 0 && now.saturating_sub(last) < window
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: u64 = 1000;

    /// Empty polls until the first that is not `Spin`, starting at `now`.
    fn first_wait(p: &Pace, now: u64) -> (u32, Idle) {
        for k in 1.. {
            match p.empty(now, true, true) {
                Idle::Spin => {}
                other => return (k, other),
            }
        }
        unreachable!()
    }

    #[test]
    fn an_idle_cq_naps_after_a_few_empty_polls() {
        let p = Pace::default();
        assert_eq!(first_wait(&p, 1_000_000 * US), (SPINS_BEFORE_SLEEP, Idle::Nap));
    }

    #[test]
    fn a_cq_without_the_idle_channel_only_yields() {
        let p = Pace::default();
        let k = (1..).find(|_| p.empty(US, false, true) != Idle::Spin).unwrap();
        assert_eq!(k, SPINS_BEFORE_YIELD);
        assert_eq!(p.empty(US, false, true), Idle::Yield);
    }

    /// A ping-pong: one completion per 100 us round trip. Its waits keep
    /// yielding instead of napping.
    #[test]
    fn a_ping_pong_stays_a_stream() {
        let p = Pace::default();
        let mut now = 1_000_000 * US;
        p.found(now);
        for _ in 0..5 {
            now += 100 * US;
            p.found(now);
        }
        for _ in 0..100 {
            // The next wait starts 30 us after the last completion.
            assert_eq!(first_wait(&p, now + 30 * US), (SPINS_BEFORE_YIELD, Idle::Yield));
            now += 100 * US;
            p.found(now);
        }
    }

    #[test]
    fn a_stream_that_stops_naps_once_twice_its_gap_has_passed() {
        let p = Pace::default();
        let mut now = US;
        for _ in 0..10 {
            now += 50 * US;
            p.found(now);
        }
        assert_eq!(p.empty(now + 99 * US, true, true), Idle::Spin);
        for _ in 0..SPINS_BEFORE_SLEEP {
            p.empty(now + 99 * US, true, true);
        }
        assert_ne!(p.empty(now + 99 * US, true, true), Idle::Nap);
        assert_eq!(p.empty(now + 101 * US, true, true), Idle::Nap);
        // Never past STREAM_SPIN_MAX_NS, whatever the gap.
        let slow = Pace::default();
        slow.found(US);
        slow.found(US + 1_000 * US);
        assert_eq!(first_wait(&slow, US + 1_000 * US + STREAM_SPIN_MAX_NS + 1), (SPINS_BEFORE_SLEEP, Idle::Nap));
    }

    #[test]
    fn stream_spin_off_naps_as_an_idle_cq() {
        let p = Pace::default();
        p.found(US);
        p.found(2 * US);
        let k = (1..).find(|_| p.empty(3 * US, true, false) != Idle::Spin).unwrap();
        assert_eq!(k, SPINS_BEFORE_SLEEP);
    }
}
