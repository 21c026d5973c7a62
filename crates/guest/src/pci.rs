//! PCI configuration mechanism #1 (ports 0xCF8/0xCFC), bus 0.

use crate::boot::{PCI_CONFIG_ADDRESS, PCI_CONFIG_DATA};
use crate::hw::{inl, outl};

pub fn read32(dev: u8, reg: u8) -> u32 {
    outl(PCI_CONFIG_ADDRESS, 0x8000_0000 | (dev as u32) << 11 | (reg as u32 & 0xfc));
    inl(PCI_CONFIG_DATA)
}

pub fn write32(dev: u8, reg: u8, v: u32) {
    outl(PCI_CONFIG_ADDRESS, 0x8000_0000 | (dev as u32) << 11 | (reg as u32 & 0xfc));
    outl(PCI_CONFIG_DATA, v);
}

/// The first function on bus 0 with this class / subclass / programming interface.
pub fn find(class: u8, subclass: u8, prog_if: u8) -> Option<u8> {
    (0..32u8).find(|&dev| {
        let id = read32(dev, 0);
        id != 0xffff_ffff && read32(dev, 8) >> 8 == (class as u32) << 16 | (subclass as u32) << 8 | prog_if as u32
    })
}

/// Address of a 64-bit memory BAR (BAR0 = 0x10).
pub fn bar64(dev: u8, reg: u8) -> u64 {
    let lo = read32(dev, reg);
    let hi = if lo & 0x6 == 0x4 { read32(dev, reg + 4) } else { 0 };
    (lo & !0xf) as u64 | (hi as u64) << 32
}

/// Memory space and bus master enable.
pub fn enable_bus_master(dev: u8) {
    let cmd = read32(dev, 4);
    write32(dev, 4, (cmd & 0xffff) | 0x6);
}
