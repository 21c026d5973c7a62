//! The migration stream format (version 1). See docs/migration.md.
//!
//! Every TCP connection starts with a 16-byte preamble: magic, stream
//! version, role. The control connection then carries checksummed frames
//! (JSON messages and binary blobs); each data connection carries page
//! batches, round barriers and an end-of-stream count.

use crate::compress::Compress;
use serde::{Deserialize, Serialize};
use std::io::{self, Read, Write};

pub const MAGIC: [u8; 8] = *b"TRNSTMIG";
pub const VERSION: u32 = 2;
pub const ROLE_CONTROL: u8 = 0;
pub const ROLE_DATA: u8 = 1;
/// Postcopy: page requests (destination -> source) and their answers, on a
/// connection of their own so they never wait behind bulk pages.
pub const ROLE_URGENT: u8 = 2;
pub const PAGE: usize = 4096;
/// Largest page batch accepted; bigger means damage.
pub const MAX_FRAME: usize = 16 << 20;
/// Largest control frame accepted. The VM state travels in one, and a
/// device may carry data in its state (an NVMe memory namespace), so this
/// follows the largest section a save file accepts.
pub const MAX_CONTROL_FRAME: usize = snapshot::Section::MAX_DATA;

#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("not a Transit migration stream (bad magic {0:02x?})")]
    Magic([u8; 8]),
    #[error("stream version {found} is not supported (this build speaks version {VERSION})")]
    Version { found: u32 },
    #[error("corrupted stream: {0}")]
    Corrupt(String),
    #[error("connection: {0}")]
    Io(#[from] io::Error),
}

/// A dead peer or a cut link must show up as an error within seconds, not
/// after TCP's 15 minutes: keepalives on idle connections (2 s, then every
/// second, 3 misses) and a 20 s limit on unacknowledged data (long enough
/// for a busy receiver's zero window). Postcopy relies on it to pause and
/// wait for recovery.
pub fn tune_socket(s: &std::net::TcpStream) {
    use std::os::fd::AsRawFd;
    let fd = s.as_raw_fd();
    let set = |level: i32, opt: i32, v: i32| {
        // SAFETY: an int option on our own socket.
        unsafe { libc::setsockopt(fd, level, opt, &v as *const i32 as *const libc::c_void, 4) };
    };
    set(libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 2);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 1);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 3);
    set(libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT, 20_000);
}

pub fn write_preamble(w: &mut impl Write, version: u32, role: u8) -> io::Result<()> {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&MAGIC);
    b[8..12].copy_from_slice(&version.to_le_bytes());
    b[12] = role;
    w.write_all(&b)
}

/// Read and check a preamble; returns the role.
pub fn read_preamble(r: &mut impl Read) -> Result<u8, WireError> {
    let mut b = [0u8; 16];
    r.read_exact(&mut b)?;
    let magic: [u8; 8] = b[..8].try_into().unwrap();
    if magic != MAGIC {
        return Err(WireError::Magic(magic));
    }
    let found = u32::from_le_bytes(b[8..12].try_into().unwrap());
    if found != VERSION {
        return Err(WireError::Version { found });
    }
    Ok(b[12])
}

/// Messages of the control connection (both directions).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Msg {
    /// Source -> destination, first message.
    Hello { session: u64, shape: String, ram_bytes: u64, page_size: u64, channels: u32, compress: String, mode: String },
    /// Destination accepts; data connections may follow.
    Welcome,
    /// Destination -> source, postcopy: every connection is accepted and
    /// served; the source may pause the VM.
    Ready,
    /// Either side gives up; the text says why.
    Abort { reason: String },
    /// Source -> destination after the last page batch; the vCPU/device
    /// state blob follows as the next frame.
    End {
        pages_per_channel: Vec<u64>,
        rounds: u64,
        state_bytes: u64,
        source_paused_unix_ns: u64,
        /// A blob of per-page xxh3 hashes follows the state.
        #[serde(default)]
        ram_hashes: bool,
    },
    /// Destination -> source: every channel applied this round.
    RoundDone { round: u64 },
    /// Destination holds the complete state and loaded it.
    Loaded { cpu_s: f64 },
    /// Source committed: the destination may run.
    Go,
    /// Destination vCPUs run (or stay paused if asked to).
    Resumed { unix_ns: u64, resumed: bool, cpu_s: f64 },
    /// First message of each data connection.
    Channel { session: u64, index: u32 },
    /// Source -> destination: the source paused; from here the destination
    /// runs and fetches what it misses. Followed by the state blob and, if
    /// `dirty_ranges`, a blob of (first, count) u64 pairs: pages sent before
    /// that changed since (the destination drops its copies). Without it,
    /// no page was sent yet (pure postcopy).
    Switchover { state_bytes: u64, source_paused_unix_ns: u64, dirty_ranges: bool },
    /// Destination -> source: every page is in; the source may let go.
    Complete { faults: u64, fault_p50_us: Option<f64>, fault_p99_us: Option<f64>, fault_max_us: Option<f64>, cpu_s: f64, ram_clients: u32 },
}

const FRAME_MSG: u8 = 1;
const FRAME_BLOB: u8 = 2;

fn write_frame(w: &mut impl Write, kind: u8, payload: &[u8]) -> io::Result<()> {
    // One write per frame: small frames leave in one segment.
    let mut buf = Vec::with_capacity(payload.len() + 13);
    buf.push(kind);
    buf.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    buf.extend_from_slice(payload);
    buf.extend_from_slice(&xxhash_rust::xxh3::xxh3_64(payload).to_le_bytes());
    w.write_all(&buf)?;
    w.flush()
}

fn read_frame(r: &mut impl Read, want: u8) -> Result<Vec<u8>, WireError> {
    let mut hdr = [0u8; 5];
    r.read_exact(&mut hdr)?;
    if hdr[0] != want {
        return Err(WireError::Corrupt(format!("control frame kind {} where {} was expected", hdr[0], want)));
    }
    let len = u32::from_le_bytes(hdr[1..5].try_into().unwrap()) as usize;
    if len > MAX_CONTROL_FRAME {
        return Err(WireError::Corrupt(format!("control frame of {len} bytes")));
    }
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload)?;
    let mut sum = [0u8; 8];
    r.read_exact(&mut sum)?;
    if u64::from_le_bytes(sum) != xxhash_rust::xxh3::xxh3_64(&payload) {
        return Err(WireError::Corrupt("control frame checksum mismatch".into()));
    }
    Ok(payload)
}

pub fn send_msg(w: &mut impl Write, m: &Msg) -> io::Result<()> {
    write_frame(w, FRAME_MSG, &serde_json::to_vec(m).expect("messages serialize"))
}

pub fn recv_msg(r: &mut impl Read) -> Result<Msg, WireError> {
    let p = read_frame(r, FRAME_MSG)?;
    serde_json::from_slice(&p).map_err(|e| WireError::Corrupt(format!("bad control message: {e}")))
}

pub fn send_blob(w: &mut impl Write, b: &[u8]) -> io::Result<()> {
    write_frame(w, FRAME_BLOB, b)
}

pub fn recv_blob(r: &mut impl Read) -> Result<Vec<u8>, WireError> {
    read_frame(r, FRAME_BLOB)
}

// --- data connections ---

pub const DATA_PAGES: u8 = 1;
pub const DATA_SYNC: u8 = 2;
pub const DATA_EOS: u8 = 3;
/// Urgent connection, destination -> source: `u64 first page, u32 count`.
pub const DATA_REQUEST: u8 = 4;
/// Like a request, for pages wanted soon: the source sends only those its
/// push has not sent yet (the rest are on their way already).
pub const DATA_PREFETCH: u8 = 5;
/// Most pages one request may ask for.
pub const MAX_REQUEST_PAGES: u32 = 256;

pub fn write_request(w: &mut impl Write, kind: u8, first: u64, count: u32) -> io::Result<()> {
    let mut b = [0u8; 13];
    b[0] = kind;
    b[1..9].copy_from_slice(&first.to_le_bytes());
    b[9..].copy_from_slice(&count.to_le_bytes());
    w.write_all(&b)
}

/// Read one page request (kind, first, count); checks it lies inside
/// `total_pages`.
pub fn read_request(r: &mut impl Read, total_pages: u64) -> Result<(u8, u64, u32), WireError> {
    let mut b = [0u8; 13];
    r.read_exact(&mut b)?;
    if b[0] != DATA_REQUEST && b[0] != DATA_PREFETCH {
        return Err(WireError::Corrupt(format!("urgent frame kind {} where a page request was expected", b[0])));
    }
    let first = u64::from_le_bytes(b[1..9].try_into().unwrap());
    let count = u32::from_le_bytes(b[9..].try_into().unwrap());
    if count == 0 || count > MAX_REQUEST_PAGES || first.checked_add(count as u64).is_none_or(|e| e > total_pages) {
        return Err(WireError::Corrupt(format!("request for pages {first} (+{count}) outside guest RAM of {total_pages} pages")));
    }
    Ok((b[0], first, count))
}

/// How one page record is encoded (low 4 bits of its first word).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Enc {
    /// All-zero page, no bytes follow.
    Zero = 0,
    /// 4096 raw bytes follow.
    Raw = 1,
    /// u16 length + LZ4 block.
    Lz4 = 2,
    /// u16 length + zstd frame.
    Zstd = 3,
    /// u32 count: `count` zero pages from this one on.
    ZeroRun = 4,
    /// u32 count, then `count` raw pages from this one on (placed with one
    /// copy on a postcopy destination).
    RawRun = 5,
}

impl Enc {
    fn from_u8(v: u8) -> Option<Enc> {
        Some(match v {
            0 => Enc::Zero,
            1 => Enc::Raw,
            2 => Enc::Lz4,
            3 => Enc::Zstd,
            4 => Enc::ZeroRun,
            5 => Enc::RawRun,
            _ => return None,
        })
    }
}

/// Builds one page batch: `[kind][u32 len][u32 records][payload][xxh3]`.
pub struct BatchWriter {
    buf: Vec<u8>,
    records: u32,
    pub pages: u64,
    /// The open raw run: where its count is and the page that would extend it.
    run: Option<(usize, u64)>,
}

/// Longest raw run: 256 KiB, one batch.
pub const MAX_RAW_RUN: u32 = 64;

pub const BATCH_BYTES: usize = 256 << 10;

impl Default for BatchWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl BatchWriter {
    pub fn new() -> Self {
        let mut buf = Vec::with_capacity(BATCH_BYTES + 2 * PAGE);
        buf.extend_from_slice(&[0u8; 9]);
        BatchWriter { buf, records: 0, pages: 0, run: None }
    }
    fn head(&mut self, pfn: u64, enc: Enc) {
        self.run = None;
        self.buf.extend_from_slice(&((pfn << 4) | enc as u64).to_le_bytes());
        self.records += 1;
    }
    pub fn zero(&mut self, pfn: u64) {
        self.head(pfn, Enc::Zero);
        self.pages += 1;
    }
    pub fn zero_run(&mut self, pfn: u64, count: u32) {
        self.head(pfn, Enc::ZeroRun);
        self.buf.extend_from_slice(&count.to_le_bytes());
        self.pages += count as u64;
    }
    /// Append room for a raw page and return it to be filled.
    pub fn raw(&mut self, pfn: u64) -> &mut [u8] {
        self.head(pfn, Enc::Raw);
        self.pages += 1;
        let at = self.buf.len();
        self.buf.resize(at + PAGE, 0);
        &mut self.buf[at..]
    }
    /// Room for raw page `pfn`, appended to the open run if it follows it.
    pub fn raw_in_run(&mut self, pfn: u64) -> &mut [u8] {
        match self.run {
            Some((at, next)) if next == pfn => {
                let n = u32::from_le_bytes(self.buf[at..at + 4].try_into().unwrap()) + 1;
                self.buf[at..at + 4].copy_from_slice(&n.to_le_bytes());
                self.run = (n < MAX_RAW_RUN).then_some((at, pfn + 1));
            }
            _ => {
                self.head(pfn, Enc::RawRun);
                let at = self.buf.len();
                self.buf.extend_from_slice(&1u32.to_le_bytes());
                self.run = Some((at, pfn + 1));
            }
        }
        self.pages += 1;
        let at = self.buf.len();
        self.buf.resize(at + PAGE, 0);
        &mut self.buf[at..]
    }
    /// Append a raw page copied from `src` (no zero-fill first); returns
    /// the copy, which the caller may still turn into a zero record with
    /// [`undo_raw`](Self::undo_raw).
    pub fn raw_from(&mut self, pfn: u64, src: &[u8]) -> &[u8] {
        self.head(pfn, Enc::Raw);
        self.pages += 1;
        let at = self.buf.len();
        self.buf.extend_from_slice(&src[..PAGE]);
        &self.buf[at..]
    }
    /// Drop the raw page just appended (it turned out to be zero).
    pub fn undo_raw(&mut self) {
        self.buf.truncate(self.buf.len() - PAGE - 8);
        self.records -= 1;
        self.pages -= 1;
    }
    pub fn compressed(&mut self, pfn: u64, enc: Enc, data: &[u8]) {
        self.head(pfn, enc);
        self.pages += 1;
        self.buf.extend_from_slice(&(data.len() as u16).to_le_bytes());
        self.buf.extend_from_slice(data);
    }
    pub fn is_full(&self) -> bool {
        self.buf.len() >= BATCH_BYTES
    }
    pub fn is_empty(&self) -> bool {
        self.records == 0
    }
    /// Seal the batch and return its wire bytes; the writer is reset after
    /// the caller sent them (see [`reset`](Self::reset)).
    pub fn seal(&mut self) -> &[u8] {
        let payload_len = (self.buf.len() - 9) as u32;
        self.buf[0] = DATA_PAGES;
        self.buf[1..5].copy_from_slice(&payload_len.to_le_bytes());
        self.buf[5..9].copy_from_slice(&self.records.to_le_bytes());
        let sum = xxhash_rust::xxh3::xxh3_64(&self.buf[9..]);
        self.buf.extend_from_slice(&sum.to_le_bytes());
        &self.buf
    }
    pub fn reset(&mut self) {
        self.buf.truncate(9);
        self.records = 0;
        self.pages = 0;
        self.run = None;
    }
}

pub fn write_sync(w: &mut impl Write, round: u64) -> io::Result<()> {
    let mut b = [0u8; 9];
    b[0] = DATA_SYNC;
    b[1..].copy_from_slice(&round.to_le_bytes());
    w.write_all(&b)
}

pub fn write_eos(w: &mut impl Write, pages: u64) -> io::Result<()> {
    let mut b = [0u8; 9];
    b[0] = DATA_EOS;
    b[1..].copy_from_slice(&pages.to_le_bytes());
    w.write_all(&b)
}

/// One item read from a data connection.
pub enum DataItem {
    /// A verified batch payload and its record count.
    Pages { records: u32 },
    Sync(u64),
    Eos(u64),
}

/// Reads data frames into an internal buffer.
pub struct DataReader {
    pub payload: Vec<u8>,
}

impl Default for DataReader {
    fn default() -> Self {
        DataReader { payload: Vec::with_capacity(BATCH_BYTES + 2 * PAGE) }
    }
}

impl DataReader {
    pub fn next(&mut self, r: &mut impl Read) -> Result<DataItem, WireError> {
        let mut kind = [0u8; 1];
        r.read_exact(&mut kind)?;
        match kind[0] {
            DATA_PAGES => {
                let mut h = [0u8; 8];
                r.read_exact(&mut h)?;
                let len = u32::from_le_bytes(h[..4].try_into().unwrap()) as usize;
                let records = u32::from_le_bytes(h[4..].try_into().unwrap());
                if len > MAX_FRAME {
                    return Err(WireError::Corrupt(format!("page batch of {len} bytes")));
                }
                self.payload.resize(len, 0);
                r.read_exact(&mut self.payload)?;
                let mut sum = [0u8; 8];
                r.read_exact(&mut sum)?;
                if u64::from_le_bytes(sum) != xxhash_rust::xxh3::xxh3_64(&self.payload) {
                    return Err(WireError::Corrupt("page batch checksum mismatch".into()));
                }
                Ok(DataItem::Pages { records })
            }
            DATA_SYNC | DATA_EOS => {
                let mut v = [0u8; 8];
                r.read_exact(&mut v)?;
                let v = u64::from_le_bytes(v);
                Ok(if kind[0] == DATA_SYNC { DataItem::Sync(v) } else { DataItem::Eos(v) })
            }
            k => Err(WireError::Corrupt(format!("unknown data frame kind {k}"))),
        }
    }
}

/// A decoded page record, borrowing its bytes from the batch payload.
pub enum Record<'a> {
    Zero { pfn: u64, count: u64 },
    Raw { pfn: u64, data: &'a [u8] },
    /// `data.len() / 4096` raw pages from `pfn` on.
    RawRun { pfn: u64, data: &'a [u8] },
    Compressed { pfn: u64, kind: Compress, data: &'a [u8] },
}

/// Walks the records of a verified batch, checking every bound.
pub struct Records<'a> {
    p: &'a [u8],
    left: u32,
    total_pages: u64,
}

impl<'a> Records<'a> {
    pub fn new(payload: &'a [u8], records: u32, total_pages: u64) -> Self {
        Records { p: payload, left: records, total_pages }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if self.p.len() < n {
            return Err(WireError::Corrupt("page record runs past its batch".into()));
        }
        let (a, b) = self.p.split_at(n);
        self.p = b;
        Ok(a)
    }
    pub fn next_record(&mut self) -> Result<Option<Record<'a>>, WireError> {
        if self.left == 0 {
            if !self.p.is_empty() {
                return Err(WireError::Corrupt("trailing bytes after the last page record".into()));
            }
            return Ok(None);
        }
        self.left -= 1;
        let w = u64::from_le_bytes(self.take(8)?.try_into().unwrap());
        let pfn = w >> 4;
        let enc = Enc::from_u8((w & 0xf) as u8).ok_or_else(|| WireError::Corrupt(format!("unknown page encoding {}", w & 0xf)))?;
        let rec = match enc {
            Enc::Zero => Record::Zero { pfn, count: 1 },
            Enc::ZeroRun => {
                let c = u32::from_le_bytes(self.take(4)?.try_into().unwrap()) as u64;
                Record::Zero { pfn, count: c }
            }
            Enc::Raw => Record::Raw { pfn, data: self.take(PAGE)? },
            Enc::RawRun => {
                let c = u32::from_le_bytes(self.take(4)?.try_into().unwrap());
                if c == 0 || c > MAX_RAW_RUN {
                    return Err(WireError::Corrupt(format!("raw run of {c} pages")));
                }
                Record::RawRun { pfn, data: self.take(c as usize * PAGE)? }
            }
            Enc::Lz4 | Enc::Zstd => {
                let n = u16::from_le_bytes(self.take(2)?.try_into().unwrap()) as usize;
                if n > PAGE {
                    return Err(WireError::Corrupt(format!("compressed page of {n} bytes")));
                }
                let kind = if enc == Enc::Lz4 { Compress::Lz4 } else { Compress::Zstd(0) };
                Record::Compressed { pfn, kind, data: self.take(n)? }
            }
        };
        let (first, count) = match &rec {
            Record::Zero { pfn, count } => (*pfn, *count),
            Record::RawRun { pfn, data } => (*pfn, (data.len() / PAGE) as u64),
            Record::Raw { pfn, .. } | Record::Compressed { pfn, .. } => (*pfn, 1),
        };
        if count == 0 || first.checked_add(count).is_none_or(|e| e > self.total_pages) {
            return Err(WireError::Corrupt(format!("page {first} (+{count}) is outside guest RAM of {} pages", self.total_pages)));
        }
        Ok(Some(rec))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_roundtrip_and_damage() {
        let mut b = BatchWriter::new();
        b.zero(3);
        b.zero_run(10, 5);
        b.raw(7).fill(0xab);
        b.compressed(8, Enc::Lz4, &[1, 2, 3]);
        for p in [20, 21, 22, 30] {
            b.raw_in_run(p).fill(p as u8);
        }
        // A page copied in and taken back leaves no trace.
        b.raw_from(20, &[0u8; PAGE]);
        b.undo_raw();
        let bytes = b.seal().to_vec();
        let mut rd = DataReader::default();
        let DataItem::Pages { records } = rd.next(&mut bytes.as_slice()).unwrap() else { panic!() };
        let mut it = Records::new(&rd.payload, records, 100);
        let mut n = 0;
        while let Some(r) = it.next_record().unwrap() {
            if let Record::Raw { pfn, data } = r {
                assert_eq!(pfn, 7);
                assert!(data.iter().all(|&x| x == 0xab));
            }
            if let Record::RawRun { pfn, data } = r {
                let pages: Vec<u8> = data.chunks(PAGE).map(|c| c[0]).collect();
                assert!(pfn == 20 && pages == [20, 21, 22] || pfn == 30 && pages == [30], "run at {pfn}: {pages:?}");
            }
            n += 1;
        }
        assert_eq!(n, 6);
        // A page number beyond RAM is refused, never written.
        let mut it = Records::new(&rd.payload, records, 12);
        assert!((0..6).any(|_| it.next_record().is_err()));
        // A run reaching past RAM is refused too.
        let mut it = Records::new(&rd.payload, records, 22);
        assert!((0..6).any(|_| it.next_record().is_err()));
        // Any flipped byte is caught by the checksum.
        for i in [0usize, 3, 9, 20, bytes.len() - 1] {
            let mut bad = bytes.clone();
            bad[i] ^= 0x10;
            assert!(rd.next(&mut bad.as_slice()).is_err(), "flip at {i}");
        }
        // Preamble: wrong version and wrong magic are clear errors.
        let mut p = Vec::new();
        write_preamble(&mut p, VERSION + 1, ROLE_CONTROL).unwrap();
        assert!(matches!(read_preamble(&mut p.as_slice()), Err(WireError::Version { found }) if found == VERSION + 1));
        p[0] = b'X';
        assert!(matches!(read_preamble(&mut p.as_slice()), Err(WireError::Magic(_))));
    }
}
