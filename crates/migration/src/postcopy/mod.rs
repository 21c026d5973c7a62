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
    }
}
