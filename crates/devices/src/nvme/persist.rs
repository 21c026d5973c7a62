//! Save and restore of the whole controller.
//!
//! The section holds a JSON document shaped after NVMe 2.1's migration
//! "NVMe Controller State" (per-queue base, size, IDs, attributes, head and
//! tail pointers, phase) plus what that structure leaves to the vendor part:
//! registers, features, outstanding AERs and undelivered events, logs and
//! namespaces. Memory namespaces append their non-zero 64 KiB chunks.
//!
//! Nothing is ever in flight in a saved state: `save` drains the io_uring
//! first, so every fetched command has its completion posted; commands the
//! host queued but the controller did not fetch stay in the SQ (head != tail)
//! and run once on the destination.
//!
//! Compatibility: a newer vmm restores an older save. Fields added after
//! version 1 carry `#[serde(default)]` (here and in the structs the document
//! embeds), so a document saved without them restores with their power-on
//! value; `VERSION` moves only when an old save could no longer be read
//! correctly that way, and a save from a newer version is refused.

use super::backend::Storage;
use super::config::{BackendSpec, NamespaceSpec};
use super::ctrl::{Aer, Counters, ErrorEntry, Features, Namespace, Regs};
use super::queues::{Cq, Sq};
use super::{lock, NvmeController};
use serde::{Deserialize, Serialize};
use snapshot::{Persist, Result, Section, StateError};

/// The newest layout this code writes; it reads every version up to it.
const VERSION: u32 = 1;
const MAGIC: &[u8; 4] = b"NVMS";
const CHUNK: usize = 64 << 10;

#[derive(Serialize, Deserialize)]
struct SavedNamespace {
    nsid: u32,
    spec: NamespaceSpec,
    uuid: [u8; 16],
    bytes: u64,
}

#[derive(Serialize, Deserialize)]
struct SavedController {
    queues: u16,
    depth: u32,
    block_size: u32,
    regs: Regs,
    sqs: Vec<Sq>,
    cqs: Vec<Cq>,
    features: Features,
    // What the controller reports rather than what it needs to run: a save
    // that lacks it restores with the power-on (empty) value.
    #[serde(default)]
    aer: Aer,
    #[serde(default)]
    changed_ns: Vec<u32>,
    #[serde(default)]
    error_log: Vec<ErrorEntry>,
    #[serde(default)]
    error_count: u64,
    #[serde(default)]
    counters: Counters,
    namespaces: Vec<SavedNamespace>,
}

fn mismatch(name: &str, why: String) -> StateError {
    StateError::Mismatch { name: name.to_string(), why }
}

impl Persist for NvmeController {
    fn state_name(&self) -> String {
        self.name.clone()
    }

    fn save(&self) -> Result<Section> {
        let mut c = lock(&self.shared);
        c.drain();
        let saved = SavedController {
            queues: c.cfg.queues,
            depth: c.cfg.depth,
            block_size: c.cfg.block_size,
            regs: c.regs.clone(),
            sqs: c.sqs.iter().flatten().cloned().collect(),
            cqs: c.cqs.iter().flatten().cloned().collect(),
            features: c.features.clone(),
            aer: c.aer.clone(),
            changed_ns: c.changed_ns.iter().copied().collect(),
            error_log: c.error_log.iter().copied().collect(),
            error_count: c.error_count,
            counters: c.counters.clone(),
            namespaces: c
                .namespaces
                .iter()
                .map(|(id, ns)| SavedNamespace { nsid: *id, spec: ns.spec.clone(), uuid: ns.uuid, bytes: ns.bytes })
                .collect(),
        };
        let json = serde_json::to_vec(&saved).map_err(|e| StateError::Damaged(e.to_string()))?;
        let mut data = Vec::with_capacity(json.len() + 8);
        data.extend_from_slice(MAGIC);
        data.extend_from_slice(&(json.len() as u32).to_le_bytes());
        data.extend_from_slice(&json);
        for ns in c.namespaces.values() {
            if let Storage::Memory(v) = &ns.storage {
                let chunks: Vec<(usize, &[u8])> = v.chunks(CHUNK).enumerate().filter(|(_, c)| c.iter().any(|&b| b != 0)).collect();
                data.extend_from_slice(&(chunks.len() as u64).to_le_bytes());
                for (i, chunk) in chunks {
                    data.extend_from_slice(&((i * CHUNK) as u64).to_le_bytes());
                    data.extend_from_slice(&(chunk.len() as u32).to_le_bytes());
                    data.extend_from_slice(chunk);
                }
            }
        }
        if data.len() > Section::MAX_DATA {
            return Err(mismatch(&self.name, format!("state of {} bytes is too large (memory namespaces too full)", data.len())));
        }
        Ok(Section { name: self.name.clone(), version: VERSION, data })
    }

    fn restore(&mut self, section: &Section) -> Result<()> {
        let name = self.name.clone();
        if section.version == 0 || section.version > VERSION {
            return Err(StateError::Version { name, found: section.version, expected: VERSION });
        }
        let d = &section.data;
        let damaged = |why: &str| StateError::Decode { name: name.clone(), why: why.to_string() };
        if d.len() < 8 || &d[0..4] != MAGIC {
            return Err(damaged("not an nvme state"));
        }
        let jlen = u32::from_le_bytes(d[4..8].try_into().unwrap()) as usize;
        let json = d.get(8..8 + jlen).ok_or_else(|| damaged("truncated"))?;
        let saved: SavedController = serde_json::from_slice(json).map_err(|e| damaged(&e.to_string()))?;
        let mut rest = &d[8 + jlen..];

        // Check the saved state fits this controller before changing anything.
        {
            let c = lock(&self.shared);
            if (saved.queues, saved.depth, saved.block_size) != (c.cfg.queues, c.cfg.depth, c.cfg.block_size) {
                return Err(mismatch(
                    &name,
                    format!(
                        "saved queues/depth/block {}/{}/{} but this controller has {}/{}/{}",
                        saved.queues, saved.depth, saved.block_size, c.cfg.queues, c.cfg.depth, c.cfg.block_size
                    ),
                ));
            }
            let n = c.sqs.len();
            let bad_q =
                saved.sqs.iter().any(|q| q.qid as usize >= n || q.cqid as usize >= n || q.size < 2 || q.head >= q.size || q.tail >= q.size)
                    || saved.cqs.iter().any(|q| q.qid as usize >= n || q.size < 2 || q.head >= q.size || q.tail >= q.size);
            if bad_q {
                return Err(damaged("queue state out of range"));
            }
        }
        // Rebuild namespaces (hot-added ones included) from the saved specs.
        let block = saved.block_size as u64;
        let mut namespaces = Vec::new();
        for sn in &saved.namespaces {
            let (mut storage, bytes) = Storage::open(&sn.spec.backend, saved.block_size).map_err(|e| mismatch(&name, e))?;
            if bytes != sn.bytes {
                return Err(mismatch(&name, format!("namespace {} has {} bytes here, {} in the state", sn.nsid, bytes, sn.bytes)));
            }
            if let Storage::Memory(v) = &mut storage {
                let count = take_u64(&mut rest).ok_or_else(|| damaged("truncated namespace data"))?;
                for _ in 0..count {
                    let off = take_u64(&mut rest).ok_or_else(|| damaged("truncated namespace data"))? as usize;
                    let len = take_u32(&mut rest).ok_or_else(|| damaged("truncated namespace data"))? as usize;
                    let src = rest.get(..len).ok_or_else(|| damaged("truncated namespace data"))?;
                    let dst =
                        off.checked_add(len).and_then(|e| v.get_mut(off..e)).ok_or_else(|| damaged("namespace chunk out of range"))?;
                    dst.copy_from_slice(src);
                    rest = &rest[len..];
                }
            }
            namespaces.push((sn.nsid, Namespace { spec: sn.spec.clone(), storage, bytes, blocks: bytes / block, uuid: sn.uuid }));
        }
        if saved.namespaces.iter().any(|n| matches!(n.spec.backend, BackendSpec::File { .. })) {
            self.ensure_uring();
        }
        let mut c = lock(&self.shared);
        c.drain();
        c.regs = saved.regs;
        c.sqs.iter_mut().for_each(|q| *q = None);
        c.cqs.iter_mut().for_each(|q| *q = None);
        for q in saved.sqs {
            let i = q.qid as usize;
            c.sqs[i] = Some(q);
        }
        for q in saved.cqs {
            let i = q.qid as usize;
            c.cqs[i] = Some(q);
        }
        c.blocked.clear();
        c.features = saved.features;
        c.aer = saved.aer;
        c.changed_ns = saved.changed_ns.into_iter().collect();
        c.error_log = saved.error_log.into_iter().collect();
        c.error_count = saved.error_count;
        c.counters = saved.counters;
        c.namespaces = namespaces.into_iter().collect();
        Ok(())
    }
}

fn take_u64(r: &mut &[u8]) -> Option<u64> {
    let v = u64::from_le_bytes(r.get(..8)?.try_into().ok()?);
    *r = &r[8..];
    Some(v)
}

fn take_u32(r: &mut &[u8]) -> Option<u32> {
    let v = u32::from_le_bytes(r.get(..4)?.try_into().ok()?);
    *r = &r[4..];
    Some(v)
}
