//! `key=value` words of the command line.

pub struct Args(pub &'static str);

impl Args {
    pub fn get(&self, key: &str) -> Option<&'static str> {
        self.0.split_ascii_whitespace().find_map(|w| {
            let (k, v) = w.split_once('=')?;
            (k == key).then_some(v)
        })
    }

    /// A number: decimal with an optional K/M/G/T suffix (powers of two) or
    /// `0x` hexadecimal, as `units::parse_size` reads it.
    pub fn num(&self, key: &str, default: u64) -> u64 {
        self.get(key).and_then(|v| units::parse_size(v).ok()).unwrap_or(default)
    }
}
