//! Fill [start, end) with realistic, non-zero, partly compressible content
//! (text-like bytes mixed with pseudo-random words), then idle. Used for the
//! "idle VM" migration benchmark, where an all-zero RAM would be unfair.

use crate::hw::Platform;

pub fn run(plat: Platform, start: u64, end: u64) -> ! {
    crate::println!("fill: start={:#x} end={:#x}", start, end);
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut addr = start;
    const WORDS: &[u8] = b"the quick brown fox jumps over the lazy dog; migration moves memory pages ";
    let mut page_no = 0u64;
    while addr < end {
        let p = addr as *mut u64;
        for i in 0..512u64 {
            // xorshift64
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let v = if (page_no + i / 64).is_multiple_of(2) {
                // text-like: 8 bytes from the phrase
                let o = ((i * 8 + page_no) as usize) % (WORDS.len() - 8);
                u64::from_le_bytes(WORDS[o..o + 8].try_into().unwrap())
            } else {
                x | 1
            };
            unsafe { p.add(i as usize).write_volatile(v) };
        }
        addr += 4096;
        page_no += 1;
    }
    plat.progress(1);
    crate::println!("fill: done");
    crate::hw::halt_forever()
}
