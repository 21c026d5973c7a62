//! Interrupt delivery: the local APIC of each vCPU (the part of an xAPIC a
//! guest needs to take message-signalled interrupts) and the MSI route from
//! devices to it.
//!
//! A device raises an MSI by "writing" its message: the address names the
//! destination (0xFEEx_xxxx, APIC ID in bits 12..19, physical destination
//! mode) and the data the vector (bits 0..7, fixed delivery). The route
//! sets the vector's bit in the addressed vCPU's IRR and wakes that vCPU;
//! the vCPU takes the highest deliverable vector between two instructions
//! when RFLAGS.IF is set (moving it from IRR to ISR) and the guest ends it
//! with a write to EOI, which clears the highest ISR bit.
//!
//! The guest sees one 4 KiB register page per vCPU at [`LAPIC_ADDR`]
//! (xAPIC layout) with three registers: ID (read only, the vCPU index in
//! bits 24..31), TPR and EOI. Everything else reads as zero and ignores
//! writes: there is no timer, no IPI and no LINT pin.

use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// The local APIC page (the architectural default base).
pub const LAPIC_ADDR: u64 = 0xFEE0_0000;
pub const LAPIC_SIZE: u64 = 0x1000;
/// Registers of the page (xAPIC offsets).
pub const LAPIC_ID: u64 = 0x20;
pub const LAPIC_TPR: u64 = 0x80;
pub const LAPIC_EOI: u64 = 0xB0;

/// Where MSI messages go: address bits 20..31 are 0xFEE.
pub const MSI_ADDR_MASK: u64 = 0xFFF0_0000;
pub const MSI_ADDR_BASE: u64 = 0xFEE0_0000;
/// Vectors 0..31 are the CPU's exceptions: a message naming one is dropped.
pub const FIRST_EXTERNAL_VECTOR: u8 = 32;

/// Something a device raises MSIs through.
pub trait MsiSink: Send + Sync {
    /// Delivers the message `data` written to `addr`; false when it names
    /// no vCPU or no valid vector (the message is lost, as a write to
    /// nowhere on a real bus).
    fn send(&self, addr: u64, data: u32) -> bool;
}

/// The saved form of one local APIC: pending (IRR) and in-service (ISR)
/// vectors, 256 bits each, and the task priority.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LapicState {
    pub irr: [u64; 4],
    pub isr: [u64; 4],
    pub tpr: u8,
}

fn highest(bits: &[u64; 4]) -> Option<u8> {
    (0..4).rev().find(|&w| bits[w] != 0).map(|w| (w * 64 + 63 - bits[w].leading_zeros() as usize) as u8)
}

fn set(bits: &mut [u64; 4], v: u8) {
    bits[v as usize / 64] |= 1 << (v % 64);
}

fn clear(bits: &mut [u64; 4], v: u8) {
    bits[v as usize / 64] &= !(1 << (v % 64));
}

impl LapicState {
    /// The vector the CPU would take now: the highest pending one whose
    /// priority class (bits 4..7) is above both the task priority's and
    /// that of the highest vector in service.
    pub fn deliverable(&self) -> Option<u8> {
        let v = highest(&self.irr)?;
        let in_service = highest(&self.isr).map(|s| s >> 4).unwrap_or(0);
        let floor = (self.tpr >> 4).max(in_service);
        (v >> 4 > floor).then_some(v)
    }
}

/// One vCPU's local APIC. Devices add pending vectors from their threads;
/// the vCPU thread takes and ends them.
pub struct LocalApic {
    id: u32,
    state: Mutex<LapicState>,
    /// A vector is deliverable (read at every translation block, so an
    /// atomic beside the lock).
    ready: AtomicBool,
    /// Wakes a vCPU halted in [`LocalApic::wait`].
    wake: Condvar,
    /// Set by [`LocalApic::interrupt_wait`]: the halted vCPU must return
    /// (a pause or quit).
    stop_wait: AtomicBool,
    /// Messages accepted for this vCPU.
    pub delivered: AtomicU64,
}

impl LocalApic {
    pub fn new(id: u32) -> LocalApic {
        LocalApic {
            id,
            state: Mutex::default(),
            ready: AtomicBool::new(false),
            wake: Condvar::new(),
            stop_wait: AtomicBool::new(false),
            delivered: AtomicU64::new(0),
        }
    }

    pub fn id(&self) -> u32 {
        self.id
    }

    fn lock(&self) -> MutexGuard<'_, LapicState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn update(&self, s: &LapicState) {
        self.ready.store(s.deliverable().is_some(), Ordering::SeqCst);
    }

    /// Whether a vector waits for the vCPU (cheap: one atomic load).
    pub fn has_deliverable(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }

    /// Marks `vector` pending and wakes the vCPU if it halts.
    pub fn raise(&self, vector: u8) {
        let mut s = self.lock();
        set(&mut s.irr, vector);
        self.update(&s);
        self.delivered.fetch_add(1, Ordering::Relaxed);
        self.wake.notify_all();
    }

    /// The vCPU takes the deliverable vector, if any: IRR to ISR.
    pub fn acknowledge(&self) -> Option<u8> {
        let mut s = self.lock();
        let v = s.deliverable()?;
        clear(&mut s.irr, v);
        set(&mut s.isr, v);
        self.update(&s);
        Some(v)
    }

    /// A guest read of the register page.
    pub fn mmio_read(&self, offset: u64) -> u32 {
        match offset {
            LAPIC_ID => self.id << 24,
            LAPIC_TPR => self.lock().tpr as u32,
            _ => 0,
        }
    }

    /// A guest write to the register page.
    pub fn mmio_write(&self, offset: u64, value: u32) {
        let mut s = self.lock();
        match offset {
            // EOI ends the highest vector in service, whatever is written.
            LAPIC_EOI => {
                if let Some(v) = highest(&s.isr) {
                    clear(&mut s.isr, v);
                }
            }
            LAPIC_TPR => s.tpr = value as u8,
            _ => return,
        }
        self.update(&s);
    }

    /// Sleeps while the vCPU halts: until a vector is deliverable, or
    /// [`LocalApic::interrupt_wait`] was called (returns false then).
    pub fn wait(&self) -> bool {
        let mut s = self.lock();
        loop {
            if self.stop_wait.swap(false, Ordering::SeqCst) {
                return false;
            }
            if s.deliverable().is_some() {
                return true;
            }
            // The bound only guards against a lost wake-up; both paths that
            // end the wait notify under the lock.
            s = self.wake.wait_timeout(s, Duration::from_millis(100)).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// Ends a [`LocalApic::wait`] in progress or the next one (a kick).
    pub fn interrupt_wait(&self) {
        let _s = self.lock();
        self.stop_wait.store(true, Ordering::SeqCst);
        self.wake.notify_all();
    }

    /// Clears a stale [`LocalApic::interrupt_wait`] before the vCPU runs.
    pub fn clear_interrupt_wait(&self) {
        self.stop_wait.store(false, Ordering::SeqCst);
    }

    pub fn save(&self) -> LapicState {
        self.lock().clone()
    }

    pub fn restore(&self, st: &LapicState) {
        let mut s = self.lock();
        *s = st.clone();
        self.update(&s);
        self.wake.notify_all();
    }
}

/// The platform's MSI route: one local APIC per vCPU, APIC ID = vCPU index.
pub struct Apics {
    cpus: Vec<Arc<LocalApic>>,
    /// Messages that named no vCPU or no valid vector.
    pub dropped: AtomicU64,
}

impl Apics {
    pub fn new(vcpus: u32) -> Arc<Apics> {
        Arc::new(Apics { cpus: (0..vcpus).map(|i| Arc::new(LocalApic::new(i))).collect(), dropped: AtomicU64::new(0) })
    }

    pub fn cpu(&self, index: usize) -> Option<&Arc<LocalApic>> {
        self.cpus.get(index)
    }
}

/// Decodes an MSI message: (destination APIC ID, vector), or None for one
/// that is not an interrupt this platform delivers (an address outside
/// 0xFEEx_xxxx, logical destination mode, a delivery mode other than
/// fixed, or an exception vector).
pub fn decode_msi(addr: u64, data: u32) -> Option<(u32, u8)> {
    let logical = addr & (1 << 2) != 0;
    let delivery_mode = (data >> 8) & 0x7;
    let vector = data as u8;
    if addr & MSI_ADDR_MASK != MSI_ADDR_BASE || logical || delivery_mode != 0 || vector < FIRST_EXTERNAL_VECTOR {
        return None;
    }
    Some((((addr >> 12) & 0xff) as u32, vector))
}

impl MsiSink for Apics {
    fn send(&self, addr: u64, data: u32) -> bool {
        match decode_msi(addr, data).and_then(|(id, v)| Some((self.cpus.get(id as usize)?, v))) {
            Some((cpu, v)) => {
                cpu.raise(v);
                true
            }
            None => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn priority_classes_and_eoi() {
        let a = LocalApic::new(0);
        a.raise(0x41);
        a.raise(0x52);
        assert!(a.has_deliverable());
        assert_eq!(a.acknowledge(), Some(0x52));
        // 0x41 is of a lower class than 0x52 in service: it waits for EOI.
        assert!(!a.has_deliverable());
        assert_eq!(a.acknowledge(), None);
        a.mmio_write(LAPIC_EOI, 0);
        assert_eq!(a.acknowledge(), Some(0x41));
        a.mmio_write(LAPIC_EOI, 0);
        // The task priority holds back classes at or below its own.
        a.mmio_write(LAPIC_TPR, 0x40);
        a.raise(0x45);
        assert!(!a.has_deliverable());
        a.mmio_write(LAPIC_TPR, 0);
        assert_eq!(a.acknowledge(), Some(0x45));
        assert_eq!(a.save().isr[1], 1 << 5);
        assert_eq!(a.mmio_read(LAPIC_ID), 0);
    }

    #[test]
    fn messages_route_by_destination_and_bad_ones_drop() {
        let apics = Apics::new(2);
        assert!(apics.send(0xFEE0_1000, 0x40));
        assert!(apics.cpu(1).unwrap().has_deliverable());
        assert!(!apics.cpu(0).unwrap().has_deliverable());
        for (addr, data) in [(0xFEE0_2000, 0x40), (0xFED0_0000, 0x40), (0xFEE0_0000, 0x10), (0xFEE0_0004, 0x40), (0xFEE0_0000, 0x440)] {
            assert!(!apics.send(addr, data), "{addr:#x} {data:#x}");
        }
        assert_eq!(apics.dropped.load(Ordering::Relaxed), 5);
    }
}
