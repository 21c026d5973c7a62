//! What the receive side of a WRITE stream costs per GB, by thread CPU
//! time (steadier than wall time on a loaded machine), best of 3 rounds:
//!
//! - the ICRC of a 4 KiB packet (`wire::icrc`), and of an ACK-sized one;
//! - placing 4 KiB payloads, each ICRC-checked first as the responder
//!   does, from a 512 KiB receive area (the kernel's copy leaves it in
//!   L2) into a region larger than the caches (guest RAM under
//!   migration), with a plain copy (`Span::write`) and with streaming
//!   stores (`Span::write_streaming`, fenced once per 120 packets).
//!
//! `cargo run --release -p rnic --example rx_costs [MiB]` (default 512).

use rnic::mem::{fence_streamed, Span};
use rnic::wire::{self, Flow, ROCE_PORT};
use std::net::Ipv4Addr;

fn thread_cpu_s() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Best (lowest) CPU seconds of 3 runs of `f`.
fn best_of_3(mut f: impl FnMut()) -> f64 {
    (0..3)
        .map(|_| {
            let t = thread_cpu_s();
            f();
            thread_cpu_s() - t
        })
        .fold(f64::MAX, f64::min)
}

fn main() {
    let mib: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(512);
    let total = mib << 20;
    let flow = Flow { src: Ipv4Addr::new(10, 200, 0, 1), dst: Ipv4Addr::new(10, 200, 0, 2), sport: 0xc123, dport: ROCE_PORT };
    const PKT: usize = 4096;
    const AREA: usize = 512 << 10;
    // A receive area of WRITE_MIDDLE packets: BTH then 4 KiB of payload.
    let area: Vec<u8> = (0..AREA + 12).map(|i| (i * 7 + i / 251) as u8).collect();
    let gb = total as f64 / 1e9;

    let mut x = 0u32;
    let s = best_of_3(|| {
        for k in 0..total / PKT {
            let o = (k * PKT) % AREA;
            x ^= wire::icrc(&flow, &area[o..o + 12 + PKT]);
        }
    });
    println!("ICRC, 4 KiB packets (in cache):        {:6.1} ms/GB", s * 1e3 / gb);
    let n = 1 << 20;
    let s = best_of_3(|| {
        for k in 0..n {
            x ^= wire::icrc(&flow, &area[k % 64..k % 64 + 16]);
        }
    });
    println!("ICRC, 16-byte packets (an ACK):        {:6.1} ns/packet", s * 1e9 / n as f64);

    // Guest RAM stand-in: anonymous memory, touched once so that no fault
    // is counted, then pushed out of the caches by the first round.
    let ram = unsafe {
        libc::mmap(std::ptr::null_mut(), total, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
    } as *mut u8;
    assert!(!ram.is_null() && ram as isize != -1, "mmap of {mib} MiB failed");
    for i in (0..total).step_by(4096) {
        // SAFETY: inside the mapping.
        unsafe { *ram.add(i) = 1 };
    }
    for (name, streaming) in [("plain copy", false), ("streaming stores", true)] {
        let s = best_of_3(|| {
            for k in 0..total / PKT {
                let o = (k * PKT) % AREA;
                let pkt = &area[o..o + 12 + PKT];
                x ^= wire::icrc(&flow, pkt);
                // SAFETY: k * PKT + PKT <= total, inside the mapping.
                let span = Span::One(unsafe { ram.add(k * PKT) });
                unsafe {
                    if streaming {
                        span.write_streaming(&pkt[12..]);
                    } else {
                        span.write(&pkt[12..]);
                    }
                }
                // One fence per receive chunk (8 GRO datagrams of about
                // 15 packets), as the daemon does.
                if k % 120 == 119 {
                    fence_streamed();
                }
            }
            fence_streamed();
        });
        println!("ICRC check + placement, {name:16}: {:6.1} ms/GB", s * 1e3 / gb);
    }
    std::hint::black_box(x);
    // SAFETY: the mapping made above.
    unsafe { libc::munmap(ram as *mut libc::c_void, total) };
}
