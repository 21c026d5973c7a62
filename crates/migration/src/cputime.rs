//! CPU time of the calling thread (engine threads add theirs up).

pub fn thread_cpu_s() -> f64 {
    clock_s(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// Seconds on a CPU-time clock (0 if it cannot be read).
pub fn clock_s(clock: libc::clockid_t) -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid out pointer.
    if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
        return 0.0;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Counts the calling thread's CPU time in one side's figure: while it
/// runs, in [`Control::cpu_s_now`](crate::stats::Control::cpu_s_now), and
/// in the stats once dropped. Held by postcopy's threads for their whole
/// life (their results are not joined).
pub struct CpuTally<'a> {
    ctl: &'a crate::stats::Control,
    dest: bool,
    clock: Option<libc::clockid_t>,
}

impl<'a> CpuTally<'a> {
    pub fn new(ctl: &'a crate::stats::Control, dest: bool) -> Self {
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
            Some(c) => self.ctl.untrack_cpu(self.dest, c, thread_cpu_s()),
            None => self.ctl.add_cpu(self.dest, thread_cpu_s()),
        }
    }
}

pub fn unix_ns() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::Control;
    use std::sync::{mpsc, Arc};

    /// A running thread's CPU shows in `cpu_s_now` before it ends, and once
    /// it has ended it is counted once, on its own side only.
    #[test]
    fn tally_counts_running_threads_once() {
        let ctl = Arc::new(Control::default());
        let (busy_tx, busy_rx) = mpsc::channel();
        let (end_tx, end_rx) = mpsc::channel::<()>();
        let c = ctl.clone();
        let t = std::thread::spawn(move || {
            let _cpu = CpuTally::new(&c, true);
            while thread_cpu_s() < 0.05 {}
            busy_tx.send(thread_cpu_s()).unwrap();
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
