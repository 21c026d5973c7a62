//! Port I/O, MMIO, the debug console and the platform page.

use core::arch::asm;
use core::fmt;

pub fn outb(port: u16, v: u8) {
    unsafe { asm!("out dx, al", in("dx") port, in("al") v, options(nomem, nostack, preserves_flags)) }
}
pub fn outl(port: u16, v: u32) {
    unsafe { asm!("out dx, eax", in("dx") port, in("eax") v, options(nomem, nostack, preserves_flags)) }
}
pub fn inl(port: u16) -> u32 {
    let v: u32;
    unsafe { asm!("in eax, dx", in("dx") port, out("eax") v, options(nomem, nostack, preserves_flags)) }
    v
}

pub fn mmio_read64(addr: u64) -> u64 {
    unsafe { core::ptr::read_volatile(addr as *const u64) }
}
pub fn mmio_write64(addr: u64, v: u64) {
    unsafe { core::ptr::write_volatile(addr as *mut u64, v) }
}
pub fn mmio_read32(addr: u64) -> u32 {
    unsafe { core::ptr::read_volatile(addr as *const u32) }
}
pub fn mmio_write32(addr: u64, v: u32) {
    unsafe { core::ptr::write_volatile(addr as *mut u32, v) }
}

pub struct Console;

impl fmt::Write for Console {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        for b in s.bytes() {
            outb(crate::boot::DEBUGCON_PORT, b);
        }
        Ok(())
    }
}

#[macro_export]
macro_rules! println {
    ($($arg:tt)*) => {{
        use core::fmt::Write;
        let _ = writeln!($crate::hw::Console, $($arg)*);
    }};
}

/// The platform page (clock, exit, progress).
#[derive(Clone, Copy)]
pub struct Platform {
    pub base: u64,
}

impl Platform {
    pub fn now_ns(&self) -> u64 {
        mmio_read64(self.base + crate::boot::PLATFORM_CLOCK)
    }
    pub fn progress(&self, v: u64) {
        mmio_write64(self.base + crate::boot::PLATFORM_PROGRESS, v)
    }
    pub fn exit(&self, code: u32) -> ! {
        mmio_write32(self.base + crate::boot::PLATFORM_EXIT, code);
        halt_forever()
    }
}

/// Halts with interrupts disabled: the vCPU is done for good.
pub fn halt_forever() -> ! {
    loop {
        unsafe { asm!("cli", "hlt", options(nomem, nostack)) }
    }
}
