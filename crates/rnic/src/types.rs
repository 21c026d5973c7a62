//! Verbs-level types shared by rnicd and its clients (values as in libibverbs).

use serde::{Deserialize, Serialize};

/// Memory region / QP access flags (ibv_access_flags).
pub mod access {
    pub const LOCAL_WRITE: u32 = 1;
    pub const REMOTE_WRITE: u32 = 2;
    pub const REMOTE_READ: u32 = 4;
    pub const REMOTE_ATOMIC: u32 = 8;
    pub const ALL: u32 = 15;
    /// An MR memory windows may be bound to (IBV_ACCESS_MW_BIND): a window
    /// may grant remote access the MR itself does not (crate::keys::Keys::bind).
    pub const MW_BIND: u32 = 16;
}

/// QP attribute mask bits (ibv_qp_attr_mask).
pub mod mask {
    pub const STATE: u32 = 1 << 0;
    pub const CUR_STATE: u32 = 1 << 1;
    pub const EN_SQD_ASYNC_NOTIFY: u32 = 1 << 2;
    pub const ACCESS_FLAGS: u32 = 1 << 3;
    pub const PKEY_INDEX: u32 = 1 << 4;
    pub const PORT: u32 = 1 << 5;
    pub const QKEY: u32 = 1 << 6;
    pub const AV: u32 = 1 << 7;
    pub const PATH_MTU: u32 = 1 << 8;
    pub const TIMEOUT: u32 = 1 << 9;
    pub const RETRY_CNT: u32 = 1 << 10;
    pub const RNR_RETRY: u32 = 1 << 11;
    pub const RQ_PSN: u32 = 1 << 12;
    pub const MAX_QP_RD_ATOMIC: u32 = 1 << 13;
    pub const ALT_PATH: u32 = 1 << 14;
    pub const MIN_RNR_TIMER: u32 = 1 << 15;
    pub const SQ_PSN: u32 = 1 << 16;
    pub const MAX_DEST_RD_ATOMIC: u32 = 1 << 17;
    pub const PATH_MIG_STATE: u32 = 1 << 18;
    pub const CAP: u32 = 1 << 19;
    pub const DEST_QPN: u32 = 1 << 20;
}

/// QP transport service (ibv_qp_type): reliable connected, unreliable
/// datagram (one packet per message, no ACKs, destination per WR), or
/// unreliable connected (SEND and WRITE to one peer, no ACKs, a lost packet
/// loses its message).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum QpType {
    #[default]
    Rc,
    Ud,
    Uc,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum QpState {
    Reset,
    Init,
    Rtr,
    Rts,
    Sqd,
    Sqe,
    Err,
}

/// Path MTU as the IB enum (1..=5 = 256..4096) plus software-link sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Mtu {
    M256,
    M512,
    M1024,
    M2048,
    M4096,
    M8192,
    M16384,
    M32768,
}

impl Mtu {
    pub fn bytes(self) -> usize {
        match self {
            Mtu::M256 => 256,
            Mtu::M512 => 512,
            Mtu::M1024 => 1024,
            Mtu::M2048 => 2048,
            Mtu::M4096 => 4096,
            Mtu::M8192 => 8192,
            Mtu::M16384 => 16384,
            Mtu::M32768 => 32768,
        }
    }
    pub fn from_bytes(n: usize) -> Option<Mtu> {
        Some(match n {
            256 => Mtu::M256,
            512 => Mtu::M512,
            1024 => Mtu::M1024,
            2048 => Mtu::M2048,
            4096 => Mtu::M4096,
            8192 => Mtu::M8192,
            16384 => Mtu::M16384,
            32768 => Mtu::M32768,
            _ => return None,
        })
    }
    pub const MAX_BYTES: usize = 32768;
}

/// Send opcodes (ibv_wr_opcode values).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[repr(u8)]
pub enum WrOpcode {
    RdmaWrite = 0,
    RdmaWriteImm = 1,
    Send = 2,
    SendImm = 3,
    RdmaRead = 4,
    AtomicCmpSwp = 5,
    AtomicFetchAdd = 6,
    /// Invalidates an indirect key (`rkey`): it grants nothing until rebound.
    LocalInv = 7,
    SendInv = 9,
    /// Binds indirect key `rkey` (crate::keys) to `num_sge` ranges seen at
    /// `remote_addr` with the access flags in `compare_add`: the ranges are
    /// the SGEs, then (past 8) 16-byte `Sge`s in the inline area. The
    /// value of IBV_WR_DRIVER1, which mlx5 uses for its UMR. A memory
    /// window's bind also names its new key in `swap` (non-zero: the key is
    /// renamed first, `Keys::rename`); with no range it unbinds the window.
    BindKey = 11,
    /// RDMA atomic write (IBTA 1.5, IBV_WR_ATOMIC_WRITE): 8 bytes written
    /// to an aligned remote address in one store, as a WRITE's rights allow.
    AtomicWrite = 15,
}

impl WrOpcode {
    pub fn from_u8(v: u8) -> Option<WrOpcode> {
        Some(match v {
            0 => WrOpcode::RdmaWrite,
            1 => WrOpcode::RdmaWriteImm,
            2 => WrOpcode::Send,
            3 => WrOpcode::SendImm,
            4 => WrOpcode::RdmaRead,
            5 => WrOpcode::AtomicCmpSwp,
            6 => WrOpcode::AtomicFetchAdd,
            7 => WrOpcode::LocalInv,
            9 => WrOpcode::SendInv,
            11 => WrOpcode::BindKey,
            15 => WrOpcode::AtomicWrite,
            _ => return None,
        })
    }
    pub fn is_read_or_atomic(self) -> bool {
        matches!(self, WrOpcode::RdmaRead | WrOpcode::AtomicCmpSwp | WrOpcode::AtomicFetchAdd)
    }
    /// Work requests that touch no wire: they act on the key table.
    pub fn is_local(self) -> bool {
        matches!(self, WrOpcode::LocalInv | WrOpcode::BindKey)
    }
    pub fn is_atomic(self) -> bool {
        matches!(self, WrOpcode::AtomicCmpSwp | WrOpcode::AtomicFetchAdd)
    }
}

/// Send flags (ibv_send_flags).
pub mod send_flags {
    pub const FENCE: u8 = 1;
    pub const SIGNALED: u8 = 2;
    pub const SOLICITED: u8 = 4;
    pub const INLINE: u8 = 8;
}

/// Work completion status (ibv_wc_status values).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[repr(u8)]
pub enum WcStatus {
    Success = 0,
    LocLenErr = 1,
    LocQpOpErr = 2,
    LocProtErr = 4,
    WrFlushErr = 5,
    MwBindErr = 6,
    BadRespErr = 7,
    LocAccessErr = 8,
    RemInvReqErr = 9,
    RemAccessErr = 10,
    RemOpErr = 11,
    RetryExcErr = 12,
    RnrRetryExcErr = 13,
    FatalErr = 19,
    GeneralErr = 21,
}

impl WcStatus {
    pub fn from_u8(v: u8) -> WcStatus {
        use WcStatus::*;
        match v {
            0 => Success,
            1 => LocLenErr,
            2 => LocQpOpErr,
            4 => LocProtErr,
            5 => WrFlushErr,
            6 => MwBindErr,
            7 => BadRespErr,
            8 => LocAccessErr,
            9 => RemInvReqErr,
            10 => RemAccessErr,
            11 => RemOpErr,
            12 => RetryExcErr,
            13 => RnrRetryExcErr,
            19 => FatalErr,
            _ => GeneralErr,
        }
    }
}

/// Work completion opcode (ibv_wc_opcode values).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[repr(u8)]
pub enum WcOpcode {
    Send = 0,
    RdmaWrite = 1,
    RdmaRead = 2,
    CompSwap = 3,
    FetchAdd = 4,
    BindKey = 5,
    LocalInv = 6,
    AtomicWrite = 9,
    Recv = 128,
    RecvRdmaWithImm = 129,
}

impl WcOpcode {
    pub fn from_u8(v: u8) -> WcOpcode {
        match v {
            0 => WcOpcode::Send,
            1 => WcOpcode::RdmaWrite,
            2 => WcOpcode::RdmaRead,
            3 => WcOpcode::CompSwap,
            4 => WcOpcode::FetchAdd,
            5 => WcOpcode::BindKey,
            6 => WcOpcode::LocalInv,
            9 => WcOpcode::AtomicWrite,
            129 => WcOpcode::RecvRdmaWithImm,
            _ => WcOpcode::Recv,
        }
    }
    pub fn for_wr(op: WrOpcode) -> WcOpcode {
        match op {
            WrOpcode::RdmaWrite | WrOpcode::RdmaWriteImm => WcOpcode::RdmaWrite,
            WrOpcode::Send | WrOpcode::SendImm | WrOpcode::SendInv => WcOpcode::Send,
            WrOpcode::RdmaRead => WcOpcode::RdmaRead,
            WrOpcode::AtomicCmpSwp => WcOpcode::CompSwap,
            WrOpcode::AtomicFetchAdd => WcOpcode::FetchAdd,
            WrOpcode::LocalInv => WcOpcode::LocalInv,
            WrOpcode::BindKey => WcOpcode::BindKey,
            WrOpcode::AtomicWrite => WcOpcode::AtomicWrite,
        }
    }
}

/// Work completion flags.
pub mod wc_flags {
    /// A UD receive: the buffer starts with the 40-byte GRH.
    pub const GRH: u8 = 1;
    pub const WITH_IMM: u8 = 2;
    pub const WITH_INV: u8 = 8;
}

/// QP attributes (ibv_qp_attr subset that RC uses).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QpAttr {
    pub qp_state: QpState,
    pub path_mtu: Mtu,
    pub qp_access_flags: u32,
    pub pkey_index: u16,
    pub port_num: u8,
    /// Destination GID: an IPv4 address for RoCEv2 (IPv4-mapped GID).
    pub dest_gid: std::net::Ipv4Addr,
    pub dest_qp_num: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub sq_draining: bool,
    /// UD: the Q_Key incoming messages must carry, and the one sent when a
    /// WR's Q_Key has its high bit set.
    #[serde(default)]
    pub qkey: u32,
}

impl Default for QpAttr {
    fn default() -> Self {
        QpAttr {
            qp_state: QpState::Reset,
            path_mtu: Mtu::M1024,
            qp_access_flags: 0,
            pkey_index: 0,
            port_num: 1,
            dest_gid: std::net::Ipv4Addr::UNSPECIFIED,
            dest_qp_num: 0,
            rq_psn: 0,
            sq_psn: 0,
            max_rd_atomic: 1,
            max_dest_rd_atomic: 1,
            min_rnr_timer: 0,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            sq_draining: false,
            qkey: 0,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QpCap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceAttr {
    pub fw_ver: String,
    pub node_guid: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub max_mr_size: u64,
    pub max_qp: u32,
    pub max_qp_wr: u32,
    pub max_sge: u32,
    pub max_cq: u32,
    pub max_cqe: u32,
    pub max_mr: u32,
    pub max_pd: u32,
    pub max_qp_rd_atom: u32,
    pub max_qp_init_rd_atom: u32,
    pub max_inline_data: u32,
    pub atomic_cap: String,
    pub max_msg_sz: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortAttr {
    pub state: String,
    pub max_mtu: Mtu,
    pub active_mtu: Mtu,
    pub gid_tbl_len: u32,
    pub link_layer: String,
    pub port_num: u8,
}
