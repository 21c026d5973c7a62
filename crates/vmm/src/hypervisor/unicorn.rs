//! vCPUs on the unicorn engine.
//!
//! Guest RAM is mapped with `uc_mem_map_ptr` straight onto the memfd mapping,
//! so guest stores are host stores on the shared pages (dirty tracking and
//! other processes see them). The MMIO window is one `mmio_map` routed to the
//! device bus, the local APIC page another, routed to this vCPU's
//! [`LocalApic`]; IN/OUT go through instruction hooks. The engine starts in
//! 64-bit mode with paging disabled (unicorn's flat long mode), so the
//! firmware runs on physical addresses.
//!
//! Interrupts: unicorn has no interrupt controller, so the vCPU delivers
//! them itself. A block hook stops the engine at the start of a
//! translation block when the local APIC holds a deliverable vector and
//! RFLAGS.IF is set; `run` then enters the handler as an x86-64 CPU in long
//! mode does for an interrupt at the same privilege level (IDT gate, frame
//! of SS, RSP, RFLAGS, CS, RIP on the 16-byte aligned stack, IF cleared for
//! an interrupt gate) and resumes. HLT with IF set sleeps on the local APIC
//! until a vector is deliverable or the vCPU is kicked.
//!
//! The TLB: with paging off (the firmware's flat long mode), unicorn's own
//! x86 walk maps every page identity with read, write and execute rights,
//! and unicorn sends every store to a page whose TLB entry allows
//! execution through its slow path (a call per store that looks for
//! translated code to invalidate), for good. So the vCPU fills its TLB
//! itself (`UC_TLB_VIRTUAL`, [`FlatTlb`]): the same identity map, with
//! execute only on pages code was ever fetched from. Stores to the other
//! pages take the JIT's inline path after their first; stores to code
//! pages still invalidate the code they overwrite, as before. A guest
//! that turns paging on gets unicorn's page walk back (`run`).

use super::{Hypervisor, IoHandler, Kicker, Vcpu, VcpuExit, VcpuState};
use anyhow::{anyhow, Context, Result};
use devices::apic::{LocalApic, LAPIC_ADDR, LAPIC_SIZE};
use devices::layout::{MMIO_BASE, MMIO_SIZE, PCI_HOLE_BASE, PCI_HOLE_SIZE};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use unicorn_engine::unicorn_const::{uc_error, Arch, Mode, Prot};
use unicorn_engine::{RegisterX86, Unicorn};
use unicorn_engine_sys as sys;

pub struct UnicornHypervisor;

/// Kicks are delivered at the next translation-block boundary by a block
/// hook that stops the engine from inside the vCPU thread. Calling
/// `uc_emu_stop` from another thread is not precise in unicorn 2.1: the
/// engine can report the PC of a block whose first store already ran, so a
/// resumed guest would execute that store twice (a lost-update the dirtier
/// oracle catches).
/// The same hook stops the engine for an interrupt (see the module docs).
struct UcKicker {
    kicked: AtomicBool,
    /// The block hook stopped the engine (a kick or an interrupt), as
    /// opposed to a HLT.
    hook_stopped: AtomicBool,
    lapic: Arc<LocalApic>,
}

impl Kicker for UcKicker {
    fn kick(&self) {
        self.kicked.store(true, Ordering::SeqCst);
        // A vCPU asleep in HLT returns to its caller.
        self.lapic.interrupt_wait();
    }
}

const RFLAGS_IF: u64 = 1 << 9;
/// Flags an interrupt gate clears besides IF: TF, NT, RF (and VM, AC in
/// long mode the CPU leaves; only these matter here).
const RFLAGS_CLEARED_ON_ENTRY: u64 = (1 << 8) | (1 << 14) | (1 << 16);
const OPCODE_HLT: u8 = 0xF4;

/// Whether the instruction at `addr` is HLT. An interrupt is never taken
/// with RIP at a HLT: the HLT runs first and the interrupt wakes it. That
/// is how a CPU treats `sti; hlt` (the STI shadow covers the HLT), which is
/// the idle loop of every guest, and for other HLTs it is only an early
/// wake-up.
unsafe fn at_hlt(uc: *mut sys::uc_engine, addr: u64) -> bool {
    let mut b = 0u8;
    sys::uc_mem_read(uc, addr, &mut b as *mut u8 as *mut _, 1) == uc_error::OK && b == OPCODE_HLT
}

/// Runs at the start of every translation block (a plain C callback: this
/// is the hottest path of the emulator, hence the atomics first).
unsafe extern "C" fn stop_if_kicked(uc: *mut sys::uc_engine, addr: u64, _size: u32, user: *mut std::ffi::c_void) {
    let k = &*(user as *const UcKicker);
    let stop = k.kicked.load(Ordering::Relaxed)
        || (k.lapic.has_deliverable() && {
            let mut rflags = 0u64;
            sys::uc_reg_read(uc, RegisterX86::RFLAGS as i32, &mut rflags as *mut u64 as *mut _) == uc_error::OK
                && rflags & RFLAGS_IF != 0
                && !at_hlt(uc, addr)
        });
    if stop {
        k.hook_stopped.store(true, Ordering::Relaxed);
        sys::uc_emu_stop(uc);
    }
}

const CR0_PG: u64 = 1 << 31;
const PAGE_SHIFT: u32 = 12;

/// The vCPU's TLB while paging is off: the identity map, with execute
/// rights only where code runs. Touched by the vCPU's own thread alone
/// (the fill hook inside `emu_start`, and `run` between two of them).
struct FlatTlb {
    /// One bit per page of guest RAM: code was fetched from it. A page
    /// keeps its bit: its TLB entries then always allow execution, so
    /// every store to it checks for code to invalidate, whatever evicted
    /// and refilled the entry in between (an entry refilled by a store
    /// without execute would let later stores past translated code).
    code_pages: Box<[Cell<u64>]>,
    /// A fill met CR0.PG set: the guest's page tables must be walked,
    /// which only unicorn's own TLB does.
    paging_on: Cell<bool>,
}

impl FlatTlb {
    fn new(ram_size: u64) -> FlatTlb {
        let words = (ram_size >> PAGE_SHIFT).div_ceil(64) as usize;
        FlatTlb { code_pages: (0..words).map(|_| Cell::new(0)).collect(), paging_on: Cell::new(false) }
    }

    /// The rights of the entry for the page at `addr`, reached by an
    /// access of kind `access`. Beyond RAM (MMIO, unmapped) nothing is
    /// tracked: those accesses never take the RAM fast path.
    fn perms(&self, addr: u64, access: sys::MemType) -> Prot {
        let page = addr >> PAGE_SHIFT;
        let Some(word) = self.code_pages.get((page / 64) as usize) else {
            return Prot::ALL;
        };
        let bit = 1u64 << (page % 64);
        if access == sys::MemType::FETCH {
            word.set(word.get() | bit);
        }
        if word.get() & bit != 0 {
            Prot::ALL
        } else {
            Prot::READ | Prot::WRITE
        }
    }
}

/// Unicorn's TLB fill hook (`UC_HOOK_TLB_FILL`, a plain C callback). With
/// CR0.PG set it refuses the fill and says so in `paging_on`; `run` then
/// hands the TLB back to unicorn's page walk and restarts the instruction.
unsafe extern "C" fn fill_tlb_flat(
    uc: *mut sys::uc_engine,
    vaddr: u64,
    access: sys::MemType,
    entry: *mut sys::TlbEntry,
    user: *mut std::ffi::c_void,
) -> bool {
    let tlb = &*(user as *const FlatTlb);
    let mut cr0 = 0u64;
    if sys::uc_reg_read(uc, RegisterX86::CR0 as i32, &mut cr0 as *mut u64 as *mut _) != uc_error::OK || cr0 & CR0_PG != 0 {
        tlb.paging_on.set(true);
        return false;
    }
    *entry = sys::TlbEntry { paddr: vaddr, perms: tlb.perms(vaddr, access) };
    true
}

pub struct UnicornVcpu {
    uc: Unicorn<'static, ()>,
    kicker: Arc<UcKicker>,
    lapic: Arc<LocalApic>,
    halted: bool,
    /// The fill hook's state; boxed, so that its address stays put.
    tlb: Box<FlatTlb>,
}

impl Hypervisor for UnicornHypervisor {
    fn create_vcpu(
        &self,
        _index: u32,
        ram_host_addr: *mut u8,
        ram_size: u64,
        io: Arc<dyn IoHandler>,
        lapic: Arc<LocalApic>,
    ) -> Result<Box<dyn Vcpu>> {
        let mut uc = Unicorn::new(Arch::X86, Mode::MODE_64).map_err(|e| anyhow!("unicorn: {e:?}"))?;
        // SAFETY: the RAM mapping outlives the vCPU (the VM owns both and
        // joins vCPU threads before unmapping).
        unsafe { uc.mem_map_ptr(0, ram_size, Prot::ALL, ram_host_addr as *mut _) }
            .map_err(|e| anyhow!("mapping guest RAM into the vCPU: {e:?}"))?;
        // The device window above 4 GiB, and the 32-bit PCI hole where RAM
        // leaves room for it (VmConfig refuses 32-bit BARs otherwise).
        let mut windows = vec![(MMIO_BASE, MMIO_SIZE)];
        if ram_size <= PCI_HOLE_BASE {
            windows.push((PCI_HOLE_BASE, PCI_HOLE_SIZE));
        }
        for (base, len) in windows {
            let (r, w) = (io.clone(), io.clone());
            // Unicorn's MMIO regions take at most 4 bytes per callback (QEMU's
            // default max_access_size, which its API cannot raise), so an 8-byte
            // guest access arrives as two calls, +0 then +4. Devices with 64-bit
            // registers handle them as 32-bit halves (devices::platform latches).
            uc.mmio_map(
                base,
                len,
                Some(move |_: &mut Unicorn<'_, ()>, off: u64, size: usize| {
                    let mut b = [0u8; 8];
                    let n = size.min(8);
                    r.mmio_read(base + off, &mut b[..n]);
                    u64::from_le_bytes(b)
                }),
                Some(move |_: &mut Unicorn<'_, ()>, off: u64, size: usize, v: u64| {
                    let n = size.min(8);
                    w.mmio_write(base + off, &v.to_le_bytes()[..n]);
                }),
            )
            .map_err(|e| anyhow!("mapping the MMIO window at {base:#x}: {e:?}"))?;
        }
        // The local APIC page, where RAM leaves room for it (a guest with
        // more RAM has no local APIC page, and so no interrupts: VmConfig
        // refuses devices that need them there, config.rs).
        if ram_size <= LAPIC_ADDR {
            let (r, w) = (lapic.clone(), lapic.clone());
            uc.mmio_map(
                LAPIC_ADDR,
                LAPIC_SIZE,
                Some(move |_: &mut Unicorn<'_, ()>, off: u64, _size: usize| r.mmio_read(off) as u64),
                Some(move |_: &mut Unicorn<'_, ()>, off: u64, _size: usize, v: u64| w.mmio_write(off, v as u32)),
            )
            .map_err(|e| anyhow!("mapping the local APIC page: {e:?}"))?;
        }
        let (pi, po) = (io.clone(), io);
        uc.add_insn_in_hook(move |_, port, size| {
            let mut b = [0u8; 4];
            let n = size.clamp(1, 4);
            pi.pio_read(port as u16, &mut b[..n]);
            u32::from_le_bytes(b)
        })
        .map_err(|e| anyhow!("IN hook: {e:?}"))?;
        uc.add_insn_out_hook(move |_, port, size, v| {
            let n = size.clamp(1, 4);
            po.pio_write(port as u16, &v.to_le_bytes()[..n]);
        })
        .map_err(|e| anyhow!("OUT hook: {e:?}"))?;
        let kicker = Arc::new(UcKicker { kicked: AtomicBool::new(false), hook_stopped: AtomicBool::new(false), lapic: lapic.clone() });
        let tlb = Box::new(FlatTlb::new(ram_size));
        uc.ctl_set_tlb_type(sys::TlbType::VIRTUAL).map_err(|e| anyhow!("TLB type: {e:?}"))?;
        let hooks = [
            ("block hook", sys::HookType::BLOCK, stop_if_kicked as *mut std::ffi::c_void, Arc::as_ptr(&kicker) as *mut std::ffi::c_void),
            ("TLB fill hook", sys::HookType::TLB_FILL, fill_tlb_flat as *mut _, &*tlb as *const FlatTlb as *mut _),
        ];
        for (what, kind, callback, user) in hooks {
            let mut hook: sys::uc_hook = 0;
            // SAFETY: the kicker and the TLB state live in the returned vCPU,
            // as long as the engine; each callback has its hook type's
            // signature.
            let rc = unsafe { sys::uc_hook_add(uc.get_handle(), &mut hook, kind.0 as i32, callback, user, 1, 0) };
            if rc != uc_error::OK {
                return Err(anyhow!("{what}: {rc:?}"));
            }
        }
        Ok(Box::new(UnicornVcpu { uc, kicker, lapic, halted: false, tlb }))
    }
}

const GPRS: [RegisterX86; 16] = [
    RegisterX86::RAX,
    RegisterX86::RBX,
    RegisterX86::RCX,
    RegisterX86::RDX,
    RegisterX86::RSI,
    RegisterX86::RDI,
    RegisterX86::RBP,
    RegisterX86::RSP,
    RegisterX86::R8,
    RegisterX86::R9,
    RegisterX86::R10,
    RegisterX86::R11,
    RegisterX86::R12,
    RegisterX86::R13,
    RegisterX86::R14,
    RegisterX86::R15,
];
const SEGS: [RegisterX86; 6] = [RegisterX86::CS, RegisterX86::DS, RegisterX86::ES, RegisterX86::FS, RegisterX86::GS, RegisterX86::SS];
const MSR_EFER: u32 = 0xC000_0080;

fn uerr(what: &str) -> impl Fn(uc_error) -> anyhow::Error + '_ {
    move |e| anyhow!("{what}: {e:?}")
}

impl UnicornVcpu {
    fn read_mmr(&self, reg: RegisterX86) -> Result<(u64, u32)> {
        let mut m = sys::uc_x86_mmr { selector: 0, base: 0, limit: 0, flags: 0 };
        let rc = unsafe { sys::uc_reg_read(self.uc.get_handle(), reg as i32, &mut m as *mut _ as *mut _) };
        if rc != uc_error::OK {
            return Err(anyhow!("reading {reg:?}: {rc:?}"));
        }
        Ok((m.base, m.limit))
    }

    fn write_mmr(&mut self, reg: RegisterX86, v: (u64, u32)) -> Result<()> {
        let mut m = sys::uc_x86_mmr { selector: 0, base: v.0, limit: v.1, flags: 0 };
        let rc = unsafe { sys::uc_reg_write(self.uc.get_handle(), reg as i32, &mut m as *mut _ as *mut _) };
        if rc != uc_error::OK {
            return Err(anyhow!("writing {reg:?}: {rc:?}"));
        }
        Ok(())
    }

    /// The task register as (selector, base, limit, flags).
    fn read_tr(&self) -> Result<(u16, u64, u32, u32)> {
        let mut m = sys::uc_x86_mmr { selector: 0, base: 0, limit: 0, flags: 0 };
        let rc = unsafe { sys::uc_reg_read(self.uc.get_handle(), RegisterX86::TR as i32, &mut m as *mut _ as *mut _) };
        if rc != uc_error::OK {
            return Err(anyhow!("reading TR: {rc:?}"));
        }
        Ok((m.selector, m.base, m.limit, m.flags))
    }

    fn write_tr(&mut self, tr: (u16, u64, u32, u32)) -> Result<()> {
        let mut m = sys::uc_x86_mmr { selector: tr.0, base: tr.1, limit: tr.2, flags: tr.3 };
        let rc = unsafe { sys::uc_reg_write(self.uc.get_handle(), RegisterX86::TR as i32, &mut m as *mut _ as *mut _) };
        if rc != uc_error::OK {
            return Err(anyhow!("writing TR: {rc:?}"));
        }
        Ok(())
    }

    fn msr(&self, rid: u32) -> Result<u64> {
        let mut m = sys::uc_x86_msr { rid, value: 0 };
        let rc = unsafe { sys::uc_reg_read(self.uc.get_handle(), RegisterX86::MSR as i32, &mut m as *mut _ as *mut _) };
        if rc != uc_error::OK {
            return Err(anyhow!("reading MSR {rid:#x}: {rc:?}"));
        }
        Ok(m.value)
    }

    fn set_msr(&mut self, rid: u32, value: u64) -> Result<()> {
        let mut m = sys::uc_x86_msr { rid, value };
        let rc = unsafe { sys::uc_reg_write(self.uc.get_handle(), RegisterX86::MSR as i32, &mut m as *mut _ as *mut _) };
        if rc != uc_error::OK {
            return Err(anyhow!("writing MSR {rid:#x}: {rc:?}"));
        }
        Ok(())
    }

    /// Enters the handler of the local APIC's deliverable vector, if there
    /// is one and RFLAGS.IF allows it: the long-mode interrupt entry at the
    /// same privilege level (the firmware runs in ring 0 only). A broken
    /// IDT is the guest's fault the CPU cannot continue from (a real one
    /// would take #GP, then a double fault): an error.
    fn deliver_interrupt(&mut self) -> Result<()> {
        if !self.lapic.has_deliverable() {
            return Ok(());
        }
        let rflags = self.uc.reg_read(RegisterX86::RFLAGS).map_err(uerr("RFLAGS"))?;
        let rip = self.uc.pc_read().map_err(uerr("RIP"))?;
        // SAFETY: the engine handle is live; no emulation runs.
        if rflags & RFLAGS_IF == 0 || (!self.halted && unsafe { at_hlt(self.uc.get_handle(), rip) }) {
            return Ok(());
        }
        let Some(vector) = self.lapic.acknowledge() else { return Ok(()) };
        let (idt_base, idt_limit) = self.read_mmr(RegisterX86::IDTR)?;
        let at = vector as u64 * 16;
        if at + 15 > idt_limit as u64 {
            return Err(anyhow!("interrupt vector {vector:#x}: beyond the IDT limit {idt_limit:#x}"));
        }
        let mut gate = [0u8; 16];
        self.uc.mem_read(idt_base + at, &mut gate).map_err(|e| anyhow!("interrupt vector {vector:#x}: reading its IDT gate: {e:?}"))?;
        let (selector, ist, attr) = (u16::from_le_bytes([gate[2], gate[3]]), gate[4] & 7, gate[5]);
        let target = u16::from_le_bytes([gate[0], gate[1]]) as u64
            | (u16::from_le_bytes([gate[6], gate[7]]) as u64) << 16
            | (u32::from_le_bytes([gate[8], gate[9], gate[10], gate[11]]) as u64) << 32;
        let interrupt_gate = match attr & 0x9F {
            0x8E => true,
            0x8F => false,
            _ => {
                return Err(anyhow!("interrupt vector {vector:#x}: IDT gate attributes {attr:#x} are not a present interrupt or trap gate"))
            }
        };
        let rsp = self.uc.reg_read(RegisterX86::RSP).map_err(uerr("RSP"))?;
        let cs = self.uc.reg_read(RegisterX86::CS).map_err(uerr("CS"))?;
        let ss = self.uc.reg_read(RegisterX86::SS).map_err(uerr("SS"))?;
        // An IST gate switches to the TSS's interrupt stack `ist`, leaving
        // the interrupted stack (and the red zone below its RSP) alone.
        let stack = if ist == 0 {
            rsp
        } else {
            let (_, tss, limit, _) = self.read_tr()?;
            let at = 0x24 + (ist as u64 - 1) * 8;
            if at + 7 > limit as u64 {
                return Err(anyhow!("interrupt vector {vector:#x}: its gate asks for IST {ist}, beyond the TSS limit {limit:#x}"));
            }
            let mut b = [0u8; 8];
            self.uc.mem_read(tss + at, &mut b).map_err(|e| anyhow!("interrupt vector {vector:#x}: reading IST {ist}: {e:?}"))?;
            u64::from_le_bytes(b)
        };
        let frame_at = (stack & !0xF).wrapping_sub(40);
        let mut frame = [0u8; 40];
        for (i, v) in [rip, cs, rflags, rsp, ss].iter().enumerate() {
            frame[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
        }
        self.uc
            .mem_write(frame_at, &frame)
            .map_err(|e| anyhow!("interrupt vector {vector:#x}: pushing its frame at {frame_at:#x}: {e:?}"))?;
        if selector as u64 != cs {
            self.uc.reg_write(RegisterX86::CS, selector as u64).map_err(uerr("CS"))?;
        }
        let mut flags = rflags & !RFLAGS_CLEARED_ON_ENTRY;
        if interrupt_gate {
            flags &= !RFLAGS_IF;
        }
        self.uc.reg_write(RegisterX86::RFLAGS, flags).map_err(uerr("RFLAGS"))?;
        self.uc.reg_write(RegisterX86::RSP, frame_at).map_err(uerr("RSP"))?;
        self.uc.set_pc(target).map_err(uerr("RIP"))?;
        Ok(())
    }

    fn just_halted(&self) -> bool {
        // HLT leaves RIP after the instruction and stops the engine.
        let rip = self.uc.pc_read().unwrap_or(0);
        let mut b = [0u8; 1];
        rip > 0 && self.uc.mem_read(rip - 1, &mut b).is_ok() && b[0] == 0xF4
    }
}

impl Vcpu for UnicornVcpu {
    fn run(&mut self) -> VcpuExit {
        loop {
            if self.kicker.kicked.swap(false, Ordering::SeqCst) {
                return VcpuExit::Kicked;
            }
            if self.halted {
                match self.uc.reg_read(RegisterX86::RFLAGS) {
                    Ok(f) if f & RFLAGS_IF == 0 => return VcpuExit::Halted,
                    Ok(_) => {}
                    Err(e) => return VcpuExit::Error(format!("reading RFLAGS: {e:?}")),
                }
                if !self.lapic.wait() {
                    continue; // kicked
                }
                self.halted = false;
            }
            if let Err(e) = self.deliver_interrupt() {
                return VcpuExit::Error(format!("{e:#}"));
            }
            let rip = match self.uc.pc_read() {
                Ok(r) => r,
                Err(e) => return VcpuExit::Error(format!("reading RIP: {e:?}")),
            };
            self.kicker.hook_stopped.store(false, Ordering::Relaxed);
            if let Err(e) = self.uc.emu_start(rip, u64::MAX, 0, 0) {
                if self.tlb.paging_on.replace(false) {
                    // The guest turned paging on: from now on unicorn walks
                    // its page tables (the refused access had not happened:
                    // the instruction runs again).
                    if let Err(e) = self.uc.ctl_set_tlb_type(sys::TlbType::CPU).and_then(|_| self.uc.ctl_flush_tlb()) {
                        return VcpuExit::Error(format!("handing the TLB to the page walk: {e:?}"));
                    }
                    continue;
                }
                let rip = self.uc.pc_read().unwrap_or(0);
                return VcpuExit::Error(format!("{e:?} at rip={rip:#x}"));
            }
            // Stopped by the block hook (a kick, or an interrupt the next
            // turn delivers) or by a HLT.
            if !self.kicker.hook_stopped.load(Ordering::Relaxed) && self.just_halted() {
                self.halted = true;
            }
        }
    }

    fn state(&self) -> Result<VcpuState> {
        let uc = &self.uc;
        let mut s = VcpuState::default();
        for (i, r) in GPRS.iter().enumerate() {
            s.gprs[i] = uc.reg_read(*r).map_err(uerr("reading a GPR"))?;
        }
        s.rip = uc.pc_read().map_err(uerr("RIP"))?;
        s.rflags = uc.reg_read(RegisterX86::RFLAGS).map_err(uerr("RFLAGS"))?;
        for (i, r) in SEGS.iter().enumerate() {
            s.segs[i] = uc.reg_read(*r).map_err(uerr("segment"))? as u16;
        }
        s.fs_base = uc.reg_read(RegisterX86::FS_BASE).map_err(uerr("FS_BASE"))?;
        s.gs_base = uc.reg_read(RegisterX86::GS_BASE).map_err(uerr("GS_BASE"))?;
        s.cr0 = uc.reg_read(RegisterX86::CR0).map_err(uerr("CR0"))?;
        s.cr2 = uc.reg_read(RegisterX86::CR2).map_err(uerr("CR2"))?;
        s.cr3 = uc.reg_read(RegisterX86::CR3).map_err(uerr("CR3"))?;
        s.cr4 = uc.reg_read(RegisterX86::CR4).map_err(uerr("CR4"))?;
        s.efer = self.msr(MSR_EFER)?;
        s.gdtr = self.read_mmr(RegisterX86::GDTR)?;
        s.idtr = self.read_mmr(RegisterX86::IDTR)?;
        s.tr = self.read_tr()?;
        s.mxcsr = uc.reg_read(RegisterX86::MXCSR).map_err(uerr("MXCSR"))? as u32;
        for i in 0..16 {
            let v = uc.reg_read_long(RegisterX86::XMM0 as i32 + i).map_err(uerr("XMM"))?;
            let mut x = [0u8; 16];
            x.copy_from_slice(&v[..16]);
            s.xmm.push(x);
        }
        for i in 0..8 {
            let v = uc.reg_read_long(RegisterX86::ST0 as i32 + i).map_err(uerr("ST"))?;
            let mut x = [0u8; 10];
            x.copy_from_slice(&v[..10]);
            s.st.push(x);
        }
        s.fpcw = uc.reg_read(RegisterX86::FPCW).map_err(uerr("FPCW"))? as u16;
        s.fpsw = uc.reg_read(RegisterX86::FPSW).map_err(uerr("FPSW"))? as u16;
        s.fptag = uc.reg_read(RegisterX86::FPTAG).map_err(uerr("FPTAG"))? as u16;
        s.halted = self.halted;
        s.lapic = self.lapic.save();
        Ok(s)
    }

    fn set_state(&mut self, s: &VcpuState) -> Result<()> {
        if s.xmm.len() != 16 || s.st.len() != 8 {
            return Err(anyhow!("vCPU state has {} XMM and {} x87 registers, expected 16 and 8", s.xmm.len(), s.st.len()));
        }
        // Control registers, EFER and segments: write only what differs from
        // the engine's reset state, since reloading them re-derives the
        // flat-mode flags unicorn set up.
        let cur = self.state().context("reading reset state")?;
        if s.cr0 != cur.cr0 {
            self.uc.reg_write(RegisterX86::CR0, s.cr0).map_err(uerr("CR0"))?;
        }
        if s.cr4 != cur.cr4 {
            self.uc.reg_write(RegisterX86::CR4, s.cr4).map_err(uerr("CR4"))?;
        }
        if s.cr3 != cur.cr3 {
            self.uc.reg_write(RegisterX86::CR3, s.cr3).map_err(uerr("CR3"))?;
        }
        self.uc.reg_write(RegisterX86::CR2, s.cr2).map_err(uerr("CR2"))?;
        if s.efer != cur.efer {
            self.set_msr(MSR_EFER, s.efer)?;
        }
        // The descriptor tables first: loading a selector reads the GDT.
        if s.gdtr != cur.gdtr {
            self.write_mmr(RegisterX86::GDTR, s.gdtr)?;
        }
        for (i, r) in SEGS.iter().enumerate() {
            if s.segs[i] != cur.segs[i] {
                self.uc.reg_write(*r, s.segs[i] as u64).map_err(uerr("segment"))?;
            }
        }
        if s.idtr != cur.idtr {
            self.write_mmr(RegisterX86::IDTR, s.idtr)?;
        }
        if s.tr != cur.tr {
            self.write_tr(s.tr)?;
        }
        self.uc.reg_write(RegisterX86::FS_BASE, s.fs_base).map_err(uerr("FS_BASE"))?;
        self.uc.reg_write(RegisterX86::GS_BASE, s.gs_base).map_err(uerr("GS_BASE"))?;
        for (i, r) in GPRS.iter().enumerate() {
            self.uc.reg_write(*r, s.gprs[i]).map_err(uerr("GPR"))?;
        }
        self.uc.reg_write(RegisterX86::RFLAGS, s.rflags).map_err(uerr("RFLAGS"))?;
        self.uc.reg_write(RegisterX86::MXCSR, s.mxcsr as u64).map_err(uerr("MXCSR"))?;
        for (i, x) in s.xmm.iter().enumerate() {
            self.uc.reg_write_long(RegisterX86::XMM0 as i32 + i as i32, x).map_err(uerr("XMM"))?;
        }
        for (i, x) in s.st.iter().enumerate() {
            self.uc.reg_write_long(RegisterX86::ST0 as i32 + i as i32, x).map_err(uerr("ST"))?;
        }
        self.uc.reg_write(RegisterX86::FPCW, s.fpcw as u64).map_err(uerr("FPCW"))?;
        self.uc.reg_write(RegisterX86::FPSW, s.fpsw as u64).map_err(uerr("FPSW"))?;
        self.uc.reg_write(RegisterX86::FPTAG, s.fptag as u64).map_err(uerr("FPTAG"))?;
        self.uc.set_pc(s.rip).map_err(uerr("RIP"))?;
        self.halted = s.halted;
        self.lapic.restore(&s.lapic);
        Ok(())
    }

    fn kicker(&self) -> Arc<dyn Kicker> {
        self.kicker.clone()
    }
}
