//! `key=value` words of the command line.

pub struct Args(pub &'static str);

impl Args {
    pub fn get(&self, key: &str) -> Option<&'static str> {
        self.0.split_ascii_whitespace().find_map(|w| {
            let (k, v) = w.split_once('=')?;
            (k == key).then_some(v)
        })
    }

    /// A number with an optional K/M/G suffix (powers of two).
    pub fn num(&self, key: &str, default: u64) -> u64 {
        self.get(key).and_then(parse_size).unwrap_or(default)
    }
}

pub fn parse_size(s: &str) -> Option<u64> {
    let (digits, mult) = match s.as_bytes().last()? {
        b'K' | b'k' => (&s[..s.len() - 1], 1u64 << 10),
        b'M' | b'm' => (&s[..s.len() - 1], 1 << 20),
        b'G' | b'g' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    let v = if let Some(h) = digits.strip_prefix("0x") { u64::from_str_radix(h, 16).ok()? } else { digits.parse::<u64>().ok()? };
    v.checked_mul(mult)
}
