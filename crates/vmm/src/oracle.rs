//! Checks on guest RAM used by tests, the demo and benchmarks.

use serde::Serialize;

pub const PAGE: usize = 4096;

#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct DirtierReport {
    pub pages: u64,
    /// Pages that break the rule (0 means the oracle holds).
    pub bad_pages: u64,
    /// Whether the one allowed edge (where the loop was) was seen.
    pub edge: bool,
    /// First byte of the first page: how many passes, modulo 256.
    pub first_byte: u8,
    /// Where the rule first broke: (guest address, its byte, predecessor's byte).
    pub first_bad: Option<(u64, u8, u8)>,
}

/// QEMU's `check_guests_ram` rule for the dirtier: walking up from `start`,
/// every page's first byte equals its predecessor's, except at one edge where
/// it is exactly one less (the pages the current pass has not reached yet).
pub fn check_dirtier(ram: &[u8], start: u64, end: u64) -> DirtierReport {
    let (start, end) = (start as usize, (end as usize).min(ram.len()));
    let mut last = ram[start];
    let mut edge = false;
    let mut bad = 0;
    let mut pages = 0;
    let mut first_bad = None;
    let mut a = start;
    while a < end {
        let b = ram[a];
        if b != last {
            if b.wrapping_add(1) == last && !edge {
                edge = true;
                last = b;
            } else {
                bad += 1;
                first_bad.get_or_insert((a as u64, b, last));
            }
        }
        pages += 1;
        a += PAGE;
    }
    DirtierReport { pages, bad_pages: bad, edge, first_byte: ram[start], first_bad }
}

/// One 64-bit hash per 4 KiB page, to compare RAM across hosts.
pub fn page_digests(ram: &[u8]) -> Vec<u64> {
    ram.chunks(PAGE).map(migration::wire::xxh3).collect()
}

/// A single hash over the per-page digests.
pub fn ram_digest(ram: &[u8]) -> u64 {
    let d = page_digests(ram);
    let bytes: Vec<u8> = d.iter().flat_map(|x| x.to_le_bytes()).collect();
    migration::wire::xxh3(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oracle_rules() {
        let mut ram = vec![0u8; 16 * PAGE];
        for p in 0..16 {
            ram[p * PAGE] = if p < 5 { 8 } else { 7 };
        }
        let r = check_dirtier(&ram, 0, ram.len() as u64);
        assert_eq!(r.bad_pages, 0);
        assert!(r.edge);
        ram[9 * PAGE] = 3; // a stale page, as a lost write would leave
        assert_eq!(check_dirtier(&ram, 0, ram.len() as u64).bad_pages, 1);
        // wrap-around 0 -> 255 is one step
        let mut w = vec![0u8; 4 * PAGE];
        w[0] = 0;
        w[PAGE] = 0;
        w[2 * PAGE] = 255;
        w[3 * PAGE] = 255;
        assert_eq!(check_dirtier(&w, 0, w.len() as u64).bad_pages, 0);
    }
}
