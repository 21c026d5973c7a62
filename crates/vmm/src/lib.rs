//! One Transit VM as a process: guest RAM in a memfd, vCPUs behind a small
//! hypervisor trait (the unicorn backend here), the device buses, the JSON
//! control socket, save/restore, and the VM's side of migration.

pub mod config;
pub mod control;
pub mod hypervisor;
pub mod io;
pub mod memory;
pub mod oracle;
pub mod output;
pub mod rdma_dirty;
pub mod savefile;
pub mod testing;
pub mod vcpus;
pub mod vm;

pub use config::VmConfig;
pub use vm::{RunState, Vm};
