//! vCPU threads and their control: pause/resume with acknowledgement,
//! state exchange while paused, and throttling for auto-converge.

use crate::hypervisor::{Hypervisor, IoHandler, Kicker, VcpuExit, VcpuState};
use anyhow::{anyhow, Result};
use devices::apic::{Apics, LocalApic};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Want {
    Run,
    Pause,
    Quit,
}

struct PerVcpu {
    paused: bool,
    /// State published at the last pause (or after a set).
    state: Option<VcpuState>,
    pending_set: Option<VcpuState>,
    halted: bool,
    error: Option<String>,
    kicker: Option<Arc<dyn Kicker>>,
    /// Kernel thread id, for lending it the controller's priority.
    tid: libc::pid_t,
}

struct Ctl {
    want: Want,
    cpus: Vec<PerVcpu>,
}

struct Shared {
    ctl: Mutex<Ctl>,
    cv: Condvar,
    throttle_pct: AtomicU8,
}

/// Throttle period: vCPUs are kicked this often while throttled and then
/// sleep in proportion to the time they ran (as QEMU's cpu-throttle does).
const THROTTLE_SLICE: Duration = Duration::from_millis(10);

pub struct VcpuSet {
    shared: Arc<Shared>,
    lapics: Vec<Arc<LocalApic>>,
    threads: Vec<JoinHandle<()>>,
    ticker: Option<JoinHandle<()>>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct VcpuStatus {
    pub halted: bool,
    pub error: Option<String>,
    /// Blocked in the host kernel on a page of guest RAM that is not there
    /// yet (an incoming postcopy migration fetches it): it can neither run
    /// nor stop until the page arrives.
    pub waiting_for_page: bool,
}

/// Whether thread `tid` of this process sleeps in a userfaultfd fault
/// (its wait channel, as root sees it, is `handle_userfault`).
fn in_userfault(tid: libc::pid_t) -> bool {
    tid > 0 && std::fs::read_to_string(format!("/proc/self/task/{tid}/wchan")).is_ok_and(|w| w.trim() == "handle_userfault")
}

/// How long [`VcpuSet::shutdown`] waits for the vCPU threads to end; one
/// blocked in the kernel for good (a page that will never arrive) is left
/// to the process exit that follows.
const SHUTDOWN_BOUND: Duration = Duration::from_secs(3);

impl VcpuSet {
    /// Create `n` vCPU threads, all paused in their reset state; vCPU `i`
    /// takes its interrupts from local APIC `i` of `apics`.
    pub fn start(
        hv: Arc<dyn Hypervisor>,
        n: u32,
        ram_addr: *mut u8,
        ram_size: u64,
        io: Arc<dyn IoHandler>,
        apics: Arc<Apics>,
    ) -> Result<VcpuSet> {
        let lapics: Vec<Arc<LocalApic>> =
            (0..n as usize).map(|i| apics.cpu(i).cloned().ok_or_else(|| anyhow!("no local APIC for vCPU {i}"))).collect::<Result<_>>()?;
        let shared = Arc::new(Shared {
            ctl: Mutex::new(Ctl {
                want: Want::Pause,
                cpus: (0..n)
                    .map(|_| PerVcpu { paused: false, state: None, pending_set: None, halted: false, error: None, kicker: None, tid: 0 })
                    .collect(),
            }),
            cv: Condvar::new(),
            throttle_pct: AtomicU8::new(0),
        });
        let ram_addr = ram_addr as usize;
        let mut threads = Vec::new();
        for (i, lapic) in lapics.iter().cloned().enumerate() {
            let (hv, io, sh) = (hv.clone(), io.clone(), shared.clone());
            threads.push(
                std::thread::Builder::new()
                    .name(format!("vcpu{i}"))
                    .spawn(move || vcpu_thread(i, hv, ram_addr as *mut u8, ram_size, io, lapic, sh))?,
            );
        }
        let mut set = VcpuSet { shared, lapics, threads, ticker: None };
        // Wait until every vCPU exists and has published its reset state.
        let mut c = set.shared.ctl.lock().unwrap();
        while !c.cpus.iter().all(|p| p.paused || p.error.is_some()) {
            c = set.shared.cv.wait(c).unwrap();
        }
        if let Some(e) = c.cpus.iter().find_map(|p| p.error.clone()) {
            drop(c);
            set.shutdown();
            return Err(anyhow!("creating vCPUs: {e}"));
        }
        drop(c);
        let sh = set.shared.clone();
        set.ticker = Some(std::thread::Builder::new().name("throttle".into()).spawn(move || throttle_ticker(sh))?);
        Ok(set)
    }

    fn kick_all(c: &Ctl) {
        for p in &c.cpus {
            if let Some(k) = &p.kicker {
                k.kick();
            }
        }
    }

    /// Stop every vCPU; returns once all have acknowledged.
    pub fn pause(&self) {
        let mut c = self.shared.ctl.lock().unwrap();
        if c.want == Want::Quit {
            return;
        }
        c.want = Want::Pause;
        let _loan = PriorityLoan::to(&c.cpus);
        self.shared.cv.notify_all();
        while !c.cpus.iter().all(|p| p.paused) {
            Self::kick_all(&c);
            c = self.shared.cv.wait_timeout(c, Duration::from_millis(1)).unwrap().0;
        }
    }

    /// Stop every vCPU, waiting at most `bound` for their acknowledgements.
    /// If some do not acknowledge in time (a vCPU blocked on a page that has
    /// not arrived cannot), the others run on as before and the indices of
    /// those that did not stop are returned.
    pub fn try_pause(&self, bound: Duration) -> Result<(), Vec<usize>> {
        let deadline = Instant::now() + bound;
        let mut c = self.shared.ctl.lock().unwrap();
        if c.want == Want::Quit {
            return Ok(());
        }
        let before = c.want;
        c.want = Want::Pause;
        let _loan = PriorityLoan::to(&c.cpus);
        self.shared.cv.notify_all();
        while !c.cpus.iter().all(|p| p.paused) {
            if Instant::now() >= deadline {
                let late = c.cpus.iter().enumerate().filter(|(_, p)| !p.paused).map(|(i, _)| i).collect();
                c.want = before;
                self.shared.cv.notify_all();
                return Err(late);
            }
            Self::kick_all(&c);
            c = self.shared.cv.wait_timeout(c, Duration::from_millis(1)).unwrap().0;
        }
        Ok(())
    }

    pub fn resume(&self) {
        let mut c = self.shared.ctl.lock().unwrap();
        if c.want == Want::Quit {
            return;
        }
        c.want = Want::Run;
        self.shared.cv.notify_all();
    }

    pub fn is_paused(&self) -> bool {
        let c = self.shared.ctl.lock().unwrap();
        c.want != Want::Run && c.cpus.iter().all(|p| p.paused)
    }

    /// States of all vCPUs; the set must be paused. The local APICs are
    /// read now rather than at the pause: devices go on raising interrupts
    /// while the vCPUs are paused (a PVRDMA device draining its CQs as it
    /// pauses), and those must travel too.
    pub fn states(&self) -> Result<Vec<VcpuState>> {
        let c = self.shared.ctl.lock().unwrap();
        if !c.cpus.iter().all(|p| p.paused) {
            return Err(anyhow!("vCPU state can only be read while the VM is paused"));
        }
        c.cpus
            .iter()
            .zip(&self.lapics)
            .map(|(p, lapic)| {
                let mut s = p.state.clone().ok_or_else(|| anyhow!("vCPU has no state"))?;
                s.lapic = lapic.save();
                Ok(s)
            })
            .collect()
    }

    /// Load states into all vCPUs; the set must be paused.
    pub fn set_states(&self, states: &[VcpuState]) -> Result<()> {
        let mut c = self.shared.ctl.lock().unwrap();
        if states.len() != c.cpus.len() {
            return Err(anyhow!("state has {} vCPUs, this VM has {}", states.len(), c.cpus.len()));
        }
        if !c.cpus.iter().all(|p| p.paused) {
            return Err(anyhow!("vCPU state can only be loaded while the VM is paused"));
        }
        for (p, s) in c.cpus.iter_mut().zip(states) {
            p.pending_set = Some(s.clone());
            p.error = None;
        }
        let _loan = PriorityLoan::to(&c.cpus);
        self.shared.cv.notify_all();
        while c.cpus.iter().any(|p| p.pending_set.is_some()) {
            c = self.shared.cv.wait(c).unwrap();
        }
        if let Some(e) = c.cpus.iter().find_map(|p| p.error.clone()) {
            return Err(anyhow!("loading vCPU state: {e}"));
        }
        Ok(())
    }

    pub fn set_throttle(&self, pct: u8) {
        let _c = self.shared.ctl.lock().unwrap();
        self.shared.throttle_pct.store(pct.min(99), Ordering::Relaxed);
        // A vCPU asleep for its share of the old level (up to a second at
        // 99 %) starts over with the new one at once.
        self.shared.cv.notify_all();
    }

    pub fn throttle(&self) -> u8 {
        self.shared.throttle_pct.load(Ordering::Relaxed)
    }

    pub fn status(&self) -> Vec<VcpuStatus> {
        let c = self.shared.ctl.lock().unwrap();
        c.cpus
            .iter()
            .map(|p| VcpuStatus { halted: p.halted, error: p.error.clone(), waiting_for_page: !p.paused && in_userfault(p.tid) })
            .collect()
    }

    pub fn shutdown(&mut self) {
        {
            let mut c = self.shared.ctl.lock().unwrap();
            c.want = Want::Quit;
            Self::kick_all(&c);
            self.shared.cv.notify_all();
        }
        let deadline = Instant::now() + SHUTDOWN_BOUND;
        for (i, t) in self.threads.drain(..).enumerate() {
            // Kick until the thread sees Quit (a kick can race with run()).
            while !t.is_finished() && Instant::now() < deadline {
                {
                    let c = self.shared.ctl.lock().unwrap();
                    Self::kick_all(&c);
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            if t.is_finished() {
                let _ = t.join();
            } else {
                tracing::warn!(vcpu = i, "vCPU thread did not end (blocked in the kernel); left to the process exit");
            }
        }
        if let Some(t) = self.ticker.take() {
            let _ = t.join();
        }
    }
}

impl Drop for VcpuSet {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn throttle_ticker(sh: Arc<Shared>) {
    loop {
        std::thread::sleep(THROTTLE_SLICE);
        let c = sh.ctl.lock().unwrap();
        if c.want == Want::Quit {
            return;
        }
        if sh.throttle_pct.load(Ordering::Relaxed) > 0 && c.want == Want::Run {
            VcpuSet::kick_all(&c);
        }
    }
}

/// A controller running at real-time priority (a migration's switchover)
/// lends it to the vCPU threads while it waits for them: otherwise, on a
/// busy host, a vCPU thread waits for a time slice before it acknowledges a
/// pause or loads its state, and all of it is downtime. Dropping it returns
/// the vCPU threads to the normal class.
struct PriorityLoan(Vec<libc::pid_t>);

impl PriorityLoan {
    fn to(cpus: &[PerVcpu]) -> Option<PriorityLoan> {
        // SAFETY: plain syscalls; a failure leaves priorities as they were.
        unsafe {
            let policy = libc::sched_getscheduler(0);
            if policy != libc::SCHED_FIFO && policy != libc::SCHED_RR {
                return None;
            }
            let mut p = libc::sched_param { sched_priority: 0 };
            libc::sched_getparam(0, &mut p);
            let tids: Vec<_> = cpus.iter().map(|c| c.tid).filter(|&t| t > 0).collect();
            for &t in &tids {
                libc::sched_setscheduler(t, policy, &p);
            }
            Some(PriorityLoan(tids))
        }
    }
}

impl Drop for PriorityLoan {
    fn drop(&mut self) {
        let p = libc::sched_param { sched_priority: 0 };
        for &t in &self.0 {
            // SAFETY: plain syscall.
            unsafe { libc::sched_setscheduler(t, libc::SCHED_OTHER, &p) };
        }
    }
}

fn vcpu_thread(
    i: usize,
    hv: Arc<dyn Hypervisor>,
    ram_addr: *mut u8,
    ram_size: u64,
    io: Arc<dyn IoHandler>,
    lapic: Arc<LocalApic>,
    sh: Arc<Shared>,
) {
    let mut vcpu = match hv.create_vcpu(i as u32, ram_addr, ram_size, io, lapic) {
        Ok(v) => v,
        Err(e) => {
            let mut c = sh.ctl.lock().unwrap();
            c.cpus[i].error = Some(format!("{e:#}"));
            sh.cv.notify_all();
            return;
        }
    };
    {
        let mut c = sh.ctl.lock().unwrap();
        c.cpus[i].kicker = Some(vcpu.kicker());
        // SAFETY: plain syscall.
        c.cpus[i].tid = unsafe { libc::gettid() };
    }
    loop {
        // Control point: service state requests, wait while paused/halted.
        {
            let mut c = sh.ctl.lock().unwrap();
            loop {
                if let Some(s) = c.cpus[i].pending_set.take() {
                    if let Err(e) = vcpu.set_state(&s) {
                        c.cpus[i].error = Some(format!("{e:#}"));
                    }
                    c.cpus[i].state = vcpu.state().ok();
                    // Whether a loaded HLT is for good (IF clear) is for
                    // `run` to find out: it returns Halted at once then.
                    c.cpus[i].halted = false;
                    sh.cv.notify_all();
                }
                match c.want {
                    Want::Quit => {
                        c.cpus[i].kicker = None;
                        return;
                    }
                    Want::Pause => {
                        if !c.cpus[i].paused {
                            c.cpus[i].state = vcpu.state().ok();
                            c.cpus[i].paused = true;
                            sh.cv.notify_all();
                        }
                        c = sh.cv.wait(c).unwrap();
                    }
                    Want::Run => {
                        c.cpus[i].paused = false;
                        if c.cpus[i].halted || c.cpus[i].error.is_some() {
                            c = sh.cv.wait(c).unwrap();
                        } else {
                            break;
                        }
                    }
                }
            }
        }
        let started = Instant::now();
        match vcpu.run() {
            VcpuExit::Kicked => {
                let pct = sh.throttle_pct.load(Ordering::Relaxed) as u32;
                if pct > 0 {
                    // The sleep is a share of the time the vCPU ran, not of
                    // the tick: a tick that lands while it sleeps stays
                    // pending and ends its next run at once, and a sleep of
                    // fixed length would starve it from 50 % on. A run
                    // longer than a tick began before the throttle did.
                    let sleep = started.elapsed().min(THROTTLE_SLICE) * pct / (100 - pct);
                    let c = sh.ctl.lock().unwrap();
                    if c.want == Want::Run {
                        let _ = sh.cv.wait_timeout(c, sleep);
                    }
                }
            }
            VcpuExit::Halted => {
                let mut c = sh.ctl.lock().unwrap();
                c.cpus[i].halted = true;
                sh.cv.notify_all();
            }
            VcpuExit::Error(e) => {
                tracing::error!(vcpu = i, "vCPU stopped: {e}");
                let mut c = sh.ctl.lock().unwrap();
                c.cpus[i].error = Some(e);
                sh.cv.notify_all();
            }
        }
    }
}
