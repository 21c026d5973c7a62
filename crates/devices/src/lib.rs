//! Devices of a Transit VM and the buses they sit on.
//!
//! Each device implements [`bus::BusDevice`] for guest accesses and
//! [`snapshot::Persist`] for its state; the vmm and the migration engine know
//! devices only through these two traits.

pub mod apic;
pub mod bus;
pub mod console;
pub mod layout;
pub mod mailbox;
pub mod nvme;
pub mod pci;
pub mod platform;
pub mod pvrdma;

/// Guest physical memory as every device sees it (shared memfd mappings).
pub type GuestMemory = vm_memory::GuestMemoryMmap<()>;

/// Lifecycle of a device that does work outside vCPU accesses (worker
/// threads, asynchronous I/O). The vmm calls `pause` before taking state or
/// handing the VM to migration: on return the device no longer touches guest
/// memory and every in-flight request is either completed or recorded in its
/// saved state. `resume` lets it run again (also after a restore).
pub trait Lifecycle {
    fn pause(&mut self) {}
    fn resume(&mut self) {}
}

/// What the vmm keeps in its device list: state plus lifecycle.
pub trait VmDevice: snapshot::Persist + Lifecycle + Send {}
impl<T: snapshot::Persist + Lifecycle + Send> VmDevice for T {}

impl Lifecycle for console::DebugConsole {}
impl Lifecycle for platform::Platform {}
impl Lifecycle for mailbox::Mailbox {}
