//! PVRDMA interrupts as MSI-X messages: the command response on vector 0
//! and CQ notifications on vector 2 (as Linux's vmw_pvrdma sets them up),
//! each sent with its table entry's address and data once MSI-X is enabled
//! in configuration space and the entry is unmasked; held in the PBA while
//! masked and sent on unmask; not signalled while IMR masks the vector.
//! Real rnicd processes on testbed hosts and a bare-metal verbs peer, as
//! in pvrdma_device.rs; the messages go to a recording sink in place of
//! the vCPUs' local APICs (crates/vmm/tests/interrupts.rs delivers them).
mod pvrdma;

use std::sync::{Arc, Mutex};
use std::time::Instant;

use devices::apic::MsiSink;
use devices::bus::BusDevice;
use devices::pci::{PciRoot, MSIX_CAP_OFFSET};
use devices::Lifecycle;
use pvrdma::*;
use pvrdma_abi::*;
use snapshot::Persist;
use verbs::SendWr;

#[derive(Default)]
struct Recorder(Mutex<Vec<(u64, u32)>>);

impl MsiSink for Recorder {
    fn send(&self, addr: u64, data: u32) -> bool {
        self.0.lock().unwrap().push((addr, data));
        true
    }
}

impl Recorder {
    fn take(&self) -> Vec<(u64, u32)> {
        std::mem::take(&mut self.0.lock().unwrap())
    }
}

/// The local APIC address of vCPU 0 and the vector the guest chose for
/// each device vector.
const MSI_ADDR: u64 = 0xFEE0_0000;
fn data(v: u32) -> u32 {
    0x30 + v
}

fn msix_write(d: &Drv, off: u64, v: u32) {
    d.msix.lock().unwrap().write(off, &v.to_le_bytes());
}

fn msix_read(d: &Drv, off: u64) -> u32 {
    let mut b = [0u8; 4];
    d.msix.lock().unwrap().read(off, &mut b);
    u32::from_le_bytes(b)
}

/// Configuration dword `reg` of device 0 through ports 0xCF8/0xCFC.
fn config(root: &mut PciRoot, reg: usize, write: Option<u32>) -> u32 {
    root.write(0, &(0x8000_0000u32 | (reg as u32) << 2).to_le_bytes());
    if let Some(v) = write {
        root.write(4, &v.to_le_bytes());
    }
    let mut b = [0u8; 4];
    root.read(4, &mut b);
    u32::from_le_bytes(b)
}

#[test]
fn response_and_cq_notification_arrive_as_msix_messages() {
    let bed = Bed::new("pvirq", 2);
    let gid = bed.vm_gid(0, 1);
    let mut d = Drv::new(&bed.nics[0].sock, gid);
    let rec = Arc::new(Recorder::default());
    d.dev.lock().unwrap().set_msi_sink(rec.clone());
    let mut root = PciRoot::new();
    root.add(d.dev.clone()).unwrap();

    // What Linux's pvrdma_pci_probe expects: 15ad:0820, BARs 0 (MSI-X), 1
    // (registers) and 2 (UAR) memory BARs; like VMware's, 32-bit ones in
    // the PCI hole below 4 GiB, each sized by all ones.
    assert_eq!(config(&mut root, 0, None), 0x0820_15ad);
    assert_eq!(config(&mut root, 2, None) >> 8, PCI_CLASS_NETWORK_OTHER);
    assert_eq!(config(&mut root, 0x2c / 4, None), 0x0820_15ad, "subsystem");
    let bars: Vec<u32> = (4..10).map(|r| config(&mut root, r, None)).collect();
    assert_eq!(bars[3..], [0, 0, 0], "three BARs, each one BAR register");
    for (slot, size) in [(BAR_MSIX, MSIX_BAR_SIZE), (BAR_REG, REG_BAR_SIZE), (BAR_UAR, 64 * 4096)] {
        let (reg, addr) = (4 + slot as usize, bars[slot as usize]);
        assert_eq!(addr & 0xf, 0, "BAR{slot}: memory, 32-bit, non-prefetchable");
        assert!(addr as u64 >= devices::layout::PCI_HOLE_BASE && (addr as u64) < 0xFEC0_0000, "BAR{slot} at {addr:#x}");
        assert_eq!(config(&mut root, reg, Some(!0)), !(size as u32 - 1), "BAR{slot} size");
        assert_eq!(config(&mut root, reg, Some(addr)), addr);
    }

    // The capability list names MSI-X with 16 vectors, table and PBA in BAR 0.
    assert_ne!(config(&mut root, 1, None) & (0x10 << 16), 0);
    let cap = MSIX_CAP_OFFSET / 4;
    assert_eq!(config(&mut root, cap, None) & 0xffff, 0x11);
    assert_eq!(config(&mut root, cap, None) >> 16, 15);
    assert_eq!(config(&mut root, cap + 1, None), MSIX_TABLE_OFFSET as u32 | BAR_MSIX as u32);
    assert_eq!(config(&mut root, cap + 2, None), MSIX_PBA_OFFSET as u32 | BAR_MSIX as u32);

    // Before MSI-X is enabled, nothing is sent.
    d.bring_up();
    let pd = d.create_pd();
    assert!(rec.take().is_empty());

    // The driver's order: table entries (unmasked), then enable.
    for v in 0..3u32 {
        let e = MSIX_TABLE_OFFSET + v as u64 * MSIX_ENTRY_SIZE;
        msix_write(&d, e, MSI_ADDR as u32);
        msix_write(&d, e + 4, 0);
        msix_write(&d, e + 8, data(v));
        msix_write(&d, e + 12, 0);
    }
    config(&mut root, cap, Some(0x8000 << 16));
    d.create_pd();
    assert_eq!(rec.take(), vec![(MSI_ADDR, data(INTR_VECTOR_RESPONSE))]);

    // IMR masks the response vector: no message, and none later.
    d.wr(REG_IMR, INTR_CAUSE_RESPONSE);
    d.create_pd();
    d.wr(REG_IMR, 0);
    assert!(rec.take().is_empty());

    // A masked entry holds its vector in the PBA; unmasking sends it.
    let e0 = MSIX_TABLE_OFFSET;
    msix_write(&d, e0 + 12, 1);
    d.cmd_raw(&CmdCreatePd { hdr: Drv::hdr(CMD_CREATE_PD), ctx_handle: 0, reserved: [0; 4] });
    assert!(rec.take().is_empty());
    assert_eq!(msix_read(&d, MSIX_PBA_OFFSET) & 1, 1);
    msix_write(&d, e0 + 12, 0);
    assert_eq!(rec.take(), vec![(MSI_ADDR, data(INTR_VECTOR_RESPONSE))]);
    assert_eq!(msix_read(&d, MSIX_PBA_OFFSET) & 1, 0);

    // Reading ICR (what a driver without MSI-X does) clears ICR, not the
    // PBA: the pending vector is still sent on unmask.
    msix_write(&d, e0 + 12, 1);
    d.rd(REG_ICR);
    d.cmd_raw(&CmdCreatePd { hdr: Drv::hdr(CMD_CREATE_PD), ctx_handle: 0, reserved: [0; 4] });
    assert_eq!(d.rd(REG_ICR) & INTR_CAUSE_RESPONSE, INTR_CAUSE_RESPONSE);
    assert_eq!(d.rd(REG_ICR), 0, "read to clear");
    assert_eq!(msix_read(&d, MSIX_PBA_OFFSET) & 1, 1, "ICR reads leave the PBA alone");
    assert!(rec.take().is_empty());
    msix_write(&d, e0 + 12, 0);
    assert_eq!(rec.take(), vec![(MSI_ADDR, data(INTR_VECTOR_RESPONSE))]);
    assert_eq!(msix_read(&d, MSIX_PBA_OFFSET) & 1, 0);

    // The function mask holds every vector the same way.
    config(&mut root, cap, Some(0xC000 << 16));
    d.cmd_raw(&CmdCreatePd { hdr: Drv::hdr(CMD_CREATE_PD), ctx_handle: 0, reserved: [0; 4] });
    assert!(rec.take().is_empty());
    config(&mut root, cap, Some(0x8000 << 16));
    assert_eq!(rec.take(), vec![(MSI_ADDR, data(INTR_VECTOR_RESPONSE))]);

    // An armed CQ: the completion of a peer SEND raises the CQ vector.
    let Conn { buf, key, mut rcq, mut qp, .. } = d.rc_conn_in(pd, ConnSpec { cq_entries: 16, depth: 8, sge: 2, ..Default::default() });
    let peer = bed.peer_of(&mut d, &qp, gid, 500, 700);
    rec.take();
    d.doorbell(UAR_CQ_OFFSET, UAR_CQ_ARM | rcq.handle);
    d.post_recv(&mut qp, 9, &[Sge { addr: buf, length: 64, lkey: key }]);
    peer.qp.post_send(&[SendWr::send(1, &[peer.mr.sge(0, 64)])]).unwrap();
    let t0 = Instant::now();
    while !rec.0.lock().unwrap().contains(&(MSI_ADDR, data(INTR_VECTOR_CQ))) {
        assert!(t0.elapsed() < T, "no CQ notification message: {:?}", rec.0.lock().unwrap());
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(d.get::<Cqne>(d.cq_ring + EVENT_RING_FIRST_OFFSET).info, rcq.handle);
    assert_eq!(d.wait_cqes(&mut rcq, 1)[0].wr_id, 9);
    let q = d.query();
    assert!(q["counters"]["interrupts"].as_u64().unwrap() >= 4, "{q}");
    assert_eq!(q["counters"]["lost_interrupts"], 0, "{q}");
}

/// A guest that turned bus mastering and memory decoding off (as a driver
/// does on remove or before a reset), set an interrupt line and masked
/// MSI-X as a whole finds its configuration space so after a save and a
/// restore into a new device; and one with everything on finds that.
#[test]
fn configuration_space_as_the_guest_left_it_survives_save_and_restore() {
    let bed = Bed::new("pvcfg", 1);
    let (gid, mut d, fd) = bed.movable_device();
    d.create_pd();
    let cap = MSIX_CAP_OFFSET / 4;
    const MEMORY: u32 = 1 << 1;
    const BUS_MASTER: u32 = 1 << 2;
    const INTX_DISABLE: u32 = 1 << 10;
    const MSIX_ENABLE: u32 = 0x8000 << 16;
    const MSIX_FUNCTION_MASK: u32 = 0x4000 << 16;
    for (command, msix) in [(INTX_DISABLE, MSIX_ENABLE | MSIX_FUNCTION_MASK), (MEMORY | BUS_MASTER | INTX_DISABLE, MSIX_ENABLE)] {
        let mut root = PciRoot::new();
        root.add(d.dev.clone()).unwrap();
        config(&mut root, 1, Some(MEMORY | BUS_MASTER | INTX_DISABLE));
        config(&mut root, 1, Some(command));
        config(&mut root, 0x3c / 4, Some(11));
        config(&mut root, cap, Some(msix));
        let before: Vec<u32> = [1, 0x3c / 4, cap].iter().map(|r| config(&mut root, *r, None)).collect();
        assert_eq!(before[0] & 0xffff, command);
        assert_eq!(before[2] & (MSIX_ENABLE | MSIX_FUNCTION_MASK), msix);

        d.dev.lock().unwrap().pause();
        let section = d.dev.lock().unwrap().save().expect("save");
        d.replace_device(&bed.nics[0].sock, gid, fd.try_clone().unwrap());
        let mut root = PciRoot::new();
        root.add(d.dev.clone()).unwrap();
        assert_eq!(config(&mut root, 1, None) & 0xffff, 0, "a new function starts with everything off");
        d.dev.lock().unwrap().restore(&section).expect("restore");
        d.dev.lock().unwrap().resume();
        let after: Vec<u32> = [1, 0x3c / 4, cap].iter().map(|r| config(&mut root, *r, None)).collect();
        assert_eq!(after, before, "command and status, interrupt line, MSI-X control as the guest left them");
        assert_eq!(d.query()["objects"]["pds"], 1, "the rest of the state came along");
    }
}
