//! `transit testbed ...`: the command-line face of the testbed library.

use crate::{reorder, sys, Testbed, TestbedOpts};
use anyhow::{bail, Context, Result};
use std::os::unix::process::CommandExt;
use std::process::Stdio;
use std::time::{Duration, Instant};

#[derive(clap::Subcommand)]
pub enum TestbedCmd {
    /// Create a testbed of N hosts; it stays until `down`.
    ///
    /// The hosts are network namespaces NAME-h0, NAME-h1, ... whose NICs eth0 (and
    /// eth1) sit on bridges in the namespace NAME-fab.
    Up {
        /// Testbed name (letters, digits, '-', '_', '.').
        name: String,
        /// Number of hosts.
        #[arg(long, default_value_t = 2)]
        hosts: usize,
        /// NICs per host (1 or 2); NIC k of every host is on its own bridge and subnet 10.(200+k).X.0/24.
        #[arg(long, default_value_t = 1)]
        nics: usize,
        /// Link rate of every host NIC, each direction, in Mbit/s (tc tbf).
        #[arg(long)]
        rate_mbit: Option<u32>,
        /// Random loss of IPv4 packets on every host link, each direction, in percent
        /// (nftables); a packet between two hosts crosses two links.
        #[arg(long)]
        loss: Option<f64>,
    },
    /// Run a command inside one host, e.g. `transit testbed exec tb h1 -- ip addr`.
    Exec {
        name: String,
        /// Host index (1) or name (h1, or the namespace name tb-h1).
        host: String,
        /// The command and its arguments, after `--`.
        #[arg(last = true, required = true)]
        cmd: Vec<String>,
    },
    /// Remove a testbed completely, also after a crash.
    ///
    /// Kills its processes and removes its namespaces, links, bridges, rules and state,
    /// with or without its state file.
    Down { name: String },
    /// List testbeds with their hosts, NICs, subnets and owner.
    List,
    /// Remove every testbed whose owner process has died.
    Sweep,
    /// Change the link rate and faults of one host's NIC.
    ///
    /// Settings not given are kept; 0 removes one.
    Shape {
        name: String,
        /// Host index (1) or name (h1).
        host: String,
        /// Which NIC of the host (0 = eth0).
        #[arg(long, default_value_t = 0)]
        nic: usize,
        /// Link rate in Mbit/s, each direction; 0 removes the limit.
        #[arg(long)]
        rate_mbit: Option<u32>,
        /// Percent of IPv4 packets dropped, each direction; 0 removes.
        #[arg(long)]
        loss: Option<f64>,
        /// Percent of sent IPv4 packets that are sent twice; 0 removes.
        #[arg(long)]
        dup: Option<f64>,
        /// Percent of sent IPv4 packets held back (see --reorder-delay-ms) so that later
        /// ones overtake them; 0 removes.
        #[arg(long)]
        reorder: Option<f64>,
        /// How long reordered packets are held back.
        #[arg(long, default_value_t = 10)]
        reorder_delay_ms: u64,
        /// Cut the NIC (down, like a pulled cable) or reconnect it (up).
        #[arg(long, value_parser = ["up", "down"])]
        link: Option<String>,
    },
    /// Round trip of one cache line between two CPUs of this machine, in ns.
    ///
    /// On a virtual machine whose vCPUs the hypervisor places on cores that
    /// share a cache (about 65-90 ns here) or not (320-350 ns), every figure
    /// that hands data between CPUs follows that placement; benches record it
    /// around each run (`crate::cpu_distance`).
    CpuRtt {
        /// The two CPUs.
        #[arg(long, value_delimiter = ',', default_values_t = [0, 1])]
        cpus: Vec<usize>,
        /// Round trips to average over.
        #[arg(long, default_value_t = 100_000)]
        iters: u64,
        /// Print `{"cpu_rtt_ns": N, "cpus": [A, B], "shared_cache": BOOL}` instead of a sentence.
        #[arg(long)]
        json: bool,
    },
    /// (internal) Runs the reorder delayer of a CLI testbed's NIC until killed.
    #[command(hide = true)]
    ReorderDaemon { name: String, host: usize, nic: usize, pct: f64, delay_ms: u64 },
}

pub fn run(cmd: TestbedCmd) -> Result<()> {
    if !matches!(cmd, TestbedCmd::List | TestbedCmd::CpuRtt { .. }) {
        sys::require_root()?;
    }
    match cmd {
        TestbedCmd::Up { name, hosts, nics, rate_mbit, loss } => {
            let opts = TestbedOpts {
                prefix: name,
                exact_name: true,
                hosts,
                nics,
                rate_mbit: rate_mbit.filter(|&r| r > 0),
                host_rates: Vec::new(),
                persistent: true,
            };
            let tb = Testbed::create(opts)?;
            if let Some(pct) = loss {
                for h in 0..tb.hosts().len() {
                    for k in 0..tb.nics() {
                        if let Err(e) = tb.set_loss(h, k, pct) {
                            let _ = crate::down(tb.name());
                            return Err(e);
                        }
                    }
                }
            }
            print_testbed(&tb);
            Ok(())
        }
        TestbedCmd::Exec { name, host, cmd } => {
            let tb = Testbed::open(&name)?;
            let h = tb.try_host(parse_host(&name, &host)?)?;
            let status = h.command(&cmd[0]).args(&cmd[1..]).status().with_context(|| format!("cannot run {:?} in {}", cmd[0], h.name()))?;
            if !status.success() {
                use std::os::unix::process::ExitStatusExt;
                std::process::exit(status.code().unwrap_or(128 + status.signal().unwrap_or(0)));
            }
            Ok(())
        }
        TestbedCmd::Down { name } => {
            crate::down(&name)?;
            println!("testbed {name} removed");
            Ok(())
        }
        TestbedCmd::List => {
            let all = crate::list()?;
            if all.is_empty() {
                println!("no testbeds");
            }
            for t in all {
                let owner = match (t.orphan, t.owner) {
                    (true, _) => "orphan (no state file; `down` removes it)".to_string(),
                    (false, None) => "persistent".to_string(),
                    (false, Some((pid, true))) => format!("owner pid {pid}"),
                    (false, Some((pid, false))) => format!("owner pid {pid} is dead (next create or `sweep` removes it)"),
                };
                let subnets = match t.index {
                    Some(i) => (0..t.nics).map(|k| format!("10.{}.{i}.0/24", 200 + k)).collect::<Vec<_>>().join(" "),
                    None => "?".into(),
                };
                println!("{:<24} hosts {:<3} nics {}  {:<30} {}", t.name, t.hosts, t.nics, subnets, owner);
            }
            Ok(())
        }
        TestbedCmd::Sweep => crate::sweep(),
        TestbedCmd::CpuRtt { cpus, iters, json } => {
            let [a, b] = cpus[..] else { bail!("--cpus takes two CPUs, as 0,1") };
            let rtt = crate::cpu_distance::cache_line_round_trip(a, b, iters)?;
            let ns = rtt.as_nanos();
            if json {
                let shared = rtt < crate::cpu_distance::SHARED_CACHE_RTT;
                println!("{}", serde_json::json!({ "cpu_rtt_ns": ns, "cpus": cpus, "shared_cache": shared }));
            } else {
                println!("a cache line goes from CPU {a} to CPU {b} and back in {ns} ns (mean of {iters})");
            }
            Ok(())
        }
        TestbedCmd::Shape { name, host, nic, rate_mbit, loss, dup, reorder, reorder_delay_ms, link } => {
            let tb = Testbed::open(&name)?;
            let h = parse_host(&name, &host)?;
            tb.check(h, nic)?;
            if let Some(rate) = rate_mbit {
                tb.set_rate(h, nic, (rate > 0).then_some(rate))?;
            }
            if let Some(pct) = loss {
                tb.set_loss(h, nic, pct)?;
            }
            if let Some(pct) = dup {
                tb.set_dup(h, nic, pct)?;
            }
            if let Some(pct) = reorder {
                set_reorder_daemon(&tb, h, nic, pct, Duration::from_millis(reorder_delay_ms))?;
            }
            match link.as_deref() {
                Some("down") => tb.link_down(h, nic)?,
                Some("up") => tb.link_up(h, nic)?,
                _ => {}
            }
            Ok(())
        }
        TestbedCmd::ReorderDaemon { name, host, nic, pct, delay_ms } => {
            let tb = Testbed::open(&name)?;
            let ns = tb.check(host, nic)?.name().to_string();
            let d = reorder::Delayer::start(&ns, nic, pct, Duration::from_millis(delay_ms))?;
            std::fs::write(reorder::pid_file(&name, host, nic), std::process::id().to_string())?;
            d.wait();
            bail!("the delayer stopped")
        }
    }
}

fn print_testbed(tb: &Testbed) {
    println!("testbed {} is up (remove it with `transit testbed down {}`)", tb.name(), tb.name());
    for h in tb.hosts() {
        let addrs: Vec<String> = (0..h.nics()).map(|k| format!("eth{k} {}", h.addr(k))).collect();
        println!("  h{:<3} netns {:<28} {}", h.index(), h.name(), addrs.join("  "));
    }
}

/// "3", "h3" or "NAME-h3" to 3.
fn parse_host(name: &str, host: &str) -> Result<usize> {
    let s = host.strip_prefix(&format!("{name}-")).unwrap_or(host);
    let s = s.strip_prefix('h').unwrap_or(s);
    s.parse().map_err(|_| anyhow::anyhow!("bad host {host:?}: give its index (1) or name (h1)"))
}

/// A CLI testbed has no owner process to run the delayer in, so a daemon inside the
/// host runs it (killed by `down` with everything else in the host).
fn set_reorder_daemon(tb: &Testbed, host: usize, nic: usize, pct: f64, delay: Duration) -> Result<()> {
    let pid_file = reorder::pid_file(tb.name(), host, nic);
    if let Ok(pid) = std::fs::read_to_string(&pid_file) {
        if let Ok(pid) = pid.trim().parse::<i32>() {
            // SAFETY: kill has no memory effects.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            // The tun name is free again once the old daemon is gone.
            let deadline = Instant::now() + Duration::from_secs(5);
            while std::path::Path::new(&format!("/proc/{pid}")).exists() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let _ = std::fs::remove_file(&pid_file);
    }
    let ns = tb.host(host).name().to_string();
    reorder::remove_rules(&ns, nic);
    if pct == 0.0 {
        return Ok(());
    }
    let log = pid_file.with_extension("log");
    let mut child = tb
        .host(host)
        .command(std::env::current_exe().context("cannot find the transit executable")?)
        .args(["testbed", "reorder-daemon", tb.name()])
        .args([host.to_string(), nic.to_string(), pct.to_string(), delay.as_millis().to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log)?)
        .process_group(0)
        .spawn()
        .context("cannot start the reorder daemon")?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if pid_file.exists() {
            return Ok(());
        }
        if let Some(status) = child.try_wait()? {
            bail!("reorder daemon failed ({status}): {}", std::fs::read_to_string(&log).unwrap_or_default().trim());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    bail!("reorder daemon did not start in 10 s")
}

#[cfg(test)]
mod tests {
    #[test]
    fn host_names() {
        assert_eq!(super::parse_host("tb", "2").unwrap(), 2);
        assert_eq!(super::parse_host("tb", "h2").unwrap(), 2);
        assert_eq!(super::parse_host("tb", "tb-h2").unwrap(), 2);
        assert!(super::parse_host("tb", "x").is_err());
    }
}
