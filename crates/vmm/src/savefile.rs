//! The save file of a stopped VM (`transit vm save` / `restore`).
//!
//! ```text
//! "TRANSAVE"  magic (8 bytes)
//! u32         format version (FORMAT_VERSION)
//! u32 + JSON  header: the VmConfig and RAM size
//! StateSet    vCPU and device sections (each with its CRC32)
//! RAM         per 2 MiB chunk: u64 bitmap-of-nonzero-pages x 8, the
//!             non-zero pages in order, u32 CRC32 of bitmap + pages
//! "TRANSEND"  end marker
//! ```
//! Zero pages take one bit. Any damage (bad magic, version, checksum,
//! truncation) is a clear error before the VM runs.

use crate::config::VmConfig;
use crate::memory::{GuestRam, PAGE_SIZE};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use snapshot::StateSet;
use std::io::{BufReader, Read, Write};
use std::path::Path;

const MAGIC: &[u8; 8] = b"TRANSAVE";
const END: &[u8; 8] = b"TRANSEND";
pub const FORMAT_VERSION: u32 = 1;
const CHUNK_PAGES: usize = 512;
const CHUNK: usize = CHUNK_PAGES * PAGE_SIZE as usize;

#[derive(Serialize, Deserialize)]
pub struct Header {
    pub config: VmConfig,
    pub ram_size: u64,
}

pub fn is_zero_page(p: &[u8]) -> bool {
    // Compare as u128 words; the compiler vectorises this loop.
    let (pre, mid, post) = unsafe { p.align_to::<u128>() };
    pre.iter().all(|&b| b == 0) && mid.iter().all(|&w| w == 0) && post.iter().all(|&b| b == 0)
}

/// Runs `[a, b)` of set bits among the first `n` bits of `bitmap`.
fn data_runs(bitmap: &[u64], n: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
    let bit = move |i: usize| bitmap[i / 64] & (1 << (i % 64)) != 0;
    let mut i = 0;
    std::iter::from_fn(move || {
        while i < n && !bit(i) {
            i += 1;
        }
        if i >= n {
            return None;
        }
        let a = i;
        while i < n && bit(i) {
            i += 1;
        }
        Some((a, i))
    })
}

pub struct SaveStats {
    pub bytes: u64,
    pub zero_pages: u64,
    pub data_pages: u64,
}

/// Write a paused VM's config, state and RAM to `path` (see [`crate::output`]
/// for how: all or nothing, synced, never over a non-regular file).
pub fn write(path: &Path, config: &VmConfig, state: &StateSet, ram: &GuestRam) -> Result<SaveStats> {
    let (mut stats, bytes) = crate::output::write_file(path, |w| write_contents(w, config, state, ram))?;
    stats.bytes = bytes;
    Ok(stats)
}

fn write_contents(w: &mut impl Write, config: &VmConfig, state: &StateSet, ram: &GuestRam) -> Result<SaveStats> {
    w.write_all(MAGIC)?;
    w.write_all(&FORMAT_VERSION.to_le_bytes())?;
    let hdr = serde_json::to_vec(&Header { config: config.clone(), ram_size: ram.size() })?;
    w.write_all(&(hdr.len() as u32).to_le_bytes())?;
    w.write_all(&hdr)?;
    state.write_to(&mut *w)?;
    // SAFETY: the caller paused the VM.
    let mem = unsafe { ram.as_slice() };
    let mut stats = SaveStats { bytes: 0, zero_pages: 0, data_pages: 0 };
    for chunk in mem.chunks(CHUNK) {
        let mut bitmap = [0u64; CHUNK_PAGES / 64];
        for (i, p) in chunk.chunks(PAGE_SIZE as usize).enumerate() {
            if !is_zero_page(p) {
                bitmap[i / 64] |= 1 << (i % 64);
            }
        }
        let mut crc = crc32fast::Hasher::new();
        for word in bitmap {
            w.write_all(&word.to_le_bytes())?;
            crc.update(&word.to_le_bytes());
        }
        // Runs of consecutive data pages go out in one write (large writes
        // bypass the BufWriter's copy).
        for (a, b) in data_runs(&bitmap, chunk.len() / PAGE_SIZE as usize) {
            let bytes = &chunk[a * PAGE_SIZE as usize..b * PAGE_SIZE as usize];
            w.write_all(bytes)?;
            crc.update(bytes);
            stats.data_pages += (b - a) as u64;
        }
        stats.zero_pages += (chunk.len() / PAGE_SIZE as usize) as u64 - bitmap.iter().map(|w| w.count_ones() as u64).sum::<u64>();
        w.write_all(&crc.finalize().to_le_bytes())?;
    }
    w.write_all(END)?;
    Ok(stats)
}

/// An opened save file: header and state read and checked, RAM still to come.
pub struct SaveReader {
    pub header: Header,
    pub state: StateSet,
    r: BufReader<std::fs::File>,
}

fn damaged(e: std::io::Error) -> anyhow::Error {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        anyhow::anyhow!("the save file is truncated")
    } else {
        e.into()
    }
}

pub fn open(path: &Path) -> Result<SaveReader> {
    let f = std::fs::File::open(path).with_context(|| format!("opening save file {}", path.display()))?;
    let mut r = BufReader::with_capacity(256 << 10, f);
    let mut magic = [0u8; 8];
    r.read_exact(&mut magic).map_err(damaged)?;
    if &magic != MAGIC {
        bail!("{} is not a Transit save file", path.display());
    }
    let mut four = [0u8; 4];
    r.read_exact(&mut four).map_err(damaged)?;
    let v = u32::from_le_bytes(four);
    if v != FORMAT_VERSION {
        bail!("save file format version {v} is not supported (this build reads {FORMAT_VERSION})");
    }
    r.read_exact(&mut four).map_err(damaged)?;
    let n = u32::from_le_bytes(four) as usize;
    if n > 1 << 20 {
        bail!("the save file header is damaged");
    }
    let mut hdr = vec![0u8; n];
    r.read_exact(&mut hdr).map_err(damaged)?;
    let header: Header = serde_json::from_slice(&hdr).context("the save file header is damaged")?;
    let state = StateSet::read_from(&mut r).map_err(|e| match e {
        snapshot::StateError::Io(io) => damaged(io),
        other => other.into(),
    })?;
    Ok(SaveReader { header, state, r })
}

impl SaveReader {
    /// Read RAM into a VM built from `header.config` (nothing runs yet).
    pub fn read_ram(mut self, ram: &GuestRam) -> Result<()> {
        if ram.size() != self.header.ram_size {
            bail!("save file holds {} bytes of RAM, the VM has {}", self.header.ram_size, ram.size());
        }
        // SAFETY: the VM has not started; nothing else touches RAM.
        let mem = unsafe { ram.as_mut_slice() };
        for chunk in mem.chunks_mut(CHUNK) {
            let mut bitmap = [0u64; CHUNK_PAGES / 64];
            let mut crc = crc32fast::Hasher::new();
            for word in bitmap.iter_mut() {
                let mut b = [0u8; 8];
                self.r.read_exact(&mut b).map_err(damaged)?;
                crc.update(&b);
                *word = u64::from_le_bytes(b);
            }
            let pages = chunk.len() / PAGE_SIZE as usize;
            let mut next = 0;
            for (a, b) in data_runs(&bitmap, pages) {
                chunk[next * PAGE_SIZE as usize..a * PAGE_SIZE as usize].fill(0);
                let bytes = &mut chunk[a * PAGE_SIZE as usize..b * PAGE_SIZE as usize];
                self.r.read_exact(bytes).map_err(damaged)?;
                crc.update(bytes);
                next = b;
            }
            chunk[next * PAGE_SIZE as usize..].fill(0);
            let mut c = [0u8; 4];
            self.r.read_exact(&mut c).map_err(damaged)?;
            if u32::from_le_bytes(c) != crc.finalize() {
                bail!("the save file is damaged (RAM checksum mismatch)");
            }
        }
        let mut end = [0u8; 8];
        self.r.read_exact(&mut end).map_err(damaged)?;
        if &end != END {
            bail!("the save file is damaged (no end marker)");
        }
        Ok(())
    }
}
