//! Parameters and statistics of one migration (the `query-migrate` reply).

use serde::{Deserialize, Serialize};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Tunables of an outgoing migration (`migrate-set-parameters`, CLI flags).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct Params {
    /// Parallel TCP data connections.
    pub channels: u32,
    /// none | lz4 | zstd[:level]
    pub compress: String,
    /// Bytes per second over all channels; 0 = unlimited.
    pub max_bandwidth: u64,
    /// Stop-and-copy starts once the estimated pause fits this.
    pub downtime_ms: u64,
    /// Cancel (the VM keeps running here) if not done after this; 0 = never.
    pub timeout_s: u64,
    /// Slow the vCPUs when the guest dirties faster than the link sends.
    pub auto_converge: bool,
    pub throttle_initial: u8,
    pub throttle_increment: u8,
    /// After stop-and-copy, also send a hash of every page; the destination
    /// compares them with its own and refuses to run on any difference.
    /// Costs a read of all RAM inside the downtime: for tests and audits.
    pub verify_ram: bool,
    /// precopy | postcopy | hybrid (a precopy pass, then postcopy unless the
    /// rest fits the downtime; sooner if the guest dirties RAM fast, or on
    /// `migrate-start-postcopy`).
    pub mode: String,
    /// tcp | rdma (queue pairs through the host's rnicd; after a postcopy
    /// switch the destination READs the pages it lacks).
    /// A `rdma:HOST:PORT` uri asks for it too.
    pub transport: String,
    /// rnicd's control socket for the rdma transport ("": the rnicd
    /// serving an address of this network namespace).
    pub rnicd: String,
    /// For tests only: damage to inject (see [`crate::testing::Fault`]);
    /// "" in every real migration.
    pub testing: String,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            channels: 1,
            compress: "none".into(),
            max_bandwidth: 0,
            downtime_ms: 300,
            timeout_s: 600,
            auto_converge: true,
            throttle_initial: 20,
            throttle_increment: 10,
            verify_ram: false,
            mode: "precopy".into(),
            transport: "tcp".into(),
            rnicd: String::new(),
            testing: String::new(),
        }
    }
}

impl Params {
    /// Overlay the keys present in a JSON object (QMP arguments).
    pub fn merged(&self, args: &serde_json::Value) -> Result<Params, String> {
        let mut base = serde_json::to_value(self).expect("params serialize");
        if let Some(obj) = args.as_object() {
            for (k, v) in obj {
                if base.get(k).is_some() {
                    base[k] = v.clone();
                }
            }
        }
        let p: Params = serde_json::from_value(base).map_err(|e| format!("bad migration parameter: {e}"))?;
        p.validate()?;
        Ok(p)
    }
    pub fn validate(&self) -> Result<(), String> {
        if !(1..=64).contains(&self.channels) {
            return Err(format!("channels must be 1..=64, not {}", self.channels));
        }
        self.compress.parse::<crate::compress::Compress>()?;
        self.mode.parse::<Mode>()?;
        if !matches!(self.transport.as_str(), "tcp" | "rdma") {
            return Err(format!("transport must be tcp or rdma, not {:?}", self.transport));
        }
        crate::testing::Fault::parse(&self.testing)?;
        if self.throttle_initial > 99 || self.throttle_increment == 0 {
            return Err("throttle_initial must be <= 99 and throttle_increment > 0".into());
        }
        Ok(())
    }
}

/// How RAM moves (see docs/migration.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Precopy,
    Postcopy,
    Hybrid,
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Mode, String> {
        match s {
            "precopy" => Ok(Mode::Precopy),
            "postcopy" => Ok(Mode::Postcopy),
            "hybrid" => Ok(Mode::Hybrid),
            _ => Err(format!("mode must be precopy, postcopy or hybrid, not {s:?}")),
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(match self {
            Mode::Precopy => "precopy",
            Mode::Postcopy => "postcopy",
            Mode::Hybrid => "hybrid",
        })
    }
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "kebab-case")]
pub enum Status {
    #[default]
    None,
    Setup,
    Active,
    /// Source paused, last pages and state on the way.
    Device,
    /// The destination runs; missing pages are pushed and fetched on fault.
    PostcopyActive,
    /// A postcopy connection broke: the destination waits for missing pages,
    /// the source keeps them; `migrate-recover` + `migrate resume` go on.
    PostcopyPaused,
    Completed,
    Failed,
    Cancelled,
}

impl Status {
    pub fn is_finished(self) -> bool {
        matches!(self, Status::Completed | Status::Failed | Status::Cancelled)
    }
}

/// What missing pages cost one process that maps guest RAM on a postcopy
/// destination (the vmm, or a RAM client such as rnicd): its threads block
/// on a missing page until it is placed.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[serde(default)]
pub struct FaultWaits {
    /// "vmm", or the RAM client's name ("rnicd" for PVRDMA devices).
    pub name: String,
    /// Accesses that blocked on a page not here yet.
    pub faults: u64,
    /// Their waits added up, fault to wake: a single-threaded client
    /// (rnicd's event loop) did nothing else for this long.
    pub wait_ms: f64,
    /// The longest of them.
    pub wait_max_us: f64,
    /// Accesses that blocked on a page that was here already but not
    /// mapped in that process (it dropped its page table entries when
    /// postcopy began): resolved at once, at the cost of a round trip
    /// through the fault thread.
    pub faults_present: u64,
    /// The first fault and the last wake, ms since the Unix epoch (the
    /// clock of the source's `paused_unix_ms`).
    pub first_fault_unix_ms: Option<f64>,
    pub last_wake_unix_ms: Option<f64>,
    /// Of `faults`, those on the devices' pages named at the switch
    /// (`MigratableVm::device_pages`): 0 unless some of them were left
    /// to the push (beyond what crosses in the switch).
    pub device_faults: u64,
}

/// The devices' pages at a postcopy or hybrid switch
/// (`MigratableVm::device_pages`, `postcopy::device`).
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[serde(default)]
pub struct DevicePages {
    /// Pages the devices named (the destination's count, after it loaded
    /// the state; the source's at its pause).
    pub named: u64,
    /// Of them, those that crossed in the switch because the destination
    /// lacked them: sent by the source, or waited for by the destination
    /// before it reported the VM loaded.
    pub at_switch: u64,
    /// Destination: of `at_switch`, those it asked for itself (the source
    /// did not name them).
    pub asked: u64,
    /// Destination: from the state loaded until the last of them was here
    /// (downtime).
    pub wait_ms: f64,
    /// Named pages the destination lacked beyond what crosses in the
    /// switch (`postcopy::device::SWITCH_PAGES_MAX`): pushed first after
    /// the resume.
    pub after_resume: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct RoundStat {
    pub round: u64,
    pub pages: u64,
    pub zero_pages: u64,
    pub wire_bytes: u64,
    pub duration_ms: f64,
    /// Pages the guest dirtied while this round was sent, per second.
    pub dirty_pages_per_s: f64,
    pub throttle_pct: u8,
}

#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[serde(default)]
pub struct Stats {
    pub status: Status,
    /// "outgoing" or "incoming"
    pub role: String,
    /// Outgoing: the destination took the VM over; it never runs here
    /// again, whatever the status (a postcopy may fail after this).
    pub committed: bool,
    pub error: Option<String>,
    pub peer: String,
    pub channels: u32,
    /// "tcp" or "rdma" (how the pages travel).
    pub transport: String,
    pub compress: String,
    pub ram_bytes: u64,
    pub total_pages: u64,
    pub setup_ms: f64,
    pub total_ms: f64,
    /// Source vCPU stop to destination vCPU start (both wall clocks).
    pub downtime_ms: Option<f64>,
    /// Outgoing: when the source stopped the vCPUs (ms since the Unix
    /// epoch), set with `downtime_ms`: where the switch lies on the clock
    /// other processes (a peer timing its stalls) use.
    pub paused_unix_ms: Option<f64>,
    /// When this side's part of the migration ended, teardown included
    /// (ms since the Unix epoch): with `paused_unix_ms`, where the end lies
    /// on other processes' clocks.
    pub ended_unix_ms: Option<f64>,
    pub expected_downtime_ms: f64,
    pub pages_sent: u64,
    pub zero_pages: u64,
    pub raw_pages: u64,
    pub compressed_pages: u64,
    /// Guest bytes moved (non-zero pages x 4096).
    pub ram_transferred_bytes: u64,
    /// Bytes on the wire after zero-page elision and compression.
    pub wire_bytes: u64,
    pub rounds: u64,
    pub round_stats: Vec<RoundStat>,
    pub remaining_pages: u64,
    /// Wire throughput over the whole migration.
    pub throughput_gbps: f64,
    /// Guest RAM throughput (what the wire carried, before compression).
    pub ram_throughput_gbps: f64,
    pub throttle_pct: u8,
    pub throttle_steps: u32,
    pub cpu_s_source: Option<f64>,
    pub cpu_s_dest: Option<f64>,
    pub state_bytes: u64,
    /// The devices' early state, sent ahead of the rounds (0: none).
    #[serde(default)]
    pub early_state_bytes: u64,
    /// Pages whose hash the destination checked against the source's.
    pub verified_pages: u64,
    /// Where the downtime went: (step, ms since the pause began) on this side.
    pub downtime_steps: Vec<(String, f64)>,
    /// Where setup went: (step, ms since the migration started); the
    /// destination notes when it built the early device state.
    pub setup_steps: Vec<(String, f64)>,
    /// precopy | postcopy | hybrid
    pub mode: String,
    /// Postcopy: page faults on pages not yet here (destination's count).
    pub faults: u64,
    /// Postcopy: fault to wake of the faulting thread, microseconds.
    pub fault_p50_us: Option<f64>,
    pub fault_p99_us: Option<f64>,
    pub fault_max_us: Option<f64>,
    /// Postcopy: pages sent by the background push / on request.
    pub pages_pushed: u64,
    pub pages_requested: u64,
    /// Postcopy: from the destination's start to the last page.
    pub postcopy_ms: f64,
    /// Postcopy: time spent paused between a broken connection and recovery.
    pub paused_ms: f64,
    pub recoveries: u32,
    /// Helper processes (rnicd, vhost-user backends) whose faults were served.
    pub ram_clients: u32,
    /// Incoming postcopy: how long each process that maps guest RAM (the
    /// vmm, then each RAM client) waited for missing pages, as it goes.
    pub fault_waits: Vec<FaultWaits>,
    /// Postcopy and hybrid: the devices' pages at the switch.
    #[serde(default)]
    pub device_pages: DevicePages,
    /// Outgoing: what each link carried (one entry per destination address).
    /// Incoming postcopy over rdma: what each link's READs carried (one
    /// entry per source address; `channels` counts its queue pairs to read
    /// through, `throughput_gbps` stays 0).
    pub links: Vec<crate::links::LinkStat>,
    /// Times the control stream moved to another link's connection (a
    /// failover; 0 in a migration no link failure touched).
    #[serde(default)]
    pub control_moves: u64,
}

/// Shared between the engine thread and the control socket.
#[derive(Default)]
pub struct Control {
    pub stats: Mutex<Stats>,
    cancelled: AtomicBool,
    socks: Mutex<Vec<TcpStream>>,
    /// Set by [`shutdown_all`](Self::shutdown_all): channels that are not
    /// sockets (RDMA queue pairs) look at it while they wait.
    shut: AtomicBool,
    start_postcopy: AtomicBool,
    /// `migrate-recover` / `migrate resume`: the address to go on with.
    recover: Mutex<Option<RecoverRequest>>,
    recover_cv: std::sync::Condvar,
    /// CPU clocks of engine threads still running (see
    /// [`CpuTally`]): (destination side, clock).
    live_cpu: Mutex<Vec<(bool, libc::clockid_t)>>,
    /// The `testing` parameter's fault, armed by the source.
    pub(crate) testing: crate::testing::Injector,
    /// An outgoing migration's downtime target, ms: `downtime_ms` of its
    /// start, changed by `migrate-set-parameters` while it runs (as QEMU's
    /// `downtime-limit`), read after each round.
    downtime_ms: AtomicU64,
    /// An outgoing migration's bandwidth cap, shared by its channels:
    /// `max_bandwidth` of its start, changed by `migrate-set-parameters`
    /// while it runs (as QEMU's `max-bandwidth`).
    bucket: Arc<crate::ratelimit::TokenBucket>,
    /// Figures that change with every page and fault, read when a status
    /// is asked for (see [`live_figures`](Self::live_figures)).
    live: Mutex<Option<LiveFn>>,
}

type LiveFn = Box<dyn Fn(&mut Stats) + Send + Sync>;

/// While it lives, [`Control::snapshot`] reads the figures its function
/// sets at the moment of the snapshot; dropped, they are what the engine
/// last wrote.
pub struct LiveFigures<'a>(&'a Control);

impl Drop for LiveFigures<'_> {
    fn drop(&mut self) {
        *self.0.live.lock().unwrap() = None;
    }
}

/// Where a paused postcopy goes on.
pub enum RecoverRequest {
    /// Destination: listen here for the source to come back.
    Listen(std::net::TcpListener),
    /// Source: connect to this address.
    Connect(String),
}

impl Control {
    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::SeqCst)
    }
    /// Stop the migration: set the flag and shut every connection so that
    /// blocked reads and writes on both ends return at once.
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::SeqCst);
        self.shutdown_all();
    }
    /// `migrate-start-postcopy`: a hybrid migration cuts its round in
    /// flight short and switches.
    pub fn request_postcopy(&self) {
        self.start_postcopy.store(true, Ordering::SeqCst);
    }
    pub fn postcopy_requested(&self) -> bool {
        self.start_postcopy.load(Ordering::SeqCst)
    }
    pub fn set_downtime_ms(&self, ms: u64) {
        self.downtime_ms.store(ms, Ordering::SeqCst);
    }
    pub fn downtime_ms(&self) -> u64 {
        self.downtime_ms.load(Ordering::SeqCst)
    }
    /// The bandwidth cap of this (outgoing) migration, bytes/s (0: none);
    /// senders waiting for it see a change within 20 ms.
    pub fn set_max_bandwidth(&self, bytes_per_s: u64) {
        self.bucket.set_rate(bytes_per_s);
    }
    pub(crate) fn bucket(&self) -> &Arc<crate::ratelimit::TokenBucket> {
        &self.bucket
    }
    /// Hand a paused postcopy the way to go on.
    pub fn offer_recovery(&self, r: RecoverRequest) {
        *self.recover.lock().unwrap() = Some(r);
        self.recover_cv.notify_all();
    }
    /// Wait for [`offer_recovery`](Self::offer_recovery).
    pub fn wait_recovery(&self) -> RecoverRequest {
        let mut g = self.recover.lock().unwrap();
        loop {
            if let Some(r) = g.take() {
                return r;
            }
            g = self.recover_cv.wait(g).unwrap();
        }
    }
    /// A recovery offered since the last look, if any.
    pub fn try_recovery(&self) -> Option<RecoverRequest> {
        self.recover.lock().unwrap().take()
    }
    /// Forget connections of a broken attempt (they are shut already).
    pub fn forget_connections(&self) {
        self.socks.lock().unwrap().clear();
        self.shut.store(false, Ordering::SeqCst);
    }
    pub fn shutdown_all(&self) {
        self.shut.store(true, Ordering::SeqCst);
        for s in self.socks.lock().unwrap().iter() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
    /// Whether [`shutdown_all`](Self::shutdown_all) ran (and no
    /// [`forget_connections`](Self::forget_connections) since).
    pub fn is_shut(&self) -> bool {
        self.shut.load(Ordering::SeqCst)
    }
    pub fn register(&self, s: &TcpStream) {
        if let Ok(c) = s.try_clone() {
            self.socks.lock().unwrap().push(c);
        }
        if self.is_cancelled() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
    /// Add `secs` of CPU to the source's or the destination's figure.
    pub fn add_cpu(&self, dest: bool, secs: f64) {
        self.update(|s| {
            let f = if dest { &mut s.cpu_s_dest } else { &mut s.cpu_s_source };
            *f = Some(f.unwrap_or(0.0) + secs);
        })
    }
    /// A thread whose CPU counts on one side while it runs: see
    /// [`cpu_s_now`](Self::cpu_s_now).
    pub(crate) fn track_cpu(&self, dest: bool, clock: libc::clockid_t) {
        self.live_cpu.lock().unwrap().push((dest, clock));
    }
    /// That thread ends with `secs` of CPU: from now on the figure holds it.
    pub(crate) fn untrack_cpu(&self, dest: bool, clock: libc::clockid_t, secs: f64) {
        let mut live = self.live_cpu.lock().unwrap();
        live.retain(|&(_, c)| c != clock);
        self.add_cpu(dest, secs);
    }
    /// One side's CPU so far: threads that ended plus those still running.
    /// A postcopy destination reports it while its receivers still drain
    /// their streams; their CPU would otherwise be missing from the report.
    pub fn cpu_s_now(&self, dest: bool) -> f64 {
        // The lock keeps a thread from moving its CPU from the live list to
        // the figure between the two reads.
        let live = self.live_cpu.lock().unwrap();
        let s = self.stats.lock().unwrap();
        let ended = if dest { s.cpu_s_dest } else { s.cpu_s_source };
        ended.unwrap_or(0.0) + live.iter().filter(|l| l.0 == dest).map(|l| crate::cputime::clock_s(l.1)).sum::<f64>()
    }
    pub fn update(&self, f: impl FnOnce(&mut Stats)) {
        f(&mut self.stats.lock().unwrap())
    }
    /// The figures now.
    pub fn snapshot(&self) -> Stats {
        let mut s = self.stats.lock().unwrap().clone();
        if let Some(live) = self.live.lock().unwrap().as_ref() {
            live(&mut s);
        }
        s
    }
    /// Until the guard drops, each [`snapshot`](Self::snapshot) sets some
    /// figures with `f` as it is taken. A postcopy destination's remaining
    /// pages and fault waits move with every page: a status asked for
    /// right after a thread's fault was served must show that fault, not
    /// the figures of the engine's last periodic update.
    pub fn live_figures(&self, f: impl Fn(&mut Stats) + Send + Sync + 'static) -> LiveFigures<'_> {
        *self.live.lock().unwrap() = Some(Box::new(f));
        LiveFigures(self)
    }
}

/// Counts the calling thread's CPU time in one side's figure: while it
/// runs, in [`Control::cpu_s_now`], and
/// in the stats once dropped. Held by postcopy's threads for their whole
/// life (their results are not joined).
pub struct CpuTally<'a> {
    ctl: &'a Control,
    dest: bool,
    clock: Option<libc::clockid_t>,
}

impl<'a> CpuTally<'a> {
    pub fn new(ctl: &'a Control, dest: bool) -> Self {
        let mut clock: libc::clockid_t = 0;
        // SAFETY: the calling thread's own handle and a valid out pointer.
        let clock = (unsafe { libc::pthread_getcpuclockid(libc::pthread_self(), &mut clock) } == 0).then_some(clock);
        if let Some(c) = clock {
            ctl.track_cpu(dest, c);
        }
        CpuTally { ctl, dest, clock }
    }
}

impl Drop for CpuTally<'_> {
    fn drop(&mut self) {
        match self.clock {
            Some(c) => self.ctl.untrack_cpu(self.dest, c, crate::cputime::thread_cpu_s()),
            None => self.ctl.add_cpu(self.dest, crate::cputime::thread_cpu_s()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    /// While the guard lives a snapshot reads the figure at that moment,
    /// with no update in between; once it drops, the figure is the one
    /// written last.
    #[test]
    fn live_figures_are_read_at_the_snapshot_until_the_guard_drops() {
        let ctl = Control::default();
        let missing = Arc::new(AtomicU64::new(100));
        let live = ctl.live_figures({
            let missing = missing.clone();
            move |s| s.remaining_pages = missing.load(Ordering::Relaxed)
        });
        assert_eq!(ctl.snapshot().remaining_pages, 100);
        missing.store(7, Ordering::Relaxed);
        assert_eq!(ctl.snapshot().remaining_pages, 7);
        ctl.update(|s| s.remaining_pages = 0);
        drop(live);
        missing.store(5, Ordering::Relaxed);
        assert_eq!(ctl.snapshot().remaining_pages, 0);
    }

    /// A running thread's CPU shows in `cpu_s_now` before it ends, and once
    /// it has ended it is counted once, on its own side only.
    #[test]
    fn tally_counts_running_threads_once() {
        let ctl = std::sync::Arc::new(Control::default());
        let (busy_tx, busy_rx) = std::sync::mpsc::channel();
        let (end_tx, end_rx) = std::sync::mpsc::channel::<()>();
        let c = ctl.clone();
        let t = std::thread::spawn(move || {
            let _cpu = CpuTally::new(&c, true);
            while crate::cputime::thread_cpu_s() < 0.05 {}
            busy_tx.send(crate::cputime::thread_cpu_s()).unwrap();
            end_rx.recv().unwrap();
        });
        let burnt = busy_rx.recv().unwrap();
        let running = ctl.cpu_s_now(true);
        assert!(running >= burnt, "a running thread's {burnt} s missing from {running} s");
        assert_eq!(ctl.cpu_s_now(false), 0.0);
        end_tx.send(()).unwrap();
        t.join().unwrap();
        let ended = ctl.cpu_s_now(true);
        assert!(ended >= running && ended < running + 0.05, "ended thread counted as {ended} s, {running} s while running");
        assert_eq!(ctl.snapshot().cpu_s_dest, Some(ended));
    }
}
