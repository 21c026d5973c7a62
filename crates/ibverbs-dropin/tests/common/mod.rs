// SPDX-License-Identifier: GPL-2.0-or-later
//! What the drop-in's integration tests share: where this build's drop-in
//! and rnicd are, an rnicd per testbed host, and waiting for a program.

use std::io::Read;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use testbed::{HostChild, Testbed};

/// target/<profile>: the test binary lives in its deps/.
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

/// The drop-in, linked from this build's staticlib once per test process.
pub fn lib_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let so = ibverbs_dropin::link::link(&profile_dir()).expect("link libibverbs.so.1");
        so.parent().unwrap().to_path_buf()
    })
}

pub struct Nic {
    child: Option<HostChild>,
    pub sock: PathBuf,
    pub addr: Ipv4Addr,
}

impl Nic {
    /// Starts rnicd on host `i`'s eth0 address and waits for its control socket.
    pub fn start(tb: &Testbed, i: usize) -> Nic {
        Nic::start_with(tb, i, &[])
    }

    /// Starts rnicd with `extra` options (e.g. `--sched-fifo 1`).
    pub fn start_with(tb: &Testbed, i: usize, extra: &[&str]) -> Nic {
        let rnicd = profile_dir().join("rnicd");
        assert!(rnicd.exists(), "{} is missing: cargo build --release -p rnic", rnicd.display());
        let h = tb.host(i);
        let sock = std::env::temp_dir().join(format!("{}-h{i}.rnicd.sock", tb.name()));
        let addr = h.addr(0).to_string();
        let mut args = vec!["--addr", &addr, "--sock", sock.to_str().unwrap()];
        args.extend_from_slice(extra);
        let child = h.spawn_ready(rnicd.to_str().unwrap(), args, &sock, Duration::from_secs(20)).expect("start rnicd");
        Nic { child: Some(child), sock, addr: h.addr(0) }
    }
}

impl Drop for Nic {
    fn drop(&mut self) {
        self.child.take();
        let _ = std::fs::remove_file(&self.sock);
    }
}

/// Waits for a program (at most two minutes, then kills it) and returns
/// its output. A test that fails leaves nothing running: the HostChild
/// kills the program when dropped.
pub fn finish(mut child: HostChild) -> Output {
    let (mut out, mut err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let readers = (
        std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = out.read_to_end(&mut v);
            v
        }),
        std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = err.read_to_end(&mut v);
            v
        }),
    );
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        assert!(t0.elapsed() < Duration::from_secs(120), "program still running after 2 minutes");
        std::thread::sleep(Duration::from_millis(10));
    };
    Output { status, stdout: readers.0.join().unwrap(), stderr: readers.1.join().unwrap() }
}

/// A check program from tests/c, compiled against the system's
/// <infiniband/verbs.h> and linked with this build's drop-in; the
/// executable is removed when this is dropped. Not every test binary
/// runs one.
#[allow(dead_code)]
pub struct CCheck(PathBuf);

#[allow(dead_code)]
impl CCheck {
    /// Compiles tests/c/NAME.c with warnings as errors.
    pub fn build(name: &str) -> CCheck {
        let exe = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c").join(format!("{name}.c"));
        let st = Command::new("cc")
            .args(["-O2", "-Wall", "-Werror", "-o"])
            .arg(&exe)
            .arg(&src)
            .arg(format!("-L{}", lib_dir().display()))
            .arg("-libverbs")
            .status()
            .expect("cc");
        assert!(st.success(), "compiling {}", src.display());
        CCheck(exe)
    }

    pub fn path(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

/// Builds tests/c/NAME.c and runs it on a one-host testbed (`tag`) with
/// its own rnicd, through the drop-in; the check passes when the program
/// exits 0 having printed "all ok".
#[allow(dead_code)]
pub fn c_check_passes_on_one_host(tag: &str, name: &str) {
    let tb = Testbed::create(testbed::TestbedOpts::new(tag, 1)).expect("testbed (needs root)");
    let nic = Nic::start(&tb, 0);
    let exe = CCheck::build(name);
    let mut c = tb.host(0).command(exe.path());
    c.env("LD_LIBRARY_PATH", lib_dir()).env("TRANSIT_RNICD_SOCK", &nic.sock);
    c.stdin(std::process::Stdio::null()).stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
    let out = finish(HostChild::new(c.spawn().unwrap_or_else(|e| panic!("run {name}: {e}"))));
    let t = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && t.contains("all ok"), "rnicd {}:\n{t}", nic.addr);
}

impl Drop for CCheck {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
