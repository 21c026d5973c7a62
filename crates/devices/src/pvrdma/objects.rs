//! The device's object tables: user contexts, PDs, MRs, CQs, SRQs and QPs, each
//! keyed by the handle the guest uses. Handles are small (below the table's
//! capacity, which is what the device reports as its maximum), because the
//! Linux driver indexes its own tables with `handle % max`.

use std::collections::{BTreeMap, VecDeque};

use pvrdma_abi::{Cqe, QpAttr, RqWqeHdr, Sge, SqWqeHdr};
use serde::{Deserialize, Serialize};

use super::guest::PageList;

/// Objects of one kind, by handle.
pub(crate) struct Table<T> {
    items: BTreeMap<u32, T>,
    cap: u32,
}

impl<T> Table<T> {
    pub fn new(cap: u32) -> Self {
        Table { items: BTreeMap::new(), cap }
    }

    /// The smallest free handle (from 1), or `None` when the table is full.
    pub fn free_handle(&self) -> Option<u32> {
        (1..self.cap).find(|h| !self.items.contains_key(h))
    }

    pub fn insert(&mut self, handle: u32, v: T) {
        self.items.insert(handle, v);
    }
    pub fn get(&self, h: u32) -> Option<&T> {
        self.items.get(&h)
    }
    pub fn get_mut(&mut self, h: u32) -> Option<&mut T> {
        self.items.get_mut(&h)
    }
    pub fn remove(&mut self, h: u32) -> Option<T> {
        self.items.remove(&h)
    }
    pub fn contains(&self, h: u32) -> bool {
        self.items.contains_key(&h)
    }
    pub fn len(&self) -> usize {
        self.items.len()
    }
    pub fn iter(&self) -> impl Iterator<Item = (&u32, &T)> {
        self.items.iter()
    }
    pub fn handles(&self) -> Vec<u32> {
        self.items.keys().copied().collect()
    }
    pub fn clear(&mut self) {
        self.items.clear();
    }
}

/// A user context (CREATE_UC): its UAR page.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Uc {
    pub pfn: u64,
}

pub(crate) struct Pd {
    pub ctx_handle: u32,
    pub pd: verbs::Pd,
}

/// What a memory region is, kept to re-register it after a restore.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct MrInfo {
    pub pd_handle: u32,
    /// The guest's I/O virtual address of byte 0 (what SGEs and peers use).
    pub start: u64,
    pub length: u64,
    pub access: u32,
    pub flags: u32,
    /// Where the region's bytes are in guest RAM (offsets in the RAM
    /// memfd): `(gpa, len)` runs laid end to end, consecutive pages merged.
    pub runs: Vec<(u64, u64)>,
    /// lkey = rkey, the namespace's own.
    pub key: u32,
}

impl MrInfo {
    /// Where bytes [off, off+len) of the region are in guest RAM: `(gpa,
    /// len)` pieces in order, clipped at the region's end.
    pub fn gpa_runs(&self, off: u64, len: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        let end = off.saturating_add(len).min(self.length);
        let mut run_start = 0u64;
        self.runs.iter().filter_map(move |&(gpa, n)| {
            let (s, e) = (run_start.max(off), (run_start + n).min(end));
            let piece = (s < e).then(|| (gpa + (s - run_start), e - s));
            run_start += n;
            piece
        })
    }

    /// Whether every run lies inside guest RAM of `ram_size` bytes and the
    /// runs cover exactly the region.
    pub fn runs_valid(&self, ram_size: u64) -> bool {
        let inside = self.runs.iter().all(|&(gpa, n)| n > 0 && gpa.checked_add(n).is_some_and(|e| e <= ram_size));
        inside && self.runs.iter().try_fold(0u64, |t, r| t.checked_add(r.1)) == Some(self.length)
    }
}

pub(crate) struct Mr {
    pub info: MrInfo,
    /// Dropping it deregisters the region in rnicd.
    pub mr: verbs::Mr,
}

/// The guest-visible side of a CQ: its ring in guest memory.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct CqRing {
    pub ctx_handle: u32,
    /// Entries (a power of two).
    pub entries: u32,
    pub pages: PageList,
    /// The producer index the device publishes (`rx.prod_tail`).
    pub tail: u32,
    /// 0, `CQ_FLAG_ARMED` or `CQ_FLAG_ARMED_SOL`.
    pub armed: u32,
    /// Completions taken from rnicd that did not fit the guest ring yet.
    #[serde(with = "pod_list")]
    pub pending: VecDeque<Cqe>,
}

pub(crate) struct Cq {
    pub ring: CqRing,
    pub cq: verbs::Cq,
    /// rnicd's CQ overran (it was given more completions than it holds):
    /// those are lost and it takes no more; the guest was told (CQ_ERR).
    pub overran: bool,
}

/// A queue of guest WQEs in a QP's pages.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct WqQueue {
    /// WQE slots (a power of two).
    pub wqe_cnt: u32,
    pub max_sge: u32,
    /// Bytes per slot.
    pub stride: u32,
    /// Byte offset of slot 0 in the QP's page list.
    pub offset: u64,
    /// Byte offset of this queue's `Ring` (prod_tail, then cons_head) in
    /// the QP's page list.
    pub ring_offset: u64,
    /// The consumer index the device publishes (`cons_head`).
    pub head: u32,
    /// Sequence number of the next WQE handed to rnicd (its wr_id there).
    pub next_seq: u64,
}

/// A send WQE taken from the guest ring and not yet seen complete: the
/// device's own copy, because the guest may reuse the slot once `cons_head`
/// passes it. These copies are what a restore reposts.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct OutSend {
    pub seq: u64,
    #[serde(with = "pod_bytes")]
    pub hdr: SqWqeHdr,
    #[serde(with = "sge_list")]
    pub sges: Vec<Sge>,
}

/// A receive WQE taken from the guest ring and not yet seen complete.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct OutRecv {
    pub seq: u64,
    #[serde(with = "pod_bytes")]
    pub hdr: RqWqeHdr,
    #[serde(with = "sge_list")]
    pub sges: Vec<Sge>,
}

/// The guest-visible side of a QP.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct QpInfo {
    pub qpn: u32,
    pub pd_handle: u32,
    pub send_cq: u32,
    pub recv_cq: u32,
    pub sq_sig_all: bool,
    pub pages: PageList,
    pub sq: WqQueue,
    pub rq: WqQueue,
    /// Attributes as last set by MODIFY_QP (QUERY_QP reads rnicd's).
    #[serde(with = "pod_bytes")]
    pub attr: QpAttr,
    /// The device stopped taking WQEs from this QP's rings after bad input.
    pub broken: bool,
    pub sq_out: VecDeque<OutSend>,
    pub rq_out: VecDeque<OutRecv>,
}

pub(crate) struct Qp {
    pub info: QpInfo,
    pub qp: verbs::Qp,
}

/// The guest-visible side of a shared receive queue: its ring in guest
/// memory (page 0 the ring state, whose `rx` ring the driver produces into;
/// WQEs from page 1, receive-WQE layout) and the WQEs taken from it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct SrqInfo {
    pub pd_handle: u32,
    pub pages: PageList,
    /// The receive queue in those pages: `ring_offset` is the ring state's
    /// `rx`, `head` the consumer index the device publishes, `next_seq` the
    /// sequence of the next WQE handed to rnicd's SRQ (its wr_id there,
    /// and its place in that SRQ's order since it was first created).
    pub rq: WqQueue,
    /// ARM LIMIT (`srq_limit`): 0, or the count of posted WQEs below
    /// which the device raises SRQ_LIMIT_REACHED once and disarms.
    pub limit: u32,
    /// The device stopped reading this SRQ's ring after bad input.
    pub broken: bool,
    /// QPs (handles) created with `is_srq` on this SRQ.
    pub qps: Vec<u32>,
    /// WQEs handed to rnicd and not yet seen complete, in posting order
    /// (they complete in the order messages arrive, across QPs).
    pub out: VecDeque<OutRecv>,
}

pub(crate) struct Srq {
    pub info: SrqInfo,
    pub srq: verbs::Srq,
}

/// Interface structures as byte arrays in saved state.
pub(crate) mod pod_bytes {
    use pvrdma_abi::Pod;
    use serde::{Deserialize, Deserializer, Serializer};
    pub fn serialize<T: Pod, S: Serializer>(v: &T, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(v.as_bytes().iter())
    }
    pub fn deserialize<'de, T: Pod, D: Deserializer<'de>>(d: D) -> Result<T, D::Error> {
        let v: Vec<u8> = Vec::deserialize(d)?;
        if v.len() != std::mem::size_of::<T>() {
            return Err(serde::de::Error::custom("wrong structure size"));
        }
        T::read_from(&v).ok_or_else(|| serde::de::Error::custom("short structure"))
    }
}

pub(crate) mod pod_list {
    use pvrdma_abi::Pod;
    use serde::{Deserialize, Deserializer, Serializer};
    use std::collections::VecDeque;
    pub fn serialize<T: Pod, S: Serializer>(v: &VecDeque<T>, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(v.iter().map(|x| x.as_bytes().to_vec()))
    }
    pub fn deserialize<'de, T: Pod, D: Deserializer<'de>>(d: D) -> Result<VecDeque<T>, D::Error> {
        let v: Vec<Vec<u8>> = Vec::deserialize(d)?;
        v.iter()
            .map(|b| if b.len() == std::mem::size_of::<T>() { T::read_from(b) } else { None })
            .collect::<Option<VecDeque<T>>>()
            .ok_or_else(|| serde::de::Error::custom("wrong structure size"))
    }
}

pub(crate) mod sge_list {
    use pvrdma_abi::Sge;
    use serde::{Deserialize, Deserializer, Serializer};
    pub fn serialize<S: Serializer>(v: &[Sge], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(v.iter().map(|g| (g.addr, g.length, g.lkey)))
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Sge>, D::Error> {
        let v: Vec<(u64, u32, u32)> = Vec::deserialize(d)?;
        Ok(v.into_iter().map(|(addr, length, lkey)| Sge { addr, length, lkey }).collect())
    }
}
