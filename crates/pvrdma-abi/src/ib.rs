//! The numeric values the interface carries, which are the `ib_*` numbers of
//! Linux's RDMA core. Kept as plain constants: the guest can write any value,
//! and the device must be able to hold (and reject) the ones it does not know.

/// `ib_wr_opcode` (`pvrdma_wr_opcode`).
pub mod wr_opcode {
    pub const RDMA_WRITE: u32 = 0;
    pub const RDMA_WRITE_WITH_IMM: u32 = 1;
    pub const SEND: u32 = 2;
    pub const SEND_WITH_IMM: u32 = 3;
    pub const RDMA_READ: u32 = 4;
    pub const ATOMIC_CMP_AND_SWP: u32 = 5;
    pub const ATOMIC_FETCH_AND_ADD: u32 = 6;
    pub const LSO: u32 = 7;
    pub const SEND_WITH_INV: u32 = 8;
    pub const RDMA_READ_WITH_INV: u32 = 9;
    pub const LOCAL_INV: u32 = 10;
    pub const FAST_REG_MR: u32 = 11;
    pub const MASKED_ATOMIC_CMP_AND_SWP: u32 = 12;
    pub const MASKED_ATOMIC_FETCH_AND_ADD: u32 = 13;
    pub const BIND_MW: u32 = 14;
    pub const REG_SIG_MR: u32 = 15;
}

/// `ib_wc_status`.
pub mod wc_status {
    pub const SUCCESS: u32 = 0;
    pub const LOC_LEN_ERR: u32 = 1;
    pub const LOC_QP_OP_ERR: u32 = 2;
    pub const LOC_EEC_OP_ERR: u32 = 3;
    pub const LOC_PROT_ERR: u32 = 4;
    pub const WR_FLUSH_ERR: u32 = 5;
    pub const MW_BIND_ERR: u32 = 6;
    pub const BAD_RESP_ERR: u32 = 7;
    pub const LOC_ACCESS_ERR: u32 = 8;
    pub const REM_INV_REQ_ERR: u32 = 9;
    pub const REM_ACCESS_ERR: u32 = 10;
    pub const REM_OP_ERR: u32 = 11;
    pub const RETRY_EXC_ERR: u32 = 12;
    pub const RNR_RETRY_EXC_ERR: u32 = 13;
    pub const LOC_RDD_VIOL_ERR: u32 = 14;
    pub const REM_INV_RD_REQ_ERR: u32 = 15;
    pub const REM_ABORT_ERR: u32 = 16;
    pub const INV_EECN_ERR: u32 = 17;
    pub const INV_EEC_STATE_ERR: u32 = 18;
    pub const FATAL_ERR: u32 = 19;
    pub const RESP_TIMEOUT_ERR: u32 = 20;
    pub const GENERAL_ERR: u32 = 21;
}

/// `ib_wc_opcode`.
pub mod wc_opcode {
    pub const SEND: u32 = 0;
    pub const RDMA_WRITE: u32 = 1;
    pub const RDMA_READ: u32 = 2;
    pub const COMP_SWAP: u32 = 3;
    pub const FETCH_ADD: u32 = 4;
    pub const BIND_MW: u32 = 5;
    pub const LSO: u32 = 6;
    pub const LOCAL_INV: u32 = 7;
    pub const FAST_REG_MR: u32 = 8;
    pub const MASKED_COMP_SWAP: u32 = 9;
    pub const MASKED_FETCH_ADD: u32 = 10;
    pub const RECV: u32 = 1 << 7;
    pub const RECV_RDMA_WITH_IMM: u32 = (1 << 7) + 1;
}

/// `ib_wc_flags`.
pub mod wc_flags {
    pub const GRH: u32 = 1 << 0;
    pub const WITH_IMM: u32 = 1 << 1;
    pub const WITH_INVALIDATE: u32 = 1 << 2;
    pub const IP_CSUM_OK: u32 = 1 << 3;
    pub const WITH_SMAC: u32 = 1 << 4;
    pub const WITH_VLAN: u32 = 1 << 5;
    pub const WITH_NETWORK_HDR_TYPE: u32 = 1 << 6;
}

/// `ib_send_flags`.
pub mod send_flags {
    pub const FENCE: u32 = 1 << 0;
    pub const SIGNALED: u32 = 1 << 1;
    pub const SOLICITED: u32 = 1 << 2;
    pub const INLINE: u32 = 1 << 3;
    pub const IP_CSUM: u32 = 1 << 4;
}

/// `ib_access_flags`.
pub mod access {
    pub const LOCAL_WRITE: u32 = 1 << 0;
    pub const REMOTE_WRITE: u32 = 1 << 1;
    pub const REMOTE_READ: u32 = 1 << 2;
    pub const REMOTE_ATOMIC: u32 = 1 << 3;
    pub const MW_BIND: u32 = 1 << 4;
    pub const ZERO_BASED: u32 = 1 << 5;
    pub const ON_DEMAND: u32 = 1 << 6;
}

/// `ib_qp_state`.
pub mod qp_state {
    pub const RESET: u32 = 0;
    pub const INIT: u32 = 1;
    pub const RTR: u32 = 2;
    pub const RTS: u32 = 3;
    pub const SQD: u32 = 4;
    pub const SQE: u32 = 5;
    pub const ERR: u32 = 6;
}

/// `ib_qp_attr_mask`.
pub mod qp_attr_mask {
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
    /// Every bit the interface defines.
    pub const ALL: u32 = (1 << 21) - 1;
}

/// `ib_qp_type`.
pub mod qp_type {
    pub const SMI: u8 = 0;
    pub const GSI: u8 = 1;
    pub const RC: u8 = 2;
    pub const UC: u8 = 3;
    pub const UD: u8 = 4;
}

/// `ib_mtu`.
pub mod mtu {
    pub const MTU_256: u32 = 1;
    pub const MTU_512: u32 = 2;
    pub const MTU_1024: u32 = 3;
    pub const MTU_2048: u32 = 4;
    pub const MTU_4096: u32 = 5;

    /// Bytes of an MTU value, `None` for an unknown one.
    pub const fn bytes(mtu: u32) -> Option<u32> {
        match mtu {
            MTU_256 => Some(256),
            MTU_512 => Some(512),
            MTU_1024 => Some(1024),
            MTU_2048 => Some(2048),
            MTU_4096 => Some(4096),
            _ => None,
        }
    }
}

/// `ib_port_state`.
pub mod port_state {
    pub const NOP: u32 = 0;
    pub const DOWN: u32 = 1;
    pub const INIT: u32 = 2;
    pub const ARMED: u32 = 3;
    pub const ACTIVE: u32 = 4;
    pub const ACTIVE_DEFER: u32 = 5;
}

/// `ib_port_cap_flags` the device reports.
pub mod port_cap {
    pub const CM_SUP: u32 = 1 << 16;
    pub const IP_BASED_GIDS: u32 = 1 << 26;
}

/// `ib_event` (`pvrdma_eqe_type`).
pub mod event {
    pub const CQ_ERR: u32 = 0;
    pub const QP_FATAL: u32 = 1;
    pub const QP_REQ_ERR: u32 = 2;
    pub const QP_ACCESS_ERR: u32 = 3;
    pub const COMM_EST: u32 = 4;
    pub const SQ_DRAINED: u32 = 5;
    pub const PATH_MIG: u32 = 6;
    pub const PATH_MIG_ERR: u32 = 7;
    pub const DEVICE_FATAL: u32 = 8;
    pub const PORT_ACTIVE: u32 = 9;
    pub const PORT_ERR: u32 = 10;
    pub const LID_CHANGE: u32 = 11;
    pub const PKEY_CHANGE: u32 = 12;
    pub const SM_CHANGE: u32 = 13;
    pub const SRQ_ERR: u32 = 14;
    pub const SRQ_LIMIT_REACHED: u32 = 15;
    pub const QP_LAST_WQE_REACHED: u32 = 16;
    pub const CLIENT_REREGISTER: u32 = 17;
    pub const GID_CHANGE: u32 = 18;
}

/// `ib_srq_type` in CREATE_SRQ (`IB_SRQT_BASIC` is what Linux creates).
pub mod srq_type {
    pub const BASIC: u8 = 0;
    pub const XRC: u8 = 1;
    pub const TM: u8 = 2;
}

/// `ib_srq_attr_mask` in MODIFY_SRQ.
pub mod srq_attr_mask {
    pub const MAX_WR: u32 = 1 << 0;
    pub const LIMIT: u32 = 1 << 1;
}

/// `ib_gid_type` in CREATE_BIND.
pub mod gid_type {
    pub const IB: u8 = 0;
    pub const ROCE: u8 = 1;
    pub const ROCE_UDP_ENCAP: u8 = 2;
}
