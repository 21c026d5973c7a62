//! Claiming and releasing a namespace's GID on this host.
//!
//! A namespace's GID is an IPv4 address that moves with its VM. The host
//! that answers for it is the one whose interface holds it; two hosts must
//! never hold it at once, or a peer's packets go to whichever ARP answered
//! last. rnicd does the move on request of the namespace's owner (the vmm,
//! which needs no privileges for it): a claim adds the address to the
//! interface that holds rnicd's own address, with the same prefix, and
//! announces it with gratuitous ARP so that every neighbour switches at
//! once; a release removes it.
//!
//! The address is changed with one rtnetlink request (RTM_NEWADDR or
//! RTM_DELADDR, netlink.rs) from rnicd itself: both happen inside a
//! migration's downtime, where spawning `ip` cost 10-30 ms each on a busy
//! host.

use std::net::Ipv4Addr;

use anyhow::{bail, Context, Result};

use crate::iface::{Holder, Interfaces};

/// Gratuitous ARP requests sent by a claim (one may be lost on a busy link).
const ANNOUNCEMENTS: usize = 3;

/// Whether an interface of this network namespace holds `ip`.
pub fn is_local(ip: Ipv4Addr) -> bool {
    Interfaces::read().is_ok_and(|t| t.holds(ip))
}

/// Adds `gid` next to `host` (same interface and prefix) unless it is there
/// already, then announces it. Returns the interface. The interfaces are
/// read once (iface.rs): a claim runs inside a migration's downtime.
pub fn claim(gid: Ipv4Addr, host: Ipv4Addr) -> Result<Holder> {
    let t = Interfaces::read().context("listing interface addresses")?;
    let Some(on) = t.holder(host) else { bail!("no interface of this host holds rnicd's address {host}") };
    if !t.holds(gid) {
        // Another claimant may have added it between the look and the add.
        if let Err(e) = crate::netlink::change_address(true, on.index, gid, on.prefix) {
            if !is_local(gid) {
                bail!("adding {gid}/{} to {}: {e}", on.prefix, on.name);
            }
        }
    }
    crate::announce::announce_on(&on, gid, ANNOUNCEMENTS).with_context(|| format!("announcing {gid}"))?;
    Ok(on)
}

/// Removes `gid` from whichever interface holds it (nothing if none does).
pub fn release(gid: Ipv4Addr) -> Result<()> {
    let Some(on) = Interfaces::read().context("listing interface addresses")?.holder(gid) else { return Ok(()) };
    if let Err(e) = crate::netlink::change_address(false, on.index, gid, on.prefix) {
        if is_local(gid) {
            bail!("removing {gid}/{} from {}: {e}", on.prefix, on.name);
        }
    }
    Ok(())
}
