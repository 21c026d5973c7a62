//! Warming the host's neighbour entry of a QP's peer before the QP resumes.
//!
//! A migration's destination makes its QPs suspended while RAM still moves
//! (docs/pvrdma-migration.md, "The order"); at the switch they resume and
//! each sends at once. A host with no neighbour entry for the peer would
//! hold those packets for an ARP round trip first. rnicd makes the entry
//! when such a QP is made (`engine::FlowAhead`), with an ordinary ARP
//! request whose sender is the interface's primary address (the kernel
//! picks it: no packet is waiting, so no packet's source is used), never
//! one that names the GID: the GID is not on this host before the commit,
//! and two hosts must never answer for it at once (gid.rs).
//!
//! Only a peer on the link of rnicd's own address is warmed: one behind a
//! router is reached through the router's entry, which the host's other
//! traffic keeps.

use std::net::Ipv4Addr;

use anyhow::{Context, Result};

/// Makes the neighbour entry of `peer` on the interface that holds `host`
/// (rnicd's own address) and starts resolving it if it is not fresh.
/// Returns false, doing nothing, when `peer` is not on that link.
pub fn warm(host: Ipv4Addr, peer: Ipv4Addr) -> Result<bool> {
    let t = crate::iface::Interfaces::read().context("listing interface addresses")?;
    let Some(on) = t.holder(host) else { return Ok(false) };
    if !on_link(host, on.prefix, peer) || peer == host {
        return Ok(false);
    }
    crate::netlink::use_neighbour(on.index, peer).with_context(|| format!("neighbour entry of {peer} on {}", on.name))?;
    Ok(true)
}

/// Whether `peer` is in `host`'s subnet of length `prefix`.
fn on_link(host: Ipv4Addr, prefix: u8, peer: Ipv4Addr) -> bool {
    let mask = if prefix == 0 { 0 } else { u32::MAX << (32 - u32::from(prefix.min(32))) };
    u32::from(host) & mask == u32::from(peer) & mask
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_hosts_subnet_is_on_link() {
        let host = Ipv4Addr::new(10, 200, 0, 2);
        assert!(on_link(host, 24, Ipv4Addr::new(10, 200, 0, 9)));
        assert!(!on_link(host, 24, Ipv4Addr::new(10, 200, 1, 9)));
        assert!(on_link(host, 16, Ipv4Addr::new(10, 200, 1, 9)));
        assert!(!on_link(host, 32, Ipv4Addr::new(10, 200, 0, 9)));
        assert!(on_link(host, 0, Ipv4Addr::new(192, 168, 0, 1)));
    }
}
