//! The incoming side. The VM stays paused, and never runs, unless every
//! channel ended cleanly, the page counts match what the source sent, every
//! page of RAM arrived at least once, and the state loaded.

use crate::compress::Compress;
use crate::control_conn::ControlConn;
use crate::cputime::{thread_cpu_s, unix_ns};
use crate::dirty::PAGE_SIZE;
use crate::pages::{AtomicBitmap, PageRange};
use crate::place::Alias;
use crate::postcopy::clients::{RamClients, RNICD_CLIENT};
use crate::postcopy::dest::PageSource;
use crate::stats::{Control, Mode, Status};
use crate::vm::MigratableVm;
use crate::wire::{self, Msg, WireError};
use anyhow::{anyhow, bail, Context, Result};
use snapshot::StateSet;
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::acceptor::Acceptor;
use crate::receiver::{accept_channels, drop_channel, receive_channel, RoundBarrier, RxShared, Suspects};
pub use crate::receiver::{listen, IncomingParams, Prealloc};
pub use crate::wire::DATA_IDLE_TIMEOUT;

/// Receive one migration on `listener` into the paused `vm`.
pub fn run(
    vm: Arc<dyn MigratableVm>,
    listener: TcpListener,
    params: &IncomingParams,
    ctl: Arc<Control>,
    clients: Option<Arc<RamClients>>,
) -> Result<bool> {
    let t0 = Instant::now();
    let cpu0 = thread_cpu_s();
    ctl.update(|s| {
        s.status = Status::Setup;
        s.role = "incoming".into();
        s.peer = listener.local_addr().map(|a| a.to_string()).unwrap_or_default();
    });
    let mut control: Option<ControlConn> = None;
    let mut started = t0;
    // Every step takes its connections from it; what it holds still is
    // closed when the migration ends.
    let acceptor = Acceptor::new(listener);
    let r = run_inner(&vm, &acceptor, params, &ctl, &mut control, &mut started, clients);
    if let Err(e) = &r {
        if let Some(c) = control.as_mut() {
            let _ = wire::send_msg(c, &Msg::Abort { reason: format!("{e:#}") });
            c.close();
        }
        ctl.shutdown_all();
        // Devices built ahead from an early section (nothing once the
        // state was restored: the VM holds what was built).
        vm.discard_prepared();
    }
    let cpu = thread_cpu_s() - cpu0;
    ctl.update(|s| {
        // From the source's connection on, not from when we began to listen.
        s.ended_unix_ms = Some(crate::cputime::unix_ns() as f64 / 1e6);
        s.total_ms = started.elapsed().as_secs_f64() * 1e3;
        s.cpu_s_dest = Some(s.cpu_s_dest.unwrap_or(0.0) + cpu);
        let secs = (s.total_ms - s.setup_ms) / 1e3;
        if secs > 0.0 {
            s.throughput_gbps = s.wire_bytes as f64 * 8.0 / secs / 1e9;
        }
        match &r {
            Ok(_) => s.status = Status::Completed,
            Err(e) => {
                s.status = if ctl.is_cancelled() { Status::Cancelled } else { Status::Failed };
                s.error = Some(format!("{e:#}"));
            }
        }
    });
    r
}

/// The phases of an incoming migration, each its own function as in QEMU's
/// migration incoming path: the handshake, the channels and their threads,
/// then either the postcopy hand-over at a switch, or the end of the stream
/// checked, the state loaded and the VM started on the source's go.
fn run_inner(
    vm: &Arc<dyn MigratableVm>,
    acceptor: &Acceptor,
    params: &IncomingParams,
    ctl: &Arc<Control>,
    control_out: &mut Option<ControlConn>,
    t0: &mut Instant,
    clients: Option<Arc<RamClients>>,
) -> Result<bool> {
    let ram = vm.ram();
    // Pages that may hold non-zero bytes: what has data before prealloc
    // allocates the rest, zero-filled (a zero record needs no write there).
    let data_before = ram.data_ranges()?;
    // From the moment we listen; stopped when the migration ends.
    let prealloc = if params.prealloc { Some(Prealloc::start(ram)?) } else { None };
    let timeout = (params.accept_timeout_s > 0).then(|| Duration::from_secs(params.accept_timeout_s));
    let mut control = acceptor.accept(ctl, timeout)?;
    *t0 = Instant::now();
    *control_out = Some(ControlConn::new(vec![control.try_clone()?], ctl)?);
    let hello = handshake(vm, &mut control, ctl, clients.as_deref())?;
    let conns = ControlConn::accept_spares(control, acceptor, hello.session, hello.spare_controls, ctl)?;
    let mut control = ControlConn::new(conns, ctl)?;
    *control_out = Some(control.clone());
    let (sh, threads, urgent) = start_channels(vm, acceptor, &control, &hello, data_before, prealloc.as_ref(), &params.rnicd, ctl, *t0)?;

    // The source pauses the VM only once we can take the switch at once:
    // setup here must not count as downtime.
    let armed = if hello.mode == Mode::Postcopy {
        let a = crate::postcopy::dest::arm(&sh)?;
        wire::send_msg(&mut control, &Msg::Ready)?;
        Some(a)
    } else {
        None
    };
    // The control connection is quiet until the source's End; a failing
    // channel shuts it down, which ends this read too.
    control.set_read_timeout(None)?;
    // The source's End or Switchover starts the downtime: be there at once.
    crate::priority::set_priority(true);
    let end = recv_end(vm, &mut control, &sh, ctl, *t0, hello.mode != Mode::Precopy);
    if let Ok(Msg::Switchover { state_bytes, source_paused_unix_ns, dirty_ranges, device_pages }) = &end {
        let sw = crate::postcopy::dest::Switch {
            state_bytes: *state_bytes,
            source_paused: *source_paused_unix_ns,
            dirty_ranges: *dirty_ranges,
            device_pages: crate::postcopy::device::from_wire(device_pages, sh.total)?,
        };
        let pages = urgent.ok_or_else(|| anyhow!("postcopy without an urgent connection"))?;
        return crate::postcopy::dest::run(vm, acceptor, params, ctl, control, sh, threads, pages, hello.session, sw, clients, armed);
    }
    let downtime = Steps { since: Instant::now(), ctl };
    if end.is_err() {
        ctl.shutdown_all();
    }
    let stream = end_of_stream(threads, end, sh.barrier.gone())?;
    downtime.step("channels joined");
    check_every_page(&sh)?;
    let state = load_state(vm, &mut control, &stream, ctl)?;
    downtime.step("state received");
    vm.restore_state(&state).context("loading vCPU and device state")?;
    downtime.step("state restored");
    resume_on_go(vm, params, &mut control, &stream, &downtime, ctl)
}

/// What the source's hello asked for, checked against this VM.
struct Hello {
    session: u64,
    channels: usize,
    compress: Compress,
    mode: Mode,
    /// The rdma transport (queue pairs) rather than TCP data connections.
    rdma: bool,
    /// Control connections that follow on the other links.
    spare_controls: usize,
}

/// `TRANSIT_NO_EARLY_STATE=1`: this destination answers as a build without
/// early device sections does (the source then sends the whole device
/// state at the switch), to test a migration between such builds.
const NO_EARLY_STATE_ENV: &str = "TRANSIT_NO_EARLY_STATE";

/// Whether this destination offers to build the devices' early sections.
fn builds_early_state() -> bool {
    std::env::var(NO_EARLY_STATE_ENV).map_or(true, |v| v != "1")
}

/// The control connection's preamble and hello, answered with a welcome.
fn handshake(vm: &Arc<dyn MigratableVm>, control: &mut TcpStream, ctl: &Control, clients: Option<&RamClients>) -> Result<Hello> {
    let ram = vm.ram();
    control.set_read_timeout(Some(Duration::from_secs(30)))?;
    let role = match wire::read_preamble(control) {
        Ok(r) => r,
        Err(e) => {
            // Answer in our own version so that an older or newer source
            // prints the reason rather than a bare disconnect.
            let _ = wire::write_preamble(control, wire::VERSION, wire::ROLE_CONTROL);
            return Err(anyhow!("source stream: {e}"));
        }
    };
    if role != wire::ROLE_CONTROL {
        bail!("first connection is not a control connection");
    }
    let hello = match wire::recv_msg(control)? {
        Msg::Hello { session, shape, ram_bytes, page_size, channels, compress, mode, transport, spare_controls, early_state } => {
            let mine = vm.shape();
            if shape != mine {
                bail!("VM shape differs: source {shape:?}, destination {mine:?}");
            }
            if ram_bytes != ram.len || page_size != PAGE_SIZE {
                bail!("RAM differs: source {ram_bytes} bytes in {page_size}-byte pages, here {} in {PAGE_SIZE}", ram.len);
            }
            if mode == "recover" {
                bail!("nothing to recover here: this destination has no paused postcopy migration");
            }
            let mode: Mode =
                mode.parse().map_err(|e: String| anyhow!("migration mode {mode:?} is not supported by this destination: {e}"))?;
            if !(1..=64).contains(&channels) {
                bail!("{channels} channels is out of range");
            }
            let compress: Compress = compress.parse().map_err(|e: String| anyhow!(e))?;
            let rdma = match transport.as_str() {
                "" | "tcp" => false,
                "rdma" if mode != Mode::Precopy && clients.is_some_and(|c| c.has(RNICD_CLIENT)) => bail!(
                    "{mode} over the rdma transport is not possible for a VM whose rnicd is a RAM client (PVRDMA): rnicd would write the pages it READs through its own mapping of guest RAM, which waits for those very pages; migrate it over tcp"
                ),
                "rdma" => true,
                other => bail!("transport {other:?} is not supported by this destination"),
            };
            if spare_controls > 7 {
                bail!("{spare_controls} spare control connections is out of range (links: at most 8)");
            }
            let early = early_state && builds_early_state();
            if early_state && !early {
                tracing::info!("{NO_EARLY_STATE_ENV}=1: no early device sections; the source sends the whole device state at the switch");
            }
            (Hello { session, channels: channels as usize, compress, mode, rdma, spare_controls: spare_controls as usize }, early)
        }
        other => bail!("expected hello, got {other:?}"),
    };
    let (hello, early) = hello;
    wire::send_msg(control, if early { &Msg::WelcomeEarlyState } else { &Msg::Welcome })?;
    ctl.update(|s| {
        s.channels = hello.channels as u32;
        s.transport = if hello.rdma { "rdma" } else { "tcp" }.into();
        s.compress = hello.compress.to_string();
        s.ram_bytes = ram.len;
        s.total_pages = ram.pages();
        s.mode = hello.mode.to_string();
    });
    Ok(hello)
}

type ChannelThreads = Vec<std::thread::JoinHandle<Result<(u64, f64)>>>;

/// The data connections (and the urgent one), and a receiving thread on
/// each, sharing one [`RxShared`].
#[allow(clippy::too_many_arguments)]
fn start_channels(
    vm: &Arc<dyn MigratableVm>,
    acceptor: &Acceptor,
    control: &ControlConn,
    hello: &Hello,
    data_before: Vec<PageRange>,
    prealloc: Option<&Prealloc>,
    rnicd: &str,
    ctl: &Arc<Control>,
    t0: Instant,
) -> Result<(Arc<RxShared>, ChannelThreads, Option<PageSource>)> {
    let ram = vm.ram();
    let total = ram.pages();
    let mode = hello.mode;
    let (streams, urgent, rdma) = if hello.rdma {
        let rxs = crate::rdma::accept_channels(control, rnicd, &ram, hello.channels)?;
        // Postcopy and hybrid: the queue pairs this side READs pages through.
        let reads = match mode {
            Mode::Precopy => None,
            _ => Some(PageSource::Reads(crate::rdma::accept_reader(control, rnicd, &ram)?)),
        };
        (Vec::new(), reads, rxs)
    } else {
        // Postcopy and hybrid: an urgent connection per link.
        let urgents = if mode == Mode::Precopy { 0 } else { hello.spare_controls + 1 };
        let (s, u) = accept_channels(acceptor, ctl, hello.session, hello.channels, urgents)?;
        (s, (urgents > 0).then_some(PageSource::Urgent(u)), Vec::new())
    };
    ctl.update(|s| {
        s.status = Status::Active;
        s.setup_ms = t0.elapsed().as_secs_f64() * 1e3;
    });
    let maybe_nonzero = AtomicBitmap::new(total);
    for r in data_before {
        maybe_nonzero.set_range(r);
    }
    // A hybrid receives its precopy rounds through an alias (see RxShared);
    // a preallocated destination receives through its populated one. A
    // postcopy places its pages through one, in which the devices' pages
    // are allocated ahead of the switch (`populate_device_pages`).
    let alias = match prealloc.map(Prealloc::alias) {
        Some(a) => Some(a),
        None if mode != Mode::Precopy => Some(Arc::new(Alias::map(&ram).context("mapping guest RAM for receiving")?)),
        None => None,
    };
    let sh = Arc::new(RxShared {
        ram,
        total,
        maybe_nonzero: Arc::new(maybe_nonzero),
        alias,
        precopy_rounds: mode == Mode::Hybrid,
        seen: Arc::new(AtomicBitmap::new(total)),
        suspect: Suspects::new(total),
        placer: OnceLock::new(),
        barrier: RoundBarrier::new(hello.channels),
        acks: Mutex::new(control.try_clone()?),
        data_socks: streams.iter().map(TcpStream::try_clone).collect::<std::io::Result<_>>()?,
        ctl: ctl.clone(),
    });
    let mut threads: ChannelThreads = streams
        .into_iter()
        .enumerate()
        .map(|(i, s)| {
            let sh = sh.clone();
            std::thread::Builder::new().name(format!("migrate-rx{i}")).spawn(move || receive_channel(i, s, sh))
        })
        .collect::<std::io::Result<_>>()?;
    for (i, rx) in rdma.into_iter().enumerate() {
        let sh = sh.clone();
        threads.push(std::thread::Builder::new().name(format!("migrate-rx{i}")).spawn(move || crate::rdma::receive_channel(i, rx, sh))?);
    }
    Ok((sh, threads, urgent))
}

/// Downtime steps, in ms since the source's End arrived.
struct Steps<'a> {
    since: Instant,
    ctl: &'a Control,
}

impl Steps<'_> {
    fn step(&self, name: &str) {
        let ms = self.since.elapsed().as_secs_f64() * 1e3;
        self.ctl.update(|s| s.downtime_steps.push((name.to_string(), ms)));
    }
}

/// What the source's End announced, checked against what arrived.
struct StreamEnd {
    rounds: u64,
    state_bytes: u64,
    ram_hashes: bool,
    source_paused: u64,
    /// CPU seconds the receiving threads used.
    cpu: f64,
}

/// The source's next message after the channels started (its End or
/// Switchover); meanwhile, with several links, it may report channels lost
/// with their link, which stop here (see [`drop_channel`]), and it sends
/// the devices' early state, built here while the rounds run.
/// `postcopy`: the migration may switch to postcopy (postcopy, hybrid).
fn recv_end(
    vm: &Arc<dyn MigratableVm>,
    control: &mut ControlConn,
    sh: &RxShared,
    ctl: &Control,
    t0: Instant,
    postcopy: bool,
) -> Result<Msg, WireError> {
    loop {
        match wire::recv_msg(control)? {
            Msg::ChannelLost { index } => drop_channel(sh, index as usize).map_err(|e| WireError::Corrupt(format!("{e:#}")))?,
            Msg::EarlyState { state_bytes } => {
                prepare_early(vm, control, state_bytes, ctl, t0).map_err(|e| WireError::Corrupt(format!("{e:#}")))?;
                if let Some(alias) = sh.alias.as_ref().filter(|_| postcopy) {
                    populate_device_pages(vm, alias, sh.total, ctl, t0);
                }
                // Through the acknowledgements' lock: the channels send
                // their RoundDone on the same connection.
                wire::send_msg(&mut *sh.acks.lock().unwrap(), &Msg::EarlyBuilt)?;
            }
            m => return Ok(m),
        }
    }
}

/// A destination that may switch to postcopy: allocate the pages the
/// devices will reach (`MigratableVm::device_pages_ahead`) in guest RAM's
/// memfd, mapped in the `alias` the switch places pages through, while
/// the VM still runs on the source. They cross inside the switch
/// (`postcopy::device`), and placing a page there that is not allocated
/// yet cost about 9 us (a fault, the allocation, zeroing), where a copy
/// into an allocated and mapped page is a fraction of that. The pages
/// stay zero and unmapped in the vmm, so faults still catch every access
/// until each is placed.
fn populate_device_pages(vm: &Arc<dyn MigratableVm>, alias: &Alias, total: u64, ctl: &Control, t0: Instant) {
    let pages = crate::pages::normalize(vm.device_pages_ahead(), total);
    if pages.is_empty() {
        return;
    }
    for r in &pages {
        // SAFETY: inside the alias mapping (normalized to guest RAM);
        // populating never changes page contents.
        let at = unsafe { alias.base.add((r.first * PAGE_SIZE) as usize) };
        if unsafe { libc::madvise(at as *mut libc::c_void, (r.count * PAGE_SIZE) as usize, libc::MADV_POPULATE_WRITE) } != 0 {
            tracing::debug!("the devices' pages not allocated ahead: {}", std::io::Error::last_os_error());
            return;
        }
    }
    let n = crate::pages::count_pages(&pages);
    ctl.update(|s| s.setup_steps.push((format!("{n} device pages allocated"), t0.elapsed().as_secs_f64() * 1e3)));
}

/// The early state's blob, decoded and built (`MigratableVm::prepare_state`).
/// Building ahead only saves downtime: the state at the switch names every
/// object, so a device that cannot build its early section (another GID,
/// an ID taken) builds nothing now and takes or refuses the whole state
/// at the switch, where the source hears why.
fn prepare_early(vm: &Arc<dyn MigratableVm>, control: &mut ControlConn, state_bytes: u64, ctl: &Control, t0: Instant) -> Result<()> {
    let blob = wire::recv_blob(control).map_err(|e| anyhow!("early device state: {e}"))?;
    if blob.len() as u64 != state_bytes {
        bail!("early device state is {} bytes, source announced {state_bytes}", blob.len());
    }
    let early = StateSet::read_from(&mut blob.as_slice()).context("decoding the early device state")?;
    let step = match vm.prepare_state(&early) {
        Ok(()) => "early device state built".to_string(),
        Err(e) => {
            tracing::warn!("the early device state was not built ahead (the switch builds it): {e:#}");
            vm.discard_prepared();
            format!("early device state not built: {e:#}")
        }
    };
    ctl.update(|s| {
        s.early_state_bytes = state_bytes;
        s.setup_steps.push((step, t0.elapsed().as_secs_f64() * 1e3));
    });
    Ok(())
}

/// The channels' threads joined and the End checked: every page the
/// source counted arrived (on the channels not lost: `gone`, a bit per
/// channel; their pages came again on others).
fn end_of_stream(threads: ChannelThreads, end: Result<Msg, WireError>, gone: u64) -> Result<StreamEnd> {
    let results: Vec<_> = threads.into_iter().map(|t| t.join().unwrap_or_else(|_| Err(anyhow!("channel thread panicked")))).collect();
    let mut per_channel = Vec::new();
    let mut cpu = 0.0;
    for (i, r) in results.into_iter().enumerate() {
        let (p, c) = r.with_context(|| format!("data channel {i}"))?;
        per_channel.push(p);
        cpu += c;
    }
    let (claimed, stream) = match end.map_err(|e| anyhow!("control connection: {e}"))? {
        Msg::End { pages_per_channel, rounds, state_bytes, ram_hashes, source_paused_unix_ns } => {
            (pages_per_channel, StreamEnd { rounds, state_bytes, ram_hashes, source_paused: source_paused_unix_ns, cpu })
        }
        Msg::Abort { reason } => bail!("source aborted: {reason}"),
        other => bail!("expected end of stream, got {other:?}"),
    };
    let lost = |i: usize| i < 64 && gone & (1u64 << i) != 0;
    let kept = |v: &[u64]| v.iter().enumerate().filter(|&(i, _)| !lost(i)).map(|(_, &p)| p).collect::<Vec<_>>();
    if claimed.len() != per_channel.len() || kept(&claimed) != kept(&per_channel) {
        bail!("incomplete stream: source sent {claimed:?} pages per channel, {per_channel:?} arrived");
    }
    Ok(stream)
}

/// Every page of RAM arrived at least once, and none is left damaged.
fn check_every_page(sh: &RxShared) -> Result<()> {
    let total = sh.total;
    let seen = sh.seen.count_ones();
    if seen != total {
        bail!("incomplete stream: {} of {total} pages never arrived", total - seen);
    }
    sh.suspect.verify()?;
    Ok(())
}

/// The state blob, and with `verify_ram` the source's page hashes checked
/// against RAM here.
fn load_state(vm: &Arc<dyn MigratableVm>, control: &mut ControlConn, stream: &StreamEnd, ctl: &Control) -> Result<StateSet> {
    let state_bytes = stream.state_bytes;
    control.set_read_timeout(Some(Duration::from_secs(60)))?;
    let blob = wire::recv_blob(control).map_err(|e| anyhow!("state: {e}"))?;
    if blob.len() as u64 != state_bytes {
        bail!("state is {} bytes, source announced {state_bytes}", blob.len());
    }
    let state = StateSet::read_from(&mut blob.as_slice()).context("decoding vCPU and device state")?;
    if stream.ram_hashes {
        let theirs = wire::recv_blob(control).map_err(|e| anyhow!("RAM hashes: {e}"))?;
        let mine = crate::vm::page_hashes(&vm.ram());
        if theirs.len() != mine.len() * 8 {
            bail!("RAM hashes: {} bytes for {} pages", theirs.len(), mine.len());
        }
        let bad: Vec<usize> =
            (0..mine.len()).filter(|&i| u64::from_le_bytes(theirs[i * 8..i * 8 + 8].try_into().unwrap()) != mine[i]).collect();
        if !bad.is_empty() {
            bail!("RAM differs from the source in {} pages (first: {:?})", bad.len(), &bad[..bad.len().min(8)]);
        }
        ctl.update(|s| s.verified_pages = mine.len() as u64);
    }
    Ok(state)
}

/// Tell the source the VM is loaded; on its go the VM runs here.
fn resume_on_go(
    vm: &Arc<dyn MigratableVm>,
    params: &IncomingParams,
    control: &mut ControlConn,
    stream: &StreamEnd,
    downtime: &Steps,
    ctl: &Control,
) -> Result<bool> {
    let cpu = stream.cpu;
    ctl.update(|s| {
        s.rounds = stream.rounds;
        s.state_bytes = stream.state_bytes;
        s.status = Status::Device;
        s.cpu_s_dest = Some(cpu);
    });
    wire::send_msg(control, &Msg::Loaded { cpu_s: cpu })?;
    match wire::recv_msg(control).map_err(|e| anyhow!("waiting for the source's go: {e}"))? {
        Msg::Go => {}
        other => bail!("expected go, got {other:?}"),
    }
    downtime.step("go received");
    let resumed = params.resume;
    if resumed {
        vm.resume().context("starting the VM")?;
    }
    downtime.step("resumed");
    let t = unix_ns();
    let _ = wire::send_msg(control, &Msg::Resumed { unix_ns: t, resumed, cpu_s: cpu });
    // The last message: it must survive a link that dies before the
    // source read it.
    control.finish();
    if resumed {
        // Same figure as the source's, so it survives a source that exits.
        ctl.update(|s| s.downtime_ms = Some(t.saturating_sub(stream.source_paused) as f64 / 1e6));
    }
    Ok(resumed)
}
