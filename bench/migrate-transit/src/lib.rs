//! Drive real vmm processes (`transit vm run`) on a testbed and migrate
//! between them through their control sockets. Used by the
//! `migrate-transit` benchmark and by crates/migration's end-to-end tests.
//! The processes and their control clients are the vmm's own
//! ([`vmm::testing::VmProcess`], [`vmm::control::Client`]); this module only
//! adds what a migration needs on top.

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
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
    let dir = testbed::build::build_dir();
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

/// Wait until the destination's memfd holds all of RAM (its prealloc done).
/// The prealloc fills the memfd through a mapping of its own, so the vmm's
/// resident size does not show it: look at the memfd's allocated blocks.
pub fn wait_prealloc(dst: &VmProcess, ram_gib: u64, t: Duration) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let want = ram_gib << 30;
    let s = Instant::now();
    // `ip netns exec` execs into the vmm: the child's pid is the vmm's.
    let dir = format!("/proc/{}/fd", dst.pid());
    while s.elapsed() < t {
        let allocated: u64 = std::fs::read_dir(&dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| std::fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy().starts_with("/memfd:")))
            .filter_map(|e| std::fs::metadata(e.path()).ok())
            .map(|m| m.blocks() * 512)
            .max()
            .unwrap_or(0);
        if allocated >= want {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!("  prealloc not finished after {t:?}; migrating anyway");
    Ok(())
}

/// Checks that a destination whose incoming migration failed never ran
/// the VM: while it is up its status is not running, and it ends by itself
/// with a non-zero status, at any moment, also between two looks at it.
/// So a control socket that does not answer must be a process that ended
/// (or is ending) that way; it gets `bound` to end.
pub fn check_destination_never_ran(dst: &mut VmProcess, bound: Duration) -> Result<()> {
    match dst.exec("query-status", json!({})) {
        Ok(st) if st["status"] == "running" => bail!("a destination with incomplete state runs: {st}"),
        Ok(_) => Ok(()),
        Err(e) => match dst.wait_exit(bound) {
            Ok(Some(0)) => bail!("a destination with incomplete state exited 0"),
            Ok(_) => Ok(()),
            Err(_) => bail!("the destination's control socket failed ({e:#}), yet it did not exit within {bound:?}"),
        },
    }
}

/// Waits until `src`'s outgoing migration has put `bytes` on the wire,
/// failing if it ended first: the data connections are up and the rounds
/// under way, the point a test breaks a migration in the middle at.
pub fn wait_wire_bytes(src: &VmProcess, bytes: u64, t: Duration) -> Result<()> {
    let s = Instant::now();
    let mut q = src.client()?;
    loop {
        let st = q.execute("query-migrate", json!({}))?;
        if !matches!(st["status"].as_str(), Some("setup" | "active")) {
            bail!("the migration ended before {bytes} bytes were on the wire: {st}");
        }
        if st["wire_bytes"].as_u64().unwrap_or(0) >= bytes {
            return Ok(());
        }
        if s.elapsed() > t {
            bail!("not {bytes} bytes on the wire after {t:?}: {st}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
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
    let _srv = testbed::HostChild::new(
        tb.host(1).command("iperf3").args(["-s", "-1", "-p", &port.to_string()]).stdin(Stdio::null()).stdout(Stdio::null()).spawn()?,
    );
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

/// RAM-to-RAM TCP throughput host 0 -> host 1, Gbit/s: `bytes` of a
/// filled shared-memory mapping (like guest RAM) sent over `streams`
/// connections into a populated one (like a preallocated destination),
/// with plain writes and reads of 256 KiB (the receiver woken once per
/// read, as Transit's receiver is) and nothing else. iperf3 sends from and
/// into a small buffer that stays in cache; moving RAM also pays the
/// memory traffic of both ends, which on a host with few CPUs is a large
/// part of the cost: this is the reference for what a migration over TCP
/// can reach here.
pub fn ram_tcp_gbps(tb: &Testbed, streams: u32, bytes: u64) -> Result<f64> {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    const CHUNK: usize = 256 << 10;
    let streams = streams.max(1) as usize;
    // Guest RAM comes in 2 MiB multiples.
    const UNIT: u64 = 2 << 20;
    let per = (bytes / streams as u64 / UNIT * UNIT) as usize;
    let (src_ram, dst_ram) = (populated_ram(per * streams)?, populated_ram(per * streams)?);
    // SAFETY: both mappings are ours alone, and each is used through this
    // one slice.
    let (src, dst) = unsafe { (src_ram.as_mut_slice(), dst_ram.as_mut_slice()) };
    fill(src);
    let port = 5202;
    let listener = tb.host(1).in_netns(|| TcpListener::bind(("0.0.0.0", port)))??;
    let to = (tb.host(1).addr(0), port);
    let senders: Vec<TcpStream> =
        tb.host(0).in_netns(|| (0..streams).map(|_| TcpStream::connect(to)).collect::<std::io::Result<_>>())??;
    let receivers: Vec<TcpStream> = (0..streams).map(|_| listener.accept().map(|(s, _)| s)).collect::<std::io::Result<_>>()?;
    let t0 = Instant::now();
    std::thread::scope(|sc| -> Result<f64> {
        // Which part a stream carries does not matter: all are the same size.
        let sends: Vec<_> = senders
            .into_iter()
            .zip(src.chunks(per))
            .map(|(mut s, part)| sc.spawn(move || part.chunks(CHUNK).try_for_each(|c| s.write_all(c))))
            .collect();
        let recvs: Vec<_> = receivers
            .into_iter()
            .zip(dst.chunks_mut(per))
            .map(|(mut s, part)| {
                set_rcvlowat(&s, CHUNK / 2);
                sc.spawn(move || part.chunks_mut(CHUNK).try_for_each(|c| s.read_exact(c)))
            })
            .collect();
        for h in sends {
            h.join().map_err(|_| anyhow!("RAM-to-RAM sender panicked"))?.context("RAM-to-RAM send")?;
        }
        for h in recvs {
            h.join().map_err(|_| anyhow!("RAM-to-RAM receiver panicked"))?.context("RAM-to-RAM receive")?;
        }
        Ok((per * streams) as f64 * 8.0 / t0.elapsed().as_secs_f64() / 1e9)
    })
}

/// Wake a reader only once `n` bytes are queued (or the stream ends).
fn set_rcvlowat(s: &std::net::TcpStream, n: usize) {
    use std::os::fd::AsRawFd;
    let v = n as i32;
    // SAFETY: an int option on our own socket; failing only costs wakeups.
    unsafe { libc::setsockopt(s.as_raw_fd(), libc::SOL_SOCKET, libc::SO_RCVLOWAT, &v as *const i32 as *const libc::c_void, 4) };
}

/// Memory like a destination's preallocated guest RAM: the vmm's own
/// (a memfd mapped shared), every page allocated.
fn populated_ram(len: usize) -> Result<vmm::memory::GuestRam> {
    let ram = vmm::memory::GuestRam::new("ram-tcp", len as u64)?;
    // SAFETY: the whole mapping; populating does not change its contents.
    if unsafe { libc::madvise(ram.host_addr() as *mut libc::c_void, len, libc::MADV_POPULATE_WRITE) } != 0 {
        bail!("allocating {len} bytes: {}", std::io::Error::last_os_error());
    }
    Ok(ram)
}

/// Non-zero bytes that do not repeat (a counter and a xorshift).
fn fill(b: &mut [u8]) {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for (i, w) in b.chunks_exact_mut(8).enumerate() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        w.copy_from_slice(&(if i % 2 == 0 { x } else { i as u64 | 1 }).to_le_bytes());
    }
}

/// `transit rnicd` in a testbed host, started with the host's first
/// address: its default socket is the one a vmm there finds, and the
/// host's other addresses (its other links) are served as namespaces of the
/// same process. Killed, and its socket removed, when dropped.
pub struct Rnicd(testbed::rnicd::Rnicd);

impl Rnicd {
    /// `bin` is the transit executable.
    pub fn start(bin: &Path, tb: &Testbed, host: usize, extra: &[&str]) -> Result<Rnicd> {
        let sock = rnic::daemon::default_socket_path(tb.host(host).addr(0));
        let cmd = [bin.to_str().context("binary path")?, "rnicd"];
        Ok(Rnicd(testbed::rnicd::Rnicd::start_cmd(tb, host, &cmd, Some(sock), extra)?))
    }

    /// Its CPU seconds so far, user and system (`ip netns exec` execs
    /// into rnicd, so the child's pid is rnicd's).
    pub fn cpu_s(&self) -> Result<f64> {
        process_cpu_s(self.pid())
    }

    /// Its control socket.
    pub fn socket(&self) -> &Path {
        &self.0.sock
    }

    /// Its process id (for profilers).
    pub fn pid(&self) -> u32 {
        self.0.pid().expect("rnicd runs until dropped")
    }
}

/// CPU seconds, user and system, of process `pid` so far.
pub fn process_cpu_s(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which ends with the last ')'):
    // utime and stime are the 12th and 13th.
    let rest = stat.rsplit_once(')').map(|x| x.1).context("/proc stat")?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f.get(11).context("utime")?.parse::<f64>()? + f.get(12).context("stime")?.parse::<f64>()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Ok(ticks / hz)
}
