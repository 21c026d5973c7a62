//! Devices of a Transit VM and the buses they sit on.
//!
//! Each device implements [`bus::BusDevice`] for guest accesses and
//! [`snapshot::Persist`] for its state; the vmm and the migration engine know
//! devices only through these two traits.

pub mod bus;
pub mod console;
pub mod layout;
pub mod pci;
pub mod platform;

/// Guest physical memory as every device sees it (shared memfd mappings).
pub type GuestMemory = vm_memory::GuestMemoryMmap<()>;
