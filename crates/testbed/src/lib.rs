//! Multi-host testbeds made of Linux network namespaces.
//!
//! A testbed named `NAME` is:
//! - one fabric namespace `NAME-fab` holding a bridge `br{k}` per NIC index `k`
//!   (the root namespace is never touched);
//! - one namespace per host, `NAME-h{i}`, with interfaces `eth0` (and `eth1`), each a
//!   veth whose peer `h{i}e{k}` is a port of bridge `br{k}`; host `i` has address
//!   `10.(200+k).INDEX.(i+1)/24` on `eth{k}`, where INDEX is unique per live testbed;
//! - a state file `/run/transit-testbed/NAME.json` naming the owner process, so that
//!   a testbed whose owner died is removed by the next [`Testbed::create`].
//!
//! ```no_run
//! let tb = testbed::Testbed::create(testbed::TestbedOpts::new("mytest", 2))?;
//! let out = tb.host(0).sh(&format!("echo reaching {}", tb.host(1).addr(0)))?;
//! # anyhow::Ok(())
//! ```

pub mod build;
pub mod cli;
pub mod cpu_distance;
mod faults;
mod host;
mod reorder;
pub mod rnicd;
mod state;
mod sys;

pub use host::{Host, HostChild};
pub use state::STATE_DIR;

use anyhow::{bail, Context, Result};
use state::{DirLock, Owner, State};
use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;

/// Most hosts in one testbed (addresses .1-.100; .101-.254 are spare, see [`Testbed::spare_addr`]).
pub const MAX_HOSTS: usize = 100;
/// Most NICs per host.
pub const MAX_NICS: usize = 2;

/// How to build a testbed.
#[derive(Clone, Debug)]
pub struct TestbedOpts {
    /// Name prefix; the testbed is named `PREFIX-PID-COUNTER` unless `exact_name`.
    pub prefix: String,
    /// Use `prefix` itself as the name (the CLI does; tests should not).
    pub exact_name: bool,
    pub hosts: usize,
    /// NICs per host (1 or 2); NIC `k` of every host is on bridge `br{k}`, subnet `10.(200+k).INDEX.0/24`.
    pub nics: usize,
    /// Link rate of every host NIC, both directions, in Mbit/s (None: unlimited).
    pub rate_mbit: Option<u32>,
    /// Per-host link rates (host index, Mbit/s) for all of that host's NICs; they
    /// override `rate_mbit`.
    pub host_rates: Vec<(usize, u32)>,
    /// No owner: the testbed is kept when the handle drops and the process exits,
    /// until [`down`] (what `transit testbed up` makes).
    pub persistent: bool,
}

impl TestbedOpts {
    pub fn new(prefix: &str, hosts: usize) -> TestbedOpts {
        TestbedOpts { prefix: prefix.into(), exact_name: false, hosts, nics: 1, rate_mbit: None, host_rates: Vec::new(), persistent: false }
    }
    pub fn nics(mut self, nics: usize) -> Self {
        self.nics = nics;
        self
    }
    pub fn rate_mbit(mut self, rate: u32) -> Self {
        self.rate_mbit = Some(rate);
        self
    }
    /// Link rate of one host's NICs.
    pub fn host_rate(mut self, host: usize, rate: u32) -> Self {
        self.host_rates.push((host, rate));
        self
    }
}

/// A live testbed. Dropping an owned testbed removes everything it made.
pub struct Testbed {
    name: String,
    index: u8,
    hosts: Vec<Host>,
    nics: usize,
    remove_on_drop: bool,
    /// Delayers for reordering, by (host, nic); they run in this process.
    delayers: Mutex<HashMap<(usize, usize), reorder::Delayer>>,
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// Names become namespace and file names: keep them short and plain.
pub fn validate_name(name: &str) -> Result<()> {
    let ok_chars = name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.');
    if name.is_empty() || name.len() > 40 || !ok_chars || !name.starts_with(|c: char| c.is_ascii_alphanumeric()) {
        bail!("bad testbed name {name:?}: use 1-40 letters, digits, '-', '_' or '.', starting with a letter or digit");
    }
    Ok(())
}

fn fabric_netns(name: &str) -> String {
    format!("{name}-fab")
}

fn host_netns(name: &str, i: usize) -> String {
    format!("{name}-h{i}")
}

fn host_addr(index: u8, nic: usize, host: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 200 + nic as u8, index, host as u8 + 1)
}

impl Testbed {
    /// Builds a testbed. First removes testbeds whose owner process has died.
    pub fn create(opts: TestbedOpts) -> Result<Testbed> {
        sys::require_root()?;
        if opts.hosts == 0 || opts.hosts > MAX_HOSTS {
            bail!("a testbed has 1 to {MAX_HOSTS} hosts, not {}", opts.hosts);
        }
        if let Some((h, _)) = opts.host_rates.iter().find(|(h, _)| *h >= opts.hosts) {
            bail!("a rate for host {h}, but the testbed has hosts 0..{}", opts.hosts);
        }
        if opts.nics == 0 || opts.nics > MAX_NICS {
            bail!("a host has 1 or 2 NICs, not {}", opts.nics);
        }
        let name = if opts.exact_name {
            opts.prefix.clone()
        } else {
            format!("{}-{}-{}", opts.prefix, std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed))
        };
        validate_name(&name)?;

        let state = {
            let _lock = DirLock::acquire()?;
            sweep_locked();
            if state::read(&name)?.is_some() || exists_any_netns(&name)? {
                bail!("testbed {name} already exists (remove it with `transit testbed down {name}`)");
            }
            let state = State {
                name: name.clone(),
                index: state::free_index()?,
                hosts: opts.hosts,
                nics: opts.nics,
                owner: if opts.persistent { None } else { Some(Owner::me()) },
            };
            // Written before anything exists, so a crash from here on is recoverable.
            state::write(&state)?;
            state
        };

        let tb = Testbed {
            hosts: (0..opts.hosts)
                .map(|i| Host {
                    index: i,
                    netns: host_netns(&name, i),
                    addrs: (0..opts.nics).map(|k| host_addr(state.index, k, i)).collect(),
                })
                .collect(),
            name,
            index: state.index,
            nics: opts.nics,
            // Even a persistent testbed is removed if building it fails.
            remove_on_drop: true,
            delayers: Mutex::new(HashMap::new()),
        };
        tb.build().with_context(|| format!("building testbed {}", tb.name))?;
        tb.wait_links_ready(None)?;
        for h in 0..tb.hosts.len() {
            let rate = opts.host_rates.iter().rev().find(|(i, _)| *i == h).map(|&(_, r)| r).or(opts.rate_mbit);
            for k in 0..tb.nics {
                if rate.is_some() {
                    tb.set_rate(h, k, rate)?;
                }
            }
        }
        let mut tb = tb;
        tb.remove_on_drop = !opts.persistent;
        tracing::debug!("testbed {} up: {} hosts, {} NICs, index {}", tb.name, tb.hosts.len(), tb.nics, tb.index);
        Ok(tb)
    }

    /// A handle on an existing testbed (made by the CLI or another process); dropping it
    /// removes nothing.
    pub fn open(name: &str) -> Result<Testbed> {
        validate_name(name)?;
        let Some(st) = state::read(name)? else {
            bail!("no testbed named {name} (see `transit testbed list`)");
        };
        Ok(Testbed {
            hosts: (0..st.hosts)
                .map(|i| Host { index: i, netns: host_netns(name, i), addrs: (0..st.nics).map(|k| host_addr(st.index, k, i)).collect() })
                .collect(),
            name: st.name,
            index: st.index,
            nics: st.nics,
            remove_on_drop: false,
            delayers: Mutex::new(HashMap::new()),
        })
    }

    fn build(&self) -> Result<()> {
        let fab = fabric_netns(&self.name);
        sys::ip(None, &["netns", "add", &fab])?;
        sys::bridge_without_netfilter(&fab)?;
        let mut script = String::from("link set lo up\n");
        for k in 0..self.nics {
            // No STP: ports forward at once. No IPv6 link-local: the fabric stays silent.
            script += &format!(
                "link add br{k} type bridge stp_state 0 mcast_snooping 0\n\
                 link set br{k} addrgenmode none\nlink set br{k} up\n"
            );
        }
        for h in &self.hosts {
            sys::ip(None, &["netns", "add", &h.netns])?;
            for k in 0..self.nics {
                let port = format!("h{}e{k}", h.index);
                script += &format!(
                    "link add {port} type veth peer name eth{k} netns {}\n\
                     link set {port} addrgenmode none\nlink set {port} master br{k}\nlink set {port} up\n",
                    h.netns
                );
            }
        }
        sys::ip_batch(&fab, &script)?;
        for h in &self.hosts {
            let mut script = String::from("link set lo up\n");
            for (k, addr) in h.addrs.iter().enumerate() {
                // No IPv6 link-local either: only the traffic a test makes crosses the links.
                script += &format!("link set eth{k} addrgenmode none\naddr add {addr}/24 dev eth{k}\nlink set eth{k} up\n");
            }
            sys::ip_batch(&h.netns, &script)?;
        }
        Ok(())
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Waits until links pass traffic: both veth ends operationally UP and the bridge
    /// port forwarding. A link that was just set up drops packets until the kernel's
    /// link watcher (a global worker, slow when namespaces come and go) activates it.
    pub(crate) fn wait_links_ready(&self, only: Option<(usize, usize)>) -> Result<()> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            let fab = sys::ip(Some(&self.fabric()), &["-d", "-o", "link", "show"])?;
            let mut waiting = Vec::new();
            for h in &self.hosts {
                if only.is_some_and(|(oh, _)| oh != h.index) {
                    continue;
                }
                let links = sys::ip(Some(&h.netns), &["-o", "link", "show"])?;
                for k in 0..self.nics {
                    if only.is_some_and(|(_, ok)| ok != k) {
                        continue;
                    }
                    let port = format!("h{}e{k}", h.index);
                    let port_ok =
                        line_of(&fab, &port).is_some_and(|l| l.contains(" state UP ") && l.contains("bridge_slave state forwarding"));
                    let eth_ok = line_of(&links, &format!("eth{k}")).is_some_and(|l| l.contains(" state UP "));
                    if !(port_ok && eth_ok) {
                        waiting.push(port);
                    }
                }
            }
            if waiting.is_empty() {
                return Ok(());
            }
            if std::time::Instant::now() > deadline {
                bail!("links of testbed {} not up after 20 s: {}", self.name, waiting.join(" "));
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    /// Host `i`; panics if out of range (see [`Testbed::try_host`]).
    pub fn host(&self, i: usize) -> &Host {
        self.try_host(i).unwrap()
    }

    pub fn try_host(&self, i: usize) -> Result<&Host> {
        match self.hosts.get(i) {
            Some(h) => Ok(h),
            None => bail!("testbed {} has hosts 0..{}, no host {i}", self.name, self.hosts.len()),
        }
    }

    pub fn hosts(&self) -> &[Host] {
        &self.hosts
    }

    pub fn nics(&self) -> usize {
        self.nics
    }

    /// The subnet of NIC `nic`: (network address, prefix length).
    pub fn subnet(&self, nic: usize) -> (Ipv4Addr, u8) {
        (Ipv4Addr::new(10, 200 + nic as u8, self.index, 0), 24)
    }

    /// An address of NIC `nic`'s subnet that no host has (j in 0..154), e.g. for an
    /// address that moves with a VM.
    pub fn spare_addr(&self, nic: usize, j: usize) -> Ipv4Addr {
        assert!(j < 154, "spare addresses are numbered 0..154");
        Ipv4Addr::new(10, 200 + nic as u8, self.index, (MAX_HOSTS + 1 + j) as u8)
    }

    /// The fabric namespace (holds the bridges and the host-side links' peers).
    pub fn fabric(&self) -> String {
        fabric_netns(&self.name)
    }

    pub(crate) fn check(&self, host: usize, nic: usize) -> Result<&Host> {
        let h = self.try_host(host)?;
        if nic >= self.nics {
            bail!("testbed {} hosts have NICs 0..{}, no NIC {nic}", self.name, self.nics);
        }
        Ok(h)
    }

    /// Removes the testbed now (also what dropping an owned testbed does).
    pub fn down(mut self) -> Result<()> {
        self.remove_on_drop = false;
        self.delayers.lock().unwrap().clear();
        down(&self.name)
    }
}

impl Drop for Testbed {
    fn drop(&mut self) {
        if let Ok(mut d) = self.delayers.lock() {
            d.clear();
        }
        if self.remove_on_drop {
            if let Err(e) = down(&self.name) {
                eprintln!("testbed: cannot remove {}: {e:#}", self.name);
            }
        }
    }
}

/// The `ip -o link` line of interface `dev` (named `dev` or `dev@peer`).
fn line_of<'a>(links: &'a str, dev: &str) -> Option<&'a str> {
    links.lines().find(|l| {
        l.split_whitespace().nth(1).is_some_and(|n| {
            let n = n.trim_end_matches(':');
            n == dev || n.split('@').next() == Some(dev)
        })
    })
}

/// Whether a namespace of testbed `name` exists.
fn exists_any_netns(name: &str) -> Result<bool> {
    Ok(sys::netns_list()?.iter().any(|ns| is_member_netns(name, ns)))
}

/// `NAME-fab` or `NAME-h<digits>`: the namespaces testbed `name` makes.
fn is_member_netns(name: &str, netns: &str) -> bool {
    match netns.strip_prefix(name).and_then(|r| r.strip_prefix('-')) {
        Some("fab") => true,
        Some(r) => r.strip_prefix('h').is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit())),
        None => false,
    }
}

/// Removes testbed `name` completely: kills every process in its hosts, deletes its
/// namespaces (and with them its links, bridges, qdiscs and nft tables) and its state
/// file. Works after a crash, and without a state file (by namespace names).
pub fn down(name: &str) -> Result<()> {
    sys::require_root()?;
    validate_name(name)?;
    let mut found = state::read(name).ok().flatten().is_some();
    let members: Vec<String> = sys::netns_list()?.into_iter().filter(|ns| is_member_netns(name, ns)).collect();
    found |= !members.is_empty();
    if !found {
        bail!("no testbed named {name} (see `transit testbed list`)");
    }
    // Hosts first (their processes may hold links), the fabric last.
    let (fab, hosts): (Vec<_>, Vec<_>) = members.iter().partition(|ns| ns.ends_with("-fab"));
    let mut errors = Vec::new();
    for ns in hosts.iter().chain(fab.iter()) {
        if let Err(e) = sys::kill_netns_processes(ns) {
            errors.push(format!("{e:#}"));
        }
        if let Err(e) = sys::ip(None, &["netns", "del", ns]) {
            errors.push(format!("{e:#}"));
        }
    }
    reorder::remove_pid_files(name);
    if !errors.is_empty() {
        bail!("removing testbed {name}: {}", errors.join("; "));
    }
    // Last, so that a crash while removing leaves the testbed findable.
    state::remove(name);
    Ok(())
}

/// Removes testbeds whose owner has died (call with the directory lock held).
fn sweep_locked() {
    for st in state::all() {
        if let Some(owner) = st.owner {
            if !owner.is_alive() {
                tracing::info!("removing testbed {} left behind by dead process {}", st.name, owner.pid);
                if let Err(e) = down(&st.name) {
                    eprintln!("testbed: cannot remove stale {}: {e:#}", st.name);
                }
            }
        }
    }
}

/// Removes every testbed whose owner process has died.
pub fn sweep() -> Result<()> {
    sys::require_root()?;
    let _lock = DirLock::acquire()?;
    sweep_locked();
    Ok(())
}

/// What `transit testbed list` shows.
#[derive(Debug, Clone)]
pub struct TestbedInfo {
    pub name: String,
    pub hosts: usize,
    pub nics: usize,
    pub index: Option<u8>,
    /// None: persistent (CLI); Some((pid, alive)).
    pub owner: Option<(i32, bool)>,
    /// Namespaces exist but the state file is gone (crash while removing).
    pub orphan: bool,
}

/// Testbeds known by state file, plus orphaned namespaces without one.
pub fn list() -> Result<Vec<TestbedInfo>> {
    let mut out: Vec<TestbedInfo> = state::all()
        .into_iter()
        .map(|s| TestbedInfo {
            name: s.name,
            hosts: s.hosts,
            nics: s.nics,
            index: Some(s.index),
            owner: s.owner.map(|o| (o.pid, o.is_alive())),
            orphan: false,
        })
        .collect();
    for ns in sys::netns_list().unwrap_or_default() {
        if let Some(name) = ns.strip_suffix("-fab") {
            if !out.iter().any(|t| t.name == name) {
                let hosts = sys::netns_list()?.iter().filter(|n| is_member_netns(name, n)).count() - 1;
                out.push(TestbedInfo { name: name.into(), hosts, nics: 0, index: None, owner: None, orphan: true });
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn member_names() {
        assert!(is_member_netns("a", "a-fab"));
        assert!(is_member_netns("a", "a-h12"));
        assert!(!is_member_netns("a", "a-h"));
        assert!(!is_member_netns("a", "a-h0-h0"));
        assert!(!is_member_netns("a", "ab-h0"));
        assert!(!is_member_netns("a-h0", "a-h0"));
    }

    #[test]
    fn names() {
        assert!(validate_name("tb-1-2").is_ok());
        assert!(validate_name("").is_err());
        assert!(validate_name("-x").is_err());
        assert!(validate_name("a/b").is_err());
        assert!(validate_name(&"x".repeat(41)).is_err());
    }
}
