//! A PCI root with configuration mechanism #1 (ports 0xCF8/0xCFC).
//!
//! BARs are assigned by the vmm when a function is added and are not
//! relocatable: a guest may size them (write all ones, read the mask) but
//! writes of other addresses are ignored. That keeps MMIO routing fixed, which
//! is what save/restore and migration want.

use crate::bus::BusDevice;
use serde::{Deserialize, Serialize};
use std::sync::{Arc, Mutex};

/// A PCI function: owns its configuration header.
pub trait PciFunction: Send {
    fn pci_config(&mut self) -> &mut PciConfig;
    /// The guest wrote configuration dword `reg` (after the header took
    /// it): for functions whose device state follows a register, such as
    /// the MSI-X enable bit.
    fn config_written(&mut self, _reg: usize) {}
}

/// Where the MSI-X capability sits in configuration space (the only
/// capability a function here has).
pub const MSIX_CAP_OFFSET: usize = 0x40;
/// MSI-X message control: enable, function mask.
pub const MSIX_CTRL_ENABLE: u16 = 1 << 15;
pub const MSIX_CTRL_FUNCTION_MASK: u16 = 1 << 14;

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct Bar {
    pub addr: u64,
    pub size: u64,
}

/// The registers of a function's configuration space that its guest
/// writes: the command register (memory space, bus master, interrupt
/// disable), the interrupt line and the MSI-X message control (enable,
/// function mask).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestWritable {
    pub command: u16,
    pub interrupt_line: u8,
    pub msix_control: u16,
}

/// Type 0 configuration header (256 bytes), with 32- and 64-bit memory BARs.
#[derive(Clone, Serialize, Deserialize)]
pub struct PciConfig {
    #[serde(with = "serde_bytes_256")]
    regs: [u8; 256],
    bars: [Option<Bar>; 6],
    /// Per BAR: whether it is a 64-bit BAR (its high half in the next slot).
    #[serde(default)]
    wide: [bool; 6],
    /// Set per BAR register after the guest wrote all ones (sizing).
    sizing: [bool; 6],
}

mod serde_bytes_256 {
    use serde::{Deserialize, Deserializer, Serializer};
    pub fn serialize<S: Serializer>(v: &[u8; 256], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(v.iter())
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<[u8; 256], D::Error> {
        let v: Vec<u8> = Vec::deserialize(d)?;
        v.try_into().map_err(|_| serde::de::Error::custom("config space must be 256 bytes"))
    }
}

pub const CLASS_STORAGE: u8 = 0x01;
pub const SUBCLASS_NVM: u8 = 0x08;
pub const PROGIF_NVME: u8 = 0x02;

impl PciConfig {
    pub fn new(vendor: u16, device: u16, class: u8, subclass: u8, prog_if: u8) -> Self {
        let mut regs = [0u8; 256];
        regs[0..2].copy_from_slice(&vendor.to_le_bytes());
        regs[2..4].copy_from_slice(&device.to_le_bytes());
        regs[8] = 0; // revision
        regs[9] = prog_if;
        regs[10] = subclass;
        regs[11] = class;
        regs[0x2c..0x2e].copy_from_slice(&vendor.to_le_bytes()); // subsystem vendor
        regs[0x2e..0x30].copy_from_slice(&device.to_le_bytes());
        PciConfig { regs, bars: [None; 6], wide: [false; 6], sizing: [false; 6] }
    }

    /// Declare a 64-bit memory BAR (uses BAR slots `index` and `index+1`).
    pub fn set_bar64(&mut self, index: usize, bar: Bar) {
        assert!(index < 5 && bar.size.is_power_of_two() && bar.addr.is_multiple_of(bar.size));
        assert!(self.bars[index + 1].is_none(), "BAR slot {} is taken", index + 1);
        self.bars[index] = Some(bar);
        self.wide[index] = true;
    }

    /// Declare a 32-bit memory BAR (one BAR slot), which must lie below
    /// 4 GiB (the 32-bit PCI hole, layout.rs).
    pub fn set_bar32(&mut self, index: usize, bar: Bar) {
        assert!(index < 6 && bar.size.is_power_of_two() && bar.addr.is_multiple_of(bar.size));
        assert!(bar.addr + bar.size <= 1 << 32, "a 32-bit BAR must end below 4 GiB");
        assert!(index == 0 || !self.wide[index - 1], "BAR slot {index} is a 64-bit BAR's high half");
        self.bars[index] = Some(bar);
        self.wide[index] = false;
    }

    /// Whether BAR `index` is a 64-bit BAR.
    pub fn bar_is_64bit(&self, index: usize) -> bool {
        self.wide.get(index).copied().unwrap_or(false)
    }

    /// Declare an MSI-X capability: `vectors` table entries at
    /// `table_offset` of BAR `table_bar`, the pending bits at `pba_offset`
    /// of BAR `pba_bar`. Starts disabled, as after reset.
    pub fn set_msix_capability(&mut self, vectors: u16, table_bar: u8, table_offset: u32, pba_bar: u8, pba_offset: u32) {
        assert!((1..=2048).contains(&vectors) && table_bar < 6 && pba_bar < 6);
        let c = MSIX_CAP_OFFSET;
        self.regs[0x06] |= 0x10; // status: capabilities list
        self.regs[0x34] = c as u8;
        self.regs[c] = 0x11; // MSI-X
        self.regs[c + 1] = 0; // last capability
        self.regs[c + 2..c + 4].copy_from_slice(&(vectors - 1).to_le_bytes());
        self.regs[c + 4..c + 8].copy_from_slice(&(table_offset | table_bar as u32).to_le_bytes());
        self.regs[c + 8..c + 12].copy_from_slice(&(pba_offset | pba_bar as u32).to_le_bytes());
    }

    /// The MSI-X message control word (enable, function mask, table size).
    pub fn msix_control(&self) -> u16 {
        u16::from_le_bytes([self.regs[MSIX_CAP_OFFSET + 2], self.regs[MSIX_CAP_OFFSET + 3]])
    }

    /// Whether MSI-X is enabled and not masked as a whole.
    pub fn msix_enabled(&self) -> bool {
        self.regs[MSIX_CAP_OFFSET] == 0x11 && self.msix_control() & (MSIX_CTRL_ENABLE | MSIX_CTRL_FUNCTION_MASK) == MSIX_CTRL_ENABLE
    }

    /// Sets the MSI-X enable bit (a restored function), function mask clear.
    pub fn set_msix_enabled(&mut self, enabled: bool) {
        if self.regs[MSIX_CAP_OFFSET] == 0x11 {
            let ctrl = self.msix_control() & !(MSIX_CTRL_ENABLE | MSIX_CTRL_FUNCTION_MASK) | if enabled { MSIX_CTRL_ENABLE } else { 0 };
            self.regs[MSIX_CAP_OFFSET + 2..MSIX_CAP_OFFSET + 4].copy_from_slice(&ctrl.to_le_bytes());
        }
    }

    pub fn bar(&self, index: usize) -> Option<Bar> {
        self.bars.get(index).copied().flatten()
    }

    /// Bus master enable (command register bit 2): DMA allowed.
    pub fn bus_master(&self) -> bool {
        self.regs[4] & 0x4 != 0
    }

    /// What the guest has written into configuration space, for a saved
    /// device (the rest is fixed by the function, the BARs by the layout).
    pub fn guest_writable(&self) -> GuestWritable {
        GuestWritable {
            command: u16::from_le_bytes([self.regs[4], self.regs[5]]),
            interrupt_line: self.regs[0x3c],
            msix_control: if self.regs[MSIX_CAP_OFFSET] == 0x11 { self.msix_control() } else { 0 },
        }
    }

    /// Puts back what [`guest_writable`](Self::guest_writable) took (a
    /// restored device), through the same masks as the guest's writes.
    pub fn set_guest_writable(&mut self, w: GuestWritable) {
        // Dword 1 is command and status (status is read-only), dword 15
        // the interrupt line and pin.
        self.write_dword(1, w.command as u32);
        self.write_dword(0x3c / 4, w.interrupt_line as u32);
        self.write_dword(MSIX_CAP_OFFSET / 4, (w.msix_control as u32) << 16);
    }

    fn bar_dword(&self, slot: usize) -> u32 {
        // Slot `slot` is a 32-bit BAR, the low half of a 64-bit BAR at
        // slot, or the high half of one at slot - 1.
        if let Some(b) = self.bars[slot] {
            let v = if self.sizing[slot] { !(b.size - 1) } else { b.addr };
            // Memory, non-prefetchable; type 2 = 64-bit, 0 = 32-bit.
            (v as u32 & !0xf) | if self.wide[slot] { 0x4 } else { 0 }
        } else if slot > 0 && self.wide[slot - 1] {
            if let Some(b) = self.bars[slot - 1] {
                let v = if self.sizing[slot] { !(b.size - 1) } else { b.addr };
                (v >> 32) as u32
            } else {
                0
            }
        } else {
            0
        }
    }

    pub fn read_dword(&self, reg: usize) -> u32 {
        let off = reg * 4;
        match off {
            0x10..=0x27 => self.bar_dword((off - 0x10) / 4),
            _ if off < 256 => u32::from_le_bytes(self.regs[off..off + 4].try_into().unwrap()),
            _ => 0xffff_ffff,
        }
    }

    pub fn write_dword(&mut self, reg: usize, value: u32) {
        let off = reg * 4;
        match off {
            0x04 => {
                // Command: memory space, bus master, interrupt disable are writable.
                let cmd = (value as u16) & 0x0406;
                self.regs[4..6].copy_from_slice(&cmd.to_le_bytes());
            }
            0x10..=0x27 => {
                let slot = (off - 0x10) / 4;
                self.sizing[slot] = value == 0xffff_ffff;
            }
            0x3c => self.regs[0x3c] = value as u8, // interrupt line
            // MSI-X message control: only enable and function mask are writable.
            MSIX_CAP_OFFSET if self.regs[MSIX_CAP_OFFSET] == 0x11 => {
                let writable = MSIX_CTRL_ENABLE | MSIX_CTRL_FUNCTION_MASK;
                let ctrl = (self.msix_control() & !writable) | ((value >> 16) as u16 & writable);
                self.regs[MSIX_CAP_OFFSET + 2..MSIX_CAP_OFFSET + 4].copy_from_slice(&ctrl.to_le_bytes());
            }
            _ => {}
        }
    }
}

/// Configuration mechanism #1 on ports 0xCF8..0xCFF, bus 0 only.
pub struct PciRoot {
    address: u32,
    functions: Vec<Option<Arc<Mutex<dyn PciFunction>>>>,
}

impl Default for PciRoot {
    fn default() -> Self {
        PciRoot { address: 0, functions: vec![None; 32] }
    }
}

impl PciRoot {
    pub fn new() -> Self {
        Self::default()
    }

    /// Add a function at the first free device number; returns it.
    pub fn add(&mut self, f: Arc<Mutex<dyn PciFunction>>) -> Option<u8> {
        let slot = self.functions.iter().position(|s| s.is_none())?;
        self.functions[slot] = Some(f);
        Some(slot as u8)
    }

    /// The functions present, with their device numbers.
    pub fn functions(&self) -> impl Iterator<Item = (u8, &Arc<Mutex<dyn PciFunction>>)> {
        self.functions.iter().enumerate().filter_map(|(i, f)| f.as_ref().map(|f| (i as u8, f)))
    }

    fn target(&self) -> Option<(&Arc<Mutex<dyn PciFunction>>, usize)> {
        if self.address & 0x8000_0000 == 0 {
            return None;
        }
        let bus = (self.address >> 16) & 0xff;
        let dev = ((self.address >> 11) & 0x1f) as usize;
        let func = (self.address >> 8) & 0x7;
        let reg = ((self.address >> 2) & 0x3f) as usize;
        if bus != 0 || func != 0 {
            return None;
        }
        self.functions[dev].as_ref().map(|f| (f, reg))
    }
}

impl BusDevice for PciRoot {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        match offset {
            0 if data.len() == 4 => data.copy_from_slice(&self.address.to_le_bytes()),
            4..=7 => {
                let v = match self.target() {
                    Some((f, reg)) => f.lock().unwrap().pci_config().read_dword(reg),
                    None => 0xffff_ffff,
                };
                let bytes = v.to_le_bytes();
                let start = (offset - 4) as usize;
                for (i, d) in data.iter_mut().enumerate() {
                    *d = *bytes.get(start + i).unwrap_or(&0xff);
                }
            }
            _ => data.fill(0xff),
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        match offset {
            0 if data.len() == 4 => self.address = u32::from_le_bytes(data.try_into().unwrap()),
            4 if data.len() == 4 => {
                if let Some((f, reg)) = self.target() {
                    let v = u32::from_le_bytes(data.try_into().unwrap());
                    let mut f = f.lock().unwrap();
                    f.pci_config().write_dword(reg, v);
                    f.config_written(reg);
                }
            }
            // Sub-dword config writes: read-modify-write the dword.
            4..=7 => {
                if let Some((f, reg)) = self.target() {
                    let mut f = f.lock().unwrap();
                    let mut b = f.pci_config().read_dword(reg).to_le_bytes();
                    let start = (offset - 4) as usize;
                    for (i, d) in data.iter().enumerate() {
                        if let Some(x) = b.get_mut(start + i) {
                            *x = *d;
                        }
                    }
                    f.pci_config().write_dword(reg, u32::from_le_bytes(b));
                    f.config_written(reg);
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct F(PciConfig);
    impl PciFunction for F {
        fn pci_config(&mut self) -> &mut PciConfig {
            &mut self.0
        }
    }

    #[test]
    fn enumerate_and_size_bar() {
        let mut cfg = PciConfig::new(0x1b36, 0x0010, CLASS_STORAGE, SUBCLASS_NVM, PROGIF_NVME);
        cfg.set_bar64(0, Bar { addr: 0x80_0010_0000, size: 0x4000 });
        let mut root = PciRoot::new();
        assert_eq!(root.add(Arc::new(Mutex::new(F(cfg)))), Some(0));
        let rd = |root: &mut PciRoot, dev: u32, reg: u32| {
            root.write(0, &(0x8000_0000 | dev << 11 | reg << 2).to_le_bytes());
            let mut b = [0u8; 4];
            root.read(4, &mut b);
            u32::from_le_bytes(b)
        };
        assert_eq!(rd(&mut root, 0, 0), 0x0010_1b36);
        assert_eq!(rd(&mut root, 1, 0), 0xffff_ffff);
        assert_eq!(rd(&mut root, 0, 2) >> 8, 0x010802);
        assert_eq!(rd(&mut root, 0, 4), 0x0010_0004);
        assert_eq!(rd(&mut root, 0, 5), 0x80);
        // Size BAR0: select register 4, write all ones, read the mask back.
        root.write(0, &(0x8000_0000u32 | 4 << 2).to_le_bytes());
        root.write(4, &0xffff_ffffu32.to_le_bytes());
        assert_eq!(rd(&mut root, 0, 4), 0xffff_c004);
        assert_eq!(rd(&mut root, 0, 5), 0x80, "the high half was not being sized");
    }

    #[test]
    fn size_32bit_bars_in_consecutive_slots() {
        let mut cfg = PciConfig::new(0x15ad, 0x0820, 0x02, 0x80, 0);
        cfg.set_bar32(0, Bar { addr: 0xE004_0000, size: 0x4000 });
        cfg.set_bar32(1, Bar { addr: 0xE004_4000, size: 0x1000 });
        cfg.set_bar32(2, Bar { addr: 0xE000_0000, size: 0x4_0000 });
        assert!(!cfg.bar_is_64bit(0) && !cfg.bar_is_64bit(2));
        // Type bits 0: memory, 32-bit, non-prefetchable.
        assert_eq!(
            [cfg.read_dword(4), cfg.read_dword(5), cfg.read_dword(6), cfg.read_dword(7)],
            [0xE004_0000, 0xE004_4000, 0xE000_0000, 0]
        );
        cfg.write_dword(5, 0xffff_ffff);
        assert_eq!(cfg.read_dword(5), 0xffff_f000);
        assert_eq!(cfg.read_dword(4), 0xE004_0000, "only the written BAR sizes");
        cfg.write_dword(5, 0xE004_4000);
        assert_eq!(cfg.read_dword(5), 0xE004_4000);
    }

    #[test]
    #[should_panic(expected = "below 4 GiB")]
    fn a_32bit_bar_above_4g_is_refused() {
        PciConfig::new(0x15ad, 0x0820, 0x02, 0x80, 0).set_bar32(0, Bar { addr: 0x80_0010_0000, size: 0x1000 });
    }

    #[test]
    fn msix_capability_enable_and_mask() {
        let mut cfg = PciConfig::new(0x15ad, 0x0820, 0x02, 0x80, 0);
        assert!(!cfg.msix_enabled());
        cfg.set_msix_capability(16, 0, 0, 0, 0x2000);
        assert_eq!(cfg.read_dword(1) >> 16 & 0x10, 0x10, "status lists capabilities");
        assert_eq!(cfg.read_dword(0x34 / 4) & 0xff, MSIX_CAP_OFFSET as u32);
        assert_eq!(cfg.read_dword(MSIX_CAP_OFFSET / 4), 15 << 16 | 0x11);
        assert_eq!(cfg.read_dword(MSIX_CAP_OFFSET / 4 + 2), 0x2000);
        // The table size is read only; enable and mask are not.
        cfg.write_dword(MSIX_CAP_OFFSET / 4, 0xffff_0000);
        assert_eq!(cfg.read_dword(MSIX_CAP_OFFSET / 4), 0xc00f_0011);
        assert!(!cfg.msix_enabled(), "masked as a whole");
        cfg.write_dword(MSIX_CAP_OFFSET / 4, 0x8000_0000);
        assert!(cfg.msix_enabled());
    }
}
