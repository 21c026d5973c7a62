//! The small hypervisor interface the vmm runs vCPUs through.
//!
//! On these machines KVM cannot run ordinary guests, so the one backend is
//! [`unicorn`], an emulated x86-64 core (QEMU's TCG as a library). A KVM
//! backend would implement the same two traits on real hardware.

pub mod unicorn;

use devices::apic::LocalApic;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// Guest accesses that leave the CPU: port I/O and MMIO.
pub trait IoHandler: Send + Sync {
    fn pio_read(&self, port: u16, data: &mut [u8]);
    fn pio_write(&self, port: u16, data: &[u8]);
    fn mmio_read(&self, addr: u64, data: &mut [u8]);
    fn mmio_write(&self, addr: u64, data: &[u8]);
}

/// Why `Vcpu::run` returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VcpuExit {
    /// Another thread asked it to stop (pause, throttle, quit).
    Kicked,
    /// The guest executed HLT with interrupts disabled (RFLAGS.IF clear):
    /// nothing can wake it, the vCPU is done. (A HLT with IF set waits
    /// inside `run` for an interrupt, or returns `Kicked`.)
    Halted,
    /// The guest did something the CPU cannot continue from.
    Error(String),
}

/// Interrupts a running vCPU from another thread. Kicks are idempotent and
/// may race with `run` starting; callers repeat them until acknowledged.
pub trait Kicker: Send + Sync {
    fn kick(&self);
}

/// Architectural state of one x86-64 vCPU, in a backend-neutral form.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VcpuState {
    /// rax rbx rcx rdx rsi rdi rbp rsp r8..r15
    pub gprs: [u64; 16],
    pub rip: u64,
    pub rflags: u64,
    /// cs ds es fs gs ss selectors
    pub segs: [u16; 6],
    pub fs_base: u64,
    pub gs_base: u64,
    pub cr0: u64,
    pub cr2: u64,
    pub cr3: u64,
    pub cr4: u64,
    pub efer: u64,
    pub gdtr: (u64, u32),
    pub idtr: (u64, u32),
    /// Task register: selector, base, limit, attribute flags (the TSS
    /// holds the interrupt stacks, IST).
    #[serde(default)]
    pub tr: (u16, u64, u32, u32),
    pub mxcsr: u32,
    /// xmm0..xmm15, 16 bytes each
    pub xmm: Vec<[u8; 16]>,
    /// x87 st0..st7, 10 bytes each, plus control/status/tag words
    pub st: Vec<[u8; 10]>,
    pub fpcw: u16,
    pub fpsw: u16,
    pub fptag: u16,
    /// The vCPU had executed HLT and waits: for an interrupt when IF is
    /// set, for good when it is clear.
    pub halted: bool,
    /// Its local APIC: pending and in-service vectors, task priority.
    #[serde(default)]
    pub lapic: devices::apic::LapicState,
}

pub trait Vcpu {
    fn run(&mut self) -> VcpuExit;
    fn state(&self) -> anyhow::Result<VcpuState>;
    fn set_state(&mut self, s: &VcpuState) -> anyhow::Result<()>;
    fn kicker(&self) -> Arc<dyn Kicker>;
}

/// Creates vCPUs. `create_vcpu` is called on the thread that will run the
/// vCPU (the unicorn engine is not thread-safe). `lapic` is the vCPU's
/// local APIC, which devices raise interrupts in (devices::apic) and the
/// vCPU delivers them from.
pub trait Hypervisor: Send + Sync {
    fn create_vcpu(
        &self,
        index: u32,
        ram_host_addr: *mut u8,
        ram_size: u64,
        io: Arc<dyn IoHandler>,
        lapic: Arc<LocalApic>,
    ) -> anyhow::Result<Box<dyn Vcpu>>;
}
