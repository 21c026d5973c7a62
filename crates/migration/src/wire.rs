//! The migration stream format (see [`VERSION`]). See docs/migration.md.
//!
//! Every TCP connection starts with a 16-byte preamble: magic, stream
//! version, role. The control connection then carries checksummed frames
//! (JSON messages and binary blobs); each data connection carries page
//! batches, round barriers and an end-of-stream count.

use crate::compress::Compress;
use serde::{Deserialize, Serialize};
use std::io::{self, Read, Write};

pub const MAGIC: [u8; 8] = *b"TRNSTMIG";
/// 4: the control connection's spares (`ROLE_CONTROL_SPARE`, `Hello::spare_controls`).
/// 5: `ReadCap`, a cap changed during an rdma postcopy.
pub const VERSION: u32 = 5;
pub const ROLE_CONTROL: u8 = 0;
pub const ROLE_DATA: u8 = 1;
/// Postcopy: page requests (destination -> source) and their answers, on a
/// connection of their own so they never wait behind bulk pages.
pub const ROLE_URGENT: u8 = 2;
/// With several links: a control connection on a link after the first,
/// waiting to carry the control stream if the one before fails
/// (`crate::control_conn`).
pub const ROLE_CONTROL_SPARE: u8 = 3;
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
    #[error("the peer speaks stream version {found}; this build speaks version {VERSION}")]
    PeerVersion { found: u32 },
    #[error("corrupted stream: {0}")]
    Corrupt(String),
    #[error("connection: {0}")]
    Io(#[from] io::Error),
}

/// Longest silence accepted on a data connection during a migration.
pub const DATA_IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// A dead peer or a cut link must show up as an error within seconds, not
/// after TCP's 15 minutes: keepalives on idle connections (2 s, then every
/// second, 3 misses) and a 20 s limit on unacknowledged data (long enough
/// for a busy receiver's zero window). Postcopy relies on it to pause and
/// wait for recovery.
/// Errors only cost the early detection.
pub fn tune_socket(s: &std::net::TcpStream) {
    use nix::sys::socket::{setsockopt, sockopt};
    let results = [
        setsockopt(s, sockopt::KeepAlive, &true),
        setsockopt(s, sockopt::TcpKeepIdle, &2),
        setsockopt(s, sockopt::TcpKeepInterval, &1),
        setsockopt(s, sockopt::TcpKeepCount, &3),
        setsockopt(s, sockopt::TcpUserTimeout, &20_000),
    ];
    if let Some(e) = results.into_iter().find_map(Result::err) {
        tracing::debug!("keepalive options not set: {e}");
    }
}

/// A TCP connection to the destination (control or data): without
/// Nagle, tuned to find a dead peer within seconds ([`tune_socket`]), and
/// registered with the migration so that a cancel shuts it down.
pub(crate) fn connect(addr: &str, ctl: &crate::stats::Control) -> anyhow::Result<std::net::TcpStream> {
    use anyhow::Context as _;
    use std::net::ToSocketAddrs;
    let sa = addr
        .to_socket_addrs()
        .with_context(|| format!("resolving {addr}"))?
        .next()
        .ok_or_else(|| anyhow::anyhow!("{addr} resolves to nothing"))?;
    let s =
        std::net::TcpStream::connect_timeout(&sa, std::time::Duration::from_secs(10)).with_context(|| format!("connecting to {addr}"))?;
    s.set_nodelay(true)?;
    tune_socket(&s);
    ctl.register(&s);
    Ok(s)
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
    Hello {
        session: u64,
        shape: String,
        ram_bytes: u64,
        page_size: u64,
        channels: u32,
        compress: String,
        mode: String,
        /// How pages travel: "tcp" (data connections; also when absent)
        /// or "rdma" (queue pairs, set up by `rdma_connect`).
        #[serde(default, skip_serializing_if = "String::is_empty")]
        transport: String,
        /// Control connections the source opens after the welcome, one
        /// per link after the first (`crate::control_conn`).
        #[serde(default)]
        spare_controls: u32,
        /// The source sends the devices' early sections (`EarlyState`) to
        /// a destination that answers `WelcomeEarlyState`; a destination
        /// without them ignores this field and answers `Welcome`.
        #[serde(default)]
        early_state: bool,
    },
    /// Destination accepts; data connections may follow.
    Welcome,
    /// Destination accepts, as `Welcome`, and builds the devices' early
    /// sections (the answer to a `Hello` with `early_state` only).
    WelcomeEarlyState,
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
    /// Source -> destination, precopy and hybrid, before the first round:
    /// the devices' early sections (a `StateSet` blob of `state_bytes`
    /// follows), for the destination to build while RAM moves.
    EarlyState { state_bytes: u64 },
    /// Destination -> source: the early device state is built (or was left
    /// to the switch); the source pauses the VM only after this, so that
    /// the building is not downtime.
    EarlyBuilt,
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
    Switchover {
        state_bytes: u64,
        source_paused_unix_ns: u64,
        dirty_ranges: bool,
        /// The devices' pages the destination lacks that the source sends
        /// at once, as page batches on the first urgent connection ahead
        /// of any answer there, as (first, count): the destination has
        /// them before it reports the VM loaded (`postcopy::device`).
        /// Absent: none (a source that does not send them; the
        /// destination asks for them itself).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        device_pages: Vec<(u64, u64)>,
    },
    /// Source -> destination, several links: data channel `index` was lost
    /// with its link; the destination stops reading it, and its pages not
    /// confirmed by a `round_done` come again on the other channels.
    ChannelLost { index: u32 },
    /// Destination -> source: every page is in; the source may let go.
    /// Source -> destination after welcome, rdma transport: the GID of the
    /// source's rnicd and one RC queue pair (number, first PSN) per channel.
    RdmaConnect {
        gid: String,
        qps: Vec<(u32, u32)>,
        /// Several links: the GID of each queue pair (its link's local
        /// address); absent, all are `gid`.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        gids: Vec<String>,
    },
    /// Destination -> source: its queue pairs, connected to the source's
    /// and with receives posted, and the key of its guest RAM, registered
    /// with its rnicd at I/O address 0 (guest physical addresses).
    RdmaAccept {
        gid: String,
        qps: Vec<(u32, u32)>,
        rkey: u32,
        /// Several links: the GID of each queue pair and the key of guest
        /// RAM in its link's rnicd namespace; absent, `gid` and `rkey`.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        gids: Vec<String>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        rkeys: Vec<u32>,
    },
    Complete {
        faults: u64,
        fault_p50_us: Option<f64>,
        fault_p99_us: Option<f64>,
        fault_max_us: Option<f64>,
        cpu_s: f64,
        ram_clients: u32,
        /// Pages the destination read itself (rdma transport), pushed and
        /// for faults: the source's CPU never saw them.
        #[serde(default)]
        pages_read: Option<(u64, u64)>,
        /// What missing pages cost each process that maps guest RAM there
        /// (the vmm, each RAM client).
        #[serde(default)]
        fault_waits: Vec<crate::stats::FaultWaits>,
    },
    /// Source -> destination, postcopy and hybrid over the rdma transport:
    /// the GID of the source's rnicd, the queue pairs the destination reads
    /// pages through (per link, one for faults and one for the background),
    /// and the key of the source's guest RAM, registered for
    /// remote reads at I/O address 0 (guest physical addresses).
    /// Several links: [`crate::rdma::READ_QPS`] queue pairs per link, link
    /// after link, each with its GID and key in `gids` and `rkeys` (absent,
    /// all are `gid` and `rkey`).
    RdmaReadOffer {
        gid: String,
        qpns: Vec<u32>,
        rkey: u32,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        gids: Vec<String>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        rkeys: Vec<u32>,
    },
    /// Destination -> source: its GID and queue pairs, connected to the
    /// offered ones (several links: the GID of each in `gids`).
    RdmaReadAccept {
        gid: String,
        qpns: Vec<u32>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        gids: Vec<String>,
    },
    /// Source -> destination after the switch, rdma transport: the pages
    /// the destination lacks are its to read. Two blobs follow, each of
    /// (first, count) u64 pairs: pages with data to read, and pages known
    /// to be zero (memfd holes on the source, nothing to read). The
    /// background reads keep to `max_bandwidth` (bytes/s, 0: no cap), the
    /// source's cap; reads for faults do not wait for it.
    PullPlan { max_bandwidth: u64 },
    /// Source -> destination, postcopy over rdma: `max_bandwidth` changed
    /// (`migrate-set-parameters`); the background reads keep to it from now.
    ReadCap { max_bandwidth: u64 },
    /// Destination -> source, postcopy over tcp with several links: the
    /// answer to `channel_lost`, once the lost channel's reader was told to
    /// stop. A blob follows: the destination's bitmap of the pages it holds
    /// (as in a recovery); the source pushes again every page it lacks.
    PagesHeld,
}

const FRAME_MSG: u8 = 1;
const FRAME_BLOB: u8 = 2;

fn write_frame(w: &mut impl Write, kind: u8, payload: &[u8]) -> io::Result<()> {
    // One write per frame: small frames leave in one segment.
    let mut buf = Vec::with_capacity(payload.len() + 13);
    buf.push(kind);
    buf.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    buf.extend_from_slice(payload);
    buf.extend_from_slice(&xxh3(payload).to_le_bytes());
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
    if u64::from_le_bytes(sum) != xxh3(&payload) {
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

/// The destination's answer to a hello. A destination that refuses the
/// stream version answers with its own preamble instead of a frame; frame
/// kinds are small numbers, so the magic's first byte tells them apart.
pub fn recv_answer(r: &mut impl Read) -> Result<Msg, WireError> {
    let mut first = [0u8; 1];
    r.read_exact(&mut first)?;
    let mut whole = first.as_slice().chain(&mut *r);
    if first[0] != MAGIC[0] {
        return recv_msg(&mut whole);
    }
    match read_preamble(&mut whole) {
        Err(WireError::Version { found }) => Err(WireError::PeerVersion { found }),
        Err(e) => Err(e),
        Ok(_) => Err(WireError::Corrupt("the destination answered with a preamble of this very version".into())),
    }
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
    /// All-zero page.
    Zero = 0,
    // 1 was a single raw page with its bytes inline (version 2).
    /// u16 length + u64 page hash; an LZ4 block in the data.
    Lz4 = 2,
    /// u16 length + u64 page hash; a zstd frame in the data.
    Zstd = 3,
    /// u32 count: `count` zero pages from this one on.
    ZeroRun = 4,
    /// u32 count, then `count` u64 page hashes; `count` pages of 4096 raw
    /// bytes from this one on in the data.
    RawRun = 5,
}

impl Enc {
    fn from_u8(v: u8) -> Option<Enc> {
        Some(match v {
            0 => Enc::Zero,
            2 => Enc::Lz4,
            3 => Enc::Zstd,
            4 => Enc::ZeroRun,
            5 => Enc::RawRun,
            _ => return None,
        })
    }
}

/// xxh3 of `b`, with the widest SIMD this CPU has.
pub fn xxh3(b: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(b)
}

/// The [`xxh3`] of an all-zero page: a sender hashes each page first and
/// checks for zeros only when the hash says so (one pass over the page).
pub fn zero_page_xxh3() -> u64 {
    static H: std::sync::LazyLock<u64> = std::sync::LazyLock::new(|| xxh3(&[0u8; PAGE]));
    *H
}

/// The hash a batch table carries for a page: its [`xxh3`] mixed with the
/// page number, so that bytes that land on another page never pass.
pub fn page_hash(pfn: u64, page: &[u8]) -> u64 {
    page_hash_of(pfn, xxh3(page))
}

/// [`page_hash`] from the page's [`xxh3`].
pub fn page_hash_of(pfn: u64, xxh3: u64) -> u64 {
    xxh3 ^ pfn.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// Longest raw run: 256 KiB, one batch.
pub const MAX_RAW_RUN: u32 = 64;

pub const BATCH_BYTES: usize = 256 << 10;

/// `[kind][u32 table bytes][u32 records][u32 data bytes]`
const BATCH_HEAD: usize = 13;

/// One piece of a batch's data section: guest RAM, or bytes of the
/// writer's own buffer (compressed pages, private copies).
enum Piece {
    Ram(*const u8, usize),
    Own(usize, usize),
}

/// Builds one page batch:
/// `[kind][u32 table bytes][u32 records][u32 data bytes][table][u64 xxh3 of
/// the table][data]`. The table holds the records (page number and
/// encoding, run or compressed length, and the [`page_hash`] of each page);
/// the data holds the raw and compressed bytes in table order.
///
/// Raw pages are not copied: they go from guest RAM to the socket in one
/// vectored write (the kernel's copy is the only one). A page the guest
/// writes meanwhile may leave with other bytes than its hash: the
/// destination then holds it as suspect until it comes again, which it
/// does because it is dirty (see `dest`). The table itself is built here
/// and checked whole: a damaged table is never used.
pub struct BatchWriter<'a> {
    table: Vec<u8>,
    records: u32,
    pub pages: u64,
    pieces: Vec<Piece>,
    data_len: usize,
    own: Vec<u8>,
    /// The open raw run: where its count is in the table and the page that
    /// would extend it.
    run: Option<(usize, u64)>,
    /// Some raw page is a private copy in `own` (see [`split_ram`](Self::split_ram)).
    copied_raw: bool,
    _ram: std::marker::PhantomData<&'a [u8]>,
}

impl Default for BatchWriter<'_> {
    fn default() -> Self {
        Self::new()
    }
}

impl<'a> BatchWriter<'a> {
    pub fn new() -> Self {
        let mut table = Vec::with_capacity(4096);
        table.extend_from_slice(&[0u8; BATCH_HEAD]);
        BatchWriter {
            table,
            records: 0,
            pages: 0,
            pieces: Vec::new(),
            data_len: 0,
            own: Vec::new(),
            run: None,
            copied_raw: false,
            _ram: std::marker::PhantomData,
        }
    }
    fn head(&mut self, pfn: u64, enc: Enc) {
        self.run = None;
        self.table.extend_from_slice(&((pfn << 4) | enc as u64).to_le_bytes());
        self.records += 1;
    }
    pub fn zero(&mut self, pfn: u64) {
        self.head(pfn, Enc::Zero);
        self.pages += 1;
    }
    pub fn zero_run(&mut self, pfn: u64, count: u32) {
        self.head(pfn, Enc::ZeroRun);
        self.table.extend_from_slice(&count.to_le_bytes());
        self.pages += count as u64;
    }
    /// Raw page `pfn`, its hash taken now and its bytes sent from `page`
    /// when the batch is written (the mapping must outlive the batch).
    pub fn raw(&mut self, pfn: u64, page: &'a [u8]) {
        self.raw_hashed(pfn, page, xxh3(&page[..PAGE]));
    }
    /// [`raw`](Self::raw) with the page's [`xxh3`] taken by the caller.
    pub fn raw_hashed(&mut self, pfn: u64, page: &'a [u8], xxh3: u64) {
        self.raw_entry(pfn, page_hash_of(pfn, xxh3));
        match self.pieces.last_mut() {
            // Next to the last page in memory: one iovec for both.
            Some(Piece::Ram(at, len)) if at.wrapping_add(*len) == page.as_ptr() => *len += PAGE,
            _ => self.pieces.push(Piece::Ram(page.as_ptr(), PAGE)),
        }
        self.data_len += PAGE;
    }
    /// Raw page `pfn` from a private copy (copied into the batch).
    pub fn raw_copy(&mut self, pfn: u64, page: &[u8]) {
        self.raw_entry(pfn, page_hash(pfn, &page[..PAGE]));
        self.push_own(&page[..PAGE]);
        self.copied_raw = true;
    }
    /// The table side of a raw page: a new run, or one more page of the
    /// open run (which is the table's last record, so its hashes end it).
    fn raw_entry(&mut self, pfn: u64, hash: u64) {
        match self.run {
            Some((at, next)) if next == pfn => {
                let n = u32::from_le_bytes(self.table[at..at + 4].try_into().unwrap()) + 1;
                self.table[at..at + 4].copy_from_slice(&n.to_le_bytes());
                self.run = (n < MAX_RAW_RUN).then_some((at, pfn + 1));
            }
            _ => {
                self.head(pfn, Enc::RawRun);
                let at = self.table.len();
                self.table.extend_from_slice(&1u32.to_le_bytes());
                self.run = Some((at, pfn + 1));
            }
        }
        self.table.extend_from_slice(&hash.to_le_bytes());
        self.pages += 1;
    }
    fn push_own(&mut self, b: &[u8]) {
        let at = self.own.len();
        self.own.extend_from_slice(b);
        match self.pieces.last_mut() {
            Some(Piece::Own(o, len)) if *o + *len == at => *len += b.len(),
            _ => self.pieces.push(Piece::Own(at, b.len())),
        }
        self.data_len += b.len();
    }
    /// A compressed page; `hash` is the [`page_hash`] of its bytes.
    pub fn compressed(&mut self, pfn: u64, enc: Enc, data: &[u8], hash: u64) {
        self.head(pfn, enc);
        self.pages += 1;
        self.table.extend_from_slice(&(data.len() as u16).to_le_bytes());
        self.table.extend_from_slice(&hash.to_le_bytes());
        self.push_own(data);
    }
    pub fn is_full(&self) -> bool {
        self.data_len + self.table.len() >= BATCH_BYTES
    }
    pub fn is_empty(&self) -> bool {
        self.records == 0
    }
    /// Bytes the batch takes on the wire.
    pub fn wire_len(&self) -> usize {
        self.table.len() + 8 + self.data_len
    }
    /// Fill in the head and append the table's checksum.
    fn seal(&mut self) {
        let table_len = (self.table.len() - BATCH_HEAD) as u32;
        self.table[0] = DATA_PAGES;
        self.table[1..5].copy_from_slice(&table_len.to_le_bytes());
        self.table[5..9].copy_from_slice(&self.records.to_le_bytes());
        self.table[9..13].copy_from_slice(&(self.data_len as u32).to_le_bytes());
        let sum = xxh3(&self.table[BATCH_HEAD..]);
        self.table.extend_from_slice(&sum.to_le_bytes());
    }
    /// Write the batch to `w` (vectored: guest pages straight from RAM)
    /// and start a new one; returns the bytes written.
    pub fn write_to(&mut self, w: &mut impl Write) -> io::Result<usize> {
        let n = self.wire_len();
        self.seal();
        let mut iov: Vec<io::IoSlice> = Vec::with_capacity(self.pieces.len() + 1);
        iov.push(io::IoSlice::new(&self.table));
        for p in &self.pieces {
            iov.push(io::IoSlice::new(match *p {
                // SAFETY: pages handed to `raw`, in a mapping that outlives
                // the batch ('a).
                Piece::Ram(at, len) => unsafe { std::slice::from_raw_parts(at, len) },
                Piece::Own(at, len) => &self.own[at..at + len],
            }));
        }
        let r = write_all_vectored(w, &mut iov);
        self.reset();
        r.map(|_| n)
    }
    /// End the batch for a transport that moves the raw pages itself (RDMA
    /// WRITEs from guest RAM into the peer's guest RAM): `ram` gets each
    /// run of raw pages (its address in guest RAM and length, in record
    /// order), and `out` the frame without their bytes: head, table,
    /// checksum, then the compressed bytes. The head still counts all the
    /// data, so the reader finds every record's offset. Refused for a
    /// batch holding private copies of raw pages ([`raw_copy`](Self::raw_copy)),
    /// which the reader could not tell from the rest. Starts a new batch;
    /// returns (bytes of `out` used, bytes the batch counts on the wire).
    pub fn split_ram(&mut self, out: &mut [u8], mut ram: impl FnMut(*const u8, usize)) -> io::Result<(usize, usize)> {
        let n = self.wire_len();
        if self.copied_raw {
            self.reset();
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "a batch with copied raw pages cannot leave its pages in RAM"));
        }
        self.seal();
        let own: usize = self.pieces.iter().map(|p| if let Piece::Own(_, l) = p { *l } else { 0 }).sum();
        let len = self.table.len() + own;
        if len > out.len() {
            self.reset();
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("a batch frame of {len} bytes exceeds the {}-byte buffer", out.len()),
            ));
        }
        out[..self.table.len()].copy_from_slice(&self.table);
        let mut at = self.table.len();
        for p in &self.pieces {
            match *p {
                Piece::Ram(ptr, l) => ram(ptr, l),
                Piece::Own(o, l) => {
                    out[at..at + l].copy_from_slice(&self.own[o..o + l]);
                    at += l;
                }
            }
        }
        self.reset();
        Ok((len, n))
    }
    pub fn reset(&mut self) {
        self.copied_raw = false;
        self.table.truncate(BATCH_HEAD);
        self.records = 0;
        self.pages = 0;
        self.pieces.clear();
        self.data_len = 0;
        self.own.clear();
        self.run = None;
    }
}

fn write_all_vectored(w: &mut impl Write, mut bufs: &mut [io::IoSlice<'_>]) -> io::Result<()> {
    while !bufs.is_empty() {
        match w.write_vectored(bufs) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => io::IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
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
    /// A batch: its table is read and verified; `data_len` bytes of data
    /// follow (see [`DataReader::read_data`]).
    Pages {
        records: u32,
        data_len: usize,
    },
    Sync(u64),
    Eos(u64),
}

/// Reads data frames: a batch's table into `table`, its data into `data`
/// (or, for a caller that places the bytes itself, not at all).
#[derive(Default)]
pub struct DataReader {
    table: Vec<u8>,
    records: u32,
    pub data: Vec<u8>,
}

impl DataReader {
    /// The next item; of a batch only the table is read.
    pub fn next_head(&mut self, r: &mut impl Read) -> Result<DataItem, WireError> {
        let mut kind = [0u8; 1];
        r.read_exact(&mut kind)?;
        match kind[0] {
            DATA_PAGES => {
                let mut h = [0u8; BATCH_HEAD - 1];
                r.read_exact(&mut h)?;
                let table_len = u32::from_le_bytes(h[..4].try_into().unwrap()) as usize;
                let records = u32::from_le_bytes(h[4..8].try_into().unwrap());
                let data_len = u32::from_le_bytes(h[8..].try_into().unwrap()) as usize;
                if table_len > MAX_FRAME || data_len > MAX_FRAME {
                    return Err(WireError::Corrupt(format!("page batch of {table_len} + {data_len} bytes")));
                }
                self.table.resize(table_len, 0);
                r.read_exact(&mut self.table)?;
                let mut sum = [0u8; 8];
                r.read_exact(&mut sum)?;
                if u64::from_le_bytes(sum) != xxh3(&self.table) {
                    return Err(WireError::Corrupt("page batch table checksum mismatch".into()));
                }
                self.records = records;
                self.data.clear();
                Ok(DataItem::Pages { records, data_len })
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
    /// The data of the batch whose table was just read, into `data`.
    pub fn read_data(&mut self, r: &mut impl Read, data_len: usize) -> Result<(), WireError> {
        self.data.resize(data_len, 0);
        r.read_exact(&mut self.data)?;
        Ok(())
    }
    /// The next item, a batch with its data.
    pub fn next(&mut self, r: &mut impl Read) -> Result<DataItem, WireError> {
        let item = self.next_head(r)?;
        if let DataItem::Pages { data_len, .. } = item {
            self.read_data(r, data_len)?;
        }
        Ok(item)
    }
    /// The records of the last batch, without their data.
    pub fn entries(&self, total_pages: u64) -> Table<'_> {
        Table { p: &self.table, left: self.records, total_pages }
    }
    /// The records of the last batch with the data read by `read_data`.
    pub fn records(&self, total_pages: u64) -> Records<'_> {
        self.records_in(&self.data, total_pages)
    }
    /// The records of the last batch with its data in `data` (laid out as
    /// on the wire).
    pub fn records_in<'a>(&'a self, data: &'a [u8], total_pages: u64) -> Records<'a> {
        Records { t: self.entries(total_pages), data }
    }
    /// Bytes the last batch took on the wire.
    pub fn batch_wire_len(&self, data_len: usize) -> u64 {
        (BATCH_HEAD + self.table.len() + 8 + data_len) as u64
    }
}

/// A record of a batch table.
pub enum Entry<'a> {
    Zero {
        pfn: u64,
        count: u64,
    },
    /// `count` raw pages from `pfn` on; `hashes` holds their page hashes.
    Raw {
        pfn: u64,
        count: u64,
        hashes: &'a [u8],
    },
    Compressed {
        pfn: u64,
        kind: Compress,
        len: usize,
        hash: u64,
    },
}

impl Entry<'_> {
    /// Bytes of this record in the batch's data.
    pub fn data_len(&self) -> usize {
        match self {
            Entry::Zero { .. } => 0,
            Entry::Raw { count, .. } => *count as usize * PAGE,
            Entry::Compressed { len, .. } => *len,
        }
    }
}

/// The `i`th page hash of a raw run.
pub fn run_hash(hashes: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(hashes[i * 8..i * 8 + 8].try_into().unwrap())
}

/// Walks the records of a verified batch table, checking every bound.
pub struct Table<'a> {
    p: &'a [u8],
    left: u32,
    total_pages: u64,
}

impl<'a> Table<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if self.p.len() < n {
            return Err(WireError::Corrupt("page record runs past its batch table".into()));
        }
        let (a, b) = self.p.split_at(n);
        self.p = b;
        Ok(a)
    }
    pub fn next_entry(&mut self) -> Result<Option<Entry<'a>>, WireError> {
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
        let e = match enc {
            Enc::Zero => Entry::Zero { pfn, count: 1 },
            Enc::ZeroRun => Entry::Zero { pfn, count: u32::from_le_bytes(self.take(4)?.try_into().unwrap()) as u64 },
            Enc::RawRun => {
                let c = u32::from_le_bytes(self.take(4)?.try_into().unwrap());
                if c == 0 || c > MAX_RAW_RUN {
                    return Err(WireError::Corrupt(format!("raw run of {c} pages")));
                }
                Entry::Raw { pfn, count: c as u64, hashes: self.take(c as usize * 8)? }
            }
            Enc::Lz4 | Enc::Zstd => {
                let len = u16::from_le_bytes(self.take(2)?.try_into().unwrap()) as usize;
                if len > PAGE {
                    return Err(WireError::Corrupt(format!("compressed page of {len} bytes")));
                }
                let hash = u64::from_le_bytes(self.take(8)?.try_into().unwrap());
                let kind = if enc == Enc::Lz4 { Compress::Lz4 } else { Compress::Zstd(0) };
                Entry::Compressed { pfn, kind, len, hash }
            }
        };
        let (first, count) = match &e {
            Entry::Zero { pfn, count } | Entry::Raw { pfn, count, .. } => (*pfn, *count),
            Entry::Compressed { pfn, .. } => (*pfn, 1),
        };
        if count == 0 || first.checked_add(count).is_none_or(|e| e > self.total_pages) {
            return Err(WireError::Corrupt(format!("page {first} (+{count}) is outside guest RAM of {} pages", self.total_pages)));
        }
        Ok(Some(e))
    }
}

/// A decoded page record, borrowing its bytes from the batch data.
pub enum Record<'a> {
    Zero {
        pfn: u64,
        count: u64,
    },
    /// `data.len() / 4096` raw pages from `pfn` on, with their hashes.
    Raw {
        pfn: u64,
        data: &'a [u8],
        hashes: &'a [u8],
    },
    Compressed {
        pfn: u64,
        kind: Compress,
        data: &'a [u8],
        hash: u64,
    },
}

/// Walks the records of a batch with its data, checking every bound.
pub struct Records<'a> {
    t: Table<'a>,
    data: &'a [u8],
}

impl<'a> Records<'a> {
    pub fn next_record(&mut self) -> Result<Option<Record<'a>>, WireError> {
        let Some(e) = self.t.next_entry()? else {
            if !self.data.is_empty() {
                return Err(WireError::Corrupt("trailing bytes after the last page's data".into()));
            }
            return Ok(None);
        };
        let n = e.data_len();
        if self.data.len() < n {
            return Err(WireError::Corrupt("page data runs past its batch".into()));
        }
        let (d, rest) = self.data.split_at(n);
        self.data = rest;
        Ok(Some(match e {
            Entry::Zero { pfn, count } => Record::Zero { pfn, count },
            Entry::Raw { pfn, hashes, .. } => Record::Raw { pfn, data: d, hashes },
            Entry::Compressed { pfn, kind, hash, .. } => Record::Compressed { pfn, kind, data: d, hash },
        }))
    }
}

/// Check page `pfn`'s bytes against its hash.
pub fn check_page(pfn: u64, page: &[u8], hash: u64) -> Result<(), WireError> {
    match page_hash(pfn, page) == hash {
        true => Ok(()),
        false => Err(WireError::Corrupt(format!("page {pfn} checksum mismatch"))),
    }
}

/// Check raw pages against their hashes (`data` holds whole pages).
pub fn check_run(pfn: u64, data: &[u8], hashes: &[u8]) -> Result<(), WireError> {
    data.chunks(PAGE).enumerate().try_for_each(|(i, page)| check_page(pfn + i as u64, page, run_hash(hashes, i)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Streams, page digests and RAM clients all carry these values: a hash
    /// implementation that changed them would need a new stream version.
    #[test]
    fn xxh3_keeps_its_reference_values() {
        // XXH3_64bits("") of the reference implementation.
        assert_eq!(xxh3(b""), 0x2d06_8005_38d3_94c2);
        assert_eq!(xxh3(&[0u8; PAGE]), 0x93d7_6fe1_48c6_89ba);
        assert_eq!(zero_page_xxh3(), 0x93d7_6fe1_48c6_89ba);
        let page: Vec<u8> = (0..PAGE as u32).map(|i| (i * 7 % 251) as u8).collect();
        assert_eq!(xxh3(&page), 0x5d90_27c8_4d5f_33f7);
    }

    #[test]
    fn batch_roundtrip_and_damage() {
        let ram: Vec<u8> = (0..40 * PAGE).map(|i| (i / PAGE) as u8).collect();
        let page = |p: usize| &ram[p * PAGE..(p + 1) * PAGE];
        let mut b = BatchWriter::new();
        b.zero(3);
        b.zero_run(10, 5);
        b.raw(7, page(7));
        b.compressed(8, Enc::Lz4, &[1, 2, 3], 0x1234);
        for p in [20, 21, 22, 30] {
            b.raw(p, page(p as usize));
        }
        b.raw_copy(31, page(31));
        let mut bytes = Vec::new();
        let n = b.write_to(&mut bytes).unwrap();
        assert_eq!(n, bytes.len());
        assert!(b.is_empty(), "written batches start over");
        let mut rd = DataReader::default();
        assert!(matches!(rd.next(&mut bytes.as_slice()).unwrap(), DataItem::Pages { records: 6, .. }));
        let mut it = rd.records(100);
        let mut runs = Vec::new();
        while let Some(r) = it.next_record().unwrap() {
            match r {
                Record::Raw { pfn, data, hashes } => {
                    check_run(pfn, data, hashes).unwrap();
                    runs.push((pfn, data.chunks(PAGE).map(|c| c[0]).collect::<Vec<u8>>()));
                }
                Record::Compressed { pfn, data, hash, .. } => assert_eq!((pfn, data, hash), (8, &[1u8, 2, 3][..], 0x1234)),
                Record::Zero { pfn, count } => assert!((pfn, count) == (3, 1) || (pfn, count) == (10, 5)),
            }
        }
        assert_eq!(runs, vec![(7, vec![7]), (20, vec![20, 21, 22]), (30, vec![30, 31])]);
        // A page number beyond RAM is refused, never written.
        let mut it = rd.records(12);
        assert!((0..6).any(|_| it.next_record().is_err()));
        // A run reaching past RAM is refused too.
        let mut it = rd.records(22);
        assert!((0..6).any(|_| it.next_record().is_err()));
        // A flipped byte in the header or table is caught by the table
        // checksum; one in the data by the page hash.
        let table_end = bytes.len() - (6 * PAGE + 3);
        for i in [0usize, 3, 9, 20, table_end - 1] {
            let mut bad = bytes.clone();
            bad[i] ^= 0x10;
            assert!(rd.next(&mut bad.as_slice()).is_err(), "flip at {i}");
        }
        let mut bad = bytes.clone();
        *bad.last_mut().unwrap() ^= 0x10;
        rd.next(&mut bad.as_slice()).unwrap();
        let mut it = rd.records(100);
        let mut caught = false;
        while let Some(r) = it.next_record().unwrap() {
            if let Record::Raw { pfn, data, hashes } = r {
                caught |= check_run(pfn, data, hashes).is_err();
            }
        }
        assert!(caught, "a damaged page passed its hash");
        // Preamble: wrong version and wrong magic are clear errors.
        let mut p = Vec::new();
        write_preamble(&mut p, VERSION + 1, ROLE_CONTROL).unwrap();
        assert!(matches!(read_preamble(&mut p.as_slice()), Err(WireError::Version { found }) if found == VERSION + 1));
        // A destination's answer: a message, or its preamble when it
        // refuses our version.
        assert!(matches!(recv_answer(&mut p.as_slice()), Err(WireError::PeerVersion { found }) if found == VERSION + 1));
        let mut m = Vec::new();
        send_msg(&mut m, &Msg::Welcome).unwrap();
        assert!(matches!(recv_answer(&mut m.as_slice()), Ok(Msg::Welcome)));
        p[0] = b'X';
        assert!(matches!(read_preamble(&mut p.as_slice()), Err(WireError::Magic(_))));
    }
}
