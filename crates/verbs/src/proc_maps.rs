// SPDX-License-Identifier: GPL-2.0-or-later
//! The process's own mappings, from `/proc/self/maps`: what the two movers
//! of ordinary memory onto a memfd at file offset = address (`rcache`, and
//! the libibverbs drop-in's registrations) need to know of a range before
//! they move it.

/// One mapping that overlaps the range asked for.
pub struct Vma {
    pub start: u64,
    pub end: u64,
    /// PROT_READ, PROT_WRITE and PROT_EXEC as its permissions say.
    pub prot: i32,
    /// Already moved: a mapping of the memfd named, at file offset =
    /// address.
    pub on_memfd: bool,
}

/// The mappings that overlap [lo, hi), in address order; `memfd_name` is
/// the name the memfd was created with.
pub fn vmas(lo: u64, hi: u64, memfd_name: &str) -> std::io::Result<Vec<Vma>> {
    let text = std::fs::read_to_string("/proc/self/maps")?;
    let memfd_path = format!("/memfd:{memfd_name}");
    let mut out = Vec::new();
    for line in text.lines() {
        // start-end perms offset dev inode [path]; a memfd's path is
        // "/memfd:NAME (deleted)".
        let mut it = line.split_whitespace();
        let (Some(range), Some(perms), Some(off)) = (it.next(), it.next(), it.next()) else { continue };
        let path = it.nth(2).unwrap_or("");
        let Some((a, b)) = range.split_once('-') else { continue };
        let (Ok(start), Ok(end), Ok(offset)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16), u64::from_str_radix(off, 16))
        else {
            continue;
        };
        if end <= lo || start >= hi {
            continue;
        }
        let p = perms.as_bytes();
        let mut prot = 0;
        if p.first() == Some(&b'r') {
            prot |= libc::PROT_READ;
        }
        if p.get(1) == Some(&b'w') {
            prot |= libc::PROT_WRITE;
        }
        if p.get(2) == Some(&b'x') {
            prot |= libc::PROT_EXEC;
        }
        out.push(Vma { start, end, prot, on_memfd: path == memfd_path && offset == start });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_moved_onto_a_memfd_is_seen_there() {
        const LEN: usize = 3 * 4096;
        // SAFETY: plain syscalls on mappings of our own; results checked.
        unsafe {
            let p =
                libc::mmap(std::ptr::null_mut(), LEN, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0);
            assert_ne!(p, libc::MAP_FAILED);
            let a = p as u64;
            let v = vmas(a, a + LEN as u64, "proc-maps-test").unwrap();
            assert!(v.iter().all(|v| !v.on_memfd && v.prot == libc::PROT_READ | libc::PROT_WRITE), "anonymous");
            assert!(v.first().unwrap().start <= a && v.last().unwrap().end >= a + LEN as u64, "covered");

            let fd = libc::memfd_create(c"proc-maps-test".as_ptr(), libc::MFD_CLOEXEC);
            assert!(fd >= 0);
            assert_eq!(libc::ftruncate(fd, (a + LEN as u64) as libc::off_t), 0);
            let mid = a + 4096;
            let q = libc::mmap(mid as *mut libc::c_void, 4096, libc::PROT_READ, libc::MAP_SHARED | libc::MAP_FIXED, fd, mid as libc::off_t);
            assert_eq!(q as u64, mid);
            let v = vmas(a, a + LEN as u64, "proc-maps-test").unwrap();
            let moved: Vec<_> = v.iter().filter(|v| v.on_memfd).map(|v| (v.start, v.end, v.prot)).collect();
            assert_eq!(moved, vec![(mid, mid + 4096, libc::PROT_READ)]);
            assert!(vmas(a, a + LEN as u64, "another-name").unwrap().iter().all(|v| !v.on_memfd));
            libc::munmap(p, LEN);
            libc::close(fd);
        }
    }
}
