//! Postcopy: the destination runs before all of RAM is there and fetches
//! what it touches (see docs/migration.md, "Postcopy").
//!
//! - [`source`]: the switch, the background push and the urgent server
//! - [`dest`]: the switch, fault handling, completion and recovery
//! - [`place`]: atomic page placement and waking faulting threads
//! - [`faults`]: the destination's fault-reading thread and page requests
//! - [`push`]: the order of the background push (near recent faults first)
//! - [`clients`]: processes other than the vmm that map guest RAM

pub mod clients;
pub(crate) mod dest;
pub mod faults;
pub mod place;
pub mod push;
pub(crate) mod source;

/// The threads the running guest waits on (fault reader, both ends of the
/// urgent connection, and in postcopy the push's senders and receivers)
/// get a larger CPU share (nice -10) than the vCPUs and the host's other
/// work, so that a fault's round trip and the push stay quick on busy CPUs.
/// Not a real-time class: under a fault storm those threads never block,
/// and would starve the push that ends the storm.
pub(crate) fn urgent_priority() {
    // Threads started by the switch inherit its real-time class: drop it,
    // a real-time fault path starves the push under a fault storm.
    set_priority(false);
    // SAFETY: plain syscalls on the calling thread.
    let r = unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, -10) };
    if r != 0 {
        tracing::debug!("no higher priority for the fault path: {}", std::io::Error::last_os_error());
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
