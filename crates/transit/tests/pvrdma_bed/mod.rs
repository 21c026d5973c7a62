//! Shared by the tests of a VM with a PVRDMA device against `transit rdma
//! peer`: three testbed hosts with real rnicd processes (VMs on 0 and 1,
//! the peer on 2), a VM whose GID its device claims through rnicd, the IDs
//! carried through the VM's mailbox once, as a guest agent would carry
//! them, and the peer's JSON report. rnicd serves its default socket
//! (`/run/transit/rnicd-ADDR.sock`), so a VM finds the rnicd of whatever
//! host it runs on.
#![allow(dead_code)]

use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};
use testbed::rnicd::Rnicd;
use testbed::{Testbed, TestbedOpts};
use vmm::testing::{transit_bin, unique_name, VmProcess};

/// Fields drop in order: VMs and peers first, then rnicd, then the testbed.
pub struct Bed {
    pub nics: Vec<Rnicd>,
    pub tb: Testbed,
}

impl Bed {
    pub fn new(prefix: &str) -> Bed {
        Bed::with_rnicd_args(prefix, &[])
    }

    /// As [`new`](Self::new) with `args` for every rnicd (`--no-gso` for
    /// tests whose nftables rules must see each packet's own headers).
    pub fn with_rnicd_args(prefix: &str, args: &[&str]) -> Bed {
        let tb = Testbed::create(TestbedOpts::new(prefix, 3)).expect("testbed (needs root)");
        let bin = transit_bin();
        let cmd = [bin.to_str().unwrap(), "rnicd"];
        let mut nics = Vec::new();
        for i in 0..3 {
            let h = tb.host(i);
            // ARP requests from a host name its own address, not a GID it
            // may lose while the request is out.
            h.sh("sysctl -qw net.ipv4.conf.all.arp_announce=2").unwrap();
            let sock = rnic::daemon::default_socket_path(h.addr(0));
            nics.push(Rnicd::start_cmd(&tb, i, &cmd, Some(sock), args).expect("rnicd did not start"));
        }
        Bed { nics, tb }
    }

    /// A VM's GID: a free address of the hosts' subnet. Its device claims
    /// it on whatever host it runs.
    pub fn vm_gid(&self, j: usize) -> Ipv4Addr {
        self.tb.spare_addr(0, j)
    }

    /// Whether host `h` holds `gid` on its interface.
    pub fn holds(&self, h: usize, gid: Ipv4Addr) -> bool {
        self.tb.host(h).sh("ip -4 -o addr show dev eth0").unwrap().contains(&format!(" {gid}/"))
    }

    /// The GIDs of the RDMA namespaces host `h`'s rnicd serves.
    pub fn namespaces(&self, h: usize) -> Vec<String> {
        let ctx = verbs::Context::open(Some(&self.nics[h].sock)).unwrap();
        let all = ctx.dump_qps().unwrap();
        all.as_array().unwrap().iter().map(|n| n["gid"].as_str().unwrap().to_string()).collect()
    }

    /// Waits (at most 10 s) until host `h` no longer holds `gid`: a killed
    /// VM's namespace closes with its process and its host releases the GID.
    pub fn wait_released(&self, h: usize, gid: Ipv4Addr) {
        let t0 = std::time::Instant::now();
        while self.holds(h, gid) {
            assert!(t0.elapsed() < std::time::Duration::from_secs(10), "host {h} still holds {gid}");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// A VM on host `h` running every workload with firmware `args`;
    /// `extra` adds to its command line, `pvrdma` to its device spec.
    pub fn vm_with(&self, h: usize, gid: Ipv4Addr, args: &str, pvrdma: &str, extra: &[&str]) -> VmProcess {
        self.vm_sized(h, gid, "64M", args, pvrdma, extra)
    }

    /// As [`vm_with`](Self::vm_with) with `memory` of RAM (many QPs and a
    /// big WRITE's buffer need more than 64 MiB).
    pub fn vm_sized(&self, h: usize, gid: Ipv4Addr, memory: &str, args: &str, pvrdma: &str, extra: &[&str]) -> VmProcess {
        self.vm_env(h, gid, memory, args, pvrdma, extra, &[])
    }

    /// As [`vm_sized`](Self::vm_sized), the vmm run with `env` set.
    #[allow(clippy::too_many_arguments)]
    pub fn vm_env(
        &self,
        h: usize,
        gid: Ipv4Addr,
        memory: &str,
        args: &str,
        pvrdma: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> VmProcess {
        let name = unique_name("pvrdma");
        let spec = format!("gid={gid}{pvrdma}");
        let fw_args = format!("gid={gid} {args}");
        let mut all = vec!["vm", "run", "--name", &name, "--memory", memory, "--workload", "pvrdma", "--args", &fw_args, "--pvrdma", &spec];
        all.extend_from_slice(extra);
        let mut cmd = self.tb.host(h).command(transit_bin());
        cmd.envs(env.iter().copied());
        VmProcess::start(cmd, &name, &all).unwrap()
    }

    /// Every host's rnicd QP and SRQ states (`transit rdma qps`): PSNs,
    /// windows, timers and queues of both ends of the guest's QPs.
    pub fn rnicd_qps(&self) -> String {
        let mut out = String::new();
        for (h, Rnicd { sock, .. }) in self.nics.iter().enumerate() {
            let r = std::process::Command::new(transit_bin()).args(["rdma", "qps", "--sock"]).arg(sock).output();
            let text = match r {
                Ok(o) => format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)),
                Err(e) => format!("{e}"),
            };
            out += &format!("rnicd of host {h} ({}):\n{text}\n", sock.display());
        }
        out
    }

    pub fn vm(&self, h: usize, gid: Ipv4Addr, args: &str) -> VmProcess {
        self.vm_with(h, gid, args, "", &[])
    }
}

/// The guest's message once it has published one. The guest sets up
/// every QP and buffer of its workloads first (with 16 QPs and a 64 MiB
/// WRITE, on an emulated vCPU sharing a loaded host, that took over a
/// minute): the bound is the one every other wait of a run has.
pub fn guest_ids(vm: &VmProcess) -> String {
    let t0 = Instant::now();
    loop {
        let r = vm.exec("mailbox-read", json!({})).unwrap();
        if r["seq"].as_u64().unwrap_or(0) > 0 {
            return r["data"].as_str().unwrap().to_string();
        }
        assert!(t0.elapsed() < LONG, "the guest published nothing in {LONG:?}; console:\n{}", vm.console());
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub struct Peer {
    child: Child,
    /// The peer's IDs (its first line of output, as the guest got them).
    pub line: String,
    /// The guest's IDs as the peer read them.
    ids: PathBuf,
    /// The peer's later lines of output, read by a thread; it ends when
    /// the peer closes its output.
    lines: Receiver<String>,
    /// What each workload had verified at the last progress line.
    verified: BTreeMap<String, u64>,
    /// The report, once its line came.
    last: Option<String>,
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.ids);
    }
}

/// How often the peer prints what it verified (`--progress`), seconds.
const PROGRESS_EVERY: &str = "0.2";

impl Peer {
    /// Starts the peer on host 2 with the guest's IDs and writes its own
    /// into the VM's mailbox.
    pub fn start(bed: &Bed, vm: &VmProcess, extra: &[&str]) -> Peer {
        let ids = guest_ids(vm);
        let f = std::env::temp_dir().join(format!("{}.guest-ids", vm.name));
        std::fs::write(&f, &ids).unwrap();
        let mut cmd = bed.tb.host(2).command(transit_bin());
        cmd.args(["rdma", "peer", "--guest", f.to_str().unwrap(), "--sock", bed.nics[2].sock.to_str().unwrap(), "--stall", "60"])
            .args(["--progress", PROGRESS_EVERY])
            .args(extra)
            .stdout(Stdio::piped())
            .stdin(Stdio::null());
        let mut child = cmd.spawn().unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert!(line.contains("gid="), "the peer did not start: {line:?}");
        let line = line.trim().to_string();
        vm.exec("mailbox-write", json!({"data": line})).unwrap();
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for l in out.lines() {
                let Ok(l) = l else { break };
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        Peer { child, line, ids: f, lines, verified: BTreeMap::new(), last: None }
    }

    /// Takes one line of output: a progress line updates `verified`, any
    /// other is the report. False once the output ended.
    fn take(&mut self, timeout: Duration) -> bool {
        match self.lines.recv_timeout(timeout) {
            Ok(l) => {
                match serde_json::from_str::<Value>(&l).ok().and_then(|v| v.get("progress").cloned()) {
                    Some(Value::Object(m)) => {
                        self.verified = m.into_iter().map(|(w, n)| (w, n.as_u64().unwrap_or(0))).collect();
                    }
                    _ => self.last = Some(l),
                }
                true
            }
            Err(RecvTimeoutError::Timeout) => true,
            Err(RecvTimeoutError::Disconnected) => false,
        }
    }

    /// Waits until every workload has verified `more` further operations
    /// (the big WRITE: one further round) by the peer's own count: traffic
    /// goes on where the VM runs now. Fails if the peer's run ends first.
    pub fn wait_progress(&mut self, more: u64, timeout: Duration) {
        let t = Instant::now();
        while self.verified.is_empty() {
            assert!(self.take(Duration::from_millis(100)), "the peer ended before its first progress line");
            assert!(t.elapsed() < timeout, "no progress line from the peer");
        }
        let need: BTreeMap<String, u64> = self.verified.iter().map(|(w, &n)| (w.clone(), n + if w == "big" { 1 } else { more })).collect();
        while let Some((w, n)) = need.iter().find(|(w, n)| self.verified.get(*w).copied().unwrap_or(0) < **n) {
            assert!(t.elapsed() < timeout, "the peer's {w} did not reach {n} verified (at {:?})", self.verified.get(w));
            assert!(self.take(Duration::from_millis(100)), "the peer's run ended before its {w} reached {n} verified");
        }
    }

    /// Whether the peer's run is over.
    pub fn finished(&mut self) -> bool {
        self.child.try_wait().unwrap().is_some()
    }

    /// Ends the peer's run as at the end of `--duration` (SIGTERM: nothing
    /// new is posted, what is in flight drains) and reads its report.
    pub fn stop(self) -> Value {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        // `ip netns exec` execs the peer, so this is the peer itself.
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        self.report()
    }

    /// The peer's report once its run ended by itself (or by [`stop`](Self::stop)).
    pub fn report(mut self) -> Value {
        while self.take(Duration::from_secs(1)) {}
        let _ = self.child.wait();
        let last = self.last.clone().unwrap_or_default();
        // Shown if the test fails later (a guest that gives no result).
        eprintln!("the peer's report: {last}");
        serde_json::from_str(&last).unwrap_or_else(|e| panic!("bad peer report {last:?}: {e}"))
    }
}

/// The guest's result line once it is there. If it does not come, the
/// failure shows what the device and every host's rnicd hold.
pub fn guest_result(bed: &Bed, vm: &VmProcess) -> String {
    let t0 = Instant::now();
    loop {
        let r = vm.exec("mailbox-read", json!({})).unwrap();
        let d = r["data"].as_str().unwrap_or("");
        if d.starts_with("pvrdma: ") {
            if d.starts_with("pvrdma: FAIL") {
                // Shown when the test fails on it: why the guest failed.
                let dev = vm.exec("query-pvrdma", json!({})).map(|q| format!("{q:#}")).unwrap_or_else(|e| format!("{e:#}"));
                eprintln!("the guest failed; console:\n{}\nquery-pvrdma:\n{dev}\n{}", vm.console(), bed.rnicd_qps());
            }
            return d.to_string();
        }
        if t0.elapsed() >= Duration::from_secs(300) {
            // What the device and rnicd hold (rings, outstanding WQEs, SRQ
            // room, QP states), to tell which wait never ended.
            let dev = vm.exec("query-pvrdma", json!({})).map(|q| format!("{q:#}")).unwrap_or_else(|e| format!("{e:#}"));
            panic!("no result from the guest; console:\n{}\nquery-pvrdma:\n{dev}\n{}", vm.console(), bed.rnicd_qps());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The peer saw nothing wrong: no error completion, nothing lost or twice.
pub fn assert_peer_clean(rep: &Value) {
    eprintln!("peer report: {rep}");
    assert_eq!(rep["ok"], true, "{rep:#}");
    assert_eq!(
        (rep["lost"].as_u64(), rep["duplicated"].as_u64(), rep["error_completions"].as_u64()),
        (Some(0), Some(0), Some(0)),
        "{rep:#}"
    );
}

pub fn assert_all_verified(rep: &Value, count: u64) {
    assert_peer_clean(rep);
    assert_eq!(rep["workloads"]["stream"]["verified"], count, "{rep:#}");
    assert_eq!(rep["workloads"]["ring"]["verified"], count, "{rep:#}");
    assert_eq!(rep["workloads"]["atomic"]["detail"]["counter"], count, "{rep:#}");
    assert!(rep["workloads"]["table"]["verified"].as_u64().unwrap() > 0, "{rep:#}");
}

/// The guest's console holds no violation or failure.
pub fn assert_guest_clean(console: &str) {
    assert!(!console.contains("VIOLATION") && !console.contains("FAIL"), "{console}");
}

// --- shared by the live-migration tests (pvrdma_migrate, pvrdma_postcopy) ---

mod hop;
mod runs;
// Not every test binary that includes the bed migrates.
#[allow(unused_imports)]
pub use hop::*;
#[allow(unused_imports)]
pub use runs::*;

/// The peer waits out a move of seconds: 7 retries of a 4 s ACK timeout.
/// Its `--duration` is only an upper bound: a test ends the run
/// ([`Peer::stop`]) once the peer saw [`PEER_STEP`] more on the final host.
pub const PEER: &[&str] = &["--timeout", "20", "--duration", "300"];
/// Progress (checked operations) the guest makes between two steps.
pub const STEP: u64 = 300;
/// Operations every workload verifies on the peer's side after the last
/// move before a test ends the peer's run (the big WRITE: one round).
pub const PEER_STEP: u64 = 100;
pub const LONG: Duration = Duration::from_secs(180);

pub fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn migration(vm: &VmProcess) -> Value {
    vm.exec("query-migrate", json!({})).unwrap()
}

pub fn pvrdma(vm: &VmProcess) -> Value {
    vm.exec("query-pvrdma", json!({"device": "pvrdma0"})).unwrap()
}

/// Every QP of the device is connected and running.
pub fn assert_qps_running(vm: &VmProcess) {
    let d = pvrdma(vm);
    assert_eq!(d["paused"], false, "{d:#}");
    let qps = d["qps"].as_array().unwrap();
    assert!(!qps.is_empty(), "{d:#}");
    for q in qps {
        assert_eq!(q["state"], "RTS", "{d:#}");
    }
}

/// `quit`s `vm` and waits for its process to end; if it does not within
/// `bound`, fails with where each of its threads is (name, state, kernel
/// wait channel and stack, time spent), which names what it waits for.
pub fn quit_and_wait_exit(vm: &mut VmProcess, bound: Duration) {
    let t = Instant::now();
    vm.exec("quit", json!({})).unwrap();
    if vm.wait_exit(bound).is_ok() {
        eprintln!("the vmm exited {:.2} s after quit", t.elapsed().as_secs_f64());
        return;
    }
    let pid = vm.pid();
    let mut threads = String::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).into_iter().flatten().flatten() {
        let p = task.path();
        let read = |f: &str| std::fs::read_to_string(p.join(f)).unwrap_or_default();
        let stat = read("stat");
        // comm may hold spaces: the state is the first field after its ')'.
        let state = stat.rsplit_once(") ").map(|(_, r)| r.split(' ').next().unwrap_or("?")).unwrap_or("?").to_string();
        threads += &format!(
            "\n{} {} state {} wchan {}\n{}",
            task.file_name().to_string_lossy(),
            read("comm").trim(),
            state,
            read("wchan"),
            read("stack")
        );
    }
    panic!("the vmm (pid {pid}) did not exit within {bound:?} of quit; its threads:{threads}\nconsole:\n{}", vm.console());
}
