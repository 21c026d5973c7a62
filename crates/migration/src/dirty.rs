//! Dirty-page tracking of guest RAM.
//!
//! The tracker must see a write from any thread of the vmm (vCPUs, device
//! emulation, DMA through the same mapping) and cost nothing while no
//! migration runs. We use userfaultfd's *asynchronous* write-protect
//! (`UFFD_FEATURE_WP_ASYNC`): the kernel resolves a write fault on a
//! protected page by itself and marks the page "written", no thread ever
//! blocks and no message is queued. The `PAGEMAP_SCAN` ioctl then returns
//! the written pages and write-protects them again in the same walk, so a
//! write that lands after the scan is always seen by the next one.
//! Registration happens only while a migration runs; see docs/migration.md
//! for the measurements against soft-dirty, mprotect and hashing.
//!
//! Writes made through *another* mapping of the memfd (rnicd's DMA) are not
//! visible here: those come from a [`DirtySource`] the engine unions in.
use crate::pages::PageRange;
use crate::vm::RamRegion;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

pub use crate::pages::PAGE_SIZE;

/// Something else that writes guest RAM and can report which pages it wrote
/// since the previous call (e.g. rnicd write traces, issue 7). The dirty
/// log starts it with itself and stops it when it ends (the migration
/// completed, failed or was cancelled), so that it costs nothing between
/// migrations.
pub trait DirtySource: Send + Sync {
    /// Record writes from now on; nothing from before is reported.
    fn start(&self) -> anyhow::Result<()> {
        self.take_dirty().map(drop)
    }

    /// Pages written since the previous call (or since `start`), as
    /// page-number ranges.
    fn take_dirty(&self) -> anyhow::Result<Vec<PageRange>>;

    /// Stop recording.
    fn stop(&self) {}
}

/// The external sources of one dirty log, started with it and stopped when
/// it goes (also when its tracker is kept by a VM that migrated away).
struct Sources(Vec<std::sync::Arc<dyn DirtySource>>);

impl Sources {
    fn start(others: Vec<std::sync::Arc<dyn DirtySource>>) -> anyhow::Result<Sources> {
        let mut started = Sources(Vec::with_capacity(others.len()));
        for o in others {
            // A failure stops the ones already started (Drop).
            o.start()?;
            started.0.push(o);
        }
        Ok(started)
    }
}

impl Drop for Sources {
    fn drop(&mut self) {
        for o in &self.0 {
            o.stop();
        }
    }
}

// --- userfaultfd uapi (linux/userfaultfd.h) ---
const UFFD_API: u64 = 0xAA;
const UFFDIO_API: libc::c_ulong = 0xC018_AA3F;
const UFFDIO_REGISTER: libc::c_ulong = 0xC020_AA00;
const UFFDIO_UNREGISTER: libc::c_ulong = 0x8010_AA01;
const UFFDIO_WRITEPROTECT: libc::c_ulong = 0xC018_AA06;
const UFFDIO_REGISTER_MODE_WP: u64 = 1 << 1;
const UFFDIO_WRITEPROTECT_MODE_WP: u64 = 1 << 0;
const UFFD_FEATURE_WP_HUGETLBFS_SHMEM: u64 = 1 << 12;
const UFFD_FEATURE_WP_UNPOPULATED: u64 = 1 << 13;
const UFFD_FEATURE_WP_ASYNC: u64 = 1 << 15;

#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}
#[repr(C)]
#[derive(Clone, Copy)]
struct UffdioRange {
    start: u64,
    len: u64,
}
#[repr(C)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}
#[repr(C)]
struct UffdioWriteprotect {
    range: UffdioRange,
    mode: u64,
}

// --- PAGEMAP_SCAN uapi (linux/fs.h) ---
const PAGEMAP_SCAN: libc::c_ulong = 0xC060_6610;
const PM_SCAN_WP_MATCHING: u64 = 1 << 0;
const PM_SCAN_CHECK_WPASYNC: u64 = 1 << 1;
pub const PAGE_IS_WRITTEN: u64 = 1 << 1;

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct PageRegion {
    start: u64,
    end: u64,
    categories: u64,
}
#[repr(C)]
struct PmScanArg {
    size: u64,
    flags: u64,
    start: u64,
    end: u64,
    walk_end: u64,
    vec: u64,
    vec_len: u64,
    max_pages: u64,
    category_inverted: u64,
    category_mask: u64,
    category_anyof_mask: u64,
    return_mask: u64,
}

fn ioctl<T>(fd: &impl AsRawFd, req: libc::c_ulong, arg: &mut T) -> io::Result<libc::c_int> {
    // SAFETY: `arg` is the exact uapi struct the request expects.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), req as _, arg as *mut T) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// RAM from this size on is scanned by two threads.
const PARALLEL_SCAN_BYTES: u64 = 256 << 20;

/// Write tracking of one RAM region with uffd async write-protect.
/// Dropping it unregisters the range: no cost after the migration.
pub struct UffdWpTracker {
    uffd: OwnedFd,
    start: u64,
    len: u64,
    pagemap: std::fs::File,
    regions: Vec<PageRegion>,
}

impl UffdWpTracker {
    /// Register `ram` without write-protecting any of it: writes are recorded
    /// only in ranges armed since ([`Armer::arm`]). Arming a range is a walk of
    /// its page tables (~0.1 s per GiB); the first pass arms each chunk just
    /// before reading it, so that walk overlaps with sending.
    pub fn start_unarmed(ram: &RamRegion) -> io::Result<UffdWpTracker> {
        // SAFETY: plain syscall; the fd is owned right after.
        let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::other(format!(
                "userfaultfd: {} (dirty tracking needs userfaultfd; run as root or set vm.unprivileged_userfaultfd=1)",
                io::Error::last_os_error()
            )));
        }
        // SAFETY: fd was just returned by the kernel and is ours.
        let uffd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        let mut api = UffdioApi {
            api: UFFD_API,
            features: UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_HUGETLBFS_SHMEM | UFFD_FEATURE_WP_UNPOPULATED,
            ioctls: 0,
        };
        ioctl(&uffd, UFFDIO_API, &mut api)
            .map_err(|e| io::Error::other(format!("UFFDIO_API with WP_ASYNC: {e} (needs Linux 6.7 or later)")))?;
        let start = ram.host_addr as u64;
        let mut reg = UffdioRegister { range: UffdioRange { start, len: ram.len }, mode: UFFDIO_REGISTER_MODE_WP, ioctls: 0 };
        ioctl(&uffd, UFFDIO_REGISTER, &mut reg).map_err(|e| io::Error::other(format!("UFFDIO_REGISTER (wp): {e}")))?;
        let pagemap = std::fs::File::open("/proc/self/pagemap")?;
        Ok(UffdWpTracker { uffd, start, len: ram.len, pagemap, regions: vec![PageRegion::default(); 4096] })
    }

    /// Register `ram` and write-protect all of it: from now on every write is
    /// recorded. The first [`scan`](Self::scan) returns pages written since.
    pub fn start(ram: &RamRegion) -> io::Result<UffdWpTracker> {
        let t = Self::start_unarmed(ram)?;
        t.protect_all()?;
        Ok(t)
    }

    /// A handle that write-protects parts of the range from other threads.
    pub fn armer(&self) -> io::Result<Armer> {
        Ok(Armer { uffd: self.uffd.try_clone()?, start: self.start, len: self.len })
    }

    fn protect_all(&self) -> io::Result<()> {
        let mut wp = UffdioWriteprotect { range: UffdioRange { start: self.start, len: self.len }, mode: UFFDIO_WRITEPROTECT_MODE_WP };
        ioctl(&self.uffd, UFFDIO_WRITEPROTECT, &mut wp).map_err(|e| io::Error::other(format!("UFFDIO_WRITEPROTECT: {e}")))?;
        Ok(())
    }

    /// Pages written since the previous scan (or since `start`), as sorted
    /// page-number ranges; they are write-protected again by the same walk.
    /// Large RAM is walked by two threads, each over its half: the last scan
    /// runs while the VM is paused, and a walk of 4 GiB takes 3-10 ms here.
    pub fn scan(&mut self) -> io::Result<Vec<PageRange>> {
        let end = self.start + self.len;
        let mut buf = std::mem::take(&mut self.regions);
        if self.len < PARALLEL_SCAN_BYTES {
            let r = self.scan_range(self.start, end, &mut buf);
            self.regions = buf;
            return r;
        }
        let mid = self.start + (self.len / 2) / PAGE_SIZE * PAGE_SIZE;
        let me = &*self;
        let (lo, hi) = std::thread::scope(|sc| {
            let hi = sc.spawn(move || me.scan_range(mid, end, &mut vec![PageRegion::default(); 4096]));
            let lo = me.scan_range(me.start, mid, &mut buf);
            (lo, hi.join().unwrap_or_else(|_| Err(io::Error::other("dirty scan thread panicked"))))
        });
        self.regions = buf;
        let mut out = lo?;
        for r in hi? {
            match out.last_mut() {
                Some(last) if last.end() == r.first => last.count += r.count,
                _ => out.push(r),
            }
        }
        Ok(out)
    }

    /// Like [`scan`](Self::scan), but only over `ranges` (sorted, disjoint):
    /// a page never armed counts as written, and the walk would arm it.
    pub fn scan_ranges(&mut self, ranges: &[PageRange]) -> io::Result<Vec<PageRange>> {
        let mut buf = std::mem::take(&mut self.regions);
        let out = ranges.iter().try_fold(Vec::new(), |mut out, r| {
            if r.end() * PAGE_SIZE > self.len {
                return Err(io::Error::other(format!("scanning pages {}+{} outside the tracked range", r.first, r.count)));
            }
            out.extend(self.scan_range(self.start + r.first * PAGE_SIZE, self.start + r.end() * PAGE_SIZE, &mut buf)?);
            Ok(out)
        });
        self.regions = buf;
        out
    }

    fn scan_range(&self, start: u64, end: u64, regions: &mut [PageRegion]) -> io::Result<Vec<PageRange>> {
        let mut out: Vec<PageRange> = Vec::new();
        let mut cur = start;
        while cur < end {
            let mut arg = PmScanArg {
                size: std::mem::size_of::<PmScanArg>() as u64,
                flags: PM_SCAN_WP_MATCHING | PM_SCAN_CHECK_WPASYNC,
                start: cur,
                end,
                walk_end: 0,
                vec: regions.as_mut_ptr() as u64,
                vec_len: regions.len() as u64,
                max_pages: 0,
                category_inverted: 0,
                category_mask: PAGE_IS_WRITTEN,
                category_anyof_mask: 0,
                return_mask: PAGE_IS_WRITTEN,
            };
            let n = ioctl(&self.pagemap, PAGEMAP_SCAN, &mut arg).map_err(|e| io::Error::other(format!("PAGEMAP_SCAN: {e}")))? as usize;
            for r in &regions[..n] {
                let first = (r.start - self.start) / PAGE_SIZE;
                let count = (r.end - r.start) / PAGE_SIZE;
                match out.last_mut() {
                    Some(last) if last.end() == first => last.count += count,
                    _ => out.push(PageRange { first, count }),
                }
            }
            if arg.walk_end <= cur {
                break;
            }
            cur = arg.walk_end;
        }
        Ok(out)
    }
}

impl Drop for UffdWpTracker {
    fn drop(&mut self) {
        let mut r = UffdioRange { start: self.start, len: self.len };
        // Unregistering also drops the write-protection: the VM runs at full
        // speed again. Errors are ignored: closing the uffd does the same.
        let _ = ioctl(&self.uffd, UFFDIO_UNREGISTER, &mut r);
    }
}

/// Write-protects (arms) page ranges of a tracker from any thread: writes
/// to a range are recorded from the moment it is armed.
pub struct Armer {
    uffd: OwnedFd,
    start: u64,
    len: u64,
}

impl Armer {
    pub fn arm(&self, r: PageRange) -> io::Result<()> {
        let (off, len) = (r.first * PAGE_SIZE, r.count * PAGE_SIZE);
        if len == 0 || off.checked_add(len).is_none_or(|e| e > self.len) {
            return Err(io::Error::other(format!("arming pages {}+{} outside the tracked range", r.first, r.count)));
        }
        let mut wp = UffdioWriteprotect { range: UffdioRange { start: self.start + off, len }, mode: UFFDIO_WRITEPROTECT_MODE_WP };
        ioctl(&self.uffd, UFFDIO_WRITEPROTECT, &mut wp).map_err(|e| io::Error::other(format!("UFFDIO_WRITEPROTECT: {e}")))?;
        Ok(())
    }
}

/// Everything that reports dirty pages, unioned: our own mapping (uffd) plus
/// any external sources.
pub struct DirtyLog {
    uffd: UffdWpTracker,
    others: Sources,
}

impl DirtyLog {
    /// Starts our own tracking and the external sources: what they wrote
    /// before is not reported (the first pass sends every page anyway).
    pub fn start(ram: &RamRegion, others: Vec<std::sync::Arc<dyn DirtySource>>) -> anyhow::Result<DirtyLog> {
        let uffd = UffdWpTracker::start(ram)?;
        Ok(DirtyLog { uffd, others: Sources::start(others)? })
    }

    /// Like [`start`](Self::start), but nothing of our own mapping is
    /// tracked until armed through [`armer`](Self::armer): every page must
    /// be armed before it is first read for sending.
    pub fn start_unarmed(ram: &RamRegion, others: Vec<std::sync::Arc<dyn DirtySource>>) -> anyhow::Result<DirtyLog> {
        let uffd = UffdWpTracker::start_unarmed(ram)?;
        Ok(DirtyLog { uffd, others: Sources::start(others)? })
    }

    pub fn armer(&self) -> anyhow::Result<Armer> {
        Ok(self.uffd.armer()?)
    }

    /// Pages written since the previous scan. `within`: only those of our
    /// own mapping in these ranges (all that is armed yet); none: all RAM.
    pub fn scan(&mut self, total_pages: u64, within: Option<&[PageRange]>) -> anyhow::Result<Vec<PageRange>> {
        let mut v = match within {
            Some(r) => self.uffd.scan_ranges(r)?,
            None => self.uffd.scan()?,
        };
        for o in &self.others.0 {
            v.extend(o.take_dirty()?);
        }
        Ok(crate::pages::normalize(v, total_pages))
    }

    /// The VM migrated away and never runs here again: the other sources
    /// end now; our own mapping's tracker is returned still registered,
    /// for the VM to keep ([`MigratableVm::retire`](crate::vm::MigratableVm::retire)).
    pub fn into_tracker(self) -> UffdWpTracker {
        self.uffd
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memvm::GuestRam;

    #[test]
    fn uffd_wp_sees_writes_from_any_thread_and_rearms() {
        let ram = GuestRam::new(64 << 20).unwrap();
        let region = ram.region();
        // Touch some pages before tracking: those writes are not reported.
        unsafe { *ram.byte_ptr(5 * PAGE_SIZE) = 1 };
        let mut t = UffdWpTracker::start(&region).unwrap();
        assert_eq!(t.scan().unwrap(), vec![]);
        // A write to a populated page, to a never-touched page (a shmem
        // hole), and from another thread.
        unsafe { *ram.byte_ptr(5 * PAGE_SIZE + 7) = 2 };
        unsafe { *ram.byte_ptr(1000 * PAGE_SIZE) = 3 };
        let p = ram.byte_ptr(9000 * PAGE_SIZE) as usize;
        std::thread::spawn(move || unsafe { *(p as *mut u8) = 4 }).join().unwrap();
        let d = t.scan().unwrap();
        assert_eq!(d, vec![PageRange { first: 5, count: 1 }, PageRange { first: 1000, count: 1 }, PageRange { first: 9000, count: 1 }]);
        // Re-armed: nothing new until the next write.
        assert_eq!(t.scan().unwrap(), vec![]);
        unsafe { *ram.byte_ptr(1000 * PAGE_SIZE + 1) = 5 };
        assert_eq!(t.scan().unwrap(), vec![PageRange { first: 1000, count: 1 }]);
        // Many pages in a row come back as one range.
        for i in 200..700 {
            unsafe { *ram.byte_ptr(i * PAGE_SIZE) = 6 };
        }
        assert_eq!(t.scan().unwrap(), vec![PageRange { first: 200, count: 500 }]);
        drop(t);
        // After the tracker is gone the mapping is plain again.
        unsafe { *ram.byte_ptr(3 * PAGE_SIZE) = 7 };
    }

    #[test]
    fn large_ram_is_scanned_in_two_halves_without_seams() {
        let ram = GuestRam::new(512 << 20).unwrap();
        let mut t = UffdWpTracker::start(&ram.region()).unwrap();
        let mid = (256 << 20) / PAGE_SIZE;
        // A run across the halves' boundary, and single pages in each half.
        for p in [3, mid - 2, mid - 1, mid, mid + 1, 131000] {
            unsafe { *ram.byte_ptr(p * PAGE_SIZE) = 1 };
        }
        assert_eq!(
            t.scan().unwrap(),
            vec![PageRange { first: 3, count: 1 }, PageRange { first: mid - 2, count: 4 }, PageRange { first: 131000, count: 1 }]
        );
        assert_eq!(t.scan().unwrap(), vec![], "re-armed in both halves");
    }

    #[test]
    fn unarmed_tracker_records_only_armed_ranges() {
        let ram = GuestRam::new(16 << 20).unwrap();
        let mut t = UffdWpTracker::start_unarmed(&ram.region()).unwrap();
        let a = t.armer().unwrap();
        unsafe { *ram.byte_ptr(10 * PAGE_SIZE) = 1 }; // before arming: not recorded
        a.arm(PageRange { first: 0, count: 100 }).unwrap();
        unsafe { *ram.byte_ptr(10 * PAGE_SIZE) = 2 };
        unsafe { *ram.byte_ptr(50 * PAGE_SIZE) = 3 }; // a hole, armed
        unsafe { *ram.byte_ptr(200 * PAGE_SIZE) = 4 }; // before its range is armed
        a.arm(PageRange { first: 100, count: 3996 }).unwrap();
        assert_eq!(t.scan().unwrap(), vec![PageRange { first: 10, count: 1 }, PageRange { first: 50, count: 1 }]);
        assert!(a.arm(PageRange { first: 4000, count: 200 }).is_err(), "outside RAM");
    }
}
