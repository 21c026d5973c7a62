//! The link under an address: its interface's MTU and the largest RoCE
//! path MTU whose packets it carries whole.
//!
//! One place for the choice, used by rnicd's port (its active MTU), the
//! verbs crate's default path MTU and the migration transport's queue
//! pairs. A packet larger than the link leaves as IP fragments; under a
//! rate cap or loss single fragments are dropped and the rest fill the
//! receiving host's IP reassembly memory (shared by every link), after
//! which the host drops all RoCE traffic until the fragments time out.

use std::net::Ipv4Addr;

use crate::types::Mtu;

/// Bytes a RoCEv2 packet adds to its payload at most, rounded up to 64:
/// IPv4 20, UDP 8, BTH 12, RETH 16, ICRC 4 (60).
pub const ROCE_OVERHEAD: usize = 64;

/// The path MTU assumed when no interface holds the address (yet): 1024,
/// whose packets fit any Ethernet link (1500). A namespace may open before
/// its address moves here (a VM's GID is claimed when the VM arrives).
pub const UNKNOWN_LINK_PATH_MTU: Mtu = Mtu::M1024;

/// The largest IB path MTU (256..4096) whose packets fit a link of
/// `link_mtu` bytes (256 if none does). 4096 is the largest RoCE uses.
pub fn path_mtu_fitting(link_mtu: usize) -> Mtu {
    [Mtu::M4096, Mtu::M2048, Mtu::M1024, Mtu::M512].into_iter().find(|m| m.bytes() + ROCE_OVERHEAD <= link_mtu).unwrap_or(Mtu::M256)
}

/// The path MTU for packets leaving from `addr`: what fits the MTU of the
/// interface holding it in this network namespace, else
/// [`UNKNOWN_LINK_PATH_MTU`].
pub fn path_mtu_from(addr: Ipv4Addr) -> Mtu {
    interface_mtu(addr).map_or(UNKNOWN_LINK_PATH_MTU, path_mtu_fitting)
}

/// [`path_mtu_from`] for an address on interface `name`, as a caller that
/// has just read the interfaces found it.
pub fn path_mtu_on(name: &str) -> Mtu {
    crate::iface::mtu(name).map_or(UNKNOWN_LINK_PATH_MTU, path_mtu_fitting)
}

/// The MTU of the interface holding `addr` in this network namespace (None
/// if no interface has it, or its MTU is below IPv4's 576).
pub fn interface_mtu(addr: Ipv4Addr) -> Option<usize> {
    crate::iface::mtu(&crate::iface::Interfaces::read().ok()?.holder(addr)?.name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_path_mtu_is_the_largest_whose_packets_fit() {
        assert_eq!(path_mtu_fitting(1500), Mtu::M1024, "Ethernet: 2048 + 64 does not fit");
        assert_eq!(path_mtu_fitting(2048 + 64), Mtu::M2048, "exactly fits");
        assert_eq!(path_mtu_fitting(2048 + 63), Mtu::M1024, "one byte short");
        assert_eq!(path_mtu_fitting(4096 + 64), Mtu::M4096);
        assert_eq!(path_mtu_fitting(9000), Mtu::M4096, "jumbo: 4096 is the largest RoCE uses");
        assert_eq!(path_mtu_fitting(65536), Mtu::M4096);
        assert_eq!(path_mtu_fitting(1024 + 63), Mtu::M512);
        assert_eq!(path_mtu_fitting(576), Mtu::M512, "IPv4's minimum");
        assert_eq!(path_mtu_fitting(300), Mtu::M256, "nothing fits: the smallest");
    }

    #[test]
    fn the_path_mtu_follows_the_interface_holding_the_address() {
        // Loopback's MTU (64 KiB) carries the largest.
        assert_eq!(interface_mtu(Ipv4Addr::LOCALHOST).map(path_mtu_fitting), Some(Mtu::M4096));
        assert_eq!(path_mtu_from(Ipv4Addr::LOCALHOST), Mtu::M4096);
        // An address no interface holds: what fits any Ethernet link.
        assert_eq!(interface_mtu(Ipv4Addr::new(192, 0, 2, 77)), None);
        assert_eq!(path_mtu_from(Ipv4Addr::new(192, 0, 2, 77)), Mtu::M1024);
    }
}
