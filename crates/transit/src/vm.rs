//! `transit vm ...`: run a VM (the vmm process) and control it.

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use migration::qmp::{MigrationSlot, Outcome};
use migration::stats::Status;
use migration::vm::MigratableVm;
use serde_json::{json, Value};
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;
use vmm::control::{Client, Control, ProcessRequest};
use vmm::{RunState, Vm, VmConfig};

pub mod migrate;

/// Control commands served by the migration engine.
const MIGRATION_COMMANDS: &[&str] = &[
    "migrate",
    "migrate-incoming",
    "query-migrate",
    "migrate-cancel",
    "migrate-set-parameters",
    "query-migrate-parameters",
    "migrate-start-postcopy",
    "migrate-recover",
];

#[derive(Subcommand)]
pub enum VmCmd {
    /// Start a VM in this process (it runs until `quit`, guest exit or SIGTERM).
    Run(RunArgs),
    /// Start a VM from a save file written by `transit vm save`.
    Restore(RestoreArgs),
    /// Show the run state, guest progress and vCPU status.
    Status(Target),
    /// Pause the vCPUs.
    Stop(Target),
    /// Resume the vCPUs.
    Cont(Target),
    /// Stop the VM process.
    Quit(Target),
    /// Write the VM (paused first) to a save file.
    Save {
        #[command(flatten)]
        target: Target,
        /// Save file to write.
        file: PathBuf,
    },
    /// Print the last lines the guest wrote to its console.
    Console(Target),
    /// Live-migrate a running VM to a destination waiting with `--incoming`
    /// or `migrate-incoming`.
    Migrate(migrate::MigrateArgs),
    /// Make a VM started with `--incoming` (or any paused, never-run VM)
    /// wait for an incoming migration.
    MigrateIncoming(migrate::MigrateIncomingArgs),
    /// Destination of a postcopy paused by a broken connection: listen on a
    /// new address for the source's `migrate --resume`.
    MigrateRecover(migrate::MigrateRecoverArgs),
    /// Source of a hybrid migration: switch to postcopy now.
    MigrateStartPostcopy(Target),
    /// Set migration parameters (the next migration's; the bandwidth cap
    /// and the downtime target also a running outgoing migration's).
    MigrateSetParameters(migrate::MigrateSetArgs),
    /// The guest's out-of-band channel: print the guest's message (waiting
    /// for one with --wait), or write the host's message with --write (a
    /// file's contents, or `-` for stdin).
    Mailbox {
        #[command(flatten)]
        target: Target,
        /// Write this file's contents (`-`: stdin) as the host's message.
        #[arg(long, value_name = "FILE")]
        write: Option<PathBuf>,
        /// Wait up to this many seconds for the guest to publish a message.
        #[arg(long, default_value_t = 0.0)]
        wait: f64,
    },
    /// Send any control command, e.g. `transit vm cmd query-status` or
    /// `transit vm cmd pmemsave '{"val":0,"size":4096,"filename":"/tmp/p"}'`.
    Cmd {
        #[command(flatten)]
        target: Target,
        command: String,
        /// Arguments as a JSON object.
        #[arg(default_value = "{}")]
        arguments: String,
    },
}

/// Which VM to talk to.
#[derive(Args, Clone)]
pub struct Target {
    /// VM name; its control socket is /run/transit/NAME.sock.
    #[arg(long, default_value = "vm0")]
    pub name: String,
    /// Control socket path (overrides --name).
    #[arg(long)]
    pub control: Option<PathBuf>,
}

impl Target {
    pub fn socket(&self) -> PathBuf {
        self.control.clone().unwrap_or_else(|| default_socket(&self.name))
    }
    pub fn client(&self) -> Result<Client> {
        Client::connect(&self.socket())
    }
}

pub fn default_socket(name: &str) -> PathBuf {
    PathBuf::from(format!("/run/transit/{name}.sock"))
}

#[derive(Args)]
pub struct RunArgs {
    /// VM name (letters, digits, '-', '_').
    #[arg(long, default_value = "vm0")]
    pub name: String,
    /// Guest RAM, e.g. 256M or 4G (a multiple of 2 MiB, at least 16M).
    #[arg(long, default_value = "256M")]
    pub memory: String,
    #[arg(long, default_value_t = 1)]
    pub vcpus: u32,
    /// Guest firmware ELF (default: the one built with this binary).
    #[arg(long)]
    pub firmware: Option<PathBuf>,
    /// Workload for the built-in firmware: idle, dirtier, fill, selftest, nvme-verify, nvme-perf.
    #[arg(long, default_value = "idle")]
    pub workload: String,
    /// Extra firmware command-line words, e.g. "rate=25000 start=8M".
    #[arg(long, default_value = "")]
    pub args: String,
    /// NVMe controller spec (repeatable), e.g. name=nvme0,ns=mem:64M.
    #[arg(long)]
    pub nvme: Vec<String>,
    /// PVRDMA device spec (repeatable): gid=10.200.0.50[,rnicd=SOCK][,name=N];
    /// the VM is the RDMA namespace of that GID on the host's rnicd.
    #[arg(long)]
    pub pvrdma: Vec<String>,
    /// Control socket path (default /run/transit/NAME.sock).
    #[arg(long)]
    pub control: Option<PathBuf>,
    /// Do not start the vCPUs; wait for `cont`.
    #[arg(long, short = 'S')]
    pub paused: bool,
    /// Append guest console lines to this file instead of stdout.
    #[arg(long)]
    pub console_log: Option<PathBuf>,
    /// Do not boot: wait for an incoming migration on tcp:ADDR:PORT
    /// (with --paused the VM stays paused after it arrived).
    #[arg(long, value_name = "URI")]
    pub incoming: Option<String>,
    /// With --incoming: allocate all of guest RAM while waiting (as QEMU's
    /// -mem-prealloc), so that receiving a page is only a copy.
    #[arg(long, requires = "incoming")]
    pub prealloc: bool,
    /// After migrating away, stay alive in the postmigrate state until
    /// `quit` (default: exit two seconds after completion).
    #[arg(long)]
    pub keep_after_migrate: bool,
    /// Unix socket where processes that map guest RAM (rnicd, backends)
    /// join, so an incoming postcopy serves their faults too.
    #[arg(long)]
    pub ram_socket: Option<PathBuf>,
}

#[derive(Args)]
pub struct RestoreArgs {
    /// Save file to start from.
    pub file: PathBuf,
    /// Control socket path (default /run/transit/NAME.sock, NAME from the file).
    #[arg(long)]
    pub control: Option<PathBuf>,
    /// Stay paused after restoring; wait for `cont`.
    #[arg(long, short = 'S')]
    pub paused: bool,
    /// Append guest console lines to this file instead of stdout.
    #[arg(long)]
    pub console_log: Option<PathBuf>,
}

pub fn run(cmd: VmCmd) -> Result<()> {
    match cmd {
        VmCmd::Run(a) => run_vm(a),
        VmCmd::Restore(a) => restore_vm(a),
        VmCmd::Status(t) => print(t.client()?.execute("query-status", json!({}))?),
        VmCmd::Stop(t) => print(t.client()?.execute("stop", json!({}))?),
        VmCmd::Cont(t) => print(t.client()?.execute("cont", json!({}))?),
        VmCmd::Quit(t) => print(t.client()?.execute("quit", json!({}))?),
        VmCmd::Save { target, file } => {
            let file = std::path::absolute(&file)?;
            print(target.client()?.execute("save", json!({"filename": file}))?)
        }
        VmCmd::Console(t) => {
            let r = t.client()?.execute("query-console", json!({}))?;
            for l in r["lines"].as_array().into_iter().flatten() {
                println!("{}", l.as_str().unwrap_or(""));
            }
            Ok(())
        }
        VmCmd::Migrate(a) => migrate::migrate(a),
        VmCmd::MigrateIncoming(a) => migrate::migrate_incoming(a),
        VmCmd::MigrateRecover(a) => migrate::migrate_recover(a),
        VmCmd::MigrateStartPostcopy(t) => migrate::start_postcopy(t),
        VmCmd::MigrateSetParameters(a) => migrate::set_parameters(a),
        VmCmd::Mailbox { target, write, wait } => mailbox(&target, write, wait),
        VmCmd::Cmd { target, command, arguments } => {
            let args: Value = serde_json::from_str(&arguments).context("arguments must be a JSON object")?;
            print(target.client()?.execute(&command, args)?)
        }
    }
}

fn mailbox(target: &Target, write: Option<PathBuf>, wait: f64) -> Result<()> {
    let mut c = target.client()?;
    if let Some(f) = write {
        let data = if f.as_os_str() == "-" {
            std::io::read_to_string(std::io::stdin())?
        } else {
            std::fs::read_to_string(&f).with_context(|| format!("reading {}", f.display()))?
        };
        return print(c.execute("mailbox-write", json!({"data": data.trim_end()}))?);
    }
    let deadline = std::time::Instant::now() + Duration::from_secs_f64(wait.max(0.0));
    loop {
        let r = c.execute("mailbox-read", json!({}))?;
        if r["seq"].as_u64().unwrap_or(0) > 0 {
            println!("{}", r["data"].as_str().unwrap_or(""));
            return Ok(());
        }
        if std::time::Instant::now() >= deadline {
            bail!("the guest has not written to its mailbox");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn print(v: Value) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(&v)?);
    Ok(())
}

fn console_sink(log: Option<PathBuf>) -> Result<vmm::vm::ConsoleSink> {
    Ok(match log {
        Some(p) => {
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&p)
                .with_context(|| format!("opening console log {}", p.display()))?;
            Box::new(move |l: &str| {
                let _ = writeln!(f, "{l}");
            })
        }
        None => Box::new(|l: &str| {
            let mut o = std::io::stdout().lock();
            let _ = writeln!(o, "{l}");
            let _ = o.flush();
        }),
    })
}

static TERMINATE: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    TERMINATE.store(true, Ordering::SeqCst);
}

fn run_vm(a: RunArgs) -> Result<()> {
    let memory = units::parse_size(&a.memory).map_err(|e| anyhow::anyhow!("--memory {:?}: {e}", a.memory))?;
    let mut cmdline = format!("workload={}", a.workload);
    if !a.args.trim().is_empty() {
        cmdline = format!("{cmdline} {}", a.args.trim());
    }
    let firmware = a.firmware.unwrap_or_else(guest_image::default_path);
    if !firmware.exists() {
        bail!("firmware file {} does not exist", firmware.display());
    }
    let config = VmConfig { name: a.name.clone(), memory, vcpus: a.vcpus, firmware, cmdline, nvme: a.nvme, pvrdma: a.pvrdma };
    let vm = Vm::build(config, console_sink(a.console_log)?)?;
    let socket = a.control.unwrap_or_else(|| default_socket(&a.name));
    let opts = ServeOpts {
        start: !a.paused,
        incoming: a.incoming,
        prealloc: a.prealloc,
        keep_after_migrate: a.keep_after_migrate,
        ram_socket: a.ram_socket,
    };
    if opts.incoming.is_none() {
        vm.boot()?;
    }
    serve(vm, &socket, opts)
}

fn restore_vm(a: RestoreArgs) -> Result<()> {
    let reader = vmm::savefile::open(&a.file)?;
    let config = reader.header.config.clone();
    let state = reader.state.clone();
    let vm = Vm::build(config, console_sink(a.console_log)?)?;
    reader.read_ram(vm.ram())?;
    vm.restore_state(&state)?;
    let socket = a.control.unwrap_or_else(|| default_socket(&vm.config.name));
    serve(vm, &socket, ServeOpts { start: !a.paused, incoming: None, prealloc: false, keep_after_migrate: false, ram_socket: None })
}

struct ServeOpts {
    /// Start the vCPUs (or, with `incoming`, resume once the VM arrived).
    start: bool,
    incoming: Option<String>,
    prealloc: bool,
    keep_after_migrate: bool,
    ram_socket: Option<PathBuf>,
}

/// Control commands on a destination whose RAM is still coming by postcopy:
/// they must answer promptly, and a vCPU or a read of RAM may wait on a page
/// for as long as the migration is paused (for ever if the source died).
fn during_incoming_postcopy(vm: &Vm, cmd: &str, st: &migration::stats::Stats) -> Option<Result<Value, vmm::control::CmdError>> {
    let paused = st.status == Status::PostcopyPaused;
    let missing = st.remaining_pages;
    let refuse = |desc: String| Some(Err(vmm::control::CmdError { class: "GenericError", desc }));
    let outlook = if paused {
        format!(
            "the migration is paused with {missing} pages still on the source: if the source lives, `migrate-recover` here and \
             `migrate` with resume there bring them; if it died they are lost, and `quit` ends this VM"
        )
    } else {
        format!("{missing} pages are still on their way; try again once the migration completed")
    };
    match cmd {
        "query-status" => {
            let mut v = vmm::control::status(vm);
            v["postcopy"] = json!({"status": st.status, "pages_missing": missing, "error": st.error});
            if paused {
                // Some vCPUs may run, but any of them can block for good on
                // a missing page: the VM as a whole is not running.
                v["status"] = json!("postcopy-paused");
                v["running"] = json!(false);
            }
            Some(Ok(v))
        }
        "stop" => match vm.try_pause(vmm::control::PAUSE_BOUND) {
            Ok(()) => Some(Ok(json!({}))),
            Err(e) => refuse(format!("{e:#}; {outlook}")),
        },
        "save" | "pmemsave" | "query-ram-digest" | "check-dirtier" => {
            refuse(format!("guest RAM is not all here yet (incoming postcopy): reading it would wait for missing pages; {outlook}"))
        }
        _ => None,
    }
}

/// The processes that map guest RAM besides this one and take part in an
/// incoming postcopy: whoever joins at `--ram-socket`, and, on a
/// destination (`--incoming`) with PVRDMA devices, the rnicd of each, which
/// joins through a socket pair before any migration can start, so that
/// postcopy and hybrid of a PVRDMA VM need nothing from the operator.
fn ram_clients(
    vm: &Vm,
    vm_dyn: &Arc<dyn MigratableVm>,
    slot: &MigrationSlot,
    opts: &ServeOpts,
) -> Result<Option<Arc<migration::postcopy::clients::RamClients>>> {
    use migration::postcopy::clients::RamClients;
    let mut rnicds = Vec::new();
    if opts.incoming.is_some() {
        for spec in &vm.config.pvrdma {
            let cfg = devices::pvrdma::PvrdmaConfig::parse(spec).map_err(|e| anyhow::anyhow!("--pvrdma {spec:?}: {e}"))?;
            if !rnicds.contains(&cfg.rnicd) {
                rnicds.push(cfg.rnicd);
            }
        }
    }
    let clients = match &opts.ram_socket {
        Some(p) => RamClients::bind(p, vm_dyn.ram())?,
        None if !rnicds.is_empty() => RamClients::new(vm_dyn.ram()),
        None => return Ok(None),
    };
    for rnicd in rnicds {
        // rnicd's own namespace: the VM's GID may not be served here yet.
        let ctx = verbs::Context::open(rnicd.as_deref()).context("rnicd of the PVRDMA device, to join it as a RAM client")?;
        ctx.join_ram_client(clients.pair("rnicd")?)
            .with_context(|| format!("rnicd at {} joining as a RAM client", ctx.socket_path().display()))?;
    }
    slot.set_ram_clients(clients.clone());
    Ok(Some(clients))
}

/// How long a source that migrated away stays up so clients can read the
/// final `query-migrate`.
const POSTMIGRATE_GRACE: Duration = Duration::from_secs(2);

/// Serve the control socket and run until quit, guest exit or a signal.
fn serve(vm: Arc<Vm>, socket: &std::path::Path, opts: ServeOpts) -> Result<()> {
    unsafe {
        libc::signal(libc::SIGTERM, on_signal as *const () as usize);
        libc::signal(libc::SIGINT, on_signal as *const () as usize);
    }
    let (tx, rx) = mpsc::channel();
    let mut control = Control::new(vm.clone(), tx);
    let slot = Arc::new(MigrationSlot::default());
    for s in vm.dirty_sources() {
        slot.add_dirty_source(s);
    }
    let vm_dyn: Arc<dyn MigratableVm> = vm.clone();
    {
        let (slot, vm_dyn) = (slot.clone(), vm_dyn.clone());
        let refuse = |desc: &str| Some(Err(vmm::control::CmdError { class: "GenericError", desc: desc.into() }));
        control.extend(Box::new(move |vm, cmd, args| {
            if let Some(st) =
                slot.stats().filter(|s| s.role == "incoming" && matches!(s.status, Status::PostcopyActive | Status::PostcopyPaused))
            {
                if let Some(r) = during_incoming_postcopy(vm, cmd, &st) {
                    return Some(r);
                }
            }
            if cmd == "cont" {
                // A source whose state went to the destination must never
                // run again: from the pause of stop-and-copy or the
                // postcopy switch on, `cont` would split the VM in two.
                return match slot.stats().map(|s| (s.role, s.status, s.committed)) {
                    Some(
                        (role, Status::Device | Status::PostcopyActive | Status::PostcopyPaused | Status::Completed, _) | (role, _, true),
                    ) if role == "outgoing" => refuse("the VM is being handed over to the migration destination; it cannot run here"),
                    // A destination runs once all of its state is here,
                    // and never on what a failed migration left.
                    Some((role, Status::Setup | Status::Active | Status::Device, _)) if role == "incoming" => {
                        refuse("the VM is receiving a migration; it runs when the migration completes")
                    }
                    Some((role, Status::Failed | Status::Cancelled, _)) if role == "incoming" => {
                        refuse("the incoming migration failed: this VM holds part of a state and cannot run")
                    }
                    _ => None,
                };
            }
            // Pages the guest writes while a migration comes in would mix
            // with the pages that arrive (and a page that was a hole when
            // it began listening is taken for zero).
            if cmd == "migrate-incoming" && vm.run_state() == RunState::Running {
                return refuse("the VM is running; receive a migration into a VM started with --paused or --incoming");
            }
            if !MIGRATION_COMMANDS.contains(&cmd) {
                return None;
            }
            Some(migration::qmp::handle(&vm_dyn, &slot, cmd, args).map_err(|e| vmm::control::CmdError {
                class: if e.class == "CommandNotFound" { "CommandNotFound" } else { "GenericError" },
                desc: e.desc,
            }))
        }));
    }
    // Before the control socket answers: whoever sees it can migrate into
    // this VM, and every RAM client must be in by then.
    let _ram_clients = ram_clients(&vm, &vm_dyn, &slot, &opts)?;
    control.serve(socket)?;
    tracing::info!(name = %vm.config.name, socket = %socket.display(), "VM ready");
    if let Some(uri) = &opts.incoming {
        migration::qmp::handle(&vm_dyn, &slot, "migrate-incoming", &json!({"uri": uri, "resume": opts.start, "prealloc": opts.prealloc}))
            .map_err(|e| anyhow::anyhow!("migrate-incoming {uri}: {}", e.desc))?;
        tracing::info!(%uri, "waiting for an incoming migration");
    } else if opts.start {
        vm.resume()?;
    }
    let mut migrated_at: Option<std::time::Instant> = None;
    let result = loop {
        match slot.outcome() {
            Some(Outcome::OutgoingCompleted) if migrated_at.is_none() => {
                vm.set_run_state(RunState::Postmigrate);
                vm.close_rdma();
                tracing::info!("migrated away; this VM is now stopped for good");
                migrated_at = Some(std::time::Instant::now());
            }
            // Failed after the destination took the VM over (postcopy):
            // it never runs here again, and this process stays up.
            Some(Outcome::OutgoingFailed(_)) if vm.run_state() != RunState::Postmigrate && slot.stats().is_some_and(|s| s.committed) => {
                vm.set_run_state(RunState::Postmigrate);
            }
            Some(Outcome::IncomingFailed(why)) if opts.incoming.is_some() => {
                break Err(anyhow::anyhow!("incoming migration failed, the VM never ran: {why}"));
            }
            _ => {}
        }
        if migrated_at.is_some_and(|t| !opts.keep_after_migrate && t.elapsed() > POSTMIGRATE_GRACE) {
            break Ok(());
        }
        match rx.recv_timeout(Duration::from_millis(50)) {
            Ok(ProcessRequest::Quit) => break Ok(()),
            Err(mpsc::RecvTimeoutError::Disconnected) => break Ok(()),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
        if TERMINATE.load(Ordering::SeqCst) {
            break Ok(());
        }
        match vm.run_state() {
            RunState::Shutdown => {
                let code = vm.guest_exit_code().unwrap_or(0);
                tracing::info!(code, "guest exited");
                let _ = std::fs::remove_file(socket);
                vm.shutdown();
                std::process::exit(code.min(255) as i32);
            }
            RunState::InternalError => {
                let why: Vec<String> = vm.vcpu_status().into_iter().filter_map(|s| s.error).collect();
                break Err(anyhow::anyhow!("guest stopped with an internal error: {}", why.join("; ")));
            }
            _ => {}
        }
    };
    let _ = std::fs::remove_file(socket);
    vm.shutdown();
    result
}
