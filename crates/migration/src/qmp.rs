//! The migration commands of the vmm's control socket (QMP style).
//!
//! The vmm forwards `migrate`, `migrate-incoming`, `query-migrate`,
//! `migrate-cancel`, `migrate-set-parameters` and `query-migrate-parameters`
//! to [`handle`], with the one [`MigrationSlot`] it keeps per VM, and polls
//! [`MigrationSlot::outcome`] to learn when to exit (source) or that the VM
//! runs (destination).

use crate::dest::{self, IncomingParams};
use crate::dirty::DirtySource;
use crate::postcopy::clients::RamClients;
use crate::source;
use crate::stats::{Control, Params, RecoverRequest, Stats, Status};
use crate::vm::MigratableVm;
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{class}: {desc}")]
pub struct QmpError {
    pub class: String,
    pub desc: String,
}

impl QmpError {
    fn generic(desc: impl Into<String>) -> Self {
        QmpError { class: "GenericError".into(), desc: desc.into() }
    }
}

/// How the last migration of this VM ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The destination owns the VM now; the source stays paused
    /// ("postmigrate") and the vmm may exit.
    OutgoingCompleted,
    /// Outgoing failed or was cancelled; the VM runs here as before.
    OutgoingFailed(String),
    /// The VM arrived complete; `resumed` says whether its vCPUs run.
    IncomingCompleted { resumed: bool },
    /// Incoming failed: the VM never ran and holds no usable state.
    IncomingFailed(String),
}

struct Job {
    incoming: bool,
    ctl: Arc<Control>,
    outcome: Arc<Mutex<Option<Outcome>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

#[derive(Default)]
struct Inner {
    params: Option<Params>,
    job: Option<Job>,
    sources: Vec<Arc<dyn DirtySource>>,
    ram_clients: Option<Arc<RamClients>>,
}

/// The current or last migration of one VM, and its parameters.
#[derive(Default)]
pub struct MigrationSlot {
    inner: Mutex<Inner>,
}

impl MigrationSlot {
    /// `None` while nothing ran or a migration is still going.
    pub fn outcome(&self) -> Option<Outcome> {
        let g = self.inner.lock().unwrap();
        let job = g.job.as_ref()?;
        let o = job.outcome.lock().unwrap().clone();
        o
    }

    /// Statistics of the current or last migration.
    pub fn stats(&self) -> Option<Stats> {
        self.inner.lock().unwrap().job.as_ref().map(|j| j.ctl.snapshot())
    }

    /// Add a tracker of writes made outside this process's mapping (rnicd).
    pub fn add_dirty_source(&self, s: Arc<dyn DirtySource>) {
        self.inner.lock().unwrap().sources.push(s);
    }

    /// Processes other than the vmm that map guest RAM (see
    /// [`crate::postcopy::clients`]); an incoming postcopy includes them.
    pub fn set_ram_clients(&self, c: Arc<RamClients>) {
        self.inner.lock().unwrap().ram_clients = Some(c);
    }

    /// Block until the running migration ends (tests, `--incoming` startup).
    pub fn wait(&self) -> Option<Outcome> {
        let t = self.inner.lock().unwrap().job.as_mut().and_then(|j| j.thread.take());
        if let Some(t) = t {
            let _ = t.join();
        }
        self.outcome()
    }

    fn busy(g: &Inner) -> bool {
        g.job.as_ref().is_some_and(|j| j.outcome.lock().unwrap().is_none())
    }
}

fn str_arg<'a>(args: &'a Value, k: &str) -> Result<&'a str, QmpError> {
    args.get(k).and_then(|v| v.as_str()).ok_or_else(|| QmpError::generic(format!("argument {k:?} (a string) is required")))
}

/// Execute one migration command.
pub fn handle(vm: &Arc<dyn MigratableVm>, slot: &MigrationSlot, cmd: &str, args: &Value) -> Result<Value, QmpError> {
    let args = if args.is_null() { &json!({}) } else { args };
    match cmd {
        "migrate" => {
            let uri = str_arg(args, "uri")?.to_string();
            let mut g = slot.inner.lock().unwrap();
            if args.get("resume").and_then(|v| v.as_bool()).unwrap_or(false) {
                // Recovery of a paused postcopy: the running job reconnects.
                let job = g.job.as_ref().filter(|j| !j.incoming && j.ctl.snapshot().status == Status::PostcopyPaused);
                let Some(j) = job else {
                    return Err(QmpError::generic("migrate resume: no paused postcopy migration to resume"));
                };
                crate::sender::parse_tcp_uri(&uri).map_err(|e| QmpError::generic(format!("{e:#}")))?;
                j.ctl.offer_recovery(RecoverRequest::Connect(uri));
                return Ok(json!({}));
            }
            if MigrationSlot::busy(&g) {
                return Err(QmpError::generic("a migration is already running"));
            }
            if g.job.as_ref().is_some_and(|j| !j.incoming && j.ctl.snapshot().committed) {
                return Err(QmpError::generic("this VM already migrated away"));
            }
            let params = g.params.clone().unwrap_or_default().merged(args).map_err(QmpError::generic)?;
            let ctl = Arc::new(Control::default());
            ctl.set_downtime_ms(params.downtime_ms);
            ctl.set_max_bandwidth(params.max_bandwidth);
            ctl.update(|s| {
                s.status = Status::Setup;
                s.role = "outgoing".into();
            });
            let outcome = Arc::new(Mutex::new(None));
            let (vm2, ctl2, out2, sources) = (vm.clone(), ctl.clone(), outcome.clone(), g.sources.clone());
            let thread = std::thread::Builder::new()
                .name("migrate-out".into())
                .spawn(move || {
                    let r = source::run(vm2, &uri, &params, sources, ctl2);
                    if let Err(e) = &r {
                        tracing::warn!("outgoing migration failed: {e:#}");
                    }
                    *out2.lock().unwrap() = Some(match r {
                        Ok(()) => Outcome::OutgoingCompleted,
                        Err(e) => Outcome::OutgoingFailed(format!("{e:#}")),
                    });
                })
                .map_err(|e| QmpError::generic(e.to_string()))?;
            g.job = Some(Job { incoming: false, ctl, outcome, thread: Some(thread) });
            Ok(json!({}))
        }
        "migrate-incoming" => {
            let uri = str_arg(args, "uri")?;
            let params: IncomingParams =
                serde_json::from_value(args.clone()).map_err(|e| QmpError::generic(format!("bad argument: {e}")))?;
            let mut g = slot.inner.lock().unwrap();
            if MigrationSlot::busy(&g) {
                return Err(QmpError::generic("a migration is already running"));
            }
            if g.job.is_some() {
                return Err(QmpError::generic("this VM already took part in a migration; start a fresh vmm to receive one"));
            }
            let listener = dest::listen(uri).map_err(|e| QmpError::generic(format!("{e:#}")))?;
            let port = listener.local_addr().map(|a| a.port()).unwrap_or(0);
            let ctl = Arc::new(Control::default());
            ctl.update(|s| {
                s.status = Status::Setup;
                s.role = "incoming".into();
            });
            let outcome = Arc::new(Mutex::new(None));
            let (vm2, ctl2, out2, clients) = (vm.clone(), ctl.clone(), outcome.clone(), g.ram_clients.clone());
            let thread = std::thread::Builder::new()
                .name("migrate-in".into())
                .spawn(move || {
                    let r = dest::run(vm2, listener, &params, ctl2, clients);
                    if let Err(e) = &r {
                        tracing::warn!("incoming migration failed: {e:#}");
                    }
                    *out2.lock().unwrap() = Some(match r {
                        Ok(resumed) => Outcome::IncomingCompleted { resumed },
                        Err(e) => Outcome::IncomingFailed(format!("{e:#}")),
                    });
                })
                .map_err(|e| QmpError::generic(e.to_string()))?;
            g.job = Some(Job { incoming: true, ctl, outcome, thread: Some(thread) });
            Ok(json!({ "port": port }))
        }
        "query-migrate" => {
            let g = slot.inner.lock().unwrap();
            match &g.job {
                None => Ok(json!({ "status": "none" })),
                Some(j) => {
                    let mut v = serde_json::to_value(j.ctl.snapshot()).expect("stats serialize");
                    v["incoming"] = json!(j.incoming);
                    Ok(v)
                }
            }
        }
        "migrate-cancel" => {
            let g = slot.inner.lock().unwrap();
            if let Some(j) = &g.job {
                if j.outcome.lock().unwrap().is_none() {
                    if matches!(j.ctl.snapshot().status, Status::PostcopyActive | Status::PostcopyPaused) {
                        return Err(QmpError::generic(
                            "cannot cancel a migration in postcopy: the destination runs the VM and the source holds part of its memory; only completion (or recovery) can end it",
                        ));
                    }
                    j.ctl.cancel();
                }
            }
            Ok(json!({}))
        }
        "migrate-set-parameters" => {
            let mut g = slot.inner.lock().unwrap();
            let p = g.params.clone().unwrap_or_default().merged(args).map_err(QmpError::generic)?;
            g.params = Some(p.clone());
            // The downtime target (from the next round on) and the
            // bandwidth cap (at once) apply to a running outgoing migration
            // too; the others only to the next.
            if let Some(j) = g.job.as_ref().filter(|j| !j.incoming && j.outcome.lock().unwrap().is_none()) {
                if args.get("downtime_ms").is_some() {
                    j.ctl.set_downtime_ms(p.downtime_ms);
                }
                if args.get("max_bandwidth").is_some() {
                    j.ctl.set_max_bandwidth(p.max_bandwidth);
                }
            }
            Ok(serde_json::to_value(p).expect("params serialize"))
        }
        "query-migrate-parameters" => {
            let g = slot.inner.lock().unwrap();
            Ok(serde_json::to_value(g.params.clone().unwrap_or_default()).expect("params serialize"))
        }
        "migrate-start-postcopy" => {
            let g = slot.inner.lock().unwrap();
            let Some(j) = g.job.as_ref().filter(|j| !j.incoming && j.outcome.lock().unwrap().is_none()) else {
                return Err(QmpError::generic("migrate-start-postcopy: no outgoing migration is running"));
            };
            let st = j.ctl.snapshot();
            if st.mode != "hybrid" {
                return Err(QmpError::generic(format!(
                    "migrate-start-postcopy: this migration runs in mode {:?}; start it with mode \"hybrid\"",
                    st.mode
                )));
            }
            j.ctl.request_postcopy();
            Ok(json!({}))
        }
        "migrate-recover" => {
            let uri = str_arg(args, "uri")?;
            let g = slot.inner.lock().unwrap();
            let job = g.job.as_ref().filter(|j| j.incoming && j.ctl.snapshot().status == Status::PostcopyPaused);
            let Some(j) = job else {
                return Err(QmpError::generic("migrate-recover: no paused incoming postcopy migration here"));
            };
            let listener = dest::listen(uri).map_err(|e| {
                QmpError::generic(format!("{e:#} (a paused destination also keeps accepting the source on its original address)"))
            })?;
            let port = listener.local_addr().map(|a| a.port()).unwrap_or(0);
            j.ctl.offer_recovery(RecoverRequest::Listen(listener));
            Ok(json!({ "port": port }))
        }
        _ => Err(QmpError { class: "CommandNotFound".into(), desc: format!("unknown migration command {cmd:?}") }),
    }
}
