//! The boot protocol, mirror of crates/devices/src/layout.rs.

pub const BOOT_MAGIC: u64 = 0x5452_414e_5349_5431;
pub const DEBUGCON_PORT: u16 = 0xE9;
pub const PCI_CONFIG_ADDRESS: u16 = 0xCF8;
pub const PCI_CONFIG_DATA: u16 = 0xCFC;
pub const PLATFORM_CLOCK: u64 = 0x00;
pub const PLATFORM_EXIT: u64 = 0x08;
pub const PLATFORM_PROGRESS: u64 = 0x10;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BootInfo {
    pub magic: u64,
    pub ram_size: u64,
    pub num_vcpus: u32,
    pub _pad: u32,
    pub mmio_base: u64,
    pub cmdline_addr: u64,
    pub cmdline_len: u64,
    pub firmware_end: u64,
}

impl BootInfo {
    pub fn cmdline(&self) -> &'static str {
        // SAFETY: the vmm wrote cmdline_len bytes of UTF-8 at cmdline_addr.
        unsafe {
            let s = core::slice::from_raw_parts(self.cmdline_addr as *const u8, self.cmdline_len as usize);
            core::str::from_utf8(s).unwrap_or("")
        }
    }
}
