//! Submission and completion queue state (what NVMe 2.1's migration
//! "I/O Submission/Completion Queue data" structures carry, plus the
//! controller-private reservation count).

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Sq {
    pub qid: u16,
    pub cqid: u16,
    /// Guest physical base (PRP1 of Create I/O SQ, or ASQ).
    pub base: u64,
    /// Entries (QSIZE + 1).
    pub size: u32,
    /// Next entry the controller fetches.
    pub head: u32,
    /// Last tail the host wrote to the doorbell.
    pub tail: u32,
    pub prio: u8,
}

impl Sq {
    pub fn pending(&self) -> bool {
        self.head != self.tail
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Cq {
    pub qid: u16,
    pub base: u64,
    pub size: u32,
    /// Last head the host wrote to the doorbell.
    pub head: u32,
    /// Next slot the controller writes.
    pub tail: u32,
    /// Phase tag the controller writes into the slot at `tail`.
    pub phase: bool,
    pub irq_enabled: bool,
    pub vector: u16,
    /// Commands fetched for this CQ whose completion is not yet posted: each
    /// holds a slot, so a posted completion always fits.
    pub reserved: u32,
}

impl Cq {
    pub fn new(qid: u16, base: u64, size: u32, irq_enabled: bool, vector: u16) -> Cq {
        Cq { qid, base, size, head: 0, tail: 0, phase: true, irq_enabled, vector, reserved: 0 }
    }

    /// Entries posted and not yet consumed by the host.
    pub fn used(&self) -> u32 {
        (self.tail + self.size - self.head) % self.size
    }

    /// Room for one more command's completion (one slot always stays empty).
    pub fn has_room(&self) -> bool {
        self.used() + self.reserved < self.size - 1
    }

    /// A new head is valid if it lies between the old head and the tail.
    pub fn head_valid(&self, new_head: u32) -> bool {
        new_head < self.size && (new_head + self.size - self.head) % self.size <= self.used()
    }

    pub fn advance_tail(&mut self) {
        self.tail += 1;
        if self.tail == self.size {
            self.tail = 0;
            self.phase = !self.phase;
        }
    }
}
