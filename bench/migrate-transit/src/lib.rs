//! Drive real vmm processes (`transit vm run`) on a testbed and migrate
//! between them through their control sockets. Used by the
//! `migrate-transit` benchmark and by crates/migration's end-to-end tests.
//! The processes and their control clients are the vmm's own
//! ([`vmm::testing::VmProcess`], [`vmm::control::Client`]); this module only
//! adds what a migration needs on top.

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use testbed::Testbed;
pub use vmm::control::Client;
pub use vmm::testing::{unique_name, VmProcess};

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
    if let Some(ws) = Path::new(env!("CARGO_MANIFEST_DIR")).ancestors().nth(2) {
        // Works from any current directory.
        c.current_dir(ws);
    }
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

pub struct VmSpec<'a> {
    pub name: &'a str,
    pub memory: &'a str,
    pub workload: &'a str,
    pub args: &'a str,
}

/// How a destination vmm waits for its migration.
#[derive(Clone, Copy)]
pub enum Incoming<'a> {
    /// `vm run --incoming URI`: listens from startup, RAM allocated as pages
    /// arrive.
    Uri(&'a str),
    /// `vm run --paused`, then `migrate-incoming {uri, prealloc: true}`: the
    /// destination allocates its RAM while it waits (precopy only).
    Prealloc(&'a str),
}

/// Start `transit vm run` in `host` (the source: it boots and runs), or,
/// with `incoming`, a destination waiting for a migration.
pub fn start_vm(bin: &Path, tb: &Testbed, host: usize, spec: &VmSpec, incoming: Option<Incoming>) -> Result<VmProcess> {
    let mut args = vec!["vm", "run", "--name", spec.name, "--memory", spec.memory, "--workload", spec.workload, "--args", spec.args];
    match incoming {
        Some(Incoming::Uri(u)) => args.extend(["--incoming", u]),
        Some(Incoming::Prealloc(_)) => args.push("--paused"),
        None => {}
    }
    // Process names are unique; the VM name (part of its shape) is not.
    let vm = VmProcess::start(tb.host(host).command(bin), &unique_name(&format!("{}-h{host}", spec.name)), &args)
        .with_context(|| format!("vmm in host {host} did not come up"))?;
    if let Some(Incoming::Prealloc(u)) = incoming {
        vm.exec("migrate-incoming", json!({"uri": u, "prealloc": true}))?;
    }
    Ok(vm)
}

/// Whether the process still runs.
pub fn is_alive(vm: &mut VmProcess) -> bool {
    // A zero timeout: an error means "has not exited".
    vm.wait_exit(Duration::ZERO).is_err()
}

/// Wait until `query-status`'s guest progress reaches `n` (the fill workload
/// reports 1 when RAM is full; the dirtier counts passes).
pub fn wait_guest_progress(vm: &VmProcess, n: u64, t: Duration) -> Result<()> {
    vm.wait_progress(n, t).map(|_| ())
}

/// Poll `query-migrate` on `vm` until the migration ends.
pub fn wait_migration(vm: &VmProcess, t: Duration) -> Result<Value> {
    let s = Instant::now();
    let mut q = vm.client()?;
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
/// (iperf3), Gbit/s. Bounded in time whatever the link does.
pub fn raw_tcp_gbps(tb: &Testbed, streams: u32, secs: u32) -> Result<f64> {
    let port = 5201;
    let _srv = tb.host(1).spawn("iperf3", ["-s", "-1", "-p", &port.to_string()])?;
    std::thread::sleep(Duration::from_millis(300));
    let out = tb.host(0).sh(&format!(
        "timeout {} iperf3 -c {} -p {port} -P {streams} -t {secs} --connect-timeout 3000 -J",
        secs + 20,
        tb.host(1).addr(0)
    ))?;
    let v: Value = serde_json::from_str(&out).context("iperf3 JSON")?;
    let bps = v["end"]["sum_received"]["bits_per_second"].as_f64().ok_or_else(|| anyhow!("iperf3 gave no throughput"))?;
    Ok(bps / 1e9)
}
