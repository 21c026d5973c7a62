//! Several links between two hosts: which address each connection of a
//! migration goes to, how a channel whose link died is noticed, and the
//! per-link statistics.
//!
//! A migration address may name several destination addresses, one per
//! link (`tcp:10.200.1.2:4444,10.201.1.2:4444`). The data channels are
//! spread over them round-robin, as SMB multichannel spreads its
//! connections over interfaces; the control connection goes to the first,
//! with a waiting one on every other ([`crate::control_conn`]), and over
//! tcp postcopy opens an urgent connection to each. With several links, a data channel
//! whose link dies is dropped and its unconfirmed pages go again on the
//! others ([`crate::sender::ChannelSet`]); the migration fails only when
//! no channel is left.
//!
//! The rdma transport spreads its queue pairs the same way. One rnicd per
//! host serves every link: each link's queue pairs live in the rnicd
//! namespace of the local address that faces that link (the address the
//! kernel routes the peer's address from, [`local_addr_towards`]), as one
//! RNIC with a port per link would. A queue pair on a dead link fails
//! with retry exceeded after about [`LINK_TIMEOUT`] ([`RDMA_LINK_TIMEOUT`],
//! [`RDMA_LINK_RETRIES`]), and its channel is failed over like a TCP one.
//!
//! Every rdma queue pair of a migration (data channels and postcopy's
//! READs) takes the path MTU its link carries whole (`verbs::Qp::connect`
//! caps it at the active MTU of rnicd's port for the address, `rnic::link`):
//! the largest whose packets fit the MTU of the interface holding the
//! local address, 1024 on a 1500-byte link, 4096 on a jumbo one. Larger
//! packets would leave IP-fragmented, and a fragment lost (a full queue,
//! a rate cap) pins the others of its packet in the receiving host's
//! reassembly memory for 30 s: a few thousand such losses fill it (4 MiB,
//! per host, shared by all its links), and from then on the host drops
//! every fragmented packet, so every queue pair of every link retries out.

use anyhow::{anyhow, bail, Context as _, Result};
use std::net::{IpAddr, Ipv4Addr, TcpStream, ToSocketAddrs, UdpSocket};
use std::os::fd::AsRawFd;
use std::time::Duration;

/// How long a data channel's sent bytes may stay unacknowledged before its
/// link counts as dead (TCP_USER_TIMEOUT), when there are other links to
/// go on with. One link keeps the longer timeout of [`crate::wire::tune_socket`]:
/// there is nothing to fail over to, and a slow link should not fail.
pub const LINK_TIMEOUT: Duration = Duration::from_secs(4);

/// The IB ACK timeout exponent of an rdma channel's queue pair with
/// several links: 4.096 us x 2^17 = 0.54 s without an acknowledgement.
/// rnicd doubles the wait on each consecutive timeout and resets its
/// retries on any progress, so [`RDMA_LINK_RETRIES`] retries make
/// 0.54 + 1.07 + 2.15 = 3.8 s of silence, about [`LINK_TIMEOUT`], before
/// the queue pair fails with retry exceeded. With one link the queue
/// pairs keep verbs' defaults (about 13 s): there is nothing to fail over to.
pub const RDMA_LINK_TIMEOUT: u8 = 17;
/// Retransmissions after the first timeout (see [`RDMA_LINK_TIMEOUT`]).
pub const RDMA_LINK_RETRIES: u8 = 2;

/// The destination addresses of one migration, one per link.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Links {
    addrs: Vec<String>,
    /// Taken from a list of several ([`Links::from_link`]): the addresses
    /// name links of their own, even when one is left.
    part_of_several: bool,
}

impl Links {
    /// `tcp:HOST:PORT[,HOST:PORT...]` (each part may carry its own `tcp:`).
    pub fn parse(uri: &str) -> Result<Links> {
        let body = uri.strip_prefix("tcp:").unwrap_or(uri);
        let mut addrs = Vec::new();
        for part in body.split(',') {
            let a = part.trim();
            let a = a.strip_prefix("tcp:").unwrap_or(a);
            let port_ok = a.rsplit_once(':').is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok());
            if !port_ok {
                bail!("bad migration address {uri:?} (expected tcp:HOST:PORT, or several HOST:PORT separated by commas)");
            }
            if addrs.iter().any(|x| x == a) {
                bail!("migration address {uri:?} names {a} twice");
            }
            addrs.push(a.to_string());
        }
        if addrs.len() > 8 {
            bail!("migration address {uri:?} names {} links; at most 8", addrs.len());
        }
        Ok(Links { addrs, part_of_several: false })
    }

    /// The first link's address: the control connection starts there.
    pub fn first(&self) -> &str {
        &self.addrs[0]
    }

    pub fn len(&self) -> usize {
        self.addrs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.addrs.is_empty()
    }

    /// The links from `k` on (those before it are left out).
    pub fn from_link(&self, k: usize) -> Links {
        Links { addrs: self.addrs[k..].to_vec(), part_of_several: self.part_of_several || self.several() }
    }

    /// More than one link: a channel lost with its link is failed over.
    pub fn several(&self) -> bool {
        self.addrs.len() > 1
    }

    /// Each address is a link of its own, whose rdma queue pairs live in
    /// the rnicd namespace of the local address facing it: several
    /// addresses, or what is left of several after a recovery passed over
    /// a dead link (the rnicd's own address may be on that link). One
    /// address given alone may be a loopback or proxied control address
    /// that names no namespace a peer can reach: the rnicd's own then.
    pub fn namespace_per_link(&self) -> bool {
        self.several() || self.part_of_several
    }

    /// The link of data channel `i`: round-robin.
    pub fn of_channel(&self, i: usize) -> usize {
        i % self.addrs.len()
    }

    pub fn addr(&self, link: usize) -> &str {
        &self.addrs[link]
    }

    /// The statistics entries, one per link, before anything moved.
    pub fn stats(&self, channels: u32) -> Vec<LinkStat> {
        (0..self.addrs.len())
            .map(|k| LinkStat {
                addr: self.addrs[k].clone(),
                channels: (0..channels as usize).filter(|&i| self.of_channel(i) == k).count() as u32,
                ..LinkStat::default()
            })
            .collect()
    }
}

impl std::fmt::Display for Links {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "{}", self.addrs.join(","))
    }
}

/// What one link carried (source side, in `query-migrate`'s `links`).
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize, PartialEq)]
#[serde(default)]
pub struct LinkStat {
    /// The destination address of this link.
    pub addr: String,
    /// Data channels opened on it.
    pub channels: u32,
    /// Of those, lost with the link (their pages went again on others).
    pub channels_lost: u32,
    /// Every channel of it was lost: the link is out of the migration.
    pub failed: bool,
    /// Why its first channel was lost (the transport's error).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Page batch bytes written to its channels.
    pub wire_bytes: u64,
    /// `wire_bytes` over the migration's time so far.
    pub throughput_gbps: f64,
    /// The control connection rides this link now (source side).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub control: bool,
}

/// The local IPv4 address the kernel sends from towards `addr`
/// (`HOST:PORT`): the address of the link that reaches it. No packet is
/// sent (a connected UDP socket only looks the route up).
pub fn local_addr_towards(addr: &str) -> Result<Ipv4Addr> {
    let sa =
        addr.to_socket_addrs().with_context(|| format!("resolving {addr}"))?.next().ok_or_else(|| anyhow!("{addr} resolves to nothing"))?;
    let s = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
    s.connect(sa).with_context(|| format!("no route to {addr}"))?;
    match s.local_addr()?.ip() {
        IpAddr::V4(ip) if !ip.is_unspecified() => Ok(ip),
        ip => bail!("the route to {addr} leaves from {ip}, not an IPv4 address rnicd can serve"),
    }
}

/// Data sockets on a link that died report an error or a hang-up: TCP gave
/// up on unacknowledged bytes (`LINK_TIMEOUT`), or the peer reset them.
pub fn socket_broken(s: &TcpStream) -> bool {
    let mut pfd = libc::pollfd { fd: s.as_raw_fd(), events: 0, revents: 0 };
    // SAFETY: one valid pollfd, no wait.
    let n = unsafe { libc::poll(&mut pfd, 1, 0) };
    n > 0 && pfd.revents & (libc::POLLERR | libc::POLLHUP) != 0
}

/// Give a socket of one of several links the shorter [`LINK_TIMEOUT`].
/// It bounds an idle socket too: TCP_USER_TIMEOUT alone fails a socket
/// only while it has unacknowledged bytes, so on a link cut with no reset
/// (a dropping firewall, a dead switch port) a socket whose two ends both
/// wait to read would wait for ever; the keepalive probes every migration
/// socket sends after 2 s of silence ([`crate::wire::tune_socket`]) are
/// such bytes, and the user timeout then bounds them, not their count.
pub fn shorten_timeout(s: &TcpStream) {
    use nix::sys::socket::{setsockopt, sockopt};
    if let Err(e) = setsockopt(s, sockopt::TcpUserTimeout, &(LINK_TIMEOUT.as_millis() as u32)) {
        tracing::debug!("TCP_USER_TIMEOUT not set: {e}");
    }
}

impl LinkStat {
    /// One of its channels was lost with it, for `why`.
    pub fn channel_lost(&mut self, why: &anyhow::Error) {
        self.channels_lost += 1;
        self.failed = self.channels_lost >= self.channels;
        self.error.get_or_insert_with(|| format!("{why:#}"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_one_and_several_addresses() {
        let one = Links::parse("tcp:10.0.0.2:4444").unwrap();
        assert_eq!(one.len(), 1);
        assert!(!one.several());
        assert_eq!(one.first(), "10.0.0.2:4444");
        let two = Links::parse("tcp:10.0.1.2:4444,10.0.2.2:4445").unwrap();
        assert_eq!(two.len(), 2);
        assert_eq!(two.addr(1), "10.0.2.2:4445");
        assert_eq!(Links::parse("tcp:a:1,tcp:b:2").unwrap().to_string(), "a:1,b:2");
        assert_eq!(Links::parse("a:1").unwrap().first(), "a:1");
        assert_eq!(two.from_link(1).to_string(), "10.0.2.2:4445");
        assert!(!one.namespace_per_link());
        assert!(two.namespace_per_link());
        assert!(two.from_link(1).namespace_per_link(), "a link left of two is still a link of its own");
        assert!(!two.from_link(1).several());
        for bad in ["tcp:", "tcp:a", "tcp:a:1,", "tcp:a:1,b", "tcp::1", "tcp:a:99999", "tcp:a:1,a:1"] {
            assert!(Links::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn channels_go_round_robin() {
        let l = Links::parse("a:1,b:1").unwrap();
        assert_eq!((0..5).map(|i| l.of_channel(i)).collect::<Vec<_>>(), vec![0, 1, 0, 1, 0]);
        let mut s = l.stats(5);
        assert_eq!((s[0].channels, s[1].channels), (3, 2));
        s[1].channel_lost(&anyhow!("first"));
        assert!(!s[1].failed, "one channel of two lost: the link still carries");
        s[1].channel_lost(&anyhow!("second"));
        assert!(s[1].failed);
        assert_eq!(s[1].error.as_deref(), Some("first"), "the first loss says why");
    }

    #[test]
    fn a_socket_of_several_links_times_out_idle_too() {
        use nix::sys::socket::{getsockopt, sockopt};
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let s = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        crate::wire::tune_socket(&s);
        shorten_timeout(&s);
        assert_eq!(getsockopt(&s, sockopt::TcpUserTimeout).unwrap(), LINK_TIMEOUT.as_millis() as u32);
        assert!(getsockopt(&s, sockopt::KeepAlive).unwrap(), "an idle socket is probed");
        assert!(getsockopt(&s, sockopt::TcpKeepIdle).unwrap() < LINK_TIMEOUT.as_secs() as u32, "probed before the timeout");
    }

    #[test]
    fn the_local_address_towards_a_peer_is_the_routed_one() {
        assert_eq!(local_addr_towards("127.0.0.1:4791").unwrap(), Ipv4Addr::LOCALHOST);
        assert!(local_addr_towards("nohost.invalid:1").is_err());
    }
}
