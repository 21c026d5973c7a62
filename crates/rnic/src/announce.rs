//! Announcing a GID that moved to this host: gratuitous ARP.
//!
//! When a namespace's address moves, its peers must send to the new host at
//! once. An ordinary ARP request from the new host (what sending any packet
//! from the GID provokes) is not enough: Linux ignores the sender address of
//! a non-gratuitous ARP packet for an entry that was confirmed within the last
//! `locktime` (1 s by default) and stays REACHABLE at the old MAC. A gratuitous
//! ARP request (sender IP = target IP = the GID) always overrides, which is
//! why VMMs announce a moved guest with gratuitous ARP (or RARP). This is what
//! the owner of a namespace calls on the new host, before resuming its QPs.

use std::collections::HashMap;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::sync::Mutex;

use crate::iface::{Holder, Interfaces};

const ETH_P_ARP: u16 = 0x0806;

/// The interface of this network namespace that holds `ip`.
fn holder_of(ip: Ipv4Addr) -> io::Result<Holder> {
    Interfaces::read()?.holder(ip).ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("no interface holds {ip}")))
}

/// The ARP payload of a gratuitous request for `ip` from `mac`.
pub fn garp_request(mac: [u8; 6], ip: Ipv4Addr) -> [u8; 28] {
    let mut p = [0u8; 28];
    p[0..2].copy_from_slice(&1u16.to_be_bytes()); // Ethernet
    p[2..4].copy_from_slice(&0x0800u16.to_be_bytes()); // IPv4
    p[4] = 6;
    p[5] = 4;
    p[6..8].copy_from_slice(&1u16.to_be_bytes()); // request
    p[8..14].copy_from_slice(&mac);
    p[14..18].copy_from_slice(&ip.octets());
    // Target hardware address zero, target IP = sender IP: gratuitous.
    p[24..28].copy_from_slice(&ip.octets());
    p
}

/// A packet socket to send ARP frames from, in the calling thread's network
/// namespace. Opened with protocol 0 it receives nothing (no copy of the
/// host's ARP traffic queues up on it); each `sendto` names ARP.
fn packet_socket() -> io::Result<OwnedFd> {
    // SAFETY: socket() result checked and owned.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The packet socket of the calling thread's network namespace, opened on
/// first use and never closed. Closing a packet socket waits for an RCU
/// grace period (`packet_release` calls `synchronize_net`): 10-15 ms on a
/// loaded host, which a claim inside a migration's downtime paid after its
/// announcement and before the QPs could resume (the destination's resume
/// NAKs left 10 ms after its gratuitous ARP in packet traces).
fn shared_packet_socket() -> io::Result<RawFd> {
    static SOCKETS: Mutex<Option<HashMap<u64, OwnedFd>>> = Mutex::new(None);
    let netns = std::fs::metadata("/proc/thread-self/ns/net")?.ino();
    let mut g = SOCKETS.lock().unwrap_or_else(|e| e.into_inner());
    let map = g.get_or_insert_with(HashMap::new);
    if let Some(fd) = map.get(&netns) {
        return Ok(fd.as_raw_fd());
    }
    let fd = packet_socket()?;
    let raw = fd.as_raw_fd();
    map.insert(netns, fd);
    Ok(raw)
}

/// Where and what a gratuitous ARP for `ip` on interface `on` is: the
/// interface's broadcast address and the frame.
fn garp_on(on: &Holder, ip: Ipv4Addr) -> io::Result<(libc::sockaddr_ll, [u8; 28])> {
    let mac = on.mac.ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("{} has no link-layer address", on.name)))?;
    // SAFETY: a zeroed sockaddr_ll is valid; fields set below.
    let mut sa: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sa.sll_family = libc::AF_PACKET as u16;
    sa.sll_protocol = ETH_P_ARP.to_be();
    sa.sll_ifindex = on.index as i32;
    sa.sll_halen = 6;
    sa.sll_addr[..6].copy_from_slice(&[0xff; 6]);
    Ok((sa, garp_request(mac, ip)))
}

/// Sends `pkt` to `sa` from `fd`, `count` times (at least once).
fn send_frames(fd: RawFd, sa: &libc::sockaddr_ll, pkt: &[u8], count: usize) -> io::Result<()> {
    for _ in 0..count.max(1) {
        // SAFETY: valid buffer and sockaddr_ll.
        let r = unsafe {
            libc::sendto(
                fd,
                pkt.as_ptr() as *const libc::c_void,
                pkt.len(),
                0,
                sa as *const _ as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// A prepared announcement: the packet socket and frame are made ahead (in
/// the new host's network namespace, once the address is there), so that
/// announcing at move time is one `sendto` per packet from any thread.
pub struct Announcer {
    fd: OwnedFd,
    sa: libc::sockaddr_ll,
    pkt: [u8; 28],
    /// The interface that holds the address.
    pub interface: String,
}

impl Announcer {
    /// Prepares gratuitous ARP for `ip` on the interface of the calling
    /// thread's network namespace that holds it.
    pub fn new(ip: Ipv4Addr) -> io::Result<Announcer> {
        let on = holder_of(ip)?;
        let (sa, pkt) = garp_on(&on, ip)?;
        Ok(Announcer { fd: packet_socket()?, sa, pkt, interface: on.name })
    }

    /// Broadcasts `count` gratuitous ARP requests.
    pub fn announce(&self, count: usize) -> io::Result<()> {
        send_frames(self.fd.as_raw_fd(), &self.sa, &self.pkt, count)
    }
}

/// Broadcasts `count` gratuitous ARP requests for `ip` on the interface that
/// holds it (in the calling thread's network namespace), from the
/// namespace's long-lived packet socket. Returns the interface's name.
pub fn gratuitous_arp(ip: Ipv4Addr, count: usize) -> io::Result<String> {
    let on = holder_of(ip)?;
    announce_on(&on, ip, count)?;
    Ok(on.name)
}

/// [`gratuitous_arp`] on interface `on`, as a caller that has just read
/// the interfaces found it: no second read.
pub fn announce_on(on: &Holder, ip: Ipv4Addr, count: usize) -> io::Result<()> {
    let (sa, pkt) = garp_on(on, ip)?;
    send_frames(shared_packet_socket()?, &sa, &pkt, count)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn garp_layout() {
        let p = garp_request([2, 0, 0, 0, 0, 1], Ipv4Addr::new(10, 1, 2, 3));
        assert_eq!(&p[..8], &[0, 1, 8, 0, 6, 4, 0, 1]);
        assert_eq!(&p[14..18], &p[24..28], "sender IP = target IP");
        assert_eq!(&p[18..24], &[0; 6]);
    }
}
