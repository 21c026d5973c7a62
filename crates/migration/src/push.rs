//! The source's background push: the pages the destination still misses,
//! handed to the bulk channels in chunks, starting next to the most recent
//! fault (a guest that touched page p will likely touch p+1 soon), as
//! QEMU's postcopy does after each page request. Pages that devices reach
//! without the vCPU (`MigratableVm::device_pages`) go before all others.

use crate::pages::PageRange;
use std::sync::Mutex;

struct Inner {
    bits: Vec<u64>,
    /// Ranges to push before the cursor's sweep, in order (the devices'
    /// pages); the pages of them still queued in `bits` go first.
    first: std::collections::VecDeque<PageRange>,
    /// Known-zero ranges (memfd holes): sent first, one record each.
    zero: Vec<PageRange>,
    cursor: u64,
    left: u64,
}

pub struct PushQueue {
    inner: Mutex<Inner>,
    total: u64,
}

/// One claimed piece of work: pages to send, or a known-zero run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claim {
    pub first: u64,
    pub count: u64,
    pub known_zero: bool,
}

impl PushQueue {
    /// Pages to push: `data` (read and sent) and `zero` (known holes).
    pub fn new(total: u64, data: &[PageRange], zero: Vec<PageRange>) -> PushQueue {
        let mut bits = vec![0u64; total.div_ceil(64) as usize];
        let mut left = 0;
        for r in data {
            for p in r.first..r.end().min(total) {
                let (w, b) = ((p / 64) as usize, p % 64);
                if bits[w] & (1 << b) == 0 {
                    bits[w] |= 1 << b;
                    left += 1;
                }
            }
        }
        PushQueue { inner: Mutex::new(Inner { bits, first: Default::default(), zero, cursor: 0, left }), total }
    }

    /// Start over with this work (after a reconnection: what the
    /// destination reports missing).
    /// The ranges of `push_first` stay first.
    pub fn reset(&self, total: u64, data: &[PageRange], zero: Vec<PageRange>) {
        let mut fresh = PushQueue::new(total, data, zero).inner.into_inner().unwrap();
        let mut g = self.inner.lock().unwrap();
        fresh.first = std::mem::take(&mut g.first);
        *g = fresh;
    }

    /// Push the queued pages of `ranges` (in their order) before any
    /// other; the known-zero runs still go first (one record each).
    pub fn push_first(&self, ranges: &[PageRange]) {
        let mut g = self.inner.lock().unwrap();
        g.first = ranges.iter().filter(|r| r.first < self.total && r.count > 0).copied().collect();
    }

    /// Nothing more to push (the destination has every page).
    pub fn clear(&self) {
        let mut g = self.inner.lock().unwrap();
        g.bits.iter_mut().for_each(|w| *w = 0);
        g.zero.clear();
        g.left = 0;
    }

    /// Pages still to read and send (known-zero runs not counted).
    pub fn left(&self) -> u64 {
        self.inner.lock().unwrap().left
    }

    /// A fault asked for `first..first+count`: those go out now on the
    /// urgent connection, so drop them here, and push on from there.
    pub fn requested(&self, first: u64, count: u64) {
        self.take(first, count, |_| {});
    }

    /// Prefetch of `first..first+count`: take the pages still queued (the
    /// others went out with the push already) into `out` as runs, and push
    /// on from there.
    pub fn take_queued(&self, first: u64, count: u64, out: &mut Vec<PageRange>) {
        self.take(first, count, |p| match out.last_mut() {
            Some(r) if r.end() == p => r.count += 1,
            _ => out.push(PageRange { first: p, count: 1 }),
        });
    }

    /// Pages that went another way (the devices' pages of the switch):
    /// drop them from the queue, the cursor stays.
    pub fn drop_queued(&self, first: u64, count: u64) {
        let mut g = self.inner.lock().unwrap();
        self.unqueue(&mut g, first, count, |_| {});
    }

    /// Drop the queued pages of `first..first+count` (calling `taken` on
    /// each) and move the cursor after the range.
    fn take(&self, first: u64, count: u64, taken: impl FnMut(u64)) {
        let mut g = self.inner.lock().unwrap();
        self.unqueue(&mut g, first, count, taken);
        g.cursor = (first + count) % self.total.max(1);
    }

    /// Clears the queued pages of `first..first+count`, calling `taken` on each.
    fn unqueue(&self, g: &mut Inner, first: u64, count: u64, mut taken: impl FnMut(u64)) {
        for p in first..(first + count).min(self.total) {
            let (w, b) = ((p / 64) as usize, p % 64);
            if g.bits[w] & (1 << b) != 0 {
                g.bits[w] &= !(1 << b);
                g.left -= 1;
                taken(p);
            }
        }
    }

    /// Claimed pages that were not sent after all: queue them again.
    pub fn give_back(&self, first: u64, count: u64) {
        let mut g = self.inner.lock().unwrap();
        for p in first..(first + count).min(self.total) {
            let (w, b) = ((p / 64) as usize, p % 64);
            if g.bits[w] & (1 << b) == 0 {
                g.bits[w] |= 1 << b;
                g.left += 1;
            }
        }
    }

    /// Pages the destination lacks after all (a push channel was lost with
    /// its link): queue `data` again, and `zero` as known-zero runs. Pages
    /// queued already stay queued once.
    pub fn requeue(&self, data: &[PageRange], zero: &[PageRange]) {
        for r in data {
            self.give_back(r.first, r.count);
        }
        self.inner.lock().unwrap().zero.extend_from_slice(zero);
    }

    /// Up to `max` pages from the cursor on (wrapping), as runs.
    pub fn claim(&self, max: u64, out: &mut Vec<Claim>) -> bool {
        out.clear();
        let mut g = self.inner.lock().unwrap();
        if let Some(z) = g.zero.pop() {
            out.push(Claim { first: z.first, count: z.count, known_zero: true });
            return true;
        }
        if g.left == 0 {
            return false;
        }
        let mut taken = 0u64;
        while taken < max {
            let Some(r) = g.first.pop_front() else { break };
            let end = r.end().min(self.total);
            let mut p = r.first;
            while p < end && taken < max {
                let (w, b) = ((p / 64) as usize, p % 64);
                if g.bits[w] & (1 << b) != 0 {
                    g.bits[w] &= !(1 << b);
                    taken += 1;
                    match out.last_mut() {
                        Some(c) if c.first + c.count == p => c.count += 1,
                        _ => out.push(Claim { first: p, count: 1, known_zero: false }),
                    }
                }
                p += 1;
            }
            if p < end {
                g.first.push_front(PageRange { first: p, count: end - p });
            }
        }
        if taken > 0 {
            g.left -= taken;
            return true;
        }
        let words = g.bits.len();
        let mut w = (g.cursor / 64) as usize;
        // At most one full turn over the bitmap (+1 for the cursor's word).
        for turn in 0..=words {
            let mut word = g.bits[w];
            if turn == 0 {
                // Start at the cursor within its word.
                word &= !0u64 << (g.cursor % 64);
            }
            while word != 0 && taken < max {
                let b = word.trailing_zeros() as u64;
                let p = w as u64 * 64 + b;
                g.bits[w] &= !(1 << b);
                word &= !(1 << b);
                taken += 1;
                match out.last_mut() {
                    Some(c) if c.first + c.count == p => c.count += 1,
                    _ => out.push(Claim { first: p, count: 1, known_zero: false }),
                }
            }
            if taken >= max {
                break;
            }
            w = (w + 1) % words;
        }
        g.left -= taken;
        if let Some(c) = out.last() {
            g.cursor = (c.first + c.count) % self.total.max(1);
        }
        taken > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_every_page_once_from_the_last_fault_on() {
        let q = PushQueue::new(1000, &[PageRange { first: 0, count: 1000 }], vec![PageRange { first: 5000, count: 3 }]);
        let mut out = Vec::new();
        assert!(q.claim(256, &mut out));
        assert_eq!(out, vec![Claim { first: 5000, count: 3, known_zero: true }]);
        q.requested(700, 2);
        assert!(q.claim(100, &mut out));
        assert_eq!(out, vec![Claim { first: 702, count: 100, known_zero: false }]);
        let mut seen = vec![false; 1000];
        seen[700] = true;
        seen[701] = true;
        seen[702..802].fill(true);
        while q.claim(64, &mut out) {
            for c in &out {
                for p in c.first..c.first + c.count {
                    assert!(!seen[p as usize], "page {p} twice");
                    seen[p as usize] = true;
                }
            }
        }
        assert!(seen.iter().all(|&s| s));
        assert_eq!(q.left(), 0);
    }

    #[test]
    fn the_devices_pages_go_first_once() {
        let q = PushQueue::new(1000, &[PageRange { first: 0, count: 1000 }], Vec::new());
        q.requested(600, 1); // a fault's page went out on the urgent channel
        q.push_first(&[PageRange { first: 590, count: 20 }, PageRange { first: 10, count: 2 }, PageRange { first: 5000, count: 3 }]);
        let mut out = Vec::new();
        assert!(q.claim(16, &mut out));
        assert_eq!(out, vec![Claim { first: 590, count: 10, known_zero: false }, Claim { first: 601, count: 6, known_zero: false }]);
        assert!(q.claim(16, &mut out));
        assert_eq!(out, vec![Claim { first: 607, count: 3, known_zero: false }, Claim { first: 10, count: 2, known_zero: false }]);
        // Then the sweep, from the last fault on, without those pages.
        assert!(q.claim(4, &mut out));
        assert_eq!(out, vec![Claim { first: 610, count: 4, known_zero: false }]);
        let mut n = 4 + 21;
        while q.claim(64, &mut out) {
            for c in &out {
                assert!(!(590..610).contains(&c.first) && !(10..12).contains(&c.first));
                n += c.count;
            }
        }
        assert_eq!(n, 999);
        assert_eq!(q.left(), 0);
    }

    #[test]
    fn pages_requeued_after_a_lost_channel_go_once_more() {
        let q = PushQueue::new(100, &[PageRange { first: 0, count: 100 }], Vec::new());
        let mut out = Vec::new();
        assert!(q.claim(60, &mut out)); // 0..60 on their way, some lost
                                        // The destination lacks 10..20 (lost) and 70..80 (still queued),
                                        // and a known-zero run it never got.
        q.requeue(&[PageRange { first: 10, count: 10 }, PageRange { first: 70, count: 10 }], &[PageRange { first: 30, count: 5 }]);
        assert_eq!(q.left(), 40 + 10, "pages still queued are queued once");
        let mut claimed = vec![0u32; 100];
        let mut zero_runs = Vec::new();
        while q.claim(64, &mut out) {
            for c in &out {
                if c.known_zero {
                    zero_runs.push((c.first, c.count));
                    continue;
                }
                (c.first..c.first + c.count).for_each(|p| claimed[p as usize] += 1);
            }
        }
        assert_eq!(zero_runs, vec![(30, 5)]);
        assert!((10..20).chain(60..100).all(|p| claimed[p] == 1), "{claimed:?}");
        assert!((0..10).chain(20..60).all(|p| claimed[p] == 0), "{claimed:?}");
    }

    #[test]
    fn prefetch_takes_only_what_the_push_has_not_sent() {
        let q = PushQueue::new(100, &[PageRange { first: 0, count: 100 }], Vec::new());
        let mut out = Vec::new();
        assert!(q.claim(10, &mut out)); // pages 0..10 are on their way
        let mut runs = Vec::new();
        q.take_queued(5, 10, &mut runs);
        assert_eq!(runs, vec![PageRange { first: 10, count: 5 }]);
        assert_eq!(q.left(), 85);
        // The push goes on after the prefetch, without those pages.
        assert!(q.claim(3, &mut out));
        assert_eq!(out, vec![Claim { first: 15, count: 3, known_zero: false }]);
    }
}
