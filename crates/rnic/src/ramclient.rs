//! rnicd as a postcopy RAM client of a vmm (the `ram-client` protocol).
//!
//! A VM's memory regions are views of one window onto its guest RAM memfd
//! (`mem::window`). On the destination of a postcopy or hybrid migration
//! the VM runs before all of its pages are here; rnicd moves RDMA payload
//! through that window, where a page not yet here would read as zeros (or
//! as a stale or preallocated page). So the vmm hands rnicd one end of a
//! RAM-client socket (`Request::JoinRamClient`); rnicd maps the window
//! and, at `postcopy-advise`, registers it with a userfaultfd for missing
//! and minor faults after dropping its page table entries. An access to a
//! page that is not in then blocks until the vmm placed it (fetched on the
//! urgent channel), and the data path goes on with the right bytes.
//!
//! The thread that blocks is the event loop itself, which serves every
//! namespace of this rnicd: while one VM's page is fetched, the other
//! namespaces wait too (one urgent round trip per missing page, and only
//! while that VM is in postcopy). If the migration pauses (its link
//! broken), an access to a missing page waits until it is recovered, or
//! until the vmm goes away: then its end of the socket closes, this side
//! drops its userfaultfd, and the kernel lets the access go on.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context as _};
use ram_client::RamClient;
use tracing::{info, warn};

use crate::loop_priority::LoopPriority;
use crate::mem::{self, Mapping};

/// Most vmms one rnicd serves as a RAM client at a time (one thread each).
pub const MAX_RAM_CLIENTS: usize = 256;

/// The vmms one daemon serves as a RAM client, and its event loop's
/// priority, raised while any of them is in postcopy (`loop_priority`).
pub struct RamClients {
    joined: AtomicUsize,
    priority: Arc<LoopPriority>,
}

impl RamClients {
    /// Made on the daemon's event loop thread (the one it raises).
    pub fn new() -> Arc<RamClients> {
        Arc::new(RamClients { joined: AtomicUsize::new(0), priority: LoopPriority::of_this_thread() })
    }

    /// vmms served now.
    pub fn joined(&self) -> usize {
        self.joined.load(Ordering::Relaxed)
    }

    /// vmms served whose postcopy is under way.
    pub fn in_postcopy(&self) -> usize {
        self.priority.in_postcopy()
    }
}

/// Sets or clears O_NONBLOCK on `fd`.
fn set_nonblocking(fd: &OwnedFd, on: bool) -> anyhow::Result<()> {
    let fd = fd.as_raw_fd();
    // SAFETY: fcntl on a descriptor we own.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    let flags = if on { flags | libc::O_NONBLOCK } else { flags & !libc::O_NONBLOCK };
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags) } < 0 {
        bail!("fcntl: {}", std::io::Error::last_os_error());
    }
    Ok(())
}

/// Joins the vmm at the other end of `sock` (already admitted by it: its
/// welcome with the guest RAM memfd is waiting) and serves it on a thread
/// of its own until the vmm closes. Returns the guest RAM size.
pub fn join(clients: &Arc<RamClients>, sock: OwnedFd) -> anyhow::Result<u64> {
    if clients.joined() >= MAX_RAM_CLIENTS {
        bail!("this rnicd already serves {MAX_RAM_CLIENTS} vmms as a RAM client");
    }
    // Called on the event loop: the welcome must be there already, never
    // waited for.
    set_nonblocking(&sock, true)?;
    let client = RamClient::from_socket(sock).context("joining as a RAM client (the vmm's welcome must be queued)")?;
    set_nonblocking(client.socket(), false)?;
    let window: Arc<Mapping> = mem::window(&client.memfd).context("guest RAM")?;
    if (window.len() as u64) < client.ram_bytes {
        bail!("guest RAM memfd holds {} bytes, the vmm says {}", window.len(), client.ram_bytes);
    }
    let ram_bytes = client.ram_bytes;
    // Registered whole, page aligned: the window maps the file from 0.
    let ranges = [(window.ptr() as u64, 0u64, (window.len() as u64).next_multiple_of(4096))];
    clients.joined.fetch_add(1, Ordering::Relaxed);
    let me = clients.clone();
    // Not at the loop's raised priority (another vmm's postcopy): its own.
    let spawned = crate::loop_priority::spawn("ram-client", move || {
        info!(ram_bytes, "joined a vmm as a RAM client");
        match client.serve_with(&ranges, |on| me.priority.postcopy_phase(on)) {
            Ok(()) => info!("the vmm closed its RAM client socket"),
            Err(e) => warn!("RAM client: {e:#}"),
        }
        // The window stays mapped while memory regions still use it.
        drop(window);
        me.joined.fetch_sub(1, Ordering::Relaxed);
    });
    if let Err(e) = spawned {
        clients.joined.fetch_sub(1, Ordering::Relaxed);
        bail!("starting the RAM client thread: {e}");
    }
    Ok(ram_bytes)
}
