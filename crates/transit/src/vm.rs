//! `transit vm ...`: run a VM (the vmm process) and control it.

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use serde_json::{json, Value};
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;
use vmm::control::{Client, Control, ProcessRequest};
use vmm::{RunState, Vm, VmConfig};

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
    /// Control socket path (default /run/transit/NAME.sock).
    #[arg(long)]
    pub control: Option<PathBuf>,
    /// Do not start the vCPUs; wait for `cont`.
    #[arg(long, short = 'S')]
    pub paused: bool,
    /// Append guest console lines to this file instead of stdout.
    #[arg(long)]
    pub console_log: Option<PathBuf>,
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
        VmCmd::Cmd { target, command, arguments } => {
            let args: Value = serde_json::from_str(&arguments).context("arguments must be a JSON object")?;
            print(target.client()?.execute(&command, args)?)
        }
    }
}

fn print(v: Value) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(&v)?);
    Ok(())
}

fn console_sink(log: Option<PathBuf>) -> Result<vmm::vm::ConsoleSink> {
    Ok(match log {
        Some(p) => {
            let mut f = std::fs::OpenOptions::new().create(true).append(true).open(&p)
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
    let memory = vmm::config::parse_size(&a.memory)?;
    let mut cmdline = format!("workload={}", a.workload);
    if !a.args.trim().is_empty() {
        cmdline = format!("{cmdline} {}", a.args.trim());
    }
    let firmware = a.firmware.unwrap_or_else(guest_image::default_path);
    if !firmware.exists() {
        bail!("firmware file {} does not exist", firmware.display());
    }
    let config = VmConfig { name: a.name.clone(), memory, vcpus: a.vcpus, firmware, cmdline, nvme: a.nvme };
    let vm = Vm::build(config, console_sink(a.console_log)?)?;
    vm.boot()?;
    let socket = a.control.unwrap_or_else(|| default_socket(&a.name));
    serve(vm, &socket, !a.paused)
}

fn restore_vm(a: RestoreArgs) -> Result<()> {
    let reader = vmm::savefile::open(&a.file)?;
    let config = reader.header.config.clone();
    let state = reader.state.clone();
    let vm = Vm::build(config, console_sink(a.console_log)?)?;
    reader.read_ram(vm.ram())?;
    vm.restore_state(&state)?;
    let socket = a.control.unwrap_or_else(|| default_socket(&vm.config.name));
    serve(vm, &socket, !a.paused)
}

/// Serve the control socket and run until quit, guest exit or a signal.
fn serve(vm: Arc<Vm>, socket: &std::path::Path, start: bool) -> Result<()> {
    unsafe {
        libc::signal(libc::SIGTERM, on_signal as *const () as usize);
        libc::signal(libc::SIGINT, on_signal as *const () as usize);
    }
    let (tx, rx) = mpsc::channel();
    let control = Control::new(vm.clone(), tx);
    control.serve(socket)?;
    tracing::info!(name = %vm.config.name, socket = %socket.display(), "VM ready");
    if start {
        vm.resume()?;
    }
    let result = loop {
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
