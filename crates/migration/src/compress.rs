//! Per-page compression, used only where it pays.

use std::fmt;
use std::str::FromStr;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Compress {
    #[default]
    None,
    Lz4,
    Zstd(i32),
}

impl FromStr for Compress {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "none" | "" => Ok(Compress::None),
            "lz4" => Ok(Compress::Lz4),
            "zstd" => Ok(Compress::Zstd(1)),
            _ => match s.strip_prefix("zstd:") {
                Some(l) => {
                    let level: i32 = l.parse().map_err(|_| format!("bad zstd level {l:?}"))?;
                    if !(-7..=22).contains(&level) {
                        return Err(format!("zstd level {level} is outside -7..=22"));
                    }
                    Ok(Compress::Zstd(level))
                }
                None => Err(format!("unknown compression {s:?} (none, lz4, zstd, zstd:LEVEL)")),
            },
        }
    }
}

impl fmt::Display for Compress {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self {
            Compress::None => write!(f, "none"),
            Compress::Lz4 => write!(f, "lz4"),
            Compress::Zstd(l) => write!(f, "zstd:{l}"),
        }
    }
}

/// A page is sent compressed only if that saves at least this many bytes;
/// otherwise the receiver's decompression time is wasted.
pub const MIN_SAVING: usize = 512;

/// One channel's compressor. After a run of pages that did not shrink it
/// stops trying for a while, so incompressible RAM costs little CPU.
pub struct PageCompressor {
    kind: Compress,
    zstd: Option<zstd::bulk::Compressor<'static>>,
    misses: u32,
    skip: u32,
    pub attempts: u64,
    pub skipped: u64,
}

impl PageCompressor {
    pub fn new(kind: Compress) -> std::io::Result<Self> {
        let zstd = match kind {
            Compress::Zstd(l) => Some(zstd::bulk::Compressor::new(l)?),
            _ => None,
        };
        Ok(PageCompressor { kind, zstd, misses: 0, skip: 0, attempts: 0, skipped: 0 })
    }

    /// Whether the next page should be tried at all (cheap check first).
    pub fn wants_to_try(&mut self) -> bool {
        if self.kind == Compress::None {
            return false;
        }
        if self.skip > 0 {
            self.skip -= 1;
            self.skipped += 1;
            return false;
        }
        true
    }

    /// Compress `page` into `out` (cleared first). Returns false (and leaves
    /// `out` unspecified) when the page should go raw.
    pub fn compress(&mut self, page: &[u8], out: &mut Vec<u8>) -> bool {
        if self.kind == Compress::None {
            return false;
        }
        self.attempts += 1;
        out.clear();
        out.resize(lz4_flex::block::get_maximum_output_size(page.len()).max(zstd::zstd_safe::compress_bound(page.len())), 0);
        let n = match self.kind {
            Compress::Lz4 => lz4_flex::block::compress_into(page, out).ok(),
            Compress::Zstd(_) => self.zstd.as_mut().and_then(|z| z.compress_to_buffer(page, out.as_mut_slice()).ok()),
            Compress::None => None,
        };
        match n {
            Some(n) if n + MIN_SAVING <= page.len() => {
                out.truncate(n);
                self.misses = 0;
                true
            }
            _ => {
                self.misses += 1;
                if self.misses >= 8 {
                    // Back off: skip the next 8, 16, ... up to 256 pages.
                    self.skip = (self.misses * 2).min(256);
                }
                false
            }
        }
    }
}

/// Decompress one page of `kind` into `dst` (exactly one page).
pub fn decompress(kind: Compress, src: &[u8], dst: &mut [u8], zstd: &mut Option<zstd::bulk::Decompressor<'static>>) -> Result<(), String> {
    let n = match kind {
        Compress::Lz4 => lz4_flex::block::decompress_into(src, dst).map_err(|e| format!("lz4: {e}"))?,
        Compress::Zstd(_) => {
            if zstd.is_none() {
                *zstd = Some(zstd::bulk::Decompressor::new().map_err(|e| e.to_string())?);
            }
            zstd.as_mut().unwrap().decompress_to_buffer(src, dst).map_err(|e| format!("zstd: {e}"))?
        }
        Compress::None => return Err("page marked compressed without a method".into()),
    };
    if n != dst.len() {
        return Err(format!("page decompressed to {n} bytes, expected {}", dst.len()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_roundtrip() {
        assert_eq!("zstd:3".parse::<Compress>().unwrap(), Compress::Zstd(3));
        assert!("zstd:99".parse::<Compress>().is_err());
        assert!("gzip".parse::<Compress>().is_err());
        let mut page = vec![0u8; 4096];
        for (i, b) in page.iter_mut().enumerate() {
            *b = b"hello transit "[i % 14];
        }
        for k in [Compress::Lz4, Compress::Zstd(1)] {
            let mut c = PageCompressor::new(k).unwrap();
            let mut out = Vec::new();
            assert!(c.compress(&page, &mut out), "{k} shrinks text");
            let mut back = vec![0u8; 4096];
            decompress(k, &out, &mut back, &mut None).unwrap();
            assert_eq!(back, page);
            // Random bytes do not shrink: sent raw.
            let mut x = 1u64;
            let rnd: Vec<u8> = (0..4096)
                .map(|_| {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                    (x >> 56) as u8
                })
                .collect();
            assert!(!c.compress(&rnd, &mut out));
            // Garbage never decodes into a page silently.
            assert!(decompress(k, &out[..out.len().min(10)], &mut back, &mut None).is_err());
        }
    }
}
