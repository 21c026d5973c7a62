//! RAM clients: processes other than the vmm that map guest RAM (rnicd, a
//! vhost-user backend) and so must take part in postcopy, or they would
//! read holes as zeros. The protocol follows DPDK vhost-user's postcopy
//! (advise / listen / end), over a unix SOCK_SEQPACKET socket of the vmm:
//!
//! | from | message | with fd | meaning |
//! |---|---|---|---|
//! | client | `{"op":"hello","name":N}` | – | join |
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

use super::place::FaultDomain;
use crate::vm::RamRegion;
use anyhow::{anyhow, bail, Context, Result};
use nix::sys::socket::{self, SockFlag, SockType, UnixAddr};
use serde_json::{json, Value};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long a client may take to answer advise / end.
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(5);

fn send(fd: BorrowedFd, v: &Value, pass: Option<RawFd>) -> Result<()> {
    fdmsg::send(fd, v, pass.as_slice())?;
    Ok(())
}

/// One message and the fd passed with it, if any. `None` at end of stream.
fn recv(fd: BorrowedFd) -> Result<Option<(Value, Option<OwnedFd>)>> {
    let msg = fdmsg::recv_json::<Value>(fd).map_err(|e| anyhow!("bad RAM client message: {e}"))?;
    Ok(msg.map(|(v, fds)| (v, fds.into_iter().next())))
}

fn set_timeout(fd: RawFd, d: Option<Duration>) {
    let tv = match d {
        Some(d) => libc::timeval { tv_sec: d.as_secs() as _, tv_usec: d.subsec_micros() as _ },
        None => libc::timeval { tv_sec: 0, tv_usec: 0 },
    };
    // SAFETY: valid timeval for SO_RCVTIMEO.
    unsafe {
        libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_RCVTIMEO, &tv as *const _ as *const libc::c_void, std::mem::size_of_val(&tv) as u32)
    };
}

struct Conn {
    fd: OwnedFd,
    name: String,
}

/// The vmm's side: a listening socket and the clients that joined.
pub struct RamClients {
    path: PathBuf,
    ram: RamRegion,
    conns: Mutex<Vec<Conn>>,
}

impl RamClients {
    /// Listen on `path` (replaced if it exists) for clients of `ram`.
    pub fn bind(path: &Path, ram: RamRegion) -> Result<Arc<RamClients>> {
        let _ = std::fs::remove_file(path);
        let fd = socket::socket(socket::AddressFamily::Unix, SockType::SeqPacket, SockFlag::SOCK_CLOEXEC, None)?;
        socket::bind(fd.as_raw_fd(), &UnixAddr::new(path)?).with_context(|| format!("binding {}", path.display()))?;
        socket::listen(&fd, socket::Backlog::new(16)?)?;
        let listener = UnixListener::from(fd);
        let me = Arc::new(RamClients { path: path.to_path_buf(), ram, conns: Mutex::new(Vec::new()) });
        let weak = Arc::downgrade(&me);
        std::thread::Builder::new().name("ram-clients".into()).spawn(move || {
            for s in listener.incoming() {
                let Some(me) = weak.upgrade() else { return };
                match s {
                    Ok(s) => {
                        if let Err(e) = me.admit(OwnedFd::from(s)) {
                            tracing::warn!("RAM client refused: {e:#}");
                        }
                    }
                    Err(e) => tracing::warn!("RAM client socket: {e}"),
                }
            }
        })?;
        Ok(me)
    }

    fn admit(&self, fd: OwnedFd) -> Result<()> {
        set_timeout(fd.as_raw_fd(), Some(CLIENT_TIMEOUT));
        let (hello, _) = recv(fd.as_fd())?.ok_or_else(|| anyhow!("client left before hello"))?;
        if hello["op"] != "hello" {
            bail!("expected hello, got {hello}");
        }
        let name = hello["name"].as_str().unwrap_or("client").chars().take(64).collect::<String>();
        send(fd.as_fd(), &json!({"op": "welcome", "ram_bytes": self.ram.len}), Some(self.ram.memfd))?;
        set_timeout(fd.as_raw_fd(), None);
        tracing::info!("RAM client {name:?} joined");
        self.conns.lock().unwrap().push(Conn { fd, name });
        Ok(())
    }

    /// Clients connected now.
    pub fn count(&self) -> usize {
        self.conns.lock().unwrap().len()
    }

    /// Postcopy starts: every client registers its mappings and hands us
    /// its uffd. A client that left is dropped; one that fails fails this.
    pub fn advise(&self) -> Result<Vec<FaultDomain>> {
        let mut conns = self.conns.lock().unwrap();
        let mut out = Vec::new();
        let mut keep = Vec::new();
        for c in conns.drain(..) {
            let fd = c.fd.as_fd();
            set_timeout(fd.as_raw_fd(), Some(CLIENT_TIMEOUT));
            if send(fd, &json!({"op": "postcopy-advise"}), None).is_err() {
                tracing::info!("RAM client {:?} left", c.name);
                continue;
            }
            let reply = recv(fd).with_context(|| format!("RAM client {:?} did not answer postcopy-advise", c.name))?;
            let Some((v, uffd)) = reply else {
                tracing::info!("RAM client {:?} left", c.name);
                continue;
            };
            if v["op"] == "error" {
                bail!("RAM client {:?} cannot take part in postcopy: {}", c.name, v["reason"]);
            }
            let uffd = uffd.ok_or_else(|| anyhow!("RAM client {:?} answered without a userfaultfd", c.name))?;
            let ranges: Vec<(u64, u64, u64)> =
                serde_json::from_value(v["ranges"].clone()).map_err(|e| anyhow!("RAM client {:?}: bad ranges: {e}", c.name))?;
            // SAFETY: the fd came with the message and is a uffd by
            // protocol; any other fd fails its first ioctl.
            let uffd = unsafe { userfaultfd::Uffd::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(uffd)) };
            out.push(FaultDomain { uffd, ranges, name: c.name.clone(), gone: Default::default() });
            keep.push(c);
        }
        *conns = keep;
        Ok(out)
    }

    /// Every page is in: clients unregister. Best effort, bounded.
    pub fn end(&self) {
        for c in self.conns.lock().unwrap().iter() {
            let fd = c.fd.as_fd();
            set_timeout(fd.as_raw_fd(), Some(CLIENT_TIMEOUT));
            if send(fd, &json!({"op": "postcopy-end"}), None).is_ok() {
                match recv(fd) {
                    Ok(Some((v, _))) if v["op"] == "postcopy-ended" => {}
                    other => tracing::warn!("RAM client {:?} did not end postcopy cleanly: {:?}", c.name, other.map(|o| o.map(|x| x.0))),
                }
            }
            set_timeout(fd.as_raw_fd(), None);
        }
    }
}

impl Drop for RamClients {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The client's side (a helper process; rnicd later).
pub struct RamClient {
    sock: OwnedFd,
    /// Guest RAM, as the vmm passed it.
    pub memfd: OwnedFd,
    pub ram_bytes: u64,
}

impl RamClient {
    pub fn connect(path: &Path, name: &str) -> Result<RamClient> {
        let sock = socket::socket(socket::AddressFamily::Unix, SockType::SeqPacket, SockFlag::SOCK_CLOEXEC, None)?;
        socket::connect(sock.as_raw_fd(), &UnixAddr::new(path)?).with_context(|| format!("connecting to {}", path.display()))?;
        send(sock.as_fd(), &json!({"op": "hello", "name": name}), None)?;
        let (v, fd) = recv(sock.as_fd())?.ok_or_else(|| anyhow!("the vmm closed the connection"))?;
        if v["op"] != "welcome" {
            bail!("expected welcome, got {v}");
        }
        let memfd = fd.ok_or_else(|| anyhow!("welcome came without the RAM memfd"))?;
        let ram_bytes = v["ram_bytes"].as_u64().ok_or_else(|| anyhow!("welcome without ram_bytes"))?;
        Ok(RamClient { sock, memfd, ram_bytes })
    }

    /// Answer the vmm until it closes: register `ranges` (address here,
    /// guest offset, length) for missing and minor faults on advise,
    /// unregister on end.
    pub fn serve(&self, ranges: &[(u64, u64, u64)]) -> Result<()> {
        let fd = self.sock.as_fd();
        let mut uffd: Option<userfaultfd::Uffd> = None;
        while let Some((v, _)) = recv(fd)? {
            match v["op"].as_str() {
                Some("postcopy-advise") => {
                    let r = (|| -> Result<userfaultfd::Uffd> {
                        let u = userfaultfd::UffdBuilder::new().close_on_exec(true).non_blocking(true).user_mode_only(true).create()?;
                        for r in ranges {
                            // Pages this process touched before must fault
                            // too: what it maps now may be stale or absent.
                            // SAFETY: the client's own shared mapping of guest RAM.
                            unsafe { super::place::zap(r.0 as *mut libc::c_void, r.2 as usize) }?;
                            super::place::register_ram(&u, r.0 as *mut libc::c_void, r.2 as usize)?;
                        }
                        Ok(u)
                    })();
                    match r {
                        Ok(u) => {
                            send(fd, &json!({"op": "postcopy-listen", "ranges": ranges}), Some(u.as_raw_fd()))?;
                            uffd = Some(u);
                        }
                        Err(e) => send(fd, &json!({"op": "error", "reason": format!("{e:#}")}), None)?,
                    }
                }
                Some("postcopy-end") => {
                    if let Some(u) = uffd.take() {
                        for r in ranges {
                            let _ = u.unregister(r.0 as *mut libc::c_void, r.2 as usize);
                        }
                    }
                    send(fd, &json!({"op": "postcopy-ended"}), None)?;
                }
                _ => send(fd, &json!({"op": "error", "reason": format!("unknown message {v}")}), None)?,
            }
        }
        Ok(())
    }
}
