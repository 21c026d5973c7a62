// SPDX-License-Identifier: GPL-2.0-or-later
//! Ordinary process memory made reachable by rnicd.
//!
//! rnicd reaches client memory only through memfds it maps (rnic::mem). A
//! libibverbs program registers whatever it has: malloc'd, memalign'd, stack
//! or mmap'd buffers. The drop-in moves the pages of a registered range onto
//! one process-wide memfd, at the file offset equal to their virtual
//! address: the pages' content is written into the memfd, then the memfd is
//! mapped MAP_SHARED|MAP_FIXED over the range with the range's protection.
//! The program keeps its pointers, rnicd maps the same file pages, and
//! overlapping registrations share pages without any bookkeeping, since a
//! page's place in the file is its address.
//!
//! When the last registration covering a page goes, the page moves back to
//! private anonymous memory and its file page is punched out, so the memfd
//! holds only registered memory. In a forked child every registered page is
//! made private again (pthread_atfork), so a child gets a copy of registered
//! memory as with a fork-safe kernel driver, not a page shared with its
//! parent.
//!
//! Corner cases (docs/ibverbs.md): whole pages move, so data beside an
//! unaligned buffer moves with it (it stays where it was, only shared); a
//! store by another thread into those pages while they move may be lost;
//! `munmap` of a registered range drops the program's view, rnicd keeps its
//! own until the MR is deregistered.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Mutex, OnceLock};

const PAGE: u64 = 4096;
/// The memfd's size: the whole user address space of x86-64 (47 bits).
const SPAN: u64 = 1 << 47;
const MEMFD_NAME: &str = "transit-ibverbs-mr";

struct Shared {
    fd: OwnedFd,
    /// The process that made the memfd: a forked child shares the file with
    /// it and must never punch its pages.
    owner: libc::pid_t,
    /// Live registrations as page ranges [start, end).
    regs: Mutex<Vec<(u64, u64)>>,
}

static SHARED: OnceLock<Result<Shared, i32>> = OnceLock::new();

fn shared() -> Result<&'static Shared, i32> {
    SHARED
        .get_or_init(|| {
            let name = std::ffi::CString::new(MEMFD_NAME).unwrap();
            // SAFETY: plain syscalls; results checked.
            let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
            if fd < 0 {
                return Err(errno());
            }
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            if unsafe { libc::ftruncate(fd.as_raw_fd(), SPAN as libc::off_t) } < 0 {
                return Err(errno());
            }
            // rnicd maps only memfds that cannot shrink under it.
            if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL) } < 0 {
                return Err(errno());
            }
            unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
            Ok(Shared { fd, owner: unsafe { libc::getpid() }, regs: Mutex::new(Vec::new()) })
        })
        .as_ref()
        .map_err(|e| *e)
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)
}

/// The memfd every registered page lives in (file offset = address).
pub fn memfd() -> Result<RawFd, i32> {
    Ok(shared()?.fd.as_raw_fd())
}

/// The mappings that overlap [lo, hi) (`verbs::proc_maps`).
fn vmas(lo: u64, hi: u64) -> Result<Vec<verbs::proc_maps::Vma>, i32> {
    verbs::proc_maps::vmas(lo, hi, MEMFD_NAME).map_err(|_| libc::EIO)
}

fn page_range(addr: u64, len: u64) -> Result<(u64, u64), i32> {
    let end = addr.checked_add(len).filter(|e| *e <= SPAN).ok_or(libc::EFAULT)?;
    Ok((addr & !(PAGE - 1), end.div_ceil(PAGE) * PAGE))
}

/// Moves the pages of [addr, addr+len) onto the memfd (those not there
/// yet) and records the registration. EFAULT if part of the range is not
/// mapped or not readable.
pub fn share(addr: u64, len: u64) -> Result<(), i32> {
    let sh = shared()?;
    let (lo, hi) = page_range(addr, len)?;
    let mut regs = sh.regs.lock().unwrap_or_else(|e| e.into_inner());
    let maps = vmas(lo, hi)?;
    // Every page must be mapped and readable (a NIC reads what it sends).
    let mut at = lo;
    for v in &maps {
        if v.start > at || v.prot & libc::PROT_READ == 0 {
            return Err(libc::EFAULT);
        }
        at = v.end;
    }
    if at < hi {
        return Err(libc::EFAULT);
    }
    let fd = sh.fd.as_raw_fd();
    off_stack(|| {
        for v in maps.iter().filter(|v| !v.on_memfd) {
            move_to_memfd(fd, v.start.max(lo), v.end.min(hi), v.prot)?;
        }
        Ok::<(), i32>(())
    })?;
    regs.push((lo, hi));
    Ok(())
}

/// Runs a move of pages on a helper thread while the calling thread waits.
/// The range may hold the caller's own stack (a registered stack buffer):
/// a store into a live frame between the copy and the remap would be lost,
/// and the caller's own calls make such stores. Blocked in the join, the
/// caller writes nothing to its stack until the move is over.
fn off_stack<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    std::thread::scope(|s| s.spawn(f).join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
}

fn move_to_memfd(fd: RawFd, s: u64, e: u64, prot: i32) -> Result<(), i32> {
    // The current content goes into the file at offset = address, read
    // straight from the pages (no bounce buffer), then the file replaces them.
    let mut done = 0u64;
    while done < e - s {
        // SAFETY: the range is mapped and readable (checked by the caller).
        let n = unsafe { libc::pwrite(fd, (s + done) as *const libc::c_void, (e - s - done) as usize, (s + done) as libc::off_t) };
        if n <= 0 {
            return Err(if n < 0 { errno() } else { libc::EIO });
        }
        done += n as u64;
    }
    // SAFETY: replaces pages of the caller's own range with the same content.
    let p = unsafe { libc::mmap(s as *mut libc::c_void, (e - s) as usize, prot, libc::MAP_SHARED | libc::MAP_FIXED, fd, s as libc::off_t) };
    if p == libc::MAP_FAILED {
        return Err(errno());
    }
    Ok(())
}

/// Copies [s, e) of our memfd mapping into fresh private anonymous pages at
/// the same address.
fn move_to_private(s: u64, e: u64, prot: i32) -> Result<(), i32> {
    let len = (e - s) as usize;
    // SAFETY: a bounce buffer of our own, then a MAP_FIXED over pages that
    // are the memfd's (checked by the caller) with their content copied back.
    unsafe {
        let tmp = libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0);
        if tmp == libc::MAP_FAILED {
            return Err(errno());
        }
        std::ptr::copy_nonoverlapping(s as *const u8, tmp as *mut u8, len);
        let p = libc::mmap(
            s as *mut libc::c_void,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
            -1,
            0,
        );
        if p == libc::MAP_FAILED {
            let err = errno();
            libc::munmap(tmp, len);
            return Err(err);
        }
        std::ptr::copy_nonoverlapping(tmp as *const u8, s as *mut u8, len);
        libc::munmap(tmp, len);
        if prot != libc::PROT_READ | libc::PROT_WRITE {
            libc::mprotect(s as *mut libc::c_void, len, prot);
        }
    }
    Ok(())
}

/// Forgets the registration of [addr, addr+len) (after rnicd dropped its
/// MR): pages no other registration covers go back to private memory and
/// leave the memfd.
pub fn unshare(addr: u64, len: u64) {
    let Ok(sh) = shared() else { return };
    let Ok((lo, hi)) = page_range(addr, len) else { return };
    let mut regs = sh.regs.lock().unwrap_or_else(|e| e.into_inner());
    let Some(i) = regs.iter().position(|r| *r == (lo, hi)) else { return };
    regs.swap_remove(i);
    // SAFETY: getpid cannot fail.
    if unsafe { libc::getpid() } != sh.owner {
        // A forked child's registered pages are already private copies
        // (after_fork_in_child); the file's pages are its parent's.
        return;
    }
    // The pages of [lo, hi) that no remaining registration covers.
    let mut free = vec![(lo, hi)];
    for &(s, e) in regs.iter() {
        free = free
            .into_iter()
            .flat_map(|(a, b)| {
                if e <= a || s >= b {
                    vec![(a, b)]
                } else {
                    [(a, s.max(a)), (e.min(b), b)].into_iter().filter(|(x, y)| x < y).collect()
                }
            })
            .collect();
    }
    for (a, b) in free {
        if let Ok(maps) = vmas(a, b) {
            off_stack(|| {
                for v in maps.iter().filter(|v| v.on_memfd) {
                    let _ = move_to_private(v.start.max(a), v.end.min(b), v.prot);
                }
            });
        }
        // SAFETY: drops file pages nobody maps any more (the program's view
        // is private again, rnicd unmapped the MR before we got here).
        unsafe {
            libc::fallocate(
                sh.fd.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                a as libc::off_t,
                (b - a) as libc::off_t,
            )
        };
    }
}

/// In a forked child (one thread), registered pages become private copies:
/// the child must not share its parent's registered memory. The memfd
/// itself stays untouched: it is still the parent's.
extern "C" fn after_fork_in_child() {
    let Some(Ok(sh)) = SHARED.get() else { return };
    let regs = match sh.regs.try_lock() {
        Ok(r) => r.clone(),
        Err(_) => return,
    };
    for (lo, hi) in regs {
        if let Ok(maps) = vmas(lo, hi) {
            off_stack(|| {
                for v in maps.iter().filter(|v| v.on_memfd) {
                    let _ = move_to_private(v.start.max(lo), v.end.min(hi), v.prot);
                }
            });
        }
    }
}
