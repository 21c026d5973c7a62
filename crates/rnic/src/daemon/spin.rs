//! How long the event loop keeps polling after activity before it sleeps
//! in epoll: adaptive, as Linux's halt polling (KVM's `halt_poll_ns`,
//! cpuidle-haltpoll; Documentation/virt/kvm/halt-polling.rst), with a
//! break-even as in the ski-rental rule for spin-then-block locks.
//!
//! A spin is worth its CPU only when the work it waits for comes sooner
//! than a sleep and a wake-up would cost (`worth`): a ping-pong's next
//! request then finds rnicd awake. Work that comes later is cheaper to
//! sleep for, whether the spin caught it or not: when rnicd waits on the
//! wire (a migration over a rate-capped link, a packet every 30-500 µs), a
//! spin that catches each packet keeps it polling all the time. So:
//! - woken from a sleep by work within `worth` of the last activity (a
//!   longer spin would have caught it, cheaply): the spin doubles, from
//!   10 µs up to the ceiling;
//! - woken later, or a spin that found work only after more than `worth`
//!   (successful but too long): the spin halves, to 0 below 10 µs;
//! - a spin that found work within `worth` changes nothing.

use std::time::Duration;

/// The spin a grow starts from (a shrink below it stops spinning).
const GROW_FROM: Duration = Duration::from_micros(10);

/// Buckets of the wait histograms: [0, 2) µs, [2, 4), ..., [2^14, ∞).
const BUCKETS: usize = 16;

/// The current spin, its ceiling and its break-even.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Spin {
    limit: Duration,
    max: Duration,
    worth: Duration,
    pub(super) counts: Counts,
}

/// What the spins found, for the log line at exit (`Counts::summary`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Counts {
    /// Polling rounds of a spin that found nothing.
    pub(super) empty_rounds: u64,
    /// Spins that found work, by wait since the last activity (log2 µs).
    pub(super) found: [u64; BUCKETS],
    /// Sleeps that work ended, by wait since the last activity (log2 µs).
    pub(super) woken: [u64; BUCKETS],
}

impl Spin {
    /// Starts at `max` (`RNICD_SPIN_US`): the first ping-pong is served at
    /// once. `worth` (`RNICD_SPIN_WORTH_US`) is the break-even: a wait
    /// longer than that is cheaper slept through.
    pub(super) fn new(max: Duration, worth: Duration) -> Spin {
        Spin { limit: max, max, worth, counts: Counts::default() }
    }

    /// How long to keep polling after the last activity.
    pub(super) fn limit(&self) -> Duration {
        self.limit
    }

    /// A polling round of a spin found nothing.
    pub(super) fn empty_round(&mut self) {
        self.counts.empty_rounds += 1;
    }

    /// A spin found work `wait` after the last activity.
    pub(super) fn found_after(&mut self, wait: Duration) {
        self.counts.found[bucket(wait)] += 1;
        if wait > self.worth {
            self.shrink();
        }
    }

    /// The loop slept and work woke it `idle` after the last activity.
    pub(super) fn woken_after(&mut self, idle: Duration) {
        self.counts.woken[bucket(idle)] += 1;
        if idle <= self.worth {
            self.limit = (self.limit * 2).max(GROW_FROM).min(self.max);
        } else {
            self.shrink();
        }
    }

    fn shrink(&mut self) {
        self.limit /= 2;
        if self.limit < GROW_FROM {
            self.limit = Duration::ZERO;
        }
    }
}

fn bucket(d: Duration) -> usize {
    let us = d.as_micros().min(u64::MAX as u128) as u64;
    ((u64::BITS - us.leading_zeros()) as usize).saturating_sub(1).min(BUCKETS - 1)
}

impl Counts {
    /// One line: empty polling rounds, and the two histograms as
    /// `upper-bound-µs:count` for the non-empty buckets.
    pub(super) fn summary(&self) -> String {
        let hist = |h: &[u64; BUCKETS]| {
            let total: u64 = h.iter().sum();
            let parts: Vec<String> = h.iter().enumerate().filter(|(_, &n)| n > 0).map(|(i, n)| format!("<{}:{n}", 2u64 << i)).collect();
            format!("{total} [{}]", parts.join(" "))
        };
        format!(
            "{} polling rounds found nothing; spins that found work by wait in µs {}; sleeps woken by work {}",
            self.empty_rounds,
            hist(&self.found),
            hist(&self.woken)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: Duration = Duration::from_micros(200);
    const WORTH: Duration = Duration::from_micros(50);

    #[test]
    fn wake_ups_long_after_activity_stop_the_spin() {
        let mut s = Spin::new(MAX, WORTH);
        for _ in 0..4 {
            s.woken_after(Duration::from_millis(1));
        }
        assert_eq!(s.limit(), Duration::from_nanos(12_500));
        s.woken_after(Duration::from_millis(1));
        assert_eq!(s.limit(), Duration::ZERO, "below the grow start it stops");
        s.woken_after(Duration::from_millis(1));
        assert_eq!(s.limit(), Duration::ZERO);
    }

    #[test]
    fn wake_ups_past_the_break_even_shrink_it_too() {
        // A packet every 80 µs (a capped link): waking for each is cheaper
        // than spinning for each, though a spin would have caught them.
        let mut s = Spin::new(MAX, WORTH);
        for _ in 0..5 {
            s.woken_after(Duration::from_micros(80));
        }
        assert_eq!(s.limit(), Duration::ZERO);
    }

    #[test]
    fn spins_that_find_work_too_late_shrink_it() {
        let mut s = Spin::new(MAX, WORTH);
        s.found_after(Duration::from_micros(80));
        assert_eq!(s.limit(), MAX / 2, "successful but too long");
        for _ in 0..4 {
            s.found_after(Duration::from_micros(80));
        }
        assert_eq!(s.limit(), Duration::ZERO);
        assert_eq!(s.counts.found[bucket(Duration::from_micros(80))], 5);
    }

    #[test]
    fn spins_that_find_work_soon_change_nothing() {
        let mut s = Spin::new(MAX, WORTH);
        for _ in 0..100 {
            s.found_after(Duration::from_micros(30));
        }
        assert_eq!(s.limit(), MAX, "a ping-pong keeps its spin");
    }

    #[test]
    fn wake_ups_a_spin_would_have_caught_cheaply_grow_it_back() {
        let mut s = Spin::new(MAX, WORTH);
        for _ in 0..10 {
            s.woken_after(Duration::from_secs(1));
        }
        assert_eq!(s.limit(), Duration::ZERO);
        s.woken_after(Duration::from_micros(40));
        assert_eq!(s.limit(), GROW_FROM);
        for _ in 0..4 {
            s.woken_after(Duration::from_micros(40));
        }
        assert_eq!(s.limit(), Duration::from_micros(160));
        s.woken_after(Duration::from_micros(40));
        assert_eq!(s.limit(), MAX, "never beyond the ceiling");
    }

    #[test]
    fn a_break_even_at_the_ceiling_grows_on_every_wake_within_it() {
        let mut s = Spin::new(MAX, MAX);
        for _ in 0..10 {
            s.woken_after(Duration::from_secs(1));
        }
        s.woken_after(Duration::from_micros(150));
        assert_eq!(s.limit(), GROW_FROM);
        s.found_after(Duration::from_micros(150));
        assert_eq!(s.limit(), GROW_FROM);
    }

    #[test]
    fn no_ceiling_no_spin() {
        let mut s = Spin::new(Duration::ZERO, WORTH);
        s.woken_after(Duration::ZERO);
        assert_eq!(s.limit(), Duration::ZERO);
    }

    #[test]
    fn buckets_are_powers_of_two() {
        assert_eq!(bucket(Duration::ZERO), 0);
        assert_eq!(bucket(Duration::from_micros(1)), 0);
        assert_eq!(bucket(Duration::from_micros(2)), 1);
        assert_eq!(bucket(Duration::from_micros(33)), 5);
        assert_eq!(bucket(Duration::from_secs(10)), BUCKETS - 1);
        let mut c = Counts::default();
        c.found[5] = 3;
        assert!(c.summary().contains("3 [<64:3]"), "{}", c.summary());
    }
}
