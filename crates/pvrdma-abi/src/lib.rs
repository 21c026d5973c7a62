//! The VMware PVRDMA device interface, as Linux's `vmw_pvrdma` driver sees it.
//!
//! Both sides of the interface use this crate: the device model in
//! `crates/devices/src/pvrdma/` and the no_std guest firmware driver. It holds
//! only the interface: constants, `repr(C)` structures laid out byte for byte
//! as in Linux (`drivers/infiniband/hw/vmw_pvrdma/pvrdma_dev_api.h`,
//! `pvrdma_verbs.h`, `pvrdma_ring.h` and `include/uapi/rdma/vmw_pvrdma-abi.h`;
//! each structure's size is checked at compile time against the Linux
//! layout), and the index rules of rings and page directories. No behaviour of
//! either side lives here.
//!
//! All multi-byte fields are little endian (x86-64) except where the Linux
//! type is `__be*` (immediate data, GUIDs), which this crate keeps as raw
//! `u32`/`u64` in the byte order the guest wrote.
#![no_std]

pub mod cmd;
pub mod dsr;
pub mod ib;
pub mod pdir;
pub mod regs;
pub mod ring;
pub mod wqe;

pub use cmd::*;
pub use dsr::*;
pub use pdir::*;
pub use regs::*;
pub use ring::*;
pub use wqe::*;

/// The guest page size the interface is written for.
pub const PAGE_SIZE: usize = 4096;
/// log2 of [`PAGE_SIZE`].
pub const PAGE_SHIFT: u32 = 12;

/// A plain-old-data interface structure: every bit pattern is a valid value
/// and there is no padding, so it can be copied to and from guest memory as
/// bytes.
///
/// # Safety
/// Implement only for `repr(C)` types made of integers and arrays of integers
/// with no implicit padding (each implementation here is checked by a size
/// assertion that would fail if the compiler inserted padding).
pub unsafe trait Pod: Copy + Sized + 'static {
    /// The all-zero value.
    fn zeroed() -> Self {
        // SAFETY: all-zero bytes are a valid value of a Pod type.
        unsafe { core::mem::zeroed() }
    }

    /// The value's bytes, as the guest sees them in memory.
    fn as_bytes(&self) -> &[u8] {
        // SAFETY: Pod types have no padding, so every byte is initialised.
        unsafe { core::slice::from_raw_parts(self as *const Self as *const u8, core::mem::size_of::<Self>()) }
    }

    /// The value's bytes, writable.
    fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and every bit pattern is a valid value.
        unsafe { core::slice::from_raw_parts_mut(self as *mut Self as *mut u8, core::mem::size_of::<Self>()) }
    }

    /// Reads a value from the start of `bytes` (any alignment); `None` when
    /// `bytes` is shorter than the value.
    fn read_from(bytes: &[u8]) -> Option<Self> {
        if bytes.len() < core::mem::size_of::<Self>() {
            return None;
        }
        // SAFETY: the length is checked, every bit pattern is valid, and the
        // read does not assume alignment.
        Some(unsafe { core::ptr::read_unaligned(bytes.as_ptr() as *const Self) })
    }
}

// SAFETY: integers are plain old data.
unsafe impl Pod for u8 {}
unsafe impl Pod for u16 {}
unsafe impl Pod for u32 {}
unsafe impl Pod for u64 {}

/// Declares interface structures `Pod` and asserts their sizes against the
/// Linux layout at compile time.
macro_rules! pod {
    ($($t:ty = $size:expr),* $(,)?) => {
        $(
            // SAFETY: repr(C) integers and arrays only; the size assertion
            // below fails if the compiler added padding.
            unsafe impl $crate::Pod for $t {}
            const _: () = assert!(core::mem::size_of::<$t>() == $size);
        )*
    };
}
pub(crate) use pod;
