//! The doorbell page: which of a client's QPs rang.
//!
//! A client's doorbell is one eventfd for all its QPs, so on its own it
//! says only that some QP has work, and rnicd would read the rings of every
//! QP of the client (a VM's device with 256 QPs: 256 looks per doorbell).
//! Beside the eventfd the client shares one page, a bitmap of
//! [`SLOTS`] bits: before it rings, it sets the bit of the QP that posted
//! (`slot(qpn)`), and rnicd takes the set bits (swapping each word to zero)
//! and reads the rings of those QPs only. QPNs that share a slot are all
//! looked at: a spare look, never a missed one. A client that sends no page
//! (`Hello` with the eventfd alone) has all its QPs looked at per doorbell.
//!
//! Ordering: the client publishes its ring index, then sets the bit, then
//! writes the eventfd; rnicd drains the eventfd, then swaps the words, then
//! reads the rings. A bit set after rnicd's swap comes with an eventfd
//! write after its drain, so that QP is looked at on the next doorbell.
//!
//! A bit found already set says that rnicd has not yet taken it: the
//! doorbell that set it is written (or is being written by the thread that
//! set it) and rnicd's swap, which reads the bit, comes after this post,
//! whose ring index it then sees. Such a post writes no eventfd. Between a
//! doorbell and rnicd's wake-up (an IPI and a switch, microseconds) a
//! program keeps posting; each post used to write the eventfd again, one
//! system call per post for a doorbell rnicd drains once. The cost: a
//! thread preempted between its bit and its eventfd write holds back, until
//! it runs again, the posts of other threads to the same slot (the same QP's
//! other queue, or a QPN equal modulo [`SLOTS`]).

use crate::mem::Mapping;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};

/// Bits in the page: QPN modulo this is a QP's slot.
pub const SLOTS: usize = 4096;
const WORDS: usize = SLOTS / 64;
/// The page's size (the bitmap is its first SLOTS / 8 bytes).
pub const PAGE_BYTES: usize = 4096;

/// The bit of QP `qpn`.
pub fn slot(qpn: u32) -> usize {
    qpn as usize % SLOTS
}

/// One side's mapping of a doorbell page.
pub struct DoorbellPage {
    map: Mapping,
}

impl DoorbellPage {
    /// The client side: a fresh sealed page and its memfd, to send with
    /// `Hello`.
    pub fn create() -> anyhow::Result<(DoorbellPage, OwnedFd)> {
        let fd = crate::mem::sealed_memfd("rnic-doorbells", PAGE_BYTES)?;
        let page = DoorbellPage::map(&fd)?;
        Ok((page, fd))
    }

    /// Maps a page received from a client (refused unless sealed against
    /// shrinking and at least a page long: the client cannot make rnicd
    /// fault on it).
    pub fn map(fd: &OwnedFd) -> anyhow::Result<DoorbellPage> {
        Ok(DoorbellPage { map: Mapping::map_sealed(fd, 0, PAGE_BYTES)? })
    }

    fn words(&self) -> &[AtomicU64; WORDS] {
        // SAFETY: the mapping is PAGE_BYTES long, page aligned, and lives
        // as long as self; AtomicU64 has no invalid bit patterns.
        unsafe { &*(self.map.ptr() as *const [AtomicU64; WORDS]) }
    }

    /// Client: QP `qpn` has work. Returns whether the eventfd must be
    /// written: false if the bit was already set (a doorbell rnicd has not
    /// yet taken covers this post too).
    #[must_use = "false: the eventfd need not be written"]
    pub fn mark(&self, qpn: u32) -> bool {
        let s = slot(qpn);
        let bit = 1 << (s % 64);
        self.words()[s / 64].fetch_or(bit, Ordering::SeqCst) & bit == 0
    }

    /// rnicd: takes every set bit (clearing it) and calls `f` with its slot.
    pub fn take(&self, mut f: impl FnMut(usize)) {
        for (w, word) in self.words().iter().enumerate() {
            if word.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let mut bits = word.swap(0, Ordering::SeqCst);
            while bits != 0 {
                let b = bits.trailing_zeros() as usize;
                bits &= bits - 1;
                f(w * 64 + b);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_are_taken_once_by_slot() {
        let (client, fd) = DoorbellPage::create().unwrap();
        let rnicd = DoorbellPage::map(&fd).unwrap();
        let first: Vec<bool> = [5, 70, 5 + SLOTS as u32, 4095].into_iter().map(|q| client.mark(q)).collect();
        assert_eq!(first, [true, true, false, true], "a QPN sharing a set slot needs no eventfd");
        let mut got = Vec::new();
        rnicd.take(|s| got.push(s));
        assert_eq!(got, vec![5, 70, 4095]);
        got.clear();
        rnicd.take(|s| got.push(s));
        assert!(got.is_empty());
    }

    #[test]
    fn a_post_before_rnicd_takes_the_bit_rings_no_second_time() {
        let (client, fd) = DoorbellPage::create().unwrap();
        let rnicd = DoorbellPage::map(&fd).unwrap();
        assert!(client.mark(9), "the first post rings");
        assert!(!client.mark(9), "rnicd has not taken the bit: no eventfd");
        assert!(client.mark(10), "another slot rings");
        let mut got = Vec::new();
        rnicd.take(|s| got.push(s));
        assert_eq!(got, vec![9, 10]);
        assert!(client.mark(9), "taken: the next post rings again");
    }

    #[test]
    fn an_unsealed_page_is_refused() {
        let fd = crate::mem::sealed_memfd("x", 100).unwrap();
        assert!(DoorbellPage::map(&fd).is_err(), "shorter than a page");
        // SAFETY: plain memfd_create; the result is checked.
        let raw = unsafe { libc::memfd_create(c"y".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0);
        let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) };
        assert_eq!(unsafe { libc::ftruncate(raw, PAGE_BYTES as libc::off_t) }, 0);
        assert!(DoorbellPage::map(&fd).is_err(), "not sealed");
    }
}
