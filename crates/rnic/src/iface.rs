//! The network namespace's interfaces, read in one go.
//!
//! Which interface holds an address, its index and link-layer address, the
//! address's prefix and the interface's MTU all come from `getifaddrs`,
//! which is a netlink dump of every link and every address (about 60 µs on
//! an idle host, more on a busy one). A GID's claim and release run inside
//! a migration's downtime and need several of these facts, so each reads
//! the table once ([`Interfaces::read`]) and asks it everything.

use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use nix::ifaddrs::InterfaceAddress;

/// One read of the namespace's interface addresses.
pub struct Interfaces(Vec<InterfaceAddress>);

/// The interface that holds an address, as [`Interfaces::holder`] found it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    pub index: u32,
    pub name: String,
    /// The interface's link-layer address (None on one without, such as a tunnel).
    pub mac: Option<[u8; 6]>,
    /// The prefix length of the address on it (32 if it has no netmask).
    pub prefix: u8,
}

impl Interfaces {
    pub fn read() -> io::Result<Interfaces> {
        Ok(Interfaces(nix::ifaddrs::getifaddrs().map_err(io::Error::from)?.collect()))
    }

    /// The interface holding `ip`, if one does.
    pub fn holder(&self, ip: Ipv4Addr) -> Option<Holder> {
        let holds = self.0.iter().find(|a| a.address.as_ref().and_then(|s| s.as_sockaddr_in()).is_some_and(|s| s.ip() == ip))?;
        let name = &holds.interface_name;
        let prefix = holds.netmask.as_ref().and_then(|m| m.as_sockaddr_in()).map_or(32, |m| u32::from(m.ip()).count_ones() as u8);
        // Every interface has a link-layer entry (its index and address),
        // unless it went away between the two parts of the dump.
        let (index, mac) = self
            .0
            .iter()
            .filter(|a| &a.interface_name == name)
            .find_map(|a| a.address.as_ref().and_then(|s| s.as_link_addr()).map(|l| (l.ifindex() as u32, l.addr())))?;
        Some(Holder { index, name: name.clone(), mac, prefix })
    }

    /// Whether an interface holds `ip`.
    pub fn holds(&self, ip: Ipv4Addr) -> bool {
        self.holder(ip).is_some()
    }
}

/// The MTU of interface `name` (SIOCGIFMTU); None if it cannot be read or
/// is below IPv4's minimum of 576.
pub fn mtu(name: &str) -> Option<usize> {
    // SAFETY: socket() result checked and owned.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: fd was just returned by socket().
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: a zeroed ifreq is valid; the name is set below, NUL-terminated.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(name.bytes().take(libc::IFNAMSIZ - 1)) {
        *d = s as libc::c_char;
    }
    // SAFETY: SIOCGIFMTU fills the ifreq's MTU.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), libc::SIOCGIFMTU, &mut req) };
    // SAFETY: the union's MTU member was written by a successful ioctl.
    (r == 0).then_some(unsafe { req.ifr_ifru.ifru_mtu } as usize).filter(|m| *m >= 576)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_is_found_with_its_prefix_and_mtu() {
        let t = Interfaces::read().unwrap();
        let lo = t.holder(Ipv4Addr::LOCALHOST).expect("lo holds 127.0.0.1");
        assert_eq!(lo.prefix, 8);
        assert!(lo.index > 0);
        assert!(mtu(&lo.name).is_some_and(|m| m >= 1500));
        assert!(!t.holds(Ipv4Addr::new(192, 0, 2, 77)));
    }
}
