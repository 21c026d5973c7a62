//! An rnicd on a testbed host, as the integration tests and benchmarks of
//! the crates that need one start it: serving the host's eth0 address on a
//! control socket, by default in the temporary directory named after the
//! testbed and the host.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};

use crate::build::build_bin;
use crate::{HostChild, Testbed};

/// A running rnicd; killed, and its socket removed, when dropped.
pub struct Rnicd {
    child: Option<HostChild>,
    pub sock: PathBuf,
    /// The address it serves: its host's eth0.
    pub addr: Ipv4Addr,
}

impl Rnicd {
    /// Starts `bin` (an rnicd executable) on host `host` of `tb` with
    /// `extra` options after `--addr` and `--sock`, and waits up to 20 s for
    /// its control socket.
    pub fn start(tb: &Testbed, host: usize, bin: &Path, extra: &[&str]) -> Result<Rnicd> {
        let program = bin.to_str().with_context(|| format!("{} is not UTF-8", bin.display()))?;
        Rnicd::start_cmd(tb, host, &[program], None, extra)
    }

    /// As [`start`](Self::start) for any command line that runs rnicd:
    /// `cmd` is the program and the arguments before rnicd's own (`transit
    /// rnicd`: the path of transit, then `rnicd`). `sock` is the control
    /// socket; `None` is the temporary one [`start`](Self::start) uses.
    /// Callers whose vmms or programs must find rnicd without being told
    /// pass rnicd's default socket for the host's address.
    pub fn start_cmd(tb: &Testbed, host: usize, cmd: &[&str], sock: Option<PathBuf>, extra: &[&str]) -> Result<Rnicd> {
        let (program, lead) = cmd.split_first().context("an empty rnicd command")?;
        let h = tb.host(host);
        let addr = h.addr(0);
        let sock = sock.unwrap_or_else(|| std::env::temp_dir().join(format!("{}-h{host}.rnicd.sock", tb.name())));
        let (a, s) = (addr.to_string(), sock.to_string_lossy().into_owned());
        let args = lead.iter().copied().chain(["--addr", a.as_str(), "--sock", s.as_str()]).chain(extra.iter().copied());
        let child = h.spawn_ready(program, args, &sock, Duration::from_secs(20)).with_context(|| format!("start rnicd on host {host}"))?;
        Ok(Rnicd { child: Some(child), sock, addr })
    }

    /// Its process ID, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// Kills it now (a peer that vanishes).
    pub fn kill(&mut self) {
        self.child.take();
    }
}

impl Drop for Rnicd {
    fn drop(&mut self) {
        self.child.take();
        let _ = std::fs::remove_file(&self.sock);
    }
}

/// This build's rnicd, `target/<profile>/rnicd` (panics if it is not
/// built).
pub fn build_rnicd() -> PathBuf {
    let p = build_bin("rnicd");
    assert!(p.exists(), "{} is missing: cargo build --release -p rnic --bin rnicd", p.display());
    p
}
