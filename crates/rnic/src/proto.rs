//! The control protocol between a client (the verbs crate) and rnicd.
//!
//! One SOCK_SEQPACKET unix connection per client; each message is one JSON
//! object, file descriptors (memfds, eventfds) travel as SCM_RIGHTS beside it
//! (the `fdmsg` crate sends and receives them).
//! A message larger than one datagram travels in a memfd (`Spilled`).
//! The data path does not use this socket: it uses the shared rings.

use serde::{Deserialize, Serialize};

use crate::types::{DeviceAttr, PortAttr, QpAttr, QpCap};

pub mod spill;

/// 3: QP states and traces travel spilled in bincode (`spill`).
/// 4: a send ring's header says how many WQEs rnicd is done with
/// (`ring::RingHeader::done`), which a client's queue depth counts on.
pub const PROTO_VERSION: u32 = 4;
/// Most QPNs in one batched request.
pub const MAX_BATCH: usize = 4096;
/// Most QP states in one QueryQpStates or RestoreQps (larger than one
/// datagram, the message spills into a memfd: `spill`).
pub const MAX_QUERY_BATCH: usize = MAX_BATCH;
/// Most objects in one CreateBatch (a migrated device's MRs and CQs, then
/// its QPs, one request each at hundreds of QPs).
pub const MAX_CREATE_BATCH: usize = 1024;
/// Most MRs in one FetchTraces (a report holds up to 1,024 runs: the worst
/// reply is a few MiB, spilled).
pub const MAX_TRACE_BATCH: usize = 256;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Request {
    /// First message; carries the client's doorbell eventfd.
    /// `namespace`: the GID (IPv4 address) of the RDMA namespace the client
    /// works in; none means the daemon's own address. A namespace is created
    /// on first use and goes away with its last client.
    Hello {
        version: u32,
        #[serde(default)]
        namespace: Option<std::net::Ipv4Addr>,
    },
    QueryDevice,
    QueryPort {
        port: u8,
    },
    QueryGid {
        port: u8,
        index: u32,
    },
    AllocPd,
    DeallocPd {
        pd: u32,
    },
    /// Carries the memfd; `fd_offset` is where `iova` lives in it.
    /// `key`: the lkey/rkey the caller wants (refused if taken in the namespace).
    RegMr {
        pd: u32,
        iova: u64,
        len: u64,
        access: u32,
        fd_offset: u64,
        #[serde(default)]
        key: Option<u32>,
    },
    /// RegMr over several runs `(fd_offset, len)` of the memfd laid end to
    /// end from `iova` (a scattered region, as a guest's pages are): at most
    /// `mem::MAX_REGION_RUNS`, each inside the memfd, boundaries between
    /// runs on pages (docs/rnic.md).
    RegMrRuns {
        pd: u32,
        iova: u64,
        access: u32,
        runs: Vec<(u64, u64)>,
        #[serde(default)]
        key: Option<u32>,
    },
    DeregMr {
        lkey: u32,
    },
    /// Starts (clearing) a write trace of the MR with blocks of `granularity`
    /// bytes (a power of two >= 512); 0 stops it.
    TraceMr {
        lkey: u32,
        granularity: u64,
    },
    /// Returns the MR's dirty blocks since the last fetch and clears them.
    FetchTrace {
        lkey: u32,
    },
    /// An indirect key (docs/mkeys.md): no memory until a bind work request
    /// binds it; at most `max_entries` (<= keys::MAX_KLM) ranges per bind.
    /// `key`: the key the caller wants (refused if taken in the namespace).
    CreateIndirectKey {
        pd: u32,
        max_entries: u32,
        #[serde(default)]
        key: Option<u32>,
    },
    /// Destroys an indirect key or an alias of the caller.
    DestroyKey {
        key: u32,
    },
    /// Lets client `grantee` of this namespace alias the caller's `key`
    /// (an MR or an indirect key).
    GrantKey {
        key: u32,
        grantee: u64,
    },
    /// Takes a grant back: the grantee's aliases of `key` turn stale.
    RevokeKey {
        key: u32,
        grantee: u64,
    },
    /// An alias, in the caller's `pd`, of client `owner`'s `key`; it is
    /// live while that key is not rebound, destroyed or revoked.
    CreateAlias {
        pd: u32,
        owner: u64,
        key: u32,
        #[serde(default)]
        alias: Option<u32>,
        /// The owner's namespace (GID) when it is not the caller's: the
        /// key of another namespace of this rnicd.
        #[serde(default)]
        owner_namespace: Option<std::net::Ipv4Addr>,
    },
    /// Whether the caller's alias `key` still reaches what it was made for.
    QueryAlias {
        key: u32,
    },
    /// Carries the channel's eventfd.
    CreateCompChannel,
    DestroyCompChannel {
        channel: u32,
    },
    /// Carries the CQ ring memfd.
    CreateCq {
        cap: u32,
        channel: Option<u32>,
    },
    DestroyCq {
        cq: u32,
    },
    /// Carries a new CQ ring memfd of `cap` entries (ibv_resize_cq): rnicd
    /// writes the CQ's completions there from now on, keeping its arm; the
    /// client hands out what is left in the old ring first.
    ResizeCq {
        cq: u32,
        cap: u32,
    },
    /// Before ibv_resize_cq judges a shrink: rnicd takes the WQEs the
    /// client's QPs on this CQ have posted and completes now what completes
    /// without a peer (UD sends, flushes of a QP in ERR), then replies `Ok`.
    /// The CQ's ring then holds every completion a hardware CQ would by the
    /// time the program resizes; the client counts them there.
    SettleCq {
        cq: u32,
    },
    /// Carries the SQ ring memfd then the RQ ring memfd.
    /// `qpn`: the QPN the caller wants (refused if taken in the namespace).
    CreateQp {
        pd: u32,
        send_cq: u32,
        recv_cq: u32,
        cap: QpCap,
        sq_sig_all: bool,
        sq_slots: u32,
        rq_slots: u32,
        #[serde(default)]
        qpn: Option<u32>,
        /// Create-suspended: the QP starts from this state (its QPN unless
        /// `qpn` says otherwise) and stays suspended until ResumeQp.
        #[serde(default)]
        restore: Option<Box<crate::qp_snapshot::QpSnapshot>>,
        /// RC unless said otherwise.
        #[serde(default)]
        qp_type: crate::types::QpType,
    },
    ModifyQp {
        qpn: u32,
        attr: QpAttr,
        mask: u32,
    },
    QueryQp {
        qpn: u32,
    },
    DestroyQp {
        qpn: u32,
    },
    /// Stop all processing and host memory access; the peer sees RNR NAKs.
    SuspendQp {
        qpn: u32,
    },
    /// The runtime state of a suspended QP.
    QueryQpState {
        qpn: u32,
    },
    ResumeQp {
        qpn: u32,
    },
    /// Batched forms for moving many QPs at once (all checked first, then
    /// applied, so a refused batch changes nothing; a QPN named again is
    /// suspended or resumed once; at most MAX_BATCH QPNs; query replies
    /// are one message, so clients ask for at most MAX_QUERY_BATCH states
    /// at a time).
    SuspendQps {
        qpns: Vec<u32>,
    },
    QueryQpStates {
        qpns: Vec<u32>,
    },
    ResumeQps {
        qpns: Vec<u32>,
    },
    /// Create-suspended in two steps, for many QPs: QPs created ahead (with
    /// the QPNs of the states, still in RESET) take these states and become
    /// suspended. All QPs (the caller's, each named once, in RESET and not
    /// suspended) and states are checked first, then applied. At most
    /// MAX_QUERY_BATCH states per request.
    RestoreQps {
        states: Vec<crate::qp_snapshot::QpSnapshot>,
    },
    /// Each state goes into the QP of its QPN, made to await its state
    /// (`Create::Qp { await_state }`) and still without one, which stays
    /// suspended until ResumeQps: a migration's destination builds its QPs
    /// ahead and loads only their states at the switch. All QPs and states
    /// are checked first, then applied; any other QP (one that ran, one
    /// that has its state already) is refused. At most MAX_QUERY_BATCH
    /// states.
    LoadQpStates {
        states: Vec<crate::qp_snapshot::QpSnapshot>,
    },
    Stats,
    /// The transport state of every QP and SRQ in every namespace of this
    /// rnicd (PSNs, window, timers, queues: `qp::debug`), for operators and
    /// failing tests. Reply: `QpDump`.
    DumpQps,
    /// Carries one end of a vmm's RAM-client socket (`ram-client`): rnicd
    /// joins it, so that in an incoming postcopy its accesses to guest RAM
    /// wait for pages not yet migrated. Not bound to the caller's namespace.
    JoinRamClient,
    /// Makes this host answer for the client's namespace GID: adds the
    /// address beside rnicd's own and announces it (gratuitous ARP). The
    /// owner claims on the host it moves to, after the old host released.
    ClaimGid,
    /// This host stops answering for the client's namespace GID (removes
    /// the address). A claimed GID is also released when its namespace
    /// closes.
    ReleaseGid,
    /// ClaimGid, then ResumeQps of `qpns` (at most MAX_BATCH), in one round
    /// trip: a migration's destination does both inside its downtime. The
    /// claim comes first, so the QPs' first packets (their resume NAKs)
    /// leave from a host that answers for the GID; a claim that fails
    /// resumes nothing.
    ClaimGidAndResumeQps {
        qpns: Vec<u32>,
    },
    /// Carries an eventfd that rnicd signals when it queues an asynchronous
    /// event for this client (async_events.rs).
    OpenAsync,
    /// Takes the asynchronous events queued for this client.
    FetchAsync,
    /// Suspends those of `qpns` that are connected (RTR, RTS or SQD) and
    /// leaves the others (RESET, INIT, ERR...) as they are: a migration's
    /// pause in one round trip, without asking each QP's state first. All
    /// QPNs are checked first (the caller's, at most MAX_BATCH); the reply
    /// (`Qpns`) lists the QPs now suspended, in the request's order.
    SuspendConnected {
        qpns: Vec<u32>,
    },
    /// SuspendConnected and QueryQpStates in one pass: replies with the
    /// states (`QpStates`) of the QPs it suspended, in the request's order.
    /// A suspended QP's state no longer changes, so a migration's source
    /// takes the states at the pause instead of asking again at the save.
    SuspendConnectedStates {
        qpns: Vec<u32>,
    },
    /// SuspendConnectedStates, then FetchTraces of `lkeys`, in one pass: a
    /// migration's source pauses its device and takes the last traces in
    /// one round trip (once the QPs are suspended nothing writes their
    /// memory, so those traces are the last). Every QPN and key is checked
    /// before anything is suspended or cleared. At most MAX_BATCH QPNs and
    /// MAX_TRACE_BATCH keys; the reply is `Suspended`.
    SuspendAndFetchTraces {
        qpns: Vec<u32>,
        lkeys: Vec<u32>,
    },
    /// Creates MRs, CQs and QPs in one round trip (a migrated device's
    /// restore), in order, each as its own request would. The memfds
    /// travel once beside the message (the guest RAM for every MR, one
    /// memfd holding many rings); each item names its fd by index and the
    /// offset it lives at. All or nothing: if an item fails, those made
    /// before it are destroyed and the error names the item. At most
    /// MAX_CREATE_BATCH items; the reply (`Created`) has one reply per item.
    CreateBatch {
        items: Vec<Create>,
    },
    /// A shared receive queue (crate::srq); carries its ring memfd, a
    /// receive ring of `slots` (a power of two, at least `attr.max_wr`).
    /// `restore`: the state of an SRQ saved elsewhere (QuerySrqState).
    CreateSrq {
        pd: u32,
        attr: crate::srq::SrqAttr,
        slots: u32,
        #[serde(default)]
        restore: Option<crate::srq::SrqSnapshot>,
    },
    /// ibv_modify_srq: arms (or, with 0, disarms) the limit; resizing is
    /// refused.
    ModifySrq {
        srq: u32,
        #[serde(default)]
        max_wr: Option<u32>,
        #[serde(default)]
        srq_limit: Option<u32>,
    },
    QuerySrq {
        srq: u32,
    },
    /// Refused while a QP uses the SRQ (EBUSY, as drivers do).
    DestroySrq {
        srq: u32,
    },
    /// The QP (in RESET, or just created suspended) takes its receives from
    /// the SRQ from now on; its own receive ring is unused.
    AttachSrq {
        qpn: u32,
        srq: u32,
    },
    /// The state of an SRQ whose QPs are all suspended (crate::srq).
    QuerySrqState {
        srq: u32,
    },
    /// The write traces of many MRs (each as FetchTrace), in their order;
    /// all keys are checked first. At most MAX_TRACE_BATCH.
    FetchTraces {
        lkeys: Vec<u32>,
    },
    /// The request is `len` bytes in `format` in the message's last
    /// descriptor (a memfd): one larger than a datagram, or one that
    /// carries QP states (`spill`).
    Spilled {
        len: u64,
        #[serde(default)]
        format: spill::Format,
    },
}

/// One object of a CreateBatch; `fd` indexes the request's memfds.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Create {
    /// As RegMrRuns: `runs` of memfd `fd` laid end to end at `iova`.
    Mr { pd: u32, iova: u64, access: u32, fd: u8, runs: Vec<(u64, u64)>, key: Option<u32> },
    /// As CreateCq; the ring at `ring_offset` (page aligned).
    Cq { cap: u32, channel: Option<u32>, fd: u8, ring_offset: u64 },
    /// As CreateQp; both rings in memfd `fd` (page aligned offsets).
    Qp {
        pd: u32,
        send_cq: u32,
        recv_cq: u32,
        cap: QpCap,
        sq_sig_all: bool,
        sq_slots: u32,
        rq_slots: u32,
        qpn: Option<u32>,
        restore: Option<Box<crate::qp_snapshot::QpSnapshot>>,
        /// RC unless said otherwise.
        #[serde(default)]
        qp_type: crate::types::QpType,
        fd: u8,
        sq_offset: u64,
        rq_offset: u64,
        /// Made suspended with no state (RESET): it reads neither ring nor
        /// packet until LoadQpStates gives it one. Not with `restore`.
        #[serde(default)]
        await_state: bool,
        /// The peer's address the state will name, if the caller knows it:
        /// rnicd makes the host's neighbour entry for it ahead (an ARP
        /// request from the host's own address, never one for the GID),
        /// so the QP's first packet after its resume waits for no ARP.
        #[serde(default)]
        peer: Option<std::net::Ipv4Addr>,
    },
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Reply {
    Hello {
        gid: std::net::Ipv4Addr,
        client: u64,
    },
    Device(DeviceAttr),
    Port(PortAttr),
    Gid(std::net::Ipv4Addr),
    Pd(u32),
    Mr {
        lkey: u32,
        rkey: u32,
    },
    Key(u32),
    /// An alias and the range of its target at creation.
    Alias {
        key: u32,
        iova: u64,
        len: u64,
        access: u32,
    },
    AliasState {
        live: bool,
    },
    Channel(u32),
    Cq(u32),
    Qp {
        qpn: u32,
        cap: QpCap,
    },
    QpInfo {
        attr: QpAttr,
        cap: QpCap,
    },
    QpState(Box<crate::qp_snapshot::QpSnapshot>),
    QpStates(Vec<crate::qp_snapshot::QpSnapshot>),
    Trace(crate::trace::TraceReport),
    Stats(serde_json::Value),
    /// DumpQps: one object per namespace.
    QpDump(serde_json::Value),
    RamClient {
        ram_bytes: u64,
    },
    Ok,
    AsyncEvents(Vec<crate::async_events::AsyncEvent>),
    /// QPNs (SuspendConnected: the QPs it suspended).
    Qpns(Vec<u32>),
    /// CreateBatch: one reply per item (Mr, Cq or Qp).
    Created(Vec<Reply>),
    /// CreateSrq: its handle and the attributes it got.
    Srq {
        srq: u32,
        attr: crate::srq::SrqAttr,
    },
    SrqAttr(crate::srq::SrqAttr),
    SrqState(crate::srq::SrqSnapshot),
    /// FetchTraces: one report per MR, in the request's order.
    Traces(Vec<crate::trace::TraceReport>),
    /// SuspendAndFetchTraces: the states of the QPs it suspended and one
    /// trace report per MR, each in the request's order.
    Suspended {
        states: Vec<crate::qp_snapshot::QpSnapshot>,
        traces: Vec<crate::trace::TraceReport>,
    },
    /// The response is `len` bytes in `format` in the memfd beside this
    /// message: one larger than a datagram, or one that carries QP states
    /// or traces (`spill`).
    Spilled {
        len: u64,
        #[serde(default)]
        format: spill::Format,
    },
}

pub type Response = Result<Reply, String>;
