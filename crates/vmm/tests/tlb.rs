//! The unicorn vCPU's own TLB (docs/architecture.md, "A VM"): with paging
//! off it maps guest RAM identity and lets stores to data pages take the
//! JIT's fast path, yet code a guest rewrites still runs as rewritten, and
//! a guest that turns paging on is translated through its own page tables.
//! Real vCPU threads on the unicorn backend; each guest is a few
//! hand-assembled instructions (`as --64`, Intel syntax, in the comments).

use devices::apic::Apics;
use std::sync::Arc;
use std::time::{Duration, Instant};
use vm_memory::{Bytes, GuestAddress};
use vmm::hypervisor::unicorn::UnicornHypervisor;
use vmm::memory::GuestRam;
use vmm::testing::NoDevices;
use vmm::vcpus::VcpuSet;

const CODE: u64 = 0x2_0000;
/// Where the guests leave their results.
const RESULTS: u64 = 0x3_0000;

/// Runs `program` at CODE on one vCPU over 16 MiB of RAM that `setup`
/// prepared, until it ends in `cli; hlt`; returns the RAM.
fn run(name: &str, program: &[u8], setup: impl FnOnce(&GuestRam)) -> GuestRam {
    let ram = GuestRam::new(name, 16 << 20).unwrap();
    ram.memory().write_slice(program, GuestAddress(CODE)).unwrap();
    setup(&ram);
    let vcpus = VcpuSet::start(Arc::new(UnicornHypervisor), 1, ram.host_addr(), ram.size(), Arc::new(NoDevices), Apics::new(1)).unwrap();
    let mut s = vcpus.states().unwrap();
    s[0].rip = CODE;
    vcpus.set_states(&s).unwrap();
    vcpus.resume();
    let t = Instant::now();
    loop {
        let st = &vcpus.status()[0];
        assert!(st.error.is_none(), "vCPU error: {:?}", st.error);
        if st.halted {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "the guest did not finish: {st:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(vcpus);
    ram
}

fn read(ram: &GuestRam, addr: u64) -> u64 {
    ram.memory().read_obj(GuestAddress(addr)).unwrap()
}

/// ```text
///     mov rsp, 0x80000
///     mov dword ptr [0x41800], 7      ; a store first: a data page so far
///     mov rax, 0x41000
///     call rax                        ; mov eax, 1; ret
///     mov [0x30000], rax
///     mov rbx, 0x141000               ; loads from 15 pages that share
/// 1:  mov rcx, [rbx]                  ; 0x41000's TLB index, so that its
///     add rbx, 0x100000               ; entry is evicted and the next
///     cmp rbx, 0x1000000              ; store refills it
///     jb 1b
///     mov dword ptr [0x41800], 8      ; that store (the page's first since)
///     mov byte ptr [0x41001], 2       ; and then rewrite the immediate
///     mov rax, 0x41000
///     call rax
///     mov [0x30008], rax
///     cli
///     hlt
/// ```
const REWRITES_ITS_CODE: &[u8] = &[
    0x48, 0xc7, 0xc4, 0x00, 0x00, 0x08, 0x00, 0xc7, 0x04, 0x25, 0x00, 0x18, 0x04, 0x00, 0x07, 0x00, 0x00, 0x00, 0x48, 0xc7, 0xc0, 0x00,
    0x10, 0x04, 0x00, 0xff, 0xd0, 0x48, 0x89, 0x04, 0x25, 0x00, 0x00, 0x03, 0x00, 0x48, 0xc7, 0xc3, 0x00, 0x10, 0x14, 0x00, 0x48, 0x8b,
    0x0b, 0x48, 0x81, 0xc3, 0x00, 0x00, 0x10, 0x00, 0x48, 0x81, 0xfb, 0x00, 0x00, 0x00, 0x01, 0x72, 0xed, 0xc7, 0x04, 0x25, 0x00, 0x18,
    0x04, 0x00, 0x08, 0x00, 0x00, 0x00, 0xc6, 0x04, 0x25, 0x01, 0x10, 0x04, 0x00, 0x02, 0x48, 0xc7, 0xc0, 0x00, 0x10, 0x04, 0x00, 0xff,
    0xd0, 0x48, 0x89, 0x04, 0x25, 0x08, 0x00, 0x03, 0x00, 0xfa, 0xf4,
];
/// `mov eax, 1; ret`
const RETURN_ONE: &[u8] = &[0xb8, 0x01, 0x00, 0x00, 0x00, 0xc3];

#[test]
fn code_the_guest_rewrites_runs_as_rewritten() {
    let ram = run("tlb-smc", REWRITES_ITS_CODE, |ram| ram.memory().write_slice(RETURN_ONE, GuestAddress(0x4_1000)).unwrap());
    assert_eq!(read(&ram, 0x4_1800) as u32, 8, "the data stores landed");
    assert_eq!(read(&ram, RESULTS), 1, "the function before the rewrite");
    assert_eq!(read(&ram, RESULTS + 8), 2, "the rewritten function");
}

/// ```text
///     mov rax, 0x70000
///     mov cr3, rax
///     mov rax, cr4
///     or rax, 0x20                    ; PAE
///     mov cr4, rax
///     mov rax, cr0
///     bts rax, 31                     ; PG
///     mov cr0, rax
///     mov rax, [0x400000]             ; virtual 4 MiB
///     mov [0x30000], rax
///     mov qword ptr [0x400008], 0x1234
///     cli
///     hlt
/// ```
const TURNS_PAGING_ON: &[u8] = &[
    0x48, 0xc7, 0xc0, 0x00, 0x00, 0x07, 0x00, 0x0f, 0x22, 0xd8, 0x0f, 0x20, 0xe0, 0x48, 0x83, 0xc8, 0x20, 0x0f, 0x22, 0xe0, 0x0f, 0x20,
    0xc0, 0x48, 0x0f, 0xba, 0xe8, 0x1f, 0x0f, 0x22, 0xc0, 0x48, 0x8b, 0x04, 0x25, 0x00, 0x00, 0x40, 0x00, 0x48, 0x89, 0x04, 0x25, 0x00,
    0x00, 0x03, 0x00, 0x48, 0xc7, 0x04, 0x25, 0x08, 0x00, 0x40, 0x00, 0x34, 0x12, 0x00, 0x00, 0xfa, 0xf4,
];

#[test]
fn a_guest_that_turns_paging_on_is_translated_through_its_page_tables() {
    // Page tables at 0x70000: the first 2 MiB identity (one large page),
    // virtual 4 MiB -> physical 0x50000 (one 4 KiB page).
    const PRESENT_WRITABLE: u64 = 3;
    const LARGE: u64 = 0x80;
    let ram = run("tlb-paging", TURNS_PAGING_ON, |ram| {
        let m = ram.memory();
        m.write_obj(0x7_1000 | PRESENT_WRITABLE, GuestAddress(0x7_0000)).unwrap(); // PML4[0] -> PDPT
        m.write_obj(0x7_2000 | PRESENT_WRITABLE, GuestAddress(0x7_1000)).unwrap(); // PDPT[0] -> PD
        m.write_obj(LARGE | PRESENT_WRITABLE, GuestAddress(0x7_2000)).unwrap(); // PD[0]: 0..2 MiB
        m.write_obj(0x7_3000 | PRESENT_WRITABLE, GuestAddress(0x7_2000 + 2 * 8)).unwrap(); // PD[2] -> PT
        m.write_obj(0x5_0000 | PRESENT_WRITABLE, GuestAddress(0x7_3000)).unwrap(); // PT[0]: 4 MiB -> 0x50000
        m.write_obj(0x1122_3344_5566_7788u64, GuestAddress(0x5_0000)).unwrap();
        m.write_obj(0xdead_beefu64, GuestAddress(0x40_0000)).unwrap();
    });
    assert_eq!(read(&ram, RESULTS), 0x1122_3344_5566_7788, "the load went through the guest's page tables");
    assert_eq!(read(&ram, 0x5_0008), 0x1234, "the store went through them too");
    assert_eq!(read(&ram, 0x40_0000), 0xdead_beef, "physical 4 MiB is untouched");
    assert_eq!(read(&ram, 0x40_0008), 0);
}
