//! CPU time of the calling thread (engine threads add theirs up).

pub fn thread_cpu_s() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid out pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Adds the calling thread's CPU time to one side's figure in the stats
/// when dropped: held by postcopy's threads for their whole life.
pub struct CpuTally<'a> {
    pub ctl: &'a crate::stats::Control,
    pub dest: bool,
}

impl Drop for CpuTally<'_> {
    fn drop(&mut self) {
        self.ctl.add_cpu(self.dest, thread_cpu_s());
    }
}

pub fn unix_ns() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}
