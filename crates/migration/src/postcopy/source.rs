//! The source side of postcopy: pause, hand over vCPU and device state and
//! the list of stale pages, then push every missing page in the background
//! while answering the destination's page requests on the urgent
//! connection, until the destination has all of RAM. A broken connection
//! after the switch pauses the migration (the source keeps every page) until
//! `migrate` with `resume` gives a new address; with several links, a push
//! channel lost with its link is dropped instead, and the others push what
//! it did not deliver.

use crate::compress::Compress;
use crate::control_conn::ControlConn;
use crate::dirty::{DirtyLog, PAGE_SIZE};
use crate::links::Links;
use crate::pages::{complement, normalize, AtomicBitmap, PageRange};
use crate::push::PushQueue;
use crate::ratelimit::TokenBucket;
use crate::rdma::ReadableRam;
use crate::sender::{nonzero_xxh3, open_channels, open_urgent, recv_reply, recv_welcome, ChannelSet, Downtime, Outgoing};
use crate::stats::CpuTally;
use crate::stats::{Control, RecoverRequest, Stats, Status};
use crate::transport::Transport;
use crate::vm::RamRegion;
use crate::wire::{self, BatchWriter, Msg};
use anyhow::{anyhow, bail, Context, Result};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What the precopy part hands over at the switch.
pub(crate) struct Start {
    pub session: u64,
    pub compress: Compress,
    pub bucket: Arc<TokenBucket>,
    pub control: ControlConn,
    /// The tcp transport: the connections page requests come on, one per
    /// link.
    pub urgent: Option<Vec<TcpStream>>,
    /// The rdma transport: our guest RAM, registered for the destination
    /// to READ (it fetches every page itself, see [`run_reads`]).
    pub reads: Option<ReadableRam>,
    pub transport: Transport,
    pub channels: ChannelSet,
    /// Hybrid: the dirty log and, before all of RAM was sent, the part of
    /// it that is armed (what was sent lies within; the rest is pending).
    /// Pure postcopy: none, nothing was sent.
    pub log: Option<(DirtyLog, Option<Vec<PageRange>>)>,
    /// The memfd's holes, seen while the VM still ran.
    pub holes: Vec<PageRange>,
    pub pending: Vec<PageRange>,
    pub round: u64,
}

/// Split sorted, disjoint `pages` into (pages with data here, pages that
/// are in `holes`).
fn split_known_zero(holes: &[PageRange], pages: &[PageRange]) -> (Vec<PageRange>, Vec<PageRange>) {
    let (mut data, mut zero) = (Vec::new(), Vec::new());
    // Both lists are sorted and disjoint within themselves: intersect by walking.
    let mut h = 0;
    for r in pages {
        let mut f = r.first;
        while f < r.end() {
            while h < holes.len() && holes[h].end() <= f {
                h += 1;
            }
            match holes.get(h) {
                Some(hole) if hole.first <= f => {
                    let e = hole.end().min(r.end());
                    zero.push(PageRange { first: f, count: e - f });
                    f = e;
                }
                Some(hole) => {
                    let e = hole.first.min(r.end());
                    data.push(PageRange { first: f, count: e - f });
                    f = e;
                }
                None => {
                    data.push(PageRange { first: f, count: r.end() - f });
                    f = r.end();
                }
            }
        }
    }
    (data, zero)
}

/// The postcopy source after the switch decision, in phases: the switch
/// (the downtime), planning the push, then serving the destination until
/// it has every page, through any number of recoveries.
pub(crate) fn run(guard: &mut Outgoing, st: Start) -> Result<()> {
    let Start { session, compress, bucket, mut control, urgent, reads, transport, mut channels, log, holes, pending, round } = st;
    // The timeout bounds the precopy part only: from the switch on, the
    // destination runs and needs every page, however long the push takes.
    channels.clear_deadline();
    if let Some(reads) = reads {
        let Transport::Rdma { rnicd } = transport else { bail!("RDMA reads without the rdma transport") };
        let st = ReadsStart { session, control, channels, reads, log, holes, pending, round, rnicd };
        return run_reads(guard, st);
    }
    let urgent = urgent.ok_or_else(|| anyhow!("postcopy over tcp without an urgent connection"))?;
    let ctl = guard.ctl.clone();
    let ram = guard.vm.ram();
    let (missing, queue, server, sent) = switch_over(guard, &mut control, Some(urgent), log, pending)?;
    let server = server.expect("an urgent server for the urgent connection");
    plan_push(ram, missing, holes, &queue, &sent)?;
    let t_post = Instant::now();
    ctl.update(|s| {
        s.status = Status::PostcopyActive;
        s.rounds = round + 1;
        s.remaining_pages = queue.left();
    });
    let resume = Resume { session, compress, bucket };
    serve_with_recovery(control, channels, server, &queue, &ctl, &resume, ram)?;
    let postcopy_ms = t_post.elapsed().as_secs_f64() * 1e3;
    ctl.update(|s| {
        s.postcopy_ms = postcopy_ms;
        s.remaining_pages = 0;
    });
    Ok(())
}

/// What the switch leaves: the pages the destination lacks (`None`: all),
/// the push queue, the urgent server (tcp only), and the devices' pages
/// it sent in the switch.
type Switched = (Option<Vec<PageRange>>, Arc<PushQueue>, Option<UrgentServer>, Vec<PageRange>);

/// The switch, all of it downtime: pause, the stale pages, the state; the
/// destination loads it and owns the VM from then on (the commit), and is
/// told to run it. Returns the pages the destination still lacks (`None`:
/// all of them), the push queue, and the urgent server, already serving.
fn switch_over(
    guard: &mut Outgoing,
    control: &mut ControlConn,
    urgent: Option<Vec<TcpStream>>,
    log: Option<(DirtyLog, Option<Vec<PageRange>>)>,
    pending: Vec<PageRange>,
) -> Result<Switched> {
    let (vm, ctl) = (guard.vm.clone(), guard.ctl.clone());
    let ram = vm.ram();
    let total = ram.pages();
    // All of it is downtime; it blocks only on I/O. (This thread ends with
    // the migration, so an early return needs no reset.)
    crate::priority::set_priority(true);
    let pause = Downtime::pause(guard)?;
    let (paused_at, t_pause) = (pause.paused_at, pause.since);
    let step = |name: &str| pause.step(name);
    let (missing, log) = match log {
        Some((mut l, armed)) => {
            let mut p = pending;
            p.extend(l.scan(total, armed.as_deref())?);
            (Some(normalize(p, total)), Some(l))
        }
        None => (None, None),
    };
    step("scanned");
    let state = guard.save_state().context("saving vCPU and device state")?;
    let mut blob = Vec::with_capacity(state.encoded_len() + 16);
    state.write_to(&mut blob)?;
    step("state saved");
    // Requests are served from now on, even while the destination loads
    // the state (a device may touch RAM); the push queue fills below.
    let queue = Arc::new(PushQueue::new(total, &[], Vec::new()));
    // What devices reach without the vCPU (`device_pages`), taken now,
    // while the devices still hold what the VM had: the missing ones of
    // the switch's share cross now, on the first urgent connection ahead
    // of any answer there (over rdma the destination asks for them), and
    // the rest goes first in the push.
    let device = vm.device_pages();
    queue.push_first(&device);
    let sent = match &urgent {
        Some(_) => {
            let lacks = |p| super::device::in_ranges(missing.as_deref(), p);
            super::device::first_pages(&super::device::lacking_in_order(&device, lacks, total), super::device::SWITCH_PAGES_MAX)
        }
        None => Vec::new(),
    };
    let server = urgent.map(|u| UrgentServer::start(u, ram, queue.clone(), ctl.clone(), sent.clone())).transpose()?;
    let sent_n = crate::pages::count_pages(&sent);
    let named = super::device::count_named(&device, total);
    ctl.update(|s| s.device_pages = crate::stats::DevicePages { named, at_switch: sent_n, ..Default::default() });
    wire::send_msg(
        control,
        &Msg::Switchover {
            state_bytes: blob.len() as u64,
            source_paused_unix_ns: paused_at,
            dirty_ranges: missing.is_some(),
            device_pages: super::device::to_wire(&sent),
        },
    )?;
    wire::send_blob(control, &blob)?;
    if let Some(m) = &missing {
        let bytes: Vec<u8> = m.iter().flat_map(|r| [r.first.to_le_bytes(), r.count.to_le_bytes()]).flatten().collect();
        wire::send_blob(control, &bytes)?;
    }
    step("switchover sent");
    guard.let_go()?;
    step("identity let go");
    control.set_read_timeout(Some(Duration::from_secs(60)))?;
    match recv_reply(control)? {
        Msg::Loaded { .. } => {}
        other => bail!("destination answered {other:?} to the switchover"),
    }
    // Commit point: from here the destination owns the VM and this side
    // only serves its memory.
    guard.commit();
    step("destination loaded");
    let go = wire::send_msg(control, &Msg::Go);
    match go.map_err(anyhow::Error::from).and_then(|_| recv_reply(control)) {
        Ok(Msg::Resumed { unix_ns, resumed, .. }) => ctl.update(|s| {
            s.downtime_steps.push(("destination resumed (reply)".into(), t_pause.elapsed().as_secs_f64() * 1e3));
            s.paused_unix_ms = Some(paused_at as f64 / 1e6);
            s.downtime_ms =
                Some(if resumed { unix_ns.saturating_sub(paused_at) as f64 / 1e6 } else { t_pause.elapsed().as_secs_f64() * 1e3 });
        }),
        Ok(other) => tracing::warn!("destination sent {other:?} instead of resumed"),
        Err(e) => tracing::warn!("destination did not confirm its start: {e:#}"),
    }
    // The downtime is over: back to the normal class (the threads below
    // inherit it).
    crate::priority::set_priority(false);
    // Nothing writes this RAM any more, and the push only reads it.
    if let Some(log) = log {
        vm.retire(Box::new(log.into_tracker()));
    }
    Ok((missing, queue, server, sent))
}

/// Plan the push: everything the destination lacks, split into pages to
/// read and memfd holes (known zero); returns both.
fn plan_push(
    ram: RamRegion,
    missing: Option<Vec<PageRange>>,
    holes: Vec<PageRange>,
    queue: &Arc<PushQueue>,
    sent: &[PageRange],
) -> Result<(Vec<PageRange>, Vec<PageRange>)> {
    let total = ram.pages();
    // Everything the destination lacks, split into pages to read and memfd
    // holes (known zero): looking at the old holes again takes a few
    // kernel milliseconds at most, so it happens once the destination
    // runs, not during the downtime (on two busy CPUs it delayed the
    // destination's vCPU thread).
    // Pages requested meanwhile may go twice; the second copy is dropped.
    let (q2, sent) = (queue.clone(), sent.to_vec());
    let fill = std::thread::spawn(move || {
        let all = [PageRange { first: 0, count: total }];
        let pages = missing.as_deref().unwrap_or(&all);
        // Holes seen while the VM still ran, looked at again: a full walk
        // here held up the fault path for as long as it took (about 50 ms
        // for 4 GiB, in the kernel).
        let (data, zero) = match ram.holes_since(&holes).context("finding the memfd's holes") {
            Ok(h) => split_known_zero(&h, pages),
            Err(e) => {
                // Without the holes every page is read and checked for zero.
                tracing::warn!("{e:#}; pushing every missing page");
                (pages.to_vec(), Vec::new())
            }
        };
        q2.reset(total, &data, zero.clone());
        // The devices' pages of the switch went already.
        for r in &sent {
            q2.drop_queued(r.first, r.count);
        }
        (data, zero)
    });
    // The push can only start once it knows what to push.
    fill.join().map_err(|_| anyhow!("the push planner panicked"))
}

/// What a reconnection after a break needs.
struct Resume {
    session: u64,
    compress: Compress,
    bucket: Arc<TokenBucket>,
}

/// Serve until the destination has every page; on a break, wait for
/// `migrate resume` and reconnect.
fn serve_with_recovery(
    control: ControlConn,
    channels: ChannelSet,
    mut server: UrgentServer,
    queue: &Arc<PushQueue>,
    ctl: &Arc<Control>,
    resume: &Resume,
    ram: RamRegion,
) -> Result<()> {
    let Resume { session, compress, bucket } = resume;
    let (session, compress) = (*session, *compress);
    let mut conn = Some((control, channels));
    loop {
        let r = match conn.take() {
            Some((mut control, mut channels)) => {
                let r = serve(&mut control, &mut channels, queue, ctl, ram);
                if r.is_ok() {
                    // Complete: the stream ends before the channels' teardown.
                    control.close();
                }
                r
            }
            None => Err(anyhow!("not connected")),
        };
        match r {
            Ok(()) => break,
            Err(e) => {
                // The destination runs the VM: never resume here. Keep
                // every page and wait for a way to go on.
                ctl.shutdown_all();
                server.stop();
                let (target, t_paused) = pause_until_resume(ctl, &e);
                // A failure here leaves the source paused and holding its
                // pages, as a failed reconnection does: returning an error
                // would end the migration with the pages unreachable.
                let resumed = reconnect(&target, session, &ram, compress, bucket, ctl, queue)
                    .and_then(|(c, ch, u)| Ok((c, ch, UrgentServer::start(u, ram, queue.clone(), ctl.clone(), Vec::new())?)));
                match resumed {
                    Ok((c, ch, s)) => {
                        server = s;
                        conn = Some((c, ch));
                        mark_resumed(ctl, &target, t_paused);
                    }
                    Err(e) => {
                        ctl.update(|s| s.paused_ms += t_paused.elapsed().as_secs_f64() * 1e3);
                        conn = None;
                        tracing::warn!("recovery failed: {e:#}");
                        continue;
                    }
                }
            }
        }
    }
    server.stop();
    Ok(())
}

/// What the postcopy control reader hears from the destination.
enum FromDest {
    /// Every page is in (its statistics).
    Complete(Msg),
    /// A push channel was lost with its link and the pages the destination
    /// lacks are queued again: the push must run again if it ended.
    Requeued,
}

/// Push until the queue is empty (or the destination has everything, which
/// a guest that faults fast reaches before the push), take the
/// destination's `Complete`, and end the streams. With several links a
/// push channel lost with its link is dropped, as in precopy: the
/// destination stops reading it and answers with the pages it holds, and
/// what it lacks is pushed again on the channels left. The streams end only
/// at `Complete`, so a loss found after the push emptied its queue (a
/// channel whose link died with pages in its socket buffer) still has
/// channels to push on.
fn serve(control: &mut ControlConn, channels: &mut ChannelSet, queue: &Arc<PushQueue>, ctl: &Arc<Control>, ram: RamRegion) -> Result<()> {
    control.set_read_timeout(None)?;
    // Items of precopy rounds are not resent after the switch (what the
    // destination lacks is pushed): a channel lost now leaves none.
    channels.confirmed();
    let mut rd = control.try_clone()?;
    let q = queue.clone();
    let (tx, rx) = std::sync::mpsc::channel::<Result<FromDest>>();
    let reader = std::thread::Builder::new().name("postcopy-control".into()).spawn(move || {
        let r = (|| -> Result<()> {
            loop {
                match wire::recv_msg(&mut rd).map_err(|e| anyhow!("destination: {e}"))? {
                    m @ Msg::Complete { .. } => {
                        q.clear();
                        let _ = tx.send(Ok(FromDest::Complete(m)));
                        return Ok(());
                    }
                    Msg::PagesHeld => {
                        let have = wire::recv_blob(&mut rd).map_err(|e| anyhow!("destination's pages held: {e}"))?;
                        requeue_missing(&q, ram, &have)?;
                        if tx.send(Ok(FromDest::Requeued)).is_err() {
                            return Ok(());
                        }
                    }
                    Msg::Abort { reason } => bail!("destination: {reason}"),
                    Msg::RoundDone { .. } => {}
                    other => bail!("destination sent {other:?} during postcopy"),
                }
            }
        })();
        if let Err(e) = r {
            let _ = tx.send(Err(e));
        }
    })?;
    let r = push_until_complete(channels, queue, ctl, &rx);
    if r.is_err() {
        // Wakes the reader if the connection is only half dead.
        ctl.shutdown_all();
    }
    let _ = reader.join();
    let complete = r?;
    // Every page is in: the streams' ends only let the destination's
    // channel threads finish (it waits a little for them, then closes).
    match channels.finish() {
        Ok((_, cpu)) => ctl.add_cpu(false, cpu),
        Err(e) => tracing::debug!("ending the push streams after completion: {e:#}"),
    }
    // Whatever the push did after this, the destination has it all.
    ctl.update(|s| note_complete(s, &complete));
    Ok(())
}

/// The destination's figures from its `Complete` into the statistics.
fn note_complete(s: &mut Stats, complete: &Msg) {
    let Msg::Complete { faults, fault_p50_us, fault_p99_us, fault_max_us, cpu_s, ram_clients, ref fault_waits, .. } = *complete else {
        unreachable!("only a Complete carries the destination's figures")
    };
    s.faults = faults;
    s.fault_p50_us = fault_p50_us;
    s.fault_p99_us = fault_p99_us;
    s.fault_max_us = fault_max_us;
    s.cpu_s_dest = Some(cpu_s);
    s.ram_clients = ram_clients;
    s.fault_waits = fault_waits.clone();
}

/// Run the push, and again whenever the destination's report after a lost
/// channel queued pages again, until `Complete`; between pushes, drop the
/// channels whose link died (with several links). Returns `Complete`.
fn push_until_complete(
    channels: &mut ChannelSet,
    queue: &Arc<PushQueue>,
    ctl: &Control,
    rx: &std::sync::mpsc::Receiver<Result<FromDest>>,
) -> Result<Msg> {
    use std::sync::mpsc::RecvTimeoutError;
    loop {
        channels.push(queue)?;
        loop {
            match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(Ok(FromDest::Complete(m))) => return Ok(m),
                Ok(Ok(FromDest::Requeued)) => break,
                Ok(Err(e)) => return Err(e),
                Err(RecvTimeoutError::Disconnected) => bail!("postcopy control reader ended"),
                Err(RecvTimeoutError::Timeout) => {
                    if ctl.is_cancelled() {
                        bail!("cancelled");
                    }
                    // A channel whose link died with pages still in its
                    // socket buffer: the destination waits for those.
                    channels.check_links()?;
                    if queue.left() > 0 {
                        break;
                    }
                }
            }
        }
    }
}

/// The destination holds the pages of `have` (its bitmap): queue the rest
/// again, read from RAM or known zero. The VM is paused here: one walk of
/// the memfd's data is exact.
fn requeue_missing(queue: &PushQueue, ram: RamRegion, have: &[u8]) -> Result<()> {
    let total = ram.pages();
    let have =
        AtomicBitmap::from_le_bytes(total, have).ok_or_else(|| anyhow!("pages-held bitmap of {} bytes for {total} pages", have.len()))?;
    let missing = normalize((0..total).filter(|&p| !have.get(p)).map(|p| PageRange { first: p, count: 1 }).collect(), total);
    let holes = complement(&ram.data_ranges().context("finding the memfd's data ranges")?, total);
    let (data, zero) = split_known_zero(&holes, &missing);
    let pages: u64 = missing.iter().map(|r| r.count).sum();
    tracing::warn!("postcopy: a push channel was lost with its link; the destination lacks {pages} pages, pushed again");
    queue.requeue(&data, &zero);
    Ok(())
}

/// What a recovery handshake gives: the control connection, the links
/// the recovery uses, and the pages the destination lacks, with data and
/// known to be zero.
type Recovered = (ControlConn, Links, Vec<PageRange>, Vec<PageRange>);

/// The recovery handshake with a destination that kept its RAM: a
/// `recover` hello, its welcome and its bitmap of the pages it has. The
/// control connection goes to the first link that takes a connection (a
/// link still cut is passed over, and left out of the recovery with those
/// before it).
fn recover_hello(
    links: &Links,
    session: u64,
    ram: &RamRegion,
    channels: u32,
    compress: &str,
    transport: &str,
    ctl: &Arc<Control>,
) -> Result<Recovered> {
    let total = ram.pages();
    let mut tried = Vec::new();
    let (mut control, live) = loop {
        let k = tried.len();
        if k == links.len() {
            bail!("no link takes the recovery's control connection: {}", tried.join("; "));
        }
        match crate::wire::connect(links.addr(k), ctl) {
            Ok(c) => break (c, links.from_link(k)),
            Err(e) => {
                tracing::warn!("recovery: {e:#}; trying the next link");
                tried.push(format!("{e:#}"));
            }
        }
    };
    wire::write_preamble(&mut control, wire::VERSION, wire::ROLE_CONTROL)?;
    wire::send_msg(
        &mut control,
        &Msg::Hello {
            session,
            shape: String::new(),
            ram_bytes: ram.len,
            page_size: PAGE_SIZE,
            channels,
            compress: compress.into(),
            mode: "recover".into(),
            transport: transport.into(),
            spare_controls: live.len() as u32 - 1,
            early_state: false,
        },
    )?;
    control.set_read_timeout(Some(Duration::from_secs(30)))?;
    recv_welcome(&mut control, "recovery hello")?;
    let have = wire::recv_blob(&mut control).map_err(|e| anyhow!("received-pages bitmap: {e}"))?;
    // The control connection gets its spares again, one on each link of
    // the recovery after its own, so that a link cut after the recovery
    // moves the control stream rather than pausing again.
    let spares: Vec<&str> = (1..live.len()).map(|k| live.addr(k)).collect();
    let mut conns = vec![control];
    conns.extend(ControlConn::open_spares(&spares, session, ctl)?);
    let have = AtomicBitmap::from_le_bytes(total, &have)
        .ok_or_else(|| anyhow!("received-pages bitmap of {} bytes for {total} pages", have.len()))?;
    let missing: Vec<PageRange> = (0..total).filter(|&p| !have.get(p)).map(|p| PageRange { first: p, count: 1 }).collect();
    let missing = normalize(missing, total);
    // The VM is paused on both sides: one full walk is exact.
    let holes = complement(&ram.data_ranges().context("finding the memfd's data ranges")?, total);
    let (data, zero) = split_known_zero(&holes, &missing);
    let control = ControlConn::new(conns, ctl)?;
    control.set_read_timeout(None)?;
    Ok((control, live, data, zero))
}

/// The links' statistics after a recovery: the control connection rides
/// the first of the links used, and the link it moves to later.
fn mark_control(ctl: &Arc<Control>, control: &ControlConn, live: &Links) {
    let on_link = |s: &mut crate::stats::Stats, addr: &str| {
        for l in s.links.iter_mut() {
            l.control = l.addr == addr;
        }
    };
    ctl.update(|s| on_link(s, live.first()));
    let (c, live) = (ctl.clone(), live.clone());
    control.on_move(move |k| c.update(|s| on_link(s, live.addr(k))));
}

/// A new set of connections to a destination that kept its RAM: it tells
/// which pages it has, the queue becomes the rest.
fn reconnect(
    addr: &str,
    session: u64,
    ram: &RamRegion,
    compress: Compress,
    bucket: &Arc<TokenBucket>,
    ctl: &Arc<Control>,
    queue: &Arc<PushQueue>,
) -> Result<(ControlConn, ChannelSet, Vec<TcpStream>)> {
    let addr = crate::sender::parse_tcp_uri(addr)?;
    let channels = ctl.snapshot().channels.max(1);
    let (control, live, data, zero) = recover_hello(&addr, session, ram, channels, &compress.to_string(), "", ctl)?;
    queue.reset(ram.pages(), &data, zero);
    let mut ch = open_channels(&live, session, channels, *ram, compress, bucket, ctl, None)?;
    ch.enable_failover(&control)?;
    mark_control(ctl, &control, &live);
    // An urgent connection per link of the recovery, as at the start.
    let urgent = open_urgent(&live, session, ctl)?;
    Ok((control, ch, urgent))
}

/// What the rdma transport's postcopy source starts from.
struct ReadsStart {
    session: u64,
    control: ControlConn,
    channels: ChannelSet,
    reads: ReadableRam,
    log: Option<(DirtyLog, Option<Vec<PageRange>>)>,
    holes: Vec<PageRange>,
    pending: Vec<PageRange>,
    round: u64,
    rnicd: String,
}

/// Postcopy over the rdma transport. The data channels end before the
/// pause (the precopy rounds' WRITEs have landed once they have), then
/// the switch as over tcp, then the plan: which pages the destination
/// lacks, with data or known zero. From there the destination READs them
/// from our guest RAM, registered with our rnicd ([`ReadableRam`]): no
/// thread of this vmm runs for a page, this one only waits for
/// `Complete` on the control connection. A break pauses, as over tcp;
/// `migrate resume` offers the RAM again on a new connection with the
/// plan of what is still missing.
fn run_reads(guard: &mut Outgoing, st: ReadsStart) -> Result<()> {
    let ReadsStart { session, mut control, mut channels, reads, log, holes, pending, round, rnicd } = st;
    let ctl = guard.ctl.clone();
    let ram = guard.vm.ram();
    // After the switch the destination places pages itself: a WRITE that
    // landed later could overwrite a page the guest changed since. Each
    // channel's end waits for the completion of its last SEND, and so of
    // every WRITE before it. Before the pause: not downtime.
    let (_, cpu) = channels.finish()?;
    ctl.add_cpu(false, cpu);
    // Kept (ended) until the migration ends: dropping the set shuts every
    // connection of the migration down, the control connection too.
    let _channels = channels;
    let (missing, queue, _, _) = switch_over(guard, &mut control, None, log, pending)?;
    let (data, zero) = plan_push(ram, missing, holes, &queue, &[])?;
    let t_post = Instant::now();
    ctl.update(|s| {
        s.status = Status::PostcopyActive;
        s.rounds = round + 1;
        s.remaining_pages = queue.left();
    });
    // The cap the destination READs at: the one set now, which
    // `migrate-set-parameters` may have changed since the start.
    let mut sent_cap = ctl.bucket().rate();
    let mut conn = match send_plan(&mut control, &data, &zero, sent_cap) {
        Ok(()) => Some((control, reads)),
        Err(e) => {
            tracing::warn!("the plan of pages to read did not go out: {e:#}");
            None
        }
    };
    loop {
        let r = match conn.take() {
            // The RAM stays readable until the destination has it all.
            Some((mut c, _reads)) => {
                let r = wait_complete(&mut c, &ctl, sent_cap);
                if r.is_ok() {
                    c.close();
                }
                r
            }
            None => Err(anyhow!("not connected")),
        };
        let Err(e) = r else { break };
        let (target, t_paused) = pause_until_resume(&ctl, &e);
        sent_cap = ctl.bucket().rate();
        match reconnect_reads(&target, session, &ram, &rnicd, sent_cap, &ctl) {
            Ok(c) => {
                conn = Some(c);
                mark_resumed(&ctl, &target, t_paused);
            }
            Err(e) => {
                ctl.update(|s| s.paused_ms += t_paused.elapsed().as_secs_f64() * 1e3);
                tracing::warn!("recovery failed: {e:#}");
            }
        }
    }
    let postcopy_ms = t_post.elapsed().as_secs_f64() * 1e3;
    ctl.update(|s| {
        s.postcopy_ms = postcopy_ms;
        s.remaining_pages = 0;
    });
    Ok(())
}

/// After a break in postcopy: report `postcopy-paused` with what the user
/// can do, and wait for `migrate resume` (the target to reconnect to).
/// Returns the target and when the pause began.
fn pause_until_resume(ctl: &Control, e: &anyhow::Error) -> (String, Instant) {
    let why = format!("{e:#}");
    tracing::warn!("postcopy paused: {why}");
    let t_paused = Instant::now();
    ctl.update(|s| {
        s.status = Status::PostcopyPaused;
        s.error = Some(format!(
            "postcopy paused: {why}; the destination runs the VM and this host still holds its missing pages: recover with migrate-recover on the destination and migrate resume here"
        ));
    });
    let target = loop {
        match ctl.wait_recovery() {
            RecoverRequest::Connect(a) => break a,
            RecoverRequest::Listen(_) => tracing::warn!("migrate-recover is for the destination"),
        }
    };
    ctl.forget_connections();
    (target, t_paused)
}

/// A reconnection after a pause succeeded: postcopy is active again.
fn mark_resumed(ctl: &Control, target: &str, t_paused: Instant) {
    ctl.update(|s| {
        s.status = Status::PostcopyActive;
        s.error = None;
        s.recoveries += 1;
        s.paused_ms += t_paused.elapsed().as_secs_f64() * 1e3;
        s.peer = target.to_string();
    });
}

/// `PullPlan` and its two blobs: pages with data, pages known zero.
fn send_plan(control: &mut ControlConn, data: &[PageRange], zero: &[PageRange], max_bandwidth: u64) -> Result<()> {
    let blob = |rs: &[PageRange]| -> Vec<u8> { rs.iter().flat_map(|r| [r.first.to_le_bytes(), r.count.to_le_bytes()]).flatten().collect() };
    wire::send_msg(control, &Msg::PullPlan { max_bandwidth })?;
    wire::send_blob(control, &blob(data))?;
    wire::send_blob(control, &blob(zero))?;
    Ok(())
}

/// How often a source whose destination READs its pages looks for a new
/// bandwidth cap, as senders waiting for the bucket do.
const CAP_LOOK: Duration = Duration::from_millis(20);

/// Wait for the destination's `Complete` (it READs every page itself,
/// at the cap it was told last: `cap`). A cap changed meanwhile
/// (`migrate-set-parameters`) goes to it within [`CAP_LOOK`].
fn wait_complete(control: &mut ControlConn, ctl: &Control, mut cap: u64) -> Result<()> {
    control.set_read_timeout(None)?;
    loop {
        let now = ctl.bucket().rate();
        if now != cap {
            wire::send_msg(control, &Msg::ReadCap { max_bandwidth: now })?;
            cap = now;
        }
        if !control.wait_readable(CAP_LOOK) {
            continue;
        }
        match wire::recv_msg(control).map_err(|e| anyhow!("destination: {e}"))? {
            complete @ Msg::Complete { pages_read, .. } => {
                let (pushed, requested) = pages_read.unwrap_or_default();
                ctl.update(|s| {
                    note_complete(s, &complete);
                    // Read by the destination from this RAM, not sent.
                    s.pages_pushed = pushed;
                    s.pages_requested = requested;
                    s.pages_sent += pushed + requested;
                });
                return Ok(());
            }
            Msg::Abort { reason } => bail!("destination: {reason}"),
            Msg::RoundDone { .. } => {}
            other => bail!("destination sent {other:?} during postcopy"),
        }
    }
}

/// Over rdma: a new control connection to a destination that kept its RAM;
/// it says which pages it has, and READs the rest through new queue pairs.
fn reconnect_reads(
    target: &str,
    session: u64,
    ram: &RamRegion,
    rnicd: &str,
    cap: u64,
    ctl: &Arc<Control>,
) -> Result<(ControlConn, ReadableRam)> {
    let (addr, _) = Transport::from_uri(target, "rdma", rnicd)?;
    let addr = crate::sender::parse_tcp_uri(&addr)?;
    let channels = ctl.snapshot().channels.max(1);
    let (mut control, live, data, zero) = recover_hello(&addr, session, ram, channels, "", "rdma", ctl)?;
    let reads = crate::rdma::offer_ram(&mut control, rnicd, &live, ram)?;
    mark_control(ctl, &control, &live);
    send_plan(&mut control, &data, &zero, cap)?;
    Ok((control, reads))
}

/// Answers page requests on the urgent connections, one per link, each
/// request with one batch on the connection it came on. One whose link
/// died ends alone: the destination asks on another.
struct UrgentServer {
    streams: Vec<TcpStream>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl UrgentServer {
    /// `first`: pages the first connection sends before it answers
    /// anything (the devices' pages of the switch).
    fn start(
        streams: Vec<TcpStream>,
        ram: RamRegion,
        queue: Arc<PushQueue>,
        ctl: Arc<Control>,
        first: Vec<PageRange>,
    ) -> Result<UrgentServer> {
        let mut threads = Vec::new();
        let mut first = Some(first).filter(|f| !f.is_empty());
        for (k, s) in streams.iter().enumerate() {
            let (s2, queue, ctl, first) = (s.try_clone()?, queue.clone(), ctl.clone(), first.take());
            threads.push(std::thread::Builder::new().name("postcopy-urgent".into()).spawn(move || {
                let r = first
                    .map_or(Ok(0), |pages| {
                        // The switch's real-time class, inherited: this is
                        // downtime (at the normal class the destination
                        // waited 3-28 ms for them after its restore, against
                        // 0.1 ms).
                        let mut w = &s2;
                        super::device::send(&mut w, ram, &pages, &ctl)
                    })
                    .and_then(|_| serve_requests(s2, ram, &queue, &ctl));
                if let Err(e) = r {
                    tracing::debug!("urgent connection of link {k} ended: {e:#}");
                }
            })?);
        }
        Ok(UrgentServer { streams, threads })
    }
    fn stop(&mut self) {
        for s in &self.streams {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn serve_requests(mut s: TcpStream, ram: RamRegion, queue: &PushQueue, ctl: &Control) -> Result<()> {
    let _cpu = CpuTally::new(ctl, false);
    crate::priority::fault_path_priority();
    let total = ram.pages();
    let mut w = s.try_clone()?;
    let mut batch = BatchWriter::new();
    let mut runs = Vec::new();
    loop {
        let (kind, first, count) = wire::read_request(&mut s, total)?;
        runs.clear();
        if kind == wire::DATA_PREFETCH {
            queue.take_queued(first, count as u64, &mut runs);
        } else {
            queue.requested(first, count as u64);
            runs.push(PageRange { first, count: count as u64 });
        }
        let mut sent = 0;
        for r in &runs {
            for pfn in r.first..r.end() {
                // SAFETY: read_request checked the range; the VM is paused here.
                let src = unsafe { std::slice::from_raw_parts(ram.host_addr.add((pfn * PAGE_SIZE) as usize), PAGE_SIZE as usize) };
                // One pass over the page (the VM is paused: no race).
                match nonzero_xxh3(src) {
                    Some(h) => batch.raw_hashed(pfn, src, h),
                    None => batch.zero(pfn),
                }
            }
            sent += r.count;
        }
        if sent == 0 {
            continue;
        }
        let n = batch.write_to(&mut w)? as u64;
        ctl.update(|st| {
            st.pages_requested += sent;
            st.pages_sent += sent;
            st.wire_bytes += n;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memvm::GuestRam;

    #[test]
    fn holes_written_after_the_first_look_are_data() {
        let ram = GuestRam::new(64 * PAGE_SIZE).unwrap();
        let r = ram.region();
        let write = |pfn: u64| unsafe { *ram.byte_ptr(pfn * PAGE_SIZE + 7) = 1 };
        write(3);
        write(10);
        let before = complement(&r.data_ranges().unwrap(), 64);
        // Written since (by the guest, or a RAM client through its own
        // mapping), and punched out since.
        write(20);
        write(63);
        // SAFETY: a page of our own memfd.
        assert_eq!(
            unsafe {
                libc::fallocate(r.memfd, libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, 3 * PAGE_SIZE as i64, PAGE_SIZE as i64)
            },
            0
        );
        let holes = r.holes_since(&before).unwrap();
        let all = [PageRange { first: 0, count: 64 }];
        let (data, zero) = split_known_zero(&holes, &all);
        let is_zero = |p: u64| zero.iter().any(|z| z.first <= p && p < z.end());
        assert!(!is_zero(20) && !is_zero(63) && !is_zero(10), "written pages are data: {zero:?}");
        // A punched page still goes as data (it reads as zeros): only slower.
        assert!(!is_zero(3));
        assert!(is_zero(0) && is_zero(21) && is_zero(62));
        assert_eq!(data.iter().chain(&zero).map(|r| r.count).sum::<u64>(), 64);
    }
}
