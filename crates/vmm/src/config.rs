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
        // RAM is one range from 0, without a hole: a PVRDMA device's 32-bit
        // BARs (and the local APIC page its interrupts need, above them)
        // must lie above its end.
        let hole = devices::layout::PCI_HOLE_BASE;
        if !self.pvrdma.is_empty() && self.memory > hole {
            bail!(
                "a PVRDMA device has 32-bit BARs in the PCI hole at {hole:#x} (as Linux's vmw_pvrdma expects), and a VM with more than {} MiB of RAM has no room for it",
                hole >> 20
            );
        }
        if self.cmdline.len() >= devices::layout::CMDLINE_MAX {
            bail!("command line is longer than {} bytes", devices::layout::CMDLINE_MAX - 1);
        }
        Ok(())
    }

    /// The parts that must match on both ends of a migration (`bars=hole32`:
    /// PVRDMA's BARs are 32-bit in the PCI hole; a vmm that put them above
    /// 4 GiB said nothing, so the two do not migrate into each other).
    pub fn shape(&self) -> String {
        let pvrdma = if self.pvrdma.is_empty() { String::new() } else { format!(" pvrdma={} bars=hole32", self.pvrdma.len()) };
        format!("mem={} vcpus={} nvme={}{pvrdma}", self.memory, self.vcpus, self.nvme.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pvrdma_device_needs_ram_below_the_pci_hole() {
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
        assert!(e.contains("PCI hole") && e.contains("3584 MiB"), "{e}");
        c.memory = 3584 << 20;
        c.validate().unwrap();
        c.memory += 4096;
        assert!(c.validate().is_err());
        c.memory = 4 << 30;
        c.pvrdma.clear();
        c.validate().unwrap();
    }
}
