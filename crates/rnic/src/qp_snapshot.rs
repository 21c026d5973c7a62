//! The saved transport state of an RC QP: what query-suspended returns and
//! create-suspended takes (docs/rdma-migration.md). Plain serialisable data,
//! below both the control protocol (`proto`) and the transport (`qp`), which
//! fills and reads it.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use crate::types::QpAttr;

/// Responder's write in progress (between WRITE_FIRST and WRITE_LAST).
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct WriteCtx {
    pub va: u64,
    pub rkey: u32,
    pub remaining: u64,
    pub total: u64,
    /// The rkey's generation at the message's first packet (`keys`): a
    /// later packet finding another one is refused, never half placed.
    #[serde(default)]
    pub key_gen: u64,
}

/// A response the responder still has to send, in PSN order.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub enum RespJob {
    Ack {
        psn: u32,
        syndrome: u8,
    },
    AtomicAck {
        psn: u32,
        orig: u64,
    },
    Read {
        psn: u32,
        va: u64,
        rkey: u32,
        remaining: u64,
        first: bool,
        /// The rkey generation the READ reads (as `WriteCtx`): fixed by
        /// its first response packet (None until then), or by the first
        /// answer of the READ a duplicate resends (`ReadExec`).
        #[serde(default)]
        key_gen: Option<u64>,
        /// Answers a duplicate: if its binding is gone it stops silently
        /// (the requester may not need it; one that does times out).
        #[serde(default)]
        resent: bool,
    },
}

/// A READ the responder executed, kept while its requester may still send
/// it again: a duplicate, whole or from the middle, reads the binding the
/// first answer read, or is refused; never a mix of two bindings.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ReadExec {
    /// PSNs of its first and last response.
    pub psn: u32,
    pub last: u32,
    pub rkey: u32,
    /// The rkey's generation when the first response went out.
    pub key_gen: Option<u64>,
}

/// The transport state of a QP: everything but its queues and timers.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct QpRuntime {
    // requester
    /// PSN the next pulled WQE starts at.
    pub next_psn: u32,
    /// Oldest unacknowledged PSN.
    pub una: u32,
    /// Next PSN to (re)transmit.
    pub tx_psn: u32,
    /// One past the highest PSN ever transmitted.
    pub max_sent: u32,
    pub retry_left: u8,
    pub rnr_left: u8,
    /// Packets the requester may have unacknowledged now (<= the window):
    /// cut after a timeout, grown by every ACKed packet, so
    /// that a go-back-N retransmission after a stall is not a full window.
    #[serde(default)]
    pub cwnd: u32,
    // responder
    pub epsn: u32,
    pub msn: u32,
    /// Bytes already placed into the head receive WQE by a multi-packet SEND.
    pub recv_offset: u64,
    pub in_send: bool,
    pub write: Option<WriteCtx>,
    pub atomic_results: VecDeque<(u32, u64)>,
    /// The latest READs executed (as many as atomics replayed).
    #[serde(default)]
    pub read_history: VecDeque<ReadExec>,
    pub nak_sent: bool,
    pub resp_queue: VecDeque<RespJob>,
    /// Send WQEs retired (completed, signaled or not) since the QP was
    /// created: the owner reposts its WRs from this index on after a move.
    #[serde(default)]
    pub sq_retired: u64,
    /// Receive WQEs retired since the QP was created (the same for RECVs).
    #[serde(default)]
    pub rq_retired: u64,
    /// A QP on a shared receive queue (`crate::srq`): the receive WQE it took
    /// from the SRQ for the SEND it is in the middle of (`in_send`); the
    /// restored QP finishes that message into it.
    #[serde(default)]
    pub srq_wqe: Option<SavedRecv>,
}

/// A receive WQE outside any ring, as migration state carries it.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct SavedRecv {
    pub wr_id: u64,
    /// (address, length, lkey) of each SGE.
    pub sge: Vec<(u64, u32, u32)>,
}

/// Version of [`QpSnapshot`]; bump on any change of its meaning.
pub const QP_SNAPSHOT_VERSION: u32 = 1;

/// The runtime state of a suspended RC QP, as query-suspended returns it and
/// create-suspended takes it (docs/rdma-migration.md). Posted WRs are not in
/// it: the owner reposts those from `runtime.sq_retired` / `rq_retired` on.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct QpSnapshot {
    pub version: u32,
    pub qpn: u32,
    pub attr: QpAttr,
    pub runtime: QpRuntime,
}
