//! Platform registers in the first page of the MMIO window.
//!
//! | offset | access | meaning |
//! |--------|--------|---------|
//! | 0x00   | R 64   | guest clock, nanoseconds; runs only while the VM runs, continues across save/restore and migration |
//! | 0x08   | W 32   | exit: the guest reports it is done with a status (0 = pass) |
//! | 0x10   | RW 64  | progress: a counter a workload bumps (dirtier passes, verified blocks) |

use crate::bus::BusDevice;
use serde::{Deserialize, Serialize};
use snapshot::{Persist, Result, Section};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

pub const REG_CLOCK: u64 = 0x00;
pub const REG_EXIT: u64 = 0x08;
pub const REG_PROGRESS: u64 = 0x10;

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
        Arc::new(GuestClock {
            origin: Instant::now(),
            inner: Mutex::new(ClockInner { base_ns: 0, since: 0, running: false }),
        })
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
        match offset {
            REG_CLOCK => put(data, self.clock.now_ns()),
            REG_PROGRESS => put(data, self.events.progress.load(Ordering::Relaxed)),
            _ => data.fill(0xff),
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        match offset {
            REG_EXIT => self.events.exit_code.store(get(data) as u32 as i64, Ordering::SeqCst),
            REG_PROGRESS => self.events.progress.store(get(data), Ordering::Relaxed),
            _ => {}
        }
    }
}

impl Persist for Platform {
    fn state_name(&self) -> String {
        "platform".into()
    }
    fn save(&self) -> Result<Section> {
        let st = PlatformState {
            clock_ns: self.clock.now_ns(),
            progress: self.events.progress.load(Ordering::Relaxed),
        };
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
}
