//! The outgoing side of a precopy migration.
//!
//! One control connection and N data connections. Each round's pages are
//! cut into chunks that the channel threads take from a shared index, so a
//! channel that goes faster simply takes more chunks. Every round ends with
//! a SYNC on every channel: the destination applies round r+1 only after all
//! of round r, so a page resent on another channel never loses to its older
//! copy.

use crate::compress::Compress;
use crate::control_conn::ControlConn;
use crate::cputime::{thread_cpu_s, unix_ns};
use crate::dirty::{DirtyLog, DirtySource, PAGE_SIZE};
use crate::links::Links;
use crate::pages::{complement, count_pages, normalize, overlap, PageRange};
use crate::ratelimit::TokenBucket;
use crate::stats::{Control, Mode, Params, RoundStat, Status};
use crate::transport::Transport;
use crate::vm::MigratableVm;
use crate::wire::{self, Msg};
use anyhow::{anyhow, bail, Context, Result};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::sender::{
    chunk, give_up_at, open_channels, open_urgent, recv_reply, recv_welcome, written_holes_as_data, ChannelSet, Downtime, Outgoing,
    WorkItem, CHUNK_PAGES, ZERO_CHUNK_PAGES,
};
pub use crate::sender::{is_zero, nonzero_xxh3};

/// Run an outgoing migration to `uri` to its end. On success the VM stays
/// paused here (the destination runs it); on any failure it runs here again
/// with its memory untouched. Progress and the result are in `ctl.stats`.
pub fn run(vm: Arc<dyn MigratableVm>, uri: &str, params: &Params, sources: Vec<Arc<dyn DirtySource>>, ctl: Arc<Control>) -> Result<()> {
    let t0 = Instant::now();
    let cpu0 = thread_cpu_s();
    ctl.testing.arm(crate::testing::Fault::parse(&params.testing).unwrap_or(None));
    let r = run_inner(vm, uri, params, sources, &ctl, t0);
    let cpu_main = thread_cpu_s() - cpu0;
    ctl.update(|s| {
        s.ended_unix_ms = Some(crate::cputime::unix_ns() as f64 / 1e6);
        s.total_ms = t0.elapsed().as_secs_f64() * 1e3;
        s.cpu_s_source = Some(s.cpu_s_source.unwrap_or(0.0) + cpu_main);
        let secs = s.total_ms / 1e3;
        if secs > 0.0 {
            s.throughput_gbps = s.wire_bytes as f64 * 8.0 / secs / 1e9;
            for l in &mut s.links {
                l.throughput_gbps = l.wire_bytes as f64 * 8.0 / secs / 1e9;
            }
            s.ram_throughput_gbps = s.pages_sent.saturating_sub(s.zero_pages) as f64 * PAGE_SIZE as f64 * 8.0 / secs / 1e9;
        }
        match &r {
            Ok(()) => s.status = Status::Completed,
            Err(e) => {
                s.status = if ctl.is_cancelled() { Status::Cancelled } else { Status::Failed };
                s.error = Some(format!("{e:#}"));
            }
        }
    });
    r
}

/// The phases of an outgoing migration, each its own function as in QEMU's
/// migration_thread: setup, the first pass, the rounds with their switch
/// decision, then either the postcopy hand-over or stop-and-copy and the
/// commit.
fn run_inner(
    vm: Arc<dyn MigratableVm>,
    uri: &str,
    params: &Params,
    sources: Vec<Arc<dyn DirtySource>>,
    ctl: &Arc<Control>,
    t0: Instant,
) -> Result<()> {
    let plan = Plan::new(&vm, uri, params, ctl, t0)?;
    let mut guard = Outgoing { vm: vm.clone(), ctl: ctl.clone(), paused_by_us: false, committed: false, early_sent: false };
    let mut link = connect_session(&vm, &plan, params, ctl)?;
    if plan.mode == Mode::Postcopy {
        return postcopy_at_once(&mut guard, &vm, plan, link, ctl);
    }
    guard.early_sent = send_early_state(&vm, &plan, &mut link, ctl)?;
    let mut pass = first_pass(&vm, sources, &plan, &mut link, ctl)?;
    let end = rounds(&vm, params, &plan, &mut link, &mut pass, ctl)?;
    if end.switch {
        return switch_to_postcopy(&mut guard, &vm, &plan, link, pass, end);
    }
    let fin = stop_and_copy(&mut guard, &plan, &mut link, &mut pass.log, end, ctl)?;
    commit(&mut guard, &vm, params, link, pass.log, fin, ctl)
}

/// The migration's parameters, checked, and when it gives up.
struct Plan {
    /// The destination's addresses, one per link.
    links: Links,
    transport: Transport,
    compress: Compress,
    mode: Mode,
    total: u64,
    deadline: Option<Instant>,
    t0: Instant,
}

impl Plan {
    fn new(vm: &Arc<dyn MigratableVm>, uri: &str, params: &Params, ctl: &Control, t0: Instant) -> Result<Plan> {
        params.validate().map_err(|e| anyhow!(e))?;
        let compress: Compress = params.compress.parse().map_err(|e: String| anyhow!(e))?;
        let mode: Mode = params.mode.parse().map_err(|e: String| anyhow!(e))?;
        let (addr, transport) = Transport::from_uri(uri, &params.transport, &params.rnicd)?;
        let links = Links::parse(&addr)?;
        let ram = vm.ram();
        let total = ram.pages();
        let deadline = (params.timeout_s > 0).then(|| t0 + Duration::from_secs(params.timeout_s));
        ctl.update(|s| {
            s.status = Status::Setup;
            s.role = "outgoing".into();
            s.peer = links.to_string();
            s.channels = params.channels;
            s.transport = transport.name().into();
            s.compress = compress.to_string();
            s.ram_bytes = ram.len;
            s.total_pages = total;
            s.mode = mode.to_string();
        });
        Ok(Plan { links, transport, compress, mode, total, deadline, t0 })
    }

    fn setup_step(&self, ctl: &Control, name: &str) {
        let ms = self.t0.elapsed().as_secs_f64() * 1e3;
        ctl.update(|s| s.setup_steps.push((name.to_string(), ms)));
    }
}

/// The connections to the destination.
struct Link {
    session: u64,
    bucket: Arc<TokenBucket>,
    /// On every link: the engine never knows which one carries it.
    control: ControlConn,
    channels: ChannelSet,
    /// Postcopy and hybrid: the channel for pages the destination faults on.
    urgent: Option<Vec<TcpStream>>,
    /// Postcopy and hybrid over rdma: our guest RAM, for the destination
    /// to READ what it lacks after the switch (no urgent connection then).
    reads: Option<crate::rdma::ReadableRam>,
    /// The destination builds the devices' early sections
    /// (`Msg::WelcomeEarlyState`).
    builds_early: bool,
    /// When the devices' early state was sent, while the destination has
    /// not yet said it is built (`Msg::EarlyBuilt`).
    early_pending: Option<Instant>,
}

/// Setup: the control connection, the handshake, the data connections.
fn connect_session(vm: &Arc<dyn MigratableVm>, plan: &Plan, params: &Params, ctl: &Arc<Control>) -> Result<Link> {
    let ram = vm.ram();
    let session = unix_ns() ^ (std::process::id() as u64) << 32;
    let mut control = crate::wire::connect(plan.links.first(), ctl)?;
    wire::write_preamble(&mut control, wire::VERSION, wire::ROLE_CONTROL)?;
    wire::send_msg(
        &mut control,
        &Msg::Hello {
            session,
            shape: vm.shape(),
            ram_bytes: ram.len,
            page_size: PAGE_SIZE,
            channels: params.channels,
            compress: plan.compress.to_string(),
            mode: plan.mode.to_string(),
            transport: plan.transport.name().into(),
            spare_controls: plan.links.len() as u32 - 1,
            early_state: true,
        },
    )?;
    control.set_read_timeout(Some(Duration::from_secs(30)))?;
    let builds_early = recv_welcome(&mut control, "hello")?;
    if !builds_early {
        tracing::info!("the destination does not build early device sections (an older build, or TRANSIT_NO_EARLY_STATE=1 there): the whole device state goes at the switch");
    }
    let spares: Vec<&str> = (1..plan.links.len()).map(|k| plan.links.addr(k)).collect();
    let mut conns = vec![control];
    conns.extend(ControlConn::open_spares(&spares, session, ctl)?);
    let mut control = ControlConn::new(conns, ctl)?;
    let on_link = |s: &mut crate::stats::Stats, k: usize| {
        for (i, l) in s.links.iter_mut().enumerate() {
            l.control = i == k;
        }
    };
    plan.setup_step(ctl, "welcomed");
    // Its rate was set from `params` and may change while this runs.
    let bucket = ctl.bucket().clone();
    let mut channels = match &plan.transport {
        Transport::Tcp => open_channels(&plan.links, session, params.channels, ram, plan.compress, &bucket, ctl, plan.deadline)?,
        Transport::Rdma { rnicd } => {
            crate::rdma::open_channels(&mut control, rnicd, &plan.links, params.channels, ram, plan.compress, &bucket, ctl, plan.deadline)?
        }
    };
    channels.enable_failover(&control)?;
    // The links' statistics exist once the channels are open.
    let c = ctl.clone();
    control.on_move(move |k| c.update(|s| on_link(s, k)));
    ctl.update(|s| on_link(s, control.live_link().unwrap_or(0)));
    let (urgent, reads) = match (&plan.transport, plan.mode) {
        (_, Mode::Precopy) => (None, None),
        (Transport::Tcp, _) => (Some(open_urgent(&plan.links, session, ctl)?), None),
        (Transport::Rdma { rnicd }, _) => (None, Some(crate::rdma::offer_ram(&mut control, rnicd, &plan.links, &ram)?)),
    };
    plan.setup_step(ctl, "channels open");
    Ok(Link { session, bucket, control, channels, urgent, reads, builds_early, early_pending: None })
}

/// Postcopy: no RAM moves before the switch. The destination runs as
/// soon as it says it is ready and has built the devices' early sections
/// (sent now, while the VM runs here: what the destination builds ahead
/// is not downtime). Meanwhile the memfd's holes are found (a walk of
/// every page, not to be done once the destination runs and faults).
fn postcopy_at_once(guard: &mut Outgoing, vm: &Arc<dyn MigratableVm>, plan: Plan, mut link: Link, ctl: &Control) -> Result<()> {
    let ram = vm.ram();
    let walk = std::thread::spawn(move || ram.data_ranges());
    link.control.set_read_timeout(Some(Duration::from_secs(30)))?;
    match recv_reply(&mut link.control)? {
        Msg::Ready => {}
        other => bail!("destination answered {other:?} instead of ready"),
    }
    link.control.set_read_timeout(None)?;
    guard.early_sent = send_early_state(vm, &plan, &mut link, ctl)?;
    wait_early_built(&mut link, &plan, ctl)?;
    let data = walk.join().map_err(|_| anyhow!("the hole walk panicked"))?.context("finding the memfd's data ranges")?;
    let holes = complement(&data, plan.total);
    ctl.update(|s| s.setup_ms = plan.t0.elapsed().as_secs_f64() * 1e3);
    hand_over(guard, &plan, link, None, holes, Vec::new(), 0)
}

/// Hands the session's connections and what is left to send to the
/// postcopy source, which runs until the migration ends.
fn hand_over(
    guard: &mut Outgoing,
    plan: &Plan,
    link: Link,
    log: Option<(DirtyLog, Option<Vec<PageRange>>)>,
    holes: Vec<PageRange>,
    pending: Vec<PageRange>,
    round: u64,
) -> Result<()> {
    let start = crate::postcopy::source::Start {
        session: link.session,
        compress: plan.compress,
        bucket: link.bucket,
        control: link.control,
        urgent: link.urgent,
        reads: link.reads,
        transport: plan.transport.clone(),
        channels: link.channels,
        log,
        holes,
        pending,
        round,
    };
    crate::postcopy::source::run(guard, start)
}

/// The devices' early sections go first, so that the destination builds
/// them while the rounds run (precopy, hybrid) or while the VM runs here
/// before a postcopy switch; the state at the switch then finds them
/// built. Nothing is sent if no device has one, or to a destination that
/// does not build them (an older build; `TRANSIT_NO_EARLY_STATE=1` there):
/// it then gets the whole device state at the switch. Whether they went.
fn send_early_state(vm: &Arc<dyn MigratableVm>, plan: &Plan, link: &mut Link, ctl: &Control) -> Result<bool> {
    if !link.builds_early {
        return Ok(false);
    }
    let early = vm.save_early_state().context("saving the devices' early state")?;
    if early.sections.is_empty() {
        return Ok(false);
    }
    let mut blob = Vec::with_capacity(early.encoded_len() + 4);
    early.write_to(&mut blob)?;
    wire::send_msg(&mut link.control, &Msg::EarlyState { state_bytes: blob.len() as u64 })?;
    wire::send_blob(&mut link.control, &blob)?;
    link.early_pending = Some(Instant::now());
    ctl.update(|s| s.early_state_bytes = blob.len() as u64);
    plan.setup_step(ctl, "early device state sent");
    Ok(true)
}

/// Postcopy: with no rounds to run meanwhile, wait here (the VM runs on)
/// until the destination has built the devices' early sections, so that
/// the build is not downtime. Bounded as in precopy: past the migration's
/// timeout or `EARLY_BUILD_WAIT` the switch goes ahead and the rest of
/// the build becomes downtime (the destination finishes it before it
/// loads the state). Waiting never fails a migration; a cancel or a
/// destination that refuses does.
fn wait_early_built(link: &mut Link, plan: &Plan, ctl: &Control) -> Result<()> {
    let Some(sent) = link.early_pending else { return Ok(()) };
    while link.early_pending.is_some() {
        if ctl.is_cancelled() {
            bail!("cancelled");
        }
        if sent.elapsed() >= EARLY_BUILD_WAIT || plan.deadline.is_some_and(|d| Instant::now() >= d) {
            link.early_pending = None;
            break;
        }
        if link.control.wait_readable(Duration::from_millis(100)) {
            link.control.set_read_timeout(Some(Duration::from_secs(30)))?;
            match wire::recv_msg(&mut link.control).map_err(|e| anyhow!("destination: {e}"))? {
                Msg::EarlyBuilt => link.early_pending = None,
                Msg::Abort { reason } => bail!("destination refused: {reason}"),
                other => bail!("destination sent {other:?} while building the early device state"),
            }
            link.control.set_read_timeout(None)?;
        }
    }
    plan.setup_step(ctl, "early device state built");
    Ok(())
}

/// Dirty tracking and the first pass over all of RAM, cut into work.
struct FirstPass {
    log: DirtyLog,
    /// The first round's work: all of RAM (hybrid: its first eighth).
    items: Vec<WorkItem>,
    /// Hybrid: the rest of the first pass, sent in the round after.
    rest: Vec<WorkItem>,
    /// Hybrid: the sample of RAM's data armed before the first round.
    sample: Vec<PageRange>,
    /// The memfd's holes when the pass was planned (sent as zero runs).
    holes: Vec<PageRange>,
}

/// Setup, continued: dirty tracking from here on, and the first pass
/// planned. Tracking is registered now; each page is write-protected by
/// the first pass just before it is read, so that walk overlaps with
/// sending.
fn first_pass(
    vm: &Arc<dyn MigratableVm>,
    sources: Vec<Arc<dyn DirtySource>>,
    plan: &Plan,
    link: &mut Link,
    ctl: &Control,
) -> Result<FirstPass> {
    let ram = vm.ram();
    let total = plan.total;
    let log = DirtyLog::start_unarmed(&ram, sources)?;
    let armer = log.armer()?;
    plan.setup_step(ctl, "tracking registered");
    // Holes go as zero runs without being read, so they must be armed
    // before they are taken for holes: arm the holes seen now, then look
    // again. A page written in between is data in the second look and is
    // read (after arming) like any other; a hole in the second look was a
    // hole when it was armed.
    let holes = complement(&ram.data_ranges().context("finding the memfd's data ranges")?, total);
    for r in &holes {
        armer.arm(*r).context("arming dirty tracking")?;
    }
    plan.setup_step(ctl, "holes armed");
    let holes = ram.holes_since(&holes).context("finding the memfd's holes")?;
    let data = complement(&holes, total);
    let mut items = Vec::new();
    chunk(&data, CHUNK_PAGES, false, &mut items);
    chunk(&holes, ZERO_CHUNK_PAGES, true, &mut items);
    items.sort_by_key(|w| w.first);
    // Hybrid sends its first pass in two rounds, the first eighth of RAM,
    // then the rest, and may switch in between (see `next_step`). Until the
    // rest is sent, the scans look only at the first eighth (armed chunk by
    // chunk as it is sent), at a sample of its data (armed now) and at
    // every hole (armed above); the rest's other data is unarmed, and is
    // sent or missing anyway.
    let mut rest = Vec::new();
    let mut sample = Vec::new();
    if plan.mode == Mode::Hybrid {
        sample = mark_rate_sample(&mut items);
        for r in &sample {
            armer.arm(*r).context("arming dirty tracking")?;
        }
        plan.setup_step(ctl, "sample armed");
        let at = items.partition_point(|w| w.first < total / 8);
        rest = items.split_off(at);
    }
    link.channels.arm_next = Some(armer);
    ctl.update(|s| {
        s.status = Status::Active;
        s.setup_ms = plan.t0.elapsed().as_secs_f64() * 1e3;
        s.remaining_pages = total;
    });
    Ok(FirstPass { log, items, rest, sample, holes })
}

/// How the rounds ended.
struct RoundsEnd {
    /// Pages still to send: dirty ones, and for a switch, the first pass's
    /// pages never sent.
    pending: Vec<PageRange>,
    /// Switch to postcopy (hybrid) rather than stop and copy.
    switch: bool,
    /// The last round sent.
    round: u64,
    throttle: u8,
    /// Hybrid: where the first pass's pages not sent yet begin.
    unarmed_from: Option<u64>,
}

/// What a round's end tells the switch decision.
#[derive(Debug, Clone, Copy)]
struct RoundFacts {
    mode: Mode,
    /// Expected downtime: the dirty pages and the state at the link's rate.
    est_s: f64,
    /// The downtime asked for.
    target_s: f64,
    /// Hybrid: the rest of the first pass is still to send.
    rest_pending: bool,
    /// The round was cut short (hybrid's timeout or a postcopy request).
    was_cut: bool,
    timed_out: bool,
    postcopy_requested: bool,
    /// Hybrid: pages the guest wrote since the sample was armed, over all
    /// of RAM ([`written_estimate`]), and the pages the first round sent
    /// meanwhile.
    written: u64,
    first_round_pages: u64,
}

/// What to do after a round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NextStep {
    /// What is left fits the downtime: pause and send it.
    StopAndCopy,
    /// Hybrid: hand over to postcopy.
    SwitchToPostcopy,
    /// Precopy past its timeout without converging.
    GiveUp,
    AnotherRound,
}

/// The switch decision, as QEMU's migration_iteration_run makes it: stop
/// and copy once the rest fits the downtime; a hybrid switches to postcopy
/// when its first pass is over and what is left does not fit (another
/// round would send what the push sends and leave behind what the guest
/// dirties meanwhile), sooner, after the first eighth of the pass, if the
/// guest wrote pages at a quarter of the rate the link sent them or more
/// (precopy rounds would then send another third of RAM or more before
/// they converge, while the push sends each page once), and when the
/// operator asks or the timeout passes (either may have cut the round
/// short). A hybrid past its deadline switches even if the rest fits: its
/// stop-and-copy would be cancelled at the deadline.
fn next_step(f: &RoundFacts) -> NextStep {
    let hybrid = f.mode == Mode::Hybrid;
    let rest_fits = f.est_s <= f.target_s && !f.rest_pending && !f.was_cut;
    let hybrid_too_late = hybrid && f.timed_out;
    if rest_fits && !hybrid_too_late {
        return NextStep::StopAndCopy;
    }
    let dirtying = f.rest_pending && f.written * 4 >= f.first_round_pages;
    if hybrid && (f.postcopy_requested || f.timed_out || f.was_cut || !f.rest_pending || dirtying) {
        return NextStep::SwitchToPostcopy;
    }
    if f.timed_out {
        return NextStep::GiveUp;
    }
    NextStep::AnotherRound
}

/// The rounds: the first pass, then the pages dirtied meanwhile, until
/// [`next_step`] says stop and copy, or switch.
fn rounds(
    vm: &Arc<dyn MigratableVm>,
    params: &Params,
    plan: &Plan,
    link: &mut Link,
    pass: &mut FirstPass,
    ctl: &Control,
) -> Result<RoundsEnd> {
    let total = plan.total;
    let mode = plan.mode;
    let state_estimate = vm.state_size_estimate();
    let mut throttle: u8 = 0;
    let mut round = 0u64;
    // Hybrid's timeout and `migrate-start-postcopy` end its rounds early,
    // and it switches: the destination can run at once and fetch the rest.
    let cuttable = mode == Mode::Hybrid;
    let round_deadline = give_up_at(plan.deadline, cuttable);
    let t_round = Instant::now();
    let mut last = link.channels.round(round, std::mem::take(&mut pass.items), cuttable)?;
    wait_round_done(link, round, ctl, round_deadline)?;
    last.secs = t_round.elapsed().as_secs_f64();
    // Bytes per second the link gave us, and wire bytes per non-zero page.
    let mut bw = link_rate(last.wire, last.secs, link.bucket.rate());
    let mut page_cost = last.page_cost();
    // What the first round sent (for hybrid, the first eighth of RAM).
    let first_round_pages = last.pages;
    let mut scanned_at = t_round;
    // Hybrid: where the first pass's pages not sent yet begin. They run to
    // the end of RAM and were never armed (see `armed_part`); none once
    // the pass is all sent. A round cut short leaves its tail unsent: the
    // eighth's, or the rest's in the round after.
    let mut unarmed_from = (mode == Mode::Hybrid).then_some(0);
    loop {
        let unsent = std::mem::take(&mut last.unsent);
        unarmed_from = unarmed_from.and_then(|from| {
            let cut = unsent.iter().map(|w| w.first).filter(|&f| f >= from).min();
            cut.or(pass.rest.first().map(|w| w.first))
        });
        let scanned = rate_scan_part(unarmed_from, &pass.sample, &pass.holes, total);
        let mut dirty = pass.log.scan(total, scanned.as_deref())?;
        // The pages found dirty were written from scan to scan: the round,
        // and the scan and planning around it.
        let window = std::mem::replace(&mut scanned_at, Instant::now()).elapsed().as_secs_f64().max(1e-6);
        // Hybrid, after the first eighth: pages the guest wrote since the
        // sample was armed, over all of RAM, against the pages sent
        // meanwhile.
        let written = written_estimate(&dirty, &pass.sample, scanned.as_deref(), total);
        // The scan took the record of the holes the guest wrote: the rest
        // of the pass must send them as data, not as zero runs.
        pass.rest = written_holes_as_data(std::mem::take(&mut pass.rest), &dirty);
        if let Some(cut) = unarmed_from {
            // The first pass's pages not sent yet go anyway (with the rest,
            // or as missing).
            dirty.retain_mut(|r| {
                r.count = r.count.min(cut.saturating_sub(r.first));
                r.count > 0
            });
        }
        let n = count_pages(&dirty);
        let rate = n as f64 / window;
        // Sending the dirty pages alone, then with the state (the pause).
        let dirty_s = n as f64 * page_cost / bw.max(1.0);
        let est_s = dirty_s + state_estimate as f64 / bw.max(1.0);
        ctl.update(|s| {
            s.rounds = round + 1;
            s.round_stats.push(RoundStat {
                round,
                pages: last.pages,
                zero_pages: last.zero,
                wire_bytes: last.wire,
                duration_ms: last.secs * 1e3,
                dirty_pages_per_s: rate,
                throttle_pct: throttle,
            });
            s.remaining_pages = n;
            s.expected_downtime_ms = est_s * 1e3;
        });
        let facts = RoundFacts {
            mode,
            est_s,
            // `migrate-set-parameters` may have changed it meanwhile.
            target_s: ctl.downtime_ms() as f64 / 1e3,
            rest_pending: !pass.rest.is_empty(),
            was_cut: !unsent.is_empty(),
            timed_out: plan.deadline.is_some_and(|d| Instant::now() >= d),
            postcopy_requested: ctl.postcopy_requested(),
            written,
            first_round_pages,
        };
        let mut step = next_step(&facts);
        if let Some(sent) = link.early_pending.filter(|_| matches!(step, NextStep::StopAndCopy | NextStep::SwitchToPostcopy)) {
            if facts.timed_out || facts.postcopy_requested || sent.elapsed() >= EARLY_BUILD_WAIT {
                // Waiting longer would cost the migration more than the
                // build saves: go on, and the rest of the build becomes
                // downtime (the destination finishes it before it loads
                // the final state). A late `EarlyBuilt` is skipped.
                link.early_pending = None;
            } else {
                // The destination still builds the devices' early state:
                // that must not become downtime. Another round meanwhile
                // (`wait_round_done` takes the `EarlyBuilt`), then decide
                // again.
                step = NextStep::AnotherRound;
            }
        }
        match step {
            NextStep::StopAndCopy => return Ok(RoundsEnd { pending: dirty, switch: false, round, throttle, unarmed_from }),
            NextStep::SwitchToPostcopy => {
                let mut missing = dirty;
                let lost = link.channels.take_lost();
                missing.extend(pass.rest.iter().chain(&unsent).chain(&lost).map(|w| PageRange { first: w.first, count: w.count }));
                return Ok(RoundsEnd { pending: missing, switch: true, round, throttle, unarmed_from });
            }
            NextStep::GiveUp => {
                ctl.cancel();
                bail!(
                    "did not converge within the {} s timeout (expected downtime {:.0} ms, throttle {}%)",
                    params.timeout_s,
                    est_s * 1e3,
                    throttle
                );
            }
            NextStep::AnotherRound => {}
        }
        if !pass.rest.is_empty() {
            // The rest is armed as it is sent, as precopy's first pass is;
            // from then on all of RAM is armed.
            link.channels.arm_next = Some(pass.log.armer()?);
        }
        if params.auto_converge && mode == Mode::Precopy {
            if let Some(t) = converge_step(throttle, dirty_s / window, params) {
                throttle = t;
                vm.set_cpu_throttle(throttle);
                ctl.update(|s| {
                    s.throttle_pct = throttle;
                    s.throttle_steps += 1;
                });
            }
        }
        round += 1;
        let mut items = std::mem::take(&mut pass.rest);
        let from = items.len();
        chunk(&dirty, CHUNK_PAGES, false, &mut items);
        // The scan armed the dirty pages again: a round that arms (hybrid's
        // rest of the pass) skips them.
        items[from..].iter_mut().for_each(|w| w.armed = true);
        let t_round = Instant::now();
        last = link.channels.round(round, items, cuttable)?;
        wait_round_done(link, round, ctl, round_deadline)?;
        last.secs = t_round.elapsed().as_secs_f64();
        if last.wire >= RATE_MIN_BYTES {
            bw = link_rate(last.wire, last.secs, link.bucket.rate());
            page_cost = last.page_cost();
        }
    }
}

/// Hybrid's switch: postcopy takes the connections, the log and the pages
/// still to send.
fn switch_to_postcopy(
    guard: &mut Outgoing,
    vm: &Arc<dyn MigratableVm>,
    plan: &Plan,
    link: Link,
    pass: FirstPass,
    end: RoundsEnd,
) -> Result<()> {
    let total = vm.ram().pages();
    let log = Some((pass.log, armed_part(end.unarmed_from, &pass.sample, total)));
    hand_over(guard, plan, link, log, pass.holes, end.pending, end.round + 1)
}

/// What stop-and-copy leaves for the commit.
struct Copied {
    pause: Downtime,
    rounds: u64,
    per_channel: Vec<u64>,
    state: Vec<u8>,
}

/// Stop-and-copy: pause, send the last dirty pages, save the state, end the
/// streams.
fn stop_and_copy(guard: &mut Outgoing, plan: &Plan, link: &mut Link, log: &mut DirtyLog, end: RoundsEnd, ctl: &Control) -> Result<Copied> {
    let total = plan.total;
    let RoundsEnd { mut pending, mut round, throttle, .. } = end;
    let pause = Downtime::pause(guard)?;
    let step = |name: &str| pause.step(name);
    pending.extend(log.scan(total, None)?);
    let pending = normalize(pending, total);
    // Keep the registration until the end: unregistering walks every page
    // table entry of RAM (hundreds of ms for GiBs) and nothing writes now.
    step("scanned");
    round += 1;
    let mut items = Vec::new();
    chunk(&pending, CHUNK_PAGES, false, &mut items);
    let mut fin = link.channels.round(round, items, false)?;
    if link.channels.failover_enabled() {
        // With several links, a channel may die with its link after its
        // last write: the round must be confirmed, and what a lost channel
        // may not have delivered sent again, before the streams end.
        wait_round_done(link, round, ctl, None)?;
        loop {
            let lost = link.channels.take_lost();
            if lost.is_empty() {
                break;
            }
            round += 1;
            let again = link.channels.round(round, lost, false)?;
            fin.pages += again.pages;
            fin.zero += again.zero;
            fin.wire += again.wire;
            wait_round_done(link, round, ctl, None)?;
        }
    }
    step("last pages sent");
    let state = guard.save_state().context("saving vCPU and device state")?;
    let mut blob = Vec::with_capacity(state.encoded_len() + 16);
    state.write_to(&mut blob)?;
    step("state saved");
    let (per_channel, cpu) = link.channels.finish()?;
    step("streams ended");
    ctl.update(|s| {
        s.rounds = round + 1;
        s.round_stats.push(RoundStat {
            round,
            pages: fin.pages,
            zero_pages: fin.zero,
            wire_bytes: fin.wire,
            duration_ms: fin.secs * 1e3,
            dirty_pages_per_s: 0.0,
            throttle_pct: throttle,
        });
        s.remaining_pages = 0;
        s.state_bytes = blob.len() as u64;
        s.cpu_s_source = Some(cpu);
    });
    Ok(Copied { pause, rounds: round + 1, per_channel, state: blob })
}

/// The commit: the end of the stream and the state; once the destination
/// has loaded them it owns the VM, and it is told to run it.
fn commit(
    guard: &mut Outgoing,
    vm: &Arc<dyn MigratableVm>,
    params: &Params,
    link: Link,
    log: DirtyLog,
    fin: Copied,
    ctl: &Control,
) -> Result<()> {
    // The channels go after the commit: tearing down RDMA queue pairs and
    // registrations takes rnicd round trips that the downtime need not wait for.
    let Link { mut control, channels, .. } = link;
    let Copied { pause, rounds, per_channel, state: blob } = fin;
    let (paused_at, t_pause) = (pause.paused_at, pause.since);
    let step = |name: &str| pause.step(name);
    wire::send_msg(
        &mut control,
        &Msg::End {
            pages_per_channel: per_channel,
            rounds,
            state_bytes: blob.len() as u64,
            source_paused_unix_ns: paused_at,
            ram_hashes: params.verify_ram,
        },
    )?;
    wire::send_blob(&mut control, &blob)?;
    if params.verify_ram {
        let h = crate::vm::page_hashes(&vm.ram());
        let bytes: Vec<u8> = h.iter().flat_map(|x| x.to_le_bytes()).collect();
        wire::send_blob(&mut control, &bytes)?;
    }
    guard.let_go()?;
    step("identity let go");
    control.set_read_timeout(Some(Duration::from_secs(60)))?;
    let dest_cpu = match recv_reply(&mut control)? {
        Msg::Loaded { cpu_s } => cpu_s,
        other => bail!("destination answered {other:?} to the end of the stream"),
    };
    // Commit point: from here the destination owns the VM.
    guard.commit();
    step("destination loaded");
    ctl.update(|s| s.cpu_s_dest = Some(dest_cpu));
    let go = wire::send_msg(&mut control, &Msg::Go);
    control.set_read_timeout(Some(Duration::from_secs(30)))?;
    match go.map_err(anyhow::Error::from).and_then(|_| recv_reply(&mut control)) {
        Ok(Msg::Resumed { unix_ns, resumed, cpu_s }) => ctl.update(|s| {
            s.downtime_steps.push(("destination resumed (reply)".into(), t_pause.elapsed().as_secs_f64() * 1e3));
            s.cpu_s_dest = Some(cpu_s);
            s.paused_unix_ms = Some(paused_at as f64 / 1e6);
            s.downtime_ms =
                Some(if resumed { unix_ns.saturating_sub(paused_at) as f64 / 1e6 } else { t_pause.elapsed().as_secs_f64() * 1e3 });
        }),
        Ok(other) => tracing::warn!("destination sent {other:?} instead of resumed"),
        Err(e) => tracing::warn!("destination loaded the VM but did not confirm its start: {e:#}"),
    }
    // The stream ends here: the channels' teardown below shuts every
    // connection of the migration, which must not look like a failed link.
    control.close();
    // The VM never runs here again (after the downtime: a VM that does
    // not keep it unregisters now).
    vm.retire(Box::new(log.into_tracker()));
    drop(channels);
    Ok(())
}

/// A round that moved fewer bytes is dominated by fixed costs (scan, round
/// barrier, the destination's bookkeeping) and would understate the link.
const RATE_MIN_BYTES: u64 = 1 << 20;

/// How long the rounds go on for the destination to build the devices'
/// early state before the source stops waiting for it (a build is well
/// under a second; one stuck must not hold the migration).
const EARLY_BUILD_WAIT: Duration = Duration::from_secs(120);
/// The link rate assumed until a round moved enough to measure it: 1
/// Gbit/s, or the cap if lower.
const ASSUMED_RATE: f64 = 125e6;

/// The link's rate in bytes/s, from a round that moved `wire` bytes in
/// `secs`. A first pass over mostly-zero RAM moves little (zero runs are a
/// few bytes each) in the time the destination takes to apply it; taken
/// as the link's rate, it made even the vCPU state look seconds long, and
/// such a VM never converged.
fn link_rate(wire: u64, secs: f64, cap: u64) -> f64 {
    if wire >= RATE_MIN_BYTES && secs > 0.0 {
        return wire as f64 / secs;
    }
    if cap > 0 {
        ASSUMED_RATE.min(cap as f64)
    } else {
        ASSUMED_RATE
    }
}

/// What a hybrid's switch scans while its first pass is not all sent
/// (`unarmed_from`: its first page not sent): RAM up to there, armed as it
/// was sent, and the sample, armed before; none once all of RAM is armed.
/// A page never armed would count as written and the walk would arm it:
/// kernel time, in the downtime for the switch's scan, for pages that go
/// as missing anyway (a pass cut short by the timeout or
/// `migrate-start-postcopy`). Pages past `unarmed_from` go as missing
/// anyway, so the switch need not look at their holes.
fn armed_part(unarmed_from: Option<u64>, sample: &[PageRange], total: u64) -> Option<Vec<PageRange>> {
    let mut a = sample.to_vec();
    a.push(PageRange { first: 0, count: unarmed_from? });
    Some(normalize(a, total))
}

/// What a hybrid's scans after a round look at while its first pass is
/// not all sent: the [`armed_part`], and every hole of the pass, armed
/// before it was taken for one. Writes into holes so count as dirtying
/// page by page, not through the sample: a guest that writes memory it
/// never wrote before writes only holes, where the sample (data only)
/// has nothing.
fn rate_scan_part(unarmed_from: Option<u64>, sample: &[PageRange], holes: &[PageRange], total: u64) -> Option<Vec<PageRange>> {
    let mut a = armed_part(unarmed_from, sample, total)?;
    a.extend_from_slice(holes);
    Some(normalize(a, total))
}

/// Hybrid's sample of RAM: one data item in each eight, at a different
/// place in each eight, so that a guest writing with the period of eight
/// items is neither missed nor counted eight times. They are marked armed:
/// armed before the first round, they record writes from then on, even
/// after they are sent. Arming them costs an eighth of arming all of RAM
/// (50-70 ms per GiB here).
fn mark_rate_sample(items: &mut [WorkItem]) -> Vec<PageRange> {
    let mut out = Vec::new();
    let data: Vec<usize> = (0..items.len()).filter(|&i| !items[i].known_zero).collect();
    for (g, eight) in data.chunks(8).enumerate() {
        let i = eight[(g * 5 + 3) % 8 % eight.len()];
        items[i].armed = true;
        out.push(PageRange { first: items[i].first, count: items[i].count });
    }
    out
}

/// Pages the guest wrote in all of RAM since the sample was armed, from a
/// scan of `scanned` (none: all of RAM). Where the scan looked (the first
/// eighth, armed as it was sent, the sample and the holes) the pages it
/// found count one by one; the data it did not look at counts as the
/// sample's written share of it, or as what other dirty sources (which
/// see all of RAM) found there, whichever is more.
fn written_estimate(dirty: &[PageRange], sample: &[PageRange], scanned: Option<&[PageRange]>, total: u64) -> u64 {
    let Some(scanned) = scanned else { return count_pages(dirty) };
    let unscanned = complement(scanned, total);
    let found_outside = overlap(dirty, &unscanned);
    let found = count_pages(dirty) - found_outside;
    let sampled = count_pages(sample);
    let share = if sampled == 0 { 0.0 } else { overlap(dirty, sample) as f64 / sampled as f64 };
    let extrapolated = (share * count_pages(&unscanned) as f64) as u64;
    (found + extrapolated.max(found_outside)).min(total)
}

/// Auto-converge: the throttle after a round, if it must rise. `ratio` is
/// how long the next round would take (the pages dirtied meanwhile)
/// against the time they were dirtied in (scan to scan, the round just
/// sent). Above 1/2 the rounds shrink too slowly, or grow: the vCPUs slow
/// a step (`throttle_initial`, then `throttle_increment` more, as QEMU's
/// cpu-throttle), or at once to the level at which the guest's dirtying,
/// scaled by the vCPU share it keeps, would make the ratio 1/2 (as
/// VMware's SDPS matches the guest to the link), whichever is more. One round decides: each is measured, and the first pass, the
/// longest, counts too (QEMU waits for two rounds after it).
fn converge_step(throttle: u8, ratio: f64, params: &Params) -> Option<u8> {
    if ratio <= 0.5 || throttle >= 99 {
        return None;
    }
    let step = if throttle == 0 { params.throttle_initial } else { throttle.saturating_add(params.throttle_increment) };
    let share = f64::from(100 - throttle) / 100.0;
    let matched = (100.0 * (1.0 - 0.5 * share / ratio)).ceil() as u8;
    Some(step.max(matched).min(99))
}

/// Wait for the destination to have applied `round` on every channel.
/// Meanwhile, with several links, a channel whose link died is dropped
/// (the destination then leaves it out of the round).
fn wait_round_done(link: &mut Link, round: u64, ctl: &Control, deadline: Option<Instant>) -> Result<()> {
    let t = Instant::now();
    let control = &mut link.control;
    loop {
        link.channels.check_links()?;
        // Wait for readability first: a read timeout could cut a frame.
        if control.wait_readable(Duration::from_millis(100)) {
            control.set_read_timeout(Some(Duration::from_secs(30)))?;
            match wire::recv_msg(control).map_err(|e| anyhow!("destination: {e}"))? {
                Msg::RoundDone { round: r } if r == round => {
                    link.channels.confirmed();
                    return Ok(());
                }
                Msg::RoundDone { .. } => continue,
                Msg::EarlyBuilt => link.early_pending = None,
                Msg::Abort { reason } => bail!("destination refused: {reason}"),
                other => bail!("destination sent {other:?} during round {round}"),
            }
        }
        if ctl.is_cancelled() {
            bail!("cancelled");
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            ctl.cancel();
            bail!("timed out waiting for the destination to apply round {round}");
        }
        if t.elapsed() > Duration::from_secs(120) {
            bail!("destination did not confirm round {round} within 120 s");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A precopy round's facts: fits the downtime unless changed.
    fn facts() -> RoundFacts {
        RoundFacts {
            mode: Mode::Precopy,
            est_s: 0.1,
            target_s: 0.3,
            rest_pending: false,
            was_cut: false,
            timed_out: false,
            postcopy_requested: false,
            written: 0,
            first_round_pages: 1000,
        }
    }

    #[test]
    fn precopy_stops_and_copies_once_the_rest_fits_the_downtime() {
        assert_eq!(next_step(&facts()), NextStep::StopAndCopy);
        assert_eq!(next_step(&RoundFacts { est_s: 0.3, ..facts() }), NextStep::StopAndCopy, "exactly the target fits");
        assert_eq!(next_step(&RoundFacts { est_s: 0.5, ..facts() }), NextStep::AnotherRound);
        // Past the timeout it still copies if the rest fits, else gives up.
        assert_eq!(next_step(&RoundFacts { timed_out: true, ..facts() }), NextStep::StopAndCopy);
        assert_eq!(next_step(&RoundFacts { timed_out: true, est_s: 0.5, ..facts() }), NextStep::GiveUp);
        // A postcopy request means nothing to precopy.
        assert_eq!(next_step(&RoundFacts { postcopy_requested: true, est_s: 0.5, ..facts() }), NextStep::AnotherRound);
    }

    #[test]
    fn hybrid_switches_when_the_pass_is_over_and_the_rest_does_not_fit() {
        let hybrid = RoundFacts { mode: Mode::Hybrid, ..facts() };
        assert_eq!(next_step(&hybrid), NextStep::StopAndCopy, "converged like precopy");
        assert_eq!(next_step(&RoundFacts { est_s: 0.5, ..hybrid }), NextStep::SwitchToPostcopy);
        // Past its deadline it switches even if the rest fits: its
        // stop-and-copy would be cancelled.
        assert_eq!(next_step(&RoundFacts { timed_out: true, ..hybrid }), NextStep::SwitchToPostcopy);
        // A round cut short, or the operator's request, switches.
        assert_eq!(next_step(&RoundFacts { was_cut: true, ..hybrid }), NextStep::SwitchToPostcopy);
        assert_eq!(next_step(&RoundFacts { postcopy_requested: true, est_s: 0.5, ..hybrid }), NextStep::SwitchToPostcopy);
    }

    #[test]
    fn hybrid_switches_after_the_first_eighth_only_for_a_busy_guest() {
        // The rest of the first pass is still to send: it is sent next
        // unless the guest wrote a quarter of what the first round sent.
        let eighth = RoundFacts { mode: Mode::Hybrid, rest_pending: true, est_s: 0.5, ..facts() };
        assert_eq!(next_step(&RoundFacts { written: 249, ..eighth }), NextStep::AnotherRound);
        assert_eq!(next_step(&RoundFacts { written: 250, ..eighth }), NextStep::SwitchToPostcopy);
        // Even a tiny rest that fits waits for the pass to end.
        assert_eq!(next_step(&RoundFacts { est_s: 0.0, ..eighth }), NextStep::AnotherRound);
        assert_eq!(next_step(&RoundFacts { postcopy_requested: true, ..eighth }), NextStep::SwitchToPostcopy);
    }

    #[test]
    fn link_rate_needs_a_round_that_moved_enough() {
        assert_eq!(link_rate(100 << 20, 0.5, 0), (200 << 20) as f64);
        // Zero runs only: a few KiB in seconds say nothing about the link.
        assert_eq!(link_rate(4096, 2.0, 0), ASSUMED_RATE);
        assert_eq!(link_rate(4096, 2.0, 10_000_000), 10e6);
        assert_eq!(link_rate(0, 0.0, 0), ASSUMED_RATE);
    }

    #[test]
    fn rate_sample_takes_an_item_in_eight_and_scales_to_ram() {
        let mut items = Vec::new();
        chunk(&[PageRange { first: 0, count: 100 * CHUNK_PAGES + 7 }], CHUNK_PAGES, false, &mut items);
        chunk(&[PageRange { first: 100 * CHUNK_PAGES + 7, count: 1 << 20 }], ZERO_CHUNK_PAGES, true, &mut items);
        let total = 100 * CHUNK_PAGES + 7 + (1 << 20);
        let s = mark_rate_sample(&mut items);
        assert_eq!(s.len(), 13, "one per eight data items, the short last eight too");
        assert!(items.iter().all(|w| !(w.armed && w.known_zero)), "holes are not sampled");
        assert_eq!(items.iter().filter(|w| w.armed).count(), 13);
        let places: std::collections::HashSet<u64> = s.iter().take(8).map(|r| r.first / CHUNK_PAGES % 8).collect();
        assert_eq!(places.len(), 8, "every place in the eight is sampled");

        // The scans after the first eighth look at the eighth, the sample
        // and the holes.
        let data_pages = 100 * CHUNK_PAGES + 7;
        let holes = [PageRange { first: data_pages, count: 1 << 20 }];
        let scanned = rate_scan_part(Some(8 * CHUNK_PAGES), &s, &holes, total).unwrap();
        let unscanned_data = data_pages - overlap(&[PageRange { first: 0, count: data_pages }], &scanned);
        // Every sampled page written: all the data not looked at.
        assert_eq!(written_estimate(&s, &s, Some(&scanned), total), count_pages(&s) + unscanned_data);
        // Half of each sample: about half of it.
        let half: Vec<PageRange> = s.iter().map(|r| PageRange { first: r.first, count: r.count / 2 }).collect();
        let est = written_estimate(&half, &s, Some(&scanned), total);
        assert!(est.abs_diff((count_pages(&s) + unscanned_data) / 2) < data_pages / 50, "{est}");
        // Writes into holes count page by page, beside the sample's share.
        let fresh = PageRange { first: data_pages + 5000, count: 3000 };
        assert_eq!(written_estimate(&[fresh], &s, Some(&scanned), total), 3000);
        let both = normalize([half.clone(), vec![fresh]].concat(), total);
        assert_eq!(written_estimate(&both, &s, Some(&scanned), total), est + 3000);
        // Writes the sample missed are still counted: in the eighth, or
        // found outside the scan by another dirty source.
        let low = vec![PageRange { first: 0, count: 3 }];
        assert_eq!(written_estimate(&low, &s, Some(&scanned), total), 3);
        let outside = complement(&scanned, total)[0];
        let other = vec![PageRange { first: outside.first, count: 2 }];
        assert_eq!(written_estimate(&other, &s, Some(&scanned), total), 2);
        // All of RAM scanned: what it found.
        assert_eq!(written_estimate(&both, &s, None, total), count_pages(&both));
    }

    #[test]
    fn rate_scan_looks_at_every_hole_and_the_switch_does_not() {
        let r = |first, count| PageRange { first, count };
        let sample = [r(300, 10), r(900, 10)];
        let holes = [r(100, 50), r(500, 200)];
        assert_eq!(rate_scan_part(Some(120), &sample, &holes, 1000), Some(vec![r(0, 150), r(300, 10), r(500, 200), r(900, 10)]));
        assert_eq!(armed_part(Some(120), &sample, 1000), Some(vec![r(0, 120), r(300, 10), r(900, 10)]));
        assert_eq!(rate_scan_part(None, &sample, &holes, 1000), None, "all of RAM is armed");
    }

    #[test]
    fn converge_steps_and_matches_the_dirty_rate() {
        let p = Params::default();
        // Rounds that halve, or better, need no throttle.
        assert_eq!(converge_step(0, 0.5, &p), None);
        assert_eq!(converge_step(30, 0.2, &p), None);
        // Slightly too fast: the first step.
        assert_eq!(converge_step(0, 0.55, &p), Some(p.throttle_initial));
        // The next round as long as this one: half the vCPU makes it half.
        assert_eq!(converge_step(0, 1.0, &p), Some(50));
        // Already at 50 %, still as long: the guest keeps a quarter.
        assert_eq!(converge_step(50, 1.0, &p), Some(75));
        // Close to matched: one increment.
        assert_eq!(converge_step(40, 0.6, &p), Some(50));
        // Never past 99 %, and no step from there.
        assert_eq!(converge_step(90, 40.0, &p), Some(99));
        assert_eq!(converge_step(99, 40.0, &p), None);
    }
}
