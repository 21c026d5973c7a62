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
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context as _};
use ram_client::RamClient;
use tracing::{info, warn};

use crate::mem::{self, Mapping};

/// The event loop's nice value while a vmm it serves is in postcopy: the
/// VM runs there and its RDMA traffic goes through this loop, beside the
/// migration's push threads (normal priority) that copy its pages. At the
/// same priority, on a loaded host, the loop waited for a CPU for as long
/// as the push ran (a peer saw every QP stall 60-130 ms past the VM's
/// restart). Not a real-time class: the loop polls while it has work.
const POSTCOPY_NICE: i32 = -10;

/// The event loop's thread (the one that joins).
static EVENT_LOOP: AtomicI32 = AtomicI32::new(0);
/// vmms in postcopy now, and the event loop's nice value before the first.
static IN_POSTCOPY: Mutex<(usize, i32)> = Mutex::new((0, 0));

/// vmms this rnicd serves whose postcopy is under way (its event loop runs
/// at [`POSTCOPY_NICE`] meanwhile).
pub fn in_postcopy() -> usize {
    IN_POSTCOPY.lock().unwrap().0
}

fn nice_of(tid: i32) -> i32 {
    // SAFETY: plain syscall (-1 is a valid nice value, so errors read as it).
    unsafe { libc::getpriority(libc::PRIO_PROCESS, tid as libc::id_t) }
}

fn set_nice(tid: i32, nice: i32) -> std::io::Result<()> {
    // SAFETY: plain syscall.
    if unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// A vmm this rnicd serves entered (`true`) or left postcopy.
fn postcopy_phase(on: bool) {
    let tid = EVENT_LOOP.load(Ordering::Relaxed);
    let mut g = IN_POSTCOPY.lock().unwrap();
    if on {
        g.0 += 1;
        if g.0 == 1 {
            g.1 = nice_of(tid);
            if let Err(e) = set_nice(tid, POSTCOPY_NICE.min(g.1)) {
                warn!("the event loop keeps its priority during postcopy: {e}");
            }
        }
    } else if g.0 > 0 {
        g.0 -= 1;
        if g.0 == 0 {
            if let Err(e) = set_nice(tid, g.1) {
                warn!("restoring the event loop's priority after postcopy: {e}");
            }
        }
    }
}

/// Most vmms one rnicd serves as a RAM client at a time (one thread each).
pub const MAX_RAM_CLIENTS: usize = 256;
static JOINED: AtomicUsize = AtomicUsize::new(0);

/// vmms this rnicd serves as a RAM client now.
pub fn joined() -> usize {
    JOINED.load(Ordering::Relaxed)
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
pub fn join(sock: OwnedFd) -> anyhow::Result<u64> {
    if JOINED.load(Ordering::Relaxed) >= MAX_RAM_CLIENTS {
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
    JOINED.fetch_add(1, Ordering::Relaxed);
    // SAFETY: plain syscall.
    EVENT_LOOP.store(unsafe { libc::gettid() }, Ordering::Relaxed);
    let spawned = std::thread::Builder::new().name("ram-client".into()).spawn(move || {
        info!(ram_bytes, "joined a vmm as a RAM client");
        match client.serve_with(&ranges, postcopy_phase) {
            Ok(()) => info!("the vmm closed its RAM client socket"),
            Err(e) => warn!("RAM client: {e:#}"),
        }
        // The window stays mapped while memory regions still use it.
        drop(window);
        JOINED.fetch_sub(1, Ordering::Relaxed);
    });
    if let Err(e) = spawned {
        JOINED.fetch_sub(1, Ordering::Relaxed);
        bail!("starting the RAM client thread: {e}");
    }
    Ok(ram_bytes)
}
