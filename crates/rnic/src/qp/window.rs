//! The congestion window of an RC requester: how many request packets may
//! be unacknowledged, answering loss as RoCE NICs do (DCQCN cuts a QP's
//! rate on congestion and raises it back in steps; rnicd has no ECN marks,
//! so loss and delay are its signals, and it windows instead of pacing).
//!
//! A loss halves the window, once per window of packets: losses of packets
//! sent before the last cut are the same congestion event. A round trip
//! (the path's part of it, as TIMELY takes it from NIC timestamps: from the
//! send to the ACK's arrival in the kernel, less the time the responder
//! reports it held the requests; `qp::completer`)
//! above the delay threshold (a queue on the path) shrinks it in proportion
//! to how far above, as RDMA's TIMELY does: by a fraction
//! `DELAY_BETA * (1 - threshold / rtt)`, once per window too, so that the
//! queue settles near the threshold instead of draining (halving at every
//! crossing emptied a rate-capped link's queue and left the link idle
//! while the window grew back by one packet per window). The window never
//! drops below [`MIN_CWND`]. A retransmission timeout drops it to
//! [`MIN_CWND`]. ACKs grow it back: by every ACKed packet up to half the
//! window at the last cut (slow start), then by one packet per window
//! (additive increase). The window itself lives in the QP's runtime state
//! (it is part of a QP snapshot); this is the arithmetic and what it
//! remembers between ACKs.

use crate::wire::psn_diff;

/// Smallest congestion window (packets).
pub const MIN_CWND: u32 = 16;
/// The largest fraction a delay signal takes off the window (TIMELY's β).
pub const DELAY_BETA: f64 = 0.8;

/// What the window remembers between ACKs and losses.
#[derive(Debug, Clone, PartialEq)]
pub struct Window {
    /// `una` when the window last grew.
    una: u32,
    /// Below this the window grows by every ACKed packet (slow start),
    /// above by one packet per window (additive increase); half the
    /// window at the last loss.
    ssthresh: u32,
    /// ACKed packets not yet turned into additive growth.
    acc: u32,
    /// After a cut: `max_sent` then. Losses of packets sent before it are
    /// the same congestion event and do not cut again.
    cut_until: Option<u32>,
    /// The round trip sampled before the last (µs): a delay cut takes the
    /// smaller of the two.
    last_rtt_us: f64,
}

impl Default for Window {
    fn default() -> Window {
        Window { una: 0, ssthresh: u32::MAX, acc: 0, cut_until: None, last_rtt_us: 0.0 }
    }
}

/// The window in force: `cwnd`, at least [`MIN_CWND`], at most `max`.
pub fn effective(cwnd: u32, max: u32) -> u32 {
    max.min(cwnd.max(MIN_CWND))
}

impl Window {
    /// Full again, with no loss remembered (the PSNs restart at `una`).
    pub fn restart(&mut self, una: u32) {
        *self = Window { una, ..Window::default() };
    }

    /// `una` moved: grow `cwnd` (up to `max`) by the packets it acknowledged.
    pub fn on_ack(&mut self, cwnd: &mut u32, una: u32, max: u32) {
        let acked = psn_diff(una, self.una).max(0) as u32;
        self.una = una;
        if self.cut_until.is_some_and(|p| psn_diff(una, p) >= 0) {
            self.cut_until = None;
        }
        let w = (*cwnd).max(MIN_CWND);
        if w < self.ssthresh {
            *cwnd = w.saturating_add(acked).min(self.ssthresh).min(max);
            self.acc = 0;
            return;
        }
        self.acc = self.acc.saturating_add(acked);
        if self.acc >= w {
            self.acc -= w;
            *cwnd = (w + 1).min(max);
        }
    }

    /// A loss with `una` and `max_sent` as now: halve what was in flight
    /// (not a window grown while little was sent), to at least
    /// [`MIN_CWND`], unless the loss belongs to the last cut's event.
    /// True if the window was cut.
    pub fn cut(&mut self, cwnd: &mut u32, una: u32, max_sent: u32, max: u32) -> bool {
        if self.cut_until.is_some_and(|p| psn_diff(una, p) < 0) {
            return false;
        }
        let flight = psn_diff(max_sent, una).max(0) as u32;
        let w = effective(*cwnd, max).min(flight.max(MIN_CWND));
        *cwnd = (w / 2).max(MIN_CWND);
        self.ssthresh = *cwnd;
        self.acc = 0;
        self.cut_until = Some(max_sent);
        true
    }

    /// A round trip sample of `sample_us`. Its delay is the smaller of it
    /// and the sample before: a queue on the path stands for several round
    /// trips, a stall of either host (its rnicd not scheduled, which on a
    /// loaded machine takes tens of milliseconds) inflates one sample, and
    /// cutting for it only leaves the link idle. A delay above
    /// `threshold_us` shrinks the window in flight by
    /// `DELAY_BETA * (1 - threshold_us / rtt)` (at least one packet), to at
    /// least [`MIN_CWND`], unless the last cut's event is still in flight.
    /// True if the window was cut.
    pub fn delay_cut(&mut self, cwnd: &mut u32, una: u32, max_sent: u32, max: u32, sample_us: f64, threshold_us: f64) -> bool {
        let rtt_us = sample_us.min(self.last_rtt_us);
        self.last_rtt_us = sample_us;
        if rtt_us <= threshold_us || self.cut_until.is_some_and(|p| psn_diff(una, p) < 0) {
            return false;
        }
        let flight = psn_diff(max_sent, una).max(0) as u32;
        let w = effective(*cwnd, max).min(flight.max(MIN_CWND));
        let keep = 1.0 - DELAY_BETA * (1.0 - threshold_us / rtt_us);
        *cwnd = ((w as f64 * keep) as u32).min(w.saturating_sub(1)).max(MIN_CWND);
        self.ssthresh = *cwnd;
        self.acc = 0;
        self.cut_until = Some(max_sent);
        true
    }

    /// The next loss cuts whether or not it belongs to the last cut's
    /// event (a refusal by the local qdisc, a timeout).
    pub fn forget_cut(&mut self) {
        self.cut_until = None;
    }

    /// A retransmission timeout: nothing came back for a whole timeout.
    /// Slow start from [`MIN_CWND`] up to half of what was in flight.
    pub fn timeout(&mut self, cwnd: &mut u32, una: u32, max_sent: u32, max: u32) {
        self.forget_cut();
        self.cut(cwnd, una, max_sent, max);
        *cwnd = MIN_CWND;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: u32 = 2048;

    /// A window of `cwnd` with `cwnd` packets in flight from PSN 0.
    fn full(cwnd: u32) -> (Window, u32) {
        let mut w = Window::default();
        w.restart(0);
        (w, cwnd)
    }

    #[test]
    fn a_loss_halves_once_per_window() {
        let (mut w, mut cwnd) = full(256);
        assert!(w.cut(&mut cwnd, 0, 256, MAX));
        assert_eq!(cwnd, 128);
        // More losses of packets sent before the cut: the same event.
        assert!(!w.cut(&mut cwnd, 10, 256, MAX));
        assert!(!w.cut(&mut cwnd, 255, 300, MAX));
        assert_eq!(cwnd, 128);
        // Once everything sent before the cut is acknowledged, a loss is
        // a new event.
        w.on_ack(&mut cwnd, 256, MAX);
        assert!(w.cut(&mut cwnd, 256, 256 + 128, MAX));
        assert_eq!(cwnd, 64);
    }

    #[test]
    fn a_cut_halves_what_was_in_flight() {
        let (mut w, mut cwnd) = full(1000);
        // A window grown while little was sent: 40 in flight, not 1000.
        w.cut(&mut cwnd, 0, 40, MAX);
        assert_eq!(cwnd, 20);
        // Nor more than the largest window the QP may have.
        let (mut w, mut cwnd) = full(4000);
        w.cut(&mut cwnd, 0, 4000, MAX);
        assert_eq!(cwnd, MAX / 2);
    }

    #[test]
    fn the_window_never_drops_below_its_floor() {
        let (mut w, mut cwnd) = full(20);
        w.cut(&mut cwnd, 0, 20, MAX);
        assert_eq!(cwnd, MIN_CWND);
        w.forget_cut();
        w.cut(&mut cwnd, 0, 20, MAX);
        assert_eq!(cwnd, MIN_CWND);
        // Nothing in flight counts as the floor's worth.
        let (mut w, mut cwnd) = full(500);
        w.cut(&mut cwnd, 7, 7, MAX);
        assert_eq!(cwnd, MIN_CWND);
        assert_eq!(effective(0, MAX), MIN_CWND);
        assert_eq!(effective(5000, MAX), MAX);
    }

    #[test]
    fn a_timeout_drops_to_the_floor_and_slow_starts_to_half() {
        let (mut w, mut cwnd) = full(256);
        w.timeout(&mut cwnd, 0, 256, MAX);
        assert_eq!(cwnd, MIN_CWND);
        // Slow start: every ACKed packet adds one, up to half the window
        // in flight at the timeout.
        w.on_ack(&mut cwnd, 10, MAX);
        assert_eq!(cwnd, 26);
        w.on_ack(&mut cwnd, 100, MAX);
        assert_eq!(cwnd, 116);
        w.on_ack(&mut cwnd, 200, MAX);
        assert_eq!(cwnd, 128, "slow start stops at half of what was in flight");
        // Then one packet per window of ACKed packets.
        w.on_ack(&mut cwnd, 200 + 127, MAX);
        assert_eq!(cwnd, 128);
        w.on_ack(&mut cwnd, 200 + 128, MAX);
        assert_eq!(cwnd, 129);
        w.on_ack(&mut cwnd, 200 + 128 + 129, MAX);
        assert_eq!(cwnd, 130);
    }

    #[test]
    fn a_timeout_cuts_even_within_the_last_event() {
        let (mut w, mut cwnd) = full(256);
        w.cut(&mut cwnd, 0, 256, MAX);
        assert_eq!(cwnd, 128);
        w.timeout(&mut cwnd, 5, 256, MAX);
        assert_eq!(cwnd, MIN_CWND);
        // Slow start up to half the window at the timeout (128, less
        // than the 251 in flight).
        w.on_ack(&mut cwnd, 5 + 1000, MAX);
        assert_eq!(cwnd, 64);
    }

    #[test]
    fn growth_stops_at_the_largest_window() {
        let mut w = Window::default();
        let mut cwnd = MAX - 1;
        w.restart(0);
        w.on_ack(&mut cwnd, 100, MAX);
        assert_eq!(cwnd, MAX);
        // Additive growth too.
        w.cut(&mut cwnd, 100, 100 + MAX, MAX);
        w.on_ack(&mut cwnd, 100 + MAX, MAX);
        let mut una = 100 + MAX;
        for _ in 0..10_000 {
            una += MAX;
            w.on_ack(&mut cwnd, una, MAX);
        }
        assert_eq!(cwnd, MAX);
    }

    #[test]
    fn acknowledgements_across_the_psn_wrap_count() {
        let top = (1 << 24) - 8;
        let mut w = Window::default();
        w.restart(top);
        let mut cwnd = MIN_CWND;
        // 8 packets before the wrap and 8 after it.
        w.on_ack(&mut cwnd, 8, MAX);
        assert_eq!(cwnd, MIN_CWND + 16);
    }

    #[test]
    fn one_slow_round_trip_is_a_stall_not_a_queue() {
        let (mut w, mut cwnd) = full(500);
        assert!(!w.delay_cut(&mut cwnd, 0, 500, MAX, 900.0, 1000.0));
        assert!(!w.delay_cut(&mut cwnd, 0, 500, MAX, 50_000.0, 1000.0), "one sample over: no cut");
        assert!(!w.delay_cut(&mut cwnd, 0, 500, MAX, 800.0, 1000.0));
        assert_eq!(cwnd, 500);
        assert!(!w.delay_cut(&mut cwnd, 0, 500, MAX, 3000.0, 1000.0));
        assert!(w.delay_cut(&mut cwnd, 0, 500, MAX, 2000.0, 1000.0), "two over: a queue");
        assert_eq!(cwnd, 300, "cut for the smaller of the two");
    }

    #[test]
    fn a_delay_cut_is_in_proportion_to_the_excess() {
        let (mut w, mut cwnd) = full(500);
        assert!(!w.delay_cut(&mut cwnd, 0, 500, MAX, 900.0, 1000.0), "under the threshold: no cut");
        assert_eq!(cwnd, 500);
        // Twice the threshold: 1 - 0.8 * (1 - 1/2) = 0.6 of the window stays.
        assert!(!w.delay_cut(&mut cwnd, 0, 500, MAX, 2000.0, 1000.0), "the first sample over");
        assert!(w.delay_cut(&mut cwnd, 0, 500, MAX, 2000.0, 1000.0));
        assert_eq!(cwnd, 300);
        // Once per window, as a loss.
        assert!(!w.delay_cut(&mut cwnd, 100, 500, MAX, 4000.0, 1000.0));
        assert_eq!(cwnd, 300);
        w.on_ack(&mut cwnd, 500, MAX);
        // Just above: at least one packet goes (the sample before was
        // far above).
        assert!(w.delay_cut(&mut cwnd, 500, 800, MAX, 1000.1, 1000.0));
        assert_eq!(cwnd, 299);
        // Far above: at most DELAY_BETA of it, never under the floor.
        w.on_ack(&mut cwnd, 800, MAX);
        assert!(!w.delay_cut(&mut cwnd, 800, 1099, MAX, 500.0, 1000.0));
        assert!(!w.delay_cut(&mut cwnd, 800, 1099, MAX, 1e9, 1000.0));
        assert!(w.delay_cut(&mut cwnd, 800, 1099, MAX, 1e9, 1000.0));
        assert_eq!(cwnd, 59);
        w.on_ack(&mut cwnd, 1099, MAX);
        assert!(w.delay_cut(&mut cwnd, 1099, 1120, MAX, 1e9, 1000.0));
        assert_eq!(cwnd, MIN_CWND);
    }

    #[test]
    fn a_restart_forgets_the_last_loss() {
        let (mut w, mut cwnd) = full(256);
        w.cut(&mut cwnd, 0, 256, MAX);
        w.restart(50);
        assert_eq!(w, Window { una: 50, ..Window::default() });
        // Slow start has no ceiling but the largest window.
        w.on_ack(&mut cwnd, 50 + 1000, MAX);
        assert_eq!(cwnd, 1128);
    }
}
