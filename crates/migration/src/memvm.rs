//! A minimal [`MigratableVm`] with real guest RAM (a memfd mapped shared) and
//! real "vCPU" threads running QEMU's migration-test dirtier. The engine's own
//! tests and the dirty-tracking bench use it before and beside the vmm; it is
//! not a mock of memory or threads, only of the instruction set.

use crate::vm::{MigratableVm, RamRegion};
use snapshot::{Section, StateSet};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

pub const PAGE: u64 = 4096;

/// A memfd of `len` bytes mapped MAP_SHARED.
pub struct GuestRam {
    fd: OwnedFd,
    addr: *mut u8,
    len: u64,
}
unsafe impl Send for GuestRam {}
unsafe impl Sync for GuestRam {}

impl GuestRam {
    pub fn new(len: u64) -> std::io::Result<GuestRam> {
        let name = std::ffi::CString::new("transit-guest-ram").unwrap();
        // SAFETY: plain syscalls; results checked.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as i64) } < 0 {
            return Err(std::io::Error::last_os_error());
        }

        let addr = unsafe {
            libc::mmap(std::ptr::null_mut(), len as usize, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd.as_raw_fd(), 0)
        };
        if addr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        // As the vmm's guest RAM: huge pages where the host allows them.
        crate::vm::advise_huge_pages(addr as *mut u8, len as usize);
        Ok(GuestRam { fd, addr: addr as *mut u8, len })
    }
    /// Seal the memfd against shrinking and growing, as the vmm's guest
    /// RAM is: rnicd registers only such memfds (the rdma transport).
    pub fn seal(&self) -> std::io::Result<()> {
        // SAFETY: fcntl on our own memfd.
        if unsafe { libc::fcntl(self.fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
    pub fn region(&self) -> RamRegion {
        RamRegion { host_addr: self.addr, len: self.len, memfd: self.fd.as_raw_fd() }
    }
    pub fn page(&self, pfn: u64) -> &[u8] {
        // SAFETY: in bounds of the live mapping; racy reads are fine for tests.
        unsafe { std::slice::from_raw_parts(self.addr.add((pfn * PAGE) as usize), PAGE as usize) }
    }
    pub fn pages(&self) -> u64 {
        self.len / PAGE
    }
    pub fn byte_ptr(&self, off: u64) -> *mut u8 {
        assert!(off < self.len);
        unsafe { self.addr.add(off as usize) }
    }
}

impl Drop for GuestRam {
    fn drop(&mut self) {
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len as usize) };
    }
}

pub use crate::vm::page_hashes;

/// QEMU's `check_guests_ram`: walking pages in order, the first byte of each
/// equals its predecessor's except at most one step down by one (where the
/// dirtier was). Returns a description of the first violation.
pub fn check_dirtier_oracle(ram: &GuestRam, first: u64, end: u64) -> Result<(), String> {
    let mut last = ram.page(first)[0];
    let mut edge = false;
    for p in first + 1..end {
        let b = ram.page(p)[0];
        if b != last {
            if b == last.wrapping_sub(1) && !edge {
                edge = true;
            } else {
                return Err(format!("page {p}: first byte {b} after {last} (edge already seen: {edge})"));
            }
        }
        last = b;
    }
    Ok(())
}

#[derive(Default)]
struct RunGate {
    paused: bool,
    parked: usize,
}

struct Shared {
    ram: GuestRam,
    gate: Mutex<RunGate>,
    cv: Condvar,
    stop: AtomicBool,
    throttle: AtomicU8,
    /// Next page each dirtier thread will write (its "vCPU state").
    pos: Vec<AtomicU64>,
    /// Each dirtier thread's kernel thread id, once it runs (0 before).
    tids: Vec<AtomicI32>,
    slices: Vec<(u64, u64)>,
    state_pad: usize,
    restored: Mutex<Option<StateSet>>,
    shape: String,
    /// Pages after each dirtier's position that `device_pages` names (0:
    /// none): a device that reaches the very pages the guest writes first.
    reach: AtomicU64,
}

/// A VM made of guest RAM and `dirtiers` threads, each incrementing the first
/// byte of every page of its own slice of [start_page, pages) in a loop.
pub struct MemVm {
    sh: Arc<Shared>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    pub rate_pages_per_s: u64,
}

impl MemVm {
    /// Build the VM paused (as an incoming VM is); `resume` starts it.
    pub fn new(ram_bytes: u64, dirtiers: usize, start_page: u64) -> std::io::Result<Arc<MemVm>> {
        let ram = GuestRam::new(ram_bytes)?;
        let pages = ram.pages();
        let per = (pages - start_page) / dirtiers.max(1) as u64;
        let slices = (0..dirtiers as u64).map(|i| (start_page + i * per, start_page + (i + 1) * per)).collect::<Vec<_>>();
        let pos = slices.iter().map(|s| AtomicU64::new(s.0)).collect();
        let tids = slices.iter().map(|_| AtomicI32::new(0)).collect();
        let shape = format!("memvm ram={ram_bytes} dirtiers={dirtiers} start={start_page}");
        let sh = Arc::new(Shared {
            ram,
            gate: Mutex::new(RunGate { paused: true, parked: 0 }),
            cv: Condvar::new(),
            stop: AtomicBool::new(false),
            throttle: AtomicU8::new(0),
            pos,
            tids,
            slices,
            state_pad: 16 << 10,
            restored: Mutex::new(None),
            shape,
            reach: AtomicU64::new(0),
        });
        let mut threads = Vec::new();
        for i in 0..dirtiers {
            let sh = sh.clone();
            threads.push(std::thread::spawn(move || dirtier(sh, i, 0)));
        }
        Ok(Arc::new(MemVm { sh, threads: Mutex::new(threads), rate_pages_per_s: 0 }))
    }

    pub fn ram_pages(&self) -> &GuestRam {
        &self.sh.ram
    }
    pub fn slices(&self) -> Vec<(u64, u64)> {
        self.sh.slices.clone()
    }
    pub fn throttle(&self) -> u8 {
        self.sh.throttle.load(Ordering::Relaxed)
    }
    pub fn is_paused(&self) -> bool {
        self.sh.gate.lock().unwrap().paused
    }
    /// Fill every page from `start_page` with non-zero, partly compressible
    /// content (as the guest's `fill` workload does).
    pub fn fill(&self, start_page: u64, end_page: u64) {
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        for p in start_page..end_page {
            let base = self.sh.ram.byte_ptr(p * PAGE) as *mut u64;
            for i in 0..512u64 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let v = if (p + i / 64) % 2 == 0 { 0x2065_6874_2067_6f64 ^ (i << 40) } else { x | 1 };
                unsafe { base.add(i as usize).write_volatile(v) };
            }
        }
    }
    /// Check the dirtier oracle on every slice.
    pub fn check_oracle(&self) -> Result<(), String> {
        for (i, (a, b)) in self.sh.slices.iter().enumerate() {
            check_dirtier_oracle(&self.sh.ram, *a, *b).map_err(|e| format!("slice {i}: {e}"))?;
        }
        Ok(())
    }
    /// Give the dirtier threads the CPU whenever they are runnable
    /// (SCHED_FIFO, the lowest real-time priority), as a vCPU pinned to a
    /// host core has it: their dirty rate is then the guest's own and
    /// the throttle's, not whatever share a loaded host leaves to one
    /// thread among many. Only the throttle's sleeps yield the core (and
    /// the kernel's real-time limit keeps 5% of it for others), so use
    /// it for a short migration that must throttle, and never for more
    /// dirtiers at once than the host has cores: the surplus would starve
    /// (and with it the migration's own threads).
    pub fn run_dirtiers_realtime(&self) -> std::io::Result<()> {
        for tid in &self.sh.tids {
            let tid = loop {
                match tid.load(Ordering::SeqCst) {
                    0 => std::thread::yield_now(),
                    t => break t,
                }
            };
            let param = libc::sched_param { sched_priority: 1 };
            // SAFETY: a valid sched_param for a thread of this process.
            if unsafe { libc::sched_setscheduler(tid, libc::SCHED_FIFO, &param) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        Ok(())
    }
    /// `device_pages` names the `pages` each dirtier writes next (from
    /// its position, wrapping in its slice): as a device reaching the
    /// guest's pages without the vCPU would, these are the pages touched
    /// first after a switch.
    pub fn set_device_reach(&self, pages: u64) {
        self.sh.reach.store(pages, Ordering::SeqCst);
    }
    /// Passes done so far by dirtier 0 (from its first byte at slice start).
    pub fn progress(&self) -> u8 {
        self.sh.ram.page(self.sh.slices[0].0)[0]
    }
}

impl Drop for MemVm {
    fn drop(&mut self) {
        self.sh.stop.store(true, Ordering::SeqCst);
        self.sh.cv.notify_all();
        for t in self.threads.lock().unwrap().drain(..) {
            let _ = t.join();
        }
    }
}

fn dirtier(sh: Arc<Shared>, idx: usize, rate: u64) {
    let (start, end) = sh.slices[idx];
    let _ = rate;
    // SAFETY: gettid has no preconditions.
    sh.tids[idx].store(unsafe { libc::gettid() }, Ordering::SeqCst);
    const BATCH: u64 = 256;
    loop {
        // The run gate: park while paused, acknowledging so pause() can return.
        {
            let mut g = sh.gate.lock().unwrap();
            if g.paused {
                g.parked += 1;
                sh.cv.notify_all();
                while g.paused && !sh.stop.load(Ordering::SeqCst) {
                    g = sh.cv.wait(g).unwrap();
                }
                g.parked -= 1;
            }
        }
        if sh.stop.load(Ordering::SeqCst) {
            return;
        }
        let t0 = std::time::Instant::now();
        let mut p = sh.pos[idx].load(Ordering::Relaxed);
        for _ in 0..BATCH {
            let b = sh.ram.byte_ptr(p * PAGE);
            // SAFETY: inside the mapping; this thread owns its slice.
            unsafe { b.write_volatile(b.read_volatile().wrapping_add(1)) };
            p += 1;
            if p == end {
                p = start;
            }
        }
        sh.pos[idx].store(p, Ordering::Relaxed);
        let th = sh.throttle.load(Ordering::Relaxed) as u32;
        if th > 0 {
            // Run (100 - th)% of the time: sleep th/(100-th) of the time run.
            let ran = t0.elapsed();
            std::thread::sleep(ran * th / (100 - th).max(1));
        }
    }
}

#[derive(serde::Serialize, serde::Deserialize)]
struct MemVmState {
    pos: Vec<u64>,
    pad: Vec<u8>,
}

impl MigratableVm for MemVm {
    fn ram(&self) -> RamRegion {
        self.sh.ram.region()
    }
    fn pause(&self) -> anyhow::Result<()> {
        let n = self.sh.slices.len();
        let mut g = self.sh.gate.lock().unwrap();
        g.paused = true;
        while g.parked < n {
            g = self.sh.cv.wait(g).unwrap();
        }
        Ok(())
    }
    fn resume(&self) -> anyhow::Result<()> {
        let mut g = self.sh.gate.lock().unwrap();
        g.paused = false;
        self.sh.cv.notify_all();
        Ok(())
    }
    fn save_state(&self) -> anyhow::Result<StateSet> {
        let st = MemVmState {
            pos: self.sh.pos.iter().map(|p| p.load(Ordering::SeqCst)).collect(),
            pad: (0..self.sh.state_pad).map(|i| (i % 251) as u8).collect(),
        };
        let mut set = StateSet::default();
        set.push(Section::encode("cpus", 1, &st));
        Ok(set)
    }
    fn restore_state(&self, state: &StateSet) -> anyhow::Result<()> {
        let st: MemVmState = state.get("cpus")?.decode(1)?;
        anyhow::ensure!(st.pos.len() == self.sh.pos.len(), "state has {} dirtiers, VM has {}", st.pos.len(), self.sh.pos.len());
        for (i, p) in st.pos.iter().enumerate() {
            let (a, b) = self.sh.slices[i];
            anyhow::ensure!(*p >= a && *p < b, "dirtier {i} position {p} outside its slice");
            self.sh.pos[i].store(*p, Ordering::SeqCst);
        }
        *self.sh.restored.lock().unwrap() = Some(state.clone());
        Ok(())
    }
    fn set_cpu_throttle(&self, pct: u8) {
        self.sh.throttle.store(pct.min(99), Ordering::Relaxed);
    }
    fn shape(&self) -> String {
        self.sh.shape.clone()
    }
    fn state_size_estimate(&self) -> u64 {
        self.sh.state_pad as u64 + 256
    }
    fn device_pages(&self) -> Vec<crate::pages::PageRange> {
        use crate::pages::PageRange;
        let n = self.sh.reach.load(Ordering::SeqCst);
        let mut out = Vec::new();
        for (i, &(start, end)) in self.sh.slices.iter().enumerate() {
            let (p, n) = (self.sh.pos[i].load(Ordering::SeqCst), n.min(end - start));
            let first = n.min(end - p);
            out.push(PageRange { first: p, count: first });
            out.push(PageRange { first: start, count: n - first });
        }
        out.retain(|r| r.count > 0);
        out
    }
}
