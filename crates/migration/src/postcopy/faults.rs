//! The destination's fault thread: reads page faults from every fault
//! domain (the vmm's uffd and each helper's) and asks the source for pages
//! nobody asked for yet, on the urgent connection.

use crate::place::{Asks, Placer, PUSH_GRACE};
use crate::wire;
use nix::sys::eventfd::{EfdFlags, EventFd};
use std::collections::VecDeque;
use std::io::Write;
use std::net::TcpStream;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use userfaultfd::Event;

/// The write side of the urgent connections (one per link, requests go
/// on the first one left), or over the rdma transport the fetcher that
/// READs the pages ([`super::fetch`]); absent while reconnecting (the
/// waiters remember what to ask for again).
/// How long a page request may wait to enter an urgent connection's
/// socket when another link can carry it instead (requests are a few
/// bytes: a socket this full is on a dead link).
const URGENT_WRITE_TIMEOUT: Duration = Duration::from_millis(500);

#[derive(Default)]
pub struct RequestSink {
    conns: Mutex<Vec<Option<TcpStream>>>,
    reads: Mutex<Option<std::sync::mpsc::Sender<super::fetch::Ask>>>,
}

impl RequestSink {
    /// The urgent connections, in link order.
    pub fn connect(&self, conns: Vec<TcpStream>) {
        if conns.len() > 1 {
            // A request stuck on a dead link's full socket would hold the
            // fault thread: give up on that connection and ask on the next.
            for s in &conns {
                let _ = s.set_write_timeout(Some(URGENT_WRITE_TIMEOUT));
            }
        }
        *self.conns.lock().unwrap() = conns.into_iter().map(Some).collect();
    }
    /// The urgent connection of link `k` failed: requests go on the next.
    /// What was asked on it and not answered must be asked again (the
    /// placer's waiters). True if another connection is left.
    pub fn lose(&self, k: usize) -> bool {
        let mut g = self.conns.lock().unwrap();
        if let Some(s) = g.get_mut(k).and_then(Option::take) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        g.iter().any(Option::is_some)
    }
    pub(crate) fn connect_reads(&self, tx: std::sync::mpsc::Sender<super::fetch::Ask>) {
        *self.reads.lock().unwrap() = Some(tx);
    }
    pub fn disconnect(&self) {
        self.conns.lock().unwrap().clear();
        *self.reads.lock().unwrap() = None;
    }
    /// Ask for `pages` (threads wait on them) and `soon` (prefetch), in
    /// runs; false if there is no connection.
    pub fn request(&self, pages: &mut [u64], soon: &mut [u64]) -> bool {
        if let Some(tx) = self.reads.lock().unwrap().as_ref() {
            return tx.send((pages.to_vec(), soon.to_vec())).is_ok();
        }
        let mut buf = Vec::with_capacity((pages.len() + soon.len()) * 13);
        for (kind, pfns) in [(wire::DATA_REQUEST, pages), (wire::DATA_PREFETCH, soon)] {
            pfns.sort_unstable();
            let mut i = 0;
            while i < pfns.len() {
                let mut n = 1;
                while i + n < pfns.len() && pfns[i + n] == pfns[i] + n as u64 && n < wire::MAX_REQUEST_PAGES as usize {
                    n += 1;
                }
                wire::write_request(&mut buf, kind, pfns[i], n as u32).expect("vec write");
                i += n;
            }
        }
        let mut g = self.conns.lock().unwrap();
        for slot in g.iter_mut() {
            let Some(s) = slot.as_mut() else { continue };
            match s.write_all(&buf) {
                Ok(()) => return true,
                Err(e) => {
                    // Its reader ends too: the link's requests are asked
                    // again on the next (see `lose`).
                    tracing::debug!("page request not sent: {e}");
                    let _ = s.shutdown(std::net::Shutdown::Both);
                    *slot = None;
                }
            }
        }
        false
    }
}

/// Runs until `stop` is set (and the wake eventfd written).
pub struct FaultThread {
    stop: Arc<AtomicBool>,
    wake: Arc<EventFd>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FaultThread {
    pub fn start(placer: Arc<Placer>, sink: Arc<RequestSink>, ctl: Arc<crate::stats::Control>) -> std::io::Result<FaultThread> {
        let wake = Arc::new(EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)?);
        let stop = Arc::new(AtomicBool::new(false));
        let (w2, s2) = (wake.clone(), stop.clone());
        let thread = std::thread::Builder::new().name("postcopy-faults".into()).spawn(move || {
            let _cpu = crate::stats::CpuTally::new(&ctl, true);
            fault_loop(placer, sink, w2, s2)
        })?;
        Ok(FaultThread { stop, wake, thread: Some(thread) })
    }
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Only fails when the counter would overflow: it is awake then.
        let _ = self.wake.write(1);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for FaultThread {
    fn drop(&mut self) {
        self.stop();
    }
}

fn fault_loop(placer: Arc<Placer>, sink: Arc<RequestSink>, wake: Arc<EventFd>, stop: Arc<AtomicBool>) {
    crate::priority::fault_path_priority();
    let mut asks = Asks::default();
    // Faults on prefetched pages, oldest first: (ask after, page).
    let mut deferred: VecDeque<(Instant, u64)> = VecDeque::new();
    while !stop.load(Ordering::SeqCst) {
        // Domains can join while we run (helpers register before resume).
        let doms = placer.fault_fds();
        let mut pfds: Vec<libc::pollfd> = std::iter::once(wake.as_fd().as_raw_fd())
            .chain(doms.iter().map(|d| d.1))
            .map(|fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 })
            .collect();
        // A short timeout picks up new domains; a deferred page sooner.
        let timeout = deferred.front().map_or(Duration::from_millis(100), |(at, _)| at.saturating_duration_since(Instant::now()));
        let ts = libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as libc::c_long };
        // SAFETY: valid pollfd array and timespec.
        let n = unsafe { libc::ppoll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, &ts, std::ptr::null()) };
        if n > 0 {
            for (k, (d, _)) in doms.iter().enumerate() {
                if pfds[k + 1].revents == 0 {
                    continue;
                }
                let Some(dom) = placer.domain(*d) else { continue };
                if pfds[k + 1].revents & (libc::POLLERR | libc::POLLHUP) != 0 && pfds[k + 1].revents & libc::POLLIN == 0 {
                    tracing::info!("{}: its process is gone, no more faults from it", dom.name);
                    dom.gone.store(true, Ordering::Relaxed);
                    continue;
                }
                loop {
                    match dom.uffd.read_event() {
                        Ok(Some(Event::Pagefault { addr, .. })) => placer.fault(*d, addr as u64, &mut asks),
                        Ok(Some(_)) => {}
                        Ok(None) => break,
                        Err(e) => {
                            tracing::warn!("{}: reading faults: {e}", dom.name);
                            break;
                        }
                    }
                }
            }
        }
        let now = Instant::now();
        deferred.extend(asks.later.drain(..).map(|p| (now + PUSH_GRACE, p)));
        while deferred.front().is_some_and(|(at, _)| *at <= now) {
            let (_, p) = deferred.pop_front().expect("checked");
            placer.ask_now(p, &mut asks);
        }
        if !asks.now.is_empty() || !asks.soon.is_empty() {
            // Without a connection the waiters are asked for again on
            // reconnection; nothing is lost.
            sink.request(&mut asks.now, &mut asks.soon);
            asks.now.clear();
            asks.soon.clear();
        }
    }
}
