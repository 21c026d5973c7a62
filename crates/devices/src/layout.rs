//! The guest physical address map and the boot protocol shared with the
//! firmware in `crates/guest` (keep `crates/guest/src/boot.rs` in step).
//!
//! ```text
//! 0x0000_1000  BootInfo (struct below)
//! 0x0000_2000  command line, NUL-terminated, at most CMDLINE_MAX bytes
//! 0x0001_0000  identity page tables built by the vmm (PML4, PDPT, PDs)
//! 0x0010_0000  firmware ELF load address (1 MiB)
//! RAM end      guest RAM is [0, ram_size)
//! PCI_HOLE_BASE  32-bit PCI hole: BARs that must lie below 4 GiB (PVRDMA's)
//! 0xFEE0_0000  local APIC page (devices/src/apic.rs)
//! MMIO_BASE    platform page, mailbox page, then 64-bit PCI BARs (NVMe's)
//! ```
//! The vCPU starts in 64-bit long mode with paging on, RIP at the ELF entry,
//! RDI = BOOT_INFO_ADDR, RSI = vCPU index.

pub const BOOT_INFO_ADDR: u64 = 0x1000;
pub const CMDLINE_ADDR: u64 = 0x2000;
pub const CMDLINE_MAX: usize = 0x1000;
pub const PAGE_TABLE_ADDR: u64 = 0x1_0000;
pub const PAGE_TABLE_END: u64 = 0xF_0000;
pub const FIRMWARE_ADDR: u64 = 0x10_0000;

/// Start of the device window: far above any RAM this machine can hold.
pub const MMIO_BASE: u64 = 0x80_0000_0000;
pub const MMIO_SIZE: u64 = 0x4000_0000;
/// Platform registers (clock, exit), first page of the window.
pub const PLATFORM_ADDR: u64 = MMIO_BASE;
/// The mailbox page (devices/src/mailbox.rs), second page of the window.
pub const MAILBOX_ADDR: u64 = MMIO_BASE + 0x1000;
/// 64-bit PCI BARs are assigned from here, each aligned to its size.
pub const PCI_BAR_BASE: u64 = MMIO_BASE + 0x10_0000;

/// The 32-bit PCI hole, for functions whose driver expects 32-bit memory
/// BARs (VMware's PVRDMA: Linux's `vmw_pvrdma` finds its MSI-X, register
/// and UAR regions at BARs 0, 1 and 2, so none of the first two may take
/// two BAR registers). It ends where the platform's interrupt controllers
/// conventionally begin (I/O APIC at 0xFEC0_0000, local APIC at
/// 0xFEE0_0000). Guest RAM is one range from 0 without a hole, so a VM
/// with such a function has at most `PCI_HOLE_BASE` bytes of RAM
/// (vmm's `VmConfig::validate`); the vCPU maps the hole only then.
pub const PCI_HOLE_BASE: u64 = 0xE000_0000;
pub const PCI_HOLE_SIZE: u64 = 0xFEC0_0000 - PCI_HOLE_BASE;

pub const BOOT_MAGIC: u64 = 0x5452_414e_5349_5431; // "TRANSIT1"

/// Port of the debug console (the same as QEMU's debugcon).
pub const DEBUGCON_PORT: u16 = 0xE9;
/// PCI configuration mechanism #1.
pub const PCI_CONFIG_ADDRESS: u16 = 0xCF8;
pub const PCI_CONFIG_DATA: u16 = 0xCFC;

/// Smallest and default guest RAM.
pub const MIN_RAM: u64 = 16 << 20;

/// What the vmm writes at BOOT_INFO_ADDR (little endian, repr C).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct BootInfo {
    pub magic: u64,
    pub ram_size: u64,
    pub num_vcpus: u32,
    pub _pad: u32,
    pub mmio_base: u64,
    pub cmdline_addr: u64,
    pub cmdline_len: u64,
    /// First byte after the firmware image (bss included), page aligned.
    pub firmware_end: u64,
}

impl BootInfo {
    pub fn to_bytes(&self) -> [u8; 64] {
        let mut b = [0u8; 64];
        let f = [
            self.magic,
            self.ram_size,
            (self.num_vcpus as u64) | ((self._pad as u64) << 32),
            self.mmio_base,
            self.cmdline_addr,
            self.cmdline_len,
            self.firmware_end,
        ];
        for (i, v) in f.iter().enumerate() {
            b[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
        }
        b
    }
}
