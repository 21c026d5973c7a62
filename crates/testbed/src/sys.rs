//! Running the system tools (ip, tc, nft) with errors that say what failed.

use anyhow::{bail, Context, Result};
use std::io::Write;
use std::process::{Command, Stdio};

/// Runs `cmd`, feeding `stdin` if given; returns stdout, or an error with the
/// command line and its stderr.
pub fn run(cmd: &mut Command, stdin: Option<&str>) -> Result<String> {
    let line = format!("{cmd:?}");
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd.stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() });
    let mut child = cmd.spawn().with_context(|| format!("cannot start {line}"))?;
    if let Some(input) = stdin {
        // A failing writer shows up as a failed command below.
        let _ = child.stdin.take().expect("piped stdin").write_all(input.as_bytes());
    }
    let out = child.wait_with_output().with_context(|| format!("waiting for {line}"))?;
    if !out.status.success() {
        let input = stdin.map(|s| format!("\ninput was:\n{s}")).unwrap_or_default();
        bail!("{line} failed ({}): {}{input}", out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `ip [-n NETNS] ARGS...`
pub fn ip(netns: Option<&str>, args: &[&str]) -> Result<String> {
    let mut c = Command::new("ip");
    if let Some(ns) = netns {
        c.args(["-n", ns]);
    }
    run(c.args(args), None)
}

/// Runs several `ip` commands in one process (`ip -batch -`), failing on the first error.
pub fn ip_batch(netns: &str, script: &str) -> Result<()> {
    run(Command::new("ip").args(["-n", netns, "-batch", "-"]), Some(script)).map(|_| ())
}

/// Bridges in `netns` forward frames as a switch does, without passing
/// them through the IP netfilter hooks: with `br_netfilter` loaded
/// (container hosts load it), a new namespace starts with
/// `bridge-nf-call-iptables` on, and every packet crossing the fabric then
/// takes the IPv4 hooks and a route lookup on the way. The fabric
/// namespace holds no rules. Nothing to do without `br_netfilter` (`-e`:
/// the keys do not exist).
pub fn bridge_without_netfilter(netns: &str) -> Result<()> {
    let keys = ["net.bridge.bridge-nf-call-iptables=0", "net.bridge.bridge-nf-call-ip6tables=0", "net.bridge.bridge-nf-call-arptables=0"];
    run(Command::new("ip").args(["netns", "exec", netns, "sysctl", "-e", "-q", "-w"]).args(keys), None).map(|_| ())
}

/// `tc -n NETNS ARGS...`
pub fn tc(netns: &str, args: &[&str]) -> Result<String> {
    run(Command::new("tc").args(["-n", netns]).args(args), None)
}

/// Loads an nftables script inside a namespace.
pub fn nft(netns: &str, script: &str) -> Result<()> {
    run(Command::new("ip").args(["netns", "exec", netns, "nft", "-f", "-"]), Some(script)).map(|_| ())
}

/// `nft ARGS...` inside a namespace, returning stdout.
pub fn nft_cmd(netns: &str, args: &[&str]) -> Result<String> {
    run(Command::new("ip").args(["netns", "exec", netns, "nft"]).args(args), None)
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

pub fn require_root() -> Result<()> {
    if !is_root() {
        bail!("the testbed needs root (it creates network namespaces); run as root or with sudo");
    }
    Ok(())
}

/// All network namespace names (`ip netns list`).
pub fn netns_list() -> Result<Vec<String>> {
    let out = ip(None, &["netns", "list"])?;
    Ok(out.lines().filter_map(|l| l.split_whitespace().next()).map(str::to_string).collect())
}

/// Pids of processes whose network namespace is `netns` (never our own).
pub fn netns_pids(netns: &str) -> Vec<i32> {
    let me = std::process::id() as i32;
    match ip(None, &["netns", "pids", netns]) {
        Ok(out) => out.lines().filter_map(|l| l.trim().parse().ok()).filter(|&p| p != me).collect(),
        Err(_) => Vec::new(),
    }
}

/// Kills every process in `netns` and waits (a few seconds at most) until none is left:
/// a live process would keep the namespace and its links alive after `ip netns del`.
pub fn kill_netns_processes(netns: &str) -> Result<()> {
    for _ in 0..100 {
        let pids = netns_pids(netns);
        if pids.is_empty() {
            return Ok(());
        }
        for pid in pids {
            // SAFETY: kill with a pid and a signal number has no memory effects.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    bail!("processes in network namespace {netns} survive SIGKILL: {:?}", netns_pids(netns))
}
