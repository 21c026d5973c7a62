//! The clocks the engine reads: a thread's CPU time, and wall time since the
//! epoch.

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

pub fn unix_ns() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}
