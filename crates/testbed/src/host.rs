//! One host of a testbed: a network namespace, and ways to run things inside it.

use anyhow::{bail, Context, Result};
use std::ffi::OsStr;
use std::fs::File;
use std::net::Ipv4Addr;
use std::ops::{Deref, DerefMut};
use std::os::fd::AsRawFd;
use std::process::{Child, Command, Stdio};

#[derive(Clone, Debug)]
pub struct Host {
    pub(crate) index: usize,
    pub(crate) netns: String,
    pub(crate) addrs: Vec<Ipv4Addr>,
}

impl Host {
    /// The network namespace name, e.g. `tb-1234-0-h1`.
    pub fn name(&self) -> &str {
        &self.netns
    }

    /// Position of the host in its testbed (0-based).
    pub fn index(&self) -> usize {
        self.index
    }

    /// The IPv4 address of NIC `nic` (interface `eth{nic}`). Panics if the host has no such NIC.
    pub fn addr(&self, nic: usize) -> Ipv4Addr {
        self.addrs[nic]
    }

    /// Number of NICs (eth0, eth1, ...).
    pub fn nics(&self) -> usize {
        self.addrs.len()
    }

    /// A command that runs `program` inside this host (`ip netns exec`); add arguments
    /// and spawn it as usual.
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec"]).arg(&self.netns).arg(program);
        c
    }

    /// Starts `program args...` in this host; the returned guard kills it when dropped.
    /// Stdin is null; stdout and stderr are inherited.
    pub fn spawn<I, S>(&self, program: &str, args: I) -> Result<HostChild>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let child = self
            .command(program)
            .args(args)
            .stdin(Stdio::null())
            .spawn()
            .with_context(|| format!("cannot start {program} in {}", self.netns))?;
        Ok(HostChild::new(child))
    }

    /// Starts a daemon as [`spawn`](Self::spawn) does and waits until it
    /// shows it is ready by making `ready` (its control socket): an error
    /// if the daemon exits first or `timeout` passes. A `ready` left by an
    /// earlier run is removed first, so only this daemon's counts.
    pub fn spawn_ready<I, S>(&self, program: &str, args: I, ready: &std::path::Path, timeout: std::time::Duration) -> Result<HostChild>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        match std::fs::remove_file(ready) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("removing the stale {}", ready.display()));
            }
            _ => {}
        }
        let mut child = self.spawn(program, args)?;
        let t0 = std::time::Instant::now();
        while !ready.exists() {
            if let Some(status) = child.try_wait()? {
                bail!("{program} in {} exited ({status}) before making {}", self.netns, ready.display());
            }
            if t0.elapsed() > timeout {
                bail!("{program} in {} did not make {} within {timeout:?}", self.netns, ready.display());
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        Ok(child)
    }

    /// Runs `sh -c script` in this host and returns its stdout; a non-zero exit is an
    /// error that carries stderr.
    pub fn sh(&self, script: &str) -> Result<String> {
        crate::sys::run(self.command("sh").args(["-c", script]), None).with_context(|| format!("in host {}", self.netns))
    }

    /// Runs `f` on a fresh thread that has entered this host's network namespace, so
    /// sockets it creates belong to the host (they stay there after the thread ends).
    pub fn in_netns<F, R>(&self, f: F) -> Result<R>
    where
        F: FnOnce() -> R + Send,
        R: Send,
    {
        let path = format!("/run/netns/{}", self.netns);
        let ns = File::open(&path).with_context(|| format!("cannot open {path}"))?;
        std::thread::scope(|s| {
            s.spawn(|| {
                // SAFETY: setns only changes this thread's network namespace.
                if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                    bail!("setns into {}: {}", self.netns, std::io::Error::last_os_error());
                }
                Ok(f())
            })
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))
        })
    }
}

/// A process running in a host; killed (SIGKILL) and reaped when dropped.
#[derive(Debug)]
pub struct HostChild(Option<Child>);

impl HostChild {
    /// Wraps a child started with [`Host::command`] so it cannot outlive the test.
    pub fn new(child: Child) -> HostChild {
        HostChild(Some(child))
    }

    /// Gives the child back without killing it.
    pub fn into_inner(mut self) -> Child {
        self.0.take().expect("child present until dropped")
    }
}

impl Deref for HostChild {
    type Target = Child;
    fn deref(&self) -> &Child {
        self.0.as_ref().expect("child present until dropped")
    }
}

impl DerefMut for HostChild {
    fn deref_mut(&mut self) -> &mut Child {
        self.0.as_mut().expect("child present until dropped")
    }
}

impl Drop for HostChild {
    fn drop(&mut self) {
        if let Some(child) = self.0.as_mut() {
            if let Ok(None) = child.try_wait() {
                let _ = child.kill();
            }
            let _ = child.wait();
        }
    }
}
