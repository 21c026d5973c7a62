//! Interrupts: a GDT with a 64-bit code segment and a TSS, an IDT whose
//! gates send vectors `VECTOR_BASE..VECTOR_BASE + VECTORS` to small
//! handlers, and the local APIC's EOI.
//!
//! Each handler counts its vector in `IRQ_COUNTS` and ends it with an EOI;
//! the code that waits (`wait_for`) compares counts, so a handler never
//! calls into Rust. The handlers run on the TSS's interrupt stack (IST 1):
//! the firmware is built for the host target, whose code may keep data in
//! the 128 bytes below RSP (the red zone), which a frame pushed on the
//! interrupted stack would overwrite.

use core::arch::{asm, global_asm};
use core::ptr::addr_of;
use core::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// The local APIC's EOI register (xAPIC page at its default base).
const LAPIC_EOI: u64 = 0xFEE0_00B0;
/// The first vector the firmware hands to devices, and how many.
pub const VECTOR_BASE: u8 = 0x30;
pub const VECTORS: usize = 16;

const CODE_SELECTOR: u16 = 0x08;
const TSS_SELECTOR: u16 = 0x10;
const TSS_SIZE: usize = 104;
const IST_STACK_SIZE: usize = 16 * 1024;

#[no_mangle]
static IRQ_COUNTS: [AtomicU64; VECTORS] = [const { AtomicU64::new(0) }; VECTORS];
static READY: AtomicBool = AtomicBool::new(false);

#[repr(C, align(16))]
struct Aligned<T>(T);

/// Null, 64-bit ring-0 code, then the 16-byte TSS descriptor.
static mut GDT: Aligned<[u64; 4]> = Aligned([0, 0x00AF_9A00_0000_FFFF, 0, 0]);
static mut TSS: Aligned<[u8; TSS_SIZE]> = Aligned([0; TSS_SIZE]);
static mut IDT: Aligned<[[u64; 2]; 256]> = Aligned([[0; 2]; 256]);
static mut IST_STACK: Aligned<[u8; IST_STACK_SIZE]> = Aligned([0; IST_STACK_SIZE]);

/// One handler per vector (count, EOI, return), and a table of their
/// addresses.
macro_rules! stubs {
    ($($n:literal),*) => {
        $(global_asm!(
            concat!(".global irq_stub_", $n),
            concat!("irq_stub_", $n, ":"),
            "push rax",
            concat!("lock inc qword ptr [rip + {counts} + ", $n, " * 8]"),
            "mov rax, {eoi}",
            "mov dword ptr [rax], 0",
            "pop rax",
            "iretq",
            counts = sym IRQ_COUNTS,
            eoi = const LAPIC_EOI,
        );)*
        global_asm!(
            ".pushsection .rodata.irq_stubs, \"a\"",
            ".balign 8",
            ".global irq_stubs",
            "irq_stubs:",
            $(concat!(".quad irq_stub_", $n),)*
            ".popsection",
        );
    };
}

stubs!(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);

extern "C" {
    static irq_stubs: [u64; VECTORS];
}

#[repr(C, packed)]
struct TableRegister {
    limit: u16,
    base: u64,
}

/// Loads the GDT (reloading CS), the TSS and the IDT. Interrupts stay
/// disabled until `enable`.
pub fn init() {
    // SAFETY: runs once on vCPU 0 before interrupts are enabled; the
    // tables are statics that live for good.
    unsafe {
        let tss = addr_of!(TSS) as u64;
        let ist_top = addr_of!(IST_STACK) as u64 + IST_STACK_SIZE as u64;
        let t = &raw mut TSS;
        core::ptr::write_unaligned((*t).0.as_mut_ptr().add(0x24) as *mut u64, ist_top);
        // I/O map base beyond the limit: no I/O permission bitmap.
        core::ptr::write_unaligned((*t).0.as_mut_ptr().add(0x66) as *mut u16, TSS_SIZE as u16);
        let limit = TSS_SIZE as u64 - 1;
        let g = &raw mut GDT;
        (*g).0[2] = (limit & 0xffff) | (tss & 0xff_ffff) << 16 | 0x89 << 40 | (limit >> 16 & 0xf) << 48 | (tss >> 24 & 0xff) << 56;
        (*g).0[3] = tss >> 32;
        let gdtr = TableRegister { limit: (core::mem::size_of::<[u64; 4]>() - 1) as u16, base: addr_of!(GDT) as u64 };
        asm!("lgdt [{}]", in(reg) &gdtr);
        // A far return loads CS from the new GDT.
        asm!("push {sel}", "lea {t}, [rip + 2f]", "push {t}", "retfq", "2:", sel = const CODE_SELECTOR as u64, t = out(reg) _);
        asm!("ltr {0:x}", in(reg) TSS_SELECTOR);
        let idt = &raw mut IDT;
        for (i, &stub) in irq_stubs.iter().enumerate() {
            let lo = (stub & 0xffff) | (CODE_SELECTOR as u64) << 16 | 1 << 32 /* IST 1 */ | 0x8E << 40 | (stub >> 16 & 0xffff) << 48;
            (*idt).0[VECTOR_BASE as usize + i] = [lo, stub >> 32];
        }
        let idtr = TableRegister { limit: (core::mem::size_of::<[[u64; 2]; 256]>() - 1) as u16, base: addr_of!(IDT) as u64 };
        asm!("lidt [{}]", in(reg) &idtr);
    }
    READY.store(true, Ordering::SeqCst);
}

/// Whether `init` ran (drivers fall back to polling otherwise).
pub fn ready() -> bool {
    READY.load(Ordering::SeqCst)
}

pub fn enable() {
    // SAFETY: the IDT is loaded.
    unsafe { asm!("sti", options(nomem, nostack)) }
}

/// How many times vector `VECTOR_BASE + index` was taken.
pub fn count(index: usize) -> u64 {
    IRQ_COUNTS[index].load(Ordering::SeqCst)
}

/// Halts until vector `VECTOR_BASE + index` has been taken more than
/// `seen` times in all. Interrupts must be enabled.
pub fn wait_for(index: usize, seen: u64) {
    loop {
        // CLI, test, then STI; HLT: the STI shadow covers the HLT, so an
        // interrupt that comes after the test wakes the HLT instead of
        // being taken before it.
        // SAFETY: plain flag changes and a halt.
        unsafe { asm!("cli", options(nomem, nostack)) };
        if count(index) != seen {
            enable();
            return;
        }
        unsafe { asm!("sti", "hlt", options(nomem, nostack)) };
    }
}
