//! Running real vmm processes from tests and benchmarks.
//!
//! A [`VmProcess`] is a `transit vm run ...` (or `restore`) child process,
//! optionally inside a testbed host, with its control socket; dropping it
//! kills the process and removes the socket, so a failing test leaves
//! nothing running; a harness killed before it can drop it takes the
//! process with it ([`die_with_parent`]).

use crate::control::Client;
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// An I/O handler with nothing behind it, as an empty bus answers: reads
/// return all ones, writes go nowhere. For tests that run a vCPU over bare
/// RAM.
pub struct NoDevices;

impl crate::hypervisor::IoHandler for NoDevices {
    fn pio_read(&self, _: u16, d: &mut [u8]) {
        d.fill(0xff)
    }
    fn pio_write(&self, _: u16, _: &[u8]) {}
    fn mmio_read(&self, _: u64, d: &mut [u8]) {
        d.fill(0xff)
    }
    fn mmio_write(&self, _: u64, _: &[u8]) {}
}

/// Make `cmd`'s process get SIGKILL when the thread that starts it ends
/// (`PR_SET_PDEATHSIG`): a test or benchmark killed by a signal runs no
/// destructor, and its VMs would run on.
pub fn die_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl and getppid are async-signal-safe; nothing else runs
    // between fork and exec.
    unsafe {
        let parent = libc::getpid();
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent may have died before the prctl.
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
}

/// The `transit` binary next to the running test executable
/// (target/<profile>/transit), or `TRANSIT_BIN`.
pub fn transit_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("TRANSIT_BIN") {
        return p.into();
    }
    let exe = std::env::current_exe().expect("current exe");
    let mut dir = exe.parent().expect("exe dir").to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let p = dir.join("transit");
    assert!(p.exists(), "{} not found: build it first (cargo build -p transit)", p.display());
    p
}

/// A unique VM name for this process (tests run in parallel).
pub fn unique_name(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!("{prefix}-{}-{}", std::process::id(), N.fetch_add(1, Ordering::SeqCst))
}

pub struct VmProcess {
    child: Option<Child>,
    pub socket: PathBuf,
    pub name: String,
    pub console_log: PathBuf,
}

impl VmProcess {
    /// Start `transit <args...> --control SOCK --console-log LOG` with `cmd`
    /// as the launcher (e.g. `testbed::Host::command`), and wait for the
    /// control socket.
    pub fn start(mut cmd: Command, name: &str, args: &[&str]) -> Result<VmProcess> {
        let socket = PathBuf::from(format!("/run/transit/test/{name}.sock"));
        let console_log = std::env::temp_dir().join(format!("transit-{name}.console"));
        let _ = std::fs::remove_file(&console_log);
        std::fs::create_dir_all(socket.parent().unwrap())?;
        cmd.args(args).arg("--control").arg(&socket).arg("--console-log").arg(&console_log).stdin(Stdio::null());
        die_with_parent(&mut cmd);
        let child = cmd.spawn().context("starting transit")?;
        let mut p = VmProcess { child: Some(child), socket, name: name.into(), console_log };
        p.wait_ready(Duration::from_secs(60))?;
        Ok(p)
    }

    /// `transit vm run --name NAME <args>` on this machine.
    pub fn run_local(name: &str, args: &[&str]) -> Result<VmProcess> {
        let mut full = vec!["vm", "run", "--name", name];
        full.extend_from_slice(args);
        Self::start(Command::new(transit_bin()), name, &full)
    }

    fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.child.as_mut().unwrap().try_wait()? {
                bail!("transit exited with {st} before its control socket was ready");
            }
            if Client::connect(&self.socket).is_ok() {
                return Ok(());
            }
            if t0.elapsed() > timeout {
                bail!("control socket {} not ready after {timeout:?}", self.socket.display());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn client(&self) -> Result<Client> {
        Client::connect(&self.socket)
    }

    pub fn exec(&self, cmd: &str, args: Value) -> Result<Value> {
        self.client()?.execute(cmd, args)
    }

    pub fn status(&self) -> Result<Value> {
        self.exec("query-status", json!({}))
    }

    pub fn console(&self) -> String {
        std::fs::read_to_string(&self.console_log).unwrap_or_default()
    }

    /// Wait until the guest reported at least `n` progress (e.g. dirtier passes).
    pub fn wait_progress(&self, n: u64, timeout: Duration) -> Result<u64> {
        let t0 = Instant::now();
        loop {
            let p = self.status()?["guest_progress"].as_u64().unwrap_or(0);
            if p >= n {
                return Ok(p);
            }
            if t0.elapsed() > timeout {
                bail!("guest progress {p} < {n} after {timeout:?}; console:\n{}", self.console());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Wait for the process to exit; returns its exit code.
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<Option<i32>> {
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.child.as_mut().unwrap().try_wait()? {
                return Ok(st.code());
            }
            if t0.elapsed() > timeout {
                bail!("transit did not exit within {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// Kill the process now (a real crash, SIGKILL).
    pub fn kill(&mut self) {
        if let Some(c) = self.child.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for VmProcess {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            if c.try_wait().ok().flatten().is_none() {
                let _ = c.kill();
            }
            let _ = c.wait();
        }
        let _ = std::fs::remove_file(&self.socket);
        // The console log stays where a test failed (it is what to read
        // then); otherwise thousands of runs would leave thousands of logs.
        if !std::thread::panicking() {
            let _ = std::fs::remove_file(&self.console_log);
        }
    }
}

/// Remove a file when dropped (save files in tests).
pub struct TempPath(pub PathBuf);

impl TempPath {
    pub fn new(name: &str) -> TempPath {
        TempPath(std::env::temp_dir().join(name))
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
