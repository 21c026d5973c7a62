//! Control messages larger than one datagram (`fdmsg::MAX_MSG`) travel in a
//! memfd: the datagram says `Spilled { len, format }` and carries the memfd
//! as its last descriptor; the receiver reads `len` bytes from it. A
//! batched request over hundreds of QPs (their states, their traces, a
//! migrated device's objects) is then one round trip instead of one per
//! 64 KiB, and each round trip to a busy rnicd costs milliseconds.
//!
//! The messages a migration's switch waits for (QP states, write traces:
//! [`Format::for_request`], [`Format::for_reply`]) always travel this way,
//! in bincode rather than JSON: at 256 QPs their JSON is about 200 KB,
//! and writing and reading it took milliseconds of the VM's downtime on
//! each side; bincode is a fraction of the size and an order of magnitude
//! cheaper. Everything else stays JSON, readable in a trace.
//!
//! The reader takes a copy (`pread`) of a memfd only, never a mapping: a
//! sender that changes or shrinks the memfd afterwards harms nothing but
//! its own message, and no descriptor on a slow file system can block it.

use std::fs::File;
use std::io::Write as _;
use std::os::fd::{AsRawFd as _, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt as _;

use anyhow::{bail, Context as _};
use bincode::Options as _;
use serde::{de::DeserializeOwned, Deserialize, Serialize};

use super::{Reply, Request, Response};

/// How the bytes of a spilled message are encoded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Format {
    #[default]
    Json,
    Bincode,
}

impl Format {
    /// Bincode for the requests that carry QP states (a migration's
    /// destination loading them): always spilled, whatever their size.
    pub fn for_request(req: &Request) -> Option<Format> {
        matches!(req, Request::LoadQpStates { .. } | Request::RestoreQps { .. }).then_some(Format::Bincode)
    }

    /// Bincode for the replies that carry QP states or write traces (a
    /// migration's source suspending its QPs, fetching its last traces).
    pub fn for_reply(resp: &Response) -> Option<Format> {
        matches!(resp, Ok(Reply::QpStates(_) | Reply::Traces(_) | Reply::Suspended { .. })).then_some(Format::Bincode)
    }

    /// `msg` in this format.
    pub fn encode<T: Serialize>(self, msg: &T) -> anyhow::Result<Vec<u8>> {
        Ok(match self {
            Format::Json => serde_json::to_vec(msg)?,
            Format::Bincode => bincode_options().serialize(msg)?,
        })
    }

    /// A message in this format. The bytes are a client's: bad ones give
    /// an error, never a panic, and bincode reads at most MAX_SPILL.
    pub fn decode<T: DeserializeOwned>(self, bytes: &[u8]) -> anyhow::Result<T> {
        Ok(match self {
            Format::Json => serde_json::from_slice(bytes)?,
            Format::Bincode => bincode_options().deserialize(bytes)?,
        })
    }
}

/// Bincode with variable-length integers (small PSNs and counters take a
/// byte or two), no trailing bytes, and nothing longer than MAX_SPILL: a
/// length prefix in bad input is bounded by it, whatever it claims.
fn bincode_options() -> impl bincode::Options {
    bincode::DefaultOptions::new().with_limit(MAX_SPILL)
}

/// Largest spilled message either side reads (a bound on what a bad length
/// makes the receiver allocate; 4,096 QP states are about 6 MiB of JSON).
pub const MAX_SPILL: u64 = 64 << 20;

/// Whether `bytes` must be spilled rather than sent as one datagram.
pub fn needed(bytes: &[u8]) -> bool {
    bytes.len() > fdmsg::MAX_MSG
}

/// A new memfd holding `bytes`.
pub fn write(bytes: &[u8]) -> anyhow::Result<OwnedFd> {
    // SAFETY: plain syscall; the result is checked before it is owned.
    let fd = unsafe { libc::memfd_create(c"rnic-spill".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("memfd_create");
    }
    // SAFETY: a descriptor memfd_create just returned to us.
    let mut f = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    f.write_all(bytes).context("writing a spilled message")?;
    Ok(f.into())
}

/// The `len` bytes at the start of the spilled message `fd`.
pub fn read(fd: OwnedFd, len: u64) -> anyhow::Result<Vec<u8>> {
    if len > MAX_SPILL {
        bail!("spilled message of {len} bytes (at most {MAX_SPILL})");
    }
    // Only a memfd (or another shmem file, whose seals fcntl can read):
    // a file on FUSE or NFS could block the reader's event loop.
    // SAFETY: plain fcntl on a descriptor we own.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) } < 0 {
        bail!("a spilled message must be in a memfd");
    }
    let mut buf = vec![0u8; len as usize];
    File::from(fd).read_exact_at(&mut buf, 0).context("spilled message shorter than it says")?;
    Ok(buf)
}
