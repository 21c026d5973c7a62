//! A virtual NVMe controller (NVMe 1.4 register and command model) that can
//! be saved, restored and live-migrated. See docs/nvme.md.
//!
//! Threading: the vCPU thread runs doorbell writes inline — it fetches the
//! new submissions, runs memory-namespace commands and posts their
//! completions before the MMIO write returns. File namespaces submit reads
//! and writes to one io_uring per controller; a worker thread waits for
//! completions and posts them. All controller state sits behind one lock.

// `x % n == 0` stays: `is_multiple_of` is newer than the workspace's rust-version.
#![allow(clippy::manual_is_multiple_of)]

mod admin;
mod backend;
pub mod config;
mod ctrl;
mod dma;
pub mod harness;
mod io;
mod jobs;
mod persist;
mod queues;
pub mod spec;
mod uring;
#[cfg(test)]
mod worker_tests;

pub use config::{BackendSpec, NamespaceSpec, NvmeConfig};

use crate::bus::BusDevice;
use crate::pci::{Bar, PciConfig, PciFunction, CLASS_STORAGE, PROGIF_NVME, SUBCLASS_NVM};
use crate::{GuestMemory, Lifecycle};
use backend::Storage;
use ctrl::{Ctrl, Namespace, URING_DEPTH};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use uring::Uring;

/// PCI IDs of the controller ("TR" / "NV").
pub const PCI_VENDOR: u16 = 0x5452;
pub const PCI_DEVICE: u16 = 0x4e56;

pub struct NvmeController {
    name: String,
    shared: Arc<Mutex<Ctrl>>,
    pci: PciConfig,
    worker: Option<JoinHandle<()>>,
}

fn lock_raw(m: &Mutex<Ctrl>) -> MutexGuard<'_, Ctrl> {
    // A panic elsewhere must not take the device down with it.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The controller lock. Dropping it wakes the completion worker if the
/// work done under it asked for that (`Ctrl::wake_pending`): after the
/// unlock, so the worker does not wake only to block on this lock.
pub(crate) struct Locked<'a>(Option<MutexGuard<'a, Ctrl>>);

fn lock(m: &Mutex<Ctrl>) -> Locked<'_> {
    Locked(Some(lock_raw(m)))
}

impl std::ops::Deref for Locked<'_> {
    type Target = Ctrl;
    fn deref(&self) -> &Ctrl {
        self.0.as_ref().unwrap()
    }
}

impl std::ops::DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut Ctrl {
        self.0.as_mut().unwrap()
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        let Some(mut g) = self.0.take() else { return };
        if !g.wake_pending {
            return;
        }
        g.wake_pending = false;
        let cv = g.worker_cv.clone();
        drop(g);
        cv.notify_one();
    }
}

impl NvmeController {
    /// Registers (0x1000) plus doorbells for up to 1024 I/O queue pairs.
    pub const BAR0_SIZE: u64 = 0x4000;

    pub fn new(cfg: NvmeConfig, mem: GuestMemory, bar0_addr: u64) -> Result<NvmeController, String> {
        if bar0_addr % Self::BAR0_SIZE != 0 {
            return Err(format!("BAR0 address {bar0_addr:#x} is not aligned to {:#x}", Self::BAR0_SIZE));
        }
        if cfg.queues == 0 || cfg.queues > config::MAX_IO_QUEUES || cfg.depth < 2 || cfg.depth > config::MAX_DEPTH {
            return Err("queues or depth out of range".into());
        }
        let mut pci = PciConfig::new(PCI_VENDOR, PCI_DEVICE, CLASS_STORAGE, SUBCLASS_NVM, PROGIF_NVME);
        pci.set_bar64(0, Bar { addr: bar0_addr, size: Self::BAR0_SIZE });
        let specs = cfg.namespaces.clone();
        let name = cfg.name.clone();
        let mut c = NvmeController { name, shared: Arc::new(Mutex::new(Ctrl::new(cfg, mem))), pci, worker: None };
        for spec in specs {
            c.add_namespace(spec, None)?;
        }
        Ok(c)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Hot-add a namespace (`mem:64M`, `file:/path[,direct=on]`).
    pub fn attach_namespace(&mut self, spec: &str) -> Result<u32, String> {
        let spec = NamespaceSpec::parse(spec)?;
        let nsid = self.add_namespace(spec, None)?;
        lock(&self.shared).namespace_changed(nsid);
        Ok(nsid)
    }

    /// Hot-remove a namespace; its in-flight commands finish first.
    pub fn detach_namespace(&mut self, nsid: u32) -> Result<(), String> {
        let mut c = lock(&self.shared);
        if !c.namespaces.contains_key(&nsid) {
            return Err(format!("namespace {nsid} is not attached"));
        }
        c.drain();
        c.namespaces.remove(&nsid);
        c.namespace_changed(nsid);
        Ok(())
    }

    fn add_namespace(&mut self, spec: NamespaceSpec, fixed: Option<(u32, [u8; 16])>) -> Result<u32, String> {
        let block = lock(&self.shared).cfg.block_size;
        let (storage, bytes) = Storage::open(&spec.backend, block)?;
        if storage.is_file() {
            self.ensure_uring();
        }
        let mut c = lock(&self.shared);
        let nsid = match fixed {
            Some((id, _)) => id,
            None => (1..=config::MAX_NAMESPACES).find(|id| !c.namespaces.contains_key(id)).ok_or("every namespace ID is in use")?,
        };
        let uuid = match fixed {
            Some((_, u)) => u,
            None => new_uuid(&c.cfg.name, nsid),
        };
        let blocks = bytes / block as u64;
        c.namespaces.insert(nsid, Namespace { spec, storage, bytes, blocks, uuid });
        Ok(nsid)
    }

    /// The first file namespace brings the io_uring and its worker; without
    /// io_uring (old kernel, seccomp) file I/O runs synchronously.
    fn ensure_uring(&mut self) {
        if self.worker.is_some() {
            return;
        }
        let ring = match Uring::new(URING_DEPTH) {
            Ok(r) => Arc::new(r),
            Err(e) => {
                tracing::warn!("io_uring unavailable ({e}); nvme file I/O runs synchronously");
                return;
            }
        };
        let cv = {
            let mut c = lock(&self.shared);
            c.uring = Some(ring.clone());
            c.worker_cv.clone()
        };
        let shared = self.shared.clone();
        let worker = std::thread::Builder::new().name(format!("{}-io", self.name)).spawn(move || {
            let mut c = lock_raw(&shared);
            // After it posted completions the worker keeps waiting on the
            // ring even with nothing in flight: while the host streams
            // writes (which io_uring finishes asynchronously) the next
            // request's completion then wakes it directly, one wakeup per
            // command instead of a condition-variable wakeup plus the ring's.
            // The first wakeup that finds nothing to reap (a request that
            // finished inline) sends it back to the condition variable.
            let mut wait_on_ring = false;
            let result = c.jobs.result.clone();
            loop {
                if c.stop {
                    return;
                }
                if let Some(slot) = c.jobs.queue.pop_front() {
                    c.jobs.start(slot);
                    let Some(op) = c.inflight.get(slot as usize).and_then(|s| s.as_ref()) else {
                        c.jobs.running = None;
                        continue;
                    };
                    let (fd, iov, n, off, dsync) = (op.fd, op.iov.as_ptr() as usize, op.iov.len(), op.off, op.dsync);
                    drop(c);
                    // SAFETY: the slot (and its iovecs) stays until this
                    // request is finished, by this thread or by a drain
                    // that waits for `result` first.
                    let res = unsafe { jobs::pwritev(fd, iov as *const libc::iovec, n, off, dsync) };
                    jobs::publish(&result, res);
                    c = lock_raw(&shared);
                    if let Some((slot, res)) = c.jobs.take_finished() {
                        c.finish_inflight(slot, res);
                    }
                    continue;
                }
                if c.inflight_count == 0 && !wait_on_ring {
                    // Nothing asynchronous outstanding: sleep until a
                    // submission leaves something in flight.
                    c.worker_idle = true;
                    c = cv.wait(c).unwrap_or_else(|e| e.into_inner());
                    c.worker_idle = false;
                    continue;
                }
                c.worker_on_ring = true;
                drop(c);
                ring.wait();
                c = lock_raw(&shared);
                c.worker_on_ring = false;
                wait_on_ring = c.reap() > 0;
            }
        });
        match worker {
            Ok(w) => self.worker = Some(w),
            Err(e) => {
                tracing::warn!("nvme worker thread: {e}; file I/O runs synchronously");
                lock(&self.shared).uring = None;
            }
        }
    }

    pub fn stats(&self) -> serde_json::Value {
        let c = lock(&self.shared);
        let k = &c.counters;
        let io_queues = c.sqs.iter().skip(1).filter(|q| q.is_some()).count();
        serde_json::json!({
            "name": c.cfg.name,
            "enabled": c.regs.cc & 1 != 0,
            "ready": c.ready(),
            "fatal": c.regs.csts & spec::CSTS_CFS != 0,
            "commands": k.commands,
            "admin_commands": k.admin_commands,
            "errors": k.errors,
            "reads": k.reads,
            "writes": k.writes,
            "bytes_read": k.bytes_read,
            "bytes_written": k.bytes_written,
            "flushes": k.flushes,
            "async_events": k.async_events,
            "doorbell_errors": k.doorbell_errors,
            "fatal_events": k.fatal,
            "inflight": c.inflight_count,
            "io_queues": io_queues,
            "paused": c.paused,
            "namespaces": c.namespaces.iter().map(|(id, ns)| serde_json::json!({
                "nsid": id, "bytes": ns.bytes, "backend": format!("{:?}", ns.spec.backend),
            })).collect::<Vec<_>>(),
        })
    }
}

fn new_uuid(name: &str, nsid: u32) -> [u8; 16] {
    use std::hash::{Hash, Hasher};
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    let mut out = [0u8; 16];
    for (i, half) in out.chunks_mut(8).enumerate() {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (name, nsid, now, std::process::id(), i).hash(&mut h);
        half.copy_from_slice(&h.finish().to_le_bytes());
    }
    out[6] = (out[6] & 0x0f) | 0x40; // version 4 layout
    out[8] = (out[8] & 0x3f) | 0x80;
    out
}

impl BusDevice for NvmeController {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset < spec::DOORBELL_BASE {
            lock(&self.shared).read_reg(offset, data);
        } else {
            data.fill(0); // doorbells read as zero
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let mut c = lock(&self.shared);
        if offset < spec::DOORBELL_BASE {
            c.write_reg(offset, data);
        } else if offset < Self::BAR0_SIZE {
            c.doorbell(offset, data);
        }
    }
}

impl PciFunction for NvmeController {
    fn pci_config(&mut self) -> &mut PciConfig {
        &mut self.pci
    }
}

impl Lifecycle for NvmeController {
    /// Finish every in-flight request (its completion is posted) and stop
    /// fetching: afterwards the device does not touch guest memory.
    fn pause(&mut self) {
        let mut c = lock(&self.shared);
        c.drain();
        c.paused = true;
    }

    /// Run again, picking up submissions that arrived or were left in the
    /// queues (for example by a restore).
    fn resume(&mut self) {
        let mut c = lock(&self.shared);
        c.paused = false;
        c.blocked.clear();
        if c.ready() {
            c.deliver_events();
            for qid in 0..c.sqs.len() as u16 {
                c.process_sq(qid);
            }
            c.submit_uring();
        }
    }
}

impl Drop for NvmeController {
    fn drop(&mut self) {
        if let Some(w) = self.worker.take() {
            {
                let mut c = lock(&self.shared);
                c.drain();
                c.stop = true;
                c.worker_cv.notify_one();
                if let Some(u) = &c.uring {
                    u.push_stop();
                }
            }
            let _ = w.join();
        }
    }
}
