//! `workload=clock`: read the platform clock in a loop and publish every
//! value as progress, so the host can compare what the guest sees with
//! query-status's guest_time_ns. Exits 1 if the clock ever goes backwards
//! (a torn 64-bit read would), and prints the first reads so a clock that
//! is off (e.g. garbage in the high half) shows on the console.

use crate::hw::Platform;

pub fn run(plat: Platform) -> ! {
    let first = plat.now_ns();
    crate::println!("clock: first read {:#018x}", first);
    let mut prev = first;
    let mut reads: u64 = 0;
    loop {
        let now = plat.now_ns();
        if now < prev {
            crate::println!("clock: went backwards {:#018x} -> {:#018x} after {} reads", prev, now, reads);
            plat.exit(1);
        }
        plat.progress(now);
        prev = now;
        reads += 1;
        if reads.is_power_of_two() && reads >= 1 << 16 {
            crate::println!("clock: read {} values, now {:#018x}", reads, now);
        }
    }
}
