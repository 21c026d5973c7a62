//! What a VM is made of. Saved with the VM so restore and migration can
//! check that both ends build the same machine.

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct VmConfig {
    pub name: String,
    /// Guest RAM in bytes.
    pub memory: u64,
    pub vcpus: u32,
    /// Guest firmware ELF.
    pub firmware: PathBuf,
    /// Firmware command line, e.g. `workload=dirtier rate=0`.
    pub cmdline: String,
    /// NVMe controllers, one spec each (see docs/nvme.md).
    #[serde(default)]
    pub nvme: Vec<String>,
    /// PVRDMA devices, one spec each: `gid=10.200.0.50[,rnicd=SOCK][,name=N]`
    /// (see docs/pvrdma.md).
    #[serde(default)]
    pub pvrdma: Vec<String>,
}

pub const MAX_VCPUS: u32 = 16;

impl VmConfig {
    pub fn validate(&self) -> Result<()> {
        if self.name.is_empty() || !self.name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
            bail!("VM name {:?} must be non-empty ASCII letters, digits, '-' or '_'", self.name);
        }
        if self.vcpus == 0 || self.vcpus > MAX_VCPUS {
            bail!("vcpus must be between 1 and {MAX_VCPUS} (got {})", self.vcpus);
        }
        if self.cmdline.len() >= devices::layout::CMDLINE_MAX {
            bail!("command line is longer than {} bytes", devices::layout::CMDLINE_MAX - 1);
        }
        Ok(())
    }

    /// The parts that must match on both ends of a migration.
    pub fn shape(&self) -> String {
        let pvrdma = if self.pvrdma.is_empty() { String::new() } else { format!(" pvrdma={}", self.pvrdma.len()) };
        format!("mem={} vcpus={} nvme={}{pvrdma}", self.memory, self.vcpus, self.nvme.len())
    }
}
