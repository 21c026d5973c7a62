//! A pass over every admin and NVM command the controller implements, and
//! the malformed cases, with the status each must give. nvme-verify runs it
//! before its loop; a wrong answer is a FAIL.

use super::{Cqe, Nvme, Region, Sqe, PAGE};

pub struct Check<'a> {
    n: &'a mut Nvme,
    pub passed: u32,
    pub failed: u32,
}

const OK: u16 = 0x000;
const INVALID_OPCODE: u16 = 0x001;
const INVALID_FIELD: u16 = 0x002;
const INVALID_NS: u16 = 0x00b;
const LBA_RANGE: u16 = 0x080;
const PRP_OFFSET: u16 = 0x013;
const INVALID_QID: u16 = 0x101;
const INVALID_LOG: u16 = 0x109;
const COMPARE_FAIL: u16 = 0x285;

impl<'a> Check<'a> {
    fn expect(&mut self, what: &str, got: Result<Cqe, Cqe>, want: u16) -> Cqe {
        let c = match got {
            Ok(c) | Err(c) => c,
        };
        if c.status == want {
            self.passed += 1;
        } else {
            self.failed += 1;
            println!("nvme-check: {}: status {:#05x}, expected {:#05x}", what, c.status, want);
        }
        c
    }

    fn admin(&mut self, what: &str, cmd: Sqe, want: u16) -> Cqe {
        let r = self.n.admin_cmd(cmd);
        self.expect(what, r, want)
    }

    fn io(&mut self, what: &str, mut cmd: Sqe, want: u16) -> Cqe {
        cmd.cid = 0x7fff;
        self.n.push_io(0, &cmd);
        self.n.kick_io(0);
        let c = loop {
            if let Some(c) = self.n.poll_io(0) {
                break c;
            }
        };
        self.n.kick_io(0);
        let r = if c.status == 0 { Ok(c) } else { Err(c) };
        self.expect(what, r, want)
    }
}

fn fill(buf: u64, len: usize, v: u8) {
    unsafe { core::ptr::write_bytes(buf as *mut u8, v, len) };
}

fn all(buf: u64, len: usize, v: u8) -> bool {
    (0..len).all(|i| unsafe { ((buf + i as u64) as *const u8).read_volatile() } == v)
}

/// Run every check on I/O queue 1 (which must be idle); returns (passed, failed).
pub fn run(n: &mut Nvme, region: &mut Region) -> (u32, u32) {
    let Some(buf) = region.alloc(2 * PAGE) else { return (0, 1) };
    let Some(log) = region.alloc(PAGE) else { return (0, 1) };
    let nsid = n.nsid;
    let bs = n.block as usize;
    let last = n.ns_blocks - 8;
    let mut k = Check { n, passed: 0, failed: 0 };
    // Identify, every CNS.
    for (cns, id, csi, want, what) in [
        (0x01u32, 0u32, 0u32, OK, "identify controller"),
        (0x00, nsid, 0, OK, "identify namespace"),
        (0x00, 0, 0, INVALID_NS, "identify namespace 0"),
        (0x02, 0, 0, OK, "active namespace list"),
        (0x03, nsid, 0, OK, "namespace descriptors"),
        (0x05, nsid, 0, OK, "NVM namespace (CSI 0)"),
        (0x05, nsid, 3, INVALID_FIELD, "namespace for unknown CSI"),
        (0x06, 0, 0, OK, "NVM controller (CSI 0)"),
        (0x07, 0, 0, OK, "active namespaces for CSI 0"),
        (0x55, 0, 0, INVALID_FIELD, "unknown CNS"),
    ] {
        k.admin(what, Sqe { opcode: 0x06, nsid: id, prp1: log, cdw10: cns, cdw11: csi << 24, ..Default::default() }, want);
    }
    // Features.
    for fid in [0x01u32, 0x02, 0x04, 0x05, 0x06, 0x07, 0x08, 0x0a, 0x0b] {
        k.admin("get features", Sqe { opcode: 0x0a, cdw10: fid, ..Default::default() }, OK);
    }
    k.admin("set volatile write cache", Sqe { opcode: 0x09, cdw10: 0x06, cdw11: 1, ..Default::default() }, OK);
    k.admin("set arbitration", Sqe { opcode: 0x09, cdw10: 0x01, cdw11: 0x3, ..Default::default() }, OK);
    k.admin("set unknown feature", Sqe { opcode: 0x09, cdw10: 0x7e, ..Default::default() }, INVALID_FIELD);
    k.admin("save unsaveable feature", Sqe { opcode: 0x09, cdw10: 0x06 | 1 << 31, cdw11: 1, ..Default::default() }, 0x10d);
    // Log pages (RAE set: do not disturb event reporting).
    for (lid, want, what) in [
        (0x01u32, OK, "error log"),
        (0x02, OK, "SMART log"),
        (0x03, OK, "firmware slot log"),
        (0x04, OK, "changed namespace log"),
        (0x70, INVALID_LOG, "unknown log"),
    ] {
        k.admin(what, Sqe { opcode: 0x02, nsid: 0xffff_ffff, prp1: log, cdw10: lid | 1 << 15 | 127 << 16, ..Default::default() }, want);
    }
    let c = k.admin("abort", Sqe { opcode: 0x08, cdw10: 1 | 0x1234 << 16, ..Default::default() }, OK);
    if c.dw0 & 1 != 1 {
        k.failed += 1;
    }
    k.admin("unknown admin opcode", Sqe { opcode: 0x7d, ..Default::default() }, INVALID_OPCODE);
    k.admin("create CQ 0", Sqe { opcode: 0x05, prp1: log, cdw10: 1 << 16, cdw11: 1, ..Default::default() }, INVALID_QID);
    k.admin("delete missing SQ", Sqe { opcode: 0x00, cdw10: 0x3ff, ..Default::default() }, INVALID_QID);

    // NVM commands on the last 8 blocks.
    let rw = |n: &Nvme, write: bool, lba: u64, nb: u32| {
        let mut c = n.rw(write, 0, lba, buf, nb * bs as u32, 0);
        c.cid = 0;
        c
    };
    fill(buf, 2 * bs, 0x5a);
    let w = rw(k.n, true, last, 2);
    k.io("write", w, OK);
    fill(buf, 2 * bs, 0);
    let r = rw(k.n, false, last, 2);
    k.io("read", r, OK);
    if !all(buf, 2 * bs, 0x5a) {
        k.failed += 1;
        println!("nvme-check: read returned other data");
    }
    let cmp = Sqe { opcode: 0x05, ..rw(k.n, false, last, 2) };
    k.io("compare (equal)", cmp, OK);
    fill(buf + 7, 1, 0);
    k.io("compare (different)", cmp, COMPARE_FAIL);
    k.io("flush", Sqe { opcode: 0x00, nsid, ..Default::default() }, OK);
    k.io("write zeroes", Sqe { opcode: 0x08, nsid, cdw10: last as u32, cdw11: (last >> 32) as u32, cdw12: 0, ..Default::default() }, OK);
    fill(buf, bs, 0xff);
    k.io("read zeroed", rw(k.n, false, last, 1), OK);
    if !all(buf, bs, 0) {
        k.failed += 1;
        println!("nvme-check: write zeroes left data");
    }
    // DSM deallocate the second block.
    let range = [0u32, 1, (last + 1) as u32, ((last + 1) >> 32) as u32];
    for (i, v) in range.iter().enumerate() {
        unsafe { ((log + 4 * i as u64) as *mut u32).write_volatile(*v) };
    }
    k.io("dataset management deallocate", Sqe { opcode: 0x09, nsid, prp1: log, cdw10: 0, cdw11: 1 << 2, ..Default::default() }, OK);
    fill(buf, bs, 0xff);
    k.io("read deallocated", rw(k.n, false, last + 1, 1), OK);
    if !all(buf, bs, 0) {
        k.failed += 1;
        println!("nvme-check: deallocated block not zero");
    }
    // Malformed commands.
    k.io("unknown NVM opcode", Sqe { opcode: 0x7f, nsid, ..Default::default() }, INVALID_OPCODE);
    k.io("missing namespace", Sqe { nsid: 99, ..rw(k.n, false, 0, 1) }, INVALID_NS);
    k.io("LBA out of range", rw(k.n, false, last + 8, 1), LBA_RANGE);
    k.io("PRP offset not dword aligned", Sqe { prp1: buf + 2, ..rw(k.n, false, 0, 1) }, PRP_OFFSET);
    k.io("SGL requested", Sqe { flags: 0x40, ..rw(k.n, false, 0, 1) }, INVALID_FIELD);
    k.io("fused command", Sqe { flags: 0x01, ..rw(k.n, false, 0, 1) }, INVALID_FIELD);
    k.io(
        "transfer above MDTS",
        Sqe { cdw12: 0xffff, ..rw(k.n, false, 0, 1) },
        if k.n.ns_blocks >= 0x10000 { INVALID_FIELD } else { LBA_RANGE },
    );
    (k.passed, k.failed)
}
