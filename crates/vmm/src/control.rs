//! The control socket: one JSON object per line, in the style of QEMU's QMP.
//!
//! Request:  `{"execute": "query-status", "arguments": {...}, "id": any}`
//! Success:  `{"return": {...}, "id": any}`
//! Failure:  `{"error": {"class": "GenericError", "desc": "..."}, "id": any}`
//! On connect the server sends a greeting `{"QMP": {"version": ..., "capabilities": []}}`.

use crate::oracle;
use crate::vm::{RunState, Vm};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;

/// What the control socket asks of the process that owns the VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProcessRequest {
    Quit,
}

#[derive(Debug)]
pub struct CmdError {
    pub class: &'static str,
    pub desc: String,
}

impl CmdError {
    pub fn generic(desc: impl Into<String>) -> Self {
        CmdError { class: "GenericError", desc: desc.into() }
    }
}

impl From<anyhow::Error> for CmdError {
    fn from(e: anyhow::Error) -> Self {
        CmdError::generic(format!("{e:#}"))
    }
}

type CmdResult = Result<Value, CmdError>;

/// Longest a control command waits for the vCPUs to stop: they acknowledge
/// within milliseconds unless one is blocked in the kernel (on a page an
/// incoming postcopy has not brought), which no wait would end.
pub const PAUSE_BOUND: std::time::Duration = std::time::Duration::from_secs(2);

/// Extra command handlers (migration, devices) plugged in by the owner.
pub type Extension = Box<dyn Fn(&Arc<Vm>, &str, &Value) -> Option<CmdResult> + Send + Sync>;

pub struct Control {
    vm: Arc<Vm>,
    requests: Sender<ProcessRequest>,
    /// Set by `quit`; the connection that ran it asks the process to end
    /// only after its reply is written, so the client always gets it.
    quit_after_reply: AtomicBool,
    extensions: Vec<Extension>,
}

pub const COMMANDS: &[&str] = &[
    "qmp_capabilities",
    "query-commands",
    "query-status",
    "query-vm",
    "stop",
    "cont",
    "quit",
    "query-console",
    "query-vcpus",
    "pmemsave",
    "query-ram-digest",
    "check-dirtier",
    "save",
    "query-nvme",
    "nvme-ns-add",
    "nvme-ns-remove",
    "mailbox-read",
    "mailbox-write",
    "query-pvrdma",
];

impl Control {
    pub fn new(vm: Arc<Vm>, requests: Sender<ProcessRequest>) -> Self {
        Control { vm, requests, extensions: Vec::new(), quit_after_reply: AtomicBool::new(false) }
    }

    pub fn extend(&mut self, e: Extension) {
        self.extensions.push(e);
    }

    /// Listen on `path` (a stale socket file is replaced) and serve each
    /// connection on its own thread.
    pub fn serve(self, path: &Path) -> anyhow::Result<()> {
        if path.exists() {
            if UnixStream::connect(path).is_ok() {
                anyhow::bail!("control socket {} is in use by another VM", path.display());
            }
            std::fs::remove_file(path)?;
        }
        if let Some(d) = path.parent() {
            std::fs::create_dir_all(d)?;
        }
        let listener = UnixListener::bind(path).map_err(|e| anyhow::anyhow!("binding control socket {}: {e}", path.display()))?;
        let me = Arc::new(self);
        std::thread::Builder::new().name("control".into()).spawn(move || {
            for conn in listener.incoming().flatten() {
                let me = me.clone();
                let _ = std::thread::Builder::new().name("control-conn".into()).spawn(move || me.connection(conn));
            }
        })?;
        Ok(())
    }

    fn connection(&self, conn: UnixStream) {
        let mut out = match conn.try_clone() {
            Ok(c) => c,
            Err(_) => return,
        };
        let greeting = json!({"QMP": {"version": {"package": "transit", "version": env!("CARGO_PKG_VERSION")}, "capabilities": []}});
        if writeln!(out, "{greeting}").is_err() {
            return;
        }
        let reader = BufReader::new(conn);
        for line in reader.split(b'\n') {
            let Ok(line) = line else { return };
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            let reply = self.handle_line(&line);
            let written = writeln!(out, "{reply}").and_then(|_| out.flush());
            if self.quit_after_reply.swap(false, Ordering::SeqCst) {
                let _ = self.requests.send(ProcessRequest::Quit);
            }
            if written.is_err() {
                return;
            }
        }
    }

    /// Parse one request line and produce the reply object.
    pub fn handle_line(&self, line: &[u8]) -> Value {
        let req: Value = match serde_json::from_slice(line) {
            Ok(v) => v,
            Err(e) => return json!({"error": {"class": "GenericError", "desc": format!("JSON parse error: {e}")}}),
        };
        let id = req.get("id").cloned();
        let r = match req.get("execute").and_then(Value::as_str) {
            None => Err(CmdError::generic("expected an object with \"execute\": \"<command>\"")),
            Some(cmd) => {
                let args = req.get("arguments").cloned().unwrap_or(json!({}));
                if !args.is_object() {
                    Err(CmdError::generic("\"arguments\" must be an object"))
                } else {
                    self.execute(cmd, &args)
                }
            }
        };
        let mut reply = match r {
            Ok(v) => json!({"return": v}),
            Err(e) => json!({"error": {"class": e.class, "desc": e.desc}}),
        };
        if let Some(id) = id {
            reply["id"] = id;
        }
        reply
    }

    pub fn execute(&self, cmd: &str, args: &Value) -> CmdResult {
        let vm = &self.vm;
        // Extensions first: they add commands and may veto built-in ones
        // (the migration engine refuses `cont` on a VM it handed over).
        for e in &self.extensions {
            if let Some(r) = e(vm, cmd, args) {
                return r;
            }
        }
        match cmd {
            "qmp_capabilities" => Ok(json!({})),
            "query-commands" => Ok(json!(COMMANDS.iter().map(|c| json!({"name": c})).collect::<Vec<_>>())),
            "query-status" => Ok(status(vm)),
            "query-vm" => Ok(json!({"config": vm.config, "shape": vm.config.shape()})),
            "stop" => {
                vm.try_pause(PAUSE_BOUND)?;
                Ok(json!({}))
            }
            "cont" => {
                vm.resume()?;
                Ok(json!({}))
            }
            "quit" => {
                self.quit_after_reply.store(true, Ordering::SeqCst);
                Ok(json!({}))
            }
            "query-console" => Ok(json!({"lines": vm.console_lines()})),
            "query-vcpus" => {
                paused_ram(vm)?;
                Ok(serde_json::to_value(vm.vcpu_states()?).unwrap())
            }
            "pmemsave" => {
                let addr = arg_u64(args, "val")?;
                let size = arg_u64(args, "size")?;
                let file = arg_path(args, "filename")?;
                let ram = paused_ram(vm)?;
                let end = addr
                    .checked_add(size)
                    .filter(|&e| e <= ram.len() as u64)
                    .ok_or_else(|| CmdError::generic(format!("range {addr:#x}+{size:#x} is outside guest RAM ({:#x} bytes)", ram.len())))?;
                crate::output::write_bytes(&file, &ram[addr as usize..end as usize])?;
                Ok(json!({}))
            }
            "query-ram-digest" => {
                let ram = paused_ram(vm)?;
                let pages = oracle::page_digests(ram);
                if let Some(f) = args.get("filename").and_then(Value::as_str) {
                    let text: String = pages.iter().map(|d| format!("{d:016x}\n")).collect();
                    crate::output::write_bytes(Path::new(f), text.as_bytes())?;
                }
                Ok(json!({"pages": pages.len(), "digest": format!("{:016x}", oracle::ram_digest(ram))}))
            }
            "check-dirtier" => {
                let ram = paused_ram(vm)?;
                let start = args.get("start").and_then(Value::as_u64).unwrap_or(4 << 20);
                let end = args.get("end").and_then(Value::as_u64).unwrap_or(ram.len() as u64);
                if start >= end || end > ram.len() as u64 || !start.is_multiple_of(4096) {
                    return Err(CmdError::generic("start/end must be page aligned with start < end <= RAM size"));
                }
                Ok(serde_json::to_value(oracle::check_dirtier(ram, start, end)).unwrap())
            }
            "save" => {
                let file = arg_path(args, "filename")?;
                vm.try_pause(PAUSE_BOUND)?;
                let state = vm.save_state()?;
                let st = crate::savefile::write(&file, &vm.config, &state, vm.ram())?;
                Ok(json!({"bytes": st.bytes, "data_pages": st.data_pages, "zero_pages": st.zero_pages}))
            }
            "query-nvme" => Ok(json!(vm
                .nvme_controllers()
                .iter()
                .map(|c| {
                    let c = c.lock().unwrap();
                    json!({"name": c.name(), "stats": c.stats()})
                })
                .collect::<Vec<_>>())),
            "nvme-ns-add" => {
                let spec = args
                    .get("spec")
                    .and_then(Value::as_str)
                    .ok_or_else(|| CmdError::generic("argument \"spec\" (e.g. \"mem:64M\") is required"))?;
                let ctrl = nvme_arg(vm, args)?;
                let nsid = ctrl.lock().unwrap().attach_namespace(spec).map_err(CmdError::generic)?;
                Ok(json!({"nsid": nsid}))
            }
            "nvme-ns-remove" => {
                let nsid = arg_u64(args, "nsid")?;
                let nsid = u32::try_from(nsid).map_err(|_| CmdError::generic("nsid is out of range"))?;
                nvme_arg(vm, args)?.lock().unwrap().detach_namespace(nsid).map_err(CmdError::generic)?;
                Ok(json!({}))
            }
            // The guest's last published message (seq 0: none yet) and the
            // host's, both as text (devices/src/mailbox.rs).
            "mailbox-read" => {
                let mb = vm.mailbox().lock().unwrap();
                let (g, h) = (mb.guest_message(), mb.host_message());
                Ok(json!({
                    "seq": g.seq,
                    "data": String::from_utf8_lossy(&g.data),
                    "host_seq": h.seq,
                    "host_data": String::from_utf8_lossy(&h.data),
                }))
            }
            "mailbox-write" => {
                let data = args
                    .get("data")
                    .and_then(Value::as_str)
                    .ok_or_else(|| CmdError::generic("argument \"data\" (the message, a string) is required"))?;
                let seq = vm.mailbox().lock().unwrap().write_host(data.as_bytes()).map_err(CmdError::generic)?;
                Ok(json!({"seq": seq}))
            }
            "query-pvrdma" => {
                let name = args.get("device").and_then(Value::as_str);
                let all: Vec<Value> = vm.pvrdma_devices().iter().map(|d| d.lock().unwrap().query()).collect();
                match name {
                    None => Ok(json!(all)),
                    Some(n) => all
                        .into_iter()
                        .find(|d| d["name"] == n)
                        .ok_or_else(|| CmdError { class: "DeviceNotFound", desc: format!("no PVRDMA device named {n}") }),
                }
            }
            _ => Err(CmdError { class: "CommandNotFound", desc: format!("the command {cmd} has not been found") }),
        }
    }
}

/// The reply of `query-status` (the migration extension adds to it).
pub fn status(vm: &Vm) -> Value {
    let st = vm.run_state();
    json!({
        "status": st,
        "running": st == RunState::Running,
        "guest_exit_code": vm.guest_exit_code(),
        "guest_progress": vm.guest_progress(),
        "guest_time_ns": vm.guest_time_ns(),
        "cpu_throttle_pct": vm.cpu_throttle(),
        "vcpus": vm.vcpu_status(),
    })
}

/// The controller named by the optional "controller" argument.
fn nvme_arg<'a>(vm: &'a Vm, args: &Value) -> Result<&'a std::sync::Arc<std::sync::Mutex<devices::nvme::NvmeController>>, CmdError> {
    let name = args.get("controller").and_then(Value::as_str);
    vm.nvme(name).ok_or_else(|| CmdError {
        class: "DeviceNotFound",
        desc: match name {
            Some(n) => format!("no NVMe controller named {n}"),
            None => "this VM has no NVMe controller".into(),
        },
    })
}

fn paused_ram(vm: &Vm) -> Result<&[u8], CmdError> {
    if !vm.is_paused() {
        return Err(CmdError::generic("the VM must be stopped first (use \"stop\")"));
    }
    // SAFETY: all vCPUs are paused and devices quiesced.
    Ok(unsafe { vm.ram().as_slice() })
}

fn arg_u64(args: &Value, k: &str) -> Result<u64, CmdError> {
    args.get(k).and_then(Value::as_u64).ok_or_else(|| CmdError::generic(format!("argument \"{k}\" (a number) is required")))
}

fn arg_path(args: &Value, k: &str) -> Result<PathBuf, CmdError> {
    args.get(k)
        .and_then(Value::as_str)
        .map(PathBuf::from)
        .ok_or_else(|| CmdError::generic(format!("argument \"{k}\" (a path) is required")))
}

/// A blocking client for the control socket.
pub struct Client {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Client {
    pub fn connect(path: &Path) -> anyhow::Result<Client> {
        let s = UnixStream::connect(path).map_err(|e| anyhow::anyhow!("connecting to VM control socket {}: {e}", path.display()))?;
        let mut c = Client { reader: BufReader::new(s.try_clone()?), writer: s };
        let g = c.read()?;
        if g.get("QMP").is_none() {
            anyhow::bail!("{} did not greet like a Transit VM", path.display());
        }
        Ok(c)
    }

    fn read(&mut self) -> anyhow::Result<Value> {
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            anyhow::bail!("the VM closed its control socket");
        }
        Ok(serde_json::from_str(&line)?)
    }

    /// Send a command; returns `return` or an error built from `error`.
    pub fn execute(&mut self, cmd: &str, args: Value) -> anyhow::Result<Value> {
        let req = json!({"execute": cmd, "arguments": args});
        writeln!(self.writer, "{req}")?;
        let r = self.read()?;
        if let Some(e) = r.get("error") {
            anyhow::bail!(
                "{}: {}",
                e.get("class").and_then(Value::as_str).unwrap_or("Error"),
                e.get("desc").and_then(Value::as_str).unwrap_or("")
            );
        }
        Ok(r.get("return").cloned().unwrap_or(Value::Null))
    }

    /// Send a raw line (for tests of malformed input); returns the reply.
    pub fn raw(&mut self, line: &str) -> anyhow::Result<Value> {
        writeln!(self.writer, "{line}")?;
        self.read()
    }
}
