//! Rings (`pvrdma_ring.h`) and the two event rings of the DSR.
//!
//! A ring of N elements keeps a producer tail and a consumer head in shared
//! memory. Indices run modulo 2N: the bit above the slot number is a
//! generation flag, so a full ring (`tail == head ^ N`) differs from an empty
//! one (`tail == head`). An index with any bit set at or above 2N is invalid.
//! The functions here are Linux's mask arithmetic exactly, which is modulo 2N
//! only when N is a power of two (every QP and CQ ring; Linux's event rings
//! of `(num_pages - 1) * 4096 / size` slots need not be): using the same
//! arithmetic on both sides keeps device and driver in agreement for any N.

use crate::pod;

/// One ring's indices.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ring {
    pub prod_tail: u32,
    pub cons_head: u32,
}

/// A ring-state page's header: a transmit and a receive ring. CQs and the
/// event rings use `rx` (device produces, driver consumes); a QP's header
/// page holds its SQ ring at +0 and its RQ ring at +8 (driver produces,
/// device consumes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RingState {
    pub tx: Ring,
    pub rx: Ring,
}

/// Byte offsets of the indices in a ring-state page.
pub const RING_STATE_TX_PROD_TAIL: u64 = 0;
pub const RING_STATE_TX_CONS_HEAD: u64 = 4;
pub const RING_STATE_RX_PROD_TAIL: u64 = 8;
pub const RING_STATE_RX_CONS_HEAD: u64 = 12;

/// Whether `idx` is a valid index of a ring of `max_elems` elements.
pub const fn idx_valid(idx: u32, max_elems: u32) -> bool {
    idx & !((max_elems << 1).wrapping_sub(1)) == 0
}

/// The slot an index designates, or `None` when the index is invalid.
pub const fn idx_slot(idx: u32, max_elems: u32) -> Option<u32> {
    if idx_valid(idx, max_elems) {
        Some(idx & max_elems.wrapping_sub(1))
    } else {
        None
    }
}

/// The index after `idx` (the generation bit flips at the wrap).
pub const fn idx_inc(idx: u32, max_elems: u32) -> u32 {
    idx.wrapping_add(1) & (max_elems << 1).wrapping_sub(1)
}

/// Why a ring's indices cannot be used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InvalidIndex;

/// For a producer: the slot to fill next, `Ok(None)` when the ring is full.
pub const fn ring_has_space(tail: u32, head: u32, max_elems: u32) -> Result<Option<u32>, InvalidIndex> {
    if !idx_valid(tail, max_elems) || !idx_valid(head, max_elems) {
        return Err(InvalidIndex);
    }
    if tail == head ^ max_elems {
        Ok(None)
    } else {
        Ok(Some(tail & max_elems.wrapping_sub(1)))
    }
}

/// For a consumer: the slot to read next, `Ok(None)` when the ring is empty.
pub const fn ring_has_data(tail: u32, head: u32, max_elems: u32) -> Result<Option<u32>, InvalidIndex> {
    if !idx_valid(tail, max_elems) || !idx_valid(head, max_elems) {
        return Err(InvalidIndex);
    }
    if tail == head {
        Ok(None)
    } else {
        Ok(Some(head & max_elems.wrapping_sub(1)))
    }
}

/// How many elements lie between `head` and `tail` (both valid, N a power
/// of two): 0 for empty, N for full.
pub const fn ring_used(tail: u32, head: u32, max_elems: u32) -> u32 {
    tail.wrapping_sub(head) & (max_elems << 1).wrapping_sub(1)
}

/// An async event (`struct pvrdma_eqe`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Eqe {
    /// `ib::event` (a 1:1 mapping of `enum ib_event`).
    pub event_type: u32,
    /// The handle of the object concerned (QP, CQ, SRQ) or the port.
    pub info: u32,
}

/// A CQ notification (`struct pvrdma_cqne`): the CQ's handle.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cqne {
    pub info: u32,
}

/// Where an event ring's entries start: after its state page.
pub const EVENT_RING_FIRST_OFFSET: u64 = crate::PAGE_SIZE as u64;

/// Slots of an event ring of `num_pages` pages (state page included) whose
/// entries are `entry_size` bytes, as the Linux driver computes them.
pub const fn event_ring_slots(num_pages: u32, entry_size: usize) -> u32 {
    if num_pages == 0 {
        return 0;
    }
    ((num_pages as usize - 1) * crate::PAGE_SIZE / entry_size) as u32
}

pod!(Ring = 8, RingState = 16, Eqe = 8, Cqne = 4);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indices_run_modulo_twice_the_size() {
        let n = 8;
        assert!(idx_valid(0, n) && idx_valid(15, n));
        assert!(!idx_valid(16, n) && !idx_valid(u32::MAX, n));
        assert_eq!(idx_slot(9, n), Some(1));
        assert_eq!(idx_slot(16, n), None);
        assert_eq!(idx_inc(7, n), 8, "the generation bit sets after the last slot");
        assert_eq!(idx_inc(15, n), 0, "and clears at the wrap");
    }

    #[test]
    fn empty_full_and_invalid() {
        let n = 4;
        assert_eq!(ring_has_data(3, 3, n), Ok(None));
        assert_eq!(ring_has_space(3, 3, n), Ok(Some(3)));
        // Tail one generation ahead on the same slot: full.
        assert_eq!(ring_has_space(1, 5, n), Ok(None));
        assert_eq!(ring_has_data(1, 5, n), Ok(Some(1)));
        assert_eq!(ring_used(1, 5, n), 4);
        assert_eq!(ring_used(6, 5, n), 1);
        assert_eq!(ring_has_data(8, 0, n), Err(InvalidIndex));
        assert_eq!(ring_has_space(0, 9, n), Err(InvalidIndex));
    }

    #[test]
    fn a_producer_and_consumer_agree_over_many_wraps() {
        let n = 16;
        let (mut tail, mut head) = (0u32, 0u32);
        let mut produced = 0u32;
        let mut consumed = 0u32;
        for round in 0..1000u32 {
            for _ in 0..(round % 7 + 1) {
                if let Ok(Some(slot)) = ring_has_space(tail, head, n) {
                    assert_eq!(slot, produced % n);
                    produced += 1;
                    tail = idx_inc(tail, n);
                }
            }
            assert_eq!(ring_used(tail, head, n), produced - consumed);
            for _ in 0..(round % 5 + 1) {
                if let Ok(Some(slot)) = ring_has_data(tail, head, n) {
                    assert_eq!(slot, consumed % n);
                    consumed += 1;
                    head = idx_inc(head, n);
                }
            }
        }
        assert!(produced > 3 * n && consumed > 3 * n);
    }

    #[test]
    fn event_ring_slots_as_linux_computes_them() {
        assert_eq!(event_ring_slots(4, 8), 1536);
        assert_eq!(event_ring_slots(2, 8), 512);
        assert_eq!(event_ring_slots(2, 4), 1024);
        assert_eq!(event_ring_slots(0, 4), 0);
    }
}
