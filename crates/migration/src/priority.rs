//! Who goes first while pages move: the fault path (what a guest or RAM
//! client thread waits on) ahead of the background push, and the switch
//! (downtime) ahead of both. Thread scheduling classes, and the push
//! channels' bounded socket buffers.

/// Socket buffer of each push channel when there are several (the kernel
/// doubles it). A page the push has taken is asked for again only once a
/// fault on it has waited [`crate::place::PUSH_GRACE`], and meanwhile it may sit
/// behind everything in the socket buffers: autotuned, they grow to 17-19
/// MiB per socket here, tens of milliseconds of a channel's data. With four
/// channels, 1 MiB halved the fault p99 (eight runs each: median about 500
/// against 1040 us, under 1 ms in 7 against 3) for 3-5% more total time.
/// One channel keeps autotuning: bounded, it lost a quarter of its
/// throughput (docs/bench-migrate.md, "Bounded push buffers").
const PUSH_SOCKET_BUF: usize = 1 << 20;

/// Bound the send (`send`) or receive buffer of a push channel that is one
/// of `channels`. The forced option passes the host's `wmem_max`/`rmem_max`;
/// without the privilege the plain one is capped by them. Errors only cost
/// the bound.
pub(crate) fn bound_push_buffer(s: &std::net::TcpStream, channels: usize, send: bool) {
    use nix::sys::socket::{setsockopt, sockopt};
    if channels < 2 {
        return;
    }
    let result = if send {
        setsockopt(s, sockopt::SndBufForce, &PUSH_SOCKET_BUF).or_else(|_| setsockopt(s, sockopt::SndBuf, &PUSH_SOCKET_BUF))
    } else {
        setsockopt(s, sockopt::RcvBufForce, &PUSH_SOCKET_BUF).or_else(|_| setsockopt(s, sockopt::RcvBuf, &PUSH_SOCKET_BUF))
    };
    if let Err(e) = result {
        tracing::debug!("push channel buffer not bounded: {e}");
    }
}

/// Without the privilege for [`fault_path_priority`], the fault path gets
/// a larger CPU share (nice -10) than the vCPUs and the host's other work.
pub(crate) fn urgent_priority() {
    normal_class_at_nice(-10);
}

/// The postcopy push's senders and receivers run at the host's normal
/// priority (leaving the real-time class the switch may have passed on).
/// The push is background work: what a thread of the guest or of a RAM
/// client waits on goes by the fault path, ahead of it. At nice -10 it
/// took the destination's CPUs from the VM it serves: rnicd's event loop
/// waited up to 130 ms for a CPU while the push ran (a peer of the VM saw
/// every QP stall that long), since on a shared host only threads of one
/// session group compete by nice value, and those are the VM's own.
pub(crate) fn push_priority() {
    normal_class_at_nice(0);
}

/// Moves the calling thread to the normal class (threads started by the
/// switch inherit its real-time class) at `nice`. Errors only cost the
/// priority.
fn normal_class_at_nice(nice: i32) {
    set_priority(false);
    // SAFETY: plain syscalls on the calling thread.
    let r = unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, nice) };
    if r != 0 {
        tracing::debug!("thread priority not set to nice {nice}: {}", std::io::Error::last_os_error());
    }
}

/// The fault path proper (the destination's fault reader and urgent
/// receiver, the source's urgent server): each fault wakes it three times,
/// and at nice -10 each wakeup could queue behind the push threads, which
/// have the same weight and keep both CPUs busy (4 channels: fault p99
/// 2.5-9 ms). SCHED_DEADLINE runs it ahead of every normal and real-time
/// thread, but for at most 300 us of each millisecond, so that a fault
/// storm, which never lets it block, cannot starve the push that ends the
/// storm (as SCHED_FIFO did). Without the privilege: nice -10.
pub(crate) fn fault_path_priority() {
    const SCHED_DEADLINE: u32 = 6;
    let attr = libc::sched_attr {
        size: std::mem::size_of::<libc::sched_attr>() as u32,
        sched_policy: SCHED_DEADLINE,
        sched_flags: libc::SCHED_FLAG_RESET_ON_FORK as u64,
        sched_nice: 0,
        sched_priority: 0,
        sched_runtime: 300_000,
        sched_deadline: 1_000_000,
        sched_period: 1_000_000,
    };
    // SAFETY: a valid sched_attr for the calling thread.
    if unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &attr as *const libc::sched_attr, 0) } == 0 {
        // Real-time sections must leave this class alone.
        REALTIME.set(true);
    } else {
        tracing::debug!("no deadline class for the fault path: {}", std::io::Error::last_os_error());
        urgent_priority();
    }
}

/// The switch itself (pause, state, load, resume) is downtime, short, and
/// blocks only on I/O: it runs at real-time priority, then drops back.
pub(crate) fn set_priority(realtime: bool) {
    let (policy, prio) = if realtime { (libc::SCHED_FIFO, 1) } else { (libc::SCHED_OTHER, 0) };
    let p = libc::sched_param { sched_priority: prio };
    // SAFETY: plain syscall on the calling thread.
    let r = unsafe { libc::sched_setscheduler(0, policy, &p) };
    if r != 0 {
        tracing::debug!("thread priority unchanged: {}", std::io::Error::last_os_error());
    } else {
        REALTIME.set(realtime);
    }
}

std::thread_local! {
    /// This thread runs real-time (set by [`set_priority`]).
    static REALTIME: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Real-time priority for a short critical section. A thread that claimed
/// pages a faulting guest thread may wait for must not lose its CPU to
/// ordinary work before it maps them: at nice -10 among a dozen busy push
/// threads on two CPUs that cost a fault up to 4 ms. The section is a copy
/// and an ioctl long, so it cannot starve anyone. A thread that is
/// real-time already keeps its class; others get theirs back on drop
/// (their nice value is kept).
pub(crate) struct RealtimeSection(bool);

impl RealtimeSection {
    pub(crate) fn enter() -> Self {
        if REALTIME.get() {
            return RealtimeSection(false);
        }
        let p = libc::sched_param { sched_priority: 1 };
        // SAFETY: plain syscall on the calling thread.
        let entered = unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &p) } == 0;
        // Sections nest: an inner one leaves the class to the outer.
        REALTIME.set(entered);
        RealtimeSection(entered)
    }
}

impl Drop for RealtimeSection {
    fn drop(&mut self) {
        if self.0 {
            set_priority(false);
        }
    }
}
