//! Commands: the driver writes one request into the command slot, writes
//! `REG_REQUEST`, reads `REG_ERR` (non-zero: rejected), waits for the
//! response interrupt, and reads the response slot, checking that `ack` is
//! the request's `*_RESP` code and `err` is zero. One command is outstanding
//! at a time.

use crate::pod;

pub const CMD_QUERY_PORT: u32 = 0;
pub const CMD_QUERY_PKEY: u32 = 1;
pub const CMD_CREATE_PD: u32 = 2;
pub const CMD_DESTROY_PD: u32 = 3;
pub const CMD_CREATE_MR: u32 = 4;
pub const CMD_DESTROY_MR: u32 = 5;
pub const CMD_CREATE_CQ: u32 = 6;
pub const CMD_RESIZE_CQ: u32 = 7;
pub const CMD_DESTROY_CQ: u32 = 8;
pub const CMD_CREATE_QP: u32 = 9;
pub const CMD_MODIFY_QP: u32 = 10;
pub const CMD_QUERY_QP: u32 = 11;
pub const CMD_DESTROY_QP: u32 = 12;
pub const CMD_CREATE_UC: u32 = 13;
pub const CMD_DESTROY_UC: u32 = 14;
pub const CMD_CREATE_BIND: u32 = 15;
pub const CMD_DESTROY_BIND: u32 = 16;
pub const CMD_CREATE_SRQ: u32 = 17;
pub const CMD_MODIFY_SRQ: u32 = 18;
pub const CMD_QUERY_SRQ: u32 = 19;
pub const CMD_DESTROY_SRQ: u32 = 20;
/// One past the last command.
pub const CMD_MAX: u32 = 21;

/// The first response code; each command's is `CMD_FIRST_RESP + cmd`.
pub const CMD_FIRST_RESP: u32 = 1 << 31;

/// The response code (`ack`) for command `cmd`.
pub const fn resp_code(cmd: u32) -> u32 {
    CMD_FIRST_RESP | cmd
}

/// Size of the largest request (`modify_qp`): the driver's request union.
pub const CMD_REQ_MAX_SIZE: usize = core::mem::size_of::<CmdModifyQp>();
/// Size of the largest response (`query_qp_resp`): the response union.
pub const CMD_RESP_MAX_SIZE: usize = core::mem::size_of::<CmdQueryQpResp>();

/// Every request starts with this.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmdHdr {
    /// Echoed in the response (the driver's lookup key).
    pub response: u64,
    /// `CMD_*`.
    pub cmd: u32,
    pub reserved: u32,
}

/// Every response starts with this.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmdRespHdr {
    /// The request's `response`.
    pub response: u64,
    /// `resp_code(cmd)`.
    pub ack: u32,
    /// Zero on success; an error number otherwise (the device's choice).
    pub err: u8,
    pub reserved: [u8; 3],
}

/// A GID: 16 bytes, 8-byte aligned (a union with two `__be64` in Linux).
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Gid {
    pub raw: [u8; 16],
}

impl Gid {
    /// The IPv4-mapped GID `::ffff:a.b.c.d` (RoCE v2 over IPv4).
    pub const fn from_ipv4(ip: [u8; 4]) -> Gid {
        Gid { raw: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, ip[0], ip[1], ip[2], ip[3]] }
    }
    /// The IPv4 address of an IPv4-mapped GID.
    pub const fn ipv4(&self) -> Option<[u8; 4]> {
        let r = &self.raw;
        let mut i = 0;
        while i < 10 {
            if r[i] != 0 {
                return None;
            }
            i += 1;
        }
        if r[10] != 0xff || r[11] != 0xff {
            return None;
        }
        Some([r[12], r[13], r[14], r[15]])
    }
}

/// Port attributes (`struct pvrdma_port_attr`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PortAttr {
    /// `ib::port_state`.
    pub state: u32,
    /// `ib::mtu`.
    pub max_mtu: u32,
    pub active_mtu: u32,
    pub gid_tbl_len: u32,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub reserved: [u8; 2],
}

/// `struct pvrdma_global_route`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GlobalRoute {
    pub dgid: Gid,
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
    pub reserved: u8,
}

/// `struct pvrdma_ah_attr`: the address of the remote end of a QP.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AhAttr {
    pub grh: GlobalRoute,
    pub dlid: u16,
    pub vlan_id: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub ah_flags: u8,
    pub port_num: u8,
    pub dmac: [u8; 6],
    pub reserved: u8,
}

/// `struct pvrdma_qp_cap`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QpCap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
    pub reserved: u32,
}

/// `struct pvrdma_qp_attr` (MODIFY_QP and QUERY_QP).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QpAttr {
    /// `ib::qp_state`.
    pub qp_state: u32,
    pub cur_qp_state: u32,
    /// `ib::mtu`.
    pub path_mtu: u32,
    pub path_mig_state: u32,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    /// `ib::access` bits.
    pub qp_access_flags: u32,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub reserved: [u8; 5],
    pub cap: QpCap,
    pub ah_attr: AhAttr,
    pub alt_ah_attr: AhAttr,
}

/// `struct pvrdma_srq_attr`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SrqAttr {
    pub max_wr: u32,
    pub max_sge: u32,
    pub srq_limit: u32,
    pub reserved: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmdQueryPort {
    pub hdr: CmdHdr,
    pub port_num: u8,
    pub reserved: [u8; 7],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmdQueryPortResp {
    pub hdr: CmdRespHdr,
    pub attrs: PortAttr,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmdQueryPkey {
    pub hdr: CmdHdr,
    pub port_num: u8,
    pub index: u8,
    pub reserved: [u8; 6],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmdQueryPkeyResp {
    pub hdr: CmdRespHdr,
    pub pkey: u16,
    pub reserved: [u8; 6],
}

/// CREATE_UC: a user context whose doorbells are the UAR page `pfn`
/// (`pfn` u32 before version 19, `pfn64` from 19 on; a union in Linux).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmdCreateUc {
    pub hdr: CmdHdr,
    pub pfn64: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmdCreateUcResp {
    pub hdr: CmdRespHdr,
    pub ctx_handle: u32,
    pub reserved: [u8; 4],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmdDestroyUc {
    pub hdr: CmdHdr,
    pub ctx_handle: u32,
    pub reserved: [u8; 4],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmdCreatePd {
    pub hdr: CmdHdr,
    pub ctx_handle: u32,
    pub reserved: [u8; 4],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmdCreatePdResp {
    pub hdr: CmdRespHdr,
    pub pd_handle: u32,
    pub reserved: [u8; 4],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmdDestroyPd {
    pub hdr: CmdHdr,
    pub pd_handle: u32,
    pub reserved: [u8; 4],
}

/// CREATE_MR: a region of `length` bytes at virtual address `start` whose
/// pages are listed by the page directory at `pdir_dma` (`nchunks` pages),
/// or all of memory with `MR_FLAG_DMA`, or a fast-registration region with
/// `MR_FLAG_FRMR` (`nchunks` = its maximum page-list length).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmdCreateMr {
    pub hdr: CmdHdr,
    pub start: u64,
    pub length: u64,
    pub pdir_dma: u64,
    pub pd_handle: u32,
    /// `ib::access` bits.
    pub access_flags: u32,
    /// `MR_FLAG_*`.
    pub flags: u32,
    pub nchunks: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmdCreateMrResp {
    pub hdr: CmdRespHdr,
    pub mr_handle: u32,
    pub lkey: u32,
    pub rkey: u32,
    pub reserved: [u8; 4],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmdDestroyMr {
    pub hdr: CmdHdr,
    pub mr_handle: u32,
    pub reserved: [u8; 4],
}

/// CREATE_CQ: `cqe` entries (a power of two) in a ring whose page directory
/// is at `pdir_dma`: `nchunks` pages, page 0 the ring state, CQEs from page 1.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmdCreateCq {
    pub hdr: CmdHdr,
    pub pdir_dma: u64,
    pub ctx_handle: u32,
    pub cqe: u32,
    pub nchunks: u32,
    pub reserved: [u8; 4],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmdCreateCqResp {
    pub hdr: CmdRespHdr,
    pub cq_handle: u32,
    pub cqe: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmdResizeCq {
    pub hdr: CmdHdr,
    pub cq_handle: u32,
    pub cqe: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmdResizeCqResp {
    pub hdr: CmdRespHdr,
    pub cqe: u32,
    pub reserved: [u8; 4],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmdDestroyCq {
    pub hdr: CmdHdr,
    pub cq_handle: u32,
    pub reserved: [u8; 4],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmdCreateSrq {
    pub hdr: CmdHdr,
    pub pdir_dma: u64,
    pub pd_handle: u32,
    pub nchunks: u32,
    pub attrs: SrqAttr,
    pub srq_type: u8,
    pub reserved: [u8; 7],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmdCreateSrqResp {
    pub hdr: CmdRespHdr,
    pub srqn: u32,
    pub reserved: [u8; 4],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmdModifySrq {
    pub hdr: CmdHdr,
    pub srq_handle: u32,
    pub attr_mask: u32,
    pub attrs: SrqAttr,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmdQuerySrq {
    pub hdr: CmdHdr,
    pub srq_handle: u32,
    pub reserved: [u8; 4],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmdQuerySrqResp {
    pub hdr: CmdRespHdr,
    pub attrs: SrqAttr,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmdDestroySrq {
    pub hdr: CmdHdr,
    pub srq_handle: u32,
    pub reserved: [u8; 4],
}

/// CREATE_QP: the QP's rings live in the pages of the page directory at
/// `pdir_dma` (`total_chunks` pages): page 0 holds the SQ ring state at +0
/// and the RQ ring state at +8, SQ WQEs start at page 1, RQ WQEs at page
/// `1 + send_chunks`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmdCreateQp {
    pub hdr: CmdHdr,
    pub pdir_dma: u64,
    pub pd_handle: u32,
    pub send_cq_handle: u32,
    pub recv_cq_handle: u32,
    pub srq_handle: u32,
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
    pub lkey: u32,
    pub access_flags: u32,
    /// Pages in the directory, the header page included.
    pub total_chunks: u16,
    /// Pages of send WQEs (the header page excluded).
    pub send_chunks: u16,
    pub max_atomic_arg: u16,
    pub sq_sig_all: u8,
    /// `ib::qp_type`.
    pub qp_type: u8,
    pub is_srq: u8,
    pub reserved: [u8; 3],
}

/// CREATE_QP response before version 20 (the QPN is also the handle).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmdCreateQpResp {
    pub hdr: CmdRespHdr,
    pub qpn: u32,
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

/// CREATE_QP response from version 20 on: the QPN the wire sees and the
/// handle commands and doorbells use.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmdCreateQpRespV2 {
    pub hdr: CmdRespHdr,
    pub qpn: u32,
    pub qp_handle: u32,
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
    /// The tail padding C puts after `max_inline_data` (8-byte alignment).
    pub pad: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmdModifyQp {
    pub hdr: CmdHdr,
    pub qp_handle: u32,
    /// `ib::qp_attr_mask` bits.
    pub attr_mask: u32,
    pub attrs: QpAttr,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmdQueryQp {
    pub hdr: CmdHdr,
    pub qp_handle: u32,
    pub attr_mask: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmdQueryQpResp {
    pub hdr: CmdRespHdr,
    pub attrs: QpAttr,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmdDestroyQp {
    pub hdr: CmdHdr,
    pub qp_handle: u32,
    pub reserved: [u8; 4],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmdDestroyQpResp {
    pub hdr: CmdRespHdr,
    pub events_reported: u32,
    pub reserved: [u8; 4],
}

/// CREATE_BIND: put `new_gid` at `index` of the port's GID table.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmdCreateBind {
    pub hdr: CmdHdr,
    pub mtu: u32,
    pub vlan: u32,
    pub index: u32,
    pub new_gid: [u8; 16],
    /// `ib::gid_type`.
    pub gid_type: u8,
    pub reserved: [u8; 3],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CmdDestroyBind {
    pub hdr: CmdHdr,
    pub index: u32,
    pub dest_gid: [u8; 16],
    pub reserved: [u8; 4],
}

pod!(
    CmdHdr = 16,
    CmdRespHdr = 16,
    Gid = 16,
    PortAttr = 48,
    GlobalRoute = 24,
    AhAttr = 40,
    QpCap = 24,
    QpAttr = 160,
    SrqAttr = 16,
    CmdQueryPort = 24,
    CmdQueryPortResp = 64,
    CmdQueryPkey = 24,
    CmdQueryPkeyResp = 24,
    CmdCreateUc = 24,
    CmdCreateUcResp = 24,
    CmdDestroyUc = 24,
    CmdCreatePd = 24,
    CmdCreatePdResp = 24,
    CmdDestroyPd = 24,
    CmdCreateMr = 56,
    CmdCreateMrResp = 32,
    CmdDestroyMr = 24,
    CmdCreateCq = 40,
    CmdCreateCqResp = 24,
    CmdResizeCq = 24,
    CmdResizeCqResp = 24,
    CmdDestroyCq = 24,
    CmdCreateSrq = 56,
    CmdCreateSrqResp = 24,
    CmdModifySrq = 40,
    CmdQuerySrq = 24,
    CmdQuerySrqResp = 32,
    CmdDestroySrq = 24,
    CmdCreateQp = 80,
    CmdCreateQpResp = 40,
    CmdCreateQpRespV2 = 48,
    CmdModifyQp = 184,
    CmdQueryQp = 24,
    CmdQueryQpResp = 176,
    CmdDestroyQp = 24,
    CmdDestroyQpResp = 24,
    CmdCreateBind = 48,
    CmdDestroyBind = 40,
);

const _: () = assert!(core::mem::offset_of!(QpAttr, cap) == 56);
const _: () = assert!(core::mem::offset_of!(QpAttr, ah_attr) == 80);
const _: () = assert!(core::mem::offset_of!(AhAttr, dmac) == 33);
const _: () = assert!(core::mem::offset_of!(CmdCreateQp, total_chunks) == 68);
const _: () = assert!(core::mem::offset_of!(CmdCreateQpRespV2, qp_handle) == 20);
