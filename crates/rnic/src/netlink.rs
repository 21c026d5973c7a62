//! Adding and removing an IPv4 address with one rtnetlink request: what
//! `ip addr add|del ADDR/PREFIX dev IFACE` sends, without spawning `ip`
//! (a GID moves inside a migration's downtime, and fork plus exec of a
//! program cost 10-30 ms there on a busy host). Linux's
//! Documentation/userspace-api/netlink and rtnetlink(7) describe the
//! messages: a `nlmsghdr`, an `ifaddrmsg`, then `IFA_LOCAL` and
//! `IFA_ADDRESS` attributes; the kernel answers with an `NLMSG_ERROR`
//! whose code is 0 for success.
//!
//! Also what `ip neigh replace ADDR dev IFACE use` sends (`RTM_NEWNEIGH`
//! with `NTF_USE`: an `ndmsg`, then `NDA_DST`): the kernel makes the
//! neighbour entry if there is none and resolves it as if a packet were
//! waiting for it, so a later first packet finds it ready.

use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};

const NLMSG_HDR: usize = 16;
const IFADDRMSG: usize = 8;
const NDMSG: usize = 12;
const RTA_IPV4: usize = 8;

static SEQ: AtomicU32 = AtomicU32::new(1);

/// The request bytes: `add` (RTM_NEWADDR, failing if present) or delete
/// (RTM_DELADDR) of `addr/prefix` on interface `index`.
pub fn address_request(add: bool, index: u32, addr: Ipv4Addr, prefix: u8, seq: u32) -> Vec<u8> {
    let len = NLMSG_HDR + IFADDRMSG + 2 * RTA_IPV4;
    let (kind, mut flags) = if add { (libc::RTM_NEWADDR, libc::NLM_F_CREATE | libc::NLM_F_EXCL) } else { (libc::RTM_DELADDR, 0) };
    flags |= libc::NLM_F_REQUEST | libc::NLM_F_ACK;
    let mut m = Vec::with_capacity(len);
    m.extend_from_slice(&(len as u32).to_ne_bytes());
    m.extend_from_slice(&kind.to_ne_bytes());
    m.extend_from_slice(&(flags as u16).to_ne_bytes());
    m.extend_from_slice(&seq.to_ne_bytes());
    m.extend_from_slice(&0u32.to_ne_bytes()); // to the kernel
                                              // ifaddrmsg: family, prefix length, flags, scope (universe), index.
    m.extend_from_slice(&[libc::AF_INET as u8, prefix, 0, 0]);
    m.extend_from_slice(&index.to_ne_bytes());
    for kind in [libc::IFA_LOCAL, libc::IFA_ADDRESS] {
        m.extend_from_slice(&(RTA_IPV4 as u16).to_ne_bytes());
        m.extend_from_slice(&kind.to_ne_bytes());
        m.extend_from_slice(&addr.octets());
    }
    m
}

/// The request bytes of `ip neigh replace addr dev <index> use`: make the
/// entry of `addr` on interface `index` if missing, and resolve it unless
/// it is fresh (`NTF_USE`; the state asked is NUD_NONE, which `NTF_USE`
/// leaves alone).
pub fn neighbour_use_request(index: u32, addr: Ipv4Addr, seq: u32) -> Vec<u8> {
    let len = NLMSG_HDR + NDMSG + RTA_IPV4;
    let flags = libc::NLM_F_REQUEST | libc::NLM_F_ACK | libc::NLM_F_CREATE | libc::NLM_F_REPLACE;
    let mut m = Vec::with_capacity(len);
    m.extend_from_slice(&(len as u32).to_ne_bytes());
    m.extend_from_slice(&libc::RTM_NEWNEIGH.to_ne_bytes());
    m.extend_from_slice(&(flags as u16).to_ne_bytes());
    m.extend_from_slice(&seq.to_ne_bytes());
    m.extend_from_slice(&0u32.to_ne_bytes()); // to the kernel
                                              // ndmsg: family, 3 pad bytes, index, state (NUD_NONE), flags, type.
    m.extend_from_slice(&[libc::AF_INET as u8, 0, 0, 0]);
    m.extend_from_slice(&(index as i32).to_ne_bytes());
    m.extend_from_slice(&0u16.to_ne_bytes());
    m.extend_from_slice(&[libc::NTF_USE, 0]);
    m.extend_from_slice(&(RTA_IPV4 as u16).to_ne_bytes());
    m.extend_from_slice(&libc::NDA_DST.to_ne_bytes());
    m.extend_from_slice(&addr.octets());
    m
}

/// The error code of the kernel's answer to request `seq` in `buf` (one
/// datagram, possibly several messages): Some(0) on success, Some(-errno).
fn ack_of(buf: &[u8], seq: u32) -> Option<i32> {
    let mut off = 0;
    while off + NLMSG_HDR <= buf.len() {
        let len = u32::from_ne_bytes(buf[off..off + 4].try_into().ok()?) as usize;
        let kind = u16::from_ne_bytes(buf[off + 4..off + 6].try_into().ok()?);
        let s = u32::from_ne_bytes(buf[off + 8..off + 12].try_into().ok()?);
        if len < NLMSG_HDR || off + len > buf.len() {
            return None;
        }
        if kind == libc::NLMSG_ERROR as u16 && s == seq && len >= NLMSG_HDR + 4 {
            return Some(i32::from_ne_bytes(buf[off + NLMSG_HDR..off + NLMSG_HDR + 4].try_into().ok()?));
        }
        off += (len + 3) & !3;
    }
    None
}

/// Adds (`add`) or removes `addr/prefix` on interface `index` of this
/// thread's network namespace and waits for the kernel's answer (at most
/// one second).
pub fn change_address(add: bool, index: u32, addr: Ipv4Addr, prefix: u8) -> io::Result<()> {
    let seq = SEQ.fetch_add(1, Ordering::Relaxed);
    request(&address_request(add, index, addr, prefix, seq), seq)
}

/// Makes and resolves the neighbour entry of `addr` on interface `index`
/// (`neighbour_use_request`) and waits for the kernel's answer (at most
/// one second), not for the resolution.
pub fn use_neighbour(index: u32, addr: Ipv4Addr) -> io::Result<()> {
    let seq = SEQ.fetch_add(1, Ordering::Relaxed);
    request(&neighbour_use_request(index, addr, seq), seq)
}

/// Sends one request `seq` to the kernel and waits for its answer.
fn request(req: &[u8], seq: u32) -> io::Result<()> {
    // SAFETY: socket() result checked and owned.
    let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::NETLINK_ROUTE) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let tv = libc::timeval { tv_sec: 1, tv_usec: 0 };
    // SAFETY: a valid timeval of the right size.
    unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            &tv as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::timeval>() as u32,
        )
    };
    // SAFETY: a zeroed sockaddr_nl is the kernel's address (pid 0).
    let mut sa: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    sa.nl_family = libc::AF_NETLINK as u16;
    // SAFETY: valid buffer and address.
    let r = unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            req.as_ptr() as *const libc::c_void,
            req.len(),
            0,
            &sa as *const _ as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_nl>() as u32,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut buf = [0u8; 8192];
    loop {
        // SAFETY: valid buffer.
        let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr() as *mut libc::c_void, buf.len(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        match ack_of(&buf[..n as usize], seq) {
            Some(0) => return Ok(()),
            Some(e) => return Err(io::Error::from_raw_os_error(-e)),
            None => continue,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_layout() {
        let m = address_request(true, 7, Ipv4Addr::new(10, 1, 2, 3), 24, 9);
        assert_eq!(m.len(), 40);
        assert_eq!(u32::from_ne_bytes(m[0..4].try_into().unwrap()), 40);
        assert_eq!(u16::from_ne_bytes(m[4..6].try_into().unwrap()), libc::RTM_NEWADDR);
        assert_eq!(&m[16..20], &[libc::AF_INET as u8, 24, 0, 0]);
        assert_eq!(u32::from_ne_bytes(m[20..24].try_into().unwrap()), 7);
        assert_eq!(&m[28..32], &[10, 1, 2, 3]);
        assert_eq!(&m[36..40], &[10, 1, 2, 3]);
    }

    #[test]
    fn neighbour_request_layout() {
        let m = neighbour_use_request(7, Ipv4Addr::new(10, 1, 2, 3), 9);
        assert_eq!(m.len(), 36);
        assert_eq!(u32::from_ne_bytes(m[0..4].try_into().unwrap()), 36);
        assert_eq!(u16::from_ne_bytes(m[4..6].try_into().unwrap()), libc::RTM_NEWNEIGH);
        assert_eq!(m[16], libc::AF_INET as u8);
        assert_eq!(i32::from_ne_bytes(m[20..24].try_into().unwrap()), 7);
        assert_eq!(m[26], libc::NTF_USE);
        assert_eq!(u16::from_ne_bytes(m[30..32].try_into().unwrap()), libc::NDA_DST);
        assert_eq!(&m[32..36], &[10, 1, 2, 3]);
    }

    #[test]
    fn acks_are_matched_by_sequence() {
        let mut other = vec![0u8; 20];
        other[0..4].copy_from_slice(&20u32.to_ne_bytes());
        other[4..6].copy_from_slice(&(libc::NLMSG_ERROR as u16).to_ne_bytes());
        other[8..12].copy_from_slice(&4u32.to_ne_bytes());
        other[16..20].copy_from_slice(&(-17i32).to_ne_bytes());
        assert_eq!(ack_of(&other, 5), None);
        assert_eq!(ack_of(&other, 4), Some(-17));
        assert_eq!(ack_of(&other[..10], 4), None, "a truncated message is no answer");
    }
}
