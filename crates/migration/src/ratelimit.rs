//! A token bucket shared by all channels of one migration (`--max-bandwidth`).

use std::sync::Mutex;
use std::time::{Duration, Instant};

pub struct TokenBucket {
    rate: f64, // bytes per second; 0 = unlimited
    state: Mutex<(f64, Instant)>,
}

impl TokenBucket {
    pub fn new(bytes_per_s: u64) -> Self {
        TokenBucket { rate: bytes_per_s as f64, state: Mutex::new((0.0, Instant::now())) }
    }

    /// The cap in bytes per second (0: none).
    pub fn rate(&self) -> u64 {
        self.rate as u64
    }

    /// Take `n` bytes worth of tokens, sleeping as long as needed. A burst of
    /// at most 50 ms worth of bytes is allowed so channels stay busy.
    pub fn take(&self, n: usize) {
        if self.rate <= 0.0 {
            return;
        }
        let wait = {
            let mut s = self.state.lock().unwrap();
            let now = Instant::now();
            let burst = self.rate * 0.05;
            s.0 = (s.0 + now.duration_since(s.1).as_secs_f64() * self.rate).min(burst);
            s.1 = now;
            s.0 -= n as f64;
            if s.0 < 0.0 {
                Duration::from_secs_f64(-s.0 / self.rate)
            } else {
                Duration::ZERO
            }
        };
        if !wait.is_zero() {
            std::thread::sleep(wait);
        }
    }
}
