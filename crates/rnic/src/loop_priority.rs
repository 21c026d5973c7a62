//! An event loop's CPU priority: raised while a vmm it serves is in
//! postcopy (`ramclient`), and kept from the threads the loop starts.
//!
//! Each daemon has one event loop thread and one [`LoopPriority`], made on
//! that thread when the daemon starts: several daemons in one process (as
//! tests run them) raise and restore their own loops only. The nice value
//! is a thread's (`setpriority` on the loop's TID), and Linux hands it to
//! every thread that thread starts; a thread the loop starts while raised
//! would keep the raise for good, so the loop starts threads with
//! [`spawn`], which gives them the loop's unraised value.

use std::cell::RefCell;
use std::sync::{Arc, Mutex};

use tracing::warn;

/// Whether the thread `tid` (0: the calling one; a process's ID: its main
/// thread, which is rnicd's event loop) runs under SCHED_FIFO or SCHED_RR
/// (`rnicd --sched-fifo`). False for a task that does not exist.
pub fn realtime(tid: i32) -> bool {
    // SAFETY: plain system call; -1 (no such task) is no policy.
    let policy = unsafe { libc::sched_getscheduler(tid) };
    policy >= 0 && matches!(policy & !libc::SCHED_RESET_ON_FORK, libc::SCHED_FIFO | libc::SCHED_RR)
}

/// The event loop's nice value while a vmm it serves is in postcopy: the
/// VM runs there and its RDMA traffic goes through this loop, beside the
/// migration's push threads (normal priority) that copy its pages. At the
/// same priority, on a loaded host, the loop waited for a CPU for as long
/// as the push ran (a peer saw every QP stall 60-130 ms past the VM's
/// restart). Not a real-time class: the loop polls while it has work.
pub const POSTCOPY_NICE: i32 = -10;

/// One event loop's priority.
pub struct LoopPriority {
    tid: i32,
    raised: Mutex<Raised>,
}

struct Raised {
    /// vmms in postcopy now.
    by: usize,
    /// The loop's nice value before the first of them.
    before: i32,
}

thread_local! {
    /// The event loop's own [`LoopPriority`], on the loop's thread.
    static THIS_LOOP: RefCell<Option<Arc<LoopPriority>>> = const { RefCell::new(None) };
}

fn nice_of(tid: i32) -> i32 {
    // SAFETY: plain syscall (-1 is a valid nice value, so errors read as it).
    unsafe { libc::getpriority(libc::PRIO_PROCESS, tid as libc::id_t) }
}

fn set_nice(tid: i32, nice: i32) -> std::io::Result<()> {
    // SAFETY: plain syscall.
    if unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn gettid() -> i32 {
    // SAFETY: plain syscall.
    unsafe { libc::gettid() }
}

impl LoopPriority {
    /// The calling thread is an event loop: its priority, which the
    /// threads it starts with [`spawn`] learn their nice value from.
    pub fn of_this_thread() -> Arc<LoopPriority> {
        let p = Arc::new(LoopPriority { tid: gettid(), raised: Mutex::new(Raised { by: 0, before: 0 }) });
        THIS_LOOP.with(|l| *l.borrow_mut() = Some(p.clone()));
        p
    }

    /// A vmm the loop serves entered (`true`) or left postcopy: the first
    /// to enter raises the loop to [`POSTCOPY_NICE`], the last to leave
    /// restores the value it had before.
    pub fn postcopy_phase(&self, on: bool) {
        let mut g = self.raised.lock().unwrap();
        if on {
            g.by += 1;
            if g.by == 1 {
                g.before = nice_of(self.tid);
                if let Err(e) = set_nice(self.tid, POSTCOPY_NICE.min(g.before)) {
                    warn!("the event loop keeps its priority during postcopy: {e}");
                }
            }
        } else if g.by > 0 {
            g.by -= 1;
            if g.by == 0 {
                if let Err(e) = set_nice(self.tid, g.before) {
                    warn!("restoring the event loop's priority after postcopy: {e}");
                }
            }
        }
    }

    /// vmms in postcopy now (the loop is raised while there are any).
    pub fn in_postcopy(&self) -> usize {
        self.raised.lock().unwrap().by
    }

    /// The loop's nice value outside postcopy.
    fn unraised(&self) -> i32 {
        let g = self.raised.lock().unwrap();
        if g.by > 0 {
            g.before
        } else {
            nice_of(self.tid)
        }
    }
}

/// Starts a thread as `std::thread::Builder` does. Started from an event
/// loop, it runs at the loop's unraised nice value whatever the loop's is
/// now (read before the thread is made: a raise or restore in between
/// changes nothing for it).
pub fn spawn<F, T>(name: &str, f: F) -> std::io::Result<std::thread::JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    let nice = THIS_LOOP.with(|l| l.borrow().as_ref().map(|p| p.unraised()));
    std::thread::Builder::new().name(name.into()).spawn(move || {
        if let Some(n) = nice {
            let me = gettid();
            if nice_of(me) != n {
                if let Err(e) = set_nice(me, n) {
                    warn!("thread {:?} keeps the event loop's raised priority: {e}", std::thread::current().name());
                }
            }
        }
        f()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on_a_thread<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        std::thread::spawn(f).join().unwrap()
    }

    #[test]
    fn an_ordinary_process_is_not_realtime() {
        assert!(!realtime(0));
        assert!(!realtime(std::process::id() as i32));
        assert!(!realtime(i32::MAX), "no such task");
    }

    /// Two loops in one process raise and restore their own threads only,
    /// and a thread a raised loop starts runs at its unraised value.
    /// (Raising needs CAP_SYS_NICE: without it the loop keeps its value
    /// and the test checks only that nothing else moved.)
    #[test]
    fn each_loop_raises_itself_and_its_threads_do_not_inherit_it() {
        on_a_thread(|| {
            let a = LoopPriority::of_this_thread();
            let base = nice_of(gettid());
            // Another daemon's loop, running beside it.
            let (tx, rx) = std::sync::mpsc::channel();
            let (stop, stopped) = std::sync::mpsc::channel::<()>();
            let other = std::thread::spawn(move || {
                tx.send((LoopPriority::of_this_thread(), nice_of(gettid()))).unwrap();
                let _ = stopped.recv();
            });
            let (b, other_base) = rx.recv().unwrap();

            a.postcopy_phase(true);
            a.postcopy_phase(true);
            let raised = nice_of(gettid());
            let can_raise = raised == POSTCOPY_NICE.min(base);
            assert!(can_raise || raised == base, "{raised}");
            assert_eq!((a.in_postcopy(), b.in_postcopy()), (2, 0));
            assert_eq!(nice_of(b.tid), other_base, "the other loop is untouched");
            let started = spawn("child", || nice_of(gettid())).unwrap().join().unwrap();
            assert_eq!(started, base, "a thread the raised loop starts runs at its unraised value");

            a.postcopy_phase(false);
            assert_eq!(nice_of(gettid()), raised, "raised while a vmm is still in postcopy");
            a.postcopy_phase(false);
            a.postcopy_phase(false);
            assert_eq!(nice_of(gettid()), base, "restored exactly");
            assert_eq!(a.in_postcopy(), 0);
            stop.send(()).unwrap();
            other.join().unwrap();
        });
    }
}
