//! Write traces: which blocks of a memory region rnicd wrote into (RDMA
//! WRITE, SEND payloads, READ responses, atomics), for the pre-copy phase of
//! a VM migration. Every write into an MR goes through `Mr::translate` with a
//! write access bit, which marks the blocks, so no write path can miss it.
//! Marking happens on the single event-loop thread, as does fetching, so a
//! fetch-and-clear is atomic with respect to writes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

/// Smallest and largest block size of a trace.
pub const MIN_GRANULARITY: u64 = 512;
pub const MAX_GRANULARITY: u64 = 1 << 30;
/// Most bitmap memory one trace may take.
pub const MAX_BITMAP_BYTES: u64 = 64 << 20;
/// Most dirty runs a fetch returns; beyond that it says "all dirty" (the
/// reply must fit in one control message).
pub const MAX_RUNS: usize = 1024;

/// What a fetch returns: dirty byte ranges `(offset from the MR start, length)`,
/// or `all_dirty` when rnicd cannot say precisely.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct TraceReport {
    pub granularity: u64,
    pub all_dirty: bool,
    pub runs: Vec<(u64, u64)>,
}

impl TraceReport {
    /// Whether byte `off` of the MR is reported dirty.
    pub fn is_dirty(&self, off: u64) -> bool {
        self.all_dirty || self.runs.iter().any(|&(o, l)| off >= o && off < o + l)
    }
}

struct Bitmap {
    shift: u32,
    len: u64,
    words: Vec<u64>,
}

/// The trace slot of one MR.
#[derive(Default)]
pub struct TraceSlot {
    on: AtomicBool,
    map: Mutex<Option<Bitmap>>,
}

impl TraceSlot {
    /// Starts (or restarts, clearing) a trace of an MR of `len` bytes.
    pub fn start(&self, len: u64, granularity: u64) -> Result<(), String> {
        if !granularity.is_power_of_two() || !(MIN_GRANULARITY..=MAX_GRANULARITY).contains(&granularity) {
            return Err(format!("trace granularity must be a power of two in {MIN_GRANULARITY}..={MAX_GRANULARITY}"));
        }
        let blocks = len.div_ceil(granularity);
        if blocks.div_ceil(8) > MAX_BITMAP_BYTES {
            return Err(format!("trace bitmap would exceed {MAX_BITMAP_BYTES} bytes: choose a coarser granularity"));
        }
        let bm = Bitmap { shift: granularity.trailing_zeros(), len, words: vec![0; blocks.div_ceil(64) as usize] };
        *self.map.lock().unwrap_or_else(|e| e.into_inner()) = Some(bm);
        self.on.store(true, Ordering::Release);
        Ok(())
    }

    pub fn stop(&self) {
        self.on.store(false, Ordering::Release);
        *self.map.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// Marks bytes [off, off+len) of the MR as written.
    pub fn mark(&self, off: u64, len: u64) {
        if !self.on.load(Ordering::Acquire) || len == 0 {
            return;
        }
        let mut g = self.map.lock().unwrap_or_else(|e| e.into_inner());
        let Some(bm) = g.as_mut() else { return };
        let first = off >> bm.shift;
        let last = (off + len - 1) >> bm.shift;
        for b in first..=last {
            if let Some(w) = bm.words.get_mut((b / 64) as usize) {
                *w |= 1 << (b % 64);
            }
        }
    }

    /// Returns the dirty blocks and clears them, in one step.
    pub fn fetch_and_clear(&self) -> Result<TraceReport, String> {
        let mut g = self.map.lock().unwrap_or_else(|e| e.into_inner());
        let Some(bm) = g.as_mut() else { return Err("this MR is not being traced".into()) };
        let gran = 1u64 << bm.shift;
        let mut rep = TraceReport { granularity: gran, all_dirty: false, runs: Vec::new() };
        let nblocks = bm.len.div_ceil(gran);
        let mut b = 0u64;
        while b < nblocks {
            let w = bm.words[(b / 64) as usize];
            if w == 0 && b.is_multiple_of(64) {
                b += 64;
                continue;
            }
            if w & (1 << (b % 64)) == 0 {
                b += 1;
                continue;
            }
            let start = b;
            while b < nblocks && bm.words[(b / 64) as usize] & (1 << (b % 64)) != 0 {
                b += 1;
            }
            if rep.runs.len() == MAX_RUNS {
                // Too many runs for one reply: say everything is dirty.
                rep.all_dirty = true;
                rep.runs.clear();
                break;
            }
            let off = start * gran;
            rep.runs.push((off, (b * gran).min(bm.len) - off));
        }
        bm.words.iter_mut().for_each(|w| *w = 0);
        Ok(rep)
    }
}
