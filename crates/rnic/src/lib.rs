//! The software RoCEv2 NIC engine (work in progress).
pub mod cli;
