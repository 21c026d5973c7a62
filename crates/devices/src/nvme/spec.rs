//! Constants and wire layouts from the NVMe base specification (1.4 / 2.x).

// Controller registers (offsets in BAR0).
pub const REG_CAP: u64 = 0x00;
pub const REG_VS: u64 = 0x08;
pub const REG_INTMS: u64 = 0x0c;
pub const REG_INTMC: u64 = 0x10;
pub const REG_CC: u64 = 0x14;
pub const REG_CSTS: u64 = 0x1c;
pub const REG_NSSR: u64 = 0x20;
pub const REG_AQA: u64 = 0x24;
pub const REG_ASQ: u64 = 0x28;
pub const REG_ACQ: u64 = 0x30;
pub const DOORBELL_BASE: u64 = 0x1000;

pub const CC_EN: u32 = 1;
pub const CSTS_RDY: u32 = 1;
pub const CSTS_CFS: u32 = 1 << 1;
pub const CSTS_SHST_COMPLETE: u32 = 0b10 << 2;
pub const CSTS_SHST_MASK: u32 = 0b11 << 2;

pub const VERSION_1_4: u32 = 0x0001_0400;

pub const PAGE_SIZE: u64 = 4096;
pub const SQE_SIZE: u64 = 64;
pub const CQE_SIZE: u64 = 16;

// Admin opcodes.
pub const ADM_DELETE_SQ: u8 = 0x00;
pub const ADM_CREATE_SQ: u8 = 0x01;
pub const ADM_GET_LOG_PAGE: u8 = 0x02;
pub const ADM_DELETE_CQ: u8 = 0x04;
pub const ADM_CREATE_CQ: u8 = 0x05;
pub const ADM_IDENTIFY: u8 = 0x06;
pub const ADM_ABORT: u8 = 0x08;
pub const ADM_SET_FEATURES: u8 = 0x09;
pub const ADM_GET_FEATURES: u8 = 0x0a;
pub const ADM_ASYNC_EVENT: u8 = 0x0c;
pub const ADM_KEEP_ALIVE: u8 = 0x18;

// NVM opcodes.
pub const NVM_FLUSH: u8 = 0x00;
pub const NVM_WRITE: u8 = 0x01;
pub const NVM_READ: u8 = 0x02;
pub const NVM_COMPARE: u8 = 0x05;
pub const NVM_WRITE_ZEROES: u8 = 0x08;
pub const NVM_DSM: u8 = 0x09;

// Feature identifiers.
pub const FEAT_ARBITRATION: u8 = 0x01;
pub const FEAT_POWER_MGMT: u8 = 0x02;
pub const FEAT_TEMP_THRESHOLD: u8 = 0x04;
pub const FEAT_ERROR_RECOVERY: u8 = 0x05;
pub const FEAT_VWC: u8 = 0x06;
pub const FEAT_NUM_QUEUES: u8 = 0x07;
pub const FEAT_IRQ_COALESCING: u8 = 0x08;
pub const FEAT_IRQ_CONFIG: u8 = 0x09;
pub const FEAT_WRITE_ATOMICITY: u8 = 0x0a;
pub const FEAT_ASYNC_EVENT_CONFIG: u8 = 0x0b;
pub const FEAT_TIMESTAMP: u8 = 0x0e;
pub const FEAT_SW_PROGRESS: u8 = 0x80;

// Log pages.
pub const LOG_ERROR: u8 = 0x01;
pub const LOG_SMART: u8 = 0x02;
pub const LOG_FW_SLOT: u8 = 0x03;
pub const LOG_CHANGED_NS: u8 = 0x04;
pub const LOG_CMD_EFFECTS: u8 = 0x05;

// Asynchronous event types and information.
pub const AER_TYPE_ERROR: u8 = 0;
pub const AER_TYPE_SMART: u8 = 1;
pub const AER_TYPE_NOTICE: u8 = 2;
pub const AER_INFO_INVALID_DB_REGISTER: u8 = 0x00;
pub const AER_INFO_INVALID_DB_VALUE: u8 = 0x01;
pub const AER_INFO_TEMPERATURE: u8 = 0x01;
pub const AER_INFO_NS_ATTR_CHANGED: u8 = 0x00;

/// A completion status: Status Code Type and Status Code (DNR set for
/// every error: retrying the same command cannot help).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Status(pub u16);

impl Status {
    pub const SUCCESS: Status = Status(0);
    const fn generic(sc: u8) -> Status {
        Status(sc as u16)
    }
    const fn specific(sc: u8) -> Status {
        Status(1 << 8 | sc as u16)
    }
    const fn media(sc: u8) -> Status {
        Status(2 << 8 | sc as u16)
    }
    pub const INVALID_OPCODE: Status = Status::generic(0x01);
    pub const INVALID_FIELD: Status = Status::generic(0x02);
    pub const DATA_TRANSFER_ERROR: Status = Status::generic(0x04);
    pub const INTERNAL_ERROR: Status = Status::generic(0x06);
    pub const ABORT_REQUESTED: Status = Status::generic(0x07);
    pub const ABORT_SQ_DELETED: Status = Status::generic(0x08);
    pub const INVALID_NAMESPACE: Status = Status::generic(0x0b);
    pub const COMMAND_SEQUENCE_ERROR: Status = Status::generic(0x0c);
    pub const INVALID_PRP_OFFSET: Status = Status::generic(0x13);
    pub const LBA_OUT_OF_RANGE: Status = Status::generic(0x80);
    pub const NAMESPACE_NOT_READY: Status = Status::generic(0x82);

    pub const INVALID_CQ: Status = Status::specific(0x00);
    pub const INVALID_QUEUE_ID: Status = Status::specific(0x01);
    pub const INVALID_QUEUE_SIZE: Status = Status::specific(0x02);
    pub const AER_LIMIT_EXCEEDED: Status = Status::specific(0x05);
    pub const INVALID_INTERRUPT_VECTOR: Status = Status::specific(0x08);
    pub const INVALID_LOG_PAGE: Status = Status::specific(0x09);
    pub const INVALID_QUEUE_DELETION: Status = Status::specific(0x0c);
    pub const FEATURE_NOT_SAVEABLE: Status = Status::specific(0x0d);

    pub const COMPARE_FAILURE: Status = Status::media(0x85);

    pub fn sct(self) -> u8 {
        (self.0 >> 8) as u8
    }
    pub fn sc(self) -> u8 {
        self.0 as u8
    }
    pub fn is_success(self) -> bool {
        self.0 == 0
    }
    /// The 15-bit status field of CQE dword 3 (bits 31:17), DNR included.
    pub fn field(self) -> u16 {
        if self.0 == 0 {
            return 0;
        }
        let dnr = 1u16 << 14;
        dnr | (self.sct() as u16 & 0x7) << 8 | self.sc() as u16
    }
}

/// A 64-byte submission queue entry, decoded.
#[derive(Clone, Copy, Debug, Default)]
pub struct Command {
    pub opcode: u8,
    pub fuse: u8,
    pub psdt: u8,
    pub cid: u16,
    pub nsid: u32,
    pub mptr: u64,
    pub prp1: u64,
    pub prp2: u64,
    pub cdw10: u32,
    pub cdw11: u32,
    pub cdw12: u32,
    pub cdw13: u32,
    pub cdw14: u32,
    pub cdw15: u32,
}

impl Command {
    pub fn parse(b: &[u8; 64]) -> Command {
        let d = |i: usize| u32::from_le_bytes(b[i * 4..i * 4 + 4].try_into().unwrap());
        let q = |i: usize| d(i) as u64 | (d(i + 1) as u64) << 32;
        let dw0 = d(0);
        Command {
            opcode: dw0 as u8,
            fuse: (dw0 >> 8) as u8 & 0x3,
            psdt: (dw0 >> 14) as u8 & 0x3,
            cid: (dw0 >> 16) as u16,
            nsid: d(1),
            mptr: q(4),
            prp1: q(6),
            prp2: q(8),
            cdw10: d(10),
            cdw11: d(11),
            cdw12: d(12),
            cdw13: d(13),
            cdw14: d(14),
            cdw15: d(15),
        }
    }

    pub fn to_bytes(&self) -> [u8; 64] {
        let mut b = [0u8; 64];
        let dw0 = self.opcode as u32 | (self.fuse as u32) << 8 | (self.psdt as u32) << 14 | (self.cid as u32) << 16;
        let mut put = |i: usize, v: u32| b[i * 4..i * 4 + 4].copy_from_slice(&v.to_le_bytes());
        put(0, dw0);
        put(1, self.nsid);
        put(4, self.mptr as u32);
        put(5, (self.mptr >> 32) as u32);
        put(6, self.prp1 as u32);
        put(7, (self.prp1 >> 32) as u32);
        put(8, self.prp2 as u32);
        put(9, (self.prp2 >> 32) as u32);
        put(10, self.cdw10);
        put(11, self.cdw11);
        put(12, self.cdw12);
        put(13, self.cdw13);
        put(14, self.cdw14);
        put(15, self.cdw15);
        b
    }

    /// Starting LBA of an NVM command (CDW10/11).
    pub fn slba(&self) -> u64 {
        self.cdw10 as u64 | (self.cdw11 as u64) << 32
    }

    /// Number of logical blocks (0's based NLB in CDW12 bits 15:0, plus one).
    pub fn nlb(&self) -> u32 {
        (self.cdw12 & 0xffff) + 1
    }
}

/// A 16-byte completion queue entry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Completion {
    pub dw0: u32,
    pub dw1: u32,
    pub sq_head: u16,
    pub sq_id: u16,
    pub cid: u16,
    pub status: Status,
}

impl Default for Status {
    fn default() -> Self {
        Status::SUCCESS
    }
}

impl Completion {
    /// Dwords 0..2 and dword 3 (without the phase tag) as written to the CQ.
    pub fn encode(&self, phase: bool) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[0..4].copy_from_slice(&self.dw0.to_le_bytes());
        b[4..8].copy_from_slice(&self.dw1.to_le_bytes());
        b[8..10].copy_from_slice(&self.sq_head.to_le_bytes());
        b[10..12].copy_from_slice(&self.sq_id.to_le_bytes());
        let dw3 = self.cid as u32 | (phase as u32) << 16 | (self.status.field() as u32) << 17;
        b[12..16].copy_from_slice(&dw3.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; 16]) -> (Completion, bool) {
        let dw3 = u32::from_le_bytes(b[12..16].try_into().unwrap());
        let field = (dw3 >> 17) as u16;
        let status = if field & 0x7ff == 0 { Status::SUCCESS } else { Status(((field >> 8) & 0x7) << 8 | (field & 0xff)) };
        (
            Completion {
                dw0: u32::from_le_bytes(b[0..4].try_into().unwrap()),
                dw1: u32::from_le_bytes(b[4..8].try_into().unwrap()),
                sq_head: u16::from_le_bytes(b[8..10].try_into().unwrap()),
                sq_id: u16::from_le_bytes(b[10..12].try_into().unwrap()),
                cid: dw3 as u16,
                status,
            },
            dw3 & (1 << 16) != 0,
        )
    }
}
