//! The destination side of postcopy: drop stale pages, register guest RAM
//! (and every RAM client's mapping) for missing-page faults, load the
//! state, run, and place pages as they come: pushed on the data channels,
//! requested on the urgent one. Ends when every page is here. A broken
//! connection pauses the migration: faulting threads wait, the rest of the
//! VM runs on, and the source comes back with `migrate resume` (on this
//! listener or on the one `migrate-recover` gives).

use super::faults::{FaultThread, RequestSink};
use super::fetch::Fetcher;
use crate::acceptor::Acceptor;
use crate::control_conn::ControlConn;
use crate::cputime::{thread_cpu_s, unix_ns};
use crate::pages::{normalize, PageRange};
use crate::place::{Placer, Via};
use crate::push::PushQueue;
use crate::receiver::{accept_channels, drop_channel, place_batch, receive_channel, IncomingParams, RxShared};
use crate::stats::CpuTally;
use crate::stats::{Control, RecoverRequest, Status};
use crate::vm::MigratableVm;
use crate::wire::{self, DataItem, DataReader, Msg};
use anyhow::{anyhow, bail, Context, Result};
use snapshot::StateSet;
use std::net::TcpStream;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub(crate) struct Switch {
    pub state_bytes: u64,
    pub source_paused: u64,
    pub dirty_ranges: bool,
    /// The devices' pages the source sends on the first urgent connection.
    pub device_pages: Vec<PageRange>,
}

type ChannelThread = JoinHandle<Result<(u64, f64)>>;

/// Where the pages a destination lacks come from after the switch.
pub(crate) enum PageSource {
    /// The source sends them: pushed on the data channels, asked for on
    /// this urgent connection.
    Urgent(Vec<TcpStream>),
    /// This side READs them from the source's guest RAM (the rdma
    /// transport, [`super::fetch`]); the source's plan of what to read
    /// comes on the control connection (`PullPlan`).
    Reads(crate::rdma::PageReader),
}

/// One connected set: data channel threads and the urgent receiver, or
/// the fetcher that READs the pages.
struct Link {
    control: ControlConn,
    channels: Vec<ChannelThread>,
    /// A clone of each data connection of a recovery, by channel index (the
    /// first connections are in [`RxShared::data_socks`]): a channel the
    /// source lost is shut.
    socks: Vec<TcpStream>,
    /// The urgent connections, one per link, and their receivers (None
    /// once its link was lost).
    urgent: Vec<TcpStream>,
    urgent_rx: Vec<Option<JoinHandle<Result<()>>>>,
    fetch: Option<(Fetcher, Arc<PushQueue>)>,
}

impl Link {
    /// `first`: pages the source sends unasked on the first urgent
    /// connection (the devices' pages of the switch).
    fn start(
        control: ControlConn,
        channels: Vec<ChannelThread>,
        pages: PageSource,
        sh: &Arc<RxShared>,
        sink: &RequestSink,
        first: u64,
    ) -> Result<Link> {
        let placer = sh.placer.get().expect("placer set before the link starts").clone();
        let total = sh.total;
        let ctl = sh.ctl.clone();
        match pages {
            PageSource::Urgent(urgent) => {
                let mut urgent_rx = Vec::new();
                let mut first = Some(first);
                for s in &urgent {
                    let (rx, placer, ctl, first) = (s.try_clone()?, placer.clone(), ctl.clone(), first.take().unwrap_or(0));
                    let t = std::thread::Builder::new()
                        .name("postcopy-urgent".into())
                        .spawn(move || receive_urgent(rx, &placer, total, &ctl, first))?;
                    urgent_rx.push(Some(t));
                }
                sink.connect(urgent.iter().map(TcpStream::try_clone).collect::<std::io::Result<_>>()?);
                Ok(Link { control, channels, socks: Vec::new(), urgent, urgent_rx, fetch: None })
            }
            PageSource::Reads(reader) => {
                // Empty until the source's plan comes; faults are read at once.
                let queue = Arc::new(PushQueue::new(total, &[], Vec::new()));
                let (tx, rx) = super::fetch::ask_channel();
                let f = Fetcher::start(reader, placer, queue.clone(), rx, ctl)?;
                sink.connect_reads(tx);
                Ok(Link { control, channels, socks: Vec::new(), urgent: Vec::new(), urgent_rx: Vec::new(), fetch: Some((f, queue)) })
            }
        }
    }

    /// Something broke: the error, if any thread or the control
    /// connection says so. Channels that ended cleanly are reaped.
    fn check(&mut self, sh: &RxShared, sink: &RequestSink) -> Option<String> {
        let total = sh.total;
        let mut i = 0;
        while i < self.channels.len() {
            if self.channels[i].is_finished() {
                let t = self.channels.remove(i);
                match t.join() {
                    Ok(Ok(_)) => continue,
                    Ok(Err(e)) => return Some(format!("data channel: {e:#}")),
                    Err(_) => return Some("data channel thread panicked".into()),
                }
            }
            i += 1;
        }
        if let Some((f, _)) = self.fetch.as_mut().filter(|(f, _)| f.is_finished()) {
            return Some(match f.stop() {
                Err(e) => format!("RDMA READs: {e:#}"),
                Ok(()) => "the RDMA fetcher ended".into(),
            });
        }
        for k in 0..self.urgent_rx.len() {
            if !self.urgent_rx[k].as_ref().is_some_and(|t| t.is_finished()) {
                continue;
            }
            let why = match self.urgent_rx[k].take().unwrap().join() {
                Ok(Err(e)) => format!("urgent connection: {e:#}"),
                _ => "urgent connection ended".into(),
            };
            if !sink.lose(k) {
                return Some(why);
            }
            // Several links: the requests go on the next urgent
            // connection, and every page asked or prefetched and not here
            // is asked again, waited on or not (a page that comes twice is
            // placed once).
            tracing::warn!("postcopy: {why}; page requests go on the next link");
            let placer = sh.placer.get().expect("placer set before the link starts");
            let mut again = placer.take_unanswered();
            again.extend(placer.waiting().into_iter().filter(|&p| !placer.seen.get(p)));
            again.sort_unstable();
            again.dedup();
            if !again.is_empty() {
                sink.request(&mut again, &mut []);
            }
        }
        if self.control.wait_readable(Duration::ZERO) {
            return Some(match wire::recv_msg(&mut self.control) {
                Ok(Msg::PullPlan { max_bandwidth }) if self.fetch.is_some() => match self.take_plan(total, max_bandwidth) {
                    Ok(()) => return None,
                    Err(e) => format!("the source's plan of pages to read: {e:#}"),
                },
                Ok(Msg::ReadCap { max_bandwidth }) if self.fetch.is_some() => {
                    if let Some((f, _)) = &self.fetch {
                        f.set_cap(max_bandwidth);
                    }
                    return None;
                }
                Ok(Msg::ChannelLost { index }) if self.fetch.is_none() => match self.channel_lost(sh, index as usize) {
                    Ok(()) => return None,
                    Err(e) => format!("data channel {index} lost: {e:#}"),
                },
                Ok(Msg::Abort { reason }) => format!("source aborted: {reason}"),
                Ok(other) => format!("source sent {other:?} during postcopy"),
                Err(e) => format!("control connection: {e}"),
            });
        }
        None
    }

    /// Several links: the source lost push channel `index` with its link.
    /// Its reader stops (it places nothing more once its claims are given
    /// back or mapped) and the source hears which pages are here: it
    /// pushes the others again. A page on its way twice is placed once
    /// (the first claim wins, [`crate::place`]).
    fn channel_lost(&mut self, sh: &RxShared, index: usize) -> Result<()> {
        drop_channel(sh, index)?;
        if let Some(s) = self.socks.get(index) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        // After a recovery `sh.acks` is the old connection; and no round
        // is acknowledged after the switch, so nothing else writes here.
        wire::send_msg(&mut self.control, &Msg::PagesHeld)?;
        wire::send_blob(&mut self.control, &sh.seen.to_le_bytes())?;
        Ok(())
    }

    /// The source's `PullPlan`: pages with data to read, pages known zero.
    fn take_plan(&mut self, total: u64, max_bandwidth: u64) -> Result<()> {
        self.control.set_read_timeout(Some(Duration::from_secs(30)))?;
        let data = ranges_blob(&wire::recv_blob(&mut self.control)?, total)?;
        let zero = ranges_blob(&wire::recv_blob(&mut self.control)?, total)?;
        self.control.set_read_timeout(None)?;
        if let Some((f, q)) = &self.fetch {
            f.set_cap(max_bandwidth);
            q.reset(total, &data, zero);
        }
        Ok(())
    }

    fn close(mut self, ctl: &Control, sink: &RequestSink) {
        sink.disconnect();
        ctl.shutdown_all();
        if let Some((mut f, _)) = self.fetch.take() {
            let _ = f.stop();
        }
        for u in &self.urgent {
            let _ = u.shutdown(std::net::Shutdown::Both);
        }
        for t in self.channels.drain(..) {
            let _ = t.join();
        }
        for t in self.urgent_rx.drain(..).flatten() {
            let _ = t.join();
        }
    }
}

/// A blob of (first, count) u64 pairs inside guest RAM, as sorted,
/// disjoint ranges.
fn ranges_blob(b: &[u8], total: u64) -> Result<Vec<PageRange>> {
    if !b.len().is_multiple_of(16) {
        bail!("page ranges of {} bytes", b.len());
    }
    let mut out = Vec::with_capacity(b.len() / 16);
    for c in b.chunks(16) {
        let first = u64::from_le_bytes(c[..8].try_into().unwrap());
        let count = u64::from_le_bytes(c[8..].try_into().unwrap());
        if count == 0 || first.checked_add(count).is_none_or(|e| e > total) {
            bail!("pages {first} (+{count}) outside guest RAM");
        }
        out.push(PageRange { first, count });
    }
    Ok(normalize(out, total))
}

/// Place what comes on an urgent connection: first the `first` pages the
/// source sends unasked in the switch (the devices' pages), in the
/// switch's real-time class, which this thread inherits (in the fault
/// path's class, capped at 30% of a CPU, 8 MiB of them took 20 ms), then
/// the answers to page requests.
fn receive_urgent(mut s: TcpStream, placer: &Placer, total: u64, ctl: &Control, mut first: u64) -> Result<()> {
    let _cpu = CpuTally::new(ctl, true);
    if first == 0 {
        crate::priority::fault_path_priority();
    } else {
        // The switch's class, set again so that the placer's real-time
        // sections leave it alone: each would take two scheduler calls per
        // run of pages (the devices' pages come in runs of 2-3), and drop
        // this thread to the normal class after the first.
        crate::priority::set_priority(true);
    }
    let mut rd = DataReader::default();
    let mut zstd = None;
    loop {
        match rd.next(&mut s)? {
            DataItem::Pages { .. } => {
                let n = place_batch(placer, ctl, &rd, total, Via::Request, &mut zstd)?;
                if first > 0 {
                    first = first.saturating_sub(n);
                    if first == 0 {
                        crate::priority::fault_path_priority();
                    }
                }
            }
            _ => bail!("unexpected frame on the urgent connection"),
        }
    }
}

/// Stale pages (sent before, changed since): the source sends them again.
/// They were written through the alias, never mapped into the vmm, so
/// forgetting them is enough: the memfd keeps their old bytes, unmapped,
/// until the new ones replace them (RAM clients drop their mappings when
/// they register).
fn drop_pages(sh: &RxShared, blob: &[u8]) -> Result<()> {
    if !blob.len().is_multiple_of(16) {
        bail!("stale page list of {} bytes", blob.len());
    }
    for c in blob.chunks(16) {
        let first = u64::from_le_bytes(c[..8].try_into().unwrap());
        let count = u64::from_le_bytes(c[8..].try_into().unwrap());
        if count == 0 || first.checked_add(count).is_none_or(|e| e > sh.total) {
            bail!("stale pages {first} (+{count}) outside guest RAM");
        }
        for p in first..first + count {
            sh.seen.clear(p);
        }
        sh.suspect.clear_range(first, count);
    }
    // Every torn page of the precopy rounds is stale: one that is not was
    // damaged on the way.
    sh.suspect.verify()
}

/// The fault machinery of a destination: the placer (guest RAM registered
/// with a userfaultfd) and the fault thread. A pure postcopy sets it up
/// before it tells the source it is ready, so that none of it is downtime;
/// a hybrid at the switch (what it has must be known first).
pub(crate) struct Armed {
    placer: Arc<Placer>,
    sink: Arc<RequestSink>,
    faults: FaultThread,
}

pub(crate) fn arm(sh: &RxShared) -> Result<Armed> {
    let alias = match &sh.alias {
        Some(a) => a.clone(),
        None => Arc::new(crate::place::Alias::map(&sh.ram).context("mapping guest RAM for placing pages")?),
    };
    let placer = Arc::new(Placer::new(sh.ram, sh.seen.clone(), alias, sh.maybe_nonzero.clone())?);
    let _ = sh.placer.set(placer.clone());
    let sink = Arc::new(RequestSink::default());
    let faults = FaultThread::start(placer.clone(), sink.clone(), sh.ctl.clone())?;
    Ok(Armed { placer, sink, faults })
}

/// The postcopy destination from the switch on, in phases: loading the
/// state (the downtime), then waiting until every page is here through any
/// number of recoveries, then the end.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run(
    vm: &Arc<dyn MigratableVm>,
    acceptor: &Acceptor,
    params: &IncomingParams,
    ctl: &Arc<Control>,
    control: ControlConn,
    sh: Arc<RxShared>,
    channels: Vec<ChannelThread>,
    pages: PageSource,
    session: u64,
    sw: Switch,
    clients: Option<Arc<super::clients::RamClients>>,
    armed: Option<Armed>,
) -> Result<bool> {
    let running = load_at_switch(vm, params, ctl, control, &sh, channels, pages, &sw, clients.as_deref(), armed)?;
    let Running { resumed, resumed_at: t, placer, sink, mut faults, link, n_clients } = running;
    // Pages that came before the switch (a hybrid's precopy rounds) are not
    // mapped into the vmm yet: map them in the background.
    let premap = match sh.precopy_rounds {
        true => Some(std::thread::Builder::new().name("postcopy-premap".into()).spawn({
            let (p, ctl) = (placer.clone(), ctl.clone());
            move || {
                let _cpu = CpuTally::new(&ctl, true);
                p.premap()
            }
        })?),
        false => None,
    };
    let t_post = Instant::now();
    let live = ctl.live_figures({
        let placer = placer.clone();
        move |s| {
            s.remaining_pages = placer.missing();
            s.faults = placer.faults.load(std::sync::atomic::Ordering::Relaxed);
            s.fault_waits = placer.fault_waits();
        }
    });
    ctl.update(|s| {
        if resumed {
            s.downtime_ms = Some(t.saturating_sub(sw.source_paused) as f64 / 1e6);
        }
        s.status = Status::PostcopyActive;
        s.ram_clients = n_clients;
    });

    let mut link = wait_for_every_page(acceptor, &params.rnicd, ctl, session, &sh, &placer, &sink, link);
    // Every page is in.
    faults.stop();
    if let Some(t) = premap {
        let _ = t.join();
    }
    placer.unregister_vmm();
    if let Some(c) = &clients {
        c.end();
    }
    let (p50, p99, max) = placer.latency_percentiles();
    // This thread's own CPU is counted by `dest::run`, which it runs in
    // (the source hears the total so far, receivers that still drain
    // their streams included).
    let cpu = ctl.cpu_s_now(true) + thread_cpu_s();
    let faults_n = placer.faults.load(std::sync::atomic::Ordering::Relaxed);
    ctl.update(|s| {
        s.faults = faults_n;
        s.fault_p50_us = p50;
        s.fault_p99_us = p99;
        s.fault_max_us = max;
        s.pages_pushed = placer.pushed.load(std::sync::atomic::Ordering::Relaxed);
        s.pages_requested = placer.requested.load(std::sync::atomic::Ordering::Relaxed);
        s.postcopy_ms = t_post.elapsed().as_secs_f64() * 1e3;
        s.remaining_pages = 0;
        s.fault_waits = placer.fault_waits();
    });
    // The figures stay as written last; the placer may go.
    drop(live);
    if let Some(mut l) = link.take() {
        let pages_read = l.fetch.is_some().then(|| {
            let n = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
            (n(&placer.pushed), n(&placer.requested))
        });
        let complete = Msg::Complete {
            faults: faults_n,
            fault_p50_us: p50,
            fault_p99_us: p99,
            fault_max_us: max,
            cpu_s: cpu,
            ram_clients: n_clients,
            pages_read,
            fault_waits: placer.fault_waits(),
        };
        if let Err(e) = wire::send_msg(&mut l.control, &complete) {
            tracing::warn!("could not tell the source that postcopy completed: {e}");
        }
        // The last message: until the source read it (and closed its
        // end), a link that dies under it is failed over.
        l.control.finish();
        // The source stops pushing on Complete and ends its streams; a link
        // that dies now loses nothing, so wait only a little.
        let t = Instant::now();
        while l.channels.iter().any(|c| !c.is_finished()) && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(5));
        }
        l.close(ctl, &sink);
    }
    Ok(resumed)
}

/// The destination once the VM runs here.
struct Running {
    resumed: bool,
    /// When it was resumed (Unix ns): the end of the downtime.
    resumed_at: u64,
    placer: Arc<Placer>,
    sink: Arc<RequestSink>,
    faults: FaultThread,
    link: Option<Link>,
    /// Processes other than the vmm that map guest RAM and fault on it.
    n_clients: u32,
}

/// The switch, all of it downtime: the state and the stale pages, the
/// fault machinery armed, the state loaded, and the VM started on the
/// source's go.
#[allow(clippy::too_many_arguments)]
fn load_at_switch(
    vm: &Arc<dyn MigratableVm>,
    params: &IncomingParams,
    ctl: &Arc<Control>,
    mut control: ControlConn,
    sh: &Arc<RxShared>,
    mut channels: Vec<ChannelThread>,
    pages: PageSource,
    sw: &Switch,
    clients: Option<&super::clients::RamClients>,
    armed: Option<Armed>,
) -> Result<Running> {
    let cpu0 = thread_cpu_s();
    let t_sw = Instant::now();
    // Until the VM runs, this is downtime and blocks only on I/O.
    crate::priority::set_priority(true);
    let step = |name: &str| {
        let ms = t_sw.elapsed().as_secs_f64() * 1e3;
        ctl.update(|s| s.downtime_steps.push((name.to_string(), ms)));
    };
    ctl.update(|s| s.status = Status::Device);
    control.set_read_timeout(Some(Duration::from_secs(60)))?;
    let blob = wire::recv_blob(&mut control).map_err(|e| anyhow!("state: {e}"))?;
    if blob.len() as u64 != sw.state_bytes {
        bail!("state is {} bytes, source announced {}", blob.len(), sw.state_bytes);
    }
    let state = StateSet::read_from(&mut blob.as_slice()).context("decoding vCPU and device state")?;
    if matches!(pages, PageSource::Reads(_)) {
        // The source ended its data channels before it paused: every WRITE
        // of the precopy rounds has landed and is checked once their
        // threads are through, and none can land on a page placed from
        // here on.
        for t in channels.drain(..) {
            t.join().map_err(|_| anyhow!("a data channel panicked"))?.context("data channel")?;
        }
    }
    if sw.dirty_ranges {
        let stale = wire::recv_blob(&mut control).map_err(|e| anyhow!("stale page list: {e}"))?;
        drop_pages(sh, &stale)?;
    }
    // What is here at the switch (the devices' pages the destination asks
    // for are those it lacks now, as the source sees them).
    let here = sh.seen.snapshot();
    step("state received");
    let Armed { placer, sink, faults } = match armed {
        Some(a) => a,
        None => arm(sh)?,
    };
    // On their way: a fault on one waits for it.
    placer.expect(&sw.device_pages);
    let mut n_clients = 0;
    if let Some(c) = clients {
        for d in c.advise().context("RAM clients")? {
            placer.add_domain(d)?;
            n_clients += 1;
        }
    }
    let first = crate::pages::count_pages(&sw.device_pages);
    let mut link = Link::start(control.try_clone()?, channels, pages, sh, &sink, first)?;
    step("faults armed");
    vm.restore_state(&state).context("loading vCPU and device state")?;
    step("state restored");
    let device = vm.device_pages();
    device_pages_here(ctl, sh, &placer, &sink, &mut link, &device, &sw.device_pages, &here)?;
    if n_clients > 0 {
        // What the devices reach goes into the RAM clients' mappings: all
        // of it but what is left to the push, which goes in as it comes.
        placer.map_for_clients(&device);
    } else {
        placer.mark_device(&device);
    }
    step("device pages here");
    let link = Some(link);
    wire::send_msg(&mut control, &Msg::Loaded { cpu_s: thread_cpu_s() - cpu0 })?;
    match wire::recv_msg(&mut control).map_err(|e| anyhow!("waiting for the source's go: {e}"))? {
        Msg::Go => {}
        other => bail!("expected go, got {other:?}"),
    }
    let resumed = params.resume;
    if resumed {
        vm.resume().context("starting the VM")?;
    }
    step("resumed");
    let t = unix_ns();
    let _ = wire::send_msg(&mut control, &Msg::Resumed { unix_ns: t, resumed, cpu_s: thread_cpu_s() - cpu0 });
    crate::priority::set_priority(false);
    Ok(Running { resumed, resumed_at: t, placer, sink, faults, link, n_clients })
}

/// How long the switch waits for the devices' pages (a link that breaks
/// meanwhile fails it sooner).
const DEVICE_PAGES_TIMEOUT: Duration = Duration::from_secs(30);

/// The switch's share of the devices' pages (`super::device`): `device`
/// as the restored VM names them, `sent` what the source said it sends,
/// `here` what was here when the state came. Asks for the pages of the
/// share the source does not send, and waits until every one is here. A
/// broken or damaged page stream fails the switch (before the commit).
#[allow(clippy::too_many_arguments)]
fn device_pages_here(
    ctl: &Control,
    sh: &RxShared,
    placer: &Placer,
    sink: &RequestSink,
    link: &mut Link,
    device: &[PageRange],
    sent: &[PageRange],
    here: &crate::pages::AtomicBitmap,
) -> Result<()> {
    let t = Instant::now();
    let lacks = |p: u64| !here.get(p);
    let lacking = super::device::lacking_in_order(device, lacks, sh.total);
    let share = super::device::first_pages(&lacking, super::device::SWITCH_PAGES_MAX);
    let sent_set = normalize(sent.to_vec(), sh.total);
    let mut asks = crate::place::Asks::default();
    for p in share.iter().flat_map(|r| r.first..r.end()) {
        if !super::device::in_ranges(Some(&sent_set), p) {
            placer.ask_now(p, &mut asks);
        }
    }
    let asked = asks.now.len() as u64;
    if !asks.now.is_empty() && !sink.request(&mut asks.now, &mut []) {
        bail!("the devices' pages: no connection to ask the source for them");
    }
    let mut all = share.clone();
    all.extend_from_slice(sent);
    let all = normalize(all, sh.total);
    let at_switch = crate::pages::count_pages(&all);
    let waited = placer.wait_present(&all, Instant::now() + DEVICE_PAGES_TIMEOUT, || link.check(sh, sink));
    match waited {
        Ok(true) => {}
        Ok(false) => bail!("the devices' {at_switch} pages of the switch did not arrive within {DEVICE_PAGES_TIMEOUT:?}"),
        Err(why) => bail!("the devices' pages of the switch: {why}"),
    }
    let named = super::device::count_named(device, sh.total);
    ctl.update(|s| {
        s.device_pages = crate::stats::DevicePages {
            named,
            at_switch,
            asked,
            wait_ms: t.elapsed().as_secs_f64() * 1e3,
            after_resume: crate::pages::count_pages(&lacking) - crate::pages::count_pages(&share),
        }
    });
    Ok(())
}

/// Serve faults until every page is here; on a break, pause and wait for
/// the source to recover (a new listener from `migrate-recover`, or the
/// old one). Returns the link that delivered the last page, if any.
#[allow(clippy::too_many_arguments)]
fn wait_for_every_page(
    acceptor: &Acceptor,
    rnicd: &str,
    ctl: &Arc<Control>,
    session: u64,
    sh: &Arc<RxShared>,
    placer: &Arc<Placer>,
    sink: &Arc<RequestSink>,
    mut link: Option<Link>,
) -> Option<Link> {
    // The one `migrate-recover` gave last, with its own connections.
    let mut acceptor_now: Option<Acceptor> = None;
    loop {
        if placer.wait_complete(Duration::from_millis(20)) {
            break;
        }
        let broken = match link.as_mut() {
            Some(l) => l.check(sh, sink),
            None => Some("not connected".into()),
        };
        let Some(why) = broken else { continue };
        if placer.is_complete() {
            break;
        }
        if let Some(l) = link.take() {
            l.close(ctl, sink);
        }
        let missing = placer.missing();
        tracing::warn!("postcopy paused: {why}; {missing} pages missing");
        let t_paused = Instant::now();
        ctl.update(|s| {
            s.status = Status::PostcopyPaused;
            s.error = Some(format!(
                "postcopy paused: {why}; {missing} pages are still on the source; threads that touch them wait. If the source lives, `migrate resume` there (after `migrate-recover` here for a new address); if it died, they are lost"
            ));
        });
        ctl.forget_connections();
        let recovered = loop {
            if let Some(RecoverRequest::Listen(nl)) = ctl.try_recovery() {
                acceptor_now = Some(Acceptor::new(nl));
            }
            if placer.is_complete() {
                break None;
            }
            let a = acceptor_now.as_ref().unwrap_or(acceptor);
            match accept_recovery(a, rnicd, ctl, session, sh, placer, sink) {
                Ok(Some(l)) => break Some(l),
                Ok(None) => {}
                Err(e) => tracing::warn!("recovery attempt refused: {e:#}"),
            }
        };
        let Some(l) = recovered else { break };
        link = Some(l);
        ctl.update(|s| {
            s.status = Status::PostcopyActive;
            s.error = None;
            s.recoveries += 1;
            s.paused_ms += t_paused.elapsed().as_secs_f64() * 1e3;
        });
    }

    link
}

/// One recovery attempt: a source that comes back with our session gets
/// our received-pages bitmap and reconnects its channels.
fn accept_recovery(
    acceptor: &Acceptor,
    rnicd: &str,
    ctl: &Arc<Control>,
    session: u64,
    sh: &Arc<RxShared>,
    placer: &Placer,
    sink: &RequestSink,
) -> Result<Option<Link>> {
    let mut control = match acceptor.accept(ctl, Some(Duration::from_millis(200))) {
        Ok(c) => c,
        Err(_) => return Ok(None),
    };
    control.set_read_timeout(Some(Duration::from_secs(30)))?;
    if wire::read_preamble(&mut control)? != wire::ROLE_CONTROL {
        bail!("first connection is not a control connection");
    }
    let (channels, rdma, spares) = match wire::recv_msg(&mut control)? {
        Msg::Hello { session: s, mode, channels, transport, spare_controls, .. }
            if mode == "recover" && s == session && (1..=64).contains(&channels) && spare_controls <= 7 =>
        {
            (channels as usize, transport == "rdma", spare_controls as usize)
        }
        Msg::Hello { mode, session: s, .. } => {
            let why = if mode != "recover" {
                format!("this destination is in a paused postcopy migration and takes only its recovery (got mode {mode:?})")
            } else {
                format!("session {s:#x} is not this migration's ({session:#x})")
            };
            let _ = wire::send_msg(&mut control, &Msg::Abort { reason: why.clone() });
            bail!(why);
        }
        other => bail!("expected hello, got {other:?}"),
    };
    // What an earlier attempt left waiting would only collide with this
    // one's connections.
    acceptor.forget_early();
    wire::send_msg(&mut control, &Msg::Welcome)?;
    wire::send_blob(&mut control, &sh.seen.to_le_bytes())?;
    control.set_read_timeout(None)?;
    // The control connection's spares, one on each other link of the
    // recovery, as at the start.
    let control = ControlConn::new(ControlConn::accept_spares(control, acceptor, session, spares, ctl)?, ctl)?;
    if rdma {
        // New queue pairs to read through; the source's plan of what is
        // left follows on the control connection.
        let reader = crate::rdma::accept_reader(&control, rnicd, &sh.ram)?;
        let link = Link::start(control, Vec::new(), PageSource::Reads(reader), sh, sink, 0)?;
        placer.forget_asked();
        let mut waiting = placer.waiting();
        if !waiting.is_empty() {
            sink.request(&mut waiting, &mut []);
        }
        return Ok(Some(link));
    }
    // An urgent connection per link of the recovery.
    let (streams, urgent) = accept_channels(acceptor, ctl, session, channels, spares + 1)?;
    let socks = streams.iter().map(TcpStream::try_clone).collect::<std::io::Result<Vec<_>>>()?;
    let threads = streams
        .into_iter()
        .enumerate()
        .map(|(i, s)| {
            let sh = sh.clone();
            std::thread::Builder::new().name(format!("migrate-rx{i}")).spawn(move || receive_channel(i, s, sh))
        })
        .collect::<std::io::Result<Vec<_>>>()?;
    let mut link = Link::start(control, threads, PageSource::Urgent(urgent), sh, sink, 0)?;
    link.socks = socks;
    // Ask again for what threads wait on: those requests died with the link.
    placer.forget_asked();
    let mut waiting = placer.waiting();
    if !waiting.is_empty() {
        sink.request(&mut waiting, &mut []);
    }
    Ok(Some(link))
}
