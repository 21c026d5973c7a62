//! Multi-host testbeds made of network namespaces (work in progress).
pub mod cli;
