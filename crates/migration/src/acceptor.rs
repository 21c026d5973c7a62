//! The destination's acceptor: the listening socket of an incoming
//! migration and the connections that came on it before the step that
//! takes them.
//!
//! A source opens its connections one after another (the control
//! connection, its spares, then data channels, then urgent ones), and one
//! listener takes them in that order. Over several links something between
//! the hosts (a proxy, a slow first packet on one path) can still hand over
//! a later one first: a connection of the session that a later step will
//! take waits here for it instead of failing the migration. The incoming
//! migration owns its acceptor (and `migrate-recover` makes a new one for
//! its new listener); every step takes its connections from it, and what
//! it still holds is closed when it is dropped with the session.

use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use crate::stats::Control;
use crate::wire::{self, Msg};

/// More early connections than a source opens in one go is not a reorder.
const MAX_EARLY: usize = 64;

/// A connection that came before the step that takes it.
struct Early {
    session: u64,
    role: u8,
    index: u32,
    conn: TcpStream,
}

impl Early {
    /// Shut rather than only dropped: the migration's `Control` holds a
    /// copy of every accepted socket (to shut them all on cancel), so a
    /// drop alone would leave the source's end open.
    fn close(self) {
        let _ = self.conn.shutdown(Shutdown::Both);
    }
}

/// The listening socket of one incoming migration, with the connections
/// of its session that wait for their step.
pub struct Acceptor {
    listener: TcpListener,
    early: Mutex<Vec<Early>>,
}

impl Acceptor {
    pub fn new(listener: TcpListener) -> Acceptor {
        Acceptor { listener, early: Mutex::new(Vec::new()) }
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// The next connection, whatever it is (a control connection): tuned
    /// and registered with `ctl` (so that a cancel shuts it). Fails on
    /// cancel, or after `timeout` without one.
    pub fn accept(&self, ctl: &Control, timeout: Option<Duration>) -> Result<TcpStream> {
        let l = &self.listener;
        l.set_nonblocking(true)?;
        let t = Instant::now();
        loop {
            match l.accept() {
                Ok((s, _)) => {
                    s.set_nonblocking(false)?;
                    s.set_nodelay(true)?;
                    wire::tune_socket(&s);
                    ctl.register(&s);
                    return Ok(s);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if ctl.is_cancelled() {
                        bail!("cancelled");
                    }
                    if let Some(to) = timeout.filter(|&to| t.elapsed() >= to) {
                        bail!("no connection from the source within {to:?}");
                    }
                    // Wake on the connection itself (a sleep here added up
                    // to its length to every accept, and so to postcopy's
                    // downtime), and look at cancel and the deadline every
                    // 50 ms.
                    let mut pfd = libc::pollfd { fd: l.as_raw_fd(), events: libc::POLLIN, revents: 0 };
                    // SAFETY: one valid pollfd.
                    unsafe { libc::poll(&mut pfd, 1, 50) };
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// The connections a source announces for `session` after its control
    /// connection: for each `(role, first, count)`, `count` connections of
    /// that role greeted with indexes `first..first + count`. Taken in any
    /// order, each index once, first from those already here; returned by
    /// kind, in index order, each with the 30 s read timeout of its
    /// greeting. One of the session that a later step takes (a spare, data
    /// or urgent role) is kept for it; a second with the same role and
    /// index, more than [`MAX_EARLY`] kept, a greeting of another session
    /// or none fails the step.
    pub fn take(&self, ctl: &Control, session: u64, kinds: &[(u8, u32, usize)]) -> Result<Vec<Vec<TcpStream>>> {
        let mut slots: Vec<Vec<Option<TcpStream>>> = kinds.iter().map(|&(_, _, n)| (0..n).map(|_| None).collect()).collect();
        let slot_for = |role: u8, index: u32, slots: &[Vec<Option<TcpStream>>]| -> Option<(usize, usize)> {
            kinds.iter().zip(slots.iter()).enumerate().find_map(|(k, (&(r, first, _), kind))| {
                let i = index.checked_sub(first)? as usize;
                (r == role && kind.get(i).is_some_and(|slot| slot.is_none())).then_some((k, i))
            })
        };
        let mut missing = kinds.iter().map(|k| k.2).sum::<usize>();
        {
            let mut early = self.lock();
            let mut i = 0;
            while i < early.len() {
                let e = &early[i];
                match slot_for(e.role, e.index, &slots).filter(|_| e.session == session) {
                    Some((k, j)) => {
                        slots[k][j] = Some(early.swap_remove(i).conn);
                        missing -= 1;
                    }
                    None => i += 1,
                }
            }
        }
        while missing > 0 {
            let mut s = self.accept(ctl, Some(Duration::from_secs(30)))?;
            s.set_read_timeout(Some(Duration::from_secs(30)))?;
            let role = wire::read_preamble(&mut s)?;
            let greeting = wire::recv_msg(&mut s)?;
            let Msg::Channel { session: ss, index } = greeting else {
                bail!("bad connection greeting {greeting:?} (role {role}) for session {session:#x}")
            };
            if ss != session {
                bail!("connection greeting for session {ss:#x} (role {role}) while taking session {session:#x}'s");
            }
            match slot_for(role, index, &slots) {
                Some((k, j)) => {
                    slots[k][j] = Some(s);
                    missing -= 1;
                }
                None if [wire::ROLE_DATA, wire::ROLE_URGENT, wire::ROLE_CONTROL_SPARE].contains(&role) => {
                    let mut early = self.lock();
                    if early.len() >= MAX_EARLY || early.iter().any(|e| (e.session, e.role, e.index) == (session, role, index)) {
                        bail!("connection {index} (role {role}) of session {session:#x} came twice or too early");
                    }
                    early.push(Early { session, role, index, conn: s });
                }
                None => bail!("bad connection greeting {greeting:?} (role {role}) for session {session:#x}"),
            }
        }
        Ok(slots.into_iter().map(|kind| kind.into_iter().map(|s| s.expect("every slot filled once")).collect()).collect())
    }

    /// Closes the connections kept for later steps: a new attempt (a
    /// recovery) opens its own, and those of one that failed would only
    /// collide with them.
    pub fn forget_early(&self) {
        for e in self.lock().drain(..) {
            e.close();
        }
    }

    /// How many connections wait for a later step.
    pub fn early(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Early>> {
        self.early.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Acceptor {
    /// The session is over: what no step took is closed.
    fn drop(&mut self) {
        self.forget_early();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn greet(addr: SocketAddr, role: u8, session: u64, index: u32) -> TcpStream {
        let mut s = TcpStream::connect(addr).unwrap();
        wire::write_preamble(&mut s, wire::VERSION, role).unwrap();
        wire::send_msg(&mut s, &Msg::Channel { session, index }).unwrap();
        s.flush().unwrap();
        s
    }

    #[test]
    fn a_connection_before_its_step_waits_for_it_and_goes_with_the_acceptor() {
        let a = Acceptor::new(TcpListener::bind("127.0.0.1:0").unwrap());
        let ctl = Control::default();
        let addr = a.local_addr().unwrap();
        // The data channel comes before the spare the first step takes.
        let data = greet(addr, wire::ROLE_DATA, 7, 0);
        let _spare = greet(addr, wire::ROLE_CONTROL_SPARE, 7, 1);
        let spares = a.take(&ctl, 7, &[(wire::ROLE_CONTROL_SPARE, 1, 1)]).unwrap();
        assert_eq!(spares[0].len(), 1);
        assert_eq!(a.early(), 1, "the data channel waits for its step");
        let channels = a.take(&ctl, 7, &[(wire::ROLE_DATA, 0, 1), (wire::ROLE_URGENT, 0, 0)]).unwrap();
        assert_eq!(channels[0].len(), 1);
        assert_eq!(a.early(), 0);
        // One kept and never taken is closed with the acceptor.
        let late = greet(addr, wire::ROLE_URGENT, 7, 3);
        let _spare = greet(addr, wire::ROLE_CONTROL_SPARE, 7, 1);
        a.take(&ctl, 7, &[(wire::ROLE_CONTROL_SPARE, 1, 1)]).unwrap();
        assert_eq!(a.early(), 1);
        drop(a);
        late.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        assert_eq!(std::io::Read::read(&mut &late, &mut [0u8; 1]).unwrap(), 0, "closed with the acceptor");
        drop(data);
    }

    #[test]
    fn the_same_connection_twice_or_another_session_fails_the_step() {
        let a = Acceptor::new(TcpListener::bind("127.0.0.1:0").unwrap());
        let ctl = Control::default();
        let addr = a.local_addr().unwrap();
        let _d1 = greet(addr, wire::ROLE_DATA, 7, 0);
        let _d2 = greet(addr, wire::ROLE_DATA, 7, 0);
        let e = a.take(&ctl, 7, &[(wire::ROLE_CONTROL_SPARE, 1, 1)]).unwrap_err();
        assert!(format!("{e:#}").contains("came twice"), "{e:#}");
        a.forget_early();
        let _other = greet(addr, wire::ROLE_DATA, 8, 0);
        let e = a.take(&ctl, 7, &[(wire::ROLE_DATA, 0, 1)]).unwrap_err();
        assert!(format!("{e:#}").contains("session 0x8"), "{e:#}");
    }
}
