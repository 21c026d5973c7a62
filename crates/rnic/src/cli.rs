//! `transit rnicd`: the software RDMA NIC daemon of one host.
use std::net::Ipv4Addr;
use std::path::PathBuf;

use anyhow::Context as _;

#[derive(clap::Args)]
pub struct RnicdArgs {
    /// The address (GID) to serve; UDP 4791 on it. Default: the first
    /// non-loopback IPv4 address of this network namespace.
    #[arg(long)]
    pub addr: Option<Ipv4Addr>,
    /// Control socket for local clients. Default: /run/transit/rnicd-<addr>.sock
    #[arg(long)]
    pub sock: Option<PathBuf>,
    /// Do not send equal-sized packets as UDP GSO batches (nor receive with
    /// GRO). Batching is on by default: several times cheaper per packet;
    /// each segment's ICRC covers the IP id the kernel gives it. Off, every
    /// packet is its own skb (captures on a veth then show wire packets, and
    /// nftables faults act per packet rather than per batch).
    #[arg(long)]
    pub no_gso: bool,
    /// Accepted for compatibility: batching is the default.
    #[arg(long, hide = true)]
    pub gso: bool,
}

pub fn rnicd(a: RnicdArgs) -> anyhow::Result<()> {
    let addr = match a.addr {
        Some(a) => a,
        None => crate::daemon::first_local_ipv4().context("no IPv4 address in this network namespace; pass --addr")?,
    };
    let sock = a.sock.unwrap_or_else(|| crate::daemon::default_socket_path(addr));
    crate::daemon::run(crate::daemon::Config { addr, sock, gso: !a.no_gso }, None)
}
