//! Platform registers in the first page of the MMIO window.
//!
//! | offset | access | meaning |
//! |--------|--------|---------|
//! | 0x00   | R 64   | guest clock, nanoseconds; runs only while the VM runs, continues across save/restore and migration |
//! | 0x08   | W 32   | exit: the guest reports it is done with a status (0 = pass) |
//! | 0x10   | RW 64  | progress: a counter a workload bumps (dirtier passes, verified blocks) |
//!
//! 64-bit registers also work as two 32-bit halves, low half first, because
//! that is how they arrive from the unicorn vCPU: its MMIO regions take at
//! most 4 bytes per callback, so one 8-byte guest load or store reaches the
//! device as an access at +0 and then one at +4. Reading the clock's low
//! half latches the whole value and the high half is served from the latch,
//! so the pair is one consistent sample (two fresh reads would tear when the
//! low half wraps, every 4.3 s). Writing progress's low half stages it and
//! the high half commits both, so the host never sees a half-written value.

use crate::bus::BusDevice;
use serde::{Deserialize, Serialize};
use snapshot::{Persist, Result, Section};
use std::cell::Cell;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

pub const REG_CLOCK: u64 = 0x00;
pub const REG_EXIT: u64 = 0x08;
pub const REG_PROGRESS: u64 = 0x10;
const REG_CLOCK_HI: u64 = REG_CLOCK + 4;
const REG_PROGRESS_HI: u64 = REG_PROGRESS + 4;

thread_local! {
    /// Per vCPU thread: the clock value latched by the last low-half read and
    /// the progress low half waiting for its high half. Per thread because
    /// the two halves of one access come from one vCPU, and another vCPU's
    /// access may run between them.
    static HALVES: Cell<Halves> = const { Cell::new(Halves { clock: 0, progress_lo: 0 }) };
}

#[derive(Clone, Copy)]
struct Halves {
    clock: u64,
    progress_lo: u32,
}

fn halves() -> Halves {
    HALVES.with(|h| h.get())
}

fn set_halves(f: impl FnOnce(&mut Halves)) {
    HALVES.with(|h| {
        let mut v = h.get();
        f(&mut v);
        h.set(v);
    })
}

/// Shared with the vmm: what the guest reported.
#[derive(Default)]
pub struct PlatformEvents {
    /// -1 while the guest has not exited.
    pub exit_code: AtomicI64,
    pub progress: AtomicU64,
}

/// Guest time: host monotonic time while running, frozen while stopped.
pub struct GuestClock {
    origin: Instant,
    inner: Mutex<ClockInner>,
}

struct ClockInner {
    /// Guest ns at the moment `since` (host ns from origin) was taken.
    base_ns: u64,
    since: u64,
    running: bool,
}

impl GuestClock {
    pub fn new() -> Arc<Self> {
        Arc::new(GuestClock { origin: Instant::now(), inner: Mutex::new(ClockInner { base_ns: 0, since: 0, running: false }) })
    }

    fn host_ns(&self) -> u64 {
        self.origin.elapsed().as_nanos() as u64
    }

    pub fn now_ns(&self) -> u64 {
        let i = self.inner.lock().unwrap();
        if i.running {
            i.base_ns + (self.host_ns() - i.since)
        } else {
            i.base_ns
        }
    }

    pub fn set_running(&self, run: bool) {
        let now = self.host_ns();
        let mut i = self.inner.lock().unwrap();
        if i.running && !run {
            i.base_ns += now - i.since;
        }
        if run && !i.running {
            i.since = now;
        }
        i.running = run;
    }

    /// Restart guest time from a saved value (clock stays stopped).
    pub fn set_ns(&self, ns: u64) {
        let mut i = self.inner.lock().unwrap();
        i.base_ns = ns;
        i.since = self.host_ns();
    }
}

pub struct Platform {
    clock: Arc<GuestClock>,
    events: Arc<PlatformEvents>,
}

#[derive(Serialize, Deserialize)]
struct PlatformState {
    clock_ns: u64,
    progress: u64,
}

impl Platform {
    pub fn new(clock: Arc<GuestClock>) -> Self {
        let events = Arc::new(PlatformEvents::default());
        events.exit_code.store(-1, Ordering::Relaxed);
        Platform { clock, events }
    }

    pub fn events(&self) -> Arc<PlatformEvents> {
        self.events.clone()
    }
}

fn put(data: &mut [u8], v: u64) {
    let b = v.to_le_bytes();
    let n = data.len().min(8);
    data[..n].copy_from_slice(&b[..n]);
}

fn get(data: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    let n = data.len().min(8);
    b[..n].copy_from_slice(&data[..n]);
    u64::from_le_bytes(b)
}

impl BusDevice for Platform {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        match (offset, data.len()) {
            (REG_CLOCK, _) => {
                let now = self.clock.now_ns();
                set_halves(|h| h.clock = now);
                put(data, now)
            }
            (REG_CLOCK_HI, 4) => put(data, halves().clock >> 32),
            (REG_PROGRESS, _) => put(data, self.events.progress.load(Ordering::Relaxed)),
            (REG_PROGRESS_HI, 4) => put(data, self.events.progress.load(Ordering::Relaxed) >> 32),
            _ => data.fill(0xff),
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        match (offset, data.len()) {
            (REG_EXIT, _) => self.events.exit_code.store(get(data) as u32 as i64, Ordering::SeqCst),
            (REG_PROGRESS, 8) => self.events.progress.store(get(data), Ordering::Relaxed),
            (REG_PROGRESS, 4) => set_halves(|h| h.progress_lo = get(data) as u32),
            (REG_PROGRESS_HI, 4) => {
                let v = get(data) << 32 | halves().progress_lo as u64;
                self.events.progress.store(v, Ordering::Relaxed)
            }
            _ => {}
        }
    }
}

impl Persist for Platform {
    fn state_name(&self) -> String {
        "platform".into()
    }
    fn save(&self) -> Result<Section> {
        let st = PlatformState { clock_ns: self.clock.now_ns(), progress: self.events.progress.load(Ordering::Relaxed) };
        Ok(Section::encode("platform", 1, &st))
    }
    fn restore(&mut self, s: &Section) -> Result<()> {
        let st: PlatformState = s.decode(1)?;
        self.clock.set_ns(st.clock_ns);
        self.events.progress.store(st.progress, Ordering::Relaxed);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clock_stops_and_continues() {
        let c = GuestClock::new();
        assert_eq!(c.now_ns(), 0);
        c.set_running(true);
        std::thread::sleep(std::time::Duration::from_millis(5));
        c.set_running(false);
        let t = c.now_ns();
        assert!(t >= 5_000_000);
        std::thread::sleep(std::time::Duration::from_millis(5));
        assert_eq!(c.now_ns(), t);
        let mut p = Platform::new(c.clone());
        let saved = p.save().unwrap();
        let c2 = GuestClock::new();
        let mut q = Platform::new(c2.clone());
        q.restore(&saved).unwrap();
        assert_eq!(c2.now_ns(), t);
        p.write(REG_EXIT, &3u32.to_le_bytes());
        assert_eq!(p.events().exit_code.load(Ordering::SeqCst), 3);
    }

    fn read_split(p: &mut Platform, off: u64) -> u64 {
        let (mut lo, mut hi) = ([0u8; 4], [0u8; 4]);
        p.read(off, &mut lo);
        p.read(off + 4, &mut hi);
        u32::from_le_bytes(lo) as u64 | (u32::from_le_bytes(hi) as u64) << 32
    }

    /// The unicorn vCPU delivers an 8-byte access as +0 then +4, 4 bytes each.
    #[test]
    fn split_64bit_accesses_are_whole_values() {
        let c = GuestClock::new();
        // Just below a carry into the high half: fresh reads of each half
        // would tear here.
        c.set_ns((5 << 32) - 1_000);
        c.set_running(true);
        let mut p = Platform::new(c.clone());
        let mut prev = 0;
        for _ in 0..2_000 {
            let v = read_split(&mut p, REG_CLOCK);
            assert!(v >= prev, "clock went backwards: {prev:#x} -> {v:#x}");
            assert!(v >> 32 == 4 || v >> 32 == 5, "torn or garbage clock {v:#x}");
            prev = v;
        }
        assert!(prev <= c.now_ns());
        let mut whole = [0u8; 8];
        p.read(REG_CLOCK, &mut whole);
        assert!(u64::from_le_bytes(whole) >= prev);

        let v: u64 = 0x1234_5678_9abc_def0;
        p.write(REG_PROGRESS, &(v as u32).to_le_bytes());
        p.write(REG_PROGRESS + 4, &((v >> 32) as u32).to_le_bytes());
        assert_eq!(p.events().progress.load(Ordering::Relaxed), v);
        assert_eq!(read_split(&mut p, REG_PROGRESS), v);
        p.write(REG_PROGRESS, &7u64.to_le_bytes());
        assert_eq!(p.events().progress.load(Ordering::Relaxed), 7);
    }
}
