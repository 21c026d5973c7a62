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

/// Parse a bandwidth: bytes per second with k/M/G (x1000) suffixes, or bits
/// per second with kbit/mbit/gbit. "0" means unlimited.
pub fn parse_bandwidth(s: &str) -> Result<u64, String> {
    let t = s.trim().to_ascii_lowercase();
    let (num, mult): (&str, f64) = if let Some(n) = t.strip_suffix("gbit") {
        (n, 1e9 / 8.0)
    } else if let Some(n) = t.strip_suffix("mbit") {
        (n, 1e6 / 8.0)
    } else if let Some(n) = t.strip_suffix("kbit") {
        (n, 1e3 / 8.0)
    } else if let Some(n) = t.strip_suffix("gb").or(t.strip_suffix('g')) {
        (n, 1e9)
    } else if let Some(n) = t.strip_suffix("mb").or(t.strip_suffix('m')) {
        (n, 1e6)
    } else if let Some(n) = t.strip_suffix("kb").or(t.strip_suffix('k')) {
        (n, 1e3)
    } else {
        (t.strip_suffix('b').unwrap_or(&t), 1.0)
    };
    let v: f64 = num.trim().parse().map_err(|_| format!("bad bandwidth {s:?} (e.g. 1gbit, 125M, 0 = unlimited)"))?;
    if !(v >= 0.0 && v.is_finite()) {
        return Err(format!("bad bandwidth {s:?}"));
    }
    Ok((v * mult) as u64)
}

#[cfg(test)]
mod tests {
    #[test]
    fn parse() {
        assert_eq!(super::parse_bandwidth("1gbit").unwrap(), 125_000_000);
        assert_eq!(super::parse_bandwidth("125M").unwrap(), 125_000_000);
        assert_eq!(super::parse_bandwidth("0").unwrap(), 0);
        assert!(super::parse_bandwidth("fast").is_err());
    }
}
