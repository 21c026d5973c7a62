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

/// Gratuitous ARP requests sent by a claim (one may be lost on a busy link).
const ANNOUNCEMENTS: usize = 3;

/// The interface holding `ip` (its index and name) and the prefix length
/// of `ip` there; `None` if no interface of this network namespace holds it.
pub(crate) fn address_of(ip: Ipv4Addr) -> Result<Option<(u32, String, u8)>> {
    let Ok((index, iface, _)) = crate::announce::interface_of(ip) else { return Ok(None) };
    let addrs = nix::ifaddrs::getifaddrs().context("listing interface addresses")?;
    let prefix = addrs
        .filter(|a| a.interface_name == iface)
        .find(|a| a.address.as_ref().and_then(|s| s.as_sockaddr_in()).is_some_and(|s| s.ip() == ip))
        .and_then(|a| a.netmask.as_ref().and_then(|m| m.as_sockaddr_in()).map(|m| u32::from(m.ip()).count_ones()))
        .unwrap_or(32);
    Ok(Some((index, iface, prefix as u8)))
}

/// Whether an interface of this network namespace holds `ip`.
pub fn is_local(ip: Ipv4Addr) -> bool {
    crate::announce::interface_of(ip).is_ok()
}

/// Adds `gid` next to `host` (same interface and prefix) unless it is there
/// already, then announces it. Returns the interface.
pub fn claim(gid: Ipv4Addr, host: Ipv4Addr) -> Result<String> {
    let Some((index, iface, prefix)) = address_of(host)? else { bail!("no interface of this host holds rnicd's address {host}") };
    if !is_local(gid) {
        // Another claimant may have added it between the look and the add.
        if let Err(e) = crate::netlink::change_address(true, index, gid, prefix) {
            if !is_local(gid) {
                bail!("adding {gid}/{prefix} to {iface}: {e}");
            }
        }
    }
    crate::announce::gratuitous_arp(gid, ANNOUNCEMENTS).with_context(|| format!("announcing {gid}"))?;
    Ok(iface)
}

/// Removes `gid` from whichever interface holds it (nothing if none does).
pub fn release(gid: Ipv4Addr) -> Result<()> {
    let Some((index, iface, prefix)) = address_of(gid)? else { return Ok(()) };
    if let Err(e) = crate::netlink::change_address(false, index, gid, prefix) {
        if is_local(gid) {
            bail!("removing {gid}/{prefix} from {iface}: {e}");
        }
    }
    Ok(())
}
