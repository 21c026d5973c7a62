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

/// The threads on the fault path (fault reader, urgent sender and
/// receiver) only block on I/O; giving them a real-time priority keeps a
/// fault's round trip short when the host's CPUs are busy with vCPUs and
/// the bulk push. Without the privilege they keep their normal priority.
pub(crate) fn urgent_priority() {
    set_priority(true);
}

/// The switch itself (pause, state, load, resume) is downtime: it runs
/// with the same real-time priority, then drops back to normal.
pub(crate) fn set_priority(realtime: bool) {
    let (policy, prio) = if realtime { (libc::SCHED_FIFO, 1) } else { (libc::SCHED_OTHER, 0) };
    let p = libc::sched_param { sched_priority: prio };
    // SAFETY: plain syscall on the calling thread.
    let r = unsafe { libc::sched_setscheduler(0, policy, &p) };
    if r != 0 {
        tracing::debug!("thread priority unchanged: {}", std::io::Error::last_os_error());
    }
}
