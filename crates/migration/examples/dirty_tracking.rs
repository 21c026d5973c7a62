//! bench/dirty-tracking: ways to learn which guest pages were written, on a
//! real memfd mapped shared (as the vmm's guest RAM), measured in one run:
//!
//! - uffd-wp: userfaultfd async write-protect + PAGEMAP_SCAN (the engine's)
//! - soft-dirty: /proc/self/clear_refs (4) + reading /proc/self/pagemap
//! - mprotect: PROT_READ + a SIGSEGV handler that records and unprotects
//! - hash: xxh3 of every page each round, compared with the last round
//!
//! For each: cost per first write of a page while tracking (the guest pays
//! it), cost of one collect-and-rearm round, whether it saw every write made
//! by a second thread, and the write cost with tracking off (the baseline,
//! measured in the same run). Prints a table, then one JSON line.
//!
//! Run: `bench/dirty-tracking/run [--ram-mib N] [--pages N]`.

use migration::dirty::UffdWpTracker;
use migration::memvm::GuestRam;
use migration::pages::PageRange;
use serde_json::json;
use std::io::{Read, Seek, SeekFrom};
use std::sync::atomic::{AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

const PAGE: u64 = 4096;

/// Write the first byte of every `stride`-th page, `count` pages, from a
/// second thread (as a vCPU would); returns ns per page.
fn dirty_pages(ram: &GuestRam, count: u64, stride: u64, val: u8) -> f64 {
    let base = ram.byte_ptr(0) as usize;
    std::thread::spawn(move || {
        let t = Instant::now();
        for i in 0..count {
            let p = (base + (i * stride * PAGE) as usize) as *mut u8;
            unsafe { p.write_volatile(val) };
        }
        t.elapsed().as_nanos() as f64 / count as f64
    })
    .join()
    .unwrap()
}

fn expected(count: u64, stride: u64) -> Vec<u64> {
    (0..count).map(|i| i * stride).collect()
}

/// (exact, writes missed, pages reported that were not written)
fn compare(got: &[u64], n: u64, stride: u64) -> (bool, usize, usize) {
    let want = expected(n, stride);
    let g: std::collections::HashSet<u64> = got.iter().copied().collect();
    let w: std::collections::HashSet<u64> = want.iter().copied().collect();
    let missed = w.difference(&g).count();
    let extra = g.difference(&w).count();
    (missed == 0 && extra == 0, missed, extra)
}

fn flatten(v: &[PageRange]) -> Vec<u64> {
    v.iter().flat_map(|r| r.first..r.end()).collect()
}

struct Row {
    method: &'static str,
    arm_ms: f64,
    write_ns: f64,
    collect_ms: f64,
    exact: bool,
    missed: usize,
    extra: usize,
    note: &'static str,
}

fn bench_uffd(ram: &GuestRam, n: u64, stride: u64) -> Row {
    let t = Instant::now();
    let mut tr = UffdWpTracker::start(&ram.region()).expect("uffd-wp");
    let arm_ms = t.elapsed().as_secs_f64() * 1e3;
    let write_ns = dirty_pages(ram, n, stride, 2);
    let t = Instant::now();
    let got = tr.scan().unwrap();
    let collect_ms = t.elapsed().as_secs_f64() * 1e3;
    let (exact, missed, extra) = compare(&flatten(&got), n, stride);
    Row { method: "uffd-wp", arm_ms, write_ns, collect_ms, exact, missed, extra, note: "async WP; scan re-arms atomically" }
}

fn read_pagemap(start: u64, pages: u64) -> Vec<u64> {
    let mut f = std::fs::File::open("/proc/self/pagemap").unwrap();
    f.seek(SeekFrom::Start(start / PAGE * 8)).unwrap();
    let mut buf = vec![0u8; (pages * 8) as usize];
    f.read_exact(&mut buf).unwrap();
    buf.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())).collect()
}

fn bench_soft_dirty(ram: &GuestRam, n: u64, stride: u64) -> Row {
    let clear = || std::fs::write("/proc/self/clear_refs", "4").expect("clear_refs");
    let t = Instant::now();
    clear();
    let arm_ms = t.elapsed().as_secs_f64() * 1e3;
    let write_ns = dirty_pages(ram, n, stride, 3);
    let t = Instant::now();
    let pm = read_pagemap(ram.byte_ptr(0) as u64, ram.pages());
    let got: Vec<u64> = pm.iter().enumerate().filter(|(_, e)| *e & (1 << 55) != 0).map(|(i, _)| i as u64).collect();
    clear(); // re-arm (for the whole process)
    let collect_ms = t.elapsed().as_secs_f64() * 1e3;
    let (exact, missed, extra) = compare(&got, n, stride);
    Row {
        method: "soft-dirty",
        arm_ms,
        write_ns,
        collect_ms,
        exact,
        missed,
        extra,
        note: "clear_refs is process-wide; no atomic read+clear",
    }
}

static SEGV_BASE: AtomicUsize = AtomicUsize::new(0);
static SEGV_LEN: AtomicUsize = AtomicUsize::new(0);
static SEGV_LOG: AtomicPtr<AtomicU64> = AtomicPtr::new(std::ptr::null_mut());

extern "C" fn on_segv(_sig: i32, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    let addr = unsafe { (*info).si_addr() } as usize;
    let base = SEGV_BASE.load(Ordering::SeqCst);
    if addr < base || addr >= base + SEGV_LEN.load(Ordering::SeqCst) {
        unsafe { libc::_exit(99) };
    }
    let page = (addr - base) / PAGE as usize;
    let log = SEGV_LOG.load(Ordering::SeqCst);
    unsafe {
        (*log.add(page / 64)).fetch_or(1 << (page % 64), Ordering::SeqCst);
        libc::mprotect((base + page * PAGE as usize) as *mut libc::c_void, PAGE as usize, libc::PROT_READ | libc::PROT_WRITE);
    }
}

fn bench_mprotect(ram: &GuestRam, n: u64, stride: u64) -> Row {
    let pages = ram.pages();
    let log: Vec<AtomicU64> = (0..pages.div_ceil(64)).map(|_| AtomicU64::new(0)).collect();
    SEGV_LOG.store(log.as_ptr() as *mut AtomicU64, Ordering::SeqCst);
    SEGV_BASE.store(ram.byte_ptr(0) as usize, Ordering::SeqCst);
    SEGV_LEN.store((pages * PAGE) as usize, Ordering::SeqCst);
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_segv as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO;
        libc::sigaction(libc::SIGSEGV, &sa, std::ptr::null_mut());
    }
    let protect = || unsafe { libc::mprotect(ram.byte_ptr(0) as *mut libc::c_void, (pages * PAGE) as usize, libc::PROT_READ) };
    let t = Instant::now();
    protect();
    let arm_ms = t.elapsed().as_secs_f64() * 1e3;
    let write_ns = dirty_pages(ram, n, stride, 4);
    let t = Instant::now();
    let got: Vec<u64> = (0..pages).filter(|&p| log[(p / 64) as usize].swap_bit(p)).collect();
    protect();
    let collect_ms = t.elapsed().as_secs_f64() * 1e3;
    unsafe { libc::mprotect(ram.byte_ptr(0) as *mut libc::c_void, (pages * PAGE) as usize, libc::PROT_READ | libc::PROT_WRITE) };
    unsafe { libc::signal(libc::SIGSEGV, libc::SIG_DFL) };
    let (exact, missed, extra) = compare(&got, n, stride);
    Row { method: "mprotect", arm_ms, write_ns, collect_ms, exact, missed, extra, note: "a signal per page; splits the VMA per page" }
}

trait SwapBit {
    fn swap_bit(&self, p: u64) -> bool;
}
impl SwapBit for AtomicU64 {
    fn swap_bit(&self, p: u64) -> bool {
        self.fetch_and(!(1 << (p % 64)), Ordering::SeqCst) & (1 << (p % 64)) != 0
    }
}

fn bench_hash(ram: &GuestRam, n: u64, stride: u64) -> Row {
    let hash_all = || (0..ram.pages()).map(|p| migration::wire::xxh3(ram.page(p))).collect::<Vec<u64>>();
    let t = Instant::now();
    let before = hash_all();
    let arm_ms = t.elapsed().as_secs_f64() * 1e3;
    let write_ns = dirty_pages(ram, n, stride, 5);
    let t = Instant::now();
    let after = hash_all();
    let got: Vec<u64> = (0..ram.pages()).filter(|&p| before[p as usize] != after[p as usize]).collect();
    let collect_ms = t.elapsed().as_secs_f64() * 1e3;
    let (exact, missed, extra) = compare(&got, n, stride);
    Row { method: "hash", arm_ms, write_ns, collect_ms, exact, missed, extra, note: "reads all RAM every round; misses same-value writes" }
}

/// Dirty-page tracking methods for guest RAM, compared in one run.
#[derive(clap::Parser)]
#[command(name = "dirty_tracking")]
struct Args {
    /// Size of the memfd standing for guest RAM, MiB.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..))]
    ram_mib: u64,
    /// Pages written per round (spread evenly over RAM).
    #[arg(long, default_value_t = 16384, value_parser = clap::value_parser!(u64).range(1..))]
    pages: u64,
}

fn main() {
    let Args { ram_mib: mib, pages: n } = clap::Parser::parse();
    let ram = GuestRam::new(mib << 20).expect("memfd");
    let pages = ram.pages();
    let stride = (pages / n).max(1);
    let n = n.min(pages);
    // Populate all of RAM first, as a running guest's would be.
    for p in 0..pages {
        unsafe { ram.byte_ptr(p * PAGE).write_volatile(1) };
    }
    let baseline_ns = dirty_pages(&ram, n, stride, 9);
    let rows =
        [bench_uffd(&ram, n, stride), bench_soft_dirty(&ram, n, stride), bench_mprotect(&ram, n, stride), bench_hash(&ram, n, stride)];
    // Cost with tracking off again (uffd unregistered, nothing armed).
    let after_ns = dirty_pages(&ram, n, stride, 10);

    println!("dirty tracking, {mib} MiB memfd RAM, {n} pages written (every {stride}th) by a second thread");
    println!("baseline write (tracking off): {baseline_ns:.0} ns/page; after all trackers stopped: {after_ns:.0} ns/page");
    println!(
        "{:<11} {:>9} {:>14} {:>12} {:>7} {:>7} {:>7}  note",
        "method", "arm ms", "write ns/page", "collect ms", "exact", "missed", "extra"
    );
    for r in &rows {
        println!(
            "{:<11} {:>9.2} {:>14.0} {:>12.2} {:>7} {:>7} {:>7}  {}",
            r.method, r.arm_ms, r.write_ns, r.collect_ms, r.exact, r.missed, r.extra, r.note
        );
    }
    let j = json!({
        "ram_mib": mib,
        "dirty_pages": n,
        "baseline_write_ns": baseline_ns,
        "after_stop_write_ns": after_ns,
        "methods": rows.iter().map(|r| json!({
            "method": r.method, "arm_ms": r.arm_ms, "write_ns_per_page": r.write_ns,
            "collect_ms": r.collect_ms, "exact": r.exact, "missed": r.missed, "extra": r.extra,
        })).collect::<Vec<_>>(),
    });
    println!("{j}");
}
