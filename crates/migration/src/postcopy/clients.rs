//! The vmm's side of the RAM-client protocol: processes other than the vmm
//! that map guest RAM (rnicd, a vhost-user backend) join here so that an
//! incoming postcopy serves their faults too. The protocol and the client's
//! side are in the `ram-client` crate.

use crate::place::FaultDomain;
use crate::vm::RamRegion;
use anyhow::{anyhow, bail, Context, Result};
use nix::sys::socket::{self, SockFlag, SockType, UnixAddr};
use ram_client::{recv, send, set_timeout};
use serde_json::json;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long a client may take to answer advise / end.
pub const CLIENT_TIMEOUT: Duration = ram_client::TIMEOUT;

struct Conn {
    fd: OwnedFd,
    name: String,
}

/// The vmm's side: the clients that joined (through a listening socket,
/// or through a socket pair the vmm handed out).
pub struct RamClients {
    /// The listening socket's path, if there is one.
    path: Option<PathBuf>,
    ram: RamRegion,
    conns: Mutex<Vec<Conn>>,
}

/// The name a vmm gives the rnicd of its PVRDMA devices when it makes it a
/// RAM client ([`RamClients::pair`]).
pub const RNICD_CLIENT: &str = "rnicd";

impl RamClients {
    /// Clients of `ram` that the vmm invites itself ([`RamClients::pair`]).
    pub fn new(ram: RamRegion) -> Arc<RamClients> {
        Arc::new(RamClients { path: None, ram, conns: Mutex::new(Vec::new()) })
    }

    /// Listen on `path` (replaced if it exists) for clients of `ram`.
    pub fn bind(path: &Path, ram: RamRegion) -> Result<Arc<RamClients>> {
        let _ = std::fs::remove_file(path);
        let fd = socket::socket(socket::AddressFamily::Unix, SockType::SeqPacket, SockFlag::SOCK_CLOEXEC, None)?;
        socket::bind(fd.as_raw_fd(), &UnixAddr::new(path)?).with_context(|| format!("binding {}", path.display()))?;
        socket::listen(&fd, socket::Backlog::new(16)?)?;
        let listener = UnixListener::from(fd);
        let me = Arc::new(RamClients { path: Some(path.to_path_buf()), ram, conns: Mutex::new(Vec::new()) });
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

    /// A client joined without a socket path: one end of a new socket pair
    /// is admitted as `name` (its welcome is already queued on it), the
    /// other end is returned, for the vmm to pass to that client (rnicd
    /// takes it with `RamClient::from_socket`).
    pub fn pair(&self, name: &str) -> Result<OwnedFd> {
        let (ours, theirs) = socket::socketpair(socket::AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)?;
        send(ours.as_fd(), &json!({"op": "welcome", "ram_bytes": self.ram.len}), Some(self.ram.memfd))?;
        tracing::info!("RAM client {name:?} invited");
        self.conns.lock().unwrap().push(Conn { fd: ours, name: name.chars().take(64).collect() });
        Ok(theirs)
    }

    /// A client named `name` is connected now.
    pub fn has(&self, name: &str) -> bool {
        self.conns.lock().unwrap().iter().any(|c| c.name == name)
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
            out.push(FaultDomain::new(&c.name, uffd, ranges));
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
        if let Some(p) = &self.path {
            let _ = std::fs::remove_file(p);
        }
    }
}

pub use ram_client::RamClient;
