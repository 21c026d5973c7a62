//! A token bucket shared by all channels of one migration (`--max-bandwidth`).
//!
//! Its rate can change while the migration runs (`migrate-set-parameters
//! max_bandwidth`, as QEMU's `max-bandwidth`): a sender waiting for tokens
//! looks at the rate again at least every [`RECHECK`], so a raised or
//! lifted cap takes effect within that, not after a wait computed at the
//! old rate.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Longest a waiting sender sleeps before it looks at the rate again.
const RECHECK: Duration = Duration::from_millis(20);

pub struct TokenBucket {
    /// Bytes per second; 0 = unlimited.
    rate: AtomicU64,
    state: Mutex<Tokens>,
}

struct Tokens {
    /// In the bucket (bytes; negative: owed by the senders waiting).
    have: f64,
    /// All tokens ever earned: a waiter goes when this reaches the mark
    /// its take set, so senders go in the order they took, whatever the
    /// rate did meanwhile.
    earned: f64,
    /// When `have` and `earned` were last counted.
    at: Instant,
}

impl Default for TokenBucket {
    /// No cap.
    fn default() -> Self {
        TokenBucket::new(0)
    }
}

impl TokenBucket {
    pub fn new(bytes_per_s: u64) -> Self {
        TokenBucket { rate: AtomicU64::new(bytes_per_s), state: Mutex::new(Tokens { have: 0.0, earned: 0.0, at: Instant::now() }) }
    }

    /// The cap in bytes per second (0: none).
    pub fn rate(&self) -> u64 {
        self.rate.load(Ordering::Relaxed)
    }

    /// A new cap (0: none), from now on: what was owed at the old rate is
    /// repaid at the new one, and lifting the cap forgives it.
    pub fn set_rate(&self, bytes_per_s: u64) {
        let mut t = self.state.lock().unwrap();
        self.refill(&mut t);
        self.rate.store(bytes_per_s, Ordering::Relaxed);
        if bytes_per_s == 0 {
            t.have = 0.0;
        }
    }

    /// Counts the tokens earned since the last count, at the current rate.
    /// A burst of at most 50 ms worth of bytes is kept so channels stay
    /// busy.
    fn refill(&self, t: &mut Tokens) {
        let now = Instant::now();
        let rate = self.rate() as f64;
        let new = now.duration_since(t.at).as_secs_f64() * rate;
        t.earned += new;
        t.have = (t.have + new).min(rate * 0.05);
        t.at = now;
    }

    /// For a loop with other work than waiting: how long until what was
    /// [`charge`](Self::charge)d is paid for (`None`: nothing owed, or no
    /// cap). It sends nothing while something is owed.
    pub fn owed(&self) -> Option<Duration> {
        let rate = self.rate();
        if rate == 0 {
            return None;
        }
        let mut t = self.state.lock().unwrap();
        self.refill(&mut t);
        (t.have < 0.0).then(|| Duration::from_secs_f64(-t.have / rate as f64))
    }

    /// `n` bytes sent without waiting (after [`owed`](Self::owed) found
    /// nothing owed): the next ones wait until they are paid for.
    pub fn charge(&self, n: u64) {
        if self.rate() == 0 {
            return;
        }
        let mut t = self.state.lock().unwrap();
        self.refill(&mut t);
        t.have -= n as f64;
    }

    /// Take `n` bytes worth of tokens, sleeping as long as needed.
    pub fn take(&self, n: usize) {
        if self.rate() == 0 {
            return;
        }
        let mark = {
            let mut t = self.state.lock().unwrap();
            self.refill(&mut t);
            t.have -= n as f64;
            if t.have >= 0.0 {
                return;
            }
            t.earned - t.have
        };
        loop {
            let wait = {
                let mut t = self.state.lock().unwrap();
                let rate = self.rate();
                if rate == 0 {
                    return;
                }
                self.refill(&mut t);
                if t.earned >= mark {
                    return;
                }
                Duration::from_secs_f64((mark - t.earned) / rate as f64)
            };
            // The last stretch at this rate: no need to look again.
            if wait <= RECHECK {
                std::thread::sleep(wait);
                return;
            }
            std::thread::sleep(RECHECK);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sender owing 10 s of tokens at 1000 B/s, then the cap set to
    /// `rate`: how long the sender waited in all.
    fn waited_after_the_cap_became(rate: u64) -> Duration {
        let b = std::sync::Arc::new(TokenBucket::new(1000));
        let b2 = b.clone();
        let t = Instant::now();
        let waiter = std::thread::spawn(move || b2.take(10_000));
        std::thread::sleep(Duration::from_millis(50));
        b.set_rate(rate);
        waiter.join().unwrap();
        assert_eq!(b.rate(), rate);
        t.elapsed()
    }

    #[test]
    fn a_lifted_cap_frees_a_waiting_sender_at_once() {
        let waited = waited_after_the_cap_became(0);
        assert!(waited < Duration::from_secs(5), "the waiter slept {waited:?} after the cap was lifted");
    }

    #[test]
    fn a_raised_cap_repays_the_debt_at_the_new_rate() {
        let waited = waited_after_the_cap_became(1_000_000_000);
        assert!(waited < Duration::from_secs(5), "the waiter slept {waited:?} after the cap was raised");
    }

    /// Without sleeping: what is charged beyond the burst is owed for as
    /// long as the rate takes to pay it; a raised cap pays it faster, a
    /// lifted one forgives it.
    #[test]
    fn a_charge_is_owed_until_paid_at_the_rate_in_force() {
        let b = TokenBucket::new(1_000_000);
        assert_eq!(b.owed(), None);
        b.charge(1_000_000);
        let owed = b.owed().expect("a second's worth charged");
        assert!(owed > Duration::from_millis(900) && owed <= Duration::from_secs(1), "{owed:?}");
        b.set_rate(10_000_000);
        let owed = b.owed().expect("still owed at the raised rate");
        assert!(owed <= Duration::from_millis(100), "{owed:?}");
        b.set_rate(0);
        assert_eq!(b.owed(), None);
        b.charge(1_000_000);
        assert_eq!(b.owed(), None, "nothing is owed without a cap");
    }

    #[test]
    fn the_cap_holds_the_rate() {
        let b = TokenBucket::new(1_000_000);
        let t = Instant::now();
        for _ in 0..20 {
            b.take(10_000);
        }
        // 200 KB at 1 MB/s, less the 50 ms burst: at least 0.15 s.
        assert!(t.elapsed() >= Duration::from_millis(140), "{:?}", t.elapsed());
    }
}
