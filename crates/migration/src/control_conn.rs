//! The control connection of a migration, on every link at once.
//!
//! With several links the source opens one control connection per link at
//! setup: the first carries the stream, the others (announced with the
//! session id, as data channels are) wait. Both ends count the bytes they
//! sent and received on the stream and keep what they sent since the last
//! failover. When the connection carrying the stream fails (an error, a
//! hang-up, the peer's FIN, or TCP giving up on unacknowledged bytes after
//! [`LINK_TIMEOUT`]), the side that notices shuts it and moves to the next
//! connection: it writes there how many bytes it received, reads how many
//! the peer received, and resends what the peer lacks. The peer notices
//! the resume arriving on that connection (or the failure itself) and
//! does the same, so both ends continue on it with no byte lost or doubled.
//!
//! The peer's FIN alone moves nothing while the engine does not read: a
//! peer that moves the stream writes its resume on the next connection,
//! and one whose migration ended closes every connection, which is no
//! link failure. An end that is done with the stream says so
//! ([`ControlConn::close`]) before it tears anything down, so that its own
//! teardown is not taken for a failure either. The end that sent the last
//! message first waits, bounded, for the peer's close
//! ([`ControlConn::finish`]): until the peer read it, that message may
//! still need a failover.
//!
//! A watcher thread per end looks at the connections every
//! [`WATCH_EVERY`], so a failover happens even while the engine neither
//! reads nor writes the control connection. The engine reads and writes a
//! [`ControlConn`] as it would a `TcpStream` and never knows which link
//! carries it. With one link there is one connection and nothing to fail
//! over to: an error is the engine's, as on a plain socket.

use crate::acceptor::Acceptor;
use crate::links::{shorten_timeout, LINK_TIMEOUT};
use crate::stats::Control;
use crate::wire::{self, Msg};
use anyhow::Result;
use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

/// How often the watcher looks at the connections, and the slice in which
/// a read waits before it looks at a failover again.
const WATCH_EVERY: Duration = Duration::from_millis(100);
/// How long a failover waits for the peer's resume on the next connection.
/// The peer's watcher answers within [`WATCH_EVERY`] of its arrival; a
/// writer of the peer stuck on the dead connection is released by the
/// shutdown that starts the peer's failover.
const RESUME_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the end that sent the stream's last message waits for the
/// peer's close ([`ControlConn::finish`]). The peer closes as soon as it
/// read the message; if the link carrying it dies first, one end finds it
/// dead within [`LINK_TIMEOUT`] (unacknowledged bytes, or idle probes),
/// and the resume on the next connection takes at most [`RESUME_TIMEOUT`].
pub const LAST_MESSAGE_WAIT: Duration = Duration::from_secs(2 * LINK_TIMEOUT.as_secs() + RESUME_TIMEOUT.as_secs());
/// The first bytes of a resume: this magic, then the bytes received.
const RESUME_MAGIC: [u8; 8] = *b"TRCTLRSM";
/// `live` once every connection failed, or the stream was closed.
const DEAD: usize = usize::MAX;

/// One end of the control connection (clones share it).
#[derive(Clone)]
pub struct ControlConn {
    inner: Arc<Inner>,
}

struct Inner {
    /// One connection per link, in link order: the stream moves only
    /// forward through them.
    conns: Vec<TcpStream>,
    /// The connection carrying the stream (changed under `tx` and `rx`).
    live: AtomicUsize,
    /// Waiting connections the watcher saw die: a failover skips them.
    quiet: Vec<AtomicBool>,
    /// This end is done with the stream ([`ControlConn::close`]): nothing
    /// moves it any more.
    closed: AtomicBool,
    /// Times the stream moved to another connection.
    moves: AtomicU64,
    /// One failover at a time.
    switch: Mutex<()>,
    tx: Mutex<Tx>,
    rx: Mutex<Rx>,
    read_timeout: Mutex<Option<Duration>>,
    /// Told the link the stream moved to.
    on_move: Mutex<Option<MoveHook>>,
    /// `control_moves` in the statistics.
    ctl: Arc<Control>,
}

type MoveHook = Box<dyn Fn(usize) + Send>;

/// What this end sent: every byte since the last failover is kept, as the
/// peer may not have read it.
struct Tx {
    sent: u64,
    kept: Vec<u8>,
    /// The stream offset of `kept[0]`.
    kept_from: u64,
}

/// Kept bytes are dropped in pieces at least this large (each drop moves
/// the rest of `kept`).
const TRIM_AT_LEAST: usize = 64 << 10;

impl Tx {
    /// `unacked` bytes of the live connection's send queue are not yet
    /// acknowledged by the peer's kernel: every byte before them is in the
    /// peer's socket, and the peer reads all of it before it shuts that
    /// connection (a failover drains it), so its resume never asks for
    /// them. Without a count, keep everything.
    fn trim(&mut self, unacked: Option<u64>) {
        let Some(q) = unacked else { return };
        let safe = self.sent.saturating_sub(q);
        let n = safe.saturating_sub(self.kept_from).min(self.kept.len() as u64) as usize;
        if n >= TRIM_AT_LEAST || (n > 0 && n == self.kept.len()) {
            self.kept.drain(..n);
            self.kept_from += n as u64;
        }
    }
}

/// Bytes in a socket's send queue not yet acknowledged by the peer
/// (`SIOCOUTQ`).
fn unacked(s: &TcpStream) -> Option<u64> {
    let mut n: libc::c_int = 0;
    // SAFETY: TIOCOUTQ (SIOCOUTQ for TCP) writes one int.
    let r = unsafe { libc::ioctl(s.as_raw_fd(), libc::TIOCOUTQ, &mut n) };
    (r == 0 && n >= 0).then_some(n as u64)
}

struct Rx {
    received: u64,
    /// Bytes read off a failed connection before it was shut, not yet
    /// handed to the engine.
    drained: VecDeque<u8>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn lost() -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionAborted, "the control connection is lost on every link")
}

/// Poll one descriptor; the events seen (0 on a timeout).
fn poll_one(s: &TcpStream, events: i16, wait: Duration) -> i16 {
    let mut pfd = libc::pollfd { fd: s.as_raw_fd(), events, revents: 0 };
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut pfd, 1, wait.as_millis() as i32) };
    if n > 0 {
        pfd.revents
    } else {
        0
    }
}

impl ControlConn {
    /// Wrap the connections of a session, set up and announced: `conns[0]`
    /// carries the stream from here on, the others wait.
    pub fn new(conns: Vec<TcpStream>, ctl: &Arc<Control>) -> Result<ControlConn> {
        assert!(!conns.is_empty());
        // Each was registered with `ctl` as it connected: a cancel shuts
        // every one of them. Its statistics count the moves.
        let ctl = ctl.clone();
        for c in &conns {
            c.set_read_timeout(None)?;
            if conns.len() > 1 {
                shorten_timeout(c);
            }
        }
        let several = conns.len() > 1;
        let inner = Arc::new(Inner {
            quiet: conns.iter().map(|_| AtomicBool::new(false)).collect(),
            closed: AtomicBool::new(false),
            moves: AtomicU64::new(0),
            conns,
            live: AtomicUsize::new(0),
            switch: Mutex::new(()),
            tx: Mutex::new(Tx { sent: 0, kept: Vec::new(), kept_from: 0 }),
            rx: Mutex::new(Rx { received: 0, drained: VecDeque::new() }),
            read_timeout: Mutex::new(None),
            on_move: Mutex::new(None),
            ctl,
        });
        if several {
            let weak = Arc::downgrade(&inner);
            std::thread::Builder::new().name("migrate-control".into()).spawn(move || watch(weak))?;
        }
        Ok(ControlConn { inner })
    }

    /// The source's extra connections, one to each link after the first,
    /// announced with the session id (before any data channel opens).
    pub fn open_spares(addrs: &[&str], session: u64, ctl: &Control) -> Result<Vec<TcpStream>> {
        let mut out = Vec::new();
        for (k, addr) in addrs.iter().enumerate() {
            let mut s = crate::wire::connect(addr, ctl)?;
            wire::write_preamble(&mut s, wire::VERSION, wire::ROLE_CONTROL_SPARE)?;
            wire::send_msg(&mut s, &Msg::Channel { session, index: k as u32 + 1 })?;
            out.push(s);
        }
        Ok(out)
    }

    /// The destination's side of [`open_spares`](Self::open_spares):
    /// `count` connections of `session`, in link order after `first`.
    pub fn accept_spares(first: TcpStream, acceptor: &Acceptor, session: u64, count: usize, ctl: &Control) -> Result<Vec<TcpStream>> {
        let mut spares = acceptor.take(ctl, session, &[(wire::ROLE_CONTROL_SPARE, 1, count)])?;
        Ok(std::iter::once(first).chain(spares.remove(0)).collect())
    }

    pub fn try_clone(&self) -> io::Result<ControlConn> {
        Ok(self.clone())
    }

    /// As `TcpStream::set_read_timeout`: a read waiting longer fails with
    /// `WouldBlock`.
    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        *lock(&self.inner.read_timeout) = t;
        Ok(())
    }

    /// Whether a read would find something (data, or an end or error to
    /// report) within `wait`.
    pub fn wait_readable(&self, wait: Duration) -> bool {
        let t = Instant::now();
        loop {
            // Wait without holding `rx`: the watcher's failover takes it.
            let live = self.inner.live.load(Ordering::SeqCst);
            if live != DEAD {
                let slice = wait.saturating_sub(t.elapsed()).min(WATCH_EVERY);
                poll_one(&self.inner.conns[live], libc::POLLIN, slice);
            }
            {
                let rx = lock(&self.inner.rx);
                if !rx.drained.is_empty() {
                    return true;
                }
                let live = self.inner.live.load(Ordering::SeqCst);
                if live == DEAD {
                    return true;
                }
                let c = &self.inner.conns[live];
                if poll_one(c, libc::POLLIN, Duration::ZERO) != 0 {
                    // Data, or the connection's end: the end moves the
                    // stream on, and the wait goes on there.
                    match c.peek(&mut [0u8]) {
                        Ok(n) if n > 0 => return true,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                        _ => {}
                    }
                    drop(rx);
                    if self.inner.fail_over(live).is_err() {
                        return true;
                    }
                    continue;
                }
            }
            if t.elapsed() >= wait {
                return false;
            }
        }
    }

    /// The link carrying the stream now (its index in the session's
    /// links), None once every one failed.
    pub fn live_link(&self) -> Option<usize> {
        Some(self.inner.live.load(Ordering::SeqCst)).filter(|&l| l != DEAD)
    }

    /// Call `hook` with the link's index whenever the stream moves.
    pub fn on_move(&self, hook: impl Fn(usize) + Send + 'static) {
        *lock(&self.inner.on_move) = Some(Box::new(hook));
    }

    /// How many times the stream moved to another connection.
    pub fn moves(&self) -> u64 {
        self.inner.moves.load(Ordering::SeqCst)
    }

    pub fn shutdown(&self) {
        for c in &self.inner.conns {
            let _ = c.shutdown(Shutdown::Both);
        }
    }

    /// This end sent the stream's last message: wait, at most
    /// [`LAST_MESSAGE_WAIT`], until the peer closed its end (it read everything, and closes on
    /// the last message), failing over meanwhile as ever, then
    /// [`close`](Self::close). Closing at once would end failover for that
    /// message: a link that dies before the peer reads it leaves the peer
    /// waiting on a stream that no longer moves. With one connection there
    /// is nothing to fail over to, and it closes at once. Whatever the
    /// peer still sends is read and dropped. Whether the peer closed in
    /// time.
    pub fn finish(&self) -> bool {
        let closed = self.inner.conns.len() > 1 && self.inner.wait_peer_close(LAST_MESSAGE_WAIT);
        self.close();
        closed
    }

    /// This end is done with the stream (the migration ended, cleanly or
    /// not): from here nothing moves it, neither the peer closing its end
    /// nor this end shutting its sockets (a source's channel teardown shuts
    /// every connection of the migration), and every connection is shut.
    /// Reads and writes after it fail.
    pub fn close(&self) {
        let _one = lock(&self.inner.switch);
        self.inner.closed.store(true, Ordering::SeqCst);
        self.inner.live.store(DEAD, Ordering::SeqCst);
        self.shutdown();
    }
}

impl Inner {
    fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let timeout = *lock(&self.read_timeout);
        let t = Instant::now();
        loop {
            // Wait without holding `rx`: the watcher's failover takes it.
            let live = self.live.load(Ordering::SeqCst);
            if live != DEAD {
                poll_one(&self.conns[live], libc::POLLIN, WATCH_EVERY);
            }
            let failed = {
                let mut rx = lock(&self.rx);
                if !rx.drained.is_empty() {
                    let n = buf.len().min(rx.drained.len());
                    for (b, d) in buf.iter_mut().zip(rx.drained.drain(..n)) {
                        *b = d;
                    }
                    return Ok(n);
                }
                let live = self.live.load(Ordering::SeqCst);
                if live == DEAD {
                    return Err(lost());
                }
                let c = &self.conns[live];
                if poll_one(c, libc::POLLIN, Duration::ZERO) != 0 {
                    match (&*c).read(buf) {
                        Ok(0) => Some((live, None)),
                        Ok(n) => {
                            rx.received += n as u64;
                            return Ok(n);
                        }
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => None,
                        Err(e) => Some((live, Some(e))),
                    }
                } else {
                    None
                }
            };
            if let Some((live, e)) = failed {
                if self.fail_over(live).is_err() {
                    let rx = lock(&self.rx);
                    if !rx.drained.is_empty() {
                        continue;
                    }
                    // The end or error the connection itself gave.
                    return match e {
                        None => Ok(0),
                        Some(e) => Err(e),
                    };
                }
                continue;
            }
            if timeout.is_some_and(|to| t.elapsed() >= to) {
                return Err(io::Error::new(io::ErrorKind::WouldBlock, "control connection read timed out"));
            }
        }
    }

    fn write(&self, buf: &[u8]) -> io::Result<usize> {
        let live = {
            let mut tx = lock(&self.tx);
            let live = self.live.load(Ordering::SeqCst);
            if live == DEAD {
                return Err(lost());
            }
            if self.conns.len() > 1 {
                tx.kept.extend_from_slice(buf);
            }
            tx.sent += buf.len() as u64;
            match (&self.conns[live]).write_all(buf) {
                Ok(()) => {
                    if self.conns.len() > 1 {
                        tx.trim(unacked(&self.conns[live]));
                    }
                    return Ok(buf.len());
                }
                Err(e) if self.conns.len() == 1 => return Err(e),
                Err(e) => tracing::debug!("control connection on link {live}: {e}"),
            }
            live
        };
        // The bytes are kept: the failover resends what the peer lacks.
        self.fail_over(live).map(|()| buf.len())
    }

    /// See [`ControlConn::finish`].
    fn wait_peer_close(&self, wait: Duration) -> bool {
        let t = Instant::now();
        let mut buf = [0u8; 4096];
        loop {
            let left = wait.saturating_sub(t.elapsed());
            let live = self.live.load(Ordering::SeqCst);
            if left.is_zero() || live == DEAD {
                return false;
            }
            // Wait without holding `rx`: the watcher's failover takes it.
            let c = &self.conns[live];
            poll_one(c, libc::POLLIN, left.min(WATCH_EVERY));
            let failed = {
                let mut rx = lock(&self.rx);
                rx.drained.clear();
                if self.live.load(Ordering::SeqCst) != live || poll_one(c, libc::POLLIN, Duration::ZERO) == 0 {
                    continue;
                }
                match (&*c).read(&mut buf) {
                    Ok(0) => match self.peer_ended_after(live) {
                        Some(true) => return true,
                        Some(false) => true,
                        None => {
                            // Its FIN on the live connection alone: a
                            // close shuts the others in the same instant,
                            // a failover resumes on one of them.
                            drop(rx);
                            std::thread::sleep(left.min(WATCH_EVERY / 10));
                            false
                        }
                    },
                    Ok(n) => {
                        rx.received += n as u64;
                        false
                    }
                    Err(e) => e.kind() != io::ErrorKind::Interrupted,
                }
            };
            if failed && self.fail_over(live).is_err() {
                return false;
            }
        }
    }

    /// The peer's FIN came on the live connection `live`: whether it closed
    /// every later connection too (`Some(true)`: its stream ended), resumes
    /// on one of them (`Some(false)`), or neither yet (`None`).
    fn peer_ended_after(&self, live: usize) -> Option<bool> {
        for (k, c) in self.conns.iter().enumerate().skip(live + 1) {
            if self.quiet[k].load(Ordering::SeqCst) {
                continue;
            }
            let ev = poll_one(c, libc::POLLIN | libc::POLLRDHUP, Duration::ZERO);
            if ev & (libc::POLLERR | libc::POLLHUP) != 0 {
                continue;
            }
            if ev & libc::POLLIN == 0 {
                return None;
            }
            match c.peek(&mut [0u8]) {
                Ok(n) if n > 0 => return Some(false),
                _ => {}
            }
        }
        Some(true)
    }

    /// The connection `from` failed (or the peer moved on from it): move
    /// the stream to the next one that works. A no-op if another thread
    /// moved it already.
    fn fail_over(&self, from: usize) -> io::Result<()> {
        let _one = lock(&self.switch);
        let live = self.live.load(Ordering::SeqCst);
        if live == DEAD || self.closed.load(Ordering::SeqCst) {
            return Err(lost());
        }
        if live != from {
            return Ok(());
        }
        let mut rx = lock(&self.rx);
        // What already arrived on it is the peer's stream: keep it.
        let old = &self.conns[from];
        let mut chunk = [0u8; 16 << 10];
        while poll_one(old, libc::POLLIN, Duration::ZERO) & libc::POLLIN != 0 {
            match (&*old).read(&mut chunk) {
                Ok(n) if n > 0 => {
                    rx.received += n as u64;
                    rx.drained.extend(&chunk[..n]);
                }
                _ => break,
            }
        }
        // Releases a writer blocked on it, and tells the peer if the link
        // still carries anything.
        let _ = old.shutdown(Shutdown::Both);
        let mut tx = lock(&self.tx);
        for next in from + 1..self.conns.len() {
            if self.quiet[next].load(Ordering::SeqCst) {
                continue;
            }
            match self.resume(next, rx.received, &mut tx) {
                Ok(()) => {
                    tracing::warn!("migration: control connection moved from link {from} to link {next}");
                    self.live.store(next, Ordering::SeqCst);
                    self.moves.fetch_add(1, Ordering::SeqCst);
                    self.ctl.update(|s| s.control_moves += 1);
                    if let Some(hook) = lock(&self.on_move).as_ref() {
                        hook(next);
                    }
                    return Ok(());
                }
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                    // The peer closed that connection too: its migration
                    // ended (or its process did), no link failed.
                    tracing::debug!("migration: control connection: the peer closed link {next} as well");
                    let _ = self.conns[next].shutdown(Shutdown::Both);
                }
                Err(e) => {
                    tracing::warn!("migration: control connection cannot resume on link {next}: {e}");
                    let _ = self.conns[next].shutdown(Shutdown::Both);
                }
            }
        }
        self.live.store(DEAD, Ordering::SeqCst);
        Err(lost())
    }

    /// The resume on connection `k`: what we received, what the peer
    /// received, then what it lacks of ours.
    fn resume(&self, k: usize, received: u64, tx: &mut Tx) -> io::Result<()> {
        let c = &self.conns[k];
        // The failover holds `tx` and `rx`: a write stuck on a dead spare
        // must give up, as the read of the peer's resume does.
        c.set_write_timeout(Some(RESUME_TIMEOUT))?;
        let r = self.resume_on(c, received, tx);
        c.set_write_timeout(None)?;
        r
    }

    fn resume_on(&self, c: &TcpStream, received: u64, tx: &mut Tx) -> io::Result<()> {
        let mut hdr = [0u8; 16];
        hdr[..8].copy_from_slice(&RESUME_MAGIC);
        hdr[8..].copy_from_slice(&received.to_le_bytes());
        (&*c).write_all(&hdr)?;
        c.set_read_timeout(Some(RESUME_TIMEOUT))?;
        let mut theirs = [0u8; 16];
        let r = (&*c).read_exact(&mut theirs);
        c.set_read_timeout(None)?;
        r?;
        if theirs[..8] != RESUME_MAGIC {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "not a control resume"));
        }
        let peer_has = u64::from_le_bytes(theirs[8..].try_into().unwrap());
        if peer_has < tx.kept_from || peer_has > tx.sent {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("the peer resumes at byte {peer_has}, outside {}..={} kept here", tx.kept_from, tx.sent),
            ));
        }
        let skip = (peer_has - tx.kept_from) as usize;
        tx.kept.drain(..skip);
        tx.kept_from = peer_has;
        (&*c).write_all(&tx.kept)
    }
}

/// The watcher: a failure of the live connection, or the peer's resume on
/// a later one, starts a failover without waiting for the engine to read
/// or write. Ends with the connection.
fn watch(weak: Weak<Inner>) {
    // The live connection whose peer sent its FIN: from then on only its
    // errors count (poll reports those unasked).
    let mut fin_seen = None;
    loop {
        let Some(inner) = weak.upgrade() else { return };
        let live = inner.live.load(Ordering::SeqCst);
        if live == DEAD || inner.closed.load(Ordering::SeqCst) {
            return;
        }
        let mut fds: Vec<libc::pollfd> = Vec::new();
        let mut which = Vec::new();
        for (k, c) in inner.conns.iter().enumerate().skip(live) {
            if k > live && inner.quiet[k].load(Ordering::SeqCst) {
                continue;
            }
            // The live one: only its failure (its data is the engine's).
            let events = match k == live {
                true if fin_seen == Some(live) => 0,
                true => libc::POLLRDHUP,
                false => libc::POLLIN | libc::POLLRDHUP,
            };
            fds.push(libc::pollfd { fd: c.as_raw_fd(), events, revents: 0 });
            which.push(k);
        }
        // SAFETY: valid pollfds; the connections live as long as `inner`.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, WATCH_EVERY.as_millis() as i32) };
        if n <= 0 {
            continue;
        }
        let mut move_on = false;
        for (p, &k) in fds.iter().zip(&which) {
            if p.revents == 0 {
                continue;
            }
            if k == live {
                if p.revents & (libc::POLLERR | libc::POLLHUP) != 0 {
                    move_on = true;
                } else {
                    // The peer's FIN alone: a peer that moves the stream
                    // resumes on a later connection (seen here), one that
                    // ended closes them all. The engine's own read of the
                    // end still moves it.
                    fin_seen = Some(live);
                }
            } else if p.revents & libc::POLLIN != 0 && p.revents & (libc::POLLERR | libc::POLLHUP | libc::POLLRDHUP) == 0 {
                // The peer moved the stream there.
                move_on = true;
            } else {
                // A waiting connection's link died: nothing to resume on.
                inner.quiet[k].store(true, Ordering::SeqCst);
            }
        }
        if move_on {
            let _ = inner.fail_over(live);
        }
    }
}

impl Read for &ControlConn {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.inner.read(buf)
    }
}

impl Write for &ControlConn {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.inner.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Read for ControlConn {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.inner.read(buf)
    }
}

impl Write for ControlConn {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.inner.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// Two ends joined by `n` loopback connections.
    fn pair(n: usize) -> (ControlConn, ControlConn, Vec<TcpStream>, Vec<TcpStream>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for _ in 0..n {
            a.push(TcpStream::connect(l.local_addr().unwrap()).unwrap());
            b.push(l.accept().unwrap().0);
        }
        let ctl = Arc::new(Control::default());
        let (ra, rb) = (a.iter().map(|s| s.try_clone().unwrap()).collect(), b.iter().map(|s| s.try_clone().unwrap()).collect());
        (ControlConn::new(a, &ctl).unwrap(), ControlConn::new(b, &ctl).unwrap(), ra, rb)
    }

    #[test]
    fn the_stream_goes_on_after_its_connection_breaks() {
        let (a, b, ra, _) = pair(2);
        wire::send_msg(&mut &a, &Msg::Ready).unwrap();
        assert_eq!(wire::recv_msg(&mut &b).unwrap(), Msg::Ready);
        // The first connection dies under the sender: what it writes next
        // and what the other end writes arrive on the second.
        ra[0].shutdown(Shutdown::Both).unwrap();
        wire::send_blob(&mut &a, &[7u8; 100_000]).unwrap();
        wire::send_msg(&mut &b, &Msg::Welcome).unwrap();
        assert_eq!(wire::recv_blob(&mut &b).unwrap(), vec![7u8; 100_000]);
        assert_eq!(wire::recv_msg(&mut &a).unwrap(), Msg::Welcome);
        assert_eq!((a.live_link(), b.live_link()), (Some(1), Some(1)));
    }

    #[test]
    fn bytes_the_peer_acknowledged_are_not_kept() {
        let (a, b, ra, _) = pair(2);
        let reader = std::thread::spawn(move || {
            let got = wire::recv_blob(&mut &b).unwrap();
            (b, got)
        });
        wire::send_blob(&mut &a, &vec![3u8; 8 << 20]).unwrap();
        let (b, got) = reader.join().unwrap();
        assert_eq!(got.len(), 8 << 20);
        // Written once more, after the peer read the rest: the acknowledged
        // bytes are trimmed, not kept until a failover.
        wire::send_blob(&mut &a, &vec![4u8; TRIM_AT_LEAST * 2]).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        wire::send_msg(&mut &a, &Msg::Go).unwrap();
        let kept = lock(&a.inner.tx).kept.len();
        assert!(kept < 4 * TRIM_AT_LEAST, "{kept} bytes kept");
        // The stream still resumes on the second connection.
        assert_eq!(wire::recv_blob(&mut &b).unwrap(), vec![4u8; TRIM_AT_LEAST * 2]);
        ra[0].shutdown(Shutdown::Both).unwrap();
        wire::send_msg(&mut &a, &Msg::Ready).unwrap();
        assert_eq!(wire::recv_msg(&mut &b).unwrap(), Msg::Go);
        assert_eq!(wire::recv_msg(&mut &b).unwrap(), Msg::Ready);
        assert_eq!(a.live_link(), Some(1));
    }

    #[test]
    fn a_peer_that_closes_after_its_last_message_moves_nothing() {
        let (a, b, _, _) = pair(2);
        wire::send_msg(&mut &b, &Msg::Go).unwrap();
        b.close();
        // The watcher sees both FINs, the reader the message and the end.
        std::thread::sleep(WATCH_EVERY * 3);
        assert_eq!(wire::recv_msg(&mut &a).unwrap(), Msg::Go);
        assert!(wire::recv_msg(&mut &a).is_err(), "the stream ended");
        assert_eq!((a.moves(), b.moves()), (0, 0));
        // Nor does this end's own teardown once it closed.
        a.close();
        a.shutdown();
        std::thread::sleep(WATCH_EVERY * 2);
        assert_eq!(a.moves(), 0);
    }

    #[test]
    fn the_last_sender_waits_until_the_peer_read_its_message() {
        let (a, b, _, _) = pair(2);
        wire::send_msg(&mut &b, &Msg::Go).unwrap();
        let waiter = std::thread::spawn(move || b.finish());
        std::thread::sleep(WATCH_EVERY * 3);
        assert!(!waiter.is_finished(), "it waits for the peer's close");
        assert_eq!(wire::recv_msg(&mut &a).unwrap(), Msg::Go);
        a.close();
        assert!(waiter.join().unwrap(), "the peer's close ends the wait");
        assert_eq!(a.moves(), 0);
    }

    #[test]
    fn the_wait_for_the_peer_is_bounded() {
        let (_a, b, _, _) = pair(2);
        wire::send_msg(&mut &b, &Msg::Go).unwrap();
        assert!(!b.inner.wait_peer_close(WATCH_EVERY * 3), "a peer that never closes");
    }

    #[test]
    fn every_connection_lost_is_an_error() {
        let (a, b, ra, _) = pair(2);
        for s in &ra {
            s.shutdown(Shutdown::Both).unwrap();
        }
        b.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        assert!(wire::recv_msg(&mut &b).is_err());
        assert!(wire::send_msg(&mut &a, &Msg::Ready).is_err());
        assert_eq!(a.live_link(), None);
    }

    #[test]
    fn one_connection_reads_and_times_out_as_a_socket() {
        let (a, b, _, _) = pair(1);
        b.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
        let e = wire::recv_msg(&mut &b).unwrap_err();
        assert!(format!("{e}").contains("timed out"), "{e}");
        wire::send_msg(&mut &a, &Msg::Go).unwrap();
        assert_eq!(wire::recv_msg(&mut &b).unwrap(), Msg::Go);
        drop(a);
        assert!(wire::recv_msg(&mut &b).is_err(), "the peer's close ends the stream");
    }
}
