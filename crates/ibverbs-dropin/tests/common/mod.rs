// SPDX-License-Identifier: GPL-2.0-or-later
//! What the drop-in's integration tests share: where this build's drop-in
//! and rnicd are, an rnicd per testbed host, and waiting for a program.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use testbed::rnicd::{build_rnicd, Rnicd};
use testbed::{HostChild, Testbed, TestbedOpts};

/// target/<profile>.
pub use testbed::build::build_dir as profile_dir;

/// The drop-in, linked from this build's staticlib once per test process.
pub fn lib_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let so = ibverbs_dropin::link::link(&profile_dir()).expect("link libibverbs.so.1");
        so.parent().unwrap().to_path_buf()
    })
}

/// This build's rnicd on host `i`'s eth0 address, with `extra` options
/// (e.g. `--sched-fifo 1`).
pub fn rnicd(tb: &Testbed, i: usize, extra: &[&str]) -> Rnicd {
    Rnicd::start(tb, i, &build_rnicd(), extra).expect("start rnicd")
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
    let nic = rnicd(&tb, 0, &[]);
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

/// A program's stdout then stderr, as text.
#[allow(dead_code)]
pub fn text(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr)
}

/// Hosts with an rnicd each; rnicds stop before the testbed goes.
#[allow(dead_code)]
pub struct Bed {
    pub nics: Vec<Rnicd>,
    pub tb: Testbed,
}

#[allow(dead_code)]
impl Bed {
    pub fn new(prefix: &str, hosts: usize) -> Bed {
        let tb = Testbed::create(TestbedOpts::new(prefix, hosts)).expect("testbed (needs root)");
        let nics = (0..hosts).map(|i| rnicd(&tb, i, &[])).collect();
        Bed { nics, tb }
    }

    /// `program args` in host `i`, on the drop-in and that host's rnicd.
    /// `ip netns exec` execs the program, so killing the child kills it.
    pub fn command(&self, i: usize, program: &str, args: &[&str]) -> Command {
        let mut c = self.tb.host(i).command(program);
        c.args(args);
        c.env("LD_LIBRARY_PATH", lib_dir()).env("TRANSIT_RNICD_SOCK", &self.nics[i].sock);
        c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        c
    }

    pub fn run(&self, i: usize, program: &str, args: &[&str]) -> Output {
        finish(HostChild::new(self.command(i, program, args).spawn().expect("run program")))
    }

    /// Waits until something listens on TCP `port` in host `i`.
    pub fn wait_listen(&self, i: usize, port: u16, server: &mut HostChild) {
        let t0 = Instant::now();
        loop {
            let out = self.tb.host(i).sh(&format!("ss -Hltn 'sport = :{port}'")).unwrap_or_default();
            if !out.trim().is_empty() {
                return;
            }
            if let Some(st) = server.try_wait().unwrap() {
                panic!("server exited before listening: {st}");
            }
            assert!(t0.elapsed() < Duration::from_secs(30), "server never listened on {port}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A server on host 0 and its client on host 1 (the server's address as
    /// the last argument); both must exit 0. Returns (server, client) stdout.
    pub fn pair(&self, program: &str, args: &[&str], port: u16) -> (String, String) {
        let mut server = HostChild::new(self.command(0, program, args).spawn().expect("server"));
        self.wait_listen(0, port, &mut server);
        let addr = self.nics[0].addr.to_string();
        let mut cargs = args.to_vec();
        cargs.push(&addr);
        let client = self.run(1, program, &cargs);
        let server = finish(server);
        let (s, c) = (text(&server), text(&client));
        assert!(server.status.success() && client.status.success(), "{program} {args:?} failed\n--- server\n{s}\n--- client\n{c}");
        (s, c)
    }
}
