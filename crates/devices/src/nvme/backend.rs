//! Namespace storage: host memory or a file / block device.

use super::config::BackendSpec;
use super::dma::Seg;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};

pub enum Storage {
    Memory(Vec<u8>),
    File(FileStore),
}

pub struct FileStore {
    pub file: File,
    pub direct: bool,
}

impl Storage {
    pub fn open(spec: &BackendSpec, block_size: u32) -> Result<(Storage, u64), String> {
        match spec {
            BackendSpec::Memory { size } => {
                if size % block_size as u64 != 0 {
                    return Err(format!("memory namespace size {size} is not a multiple of the block size {block_size}"));
                }
                if *size > 64 << 30 {
                    return Err(format!("memory namespace of {size} bytes is too large"));
                }
                // A zeroed Vec of this size is mapped lazily by the allocator.
                Ok((Storage::Memory(vec![0u8; *size as usize]), *size))
            }
            BackendSpec::File { path, direct } => {
                let mut o = OpenOptions::new();
                o.read(true).write(true);
                if *direct {
                    o.custom_flags(libc::O_DIRECT);
                }
                let file = o.open(path).map_err(|e| format!("open {path}: {e}"))?;
                let size = file_size(&file).map_err(|e| format!("size of {path}: {e}"))?;
                let size = size - size % block_size as u64;
                if size == 0 {
                    return Err(format!("{path} is smaller than one block"));
                }
                Ok((Storage::File(FileStore { file, direct: *direct }), size))
            }
        }
    }

    pub fn is_file(&self) -> bool {
        matches!(self, Storage::File(_))
    }

    /// Synchronous read of `segs.len` bytes at byte offset `off` into guest segments.
    pub fn read_into(&self, off: u64, segs: &[Seg]) -> io::Result<()> {
        match self {
            Storage::Memory(v) => {
                let mut at = off as usize;
                for s in segs {
                    // SAFETY: segments were checked by map_prps; the range by the caller.
                    unsafe { std::ptr::copy_nonoverlapping(v.as_ptr().add(at), s.ptr, s.len) };
                    at += s.len;
                }
                Ok(())
            }
            Storage::File(f) => {
                let mut at = off;
                for s in segs {
                    // SAFETY: as above.
                    let buf = unsafe { std::slice::from_raw_parts_mut(s.ptr, s.len) };
                    f.read_exact_at_maybe_direct(buf, at)?;
                    at += s.len as u64;
                }
                Ok(())
            }
        }
    }

    /// Synchronous write of guest segments at byte offset `off`.
    pub fn write_from(&mut self, off: u64, segs: &[Seg], dsync: bool) -> io::Result<()> {
        match self {
            Storage::Memory(v) => {
                let mut at = off as usize;
                for s in segs {
                    // SAFETY: as above.
                    unsafe { std::ptr::copy_nonoverlapping(s.ptr, v.as_mut_ptr().add(at), s.len) };
                    at += s.len;
                }
                Ok(())
            }
            Storage::File(f) => {
                let mut at = off;
                for s in segs {
                    // SAFETY: as above.
                    let buf = unsafe { std::slice::from_raw_parts(s.ptr, s.len) };
                    f.write_all_at_maybe_direct(buf, at)?;
                    at += s.len as u64;
                }
                if dsync {
                    f.file.sync_data()?;
                }
                Ok(())
            }
        }
    }

    /// Read `buf.len()` bytes at `off` into a host buffer (Compare).
    pub fn read_bytes(&self, off: u64, buf: &mut [u8]) -> io::Result<()> {
        match self {
            Storage::Memory(v) => {
                buf.copy_from_slice(&v[off as usize..off as usize + buf.len()]);
                Ok(())
            }
            Storage::File(f) => f.read_exact_at_maybe_direct(buf, off),
        }
    }

    /// Make `len` bytes at `off` read back as zeros. `deallocate` lets a file
    /// backend punch a hole instead of writing.
    pub fn zero(&mut self, off: u64, len: u64, deallocate: bool) -> io::Result<()> {
        match self {
            Storage::Memory(v) => {
                v[off as usize..(off + len) as usize].fill(0);
                Ok(())
            }
            Storage::File(f) => {
                let fd = f.file.as_raw_fd();
                let mode = if deallocate {
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
                } else {
                    libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
                };
                // SAFETY: plain syscall on an owned fd.
                if unsafe { libc::fallocate(fd, mode, off as i64, len as i64) } == 0 {
                    return Ok(());
                }
                // Block devices and some file systems refuse: write zeros.
                let chunk = vec![0u8; (len as usize).min(1 << 20)];
                let mut at = 0;
                while at < len {
                    let n = (len - at).min(chunk.len() as u64) as usize;
                    f.write_all_at_maybe_direct(&chunk[..n], off + at)?;
                    at += n as u64;
                }
                Ok(())
            }
        }
    }

    pub fn flush(&self) -> io::Result<()> {
        match self {
            Storage::Memory(_) => Ok(()),
            Storage::File(f) => f.file.sync_data(),
        }
    }
}

impl FileStore {
    /// O_DIRECT needs 512-aligned buffers; guest buffers at odd offsets go
    /// through an aligned bounce buffer.
    fn read_exact_at_maybe_direct(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        if self.direct && !aligned(buf.as_ptr(), buf.len(), off) {
            let mut b = AlignedBuf::new(buf.len());
            self.file.read_exact_at(b.as_mut(), off)?;
            buf.copy_from_slice(&b.as_mut()[..buf.len()]);
            return Ok(());
        }
        self.file.read_exact_at(buf, off)
    }

    fn write_all_at_maybe_direct(&self, buf: &[u8], off: u64) -> io::Result<()> {
        if self.direct && !aligned(buf.as_ptr(), buf.len(), off) {
            let mut b = AlignedBuf::new(buf.len());
            b.as_mut()[..buf.len()].copy_from_slice(buf);
            return self.file.write_all_at(&b.as_mut()[..buf.len()], off);
        }
        self.file.write_all_at(buf, off)
    }
}

pub fn aligned(p: *const u8, len: usize, off: u64) -> bool {
    (p as usize) % 512 == 0 && len % 512 == 0 && off % 512 == 0
}

struct AlignedBuf {
    v: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedBuf {
    fn new(len: usize) -> Self {
        let v = vec![0u8; len + 4096];
        let start = v.as_ptr().align_offset(4096);
        AlignedBuf { v, start, len }
    }
    fn as_mut(&mut self) -> &mut [u8] {
        &mut self.v[self.start..self.start + self.len]
    }
}

fn file_size(f: &File) -> io::Result<u64> {
    let md = f.metadata()?;
    if md.is_file() {
        return Ok(md.len());
    }
    // A block device: ask the kernel.
    let mut size: u64 = 0;
    // BLKGETSIZE64
    const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
    // SAFETY: the ioctl writes one u64.
    if unsafe { libc::ioctl(f.as_raw_fd(), BLKGETSIZE64, &mut size) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(size)
}
