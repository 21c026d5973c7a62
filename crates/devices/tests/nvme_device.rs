//! The NVMe controller driven through its bus interface with real guest
//! memory and no vCPU: every command, every malformed case.

use devices::bus::BusDevice;
use devices::nvme::harness::{setup, HostDriver};
use devices::nvme::spec::*;
use devices::nvme::{NvmeConfig, NvmeController};
use devices::{GuestMemory, Lifecycle};
use snapshot::Persist;
use std::sync::{Arc, Mutex};
use vm_memory::GuestAddress;

const RAM: usize = 64 << 20;

fn io_ready(spec: &str, queues: u16, entries: u32) -> HostDriver {
    let mut d = setup(spec, RAM);
    d.create_io_queues(queues, entries).unwrap();
    d
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| (seed.wrapping_mul(31).wrapping_add(i as u64 * 7) % 251) as u8).collect()
}

fn temp_disk(bytes: u64) -> tempfile::NamedTempFile {
    let f = tempfile::NamedTempFile::new().unwrap();
    f.as_file().set_len(bytes).unwrap();
    f
}

// ---- registers and controller state ------------------------------------------

#[test]
fn registers_after_reset_and_enable() {
    let d = setup("ns=mem:1M,depth=4096", RAM);
    let cap = d.read64(REG_CAP);
    assert_eq!(cap & 0xffff, 4095, "MQES");
    assert_eq!((cap >> 16) & 1, 1, "CQR");
    assert_eq!((cap >> 32) & 0xf, 0, "DSTRD");
    assert_eq!((cap >> 37) & 1, 1, "NVM command set");
    assert_eq!(d.read32(REG_VS), 0x0001_0400);
    // CAP read as two dwords agrees with the qword.
    assert_eq!(d.read32(0) as u64 | (d.read32(4) as u64) << 32, cap);
    // Interrupt mask set / clear.
    d.write32(REG_INTMS, 0x5);
    assert_eq!(d.read32(REG_INTMS), 0x5);
    d.write32(REG_INTMC, 0x1);
    assert_eq!(d.read32(REG_INTMS), 0x4);
    assert_eq!(d.read32(REG_INTMC), 0x4);
    // Admin queue registers cannot move while enabled.
    let asq = d.read64(REG_ASQ);
    d.write64(REG_ASQ, 0x1234_5000);
    assert_eq!(d.read64(REG_ASQ), asq);
    // Doorbells read as zero; odd sizes are ignored, never fatal.
    assert_eq!(d.read32(DOORBELL_BASE), 0);
    d.dev.lock().unwrap().write(REG_CC, &[1, 2]);
    assert_eq!(d.csts() & CSTS_CFS, 0);
}

#[test]
fn invalid_enable_sets_fatal_status_until_reset() {
    for (what, aqa, cc) in [
        ("admin queues of one entry", 0u32, HostDriver::cc_enabled()),
        ("unsupported page size", 63 | 63 << 16, HostDriver::cc_enabled() | 1 << 7),
        ("unsupported command set", 63 | 63 << 16, HostDriver::cc_enabled() | 2 << 4),
        ("unsupported arbitration", 63 | 63 << 16, HostDriver::cc_enabled() | 7 << 11),
    ] {
        let mem = GuestMemory::from_ranges(&[(GuestAddress(0), RAM)]).unwrap();
        let ctrl = NvmeController::new(NvmeConfig::parse("ns=mem:1M").unwrap(), mem.clone(), devices::layout::PCI_BAR_BASE).unwrap();
        let d = HostDriver::new(Arc::new(Mutex::new(ctrl)), mem, 0x10_0000, RAM as u64);
        d.write32(REG_AQA, aqa);
        d.write64(REG_ASQ, 0x20_0000);
        d.write64(REG_ACQ, 0x21_0000);
        d.write32(REG_CC, cc);
        assert_eq!(d.csts() & (CSTS_CFS | CSTS_RDY), CSTS_CFS, "{what}: CSTS.CFS");
        // Reset (EN=0) clears it and a proper enable works.
        d.write32(REG_CC, 0);
        assert_eq!(d.csts() & (CSTS_CFS | CSTS_RDY), 0, "{what}: reset");
        d.write32(REG_AQA, 63 | 63 << 16);
        d.write32(REG_CC, HostDriver::cc_enabled());
        assert_eq!(d.csts() & (CSTS_CFS | CSTS_RDY), CSTS_RDY, "{what}: re-enable");
    }
    // Admin queues outside guest RAM.
    let mem = GuestMemory::from_ranges(&[(GuestAddress(0), RAM)]).unwrap();
    let ctrl = NvmeController::new(NvmeConfig::parse("ns=mem:1M").unwrap(), mem.clone(), devices::layout::PCI_BAR_BASE).unwrap();
    let d = HostDriver::new(Arc::new(Mutex::new(ctrl)), mem, 0x10_0000, RAM as u64);
    d.write32(REG_AQA, 63 | 63 << 16);
    d.write64(REG_ASQ, 1 << 40);
    d.write64(REG_ACQ, 0x21_0000);
    d.write32(REG_CC, HostDriver::cc_enabled());
    assert_eq!(d.csts() & CSTS_CFS, CSTS_CFS);
}

#[test]
fn cc_change_while_enabled_is_fatal_and_commands_stop() {
    let mut d = io_ready("ns=mem:1M", 1, 16);
    d.write32(REG_CC, HostDriver::cc_enabled() | 1 << 7); // MPS changes while EN=1
    assert_ne!(d.csts() & CSTS_CFS, 0);
    // Doorbells are ignored now: nothing completes.
    let cmd = Command { opcode: ADM_GET_FEATURES, cid: 77, cdw10: FEAT_NUM_QUEUES as u32, ..Default::default() };
    d.push(0, &cmd);
    d.ring(0);
    d.timeout = std::time::Duration::from_millis(50);
    assert!(d.wait(0).is_none());
    // Reset and start over.
    d.write32(REG_CC, 0);
    assert_eq!(d.csts() & (CSTS_CFS | CSTS_RDY), 0);
}

#[test]
fn shutdown_notification_and_reset_tear_down_queues() {
    let mut d = io_ready("ns=mem:1M", 2, 16);
    d.write32(REG_CC, HostDriver::cc_enabled() | 1 << 14); // normal shutdown
    assert_eq!(d.csts() & CSTS_SHST_MASK, CSTS_SHST_COMPLETE);
    d.write32(REG_CC, 0);
    assert_eq!(d.csts() & (CSTS_RDY | CSTS_SHST_MASK), 0);
    // After reset the I/O queues are gone: enable again and recreate them.
    d.io.clear();
    let csts = d.enable(32);
    assert_eq!(csts & CSTS_RDY, CSTS_RDY);
    d.create_io_queues(2, 16).unwrap();
    let st = d.dev.lock().unwrap().stats();
    assert_eq!(st["io_queues"], 2);
}

// ---- Identify -------------------------------------------------------------------

#[test]
fn identify_controller_and_namespaces() {
    let mut d = setup("name=nvmeX,ns=mem:1M,ns=mem:2M,block=4096", RAM);
    let (s, id) = d.identify(0x01, 0, 0);
    assert_eq!(s, Status::SUCCESS);
    assert_eq!(u16::from_le_bytes([id[0], id[1]]), devices::nvme::PCI_VENDOR);
    assert!(String::from_utf8_lossy(&id[4..24]).contains("nvmeX"));
    assert_eq!(id[512], 0x66);
    assert_eq!(id[513], 0x44);
    assert_eq!(u32::from_le_bytes(id[516..520].try_into().unwrap()), 256, "NN");
    assert_eq!(u16::from_le_bytes([id[520], id[521]]) & 0xd, 0xd, "ONCS compare, dsm, write zeroes");
    assert_eq!(id[525] & 1, 1, "volatile write cache");
    assert_eq!(u32::from_le_bytes(id[92..96].try_into().unwrap()) & (1 << 8), 1 << 8, "OAES ns attribute");

    let (s, ns) = d.identify(0x00, 2, 0);
    assert_eq!(s, Status::SUCCESS);
    assert_eq!(u64::from_le_bytes(ns[0..8].try_into().unwrap()), 512, "NSZE in 4 KiB blocks");
    assert_eq!((u32::from_le_bytes(ns[128..132].try_into().unwrap()) >> 16) & 0xff, 12, "LBADS");
    // Inactive NSID: zeros; invalid NSIDs: error.
    let (s, z) = d.identify(0x00, 9, 0);
    assert_eq!(s, Status::SUCCESS);
    assert!(z.iter().all(|&b| b == 0));
    assert_eq!(d.identify(0x00, 0, 0).0, Status::INVALID_NAMESPACE);
    assert_eq!(d.identify(0x00, 0xffff_ffff, 0).0, Status::INVALID_NAMESPACE);
    assert_eq!(d.identify(0x00, 1000, 0).0, Status::INVALID_NAMESPACE);

    let (s, list) = d.identify(0x02, 0, 0);
    assert_eq!(s, Status::SUCCESS);
    assert_eq!(&list[0..12], &[1, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0]);
    let (_, list) = d.identify(0x02, 1, 0);
    assert_eq!(&list[0..8], &[2, 0, 0, 0, 0, 0, 0, 0]);
    assert_eq!(d.identify(0x02, 0xffff_fffe, 0).0, Status::INVALID_NAMESPACE);
    let (s, list7) = d.identify(0x07, 0, 0);
    assert_eq!(s, Status::SUCCESS);
    assert_eq!(&list7[0..12], &[1, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0], "CNS 07h for the NVM set lists the same");
    assert_eq!(d.identify(0x07, 0, 1).0, Status::INVALID_FIELD, "unsupported CSI");

    let (s, desc) = d.identify(0x03, 1, 0);
    assert_eq!(s, Status::SUCCESS);
    assert_eq!((desc[0], desc[1]), (2, 16), "NGUID descriptor");
    assert_eq!((desc[20], desc[21]), (3, 16), "UUID descriptor");
    assert_eq!((desc[40], desc[41], desc[44]), (4, 1, 0), "CSI descriptor");
    assert_ne!(&desc[4..20], &[0u8; 16]);
    let (_, desc2) = d.identify(0x03, 2, 0);
    assert_ne!(&desc[4..20], &desc2[4..20], "namespaces have distinct IDs");
    assert_eq!(d.identify(0x03, 5, 0).0, Status::INVALID_NAMESPACE);

    assert_eq!(d.identify(0x05, 1, 0).0, Status::SUCCESS);
    assert_eq!(d.identify(0x05, 5, 0).0, Status::INVALID_NAMESPACE);
    assert_eq!(d.identify(0x05, 1, 2).0, Status::INVALID_FIELD);
    assert_eq!(d.identify(0x06, 0, 0).0, Status::SUCCESS);
    assert_eq!(d.identify(0x06, 0, 2).0, Status::INVALID_FIELD);
    assert_eq!(d.identify(0x1f, 0, 0).0, Status::INVALID_FIELD, "unknown CNS");
}

// ---- queues ----------------------------------------------------------------------

#[test]
fn queue_creation_and_deletion_errors() {
    let mut d = setup("ns=mem:1M,queues=4,depth=256", RAM);
    let buf = d.alloc(256 * 64);
    let mk = |op: u8, qid: u32, size: u32, cdw11: u32, prp1: u64| Command {
        opcode: op,
        prp1,
        cdw10: qid | (size - 1) << 16,
        cdw11,
        ..Default::default()
    };
    let cases = [
        ("CQ id 0", mk(ADM_CREATE_CQ, 0, 16, 1, buf), Status::INVALID_QUEUE_ID),
        ("CQ id above allocation", mk(ADM_CREATE_CQ, 5, 16, 1, buf), Status::INVALID_QUEUE_ID),
        ("CQ size 1", mk(ADM_CREATE_CQ, 1, 1, 1, buf), Status::INVALID_QUEUE_SIZE),
        ("CQ above MQES", mk(ADM_CREATE_CQ, 1, 257, 1, buf), Status::INVALID_QUEUE_SIZE),
        ("CQ not contiguous", mk(ADM_CREATE_CQ, 1, 16, 0, buf), Status::INVALID_FIELD),
        ("CQ base misaligned", mk(ADM_CREATE_CQ, 1, 16, 1, buf + 8), Status::INVALID_PRP_OFFSET),
        ("CQ outside RAM", mk(ADM_CREATE_CQ, 1, 16, 1, 1 << 40), Status::INVALID_FIELD),
        ("CQ bad vector", mk(ADM_CREATE_CQ, 1, 16, 3 | 99 << 16, buf), Status::INVALID_INTERRUPT_VECTOR),
        ("SQ on missing CQ", mk(ADM_CREATE_SQ, 1, 16, 1 | 1 << 16, buf), Status::INVALID_CQ),
        ("SQ on admin CQ", mk(ADM_CREATE_SQ, 1, 16, 1, buf), Status::INVALID_CQ),
        ("delete SQ 0", mk(ADM_DELETE_SQ, 0, 1, 0, 0), Status::INVALID_QUEUE_ID),
        ("delete missing SQ", mk(ADM_DELETE_SQ, 3, 1, 0, 0), Status::INVALID_QUEUE_ID),
        ("delete missing CQ", mk(ADM_DELETE_CQ, 3, 1, 0, 0), Status::INVALID_QUEUE_ID),
        ("delete admin CQ", mk(ADM_DELETE_CQ, 0, 1, 0, 0), Status::INVALID_QUEUE_ID),
    ];
    for (what, cmd, want) in cases {
        assert_eq!(d.admin_cmd(cmd).status, want, "{what}");
    }
    assert_eq!(d.admin_cmd(mk(ADM_CREATE_CQ, 1, 16, 1, buf)).status, Status::SUCCESS);
    assert_eq!(d.admin_cmd(mk(ADM_CREATE_CQ, 1, 16, 1, buf)).status, Status::INVALID_QUEUE_ID, "CQ exists");
    let sqbuf = d.alloc(4096);
    assert_eq!(d.admin_cmd(mk(ADM_CREATE_SQ, 1, 16, 1 | 1 << 16, sqbuf)).status, Status::SUCCESS);
    assert_eq!(d.admin_cmd(mk(ADM_CREATE_SQ, 1, 16, 1 | 1 << 16, sqbuf)).status, Status::INVALID_QUEUE_ID, "SQ exists");
    assert_eq!(d.admin_cmd(mk(ADM_DELETE_CQ, 1, 1, 0, 0)).status, Status::INVALID_QUEUE_DELETION, "CQ still has an SQ");
    // Number of queues cannot change once I/O queues exist.
    let nq = Command { opcode: ADM_SET_FEATURES, cdw10: FEAT_NUM_QUEUES as u32, cdw11: 1 | 1 << 16, ..Default::default() };
    assert_eq!(d.admin_cmd(nq).status, Status::COMMAND_SEQUENCE_ERROR);
    assert_eq!(d.admin_cmd(mk(ADM_DELETE_SQ, 1, 1, 0, 0)).status, Status::SUCCESS);
    assert_eq!(d.admin_cmd(mk(ADM_DELETE_CQ, 1, 1, 0, 0)).status, Status::SUCCESS);
    // Now it can: ask for 2 of each, get 2.
    let c = d.admin_cmd(nq);
    assert_eq!((c.status, c.dw0), (Status::SUCCESS, 1 | 1 << 16));
    assert_eq!(d.admin_cmd(mk(ADM_CREATE_CQ, 3, 16, 1, buf)).status, Status::INVALID_QUEUE_ID, "beyond the allocation");
    let c = d.admin_cmd(Command { opcode: ADM_SET_FEATURES, cdw10: FEAT_NUM_QUEUES as u32, cdw11: 0xffff, ..Default::default() });
    assert_eq!(c.status, Status::INVALID_FIELD);
}

#[test]
fn sixteen_queue_pairs_of_4096_entries() {
    let mut d = setup("ns=mem:16M,queues=16,depth=4096", 256 << 20);
    d.create_io_queues(16, 4096).unwrap();
    let buf = d.alloc(4096);
    for q in 1..=16usize {
        d.write_mem(buf, &pattern(q as u64, 4096));
        let w = d.rw_cmd(true, 1, q as u64 * 8, 8, buf, 4096, None);
        assert_eq!(d.io_cmd(q, w).status, Status::SUCCESS);
    }
    for q in 1..=16usize {
        d.zero(buf, 4096);
        let r = d.rw_cmd(false, 1, q as u64 * 8, 8, buf, 4096, None);
        let c = d.io_cmd(17 - q, r);
        assert_eq!(c.status, Status::SUCCESS);
        assert_eq!(c.sq_id as usize, 17 - q);
        assert_eq!(d.read_mem(buf, 4096), pattern(q as u64, 4096));
    }
    // Fill one queue to its depth (4095 commands outstanding) in one doorbell.
    for i in 0..4095u32 {
        let mut r = d.rw_cmd(false, 1, i as u64 % 1000, 1, buf, 512, None);
        r.cid = i as u16;
        d.push(1, &r);
    }
    d.ring(1);
    let mut seen = vec![false; 4095];
    let mut out = Vec::new();
    while out.len() < 4095 {
        let before = out.len();
        d.poll_many(1, 4096, &mut out);
        assert!(out.len() > before, "completions keep coming");
    }
    for c in out {
        assert_eq!(c.status, Status::SUCCESS);
        assert!(!seen[c.cid as usize]);
        seen[c.cid as usize] = true;
    }
}

// ---- features and logs -------------------------------------------------------

#[test]
fn features_get_set() {
    let mut d = setup("ns=mem:1M,queues=8", RAM);
    let get = |d: &mut HostDriver, fid: u8, sel: u32, cdw11: u32| {
        d.admin_cmd(Command { opcode: ADM_GET_FEATURES, cdw10: fid as u32 | sel << 8, cdw11, ..Default::default() })
    };
    let set = |d: &mut HostDriver, fid: u8, v: u32| {
        d.admin_cmd(Command { opcode: ADM_SET_FEATURES, cdw10: fid as u32, cdw11: v, ..Default::default() })
    };
    assert_eq!(get(&mut d, FEAT_NUM_QUEUES, 0, 0).dw0, 7 | 7 << 16);
    assert_eq!(get(&mut d, FEAT_VWC, 0, 0).dw0, 1);
    assert_eq!(set(&mut d, FEAT_VWC, 0).status, Status::SUCCESS);
    assert_eq!(get(&mut d, FEAT_VWC, 0, 0).dw0, 0);
    assert_eq!(get(&mut d, FEAT_VWC, 1, 0).dw0, 1, "default");
    assert_eq!(get(&mut d, FEAT_VWC, 3, 0).dw0, 0x4, "capabilities: changeable");
    for (fid, v) in [
        (FEAT_ARBITRATION, 0x0302_0103u32),
        (FEAT_IRQ_COALESCING, 0x0a05),
        (FEAT_ASYNC_EVENT_CONFIG, 0x1ff),
        (FEAT_WRITE_ATOMICITY, 1),
        (FEAT_SW_PROGRESS, 9),
    ] {
        assert_eq!(set(&mut d, fid, v).status, Status::SUCCESS, "set {fid:#x}");
        assert_eq!(get(&mut d, fid, 0, 0).dw0, v, "get {fid:#x}");
    }
    assert_eq!(set(&mut d, FEAT_IRQ_CONFIG, 3 | 1 << 16).status, Status::SUCCESS);
    assert_eq!(get(&mut d, FEAT_IRQ_CONFIG, 0, 3).dw0, 3 | 1 << 16);
    assert_eq!(set(&mut d, FEAT_IRQ_CONFIG, 500).status, Status::INVALID_FIELD);
    assert_eq!(set(&mut d, FEAT_POWER_MGMT, 0).status, Status::SUCCESS);
    assert_eq!(set(&mut d, FEAT_POWER_MGMT, 1).status, Status::INVALID_FIELD, "only power state 0");
    assert_eq!(get(&mut d, FEAT_TEMP_THRESHOLD, 0, 0).dw0 & 0xffff, 343);
    assert_eq!(set(&mut d, FEAT_TEMP_THRESHOLD, 350).status, Status::SUCCESS);
    assert_eq!(get(&mut d, FEAT_TEMP_THRESHOLD, 0, 0).dw0 & 0xffff, 350);
    assert_eq!(set(&mut d, FEAT_TEMP_THRESHOLD, 350 | 3 << 20).status, Status::INVALID_FIELD);
    assert_eq!(set(&mut d, 0x7e, 1).status, Status::INVALID_FIELD, "unknown feature");
    assert_eq!(get(&mut d, 0x7e, 0, 0).status, Status::INVALID_FIELD);
    let c = d.admin_cmd(Command { opcode: ADM_SET_FEATURES, cdw10: FEAT_VWC as u32 | 1 << 31, cdw11: 1, ..Default::default() });
    assert_eq!(c.status, Status::FEATURE_NOT_SAVEABLE);
}

fn get_log(d: &mut HostDriver, lid: u8, len: usize, offset: u64, rae: bool) -> (Status, Vec<u8>) {
    let buf = d.alloc(len.max(4096) as u64);
    d.zero(buf, len as u64);
    let numd = (len / 4 - 1) as u32;
    let c = d.admin_cmd(Command {
        opcode: ADM_GET_LOG_PAGE,
        nsid: 0xffff_ffff,
        prp1: buf,
        prp2: if len > 4096 { buf + 4096 } else { 0 },
        cdw10: lid as u32 | (rae as u32) << 15 | (numd & 0xffff) << 16,
        cdw11: numd >> 16,
        cdw12: offset as u32,
        cdw13: (offset >> 32) as u32,
        ..Default::default()
    });
    (c.status, d.read_mem(buf, len))
}

#[test]
fn log_pages() {
    let mut d = io_ready("ns=mem:1M", 1, 16);
    let buf = d.alloc(4096);
    // Two reads, one write, one failing read.
    for write in [false, true, false] {
        let c = d.rw_cmd(write, 1, 0, 8, buf, 4096, None);
        assert_eq!(d.io_cmd(1, c).status, Status::SUCCESS);
    }
    let bad = d.rw_cmd(false, 1, 1 << 30, 1, buf, 512, None);
    let bad_c = d.io_cmd(1, bad);
    assert_eq!(bad_c.status, Status::LBA_OUT_OF_RANGE);

    let (s, smart) = get_log(&mut d, LOG_SMART, 512, 0, false);
    assert_eq!(s, Status::SUCCESS);
    assert_eq!(u16::from_le_bytes([smart[1], smart[2]]), 313, "temperature");
    assert_eq!(smart[3], 100, "spare");
    assert_eq!(u64::from_le_bytes(smart[64..72].try_into().unwrap()), 2, "host read commands");
    assert_eq!(u64::from_le_bytes(smart[80..88].try_into().unwrap()), 1, "host write commands");
    assert_eq!(u64::from_le_bytes(smart[32..40].try_into().unwrap()), 1, "data units read");
    assert_eq!(u64::from_le_bytes(smart[176..184].try_into().unwrap()), 1, "error log entries");

    let (s, err) = get_log(&mut d, LOG_ERROR, 4096, 0, false);
    assert_eq!(s, Status::SUCCESS);
    assert_eq!(u64::from_le_bytes(err[0..8].try_into().unwrap()), 1, "error count");
    assert_eq!(u16::from_le_bytes([err[8], err[9]]), 1, "SQ id");
    assert_eq!(u16::from_le_bytes([err[10], err[11]]), bad_c.cid);
    assert_eq!((u16::from_le_bytes([err[12], err[13]]) >> 1) & 0xff, 0x80, "status code");
    // With an offset: the second half of the first entry.
    let (s, part) = get_log(&mut d, LOG_ERROR, 32, 32, false);
    assert_eq!(s, Status::SUCCESS);
    assert_eq!(&part[..], &err[32..64]);

    let (s, fw) = get_log(&mut d, LOG_FW_SLOT, 512, 0, false);
    assert_eq!((s, fw[0]), (Status::SUCCESS, 1));
    assert_ne!(&fw[8..16], &[0u8; 8]);
    let (s, eff) = get_log(&mut d, LOG_CMD_EFFECTS, 4096, 0, false);
    assert_eq!(s, Status::SUCCESS);
    assert_eq!(eff[1024 + 4 * NVM_READ as usize] & 1, 1);
    let (s, ch) = get_log(&mut d, LOG_CHANGED_NS, 4096, 0, false);
    assert_eq!(s, Status::SUCCESS);
    assert!(ch.iter().all(|&b| b == 0));
    assert_eq!(get_log(&mut d, 0x70, 512, 0, false).0, Status::INVALID_LOG_PAGE);
    assert_eq!(get_log(&mut d, LOG_SMART, 512, 1 << 20, false).0, Status::INVALID_FIELD, "offset past the page");
}

// ---- NVM commands ------------------------------------------------------------

fn exercise_io(spec: &str) {
    let mut d = io_ready(spec, 2, 64);
    let buf = d.alloc(256 << 10);
    let list = d.alloc(4096);
    // PRP1 only, PRP1+PRP2, PRP list (128 KiB), PRP1 with an offset.
    for (i, (bytes, off)) in [(4096usize, 0u64), (8192, 0), (128 << 10, 0), (2048, 512), (4096, 1024)].into_iter().enumerate() {
        let data = pattern(i as u64 + 1, bytes);
        let lba = 1000 + i as u64 * 300;
        d.write_mem(buf + off, &data);
        let nlb = (bytes / 512) as u32;
        let mut w = d.rw_cmd(true, 1, lba, nlb, buf, bytes + off as usize, Some(list));
        w.prp1 = buf + off;
        assert_eq!(d.io_cmd(1, w).status, Status::SUCCESS, "write {bytes}@{off}");
        d.zero(buf, 256 << 10);
        let mut r = d.rw_cmd(false, 1, lba, nlb, buf, bytes + off as usize, Some(list));
        r.prp1 = buf + off;
        assert_eq!(d.io_cmd(2, r).status, Status::SUCCESS, "read {bytes}@{off}");
        assert_eq!(d.read_mem(buf + off, bytes), data, "data {bytes}@{off}");
    }
    // A PRP list that chains: the list starts 16 bytes before a page end, so
    // it holds one data entry and a pointer to the next list page.
    let chain = d.alloc(8192);
    let bytes = 16 << 10;
    let data = pattern(99, bytes);
    d.write_mem(buf, &data);
    let l0 = chain + 4096 - 16;
    let l1 = chain + 4096;
    d.write_mem(l0, &[(buf + 4096).to_le_bytes(), l1.to_le_bytes()].concat());
    d.write_mem(l1, &[(buf + 8192).to_le_bytes(), (buf + 12288).to_le_bytes()].concat());
    let mut w = d.rw_cmd(true, 1, 5000, 32, buf, 4096, None);
    w.prp2 = l0;
    assert_eq!(d.io_cmd(1, w).status, Status::SUCCESS);
    d.zero(buf, bytes as u64);
    let mut r = w;
    r.opcode = NVM_READ;
    assert_eq!(d.io_cmd(1, r).status, Status::SUCCESS);
    assert_eq!(d.read_mem(buf, bytes), data, "chained PRP list");

    // Compare: equal, then different.
    let mut cmp = w;
    cmp.opcode = NVM_COMPARE;
    assert_eq!(d.io_cmd(1, cmp).status, Status::SUCCESS);
    d.write_mem(buf + 100, &[0xAA]);
    assert_eq!(d.io_cmd(1, cmp).status, Status::COMPARE_FAILURE);

    // Write Zeroes then read: zeros.
    let wz = Command { opcode: NVM_WRITE_ZEROES, nsid: 1, cdw10: 5000, cdw12: 7, ..Default::default() };
    assert_eq!(d.io_cmd(1, wz).status, Status::SUCCESS);
    let r = d.rw_cmd(false, 1, 5000, 16, buf, 8192, None);
    assert_eq!(d.io_cmd(1, r).status, Status::SUCCESS);
    let back = d.read_mem(buf, 8192);
    assert!(back[..4096].iter().all(|&b| b == 0));
    assert_eq!(&back[4096..], &data[4096..8192], "only the zeroed range changed");

    // DSM deallocate of two ranges.
    let ranges = d.alloc(4096);
    let mut rd = Vec::new();
    for (slba, nlb) in [(5008u64, 8u32), (5024, 8)] {
        rd.extend_from_slice(&0u32.to_le_bytes());
        rd.extend_from_slice(&nlb.to_le_bytes());
        rd.extend_from_slice(&slba.to_le_bytes());
    }
    d.write_mem(ranges, &rd);
    let dsm = Command { opcode: NVM_DSM, nsid: 1, prp1: ranges, cdw10: 1, cdw11: 1 << 2, ..Default::default() };
    assert_eq!(d.io_cmd(1, dsm).status, Status::SUCCESS);
    let r = d.rw_cmd(false, 1, 5000, 32, buf, bytes, Some(list));
    assert_eq!(d.io_cmd(1, r).status, Status::SUCCESS);
    let back = d.read_mem(buf, bytes);
    assert!(back[4096..8192].iter().all(|&b| b == 0));
    assert_eq!(&back[8192..12288], &data[8192..12288]);
    assert!(back[12288..].iter().all(|&b| b == 0));
    // A DSM range beyond the namespace.
    d.write_mem(ranges + 8, &(1u64 << 40).to_le_bytes());
    let dsm1 = Command { cdw10: 0, ..dsm };
    assert_eq!(d.io_cmd(1, dsm1).status, Status::LBA_OUT_OF_RANGE);

    // Flush one namespace, and all of them.
    assert_eq!(d.io_cmd(1, Command { opcode: NVM_FLUSH, nsid: 1, ..Default::default() }).status, Status::SUCCESS);
    assert_eq!(d.io_cmd(1, Command { opcode: NVM_FLUSH, nsid: 0xffff_ffff, ..Default::default() }).status, Status::SUCCESS);
    assert_eq!(d.io_cmd(1, Command { opcode: NVM_FLUSH, nsid: 7, ..Default::default() }).status, Status::INVALID_NAMESPACE);
}

#[test]
fn nvm_commands_on_memory() {
    exercise_io("ns=mem:8M");
}

#[test]
fn nvm_commands_on_a_file() {
    let f = temp_disk(8 << 20);
    exercise_io(&format!("ns=file:{}", f.path().display()));
}

#[test]
fn nvm_commands_on_a_file_with_o_direct() {
    // tmpfs has no O_DIRECT; the target dir is on a real file system.
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("disk.img");
    std::fs::File::create(&path).unwrap().set_len(8 << 20).unwrap();
    exercise_io(&format!("ns=file:{},direct=on", path.display()));
}

#[test]
fn malformed_io_commands_get_the_right_status() {
    let mut d = io_ready("ns=mem:1M", 1, 32);
    let buf = d.alloc(8192);
    let plist = d.alloc(4096);
    let blocks = (1u64 << 20) / 512;
    let rw = |d: &mut HostDriver, slba: u64, nlb: u32| d.rw_cmd(false, 1, slba, nlb, buf, nlb as usize * 512, Some(plist));
    let mut cases: Vec<(&str, Command, Status)> = vec![
        ("LBA past the end", rw(&mut d, blocks, 1), Status::LBA_OUT_OF_RANGE),
        ("range crosses the end", rw(&mut d, blocks - 1, 2), Status::LBA_OUT_OF_RANGE),
        ("LBA overflow", rw(&mut d, u64::MAX, 1), Status::LBA_OUT_OF_RANGE),
        ("namespace 0", Command { nsid: 0, ..rw(&mut d, 0, 1) }, Status::INVALID_NAMESPACE),
        ("missing namespace", Command { nsid: 9, ..rw(&mut d, 0, 1) }, Status::INVALID_NAMESPACE),
        ("broadcast NSID on read", Command { nsid: 0xffff_ffff, ..rw(&mut d, 0, 1) }, Status::INVALID_NAMESPACE),
        ("unknown opcode", Command { opcode: 0x7f, nsid: 1, ..Default::default() }, Status::INVALID_OPCODE),
        ("admin opcode on an I/O queue", Command { opcode: ADM_IDENTIFY, nsid: 1, ..Default::default() }, Status::INVALID_OPCODE),
        ("PRP1 not dword aligned", Command { prp1: buf + 2, ..rw(&mut d, 0, 1) }, Status::INVALID_PRP_OFFSET),
        ("PRP2 with an offset", Command { prp1: buf + 512, prp2: buf + 4096 + 8, ..rw(&mut d, 0, 8) }, Status::INVALID_PRP_OFFSET),
        ("PRP outside RAM", Command { prp1: 1 << 40, ..rw(&mut d, 0, 1) }, Status::DATA_TRANSFER_ERROR),
        ("PRP list outside RAM", Command { prp2: 1 << 40, ..rw(&mut d, 0, 24) }, Status::DATA_TRANSFER_ERROR),
        ("transfer above MDTS", rw(&mut d, 0, 2048), Status::INVALID_FIELD),
        ("SGL requested", Command { psdt: 1, ..rw(&mut d, 0, 1) }, Status::INVALID_FIELD),
        ("fused command", Command { fuse: 1, ..rw(&mut d, 0, 1) }, Status::INVALID_FIELD),
    ];
    let list = d.alloc(4096);
    d.write_mem(list, &(buf + 4096 + 512).to_le_bytes());
    cases.push(("PRP list entry with an offset", Command { prp2: list, ..rw(&mut d, 0, 24) }, Status::INVALID_PRP_OFFSET));
    // A PRP list whose only entry (the last slot of its page) chains to itself.
    let selfref = d.alloc(4096) + 4096 - 8;
    d.write_mem(selfref, &selfref.to_le_bytes());
    cases.push(("PRP list chained to itself", Command { prp2: selfref, ..rw(&mut d, 0, 24) }, Status::INVALID_PRP_OFFSET));
    for (what, cmd, want) in cases {
        let c = d.io_cmd(1, cmd);
        assert_eq!(c.status, want, "{what}");
    }
    // Admin side.
    assert_eq!(d.admin_cmd(Command { opcode: 0x7d, ..Default::default() }).status, Status::INVALID_OPCODE);
    assert_eq!(d.admin_cmd(Command { opcode: NVM_READ | 0x80, ..Default::default() }).status, Status::INVALID_OPCODE);
    assert_eq!(
        d.admin_cmd(Command { opcode: ADM_IDENTIFY, cdw10: 1, prp1: 1 << 40, ..Default::default() }).status,
        Status::DATA_TRANSFER_ERROR
    );
    // The controller is still fine.
    assert_eq!(d.csts() & (CSTS_RDY | CSTS_CFS), CSTS_RDY);
    let st = d.dev.lock().unwrap().stats();
    assert!(st["errors"].as_u64().unwrap() >= 19);
}

// ---- asynchronous events, doorbells, abort ---------------------------------------

fn submit_aer(d: &mut HostDriver, cid: u16) {
    d.push(0, &Command { opcode: ADM_ASYNC_EVENT, cid, ..Default::default() });
    d.ring(0);
}

fn enable_aen(d: &mut HostDriver) {
    let c = d.admin_cmd(Command { opcode: ADM_SET_FEATURES, cdw10: FEAT_ASYNC_EVENT_CONFIG as u32, cdw11: 0x1ff, ..Default::default() });
    assert_eq!(c.status, Status::SUCCESS);
}

#[test]
fn doorbell_writes_to_bad_queues_raise_error_events() {
    let mut d = io_ready("ns=mem:1M,queues=4", 1, 16);
    submit_aer(&mut d, 900);
    submit_aer(&mut d, 901);
    // No event yet.
    assert!(d.poll(0).is_none());
    // SQ tail doorbell of a queue that does not exist.
    d.write32(DOORBELL_BASE + 8 * 3, 1);
    let c = d.wait(0).unwrap();
    assert_eq!(c.cid, 900);
    assert_eq!(c.dw0 & 0xff_ffff, AER_TYPE_ERROR as u32 | (AER_INFO_INVALID_DB_REGISTER as u32) << 8 | (LOG_ERROR as u32) << 16);
    // Error events are masked until the error log is read.
    d.write32(DOORBELL_BASE + 8, 16); // tail == size: invalid value
    d.timeout = std::time::Duration::from_millis(50);
    assert!(d.wait(0).is_none());
    d.timeout = std::time::Duration::from_secs(20);
    // (The log holds it; reading the log re-arms error events.)
    let (s, _) = get_log(&mut d, LOG_ERROR, 4096, 0, false);
    assert_eq!(s, Status::SUCCESS);
    d.write32(DOORBELL_BASE + 8, 16);
    let c = d.wait(0).unwrap();
    assert_eq!(c.cid, 901);
    assert_eq!((c.dw0 >> 8) & 0xff, AER_INFO_INVALID_DB_VALUE as u32);
    // CQ head beyond what was posted, and a doorbell beyond every queue.
    submit_aer(&mut d, 902);
    get_log(&mut d, LOG_ERROR, 4096, 0, false);
    d.write32(DOORBELL_BASE + 8 + 4, 5);
    let c = d.wait(0).unwrap();
    assert_eq!((c.cid, (c.dw0 >> 8) & 0xff), (902, AER_INFO_INVALID_DB_VALUE as u32));
    submit_aer(&mut d, 903);
    get_log(&mut d, LOG_ERROR, 4096, 0, false);
    d.write32(NvmeController::BAR0_SIZE - 4, 1);
    let c = d.wait(0).unwrap();
    assert_eq!((c.cid, (c.dw0 >> 8) & 0xff), (903, AER_INFO_INVALID_DB_REGISTER as u32));
    // The I/O queue still works.
    let buf = d.alloc(4096);
    let r = d.rw_cmd(false, 1, 0, 1, buf, 512, None);
    assert_eq!(d.io_cmd(1, r).status, Status::SUCCESS);
    assert_eq!(d.dev.lock().unwrap().stats()["doorbell_errors"], 5);
}

#[test]
fn aer_limit_and_abort() {
    let mut d = setup("ns=mem:1M", RAM);
    for cid in 0..4 {
        submit_aer(&mut d, 500 + cid);
    }
    submit_aer(&mut d, 600);
    let c = d.wait(0).unwrap();
    assert_eq!((c.cid, c.status), (600, Status::AER_LIMIT_EXCEEDED));
    let c = d.admin_cmd(Command { opcode: ADM_ABORT, cdw10: 1 | 1234 << 16, ..Default::default() });
    assert_eq!((c.status, c.dw0 & 1), (Status::SUCCESS, 1), "nothing left to abort");
}

#[test]
fn temperature_threshold_raises_a_smart_event() {
    let mut d = setup("ns=mem:1M", RAM);
    enable_aen(&mut d);
    submit_aer(&mut d, 42);
    let c = d.admin_cmd(Command { opcode: ADM_SET_FEATURES, cdw10: FEAT_TEMP_THRESHOLD as u32, cdw11: 300, ..Default::default() });
    assert_eq!(c.status, Status::SUCCESS);
    let ev = d.wait(0).unwrap();
    assert_eq!(ev.cid, 42);
    assert_eq!(ev.dw0 & 0xff_ffff, AER_TYPE_SMART as u32 | (AER_INFO_TEMPERATURE as u32) << 8 | (LOG_SMART as u32) << 16);
    let (_, smart) = get_log(&mut d, LOG_SMART, 512, 0, false);
    assert_eq!(smart[0] & 0x2, 0x2, "critical warning: temperature");
}

#[test]
fn namespace_hot_add_and_remove_reach_the_host() {
    let mut d = io_ready("ns=mem:1M", 1, 16);
    enable_aen(&mut d);
    submit_aer(&mut d, 70);
    let f = temp_disk(4 << 20);
    let nsid = d.dev.lock().unwrap().attach_namespace(&format!("file:{}", f.path().display())).unwrap();
    assert_eq!(nsid, 2);
    let ev = d.wait(0).unwrap();
    assert_eq!(ev.cid, 70);
    assert_eq!(ev.dw0 & 0xff_ffff, AER_TYPE_NOTICE as u32 | (AER_INFO_NS_ATTR_CHANGED as u32) << 8 | (LOG_CHANGED_NS as u32) << 16);
    // A second change before the log is read is not announced again.
    submit_aer(&mut d, 71);
    let nsid3 = d.dev.lock().unwrap().attach_namespace("mem:2M").unwrap();
    assert_eq!(nsid3, 3);
    assert!(d.poll(0).is_none());
    let (s, log) = get_log(&mut d, LOG_CHANGED_NS, 4096, 0, false);
    assert_eq!(s, Status::SUCCESS);
    assert_eq!(&log[..12], &[2, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0]);
    let (_, list) = d.identify(0x02, 0, 0);
    assert_eq!(&list[..16], &[1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0]);
    // The new namespace takes I/O.
    let buf = d.alloc(4096);
    d.write_mem(buf, &pattern(5, 4096));
    let w = d.rw_cmd(true, 2, 10, 8, buf, 4096, None);
    assert_eq!(d.io_cmd(1, w).status, Status::SUCCESS);
    // Remove it: a new event (the log was read), the list changes, I/O fails.
    d.dev.lock().unwrap().detach_namespace(2).unwrap();
    let ev = d.wait(0).unwrap();
    assert_eq!(ev.cid, 71);
    let (_, log) = get_log(&mut d, LOG_CHANGED_NS, 4096, 0, false);
    assert_eq!(&log[..8], &[2, 0, 0, 0, 0, 0, 0, 0]);
    let (_, list) = d.identify(0x02, 0, 0);
    assert_eq!(&list[..12], &[1, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0]);
    let r = d.rw_cmd(false, 2, 10, 8, buf, 4096, None);
    assert_eq!(d.io_cmd(1, r).status, Status::INVALID_NAMESPACE);
    assert!(d.dev.lock().unwrap().detach_namespace(2).is_err());
    assert!(d.dev.lock().unwrap().attach_namespace("file:/nonexistent/x").is_err());
    assert!(d.dev.lock().unwrap().attach_namespace("bogus").is_err());
    // The data written before the removal is in the file.
    let mut on_disk = vec![0u8; 4096];
    std::os::unix::fs::FileExt::read_exact_at(f.as_file(), &mut on_disk, 10 * 512).unwrap();
    assert_eq!(on_disk, pattern(5, 4096));
}

// ---- save / restore -----------------------------------------------------------

/// Writes tagged with (queue, i) in flight on a file backend when the device
/// pauses; state moves to a new controller on the same memory and file.
/// Each command completes exactly once, none is lost, the data is there.
#[test]
fn save_restore_mid_io_loses_and_duplicates_nothing() {
    // O_DIRECT on a real file system: requests really are in flight in the
    // kernel when the device pauses (page-cache hits would finish inline).
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("disk.img");
    std::fs::File::create(&path).unwrap().set_len(32 << 20).unwrap();
    let spec = format!("ns=file:{},direct=on,ns=mem:4M,queues=4,depth=1024", path.display());
    let mut d = io_ready(&spec, 4, 64);
    enable_aen(&mut d);
    submit_aer(&mut d, 4000);
    let per_q = 200u32; // more than a 64-entry CQ holds: the rest waits in the SQ
    let buf = d.alloc(4 * per_q as u64 * 4096);
    // Submit in slices so SQs (64 entries) never overflow; ring after each.
    let mut submitted = [0u32; 4];
    let mut done: Vec<Vec<u16>> = vec![Vec::new(); 4];
    let mut saved = None;
    let mut new_dev = None;
    loop {
        for q in 0..4usize {
            let in_q = submitted[q] as usize - done[q].len();
            let room = 60usize.saturating_sub(in_q).min((per_q - submitted[q]) as usize);
            for _ in 0..room {
                let i = submitted[q];
                let slot = q as u64 * per_q as u64 + i as u64;
                let addr = buf + slot * 4096;
                let mut data = pattern(slot, 4096);
                data[..8].copy_from_slice(&slot.to_le_bytes());
                d.write_mem(addr, &data);
                let ns = if i % 3 == 0 { 2 } else { 1 };
                let mut w = d.rw_cmd(true, ns, slot * 8, 8, addr, 4096, None);
                w.cid = i as u16;
                d.push(q + 1, &w);
                submitted[q] += 1;
            }
            d.ring(q + 1);
        }
        // Mid-way, with commands in the SQs and in flight: pause, save, and
        // continue on a new controller restored from the state.
        if saved.is_none() && submitted.iter().sum::<u32>() > 300 {
            let mut dev = d.dev.lock().unwrap();
            eprintln!("in flight at pause: {}", dev.stats()["inflight"]);
            dev.pause();
            assert_eq!(dev.stats()["inflight"], 0, "pause finishes in-flight requests");
            let section = dev.save().unwrap();
            assert_eq!(section.name, "nvme0");
            let mut wire = Vec::new();
            section.write_to(&mut wire).unwrap();
            let back = snapshot::Section::read_from(&mut wire.as_slice()).unwrap();
            let cfg = NvmeConfig::parse(&spec).unwrap();
            let mut fresh = NvmeController::new(cfg, d.mem.clone(), devices::layout::PCI_BAR_BASE).unwrap();
            fresh.restore(&back).unwrap();
            fresh.resume();
            saved = Some(back);
            new_dev = Some(fresh);
        }
        if let Some(fresh) = new_dev.take() {
            let old = std::mem::replace(&mut *d.dev.lock().unwrap(), fresh);
            drop(old);
        }
        let mut out = Vec::new();
        for (q, done_q) in done.iter_mut().enumerate() {
            out.clear();
            d.poll_many(q + 1, 64, &mut out);
            for c in &out {
                assert_eq!(c.status, Status::SUCCESS);
                done_q.push(c.cid);
            }
        }
        if done.iter().all(|v| v.len() == per_q as usize) {
            break;
        }
    }
    for (q, cids) in done.iter().enumerate() {
        let mut s = cids.clone();
        s.sort();
        s.dedup();
        assert_eq!(s.len(), per_q as usize, "queue {q}: every command completed exactly once");
    }
    // Read everything back through the restored controller.
    let rbuf = d.alloc(4096);
    for q in 0..4u64 {
        for i in 0..per_q as u64 {
            let slot = q * per_q as u64 + i;
            let ns = if i % 3 == 0 { 2 } else { 1 };
            let r = d.rw_cmd(false, ns, slot * 8, 8, rbuf, 4096, None);
            assert_eq!(d.io_cmd(1, r).status, Status::SUCCESS);
            let got = d.read_mem(rbuf, 4096);
            assert_eq!(u64::from_le_bytes(got[..8].try_into().unwrap()), slot, "block {slot}");
        }
    }
    // The outstanding AER survived. A hot add while the device is paused
    // is announced only once it runs again.
    d.dev.lock().unwrap().pause();
    d.dev.lock().unwrap().attach_namespace("mem:1M").unwrap();
    assert!(d.poll(0).is_none(), "a paused device writes no completion");
    d.dev.lock().unwrap().resume();
    let ev = d.wait(0).unwrap();
    assert_eq!(ev.cid, 4000);
    assert!(saved.is_some());
}

#[test]
fn restore_refuses_mismatched_or_damaged_state() {
    let d = io_ready("ns=mem:1M,queues=4", 2, 16);
    let section = d.dev.lock().unwrap().save().unwrap();
    let mem = d.mem.clone();
    let mut other =
        NvmeController::new(NvmeConfig::parse("ns=mem:1M,queues=8").unwrap(), mem.clone(), devices::layout::PCI_BAR_BASE).unwrap();
    assert!(matches!(other.restore(&section), Err(snapshot::StateError::Mismatch { .. })));
    let mut same = NvmeController::new(NvmeConfig::parse("ns=mem:1M,queues=4").unwrap(), mem, devices::layout::PCI_BAR_BASE).unwrap();
    let mut bad = section.clone();
    bad.data.truncate(20);
    assert!(same.restore(&bad).is_err());
    let mut bad = section.clone();
    bad.version = 99;
    assert!(matches!(same.restore(&bad), Err(snapshot::StateError::Version { .. })));
    let mut bad = section.clone();
    let l = bad.data.len();
    bad.data[l / 2] ^= 0xff;
    let _ = same.restore(&bad); // must not panic whatever it says
    assert!(same.restore(&section).is_ok());
}

/// Rewrites the JSON document inside a saved nvme section (the layout is
/// "NVMS", its length as u32 LE, the JSON, then memory namespace chunks).
fn edit_saved_json(section: &snapshot::Section, edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) -> snapshot::Section {
    let d = &section.data;
    assert_eq!(&d[..4], b"NVMS");
    let len = u32::from_le_bytes(d[4..8].try_into().unwrap()) as usize;
    let mut doc: serde_json::Value = serde_json::from_slice(&d[8..8 + len]).unwrap();
    edit(doc.as_object_mut().unwrap());
    let json = serde_json::to_vec(&doc).unwrap();
    let mut data = b"NVMS".to_vec();
    data.extend_from_slice(&(json.len() as u32).to_le_bytes());
    data.extend_from_slice(&json);
    data.extend_from_slice(&d[8 + len..]);
    snapshot::Section { data, ..section.clone() }
}

/// A state saved by an older vmm, before the counters, the error log, the
/// AER state and some features existed, restores on this one: the missing
/// fields take their power-on values and the queues carry on.
#[test]
fn restores_a_state_saved_without_newer_fields() {
    let mut d = io_ready("ns=mem:4M,queues=4", 2, 16);
    let buf = d.alloc(4096);
    d.write_mem(buf, &pattern(5, 4096));
    let w = d.rw_cmd(true, 1, 8, 8, buf, 4096, None);
    assert_eq!(d.io_cmd(1, w).status, Status::SUCCESS);
    let section = {
        let mut dev = d.dev.lock().unwrap();
        dev.pause();
        dev.save().unwrap()
    };
    let older = edit_saved_json(&section, |doc| {
        for newer in ["counters", "error_log", "error_count", "aer", "changed_ns"] {
            assert!(doc.remove(newer).is_some(), "{newer} is in the save");
        }
        let features = doc["features"].as_object_mut().unwrap();
        assert!(features.remove("sw_progress").is_some());
        assert!(features.remove("temp_over").is_some());
        doc["regs"].as_object_mut().unwrap().remove("intms");
    });
    let mut fresh =
        NvmeController::new(NvmeConfig::parse("ns=mem:4M,queues=4").unwrap(), d.mem.clone(), devices::layout::PCI_BAR_BASE).unwrap();
    fresh.restore(&older).unwrap();
    fresh.resume();
    assert_eq!(fresh.stats()["writes"], 0, "counters start from zero");
    *d.dev.lock().unwrap() = fresh;
    // The I/O queues the save held still work, and the data is there.
    d.zero(buf, 4096);
    let r = d.rw_cmd(false, 1, 8, 8, buf, 4096, None);
    assert_eq!(d.io_cmd(1, r).status, Status::SUCCESS);
    assert_eq!(d.read_mem(buf, 4096), pattern(5, 4096));
    // A field this version needs is still required.
    let broken = edit_saved_json(&section, |doc| {
        doc.remove("sqs");
    });
    let mut other =
        NvmeController::new(NvmeConfig::parse("ns=mem:4M,queues=4").unwrap(), d.mem.clone(), devices::layout::PCI_BAR_BASE).unwrap();
    assert!(matches!(other.restore(&broken), Err(snapshot::StateError::Decode { .. })));
}

#[test]
fn memory_namespace_contents_travel_with_the_state() {
    let mut d = io_ready("ns=mem:4M", 1, 16);
    let buf = d.alloc(4096);
    d.write_mem(buf, &pattern(3, 4096));
    let w = d.rw_cmd(true, 1, 4000, 8, buf, 4096, None);
    assert_eq!(d.io_cmd(1, w).status, Status::SUCCESS);
    let section = {
        let mut dev = d.dev.lock().unwrap();
        dev.pause();
        dev.save().unwrap()
    };
    assert!(section.data.len() < 200_000, "only non-zero chunks are saved");
    let mut fresh = NvmeController::new(NvmeConfig::parse("ns=mem:4M").unwrap(), d.mem.clone(), devices::layout::PCI_BAR_BASE).unwrap();
    fresh.restore(&section).unwrap();
    fresh.resume();
    *d.dev.lock().unwrap() = fresh;
    d.zero(buf, 4096);
    let r = d.rw_cmd(false, 1, 4000, 8, buf, 4096, None);
    assert_eq!(d.io_cmd(1, r).status, Status::SUCCESS);
    assert_eq!(d.read_mem(buf, 4096), pattern(3, 4096));
}

// ---- robustness -------------------------------------------------------------------

/// Random register writes, doorbells and submission entries: the device
/// must never panic, whatever the guest does.
#[test]
fn garbage_from_the_guest_never_panics() {
    let mut d = io_ready("ns=mem:1M,queues=4,depth=64", 2, 32);
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for round in 0..4000 {
        let r = next();
        match r % 5 {
            0 => {
                let mut raw = [0u8; 64];
                for c in raw.chunks_mut(8) {
                    c.copy_from_slice(&next().to_le_bytes());
                }
                let mut cmd = Command::parse(&raw);
                if r & 0x100 == 0 {
                    cmd.prp1 %= RAM as u64;
                    cmd.prp2 %= RAM as u64;
                    cmd.nsid %= 3;
                }
                let q = (r >> 8) as usize % 3;
                d.push(q, &cmd);
                d.ring(q);
            }
            1 => {
                let off = DOORBELL_BASE + (next() % 64) * 4;
                d.write32(off, (next() % 80) as u32);
            }
            2 if round % 50 == 0 => {
                let off = (next() % 0x40) & !3;
                d.write32(off, next() as u32);
            }
            _ => {
                for q in 0..3 {
                    let mut out = Vec::new();
                    d.poll_many(q, 64, &mut out);
                }
            }
        }
        if round % 500 == 0 {
            let _ = d.dev.lock().unwrap().stats();
        }
    }
    // Whatever state it is in, a reset brings it back.
    d.write32(REG_CC, 0);
    d.io.clear();
    assert_eq!(d.enable(32) & CSTS_RDY, CSTS_RDY);
    d.create_io_queues(1, 16).unwrap();
    let buf = d.alloc(4096);
    let r = d.rw_cmd(false, 1, 0, 1, buf, 512, None);
    assert_eq!(d.io_cmd(1, r).status, Status::SUCCESS);
}
