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
    /// Run the event loop under the real-time policy SCHED_FIFO at this
    /// priority (1-99; low values such as 10 suffice): a completion or an
    /// arriving packet then preempts ordinary processes at once, as a NIC
    /// has its own CPU. The kernel's RT throttling
    /// (`kernel.sched_rt_runtime_us`, 95 % by default) keeps the machine
    /// usable; rnicd then sleeps as soon as it is idle instead of spinning.
    #[arg(long, value_name = "PRIO", value_parser = clap::value_parser!(u8).range(1..=99))]
    pub sched_fifo: Option<u8>,
    /// Most completion channels one client may hold (each is a descriptor
    /// in rnicd); a client beyond it gets an error, others are unaffected.
    #[arg(long, value_name = "N", default_value_t = crate::daemon::DEFAULT_MAX_CHANNELS_PER_CLIENT)]
    pub max_channels_per_client: usize,
}

pub fn rnicd(a: RnicdArgs) -> anyhow::Result<()> {
    let addr = match a.addr {
        Some(a) => a,
        None => crate::daemon::first_local_ipv4().context("no IPv4 address in this network namespace; pass --addr")?,
    };
    let sock = a.sock.unwrap_or_else(|| crate::daemon::default_socket_path(addr));
    if let Some(prio) = a.sched_fifo {
        set_sched_fifo(prio)?;
    }
    crate::daemon::run(crate::daemon::Config { addr, sock, gso: !a.no_gso, max_channels_per_client: a.max_channels_per_client }, None)
}

/// Puts the calling thread (rnicd's event loop) under SCHED_FIFO at `prio`;
/// processes it might start do not inherit the policy.
fn set_sched_fifo(prio: u8) -> anyhow::Result<()> {
    let param = libc::sched_param { sched_priority: i32::from(prio) };
    // SAFETY: plain system call on this thread with a valid parameter block.
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO | libc::SCHED_RESET_ON_FORK, &param) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error()).context(format!("--sched-fifo {prio}: sched_setscheduler"));
    }
    tracing::info!("event loop runs under SCHED_FIFO priority {prio}");
    Ok(())
}
