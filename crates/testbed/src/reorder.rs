//! Reordering without netem: a random fraction of the packets a host sends on a NIC
//! is held back for a while and sent after packets that left later.
//!
//! How: in the host namespace, an nft `route` chain on `output` marks the chosen
//! packets; a policy-routing rule sends marked packets to a tun device `tbdly{k}`;
//! a delayer (a thread of the testbed's owner, or a daemon for CLI testbeds) reads
//! them from the tun, waits, and sends them again through a raw socket whose
//! SO_MARK keeps them from being chosen twice. They then leave through `eth{k}`
//! like any other packet (rate and loss still apply).
//!
//! Counting: a packet is counted as held back when the delayer takes it from the tun,
//! not when it sends it again. Counting on release made a reader that asked right
//! after a fast TCP transfer see none: TCP recovers held segments by retransmission
//! long before the delay expires, so a 4 MB stream could end with every held packet
//! still waiting. And since the kernel queues a chosen packet in the tun before the
//! delayer thread reads it, [`Delayer::held`] first has the thread drain the tun.

use crate::{sys, Testbed};
use anyhow::{bail, Context, Result};
use std::collections::VecDeque;
use std::fs::File;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// fwmark of chosen packets on NIC k is CHOSEN_MARK + k; routing table TABLE + k.
const CHOSEN_MARK: u32 = 0x7e57_0010;
const TABLE: u32 = 7570;
/// Mark of packets the delayer sends again (never chosen a second time).
const RESENT_MARK: u32 = 0x7e57_00ff;
const SCALE: u64 = 1_000_000;
/// Most packets held back at once.
const MAX_HELD: usize = 100_000;

fn tun_name(nic: usize) -> String {
    format!("tbdly{nic}")
}

/// A running delayer; stops (and its tun device vanishes) when dropped.
pub struct Delayer {
    netns: String,
    nic: usize,
    counts: Arc<Counts>,
    thread: Option<JoinHandle<()>>,
}

/// Shared between a delayer's owner and its relay thread.
#[derive(Default)]
struct Counts {
    stop: AtomicBool,
    /// Packets taken from the tun to be held back.
    held: AtomicU64,
    /// Packets sent again after their delay.
    released: AtomicU64,
    /// Drain requests made by [`Delayer::held`], and the last one the relay served
    /// (it reads the request before draining the tun, then stores it here).
    drain_requested: AtomicU64,
    drain_served: AtomicU64,
}

/// How often the relay looks at its stop flag and drain requests when idle.
const IDLE_POLL: Duration = Duration::from_millis(20);

impl Delayer {
    /// Sets up reordering of `pct`% of the IPv4 packets sent on `eth{nic}` of `netns`,
    /// each held back by `delay`.
    pub fn start(netns: &str, nic: usize, pct: f64, delay: Duration) -> Result<Delayer> {
        if !(pct > 0.0 && pct <= 100.0) {
            bail!("reorder percentage must be in (0, 100], not {pct}");
        }
        if delay.is_zero() || delay > Duration::from_secs(10) {
            bail!("reorder delay must be between 1 ms and 10 s, not {delay:?}");
        }
        remove_rules(netns, nic);
        let (tun, raw) = open_in_netns(netns, nic)?;
        let dev = tun_name(nic);
        let table = (TABLE + nic as u32).to_string();
        let mark = format!("{:#x}", CHOSEN_MARK + nic as u32);
        sys::ip_batch(
            netns,
            &format!(
                "link set {dev} addrgenmode none\nlink set {dev} mtu 1500 txqueuelen 10000\nlink set {dev} up\n\
                 route replace default dev {dev} table {table}\n\
                 rule add fwmark {mark} table {table} priority 100\n"
            ),
        )?;
        let t = (pct * SCALE as f64 / 100.0).round() as u64;
        sys::nft(
            netns,
            &format!(
                "table ip tb_reorder_eth{nic} {{\n  chain out {{ type route hook output priority mangle; \
                 oifname \"eth{nic}\" meta mark 0 numgen random mod {SCALE} < {t} counter meta mark set {mark}; }}\n}}\n"
            ),
        )?;
        let counts = Arc::new(Counts::default());
        let thread = {
            let counts = counts.clone();
            std::thread::Builder::new().name(format!("tb-delay-{netns}-{nic}")).spawn(move || relay(tun, raw, delay, &counts))?
        };
        Ok(Delayer { netns: netns.into(), nic, counts, thread: Some(thread) })
    }

    /// Packets held back so far, including those still waiting for their delay.
    /// Every packet the kernel handed to the delayer before this call is counted:
    /// the relay thread drains its tun first (this waits for that, a few tens of ms
    /// at most; 0 more is reported when the relay has stopped).
    pub fn held(&self) -> u64 {
        let request = self.counts.drain_requested.fetch_add(1, Ordering::SeqCst) + 1;
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.counts.drain_served.load(Ordering::SeqCst) < request
            && self.thread.as_ref().is_some_and(|t| !t.is_finished())
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(1));
        }
        self.counts.held.load(Ordering::SeqCst)
    }

    /// Packets sent again after their delay so far.
    pub fn released(&self) -> u64 {
        self.counts.released.load(Ordering::SeqCst)
    }

    /// Blocks until the delayer stops (for the CLI daemon, which is killed instead).
    pub fn wait(mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Delayer {
    fn drop(&mut self) {
        self.counts.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        remove_rules(&self.netns, self.nic);
    }
}

/// Removes the nft table and routing rule (the tun device goes with its last fd).
/// Quiet when there is nothing to remove or the namespace is already gone.
pub fn remove_rules(netns: &str, nic: usize) {
    let _ = sys::nft(netns, &format!("add table ip tb_reorder_eth{nic}\ndelete table ip tb_reorder_eth{nic}\n"));
    let mark = format!("{:#x}", CHOSEN_MARK + nic as u32);
    while sys::ip(Some(netns), &["rule", "del", "fwmark", &mark]).is_ok() {}
    let _ = sys::ip(Some(netns), &["route", "flush", "table", &(TABLE + nic as u32).to_string()]);
}

/// Opens the tun device and the raw socket inside `netns` (they stay there).
fn open_in_netns(netns: &str, nic: usize) -> Result<(File, OwnedFd)> {
    let host = crate::Host { index: 0, netns: netns.into(), addrs: Vec::new() };
    host.in_netns(|| -> Result<(File, OwnedFd)> {
        use std::os::unix::fs::OpenOptionsExt;
        let tun = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open("/dev/net/tun")
            .context("cannot open /dev/net/tun")?;
        // SAFETY: ifreq is plain data; zeroed is a valid value.
        let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
        for (dst, src) in req.ifr_name.iter_mut().zip(tun_name(nic).bytes()) {
            *dst = src as libc::c_char;
        }
        req.ifr_ifru.ifru_flags = (libc::IFF_TUN | libc::IFF_NO_PI) as libc::c_short;
        // SAFETY: TUNSETIFF reads and writes one ifreq, which outlives the call.
        if unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETIFF, &mut req) } != 0 {
            bail!("TUNSETIFF {}: {}", tun_name(nic), std::io::Error::last_os_error());
        }
        // SAFETY: plain socket(2); the fd is owned right away.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::IPPROTO_RAW) };
        if fd < 0 {
            bail!("raw socket: {}", std::io::Error::last_os_error());
        }
        // SAFETY: fd is a fresh descriptor nobody else owns.
        let raw = unsafe { OwnedFd::from_raw_fd(fd) };
        nix::sys::socket::setsockopt(&raw, nix::sys::socket::sockopt::Mark, &RESENT_MARK).map_err(|e| anyhow::anyhow!("SO_MARK: {e}"))?;
        Ok((tun, raw))
    })?
}

/// Reads chosen packets from the tun and sends each again `delay` later.
fn relay(tun: File, raw: OwnedFd, delay: Duration, counts: &Counts) {
    let mut held: VecDeque<(Instant, Vec<u8>)> = VecDeque::new();
    let mut buf = vec![0u8; 65536];
    while !counts.stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        let wait = held.front().map_or(IDLE_POLL, |(due, _)| due.saturating_duration_since(now)).min(IDLE_POLL);
        let ts = libc::timespec { tv_sec: 0, tv_nsec: wait.as_nanos() as libc::c_long };
        let mut pfd = libc::pollfd { fd: tun.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one pollfd and a timespec that live across the call.
        let n = unsafe { libc::ppoll(&mut pfd, 1, &ts, std::ptr::null()) };
        if n > 0 && pfd.revents & (libc::POLLERR | libc::POLLHUP) != 0 && pfd.revents & libc::POLLIN == 0 {
            return;
        }
        // Read before draining: whatever was queued when the request was made is read below.
        let request = counts.drain_requested.load(Ordering::SeqCst);
        // Drain everything queued (the tun is non-blocking), so bursts are not dropped.
        loop {
            // SAFETY: reads into our own buffer of the given length.
            let len = unsafe { libc::read(tun.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if len < 0 {
                break;
            }
            // Bounded: past MAX_HELD the link is overloaded and the packet is lost.
            if len >= 20 && held.len() < MAX_HELD {
                held.push_back((Instant::now() + delay, buf[..len as usize].to_vec()));
                counts.held.fetch_add(1, Ordering::SeqCst);
            }
        }
        counts.drain_served.store(request, Ordering::SeqCst);
        let now = Instant::now();
        while held.front().is_some_and(|(due, _)| *due <= now) {
            let (_, pkt) = held.pop_front().unwrap();
            send_raw(&raw, &pkt);
            counts.released.fetch_add(1, Ordering::SeqCst);
        }
    }
}

fn send_raw(raw: &OwnedFd, pkt: &[u8]) {
    if pkt[0] >> 4 != 4 {
        return; // only IPv4 is routed here
    }
    let dst = Ipv4Addr::new(pkt[16], pkt[17], pkt[18], pkt[19]);
    let sa = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr { s_addr: u32::from(dst).to_be() },
        sin_zero: [0; 8],
    };
    // SAFETY: sendto reads pkt and sa, both valid for the call. A failed send is a lost packet.
    unsafe {
        libc::sendto(
            raw.as_raw_fd(),
            pkt.as_ptr().cast(),
            pkt.len(),
            0,
            &sa as *const _ as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        );
    }
}

/// Pid file of the daemon that runs a CLI testbed's delayer.
pub fn pid_file(name: &str, host: usize, nic: usize) -> std::path::PathBuf {
    std::path::PathBuf::from(crate::STATE_DIR).join(format!("{name}.h{host}.eth{nic}.reorder.pid"))
}

/// Removes the daemon pid and log files of testbed `name` (`NAME.hI.ethK.reorder.*`).
pub fn remove_pid_files(name: &str) {
    let Ok(dir) = std::fs::read_dir(crate::STATE_DIR) else { return };
    for e in dir.flatten() {
        let f = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = f.strip_prefix(name).and_then(|r| r.strip_prefix(".h")) else { continue };
        let parts: Vec<&str> = rest.split('.').collect();
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        if let [h, eth, "reorder", "pid" | "log"] = parts[..] {
            if digits(h) && eth.strip_prefix("eth").is_some_and(digits) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

impl Testbed {
    /// Holds back `pct`% of the IPv4 packets `host` sends on NIC `nic` by `delay`, so
    /// that later packets overtake them. The delayer runs in this process, as long as
    /// this handle lives; 0 removes it.
    pub fn set_reorder(&self, host: usize, nic: usize, pct: f64, delay: Duration) -> Result<()> {
        let h = self.check(host, nic)?.netns.clone();
        let mut delayers = self.delayers.lock().unwrap();
        delayers.remove(&(host, nic)); // stop the old one first: it owns the tun name
        if pct > 0.0 {
            delayers.insert((host, nic), Delayer::start(&h, nic, pct, delay)?);
        } else {
            remove_rules(&h, nic);
        }
        Ok(())
    }

    /// Packets held back so far by this handle's delayer on NIC `nic` of `host`
    /// (see [`Delayer::held`]: every packet chosen before the call is counted, even
    /// one not yet sent again).
    pub fn reordered(&self, host: usize, nic: usize) -> u64 {
        self.delayers.lock().unwrap().get(&(host, nic)).map_or(0, |d| d.held())
    }

    /// Packets this handle's delayer on NIC `nic` of `host` has sent again so far.
    pub fn reordered_released(&self, host: usize, nic: usize) -> u64 {
        self.delayers.lock().unwrap().get(&(host, nic)).map_or(0, |d| d.released())
    }
}
