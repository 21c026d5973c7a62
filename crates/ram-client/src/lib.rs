//! RAM clients: processes other than the vmm that map guest RAM (rnicd, a
//! vhost-user backend) and so must take part in postcopy, or they would
//! read holes as zeros. The protocol follows DPDK vhost-user's postcopy
//! (advise / listen / end), over a unix SOCK_SEQPACKET socket of the vmm
//! (its `--ram-socket`, or one end of a socket pair the vmm hands out):
//!
//! | from | message | with fd | meaning |
//! |---|---|---|---|
//! | client | `{"op":"hello","name":N}` | – | join (not sent on a socket pair: the vmm named the client) |
//! | vmm | `{"op":"welcome","ram_bytes":B}` | guest RAM memfd | map it if you want |
//! | vmm | `{"op":"postcopy-advise"}` | – | postcopy starts: register your mappings |
//! | client | `{"op":"postcopy-listen","ranges":[[addr,offset,len],..]}` | a userfaultfd | registered (missing and minor faults, its page table entries dropped first) |
//! | client | `{"op":"error","reason":R}` | – | could not; the switchover is refused |
//! | vmm | `{"op":"postcopy-end"}` | – | every page is in: unregister |
//! | client | `{"op":"postcopy-ended"}` | – | done |
//!
//! The vmm reads the client's faults from that uffd and wakes them once the
//! page is in; the client's threads simply block on the access meanwhile.
//! A client that disconnects leaves; one that is connected but silent when
//! postcopy starts makes the switchover fail (the VM stays on the source).
//!
//! This crate is the client's side (and the two memory operations both
//! sides do); the vmm's side is `migration::postcopy::clients`. It is small
//! so that a client such as rnicd need not depend on the migration engine.

use anyhow::{anyhow, bail, Context, Result};
use nix::sys::socket::{self, SockFlag, SockType, UnixAddr};
use serde_json::{json, Value};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::path::Path;
use std::time::Duration;
use userfaultfd::{RegisterMode, Uffd, UffdBuilder};

/// How long a side may take to answer a message that expects one.
pub const TIMEOUT: Duration = Duration::from_secs(5);

/// Sends one protocol message with `pass` beside it.
pub fn send(fd: BorrowedFd, v: &Value, pass: Option<RawFd>) -> Result<()> {
    fdmsg::send(fd, v, pass.as_slice())?;
    Ok(())
}

/// One message and the fd passed with it, if any. `None` at end of stream.
pub fn recv(fd: BorrowedFd) -> Result<Option<(Value, Option<OwnedFd>)>> {
    let msg = fdmsg::recv_json::<Value>(fd).map_err(|e| anyhow!("bad RAM client message: {e}"))?;
    Ok(msg.map(|(v, fds)| (v, fds.into_iter().next())))
}

/// Bounds how long a receive on `fd` waits (`None`: for ever).
pub fn set_timeout(fd: RawFd, d: Option<Duration>) {
    let tv = match d {
        Some(d) => libc::timeval { tv_sec: d.as_secs() as _, tv_usec: d.subsec_micros() as _ },
        None => libc::timeval { tv_sec: 0, tv_usec: 0 },
    };
    // SAFETY: valid timeval for SO_RCVTIMEO.
    unsafe {
        libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_RCVTIMEO, &tv as *const _ as *const libc::c_void, std::mem::size_of_val(&tv) as u32)
    };
}

/// Registers `len` bytes at `addr` (a shared mapping of guest RAM) with
/// `uffd` for missing and minor faults.
pub fn register_ram(uffd: &Uffd, addr: *mut libc::c_void, len: usize) -> std::io::Result<()> {
    uffd.register_with_mode(addr, len, RegisterMode::MISSING | RegisterMode::MINOR)
        .map(|_| ())
        .map_err(|e| std::io::Error::other(format!("registering guest RAM for missing and minor faults: {e}")))
}

/// Drop this process's page table entries for `len` bytes at `addr` of a
/// shared mapping (the memfd keeps its pages): the next touch faults.
///
/// # Safety
/// `addr..addr + len` must be (part of) a shared mapping of guest RAM: for
/// a private mapping this would throw data away.
pub unsafe fn zap(addr: *mut libc::c_void, len: usize) -> std::io::Result<()> {
    // SAFETY: the caller's promise; for a shared mapping this only unmaps.
    if unsafe { libc::madvise(addr, len, libc::MADV_DONTNEED) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// A joined client: its connection to the vmm and guest RAM as passed.
pub struct RamClient {
    sock: OwnedFd,
    /// Guest RAM, as the vmm passed it.
    pub memfd: OwnedFd,
    pub ram_bytes: u64,
}

impl RamClient {
    /// Joins through the vmm's listening socket at `path`.
    pub fn connect(path: &Path, name: &str) -> Result<RamClient> {
        let sock = socket::socket(socket::AddressFamily::Unix, SockType::SeqPacket, SockFlag::SOCK_CLOEXEC, None)?;
        socket::connect(sock.as_raw_fd(), &UnixAddr::new(path)?).with_context(|| format!("connecting to {}", path.display()))?;
        send(sock.as_fd(), &json!({"op": "hello", "name": name}), None)?;
        Self::welcomed(sock)
    }

    /// Takes over a socket the vmm already admitted (one end of its socket
    /// pair): the welcome is waiting on it.
    pub fn from_socket(sock: OwnedFd) -> Result<RamClient> {
        Self::welcomed(sock)
    }

    fn welcomed(sock: OwnedFd) -> Result<RamClient> {
        set_timeout(sock.as_raw_fd(), Some(TIMEOUT));
        let (v, fd) = recv(sock.as_fd())?.ok_or_else(|| anyhow!("the vmm closed the connection"))?;
        if v["op"] != "welcome" {
            bail!("expected welcome, got {v}");
        }
        let memfd = fd.ok_or_else(|| anyhow!("welcome came without the RAM memfd"))?;
        let ram_bytes = v["ram_bytes"].as_u64().ok_or_else(|| anyhow!("welcome without ram_bytes"))?;
        set_timeout(sock.as_raw_fd(), None);
        Ok(RamClient { sock, memfd, ram_bytes })
    }

    /// The connection to the vmm.
    pub fn socket(&self) -> &OwnedFd {
        &self.sock
    }

    /// Answer the vmm until it closes: register `ranges` (address here,
    /// guest offset, length; page aligned) for missing and minor faults on
    /// advise, unregister on end. When the vmm goes away mid-postcopy the
    /// uffd is closed here too, which wakes any thread blocked on it.
    pub fn serve(&self, ranges: &[(u64, u64, u64)]) -> Result<()> {
        self.serve_with(ranges, |_| {})
    }

    /// [`serve`](Self::serve), telling `postcopy` when this client's
    /// postcopy begins (`true`, once its ranges are registered) and ends
    /// (`false`: at `postcopy-end`, or when the vmm goes away during it).
    pub fn serve_with(&self, ranges: &[(u64, u64, u64)], mut postcopy: impl FnMut(bool)) -> Result<()> {
        let fd = self.sock.as_fd();
        let mut uffd: Option<Uffd> = None;
        let served = self.answer(fd, ranges, &mut uffd, &mut postcopy);
        // The vmm went away (or the socket failed) during postcopy.
        if uffd.is_some() {
            postcopy(false);
        }
        served
    }

    fn answer(&self, fd: BorrowedFd, ranges: &[(u64, u64, u64)], uffd: &mut Option<Uffd>, postcopy: &mut impl FnMut(bool)) -> Result<()> {
        while let Some((v, _)) = recv(fd)? {
            match v["op"].as_str() {
                Some("postcopy-advise") => {
                    let r = (|| -> Result<Uffd> {
                        let u = UffdBuilder::new().close_on_exec(true).non_blocking(true).user_mode_only(true).create()?;
                        for r in ranges {
                            // Pages this process touched before must fault
                            // too: what it maps now may be stale or absent.
                            // SAFETY: the client's own shared mapping of guest RAM.
                            unsafe { zap(r.0 as *mut libc::c_void, r.2 as usize) }?;
                            register_ram(&u, r.0 as *mut libc::c_void, r.2 as usize)?;
                        }
                        Ok(u)
                    })();
                    match r {
                        Ok(u) => {
                            // In postcopy before the vmm hears it: once it
                            // has, it may report postcopy under way.
                            let first = uffd.is_none();
                            if first {
                                postcopy(true);
                            }
                            let sent = send(fd, &json!({"op": "postcopy-listen", "ranges": ranges}), Some(u.as_raw_fd()));
                            uffd.replace(u);
                            sent?;
                        }
                        Err(e) => send(fd, &json!({"op": "error", "reason": format!("{e:#}")}), None)?,
                    }
                }
                Some("postcopy-end") => {
                    if let Some(u) = uffd.take() {
                        for r in ranges {
                            let _ = u.unregister(r.0 as *mut libc::c_void, r.2 as usize);
                        }
                        postcopy(false);
                    }
                    send(fd, &json!({"op": "postcopy-ended"}), None)?;
                }
                _ => send(fd, &json!({"op": "error", "reason": format!("unknown message {v}")}), None)?,
            }
        }
        Ok(())
    }
}
