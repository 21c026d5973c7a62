//! The memory dirtier of QEMU's migration test: increment the first byte of
//! every 4 KiB page of [start, end) in an endless loop. After any migration
//! every page equals its predecessor, except at one edge where the loop was.
//! `rate` (pages per second, 0 = as fast as possible) throttles it from the
//! end of the first pass on: the first pass only fills RAM (so a migration
//! started after it moves all of it), at full speed.

use crate::hw::Platform;

pub const PAGE: u64 = 4096;

pub fn run(plat: Platform, start: u64, end: u64, rate: u64) -> ! {
    crate::println!("dirtier: start={:#x} end={:#x} rate={} pages/s", start, end, rate);
    let mut passes: u64 = 0;
    // Throttling: pages allowed so far = rate * elapsed; check every batch.
    const BATCH: u64 = 64;
    let mut t0 = plat.now_ns();
    let mut done: u64 = 0;
    loop {
        let mut addr = start;
        while addr < end {
            let p = addr as *mut u8;
            unsafe { p.write_volatile(p.read_volatile().wrapping_add(1)) };
            addr += PAGE;
            done += 1;
            if rate != 0 && passes > 0 && done.is_multiple_of(BATCH) {
                loop {
                    let allowed = plat.now_ns().saturating_sub(t0) as u128 * rate as u128 / 1_000_000_000;
                    if done as u128 <= allowed {
                        break;
                    }
                    core::hint::spin_loop();
                }
            }
        }
        passes += 1;
        if passes == 1 {
            // The rate counts from here.
            t0 = plat.now_ns();
            done = 0;
        }
        plat.progress(passes);
    }
}
