// SPDX-License-Identifier: GPL-2.0-or-later
//! Optionally moves a thread that posts work off the CPU its rnicd runs on
//! (`TRANSIT_VERBS_AVOID_RNICD_CPU=1`; off by default).
//!
//! rnicd does the NIC's work on the host's CPUs, and under `--sched-fifo`
//! it preempts whatever runs on its CPU. A program sharing that CPU runs in
//! turn with it: every doorbell preempts the program, and the program runs
//! again only after rnicd has sent the packet, acknowledged what came in
//! and gone back to sleep. On another CPU the two overlap, as a program
//! and its NIC do: rnicd is often still awake when the program posts again
//! and takes the WQE without a doorbell. On the 2-CPU test host a
//! ping-pong whose programs each shared their own rnicd's CPU took 46-51 us
//! per one-way trip, and 27-30 us in most runs with each program beside
//! the other host's rnicd; which of the two a run got was the scheduler's
//! pick, held for the whole run (docs/ibverbs.md, "The two latency levels").
//!
//! With the variable set, the first post of each thread looks at the CPU
//! rnicd's event loop last ran on (`/proc/PID/stat`, the PID from the
//! control socket's `SO_PEERCRED`) and, when it is the thread's own, moves
//! the thread to another CPU its affinity allows: it sets its affinity to
//! the mask without that CPU (which migrates it at once) and then back to
//! the mask as it was. The program's affinity is unchanged afterwards and
//! the scheduler stays free to place it; a thread whose mask holds only
//! rnicd's CPU stays. rnicd in the same process (tests) is left alone.
//! It is off by default because it is not shown to help: looking again
//! every 10 ms made latency worse on the loaded host (the scheduler moved
//! the programs back, and they moved again; docs/ibverbs.md), and the
//! idle host where the two levels show has not been measured with it.

use std::cell::Cell;
use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::FileExt;

/// Where one context's rnicd runs.
pub(crate) struct RnicdCpu {
    /// rnicd's `/proc/PID/stat`; None when the move is off (the default),
    /// or rnicd is this process or cannot be seen.
    stat: Option<File>,
    /// rnicd's event loop ran under a real-time policy (`rnicd
    /// --sched-fifo`) when the context opened.
    pub(crate) realtime: bool,
}

impl RnicdCpu {
    /// The rnicd at the other end of the control socket `sock`.
    pub(crate) fn of_peer(sock: &OwnedFd) -> RnicdCpu {
        let off = !std::env::var("TRANSIT_VERBS_AVOID_RNICD_CPU").is_ok_and(|v| v == "1");
        let pid = nix::sys::socket::getsockopt(&sock.as_fd(), nix::sys::socket::sockopt::PeerCredentials).map_or(0, |c| c.pid());
        let stat = if off || pid <= 0 || pid as u32 == std::process::id() { None } else { File::open(format!("/proc/{pid}/stat")).ok() };
        RnicdCpu { stat, realtime: pid > 0 && rnic::loop_priority::realtime(pid) }
    }

    /// The CPU rnicd's event loop (its main thread) last ran on.
    fn cpu(&self) -> Option<usize> {
        let f = self.stat.as_ref()?;
        let mut buf = [0u8; 1024];
        let n = f.read_at(&mut buf, 0).ok()?;
        last_cpu(&buf[..n])
    }

    /// Called after posting: the first time in each thread, moves the
    /// calling thread off rnicd's CPU if it is on it.
    pub(crate) fn keep_off(&self) {
        if self.stat.is_none() {
            return;
        }
        thread_local!(static LOOKED: Cell<bool> = const { Cell::new(false) });
        if LOOKED.with(|l| l.replace(true)) {
            return;
        }
        if let Some(cpu) = self.cpu() {
            if current_cpu() == Some(cpu) {
                move_off(cpu);
            }
        }
    }
}

/// Field 39 (`processor`) of a `/proc/PID/stat` line: the CPU the task
/// last ran on. The fields after the command name (which may hold spaces
/// and parentheses) start at field 3.
pub fn last_cpu(stat: &[u8]) -> Option<usize> {
    let s = std::str::from_utf8(stat).ok()?;
    let rest = &s[s.rfind(')')? + 1..];
    rest.split_ascii_whitespace().nth(39 - 3)?.parse().ok()
}

/// The CPU the calling thread runs on.
pub fn current_cpu() -> Option<usize> {
    // SAFETY: no arguments; returns -1 on failure.
    let c = unsafe { libc::sched_getcpu() };
    (c >= 0).then_some(c as usize)
}

/// Moves the calling thread to another CPU of its affinity mask than
/// `cpu`, leaving the mask as it was. False if the mask has no other CPU.
pub fn move_off(cpu: usize) -> bool {
    let size = std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: cpu_set_t is plain data; the calls get its size and a valid
    // pointer, and act on the calling thread (pid 0) only.
    unsafe {
        let mut mask: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, size, &mut mask) != 0 || cpu >= 8 * size || !libc::CPU_ISSET(cpu, &mask) || libc::CPU_COUNT(&mask) < 2
        {
            return false;
        }
        let mut others = mask;
        libc::CPU_CLR(cpu, &mut others);
        let moved = libc::sched_setaffinity(0, size, &others) == 0;
        libc::sched_setaffinity(0, size, &mask);
        moved
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_cpu_reads_field_39_past_odd_command_names() {
        let tail = (4..=52).map(|f| if f == 39 { "7".to_string() } else { f.to_string() }).collect::<Vec<_>>().join(" ");
        assert_eq!(last_cpu(format!("1234 (rnicd) S {tail}\n").as_bytes()), Some(7));
        assert_eq!(last_cpu(format!("1234 (a) b (c) S {tail}\n").as_bytes()), Some(7));
        assert_eq!(last_cpu(b"1234 (rnicd) S 1 2 3"), None);
        assert_eq!(last_cpu(b"garbage"), None);
    }

    #[test]
    fn this_process_has_a_current_cpu() {
        assert!(current_cpu().is_some());
    }
}
