//! Shared-memory rings between a client and rnicd: send queue, receive queue
//! (client produces, rnicd consumes) and completion queue (rnicd produces).
//!
//! A ring lives in a sealed memfd: one 4 KiB header page with the producer
//! and consumer indexes (free-running u32) and the notification flag, then
//! `cap` fixed-size slots. Each side keeps its own index privately and only
//! publishes it, so a misbehaving peer can make the ring look empty or full
//! but never make the other side read outside the mapping. Slot types are
//! plain integers: any bit pattern is a value, and rnicd validates the copy.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicU32, Ordering};

pub const HDR_BYTES: usize = 4096;
pub const MAX_SGE: usize = 8;
pub const MAX_INLINE: usize = 256;

/// CQ header flag values (`notify`).
pub const NOTIFY_NONE: u32 = 0;
pub const NOTIFY_NEXT: u32 = 1;
pub const NOTIFY_SOLICITED: u32 = 2;
/// Set by rnicd in the CQ header `error` word when a completion was lost.
pub const CQ_ERR_OVERFLOW: u32 = 1;

#[repr(C)]
pub struct RingHeader {
    pub prod: AtomicU32,
    _p0: [u32; 15],
    pub cons: AtomicU32,
    /// SQ: how many of the entries taken (`cons`) rnicd is done with
    /// (completed, signaled or not, flushed, or dropped by a reset); the
    /// rest are in its queues. Stored before any completion the client
    /// can see: a queue's depth counts `prod - done`, as a hardware
    /// queue's slot stays taken until its WQE completes.
    pub done: AtomicU32,
    _p1: [u32; 14],
    pub notify: AtomicU32,
    pub error: AtomicU32,
    /// SQ/RQ: nonzero while rnicd polls this ring itself; the client may
    /// then skip the doorbell (an eventfd write per post). rnicd clears it
    /// and looks at the ring once more before it sleeps.
    pub rnicd_polling: AtomicU32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// A send work request as it sits in the SQ ring (512 bytes).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct SendWqe {
    pub wr_id: u64,
    pub opcode: u8,
    pub flags: u8,
    pub num_sge: u8,
    pub _r0: u8,
    /// Immediate data (host order) or the rkey to invalidate.
    pub imm: u32,
    pub remote_addr: u64,
    pub rkey: u32,
    pub inline_len: u32,
    pub compare_add: u64,
    pub swap: u64,
    pub sge: [Sge; MAX_SGE],
    pub inline: [u8; MAX_INLINE],
    /// UD only, the WR's address handle: destination GID (IPv4, host
    /// order), QPN and Q_Key (high bit set: the sending QP's own).
    pub ud_dest: u32,
    pub ud_qpn: u32,
    pub ud_qkey: u32,
    pub _pad: [u8; 68],
}

impl Default for SendWqe {
    fn default() -> Self {
        // SAFETY: all-zero is a valid value of this plain-integer struct.
        unsafe { std::mem::zeroed() }
    }
}

/// A receive work request in the RQ ring.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct RecvWqe {
    pub wr_id: u64,
    pub num_sge: u32,
    pub _r0: u32,
    pub sge: [Sge; MAX_SGE],
}

/// A completion in the CQ ring (32 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cqe {
    pub wr_id: u64,
    pub byte_len: u32,
    /// Immediate data (host order) or the invalidated rkey.
    pub imm: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub status: u8,
    pub opcode: u8,
    pub wc_flags: u8,
    pub _r0: u8,
    pub vendor_err: u32,
}

const _: () = assert!(std::mem::size_of::<SendWqe>() == 512);
const _: () = assert!(std::mem::size_of::<Cqe>() == 32);
const _: () = assert!(std::mem::size_of::<RingHeader>() <= HDR_BYTES);

/// How much of a ring is faulted in when it is made, on both sides: its
/// header page and its first page of slots, what a fresh ring's first posts
/// or completions touch. A QP made ahead of a move then takes no page fault
/// on its first use inside the move's downtime (for 1,000 QPs, 12-19 ms of
/// faults against 0.2 ms). Not the whole ring: that is ~200 KiB for a QP of
/// 256-WR queues, which the client allocates and zeroes and rnicd maps
/// again, CPU taken from whatever shares the host while a destination
/// builds 256 such QPs ahead (docs/pvrdma-migration.md, "Where the
/// switchover's time goes"). Slots past the first page fault in as the
/// ring fills.
pub const FIRST_USE_BYTES: usize = HDR_BYTES + 4096;

/// Bytes of a memfd holding a ring of `cap` slots of `T`, page aligned.
pub fn ring_bytes<T>(cap: u32) -> usize {
    (HDR_BYTES + cap as usize * std::mem::size_of::<T>()).div_ceil(4096) * 4096
}

/// One side of a ring over shared memory.
pub struct Ring<T> {
    base: *mut u8,
    cap: u32,
    /// Our own index: producer index if we produce, consumer index if we consume.
    local: u32,
    _t: PhantomData<T>,
}

// SAFETY: the ring only touches its mapping through atomics and volatile copies.
unsafe impl<T> Send for Ring<T> {}

impl<T: Copy> Ring<T> {
    /// # Safety
    /// `base` must point to a mapping of at least `len` bytes that outlives the ring.
    pub unsafe fn new(base: *mut u8, len: usize, cap: u32) -> Option<Ring<T>> {
        if cap == 0 || !cap.is_power_of_two() || len < ring_bytes::<T>(cap) || !(base as usize).is_multiple_of(64) {
            return None;
        }
        Some(Ring { base, cap, local: 0, _t: PhantomData })
    }

    pub fn cap(&self) -> u32 {
        self.cap
    }

    pub fn header(&self) -> &RingHeader {
        // SAFETY: the header page is inside the mapping and only used atomically.
        unsafe { &*(self.base as *const RingHeader) }
    }

    fn slot(&self, idx: u32) -> *mut T {
        let i = (idx & (self.cap - 1)) as usize;
        // SAFETY: i < cap, checked against the mapping length in new().
        unsafe { self.base.add(HDR_BYTES + i * std::mem::size_of::<T>()) as *mut T }
    }

    /// Producer: appends `v`, or returns false when the consumer has not freed a slot.
    pub fn push(&mut self, v: &T) -> bool {
        let cons = self.header().cons.load(Ordering::Acquire);
        if self.local.wrapping_sub(cons) >= self.cap {
            return false;
        }
        // SAFETY: slot() is in bounds; volatile because the peer maps the same page.
        unsafe { std::ptr::write_volatile(self.slot(self.local), *v) };
        self.local = self.local.wrapping_add(1);
        self.header().prod.store(self.local, Ordering::Release);
        true
    }

    /// Producer: free slots as seen now.
    pub fn free_slots(&self) -> u32 {
        let cons = self.header().cons.load(Ordering::Acquire);
        self.cap.saturating_sub(self.local.wrapping_sub(cons))
    }

    /// Producer: entries posted that the consumer is not done with (see
    /// [`RingHeader::done`]).
    pub fn outstanding(&self) -> u32 {
        self.local.wrapping_sub(self.header().done.load(Ordering::Acquire))
    }

    /// Consumer: publishes that all entries taken but the last `in_queue`
    /// are done ([`RingHeader::done`]).
    pub fn set_done(&self, in_queue: u32) {
        self.header().done.store(self.local.wrapping_sub(in_queue), Ordering::Release);
    }

    /// Consumer: entries ready (0 if the producer index is nonsense).
    pub fn ready(&self) -> u32 {
        let prod = self.header().prod.load(Ordering::Acquire);
        let n = prod.wrapping_sub(self.local);
        if n > self.cap {
            0
        } else {
            n
        }
    }

    /// Consumer: takes the oldest entry.
    pub fn pop(&mut self) -> Option<T> {
        if self.ready() == 0 {
            return None;
        }
        // SAFETY: in bounds; the copy is validated by the caller.
        let v = unsafe { std::ptr::read_volatile(self.slot(self.local)) };
        self.local = self.local.wrapping_add(1);
        self.header().cons.store(self.local, Ordering::Release);
        Some(v)
    }

    /// Producer: after publishing entries, whether the consumer must be
    /// woken (false while it polls the ring itself). The fence orders our
    /// index store before the flag load, against the consumer's flag
    /// store before its last look at the ring.
    pub fn needs_doorbell(&self) -> bool {
        std::sync::atomic::fence(Ordering::SeqCst);
        self.header().rnicd_polling.load(Ordering::Relaxed) == 0
    }

    /// Consumer: the flag read by `needs_doorbell`.
    pub fn set_polled(&self, on: bool) {
        self.header().rnicd_polling.store(on as u32, Ordering::Relaxed);
    }

    /// Consumer: whether the producer published an impossible index.
    pub fn corrupt(&self) -> bool {
        let prod = self.header().prod.load(Ordering::Acquire);
        prod.wrapping_sub(self.local) > self.cap
    }
}
