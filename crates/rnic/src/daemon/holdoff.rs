//! Receive moderation: while a bulk stream is under way, the event loop
//! sleeps a bounded hold-off before it looks at the wire again, and then
//! takes everything that arrived meanwhile in one pass, as a NIC's
//! interrupt moderation does (ethtool's `rx-usecs`, adaptive with
//! `adaptive-rx`; Linux's DIM for mlx5 and others).
//!
//! Why: a stream whose packets come one or two at a time, further apart
//! than the spin's break-even (`spin`), wakes the loop for each of them,
//! and a sleep and a wake-up cost about 4 µs of CPU here, as much as a
//! packet's own work. (Where the link delivers a stream in bursts, as the
//! testbed's tbf does at 1 Gbit/s, GRO and each wake-up already take
//! several packets, and the hold-off rarely grows.) Only a stream is held off (`Engine::streaming`: a message a QP receives
//! is mid-way, so the rest of it is already in the peer's window), and
//! only where the loop would sleep until the next packet: a spin that
//! catches the packets (`spin`) is left alone, and a ping-pong of
//! single-packet messages is never held off, so it keeps its latency.
//!
//! The hold-off adapts to what the wake-ups find:
//! - woken by a packet during a stream, finding at most `FEW` packets,
//!   within half the ceiling of the packet before (so that a hold-off
//!   would gather at least two): it doubles, from `GROW_FROM` up to the
//!   ceiling;
//! - a full hold-off that found packets: it doubles too, up to the
//!   ceiling (the stream goes on, and a longer hold-off gathers more per
//!   wake-up);
//! - a full hold-off that found nothing (the stream paused or ended): it
//!   halves, to 0 below `GROW_FROM`;
//! - a hold-off cut short (a control request, a doorbell, a QP timer)
//!   changes nothing: what it found says nothing about its length.

use std::time::Duration;

/// The hold-off a grow starts from (a shrink below it turns it off).
const GROW_FROM: Duration = Duration::from_micros(25);
/// A wake-up that finds this many packets or fewer is one worth saving.
const FEW: usize = 2;

/// The current hold-off and its ceiling.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Holdoff {
    limit: Duration,
    max: Duration,
    /// Always `max` during a stream, never adapted (`RNICD_HOLDOFF_FIXED=1`:
    /// tests that need a hold-off whatever the load, A/B runs).
    fixed: bool,
    pub(super) counts: Counts,
}

/// What the loop's sleeps found, for the stats and the log line at exit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Counts {
    /// Sleeps in epoll (hold-offs included): each ends in a wake-up.
    pub(super) sleeps: u64,
    /// Sleeps that work ended (a packet, a doorbell, a control request).
    pub(super) woken_by_work: u64,
    /// Hold-offs slept, how many packets the passes after them received,
    /// and how many of those passes found none.
    pub(super) holdoffs: u64,
    pub(super) holdoff_packets: u64,
    pub(super) holdoff_empty: u64,
}

impl Holdoff {
    /// Off until a stream's wake-ups ask for it; never longer than `max`
    /// (`RNICD_HOLDOFF_US`; 0 turns moderation off).
    pub(super) fn new(max: Duration, fixed: bool) -> Holdoff {
        Holdoff { limit: if fixed { max } else { Duration::ZERO }, max, fixed, counts: Counts::default() }
    }

    /// Whether moderation may ever hold off.
    pub(super) fn enabled(&self) -> bool {
        !self.max.is_zero()
    }

    /// How long the next sleep during a stream holds off (0: sleep until
    /// work comes, as without a stream).
    pub(super) fn limit(&self) -> Duration {
        self.limit
    }

    /// During a stream the loop slept until work woke it, `idle` after
    /// the last packet received, and the pass found `pkts` packets.
    pub(super) fn woken(&mut self, idle: Duration, pkts: usize) {
        if !self.fixed && pkts <= FEW && idle * 2 <= self.max {
            self.grow();
        }
    }

    /// A hold-off ended; the pass after it found `pkts` packets. `full`:
    /// it ran its whole length (no control work or timer cut it short).
    pub(super) fn drained(&mut self, pkts: usize, full: bool) {
        self.counts.holdoffs += 1;
        self.counts.holdoff_packets += pkts as u64;
        self.counts.holdoff_empty += u64::from(pkts == 0);
        if !full || self.fixed {
            return;
        }
        if pkts == 0 {
            self.limit /= 2;
            if self.limit < GROW_FROM {
                self.limit = Duration::ZERO;
            }
        } else {
            self.grow();
        }
    }

    fn grow(&mut self) {
        self.limit = (self.limit * 2).max(GROW_FROM).min(self.max);
    }
}

impl Counts {
    /// One line for the log.
    pub(super) fn summary(&self) -> String {
        format!(
            "{} sleeps, {} woken by work; {} hold-offs took {} packets ({} found none)",
            self.sleeps, self.woken_by_work, self.holdoffs, self.holdoff_packets, self.holdoff_empty
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: Duration = Duration::from_micros(200);

    #[test]
    fn a_paced_stream_grows_it_to_the_ceiling() {
        // A packet every 33 µs (4 KiB at 1 Gbit/s): each wake finds one.
        let mut h = Holdoff::new(MAX, false);
        h.woken(Duration::from_micros(33), 1);
        assert_eq!(h.limit(), GROW_FROM);
        h.drained(1, true);
        assert_eq!(h.limit(), GROW_FROM * 2);
        h.drained(2, true);
        h.drained(3, true);
        assert_eq!(h.limit(), MAX);
        h.drained(6, true);
        assert_eq!(h.limit(), MAX, "never beyond the ceiling");
        assert_eq!(h.counts.holdoffs, 4);
        assert_eq!(h.counts.holdoff_packets, 12);
    }

    #[test]
    fn wake_ups_too_sparse_to_gather_leave_it_off() {
        // Work more than half the ceiling apart: a hold-off would gather
        // one packet per wake-up, no better than waking for each.
        let mut h = Holdoff::new(MAX, false);
        for _ in 0..10 {
            h.woken(Duration::from_micros(150), 1);
        }
        assert_eq!(h.limit(), Duration::ZERO);
    }

    #[test]
    fn busy_wake_ups_leave_it_off() {
        let mut h = Holdoff::new(MAX, false);
        for _ in 0..10 {
            h.woken(Duration::from_micros(10), 8);
        }
        assert_eq!(h.limit(), Duration::ZERO);
    }

    #[test]
    fn empty_hold_offs_turn_it_off() {
        let mut h = Holdoff::new(MAX, false);
        for _ in 0..4 {
            h.drained(1, true);
        }
        assert_eq!(h.limit(), MAX);
        for _ in 0..3 {
            h.drained(0, true);
        }
        assert_eq!(h.limit(), MAX / 8);
        h.drained(0, true);
        assert_eq!(h.limit(), Duration::ZERO, "below the grow start it stops");
        assert_eq!(h.counts.holdoff_empty, 4);
    }

    #[test]
    fn a_hold_off_cut_short_changes_nothing() {
        let mut h = Holdoff::new(MAX, false);
        h.woken(Duration::from_micros(20), 1);
        h.drained(0, false);
        h.drained(1, false);
        assert_eq!(h.limit(), GROW_FROM);
        assert_eq!(h.counts.holdoffs, 2);
    }

    #[test]
    fn a_fixed_hold_off_does_not_adapt() {
        let mut h = Holdoff::new(MAX, true);
        h.drained(0, true);
        h.woken(Duration::from_secs(1), 100);
        assert_eq!(h.limit(), MAX);
    }

    #[test]
    fn no_ceiling_no_hold_off() {
        let mut h = Holdoff::new(Duration::ZERO, false);
        assert!(!h.enabled());
        h.woken(Duration::ZERO, 1);
        h.drained(1, true);
        assert_eq!(h.limit(), Duration::ZERO);
    }
}
