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
        // RAM is one range from 0: above the local APIC page there is none,
        // and a PVRDMA device needs interrupts.
        if !self.pvrdma.is_empty() && self.memory > devices::apic::LAPIC_ADDR {
            bail!(
                "a PVRDMA device needs interrupts, and a VM with more than {} MiB of RAM has no room for the local APIC page at {:#x}",
                devices::apic::LAPIC_ADDR >> 20,
                devices::apic::LAPIC_ADDR
            );
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pvrdma_device_needs_ram_below_the_local_apic() {
        let mut c = VmConfig {
            name: "vm".into(),
            memory: 4 << 30,
            vcpus: 1,
            firmware: PathBuf::new(),
            cmdline: String::new(),
            nvme: vec![],
            pvrdma: vec!["gid=10.200.0.50".into()],
        };
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("local APIC") && e.contains("4078 MiB"), "{e}");
        c.memory = 1 << 30;
        c.validate().unwrap();
        c.memory = 4 << 30;
        c.pvrdma.clear();
        c.validate().unwrap();
    }
}
