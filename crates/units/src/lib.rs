//! Sizes and rates as people write them, with one meaning for every suffix
//! wherever Transit reads one (the vmm's `--memory`, NVMe namespace sizes,
//! the guest's `key=value` arguments, `--max-bandwidth`).
//!
//! - **Sizes** count bytes. `K`, `M`, `G`, `T` are powers of two (as QEMU's
//!   `-m 512M` and `qemu_strtosz`): `512M` is 512 MiB. A trailing `B` or
//!   `iB` changes nothing (`4G`, `4GB` and `4GiB` are all 4 GiB), and case
//!   does not matter. `0x...` is a plain hexadecimal byte count.
//! - **Rates** (`parse_bandwidth`) are bytes per second written as a size
//!   (`125M` is 125 MiB/s, as QEMU's `max-bandwidth`), or bits per second
//!   with `kbit`/`mbit`/`gbit`, powers of ten as network links are quoted
//!   (`1gbit` is 125,000,000 bytes/s).
//!
//! `no_std`, so that the guest firmware parses its arguments with the same
//! function.

#![no_std]

use core::fmt;

/// Why a size or rate did not parse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnitError {
    /// Not a number with a known suffix.
    Malformed,
    /// The value does not fit in 64 bits.
    TooLarge,
}

impl fmt::Display for UnitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UnitError::Malformed => f.write_str("not a size (write e.g. 4096, 0x1000, 512M or 4GiB)"),
            UnitError::TooLarge => f.write_str("too large"),
        }
    }
}

/// A byte count: `4096`, `0x1000`, `64K`, `512M`, `4G`, `1T`, `4GiB`, `4GB`.
/// See the crate documentation for what the suffixes mean.
pub fn parse_size(s: &str) -> Result<u64, UnitError> {
    let s = s.trim();
    if let Some(hex) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        return u64::from_str_radix(hex, 16).map_err(|_| UnitError::Malformed);
    }
    // "iB" needs a multiplier before it ("4GiB", not "5iB"); "B" alone
    // may follow a plain count ("100B").
    let (body, needs_multiplier) = match strip_suffix_ignore_case(s, "ib") {
        Some(body) => (body, true),
        None => (strip_suffix_ignore_case(s, "b").unwrap_or(s), false),
    };
    let (digits, shift) = match body.as_bytes().last() {
        Some(b'K' | b'k') => (&body[..body.len() - 1], 10),
        Some(b'M' | b'm') => (&body[..body.len() - 1], 20),
        Some(b'G' | b'g') => (&body[..body.len() - 1], 30),
        Some(b'T' | b't') => (&body[..body.len() - 1], 40),
        _ if needs_multiplier => return Err(UnitError::Malformed),
        _ => (body, 0),
    };
    let value = parse_decimal(digits.trim_end())?;
    value.checked_mul(1u64 << shift).ok_or(UnitError::TooLarge)
}

/// A rate in bytes per second: a size per second (`125M` = 125 MiB/s) or
/// bits per second (`100mbit`, `1gbit`, powers of ten). `0` means unlimited
/// to the callers that take it.
pub fn parse_bandwidth(s: &str) -> Result<u64, UnitError> {
    let t = s.trim();
    for (suffix, bits_per_unit) in [("kbit", 1_000u64), ("mbit", 1_000_000), ("gbit", 1_000_000_000)] {
        if let Some(n) = strip_suffix_ignore_case(t, suffix) {
            let bits = parse_decimal(n.trim_end())?.checked_mul(bits_per_unit).ok_or(UnitError::TooLarge)?;
            return Ok(bits / 8);
        }
    }
    parse_size(t)
}

fn parse_decimal(digits: &str) -> Result<u64, UnitError> {
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(UnitError::Malformed);
    }
    digits.parse::<u64>().map_err(|_| UnitError::TooLarge)
}

fn strip_suffix_ignore_case<'a>(s: &'a str, suffix: &str) -> Option<&'a str> {
    let cut = s.len().checked_sub(suffix.len())?;
    let (head, tail) = (s.get(..cut)?, s.get(cut..)?);
    tail.eq_ignore_ascii_case(suffix).then_some(head)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suffixes_are_powers_of_two() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64K"), Ok(64 << 10));
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("512m"), Ok(512 << 20));
        assert_eq!(parse_size("4G"), Ok(4 << 30));
        assert_eq!(parse_size("2T"), Ok(2 << 40));
    }

    #[test]
    fn b_and_ib_change_nothing() {
        for s in ["4G", "4GB", "4GiB", "4gib", "4gb", " 4G "] {
            assert_eq!(parse_size(s), Ok(4 << 30), "{s:?}");
        }
        assert_eq!(parse_size("100B"), Ok(100));
    }

    #[test]
    fn hexadecimal_byte_counts() {
        assert_eq!(parse_size("0x1000"), Ok(0x1000));
        assert_eq!(parse_size("0x1B"), Ok(0x1b), "B is a hex digit here, not bytes");
        assert_eq!(parse_size("0X10"), Ok(16));
    }

    #[test]
    fn refuses_what_is_not_a_size() {
        for s in ["", "lots", "M", "4X", "-1", "1.5G", "5iB", "0x", "0xZZ", "4 G B", "+4"] {
            assert_eq!(parse_size(s), Err(UnitError::Malformed), "{s:?}");
        }
        assert_eq!(parse_size("99999999999T"), Err(UnitError::TooLarge));
        assert_eq!(parse_size("99999999999999999999"), Err(UnitError::TooLarge));
    }

    #[test]
    fn bandwidth_is_a_size_per_second_or_decimal_bits() {
        assert_eq!(parse_bandwidth("0"), Ok(0));
        assert_eq!(parse_bandwidth("125M"), Ok(125 << 20));
        assert_eq!(parse_bandwidth("1gbit"), Ok(125_000_000));
        assert_eq!(parse_bandwidth("100Mbit"), Ok(12_500_000));
        assert_eq!(parse_bandwidth("8kbit"), Ok(1_000));
        assert_eq!(parse_bandwidth("fast"), Err(UnitError::Malformed));
        assert_eq!(parse_bandwidth("gbit"), Err(UnitError::Malformed));
    }
}
