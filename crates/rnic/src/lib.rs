//! rnicd: a software RoCEv2 RDMA NIC with reliable-connected queue pairs.
//!
//! `wire` is the packet format, `qp` the RC transport, `engine` one namespace
//! of objects, `daemon` the process (sockets, clients, event loop). `ring`,
//! `proto`, `types`, `eventfd`, `doorbell` and `qp_snapshot` are shared with the client
//! side (the `verbs` crate).
//!
//! Dependencies run one way, from the bottom up:
//! `types`, `wire`, `ring`, `mem`, `trace`, `eventfd`, `spill`, `iface` (no crate imports);
//! `qp_snapshot`, `announce`, `netlink`, `gid`, `link`, `doorbell`; `objects`; `srq`; `async_events` and `proto`; `qp`;
//! `engine`; `ramclient`; `daemon`; `cli`.
pub mod announce;
pub mod async_events;
pub mod cli;
pub mod daemon;
pub mod doorbell;
pub mod engine;
pub mod eventfd;
pub mod gid;
pub mod iface;
pub mod keys;
pub mod link;
pub mod loop_priority;
pub mod mem;
pub mod neighbour;
pub mod netlink;
pub mod objects;
pub mod proto;
pub mod qp;
pub mod qp_snapshot;
pub mod ramclient;
pub mod ring;
pub mod srq;
pub mod trace;
pub mod types;
pub mod wire;
