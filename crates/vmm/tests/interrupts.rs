//! Interrupt delivery in the emulated vCPU, with real vCPU threads on the
//! unicorn backend and a few hand-assembled instructions as the guest: an
//! MSI wakes a HLT and runs the IDT's handler, which ends it with an EOI
//! to the local APIC page; a vector raised while the VM is paused travels
//! in the vCPU state to another vCPU set (a restore) and is delivered
//! there; HLT with interrupts disabled stays the end of the vCPU; a broken
//! IDT gate stops the vCPU with an error that names it.

use devices::apic::{Apics, MsiSink};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vm_memory::{Bytes, GuestAddress};
use vmm::hypervisor::unicorn::UnicornHypervisor;
use vmm::memory::GuestRam;
use vmm::testing::NoDevices;
use vmm::vcpus::VcpuSet;

const CODE: u64 = 0x2_0000;
const IDT: u64 = 0x1_0000;
const GDT: u64 = 0x1_1000;
const DESCRIPTORS: u64 = 0x1_2000;
/// Counters the guest keeps: interrupts handled, HLT wake-ups, and the
/// RIP the last interrupt frame held.
const HANDLED: u64 = 0x3_0000;
const WAKEUPS: u64 = 0x3_0008;
const FRAME_RIP: u64 = 0x3_0010;
const VECTOR: u8 = 0x40;
/// A vector whose IDT gate is not present.
const BROKEN_VECTOR: u8 = 0x60;

/// `as --64`, Intel syntax:
/// ```text
/// start:  lgdt [0x12000]; push 8; lea rax, [rip + 1f]; push rax; retfq
/// 1:      lidt [0x12010]; mov rsp, 0x80000; sti
/// idle:   hlt; inc qword ptr [0x30008]; jmp idle        (at +0x24)
/// ```
const START: &[u8] = &[
    0x0f, 0x01, 0x14, 0x25, 0x00, 0x20, 0x01, 0x00, 0x6a, 0x08, 0x48, 0x8d, 0x05, 0x03, 0x00, 0x00, 0x00, 0x50, 0x48, 0xcb, 0x0f, 0x01,
    0x1c, 0x25, 0x10, 0x20, 0x01, 0x00, 0x48, 0xc7, 0xc4, 0x00, 0x00, 0x08, 0x00, 0xfb, 0xf4, 0x48, 0xff, 0x04, 0x25, 0x08, 0x00, 0x03,
    0x00, 0xeb, 0xf5,
];
/// The instruction after the idle loop's HLT.
const AFTER_HLT: u64 = CODE + 0x25;
/// The handler of VECTOR (at +0x100):
/// ```text
/// push rax; inc qword ptr [0x30000]; mov rax, [rsp + 8]; mov [0x30010], rax
/// mov rax, 0xFEE000B0; mov dword ptr [rax], 0; pop rax; iretq
/// ```
const HANDLER: &[u8] = &[
    0x50, 0x48, 0xff, 0x04, 0x25, 0x00, 0x00, 0x03, 0x00, 0x48, 0x8b, 0x44, 0x24, 0x08, 0x48, 0x89, 0x04, 0x25, 0x10, 0x00, 0x03, 0x00,
    0x48, 0xb8, 0xb0, 0x00, 0xe0, 0xfe, 0x00, 0x00, 0x00, 0x00, 0xc7, 0x00, 0x00, 0x00, 0x00, 0x00, 0x58, 0x48, 0xcf,
];
const HANDLER_AT: u64 = CODE + 0x100;
/// `cli; hlt; jmp` back (at +0x200).
const HALT_FOR_GOOD: &[u8] = &[0xfa, 0xf4, 0xeb, 0xfc];
const HALT_FOR_GOOD_AT: u64 = CODE + 0x200;

struct Machine {
    ram: GuestRam,
    apics: Arc<Apics>,
    vcpus: VcpuSet,
}

impl Machine {
    /// One vCPU on RAM holding the program, paused at its reset state.
    fn new(name: &str) -> Machine {
        let ram = GuestRam::new(name, 16 << 20).unwrap();
        let m = ram.memory();
        m.write_slice(START, GuestAddress(CODE)).unwrap();
        m.write_slice(HANDLER, GuestAddress(HANDLER_AT)).unwrap();
        m.write_slice(HALT_FOR_GOOD, GuestAddress(HALT_FOR_GOOD_AT)).unwrap();
        // GDT: null, then a 64-bit ring-0 code segment (selector 8).
        m.write_obj(0u64, GuestAddress(GDT)).unwrap();
        m.write_obj(0x00AF_9A00_0000_FFFFu64, GuestAddress(GDT + 8)).unwrap();
        // An interrupt gate to the handler, selector 8, no IST.
        let h = HANDLER_AT;
        let mut gate = [0u8; 16];
        gate[0..2].copy_from_slice(&(h as u16).to_le_bytes());
        gate[2..4].copy_from_slice(&8u16.to_le_bytes());
        gate[5] = 0x8E;
        gate[6..8].copy_from_slice(&((h >> 16) as u16).to_le_bytes());
        gate[8..12].copy_from_slice(&((h >> 32) as u32).to_le_bytes());
        m.write_slice(&gate, GuestAddress(IDT + VECTOR as u64 * 16)).unwrap();
        // lgdt / lidt operands: limit, base.
        m.write_obj(15u16, GuestAddress(DESCRIPTORS)).unwrap();
        m.write_obj(GDT, GuestAddress(DESCRIPTORS + 2)).unwrap();
        m.write_obj(0xFFFu16, GuestAddress(DESCRIPTORS + 0x10)).unwrap();
        m.write_obj(IDT, GuestAddress(DESCRIPTORS + 0x12)).unwrap();
        let apics = Apics::new(1);
        let vcpus =
            VcpuSet::start(Arc::new(UnicornHypervisor), 1, ram.host_addr(), ram.size(), Arc::new(NoDevices), apics.clone()).unwrap();
        Machine { ram, apics, vcpus }
    }

    fn read(&self, addr: u64) -> u64 {
        self.ram.memory().read_obj(GuestAddress(addr)).unwrap()
    }

    fn start_at(&self, rip: u64) {
        let mut s = self.vcpus.states().unwrap();
        s[0].rip = rip;
        s[0].gprs[7] = 0x8_0000; // rsp
        self.vcpus.set_states(&s).unwrap();
        self.vcpus.resume();
    }

    fn wait_for(&self, what: &str, f: impl Fn(&Machine) -> bool) {
        let t = Instant::now();
        while !f(self) {
            assert!(t.elapsed() < Duration::from_secs(20), "{what}: vCPU {:?}", self.vcpus.status());
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The guest ran its setup and sleeps in the idle loop's HLT.
    fn wait_idle(&self) {
        self.wait_for("idle loop", |m| m.vcpus.pause_and(|s| s.halted && s.rip == AFTER_HLT));
    }
}

/// Pauses, looks at the vCPU state, resumes.
trait PauseAnd {
    fn pause_and(&self, f: impl Fn(&vmm::hypervisor::VcpuState) -> bool) -> bool;
}
impl PauseAnd for VcpuSet {
    fn pause_and(&self, f: impl Fn(&vmm::hypervisor::VcpuState) -> bool) -> bool {
        self.pause();
        let r = f(&self.states().unwrap()[0]);
        self.resume();
        r
    }
}

#[test]
fn msi_wakes_hlt_runs_the_handler_and_eoi_ends_it() {
    let m = Machine::new("irq-deliver");
    m.start_at(CODE);
    m.wait_idle();
    // A halted vCPU that waits for interrupts is not a finished one.
    assert!(!m.vcpus.status()[0].halted);
    for n in 1..=3u64 {
        assert!(m.apics.send(0xFEE0_0000, VECTOR as u32));
        m.wait_for("handler", |m| m.read(HANDLED) == n && m.read(WAKEUPS) == n);
        // The frame's RIP is where the HLT left off: the vector arrived
        // while the vCPU halted.
        assert_eq!(m.read(FRAME_RIP), AFTER_HLT);
    }
    // Every EOI reached the local APIC: nothing is in service.
    m.wait_idle();
    m.vcpus.pause();
    let st = m.vcpus.states().unwrap()[0].lapic.clone();
    assert_eq!((st.irr, st.isr), ([0; 4], [0; 4]), "{st:?}");
    // Interrupts stay disabled outside the handler frame only: IF is set in the idle loop.
    assert_ne!(m.vcpus.states().unwrap()[0].rflags & (1 << 9), 0);
}

#[test]
fn a_pending_vector_travels_in_the_vcpu_state() {
    let src = Machine::new("irq-save");
    src.start_at(CODE);
    src.wait_idle();
    src.vcpus.pause();
    // Raised while paused: pending, not delivered.
    assert!(src.apics.send(0xFEE0_0000, VECTOR as u32));
    let states = src.vcpus.states().unwrap();
    assert_ne!(states[0].lapic.irr[1] & 1, 0, "vector {VECTOR:#x} pending in the saved state: {:?}", states[0].lapic);
    assert_eq!(src.read(HANDLED), 0);
    // Through the saved form, as a save file or a migration carries it.
    let states: Vec<vmm::hypervisor::VcpuState> = serde_json::from_slice(&serde_json::to_vec(&states).unwrap()).unwrap();

    let dst = Machine::new("irq-restore");
    dst.ram.memory().write_slice(&read_all(&src.ram), GuestAddress(0)).unwrap();
    drop(src);
    dst.vcpus.set_states(&states).unwrap();
    dst.vcpus.resume();
    dst.wait_for("handler on the destination", |m| m.read(HANDLED) == 1 && m.read(WAKEUPS) == 1);
    assert_eq!(dst.read(FRAME_RIP), AFTER_HLT);
}

fn read_all(ram: &GuestRam) -> Vec<u8> {
    let mut v = vec![0u8; ram.size() as usize];
    ram.memory().read_slice(&mut v, GuestAddress(0)).unwrap();
    v
}

#[test]
fn hlt_with_interrupts_disabled_ends_the_vcpu() {
    let m = Machine::new("irq-cli-hlt");
    m.start_at(CODE);
    m.wait_idle();
    m.vcpus.pause();
    let mut s = m.vcpus.states().unwrap();
    s[0].rip = HALT_FOR_GOOD_AT;
    s[0].halted = false;
    m.vcpus.set_states(&s).unwrap();
    m.vcpus.resume();
    m.wait_for("halted for good", |m| m.vcpus.status()[0].halted);
    assert!(m.apics.send(0xFEE0_0000, VECTOR as u32));
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(m.read(HANDLED), 0, "IF is clear: nothing is delivered");
    assert!(m.vcpus.status()[0].halted);
}

#[test]
fn a_vector_without_a_gate_is_a_vcpu_error_that_names_it() {
    let m = Machine::new("irq-no-gate");
    m.start_at(CODE);
    m.wait_idle();
    assert!(m.apics.send(0xFEE0_0000, BROKEN_VECTOR as u32));
    m.wait_for("vCPU error", |m| m.vcpus.status()[0].error.is_some());
    let e = m.vcpus.status()[0].error.clone().unwrap();
    assert!(e.contains("0x60") && e.contains("gate"), "{e}");
}
