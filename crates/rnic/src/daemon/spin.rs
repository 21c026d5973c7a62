//! How long the event loop keeps polling after activity before it sleeps
//! in epoll: adaptive, as Linux's halt polling (KVM's `halt_poll_ns`,
//! cpuidle-haltpoll; Documentation/virt/kvm/halt-polling.rst).
//!
//! A spin is worth its CPU only when work comes soon after the last: a
//! ping-pong's next request then finds rnicd awake. When rnicd waits on
//! the wire (a migration over a rate-capped link: an ACK every few
//! hundred microseconds, or more), a fixed spin after every packet keeps
//! it polling nearly all the time and finds nothing. So the spin grows
//! when rnicd slept and was woken by work that a longer spin would have
//! caught (it came within the longest spin), and shrinks when it was
//! woken after more than the longest spin: spinning then only cost CPU.
//! A spin that finds work changes nothing.

use std::time::Duration;

/// The spin a grow starts from (a shrink below it stops spinning).
const GROW_FROM: Duration = Duration::from_micros(10);

/// The current spin and its ceiling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Spin {
    limit: Duration,
    max: Duration,
}

impl Spin {
    /// Starts at `max` (`RNICD_SPIN_US`): the first ping-pong is served at once.
    pub(super) fn new(max: Duration) -> Spin {
        Spin { limit: max, max }
    }

    /// How long to keep polling after the last activity.
    pub(super) fn limit(&self) -> Duration {
        self.limit
    }

    /// The loop slept and work woke it `idle` after the last activity.
    pub(super) fn woken_after(&mut self, idle: Duration) {
        if idle <= self.max {
            self.limit = (self.limit * 2).max(GROW_FROM).min(self.max);
        } else {
            self.limit /= 2;
            if self.limit < GROW_FROM {
                self.limit = Duration::ZERO;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: Duration = Duration::from_micros(200);

    #[test]
    fn wake_ups_long_after_activity_stop_the_spin() {
        let mut s = Spin::new(MAX);
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
    fn wake_ups_a_spin_would_have_caught_grow_it_back() {
        let mut s = Spin::new(MAX);
        for _ in 0..10 {
            s.woken_after(Duration::from_secs(1));
        }
        assert_eq!(s.limit(), Duration::ZERO);
        s.woken_after(Duration::from_micros(50));
        assert_eq!(s.limit(), GROW_FROM);
        for _ in 0..4 {
            s.woken_after(Duration::from_micros(50));
        }
        assert_eq!(s.limit(), Duration::from_micros(160));
        s.woken_after(Duration::from_micros(50));
        assert_eq!(s.limit(), MAX, "never beyond the ceiling");
    }

    #[test]
    fn no_ceiling_no_spin() {
        let mut s = Spin::new(Duration::ZERO);
        s.woken_after(Duration::ZERO);
        assert_eq!(s.limit(), Duration::ZERO);
    }
}
