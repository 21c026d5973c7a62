//! The devices' pages at a postcopy switch: what devices reach without the
//! vCPU (`MigratableVm::device_pages`: a PVRDMA device's rings and memory
//! regions, which its rnicd reads and writes for the peers) crosses inside
//! the switch, so that the destination holds every one of them before it
//! reports the VM loaded. Pushed after the resume instead, they arrived
//! behind the device's first accesses: rnicd touched them within
//! milliseconds of its QPs' resume, and each access to a missing page held
//! its event loop (every QP of its host) for an urgent round trip.
//!
//! The source sends them on the first urgent connection before it answers
//! anything there, and names them in `Switchover` (`device_pages`); the
//! destination marks them asked, asks itself for the devices' pages it
//! still lacks that the source did not name (an older source sends none),
//! and waits for all of them once it loaded the state. Their page batches
//! carry a hash per page like every other: a damaged page fails the
//! switch, before the commit, and the VM stays on the source.
//!
//! What it costs the downtime: the destination allocated the pages ahead
//! (`dest::populate_device_pages`, from the early sections) and places
//! them in the switch's real-time class, beside its restore; at 256 QPs
//! (2132 pages, 8.3 MiB) they were all there 0.1 ms after the restore,
//! and mapping them into rnicd took 1.1-2.4 ms.

use crate::dirty::PAGE_SIZE;
use crate::pages::{AtomicBitmap, PageRange};
use crate::sender::nonzero_xxh3;
use crate::stats::Control;
use crate::vm::RamRegion;
use crate::wire::BatchWriter;
use anyhow::Result;
use std::io::Write;

/// The most device pages that cross inside a switch (10 MiB): the
/// source reads, hashes and sends each in about 3 us under load (2132
/// pages at 256 QPs in 4.5-6.7 ms in three runs, 21 ms in one under a
/// heavier load, beside the destination's restore), so
/// this bounds what they add to the downtime. The rings and the regions
/// come first in the devices' list; a region of tens of MiB (the source of
/// a big RDMA WRITE) would add its whole transfer for the few pages rnicd
/// reads at once. What is left is pushed first after the resume.
pub const SWITCH_PAGES_MAX: u64 = 2560;

/// Whether page `p` is in `missing` (sorted, disjoint; None: all of RAM).
pub fn in_ranges(missing: Option<&[PageRange]>, p: u64) -> bool {
    match missing {
        None => true,
        Some(m) => {
            let i = m.partition_point(|r| r.first <= p);
            i > 0 && p < m[i - 1].end()
        }
    }
}

/// The devices' pages, in their order, that the destination `lacks`, each
/// once (the first [`SWITCH_PAGES_MAX`] of them cross in the switch,
/// [`first_pages`]).
pub fn lacking_in_order(device: &[PageRange], lacks: impl Fn(u64) -> bool, total: u64) -> Vec<PageRange> {
    let taken = AtomicBitmap::new(total);
    let mut out: Vec<PageRange> = Vec::new();
    for r in device {
        for p in r.first..r.end().min(total) {
            if !lacks(p) || !taken.test_and_set(p) {
                continue;
            }
            match out.last_mut() {
                Some(l) if l.end() == p => l.count += 1,
                _ => out.push(PageRange { first: p, count: 1 }),
            }
        }
    }
    out
}

/// How many distinct pages inside RAM the devices name (`DevicePages::named`,
/// counted alike by both sides).
pub fn count_named(device: &[PageRange], total: u64) -> u64 {
    crate::pages::count_pages(&crate::pages::normalize(device.to_vec(), total))
}

/// The first `max` pages of `ranges`, in their order.
pub fn first_pages(ranges: &[PageRange], max: u64) -> Vec<PageRange> {
    let mut left = max;
    let mut out = Vec::new();
    for r in ranges {
        if left == 0 {
            break;
        }
        let count = r.count.min(left);
        out.push(PageRange { first: r.first, count });
        left -= count;
    }
    out
}

/// Source: write `pages` of the paused VM's RAM to `w` as page batches
/// (zero pages as zero records). Returns the pages written. (The calling
/// thread's CPU is its caller's to count.)
pub(crate) fn send(w: &mut impl Write, ram: RamRegion, pages: &[PageRange], ctl: &Control) -> Result<u64> {
    // SAFETY: `lacking_in_order` kept the pages inside guest RAM; the VM is
    // paused, so nothing writes them.
    let page = |pfn: u64| unsafe { std::slice::from_raw_parts(ram.host_addr.add((pfn * PAGE_SIZE) as usize), PAGE_SIZE as usize) };
    // Tests: the first page with data leaves damaged, with its right hash.
    let spoiled: Option<(u64, Vec<u8>)> = ctl
        .testing
        .fire(crate::testing::Fault::CorruptDevicePage)
        .then(|| {
            let pfn = pages.iter().flat_map(|r| r.first..r.end()).find(|&p| nonzero_xxh3(page(p)).is_some())?;
            let mut copy = page(pfn).to_vec();
            copy[7] ^= 0x40;
            Some((pfn, copy))
        })
        .flatten();
    let (mut sent, mut wire_bytes) = (0u64, 0u64);
    let mut batch = BatchWriter::new();
    for r in pages {
        for pfn in r.first..r.end() {
            let src = page(pfn);
            match nonzero_xxh3(src) {
                Some(h) => match &spoiled {
                    Some((p, copy)) if *p == pfn => batch.raw_hashed(pfn, copy, h),
                    _ => batch.raw_hashed(pfn, src, h),
                },
                None => batch.zero(pfn),
            }
            sent += 1;
            if batch.is_full() {
                wire_bytes += batch.write_to(w)? as u64;
            }
        }
    }
    if !batch.is_empty() {
        wire_bytes += batch.write_to(w)? as u64;
    }
    ctl.update(|s| {
        s.pages_sent += sent;
        s.wire_bytes += wire_bytes;
    });
    Ok(sent)
}

/// (first, count) pairs of the `Switchover` message, checked against RAM.
pub(crate) fn from_wire(pairs: &[(u64, u64)], total: u64) -> Result<Vec<PageRange>> {
    pairs
        .iter()
        .map(|&(first, count)| {
            if count == 0 || first.checked_add(count).is_none_or(|e| e > total) {
                anyhow::bail!("corrupted stream: device pages {first} (+{count}) outside guest RAM");
            }
            Ok(PageRange { first, count })
        })
        .collect()
}

pub(crate) fn to_wire(pages: &[PageRange]) -> Vec<(u64, u64)> {
    pages.iter().map(|r| (r.first, r.count)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(first: u64, count: u64) -> PageRange {
        PageRange { first, count }
    }

    #[test]
    fn takes_the_devices_order_missing_pages_once_up_to_the_budget() {
        let device = [r(50, 4), r(10, 2), r(51, 2), r(90, 20)];
        // Pure postcopy: every page is missing.
        let all = |p| in_ranges(None, p);
        assert_eq!(lacking_in_order(&device, all, 100), vec![r(50, 4), r(10, 2), r(90, 10)]);
        // Budget: the first 5 pages in the devices' order.
        assert_eq!(first_pages(&lacking_in_order(&device, all, 100), 5), vec![r(50, 4), r(10, 1)]);
        // Hybrid: only what the destination lacks.
        let missing = [r(0, 11), r(52, 40)];
        assert_eq!(lacking_in_order(&device, |p| in_ranges(Some(&missing), p), 100), vec![r(52, 2), r(10, 1), r(90, 2)]);
        assert!(lacking_in_order(&device, |p| in_ranges(Some(&[]), p), 100).is_empty());
        // Named: each page inside RAM once (50..54, 10..12, 90..100).
        assert_eq!(count_named(&device, 100), 16);
    }

    #[test]
    fn ranges_outside_ram_are_refused() {
        assert_eq!(from_wire(&[(3, 2)], 8).unwrap(), vec![r(3, 2)]);
        assert!(from_wire(&[(7, 2)], 8).is_err());
        assert!(from_wire(&[(1, 0)], 8).is_err());
        assert!(from_wire(&[(u64::MAX, 2)], 8).is_err());
    }
}
