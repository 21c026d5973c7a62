//! Drive real vmm processes (`transit vm run`) on a testbed and migrate
//! between them through their control sockets. Used by the
//! `migrate-transit` benchmark and by crates/migration's end-to-end tests.

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use testbed::{HostChild, Testbed};

/// The `transit` binary: $TRANSIT_BIN, else next to the running executable
/// (target/<profile>/ or target/<profile>/deps/), built if missing.
pub fn transit_bin() -> Result<PathBuf> {
    if let Ok(p) = std::env::var("TRANSIT_BIN") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe()?;
    let mut dir = exe.parent().unwrap().to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let bin = dir.join("transit");
    let release = dir.ends_with("release");
    let target = dir.parent().unwrap().to_path_buf();
    // Always ask cargo: it rebuilds only if the sources changed.
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.args(["build", "-q", "-p", "transit", "--bin", "transit"]).env("CARGO_TARGET_DIR", &target).env("UNICORN_NO_PKG_CONFIG", "1");
    if release {
        c.arg("--release");
    }
    let st = c.status().context("running cargo build -p transit")?;
    if !st.success() || !bin.exists() {
        bail!("cannot build {}", bin.display());
    }
    Ok(bin)
}

/// Whether this vmm can take part in migrations (`vm run --incoming`).
pub fn vmm_supports_migration(bin: &Path) -> bool {
    Command::new(bin)
        .args(["vm", "run", "--help"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("--incoming"))
        .unwrap_or(false)
}

/// A blocking client of one vmm's control socket.
pub struct Qmp {
    r: BufReader<UnixStream>,
    w: UnixStream,
}

impl Qmp {
    pub fn connect(path: &Path, wait: Duration) -> Result<Qmp> {
        let t = Instant::now();
        let s = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) if t.elapsed() > wait => bail!("control socket {}: {e}", path.display()),
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        s.set_read_timeout(Some(Duration::from_secs(120)))?;
        let mut q = Qmp { r: BufReader::new(s.try_clone()?), w: s };
        let g = q.read()?;
        if g.get("QMP").is_none() {
            bail!("no QMP greeting from {}", path.display());
        }
        Ok(q)
    }
    fn read(&mut self) -> Result<Value> {
        let mut line = String::new();
        if self.r.read_line(&mut line)? == 0 {
            bail!("control socket closed");
        }
        Ok(serde_json::from_str(&line)?)
    }
    pub fn execute(&mut self, cmd: &str, args: Value) -> Result<Value> {
        writeln!(self.w, "{}", json!({"execute": cmd, "arguments": args}))?;
        let r = self.read()?;
        if let Some(e) = r.get("error") {
            bail!("{cmd}: {}", e["desc"].as_str().unwrap_or("error"));
        }
        Ok(r["return"].clone())
    }
}

/// One vmm process in a testbed host.
pub struct VmProc {
    pub child: HostChild,
    pub sock: PathBuf,
    pub console: PathBuf,
}

impl VmProc {
    pub fn qmp(&self) -> Result<Qmp> {
        Qmp::connect(&self.sock, Duration::from_secs(60))
    }
    pub fn exec(&self, cmd: &str, args: Value) -> Result<Value> {
        self.qmp()?.execute(cmd, args)
    }
    pub fn is_alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
    /// Wait (up to `t`) until the process exits; its exit code.
    pub fn wait_exit(&mut self, t: Duration) -> Option<i32> {
        let s = Instant::now();
        while s.elapsed() < t {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Some(st.code().unwrap_or(-1));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }
}

pub struct VmSpec<'a> {
    pub name: &'a str,
    pub memory: &'a str,
    pub workload: &'a str,
    pub args: &'a str,
}

/// Start `transit vm run` in `host`; with `incoming`, paused and waiting
/// for a migration on that URI.
pub fn start_vm(bin: &Path, tb: &Testbed, host: usize, spec: &VmSpec, incoming: Option<&str>, dir: &Path) -> Result<VmProc> {
    let sock = dir.join(format!("{}-h{host}.sock", spec.name));
    let console = dir.join(format!("{}-h{host}.console", spec.name));
    let mut args: Vec<String> = ["vm", "run", "--name", spec.name, "--memory", spec.memory, "--workload", spec.workload, "--args", spec.args]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.extend(["--control".into(), sock.display().to_string(), "--console-log".into(), console.display().to_string()]);
    if let Some(u) = incoming {
        args.extend(["--incoming".into(), u.to_string()]);
    }
    let child = tb.host(host).spawn(bin.to_str().unwrap(), &args)?;
    let vm = VmProc { child, sock, console };
    vm.qmp().with_context(|| format!("vmm in host {host} did not come up"))?;
    Ok(vm)
}

/// Wait until `query-status`'s guest progress reaches `n` (the fill workload
/// reports 1 when RAM is full; the dirtier counts passes).
pub fn wait_guest_progress(vm: &VmProc, n: u64, t: Duration) -> Result<()> {
    let s = Instant::now();
    let mut q = vm.qmp()?;
    loop {
        let st = q.execute("query-status", json!({}))?;
        if st["guest_progress"].as_u64().unwrap_or(0) >= n {
            return Ok(());
        }
        if s.elapsed() > t {
            bail!("guest progress stuck at {} (want {n}): {st}", st["guest_progress"]);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Poll `query-migrate` on `vm` until the migration ends.
pub fn wait_migration(vm: &VmProc, t: Duration) -> Result<Value> {
    let s = Instant::now();
    let mut q = vm.qmp()?;
    loop {
        let st = q.execute("query-migrate", json!({}))?;
        if matches!(st["status"].as_str(), Some("completed" | "failed" | "cancelled")) {
            return Ok(st);
        }
        if s.elapsed() > t {
            bail!("migration still {} after {t:?}", st["status"]);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Raw TCP throughput host 0 -> host 1 with `streams` parallel streams
/// (iperf3), Gbit/s.
pub fn raw_tcp_gbps(tb: &Testbed, streams: u32, secs: u32) -> Result<f64> {
    let port = 5201;
    let _srv = tb.host(1).spawn("iperf3", ["-s", "-1", "-p", &port.to_string()])?;
    std::thread::sleep(Duration::from_millis(300));
    let out = tb.host(0).sh(&format!("iperf3 -c {} -p {port} -P {streams} -t {secs} -J", tb.host(1).addr(0)))?;
    let v: Value = serde_json::from_str(&out).context("iperf3 JSON")?;
    let bps = v["end"]["sum_received"]["bits_per_second"].as_f64().ok_or_else(|| anyhow!("iperf3 gave no throughput"))?;
    Ok(bps / 1e9)
}

/// A scratch directory removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(prefix: &str) -> Result<TempDir> {
        let p = std::env::temp_dir().join(format!("{prefix}-{}-{}", std::process::id(), rand_suffix()));
        std::fs::create_dir_all(&p)?;
        Ok(TempDir(p))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn rand_suffix() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos() as u64).unwrap_or(0)
}
