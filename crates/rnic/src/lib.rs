//! rnicd: a software RoCEv2 RDMA NIC with reliable-connected queue pairs.
//!
//! `wire` is the packet format, `qp` the RC transport, `engine` one namespace
//! of objects, `daemon` the process (sockets, clients, event loop). `ring`,
//! `proto` and `types` are shared with the client side (the `verbs` crate).
pub mod announce;
pub mod cli;
pub mod daemon;
pub mod engine;
pub mod mem;
pub mod objects;
pub mod proto;
pub mod qp;
pub mod ring;
pub mod trace;
pub mod types;
pub mod wire;
