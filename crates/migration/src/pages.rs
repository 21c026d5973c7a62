//! Page sets: ranges of page numbers, an atomic bitmap, and the holes of a
//! memfd (pages never written, known to be zero without touching them).
//! The bottom of the engine: it uses no other module of it.

use std::os::fd::RawFd;

/// Bytes in a guest page: the unit of tracking, transfer and placement.
pub const PAGE_SIZE: u64 = 4096;
use std::sync::atomic::{AtomicU64, Ordering};

/// `count` pages starting at page number `first`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageRange {
    pub first: u64,
    pub count: u64,
}

impl PageRange {
    pub fn end(&self) -> u64 {
        self.first + self.count
    }
    /// The part of the range below page `total` (empty if none is).
    pub fn clipped(&self, total: u64) -> PageRange {
        PageRange { first: self.first, count: self.end().min(total).saturating_sub(self.first) }
    }
}

/// Sort, merge overlapping or adjacent ranges, clip to `total` pages.
pub fn normalize(mut v: Vec<PageRange>, total: u64) -> Vec<PageRange> {
    v.retain(|r| r.count > 0 && r.first < total);
    v.sort_by_key(|r| r.first);
    let mut out: Vec<PageRange> = Vec::with_capacity(v.len());
    for r in v {
        let end = r.end().min(total);
        match out.last_mut() {
            Some(last) if r.first <= last.end() => {
                if end > last.end() {
                    last.count = end - last.first;
                }
            }
            _ => out.push(PageRange { first: r.first, count: end - r.first }),
        }
    }
    out
}

pub fn count_pages(v: &[PageRange]) -> u64 {
    v.iter().map(|r| r.count).sum()
}

/// A fixed-size bitmap that many threads set bits in.
pub struct AtomicBitmap {
    words: Vec<AtomicU64>,
    bits: u64,
}

impl AtomicBitmap {
    pub fn new(bits: u64) -> Self {
        AtomicBitmap { words: (0..bits.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(), bits }
    }
    pub fn set(&self, i: u64) {
        self.words[(i / 64) as usize].fetch_or(1 << (i % 64), Ordering::Relaxed);
    }
    /// Set bit `i`; true if it was clear before (this caller set it first).
    pub fn test_and_set(&self, i: u64) -> bool {
        let m = 1 << (i % 64);
        self.words[(i / 64) as usize].fetch_or(m, Ordering::AcqRel) & m == 0
    }
    /// Clear bit `i`; true if it was set.
    pub fn test_and_clear(&self, i: u64) -> bool {
        let m = 1 << (i % 64);
        self.words[(i / 64) as usize].fetch_and(!m, Ordering::AcqRel) & m != 0
    }
    pub fn clear(&self, i: u64) {
        self.words[(i / 64) as usize].fetch_and(!(1 << (i % 64)), Ordering::Relaxed);
    }
    pub fn clear_all(&self) {
        self.words.iter().for_each(|w| w.store(0, Ordering::Relaxed));
    }
    /// The bits as little-endian words (for the wire).
    pub fn to_le_bytes(&self) -> Vec<u8> {
        self.words.iter().flat_map(|w| w.load(Ordering::Acquire).to_le_bytes()).collect()
    }
    /// Bits set in a [`to_le_bytes`](Self::to_le_bytes) image of `bits` bits.
    pub fn from_le_bytes(bits: u64, b: &[u8]) -> Option<AtomicBitmap> {
        if b.len() as u64 != bits.div_ceil(64) * 8 {
            return None;
        }
        let words: Vec<AtomicU64> = b.chunks(8).map(|c| AtomicU64::new(u64::from_le_bytes(c.try_into().unwrap()))).collect();
        // Bits past the end are not pages: a peer must not make them count.
        if !bits.is_multiple_of(64) {
            if let Some(w) = words.last() {
                w.fetch_and((1u64 << (bits % 64)) - 1, Ordering::Relaxed);
            }
        }
        Some(AtomicBitmap { words, bits })
    }
    /// A copy of the bits as they are now.
    pub fn snapshot(&self) -> AtomicBitmap {
        AtomicBitmap { words: self.words.iter().map(|w| AtomicU64::new(w.load(Ordering::Acquire))).collect(), bits: self.bits }
    }
    pub fn get(&self, i: u64) -> bool {
        self.words[(i / 64) as usize].load(Ordering::Relaxed) & (1 << (i % 64)) != 0
    }
    /// One atomic OR per 64 pages, not per page.
    pub fn set_range(&self, r: PageRange) {
        let (mut i, end) = (r.first, r.end());
        while i < end {
            let bit = i % 64;
            let n = (64 - bit).min(end - i);
            let mask = if n == 64 { u64::MAX } else { ((1u64 << n) - 1) << bit };
            self.words[(i / 64) as usize].fetch_or(mask, Ordering::Relaxed);
            i += n;
        }
    }
    pub fn count_ones(&self) -> u64 {
        self.words.iter().map(|w| w.load(Ordering::Relaxed).count_ones() as u64).sum()
    }
    pub fn len(&self) -> u64 {
        self.bits
    }
    pub fn is_empty(&self) -> bool {
        self.bits == 0
    }
}

/// Page ranges of `fd` (bytes [0, len)) that hold data, per SEEK_DATA /
/// SEEK_HOLE. Everything else is a hole and reads as zero; reading a shmem
/// hole through a mapping would allocate it, so we never do.
pub fn data_ranges(fd: RawFd, len: u64, page: u64) -> std::io::Result<Vec<PageRange>> {
    data_ranges_between(fd, 0, len, page)
}

/// [`data_ranges`] within `within` only (page ranges of the file), e.g. to
/// look again at what were holes: SEEK_HOLE walks every page of a data
/// range (tens of ms per GiB), SEEK_DATA skips holes at once.
pub fn data_ranges_within(fd: RawFd, within: &[PageRange], page: u64) -> std::io::Result<Vec<PageRange>> {
    let mut out = Vec::new();
    for r in within {
        out.extend(data_ranges_between(fd, r.first * page, r.end() * page, page)?);
    }
    Ok(out)
}

/// [`data_ranges`] of `fd` mapped shared at `addr`, faster where most of
/// the file holds data: SEEK_HOLE walks every data page (40 ms for 4 GiB),
/// while mincore reads page tables (2 ms for 4 GiB mapped). Pages resident
/// in memory are data; the rest are looked at with SEEK_DATA, which skips
/// holes at once (a page swapped out is data, not resident). Mostly holes
/// go by `data_ranges` alone: mincore looks up each unmapped page (50 ms
/// for 4 GiB).
pub fn data_ranges_mapped(addr: *const u8, fd: RawFd, len: u64, page: u64) -> std::io::Result<Vec<PageRange>> {
    let pages = len / page;
    // SAFETY: fstat into a zeroed struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let allocated = st.st_blocks as u64 * 512 / page;
    if allocated * 4 < pages * 3 {
        return data_ranges(fd, len, page);
    }
    let mut resident = vec![0u8; pages as usize];
    // SAFETY: `addr` maps `len` bytes (the caller's mapping); one byte per page out.
    if unsafe { libc::mincore(addr as *mut libc::c_void, len as usize, resident.as_mut_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut data = Vec::new();
    let mut p = 0;
    while p < pages {
        let start = p;
        let on = resident[p as usize] & 1 != 0;
        while p < pages && (resident[p as usize] & 1 != 0) == on {
            p += 1;
        }
        if on {
            data.push(PageRange { first: start, count: p - start });
        }
    }
    let others = complement(&data, pages);
    // Many scattered gaps cost two lseeks each: walk the file instead.
    if others.len() > 4096 {
        return data_ranges(fd, len, page);
    }
    data.extend(data_ranges_within(fd, &others, page)?);
    Ok(normalize(data, pages))
}

/// Data page ranges of `fd` in bytes [start, end) (page-aligned).
fn data_ranges_between(fd: RawFd, start: u64, len: u64, page: u64) -> std::io::Result<Vec<PageRange>> {
    let mut out = Vec::new();
    let mut off = start as i64;
    while (off as u64) < len {
        // SAFETY: lseek on a valid fd has no memory effects.
        let data = unsafe { libc::lseek(fd, off, libc::SEEK_DATA) };
        if data < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                break; // no data after `off`
            }
            return Err(e);
        }
        if data as u64 >= len {
            // The next data is past the window: do not walk it (SEEK_HOLE
            // would, page by page, to its end).
            break;
        }
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let first = data as u64 / page;
        let end = (hole as u64).min(len).div_ceil(page);
        if end > first {
            out.push(PageRange { first, count: end - first });
        }
        off = hole;
    }
    Ok(out)
}

/// Split `ranges` into the complement within [0, total).
pub fn complement(ranges: &[PageRange], total: u64) -> Vec<PageRange> {
    let mut out = Vec::new();
    let mut cur = 0;
    for r in ranges {
        if r.first > cur {
            out.push(PageRange { first: cur, count: r.first - cur });
        }
        cur = cur.max(r.end());
    }
    if cur < total {
        out.push(PageRange { first: cur, count: total - cur });
    }
    out
}

/// How many pages two sorted, disjoint range lists have in common.
pub fn overlap(a: &[PageRange], b: &[PageRange]) -> u64 {
    let (mut i, mut j, mut n) = (0, 0, 0);
    while i < a.len() && j < b.len() {
        let (lo, hi) = (a[i].first.max(b[j].first), a[i].end().min(b[j].end()));
        n += hi.saturating_sub(lo);
        if a[i].end() <= b[j].end() {
            i += 1;
        } else {
            j += 1;
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlap_counts_common_pages() {
        let r = |first, count| PageRange { first, count };
        assert_eq!(overlap(&[r(0, 10), r(20, 10)], &[r(5, 20)]), 10);
        assert_eq!(overlap(&[r(5, 20)], &[r(0, 10), r(20, 10)]), 10);
        assert_eq!(overlap(&[r(0, 4)], &[r(4, 4)]), 0);
        assert_eq!(overlap(&[], &[r(0, 4)]), 0);
        assert_eq!(overlap(&[r(0, 100)], &[r(1, 1), r(3, 2), r(99, 5)]), 4);
    }

    #[test]
    fn normalize_merges_and_clips() {
        let v = vec![
            PageRange { first: 10, count: 5 },
            PageRange { first: 0, count: 2 },
            PageRange { first: 2, count: 1 },
            PageRange { first: 12, count: 10 },
            PageRange { first: 95, count: 10 },
        ];
        assert_eq!(
            normalize(v, 100),
            vec![PageRange { first: 0, count: 3 }, PageRange { first: 10, count: 12 }, PageRange { first: 95, count: 5 }]
        );
        let b = AtomicBitmap::new(300);
        b.set_range(PageRange { first: 60, count: 140 });
        b.set_range(PageRange { first: 5, count: 1 });
        assert_eq!(b.count_ones(), 141);
        assert!(b.get(5) && !b.get(59) && b.get(60) && b.get(127) && b.get(199) && !b.get(200));
        // A snapshot keeps the bits of its moment.
        let snap = b.snapshot();
        b.set(250);
        assert_eq!((snap.count_ones(), snap.len(), snap.get(250)), (141, 300, false));
        // Clipping to RAM.
        assert_eq!(PageRange { first: 95, count: 10 }.clipped(100), PageRange { first: 95, count: 5 });
        assert_eq!(PageRange { first: 120, count: 10 }.clipped(100).count, 0);
        // Data ranges of a memfd, whole and within windows.
        // SAFETY: plain syscalls on a file we own.
        let fd = unsafe { libc::memfd_create(c"pages-test".as_ptr(), 0) };
        assert!(fd >= 0);
        assert_eq!(unsafe { libc::ftruncate(fd, 64 * 4096) }, 0);
        for p in [3u64, 4, 10, 40] {
            assert_eq!(unsafe { libc::pwrite(fd, [1u8].as_ptr() as *const libc::c_void, 1, (p * 4096) as i64) }, 1);
        }
        let all = data_ranges(fd, 64 * 4096, 4096).unwrap();
        assert_eq!(all, vec![PageRange { first: 3, count: 2 }, PageRange { first: 10, count: 1 }, PageRange { first: 40, count: 1 }]);
        let holes = complement(&all, 64);
        assert_eq!(unsafe { libc::pwrite(fd, [1u8].as_ptr() as *const libc::c_void, 1, 20 * 4096) }, 1);
        assert_eq!(data_ranges_within(fd, &holes, 4096).unwrap(), vec![PageRange { first: 20, count: 1 }]);
        assert_eq!(data_ranges_within(fd, &[PageRange { first: 5, count: 5 }], 4096).unwrap(), vec![]);
        unsafe { libc::close(fd) };
        let c = complement(&[PageRange { first: 2, count: 3 }], 10);
        assert_eq!(c, vec![PageRange { first: 0, count: 2 }, PageRange { first: 5, count: 5 }]);
    }

    #[test]
    fn data_ranges_mapped_agrees_with_the_file_walk() {
        const PAGES: u64 = 24576;
        let ram = crate::memvm::GuestRam::new(PAGES * 4096).unwrap();
        let r = ram.region();
        let check = |what: &str| {
            let walked = data_ranges(r.memfd, r.len, 4096).unwrap();
            assert_eq!(data_ranges_mapped(r.host_addr, r.memfd, r.len, 4096).unwrap(), walked, "{what}");
        };
        check("empty (the file walk alone)");
        // Mostly data with a few holes: mincore, then SEEK_DATA in the gaps.
        // Some pages go in with pwrite (in the page cache, not mapped here:
        // mincore counts them all the same).
        for p in (0..PAGES).filter(|p| !(100..110).contains(p) && ![7, 5000, PAGES - 1].contains(p)) {
            if p % 3 == 0 {
                assert_eq!(unsafe { libc::pwrite(r.memfd, [1u8].as_ptr() as *const libc::c_void, 1, (p * 4096) as i64) }, 1);
            } else {
                unsafe { *ram.byte_ptr(p * 4096) = 1 };
            }
        }
        check("mostly data");
        // A hole in every fifth page: still mostly data, but too many gaps
        // to look at one by one.
        for p in (0..PAGES).step_by(5) {
            assert_eq!(
                unsafe { libc::fallocate(r.memfd, libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, (p * 4096) as i64, 4096) },
                0
            );
        }
        check("scattered holes");
    }
}
