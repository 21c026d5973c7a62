//! RoCEv2 wire formats: BTH and its extension headers, the ICRC, and a
//! parser/builder that never panics on hostile input.
//!
//! Layout follows the IBTA spec (vol. 1, ch. 9) and the RoCEv2 annex: all
//! fields big-endian; payload padded to 4 bytes; 4-byte ICRC at the end.

use std::net::Ipv4Addr;

pub const ROCE_PORT: u16 = 4791;
pub const BTH_LEN: usize = 12;
pub const RETH_LEN: usize = 16;
pub const AETH_LEN: usize = 4;
pub const ATOMIC_ETH_LEN: usize = 28;
pub const ATOMIC_ACK_ETH_LEN: usize = 8;
pub const IMM_LEN: usize = 4;
pub const IETH_LEN: usize = 4;
pub const ICRC_LEN: usize = 4;
/// Datagram ETH of UD packets: Q_Key, then the source QPN.
pub const DETH_LEN: usize = 8;
/// Longest header stack: BTH + RETH + ImmDt (WRITE_ONLY_WITH_IMM) or BTH + AtomicETH.
pub const MAX_HDR_LEN: usize = BTH_LEN + ATOMIC_ETH_LEN;
pub const PSN_MASK: u32 = 0x00ff_ffff;
pub const QPN_MASK: u32 = 0x00ff_ffff;
pub const DEFAULT_PKEY: u16 = 0xffff;

/// What a packet of an opcode carries out: its operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpKind {
    Send,
    Write,
    ReadRequest,
    ReadResponse,
    Ack,
    AtomicAck,
    Atomic,
}

impl OpKind {
    /// Requests travel requester -> responder; the rest are responses.
    pub const fn is_request(self) -> bool {
        matches!(self, OpKind::Send | OpKind::Write | OpKind::ReadRequest | OpKind::Atomic)
    }
    /// Whether packets of this kind carry a payload after their headers.
    pub const fn has_payload(self) -> bool {
        matches!(self, OpKind::Send | OpKind::Write | OpKind::ReadResponse)
    }
}

/// Where a packet sits in its message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Position {
    First,
    Middle,
    Last,
    Only,
}

/// Extension headers after the BTH, one bit each; they appear on the wire
/// in the order of the bits (IBTA vol. 1 9.2 / 9.3).
pub mod hdr {
    pub const RETH: u8 = 1 << 0;
    pub const ATOMIC_ETH: u8 = 1 << 1;
    pub const AETH: u8 = 1 << 2;
    pub const ATOMIC_ACK_ETH: u8 = 1 << 3;
    pub const IMM: u8 = 1 << 4;
    pub const IETH: u8 = 1 << 5;
    /// UD's DETH; on the wire it comes right after the BTH (IBTA 9.2).
    pub const DETH: u8 = 1 << 6;
}

/// One row of the opcode table: everything the transport knows of an opcode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpInfo {
    pub opcode: Opcode,
    /// The IBTA name.
    pub name: &'static str,
    pub kind: OpKind,
    pub position: Position,
    /// Extension headers (`hdr::*` bits).
    pub headers: u8,
}

impl OpInfo {
    /// Bytes of BTH and extension headers.
    pub const fn header_len(&self) -> usize {
        let h = self.headers;
        let mut n = BTH_LEN;
        if h & hdr::DETH != 0 {
            n += DETH_LEN;
        }
        if h & hdr::RETH != 0 {
            n += RETH_LEN;
        }
        if h & hdr::ATOMIC_ETH != 0 {
            n += ATOMIC_ETH_LEN;
        }
        if h & hdr::AETH != 0 {
            n += AETH_LEN;
        }
        if h & hdr::ATOMIC_ACK_ETH != 0 {
            n += ATOMIC_ACK_ETH_LEN;
        }
        if h & hdr::IMM != 0 {
            n += IMM_LEN;
        }
        if h & hdr::IETH != 0 {
            n += IETH_LEN;
        }
        n
    }
}

/// Defines the `Opcode` enum and the `OPCODES` table from one list, so that
/// the two cannot disagree.
macro_rules! opcode_table {
    ($($variant:ident = $code:literal, $name:literal, $kind:ident, $pos:ident, [$($h:ident)|*];)*) => {
        /// RC opcodes (transport bits 000), UC's (001) and UD's (011).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[repr(u8)]
        pub enum Opcode {
            $($variant = $code,)*
        }

        /// The opcode table, in opcode order (as Linux rxe's `rxe_opcode[]`).
        pub const OPCODES: &[OpInfo] = &[
            $(OpInfo { opcode: Opcode::$variant, name: $name, kind: OpKind::$kind, position: Position::$pos, headers: 0 $(| hdr::$h)* },)*
        ];
    };
}

opcode_table! {
    SendFirst = 0x00, "SEND_FIRST", Send, First, [];
    SendMiddle = 0x01, "SEND_MIDDLE", Send, Middle, [];
    SendLast = 0x02, "SEND_LAST", Send, Last, [];
    SendLastImm = 0x03, "SEND_LAST_WITH_IMMEDIATE", Send, Last, [IMM];
    SendOnly = 0x04, "SEND_ONLY", Send, Only, [];
    SendOnlyImm = 0x05, "SEND_ONLY_WITH_IMMEDIATE", Send, Only, [IMM];
    WriteFirst = 0x06, "RDMA_WRITE_FIRST", Write, First, [RETH];
    WriteMiddle = 0x07, "RDMA_WRITE_MIDDLE", Write, Middle, [];
    WriteLast = 0x08, "RDMA_WRITE_LAST", Write, Last, [];
    WriteLastImm = 0x09, "RDMA_WRITE_LAST_WITH_IMMEDIATE", Write, Last, [IMM];
    WriteOnly = 0x0a, "RDMA_WRITE_ONLY", Write, Only, [RETH];
    WriteOnlyImm = 0x0b, "RDMA_WRITE_ONLY_WITH_IMMEDIATE", Write, Only, [RETH | IMM];
    ReadRequest = 0x0c, "RDMA_READ_REQUEST", ReadRequest, Only, [RETH];
    ReadRespFirst = 0x0d, "RDMA_READ_RESPONSE_FIRST", ReadResponse, First, [AETH];
    ReadRespMiddle = 0x0e, "RDMA_READ_RESPONSE_MIDDLE", ReadResponse, Middle, [];
    ReadRespLast = 0x0f, "RDMA_READ_RESPONSE_LAST", ReadResponse, Last, [AETH];
    ReadRespOnly = 0x10, "RDMA_READ_RESPONSE_ONLY", ReadResponse, Only, [AETH];
    Ack = 0x11, "ACKNOWLEDGE", Ack, Only, [AETH];
    AtomicAck = 0x12, "ATOMIC_ACKNOWLEDGE", AtomicAck, Only, [AETH | ATOMIC_ACK_ETH];
    CompareSwap = 0x13, "COMPARE_SWAP", Atomic, Only, [ATOMIC_ETH];
    FetchAdd = 0x14, "FETCH_ADD", Atomic, Only, [ATOMIC_ETH];
    SendLastInv = 0x16, "SEND_LAST_WITH_INVALIDATE", Send, Last, [IETH];
    SendOnlyInv = 0x17, "SEND_ONLY_WITH_INVALIDATE", Send, Only, [IETH];
    AtomicWrite = 0x1d, "RDMA_ATOMIC_WRITE", Write, Only, [RETH];
    UcSendFirst = 0x20, "UC_SEND_FIRST", Send, First, [];
    UcSendMiddle = 0x21, "UC_SEND_MIDDLE", Send, Middle, [];
    UcSendLast = 0x22, "UC_SEND_LAST", Send, Last, [];
    UcSendLastImm = 0x23, "UC_SEND_LAST_WITH_IMMEDIATE", Send, Last, [IMM];
    UcSendOnly = 0x24, "UC_SEND_ONLY", Send, Only, [];
    UcSendOnlyImm = 0x25, "UC_SEND_ONLY_WITH_IMMEDIATE", Send, Only, [IMM];
    UcWriteFirst = 0x26, "UC_RDMA_WRITE_FIRST", Write, First, [RETH];
    UcWriteMiddle = 0x27, "UC_RDMA_WRITE_MIDDLE", Write, Middle, [];
    UcWriteLast = 0x28, "UC_RDMA_WRITE_LAST", Write, Last, [];
    UcWriteLastImm = 0x29, "UC_RDMA_WRITE_LAST_WITH_IMMEDIATE", Write, Last, [IMM];
    UcWriteOnly = 0x2a, "UC_RDMA_WRITE_ONLY", Write, Only, [RETH];
    UcWriteOnlyImm = 0x2b, "UC_RDMA_WRITE_ONLY_WITH_IMMEDIATE", Write, Only, [RETH | IMM];
    UdSendOnly = 0x64, "UD_SEND_ONLY", Send, Only, [DETH];
    UdSendOnlyImm = 0x65, "UD_SEND_ONLY_WITH_IMMEDIATE", Send, Only, [DETH | IMM];
}

/// Row of `OPCODES` for each opcode value (NO_OPCODE: not one we speak).
const NO_OPCODE: u8 = u8::MAX;
const OPCODE_ROW: [u8; 0x100] = {
    let mut rows = [NO_OPCODE; 0x100];
    let mut i = 0;
    while i < OPCODES.len() {
        rows[OPCODES[i].opcode as usize] = i as u8;
        i += 1;
    }
    rows
};

impl Opcode {
    pub fn from_u8(v: u8) -> Option<Opcode> {
        let row = *OPCODE_ROW.get(v as usize)?;
        (row != NO_OPCODE).then(|| OPCODES[row as usize].opcode)
    }
    /// This opcode's row of the table.
    pub fn info(self) -> &'static OpInfo {
        &OPCODES[OPCODE_ROW[self as usize] as usize]
    }
    pub fn name(self) -> &'static str {
        self.info().name
    }
    pub fn has_reth(self) -> bool {
        self.info().headers & hdr::RETH != 0
    }
    pub fn has_imm(self) -> bool {
        self.info().headers & hdr::IMM != 0
    }
    pub fn has_aeth(self) -> bool {
        self.info().headers & hdr::AETH != 0
    }
    pub fn has_atomic_eth(self) -> bool {
        self.info().headers & hdr::ATOMIC_ETH != 0
    }
    pub fn has_atomic_ack(self) -> bool {
        self.info().headers & hdr::ATOMIC_ACK_ETH != 0
    }
    pub fn has_ieth(self) -> bool {
        self.info().headers & hdr::IETH != 0
    }
    pub fn has_deth(self) -> bool {
        self.info().headers & hdr::DETH != 0
    }
    /// An unreliable datagram opcode (transport bits 011).
    pub fn is_ud(self) -> bool {
        self as u8 >> 5 == 3
    }
    /// An unreliable connected opcode (transport bits 001).
    pub fn is_uc(self) -> bool {
        self as u8 >> 5 == 1
    }
    /// The UC opcode of an RC SEND or WRITE opcode (the same message
    /// position and headers, transport bits 001); None for the others.
    pub fn to_uc(self) -> Option<Opcode> {
        let v = self as u8;
        if v <= Opcode::WriteOnlyImm as u8 {
            Opcode::from_u8(v | 0x20)
        } else {
            None
        }
    }
    pub fn is_atomic(self) -> bool {
        self.info().kind == OpKind::Atomic
    }
    pub fn has_payload(self) -> bool {
        self.info().kind.has_payload()
    }
    /// Requests travel requester -> responder; the rest are responses.
    pub fn is_request(self) -> bool {
        self.info().kind.is_request()
    }
    pub fn is_response(self) -> bool {
        !self.is_request()
    }
    pub fn is_send(self) -> bool {
        self.info().kind == OpKind::Send
    }
    pub fn is_write(self) -> bool {
        self.info().kind == OpKind::Write
    }
    /// First packet of a request message (or its only one).
    pub fn starts_message(self) -> bool {
        let i = self.info();
        i.kind.is_request() && matches!(i.position, Position::First | Position::Only)
    }
    /// Last packet of a message (or its only one).
    pub fn ends_message(self) -> bool {
        matches!(self.info().position, Position::Last | Position::Only)
    }
}

/// Base Transport Header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bth {
    pub opcode: Opcode,
    pub solicited: bool,
    pub mig_req: bool,
    pub pad: u8,
    pub pkey: u16,
    pub dest_qpn: u32,
    pub ack_req: bool,
    pub psn: u32,
    /// The six reserved bits of BTH byte 4 (below FECN and BECN), which
    /// the ICRC masks. An rnicd responder puts how long it held the
    /// request an ACK answers there ([`encode_hold`]); other devices send
    /// and ignore zero.
    pub resv6: u8,
}

/// Units of [`Bth::resv6`]'s hold: 1 ms, up to 63 ms.
pub const HOLD_UNIT_US: u64 = 1000;

/// A responder's hold of `us` µs as [`Bth::resv6`]: whole units rounded
/// down (never more than it held), at most 63.
pub fn encode_hold(us: u64) -> u8 {
    (us / HOLD_UNIT_US).min(0x3f) as u8
}

/// The hold a peer reported in [`Bth::resv6`], µs.
pub fn decode_hold(resv6: u8) -> u64 {
    (resv6 & 0x3f) as u64 * HOLD_UNIT_US
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reth {
    pub va: u64,
    pub rkey: u32,
    pub len: u32,
}

/// Datagram Extended Transport Header (UD): the Q_Key the receiving QP
/// must hold, and the sender's QPN.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Deth {
    pub qkey: u32,
    pub src_qpn: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AtomicEth {
    pub va: u64,
    pub rkey: u32,
    pub swap_add: u64,
    pub compare: u64,
}

/// NAK codes carried in the AETH syndrome (bits 4..0 when bits 6..5 are 11).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NakCode {
    PsnSeqError = 0,
    InvalidRequest = 1,
    RemoteAccessError = 2,
    RemoteOpError = 3,
    InvalidRdRequest = 4,
}

/// The meaning of an AETH syndrome.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Syndrome {
    /// Positive ACK with credit count (0x1f = credits not used).
    Ack(u8),
    /// Receiver not ready, with the 5-bit IB timer code.
    RnrNak(u8),
    Nak(NakCode),
    /// A syndrome we do not understand (reserved values).
    Reserved(u8),
}

impl Syndrome {
    pub fn to_u8(self) -> u8 {
        match self {
            Syndrome::Ack(c) => c & 0x1f,
            Syndrome::RnrNak(t) => 0x20 | (t & 0x1f),
            Syndrome::Nak(c) => 0x60 | c as u8,
            Syndrome::Reserved(v) => v,
        }
    }
    pub fn from_u8(v: u8) -> Syndrome {
        match (v >> 5) & 3 {
            0 => Syndrome::Ack(v & 0x1f),
            1 => Syndrome::RnrNak(v & 0x1f),
            3 => match v & 0x1f {
                0 => Syndrome::Nak(NakCode::PsnSeqError),
                1 => Syndrome::Nak(NakCode::InvalidRequest),
                2 => Syndrome::Nak(NakCode::RemoteAccessError),
                3 => Syndrome::Nak(NakCode::RemoteOpError),
                4 => Syndrome::Nak(NakCode::InvalidRdRequest),
                _ => Syndrome::Reserved(v),
            },
            _ => Syndrome::Reserved(v),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Aeth {
    pub syndrome: Syndrome,
    pub msn: u32,
}

/// IB RNR timer table (code -> microseconds), IBTA table 45.
pub fn rnr_timer_us(code: u8) -> u64 {
    const T: [u64; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920, 2560, 3840, 5120, 7680, 10_240, 15_360, 20_480,
        30_720, 40_960, 61_440, 81_920, 122_880, 163_840, 245_760, 327_680, 491_520,
    ];
    T[(code & 31) as usize]
}

/// Local ACK timeout: 4.096 us * 2^timeout; 0 means infinite (None).
pub fn ack_timeout_us(timeout: u8) -> Option<u64> {
    if timeout == 0 {
        None
    } else {
        Some((4096u64 << timeout.min(31)) / 1000)
    }
}

/// A parsed packet borrowing its payload from the receive buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Packet<'a> {
    pub bth: Bth,
    pub reth: Option<Reth>,
    pub imm: Option<u32>,
    pub aeth: Option<Aeth>,
    pub atomic: Option<AtomicEth>,
    pub atomic_ack: Option<u64>,
    pub ieth: Option<u32>,
    pub deth: Option<Deth>,
    pub payload: &'a [u8],
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("packet too short")]
    Short,
    #[error("unknown or unsupported opcode {0:#x}")]
    Opcode(u8),
    #[error("unsupported transport header version {0}")]
    Version(u8),
    #[error("bad ICRC")]
    Icrc,
    #[error("pad count larger than payload")]
    Pad,
    #[error("payload on an opcode that has none")]
    UnexpectedPayload,
}

/// Addresses of the IPv4/UDP headers around a packet; the ICRC covers them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Flow {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub sport: u16,
    pub dport: u16,
}

/// RoCEv2 source port for a QP: real NICs spread flows by QPN over 0xC000..=0xFFFF.
pub fn source_port_for_qpn(qpn: u32) -> u16 {
    let h = qpn.wrapping_mul(0x9e37_79b1) >> 18;
    0xc000 | (h as u16 & 0x3fff)
}

fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}
fn be24(b: &[u8]) -> u32 {
    u32::from_be_bytes([0, b[0], b[1], b[2]])
}
fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}
fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
}

/// Computes the ICRC of a RoCEv2 UDP payload (`pkt` excludes the ICRC itself).
///
/// We only see UDP payloads, so the IPv4 and UDP headers are rebuilt from the
/// flow with the annex's masked fields (TOS, TTL, IP checksum, UDP checksum all
/// ones) and our sockets' fixed IP id 0 with DF set. The CRC starts from 8 bytes of
/// ones standing for the masked LRH, and BTH byte 4 (resv8a) is masked too.
pub fn icrc(flow: &Flow, pkt: &[u8]) -> u32 {
    icrc_with_ip_id(flow, pkt, 0)
}

/// The ICRC for a packet that leaves with IP id `ip_id`: segment k of a UDP
/// GSO batch of DF packets gets id k from the kernel's segmentation (the
/// first gets 0), so a batched packet carries the ICRC for its own id and is
/// valid RoCEv2 on the wire.
pub fn icrc_with_ip_id(flow: &Flow, pkt: &[u8], ip_id: u16) -> u32 {
    icrc_of_parts(flow, pkt, &[], ip_id)
}

/// The ICRC of a packet whose bytes (without the ICRC) are `head` then
/// each of `rest`; `head` holds at least the BTH unless `rest` is empty. A
/// packet sent from several places (headers in a buffer, payload in a
/// memory region) is covered without first copying it into one.
pub fn icrc_of_parts(flow: &Flow, head: &[u8], rest: &[&[u8]], ip_id: u16) -> u32 {
    debug_assert!(rest.is_empty() || head.len() >= BTH_LEN);
    let pkt = head;
    let udp_len = (8 + head.len() + rest.iter().map(|r| r.len()).sum::<usize>() + ICRC_LEN) as u16;
    let mut h = crc32fast::Hasher::new_with_initial(pseudo_header_crc(flow, udp_len, ip_id));
    let n = BTH_LEN.min(pkt.len());
    let mut bth = [0u8; BTH_LEN];
    bth[..n].copy_from_slice(&pkt[..n]);
    bth[4] = 0xff; // resv8a
    h.update(&bth[..n]);
    if pkt.len() > BTH_LEN {
        h.update(&pkt[BTH_LEN..]);
    }
    for r in rest {
        h.update(r);
    }
    h.finalize()
}

/// Bytes the ICRC covers before the BTH: 8 of ones for the masked LRH,
/// the IPv4 and the UDP header.
const PSEUDO_HEADER_LEN: usize = 8 + 20 + 8;

/// The CRC of the masked LRH, IPv4 and UDP headers of a packet of `flow`
/// with `udp_len` and `ip_id`, from a small per-thread cache: a stream's
/// packets share all of it, and computing these 36 bytes for every packet
/// cost as much as a few hundred bytes of payload (a table CRC per byte,
/// not the vector path).
fn pseudo_header_crc(flow: &Flow, udp_len: u16, ip_id: u16) -> u32 {
    type Key = (Ipv4Addr, Ipv4Addr, u16, u16, u16, u16);
    const WAYS: usize = 16;
    thread_local! {
        static CACHE: [std::cell::Cell<Option<(Key, u32)>>; WAYS] = const { [const { std::cell::Cell::new(None) }; WAYS] };
    }
    let key: Key = (flow.src, flow.dst, flow.sport, flow.dport, udp_len, ip_id);
    let way = (u32::from(flow.sport) ^ u32::from(flow.src) ^ u32::from(udp_len).rotate_left(4) ^ u32::from(ip_id)) as usize % WAYS;
    CACHE.with(|c| match c[way].get() {
        Some((k, crc)) if k == key => crc,
        _ => {
            let crc = crc32fast::hash(&pseudo_header(flow, udp_len, ip_id));
            c[way].set(Some((key, crc)));
            crc
        }
    })
}

/// The masked LRH, IPv4 and UDP headers as the ICRC sees them (RoCEv2
/// annex: TOS, TTL and both checksums all ones).
fn pseudo_header(flow: &Flow, udp_len: u16, ip_id: u16) -> [u8; PSEUDO_HEADER_LEN] {
    let ip_len = 20 + udp_len;
    let mut ph = [0u8; PSEUDO_HEADER_LEN];
    ph[..8].fill(0xff);
    let ip = &mut ph[8..28];
    ip[0] = 0x45;
    ip[1] = 0xff; // TOS masked
    ip[2..4].copy_from_slice(&ip_len.to_be_bytes());
    ip[4..6].copy_from_slice(&ip_id.to_be_bytes()); // 0 for DF packets from unconnected sockets
    ip[6..8].copy_from_slice(&0x4000u16.to_be_bytes()); // DF
    ip[8] = 0xff; // TTL masked
    ip[9] = 17;
    ip[10..12].copy_from_slice(&[0xff, 0xff]); // checksum masked
    ip[12..16].copy_from_slice(&flow.src.octets());
    ip[16..20].copy_from_slice(&flow.dst.octets());
    let udp = &mut ph[28..36];
    udp[0..2].copy_from_slice(&flow.sport.to_be_bytes());
    udp[2..4].copy_from_slice(&flow.dport.to_be_bytes());
    udp[4..6].copy_from_slice(&udp_len.to_be_bytes());
    udp[6..8].copy_from_slice(&[0xff, 0xff]); // checksum masked
    ph
}

/// What changing the IP id from 0 to `ip_id` does to the ICRC of a packet
/// of `len` bytes (without its ICRC). The CRC is linear over GF(2), so this
/// does not depend on the packet's contents: ICRC(id) = ICRC(id 0) ^
/// delta(len, id), and delta is the XOR of one column per set bit of the id.
pub fn ip_id_delta(len: usize, ip_id: u16) -> u32 {
    with_ip_id_solver(len, |s| s.delta(ip_id))
}

/// Which IP id turns an ICRC mismatch `diff` (received ^ computed for id 0)
/// into a match, if any. Senders whose IP ids we cannot see through a UDP
/// socket: our own GSO segments (ids 1..), and stacks that number every
/// datagram, such as Linux's soft-RoCE (rdma_rxe), whose ids look random.
fn ip_id_for_delta(len: usize, diff: u32) -> Option<u16> {
    with_ip_id_solver(len, |s| s.solve(diff))
}

/// The ICRC's dependence on the 16 IP id bits for one packet length, as a
/// linear map from 16 to 32 bits, with an echelon basis to invert it. A
/// CRC-32 tells apart all error patterns of up to 32 bits, so the map is
/// one-to-one and every diff has at most one id.
struct IpIdSolver {
    /// columns[i]: the ICRC delta of id bit i.
    columns: [u32; 16],
    /// (vector, which id bits XOR to it), distinct leading bits, highest first.
    basis: Vec<(u32, u16)>,
}

impl IpIdSolver {
    fn new(len: usize) -> IpIdSolver {
        let zeros = vec![0u8; len];
        let f0 = Flow { src: Ipv4Addr::UNSPECIFIED, dst: Ipv4Addr::UNSPECIFIED, sport: 0, dport: 0 };
        let base = icrc_with_ip_id(&f0, &zeros, 0);
        let mut columns = [0u32; 16];
        for (i, c) in columns.iter_mut().enumerate() {
            *c = icrc_with_ip_id(&f0, &zeros, 1 << i) ^ base;
        }
        let mut basis: Vec<(u32, u16)> = Vec::with_capacity(16);
        for (i, &c) in columns.iter().enumerate() {
            let (v, m) = Self::reduce(&basis, c, 1 << i);
            if v != 0 {
                basis.push((v, m));
                basis.sort_by_key(|b| b.0.leading_zeros());
            }
        }
        IpIdSolver { columns, basis }
    }

    /// Clears from `v` every leading bit the basis has, tracking the id bits used.
    fn reduce(basis: &[(u32, u16)], mut v: u32, mut mask: u16) -> (u32, u16) {
        for &(b, bm) in basis {
            if v & (1 << (31 - b.leading_zeros())) != 0 {
                v ^= b;
                mask ^= bm;
            }
        }
        (v, mask)
    }

    fn delta(&self, ip_id: u16) -> u32 {
        (0..16).filter(|i| ip_id & (1 << i) != 0).fold(0, |d, i| d ^ self.columns[i])
    }

    fn solve(&self, diff: u32) -> Option<u16> {
        match Self::reduce(&self.basis, diff, 0) {
            (0, id) if id != 0 => Some(id),
            _ => None,
        }
    }
}

fn with_ip_id_solver<R>(len: usize, f: impl FnOnce(&IpIdSolver) -> R) -> R {
    thread_local! {
        // Looked up for every packet of a received GSO batch but its first
        // (and every segment of a sent one): the last length's solver
        // first, then a cheap hash, not the default SipHash. Solvers are
        // never removed, so a pointer to one stays valid.
        static SOLVERS: std::cell::RefCell<rustc_hash::FxHashMap<usize, Box<IpIdSolver>>> = Default::default();
        static LAST: std::cell::Cell<(usize, *const IpIdSolver)> = const { std::cell::Cell::new((usize::MAX, std::ptr::null())) };
    }
    let (last_len, last) = LAST.with(|l| l.get());
    if last_len == len {
        // SAFETY: a boxed solver of SOLVERS, which never drops one.
        return f(unsafe { &*last });
    }
    let s: *const IpIdSolver = SOLVERS.with(|t| &**t.borrow_mut().entry(len).or_insert_with(|| Box::new(IpIdSolver::new(len))) as *const _);
    LAST.with(|l| l.set((len, s)));
    // SAFETY: as above.
    f(unsafe { &*s })
}

/// Parses and validates one UDP payload. `flow` enables the ICRC check.
pub fn parse<'a>(buf: &'a [u8], flow: Option<&Flow>) -> Result<Packet<'a>, ParseError> {
    if buf.len() < BTH_LEN + ICRC_LEN {
        return Err(ParseError::Short);
    }
    let (body, crc) = buf.split_at(buf.len() - ICRC_LEN);
    if let Some(f) = flow {
        let diff = icrc(f, body) ^ u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]);
        // Sealed for an IP id other than 0: we see only the UDP payload, not
        // the id it had on the wire, so solve for it.
        if diff != 0 && ip_id_for_delta(body.len(), diff).is_none() {
            return Err(ParseError::Icrc);
        }
    }
    let opcode = Opcode::from_u8(body[0]).ok_or(ParseError::Opcode(body[0]))?;
    let tver = body[1] & 0x0f;
    if tver != 0 {
        return Err(ParseError::Version(tver));
    }
    let bth = Bth {
        opcode,
        solicited: body[1] & 0x80 != 0,
        mig_req: body[1] & 0x40 != 0,
        pad: (body[1] >> 4) & 3,
        pkey: be16(&body[2..4]),
        dest_qpn: be24(&body[5..8]),
        ack_req: body[8] & 0x80 != 0,
        psn: be24(&body[9..12]),
        resv6: body[4] & 0x3f,
    };
    let mut p = Packet { bth, reth: None, imm: None, aeth: None, atomic: None, atomic_ack: None, ieth: None, deth: None, payload: &[] };
    let mut off = BTH_LEN;
    let need = |off: usize, n: usize| if body.len() < off + n { Err(ParseError::Short) } else { Ok(()) };
    if opcode.has_deth() {
        need(off, DETH_LEN)?;
        p.deth = Some(Deth { qkey: be32(&body[off..]), src_qpn: be24(&body[off + 5..]) });
        off += DETH_LEN;
    }
    if opcode.has_reth() {
        need(off, RETH_LEN)?;
        p.reth = Some(Reth { va: be64(&body[off..]), rkey: be32(&body[off + 8..]), len: be32(&body[off + 12..]) });
        off += RETH_LEN;
    }
    if opcode.has_atomic_eth() {
        need(off, ATOMIC_ETH_LEN)?;
        p.atomic = Some(AtomicEth {
            va: be64(&body[off..]),
            rkey: be32(&body[off + 8..]),
            swap_add: be64(&body[off + 12..]),
            compare: be64(&body[off + 20..]),
        });
        off += ATOMIC_ETH_LEN;
    }
    if opcode.has_aeth() {
        need(off, AETH_LEN)?;
        p.aeth = Some(Aeth { syndrome: Syndrome::from_u8(body[off]), msn: be24(&body[off + 1..]) });
        off += AETH_LEN;
    }
    if opcode.has_atomic_ack() {
        need(off, ATOMIC_ACK_ETH_LEN)?;
        p.atomic_ack = Some(be64(&body[off..]));
        off += ATOMIC_ACK_ETH_LEN;
    }
    if opcode.has_imm() {
        need(off, IMM_LEN)?;
        p.imm = Some(be32(&body[off..]));
        off += IMM_LEN;
    }
    if opcode.has_ieth() {
        need(off, IETH_LEN)?;
        p.ieth = Some(be32(&body[off..]));
        off += IETH_LEN;
    }
    let rest = &body[off..];
    let pad = bth.pad as usize;
    if rest.len() < pad {
        return Err(ParseError::Pad);
    }
    let payload = &rest[..rest.len() - pad];
    if !opcode.has_payload() && !rest.is_empty() {
        return Err(ParseError::UnexpectedPayload);
    }
    p.payload = payload;
    Ok(p)
}

/// Header fields of a packet to build (payload supplied separately).
#[derive(Clone, Copy, Debug)]
pub struct Headers {
    pub bth: Bth,
    pub reth: Option<Reth>,
    pub imm: Option<u32>,
    pub aeth: Option<Aeth>,
    pub atomic: Option<AtomicEth>,
    pub atomic_ack: Option<u64>,
    pub ieth: Option<u32>,
    pub deth: Option<Deth>,
}

impl Headers {
    pub fn new(opcode: Opcode, dest_qpn: u32, psn: u32) -> Headers {
        Headers {
            bth: Bth { opcode, solicited: false, mig_req: false, pad: 0, pkey: DEFAULT_PKEY, dest_qpn, ack_req: false, psn, resv6: 0 },
            reth: None,
            imm: None,
            aeth: None,
            atomic: None,
            atomic_ack: None,
            ieth: None,
            deth: None,
        }
    }

    /// Writes BTH and extension headers into `out`, returns the length. The BTH
    /// pad count is derived from `payload_len`.
    pub fn write(&self, payload_len: usize, out: &mut [u8]) -> usize {
        let b = &self.bth;
        let pad = ((4 - (payload_len & 3)) & 3) as u8;
        out[0] = b.opcode as u8;
        out[1] = (b.solicited as u8) << 7 | (b.mig_req as u8) << 6 | pad << 4;
        out[2..4].copy_from_slice(&b.pkey.to_be_bytes());
        out[4] = b.resv6 & 0x3f;
        out[5..8].copy_from_slice(&(b.dest_qpn & QPN_MASK).to_be_bytes()[1..]);
        out[8] = (b.ack_req as u8) << 7;
        out[9..12].copy_from_slice(&(b.psn & PSN_MASK).to_be_bytes()[1..]);
        let mut off = BTH_LEN;
        if let Some(d) = self.deth {
            out[off..off + 4].copy_from_slice(&d.qkey.to_be_bytes());
            out[off + 4] = 0;
            out[off + 5..off + 8].copy_from_slice(&(d.src_qpn & QPN_MASK).to_be_bytes()[1..]);
            off += DETH_LEN;
        }
        if let Some(r) = self.reth {
            out[off..off + 8].copy_from_slice(&r.va.to_be_bytes());
            out[off + 8..off + 12].copy_from_slice(&r.rkey.to_be_bytes());
            out[off + 12..off + 16].copy_from_slice(&r.len.to_be_bytes());
            off += RETH_LEN;
        }
        if let Some(a) = self.atomic {
            out[off..off + 8].copy_from_slice(&a.va.to_be_bytes());
            out[off + 8..off + 12].copy_from_slice(&a.rkey.to_be_bytes());
            out[off + 12..off + 20].copy_from_slice(&a.swap_add.to_be_bytes());
            out[off + 20..off + 28].copy_from_slice(&a.compare.to_be_bytes());
            off += ATOMIC_ETH_LEN;
        }
        if let Some(a) = self.aeth {
            out[off] = a.syndrome.to_u8();
            out[off + 1..off + 4].copy_from_slice(&(a.msn & 0xff_ffff).to_be_bytes()[1..]);
            off += AETH_LEN;
        }
        if let Some(v) = self.atomic_ack {
            out[off..off + 8].copy_from_slice(&v.to_be_bytes());
            off += ATOMIC_ACK_ETH_LEN;
        }
        if let Some(i) = self.imm {
            out[off..off + 4].copy_from_slice(&i.to_be_bytes());
            off += IMM_LEN;
        }
        if let Some(k) = self.ieth {
            out[off..off + 4].copy_from_slice(&k.to_be_bytes());
            off += IETH_LEN;
        }
        off
    }
}

/// Appends pad and ICRC after headers+payload already in `buf[..len]`;
/// returns the final length.
pub fn finish(flow: &Flow, buf: &mut [u8], len: usize, payload_len: usize) -> usize {
    let pad = (4 - (payload_len & 3)) & 3;
    buf[len..len + pad].fill(0);
    let body = len + pad;
    let c = icrc(flow, &buf[..body]);
    buf[body..body + 4].copy_from_slice(&c.to_le_bytes());
    body + 4
}

/// Finishes a packet whose payload stays where it is (`payload`, sent as an
/// iovec of its own): headers are in `buf[..hdr_len]`; pad and ICRC, over
/// the headers and the payload as they are now, go to
/// `buf[hdr_len..hdr_len + tail]`. Returns `tail` (pad + 4 bytes).
pub fn finish_apart(flow: &Flow, buf: &mut [u8], hdr_len: usize, payload: &[u8]) -> usize {
    let pad = (4 - (payload.len() & 3)) & 3;
    let c = icrc_of_parts(flow, &buf[..hdr_len], &[payload, &[0u8; 3][..pad]], 0);
    buf[hdr_len..hdr_len + pad].fill(0);
    buf[hdr_len + pad..hdr_len + pad + ICRC_LEN].copy_from_slice(&c.to_le_bytes());
    pad + ICRC_LEN
}

/// Recomputes the ICRC of a finished packet (`pkt` includes its ICRC) for
/// another flow: a packet that must leave from another source port than the
/// one it was built for stays valid.
pub fn reseal(flow: &Flow, pkt: &mut [u8]) {
    if pkt.len() < BTH_LEN + ICRC_LEN {
        return;
    }
    let body = pkt.len() - ICRC_LEN;
    let c = icrc(flow, &pkt[..body]);
    pkt[body..].copy_from_slice(&c.to_le_bytes());
}

/// Builds a complete packet into a fresh vector (tests, tools; the engine
/// builds into pooled buffers with `Headers::write` + `finish`).
pub fn build(flow: &Flow, h: &Headers, payload: &[u8]) -> Vec<u8> {
    let mut buf = vec![0u8; MAX_HDR_LEN + payload.len() + 8];
    let n = h.write(payload.len(), &mut buf);
    buf[n..n + payload.len()].copy_from_slice(payload);
    let len = finish(flow, &mut buf, n + payload.len(), payload.len());
    buf.truncate(len);
    buf
}

pub fn psn_add(psn: u32, n: u32) -> u32 {
    psn.wrapping_add(n) & PSN_MASK
}

/// Signed distance a - b in the 24-bit PSN space.
pub fn psn_diff(a: u32, b: u32) -> i32 {
    ((a.wrapping_sub(b) << 8) as i32) >> 8
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flow() -> Flow {
        Flow { src: Ipv4Addr::new(10, 0, 0, 1), dst: Ipv4Addr::new(10, 0, 0, 2), sport: 0xc123, dport: ROCE_PORT }
    }

    #[test]
    fn roundtrip_every_header_kind() {
        let f = flow();
        let mut h = Headers::new(Opcode::WriteOnlyImm, 0x123456, 0xabcdef);
        h.reth = Some(Reth { va: 0x1122334455667788, rkey: 0xdeadbeef, len: 5 });
        h.imm = Some(0x01020304);
        h.bth.ack_req = true;
        h.bth.solicited = true;
        let b = build(&f, &h, b"hello");
        assert_eq!(b.len(), 12 + 16 + 4 + 5 + 3 + 4);
        let p = parse(&b, Some(&f)).unwrap();
        assert_eq!(p.bth.opcode, Opcode::WriteOnlyImm);
        assert_eq!(p.bth.dest_qpn, 0x123456);
        assert_eq!(p.bth.psn, 0xabcdef);
        assert!(p.bth.ack_req && p.bth.solicited);
        assert_eq!(p.bth.pad, 3);
        assert_eq!(p.reth, h.reth);
        assert_eq!(p.imm, Some(0x01020304));
        assert_eq!(p.payload, b"hello");

        let mut a = Headers::new(Opcode::AtomicAck, 7, 9);
        a.aeth = Some(Aeth { syndrome: Syndrome::Ack(0x1f), msn: 77 });
        a.atomic_ack = Some(42);
        let b = build(&f, &a, &[]);
        let p = parse(&b, Some(&f)).unwrap();
        assert_eq!(p.aeth, a.aeth);
        assert_eq!(p.atomic_ack, Some(42));

        let mut c = Headers::new(Opcode::CompareSwap, 7, 9);
        c.atomic = Some(AtomicEth { va: 8, rkey: 3, swap_add: 5, compare: 6 });
        let p2 = build(&f, &c, &[]);
        assert_eq!(parse(&p2, Some(&f)).unwrap().atomic, c.atomic);

        let mut i = Headers::new(Opcode::SendOnlyInv, 7, 9);
        i.ieth = Some(0x55);
        let p3 = build(&f, &i, b"x");
        let q = parse(&p3, Some(&f)).unwrap();
        assert_eq!(q.ieth, Some(0x55));
        assert_eq!(q.payload, b"x");
    }

    /// A packet finished with its payload apart (sent in place) carries
    /// the same pad and ICRC as one built whole, for every pad length.
    #[test]
    fn a_payload_apart_is_sealed_as_if_whole() {
        let f = flow();
        let mut h = Headers::new(Opcode::WriteFirst, 3, 77);
        h.reth = Some(Reth { va: 0x1000, rkey: 9, len: 4096 });
        for plen in [1024usize, 1025, 1026, 1027] {
            let payload: Vec<u8> = (0..plen).map(|i| (i * 7) as u8).collect();
            let whole = build(&f, &h, &payload);
            let mut buf = vec![0u8; MAX_HDR_LEN + 8];
            let n = h.write(plen, &mut buf);
            let tail = finish_apart(&f, &mut buf, n, &payload);
            assert_eq!(n + plen + tail, whole.len());
            assert_eq!(buf[..n], whole[..n]);
            assert_eq!(buf[n..n + tail], whole[n + plen..]);
        }
    }

    /// The ICRC as the RoCEv2 annex defines it, computed the slow way:
    /// the whole masked pseudo packet assembled, then one CRC over it.
    fn reference_icrc(f: &Flow, body: &[u8], ip_id: u16) -> u32 {
        let udp_len = (8 + body.len() + ICRC_LEN) as u16;
        let mut v = vec![0xffu8; 8];
        v.extend_from_slice(&[0x45, 0xff]);
        v.extend_from_slice(&(20 + udp_len).to_be_bytes());
        v.extend_from_slice(&ip_id.to_be_bytes());
        v.extend_from_slice(&[0x40, 0x00, 0xff, 17, 0xff, 0xff]);
        v.extend_from_slice(&f.src.octets());
        v.extend_from_slice(&f.dst.octets());
        v.extend_from_slice(&f.sport.to_be_bytes());
        v.extend_from_slice(&f.dport.to_be_bytes());
        v.extend_from_slice(&udp_len.to_be_bytes());
        v.extend_from_slice(&[0xff, 0xff]);
        let at = v.len();
        v.extend_from_slice(body);
        if body.len() > 4 {
            v[at + 4] = 0xff;
        }
        crc32fast::hash(&v)
    }

    fn test_bytes(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 + i / 251) as u8).collect()
    }

    /// Known answers, computed independently (Python's zlib.crc32 over the
    /// assembled pseudo packet), for aligned and unaligned lengths and a
    /// non-zero IP id; then the fast paths (cached pseudo-header CRC, a
    /// payload apart, the IP id delta) against the slow reference over
    /// every length up to 80 bytes and around 1 KiB and 4 KiB, for flows
    /// that collide in the pseudo-header cache.
    #[test]
    fn icrc_known_answers_and_fast_paths() {
        let f = flow();
        let bth = [0x04, 0x00, 0xff, 0xff, 0x00, 0x00, 0x00, 0x01, 0x80, 0x00, 0x00, 0x01];
        for (plen, ip_id, want) in
            [(4usize, 0u16, 0x12f2_f939u32), (1, 0, 0x7dcf_b70b), (1027, 0, 0xf18f_3b2b), (4099, 0, 0xc8b7_47b3), (4096, 7, 0x5dea_906e)]
        {
            let mut body = bth.to_vec();
            body.extend_from_slice(&test_bytes(plen));
            assert_eq!(icrc_with_ip_id(&f, &body, ip_id), want, "payload {plen}, IP id {ip_id}");
            assert_eq!(reference_icrc(&f, &body, ip_id), want);
        }
        let flows: Vec<Flow> = (0..40u16)
            .map(|k| Flow {
                src: Ipv4Addr::new(10, 0, 0, 1 + (k % 3) as u8),
                dst: Ipv4Addr::new(10, 0, 1, 2),
                sport: 0xc000 + k * 17,
                dport: ROCE_PORT,
            })
            .collect();
        let lens = (0..80).chain(1020..1030).chain(4090..4112);
        for (i, len) in lens.enumerate() {
            let body = test_bytes(len);
            for (j, g) in flows.iter().enumerate().filter(|(j, _)| (i + j) % 7 == 0) {
                let id = if j % 2 == 0 { 0 } else { (i * 31 + j) as u16 };
                let want = reference_icrc(g, &body, id);
                assert_eq!(icrc_with_ip_id(g, &body, id), want, "len {len}, flow {j}, IP id {id}");
                assert_eq!(icrc(g, &body) ^ ip_id_delta(len, id), want, "len {len}: delta for IP id {id}");
                if len >= BTH_LEN {
                    for cut in [BTH_LEN, BTH_LEN + 1, (len + BTH_LEN) / 2, len].into_iter().filter(|&c| c <= len) {
                        let (head, rest) = body.split_at(cut);
                        let (r1, r2) = rest.split_at(rest.len() / 3);
                        assert_eq!(icrc_of_parts(g, head, &[r1, r2], id), want, "len {len} cut {cut}");
                    }
                }
            }
        }
    }

    #[test]
    fn icrc_detects_corruption_and_flow_change() {
        let f = flow();
        let h = Headers::new(Opcode::SendOnly, 1, 1);
        let mut b = build(&f, &h, &[1, 2, 3, 4]);
        assert!(parse(&b, Some(&f)).is_ok());
        let mut g = f;
        g.sport ^= 1;
        assert_eq!(parse(&b, Some(&g)), Err(ParseError::Icrc));
        b[13] ^= 0x40;
        assert_eq!(parse(&b, Some(&f)), Err(ParseError::Icrc));
        // resv8a is masked: changing it keeps the ICRC valid.
        b[13] ^= 0x40;
        b[4] = 0xc0;
        assert!(parse(&b, Some(&f)).is_ok());
        // So is the responder's hold in its six low bits.
        b[4] = 0xc0 | encode_hold(17_900);
        assert_eq!(parse(&b, Some(&f)).map(|p| decode_hold(p.bth.resv6)), Ok(17_000));
        assert_eq!(encode_hold(999), 0);
        assert_eq!(decode_hold(encode_hold(10_000_000)), 63_000);
        b[4] = 0xc0;
        // Sealed for GSO segment 5 (IP id 5): still accepted; the delta is
        // what a full recomputation gives.
        let mut h5 = b.clone();
        let body = h5.len() - 4;
        let c5 = icrc_with_ip_id(&f, &h5[..body], 5);
        assert_eq!(c5, icrc(&f, &h5[..body]) ^ ip_id_delta(body, 5));
        h5[body..].copy_from_slice(&c5.to_le_bytes());
        assert!(parse(&h5, Some(&f)).is_ok());
        // Sealed for any other IP id, as Linux's soft-RoCE numbers its
        // datagrams: the id is solved for, and a corrupted one still fails.
        for id in [1u16, 0x8000, 0x1234, 0xbeef, 0xffff] {
            let mut hx = b.clone();
            let cx = icrc_with_ip_id(&f, &hx[..body], id);
            assert_eq!(cx, icrc(&f, &hx[..body]) ^ ip_id_delta(body, id));
            hx[body..].copy_from_slice(&cx.to_le_bytes());
            assert_eq!(ip_id_for_delta(body, icrc(&f, &hx[..body]) ^ cx), Some(id));
            assert!(parse(&hx, Some(&f)).is_ok());
            hx[13] ^= 0x01;
            assert_eq!(parse(&hx, Some(&f)), Err(ParseError::Icrc));
        }
        // Resealed for another source port, it is valid for that port only.
        reseal(&g, &mut b);
        assert!(parse(&b, Some(&g)).is_ok());
        assert_eq!(parse(&b, Some(&f)), Err(ParseError::Icrc));
    }

    #[test]
    fn syndrome_codes() {
        for s in [
            Syndrome::Ack(0x1f),
            Syndrome::RnrNak(14),
            Syndrome::Nak(NakCode::PsnSeqError),
            Syndrome::Nak(NakCode::RemoteAccessError),
            Syndrome::Nak(NakCode::RemoteOpError),
            Syndrome::Nak(NakCode::InvalidRequest),
        ] {
            assert_eq!(Syndrome::from_u8(s.to_u8()), s);
        }
        assert_eq!(rnr_timer_us(0), 655_360);
        assert_eq!(rnr_timer_us(14), 1280);
        assert_eq!(ack_timeout_us(14), Some(67_108));
    }

    #[test]
    fn opcode_table_is_consistent() {
        for (code, info) in OPCODES.iter().map(|i| (i.opcode as u8, i)) {
            assert_eq!(Opcode::from_u8(code), Some(info.opcode));
            assert_eq!(info.opcode.info(), info);
            // Every header the table names is written and parsed back.
            let mut h = Headers::new(info.opcode, 1, 2);
            h.reth = info.opcode.has_reth().then_some(Reth { va: 1, rkey: 2, len: 3 });
            h.atomic = info.opcode.has_atomic_eth().then_some(AtomicEth { va: 8, rkey: 2, swap_add: 3, compare: 4 });
            h.aeth = info.opcode.has_aeth().then_some(Aeth { syndrome: Syndrome::Ack(0x1f), msn: 5 });
            h.atomic_ack = info.opcode.has_atomic_ack().then_some(6);
            h.imm = info.opcode.has_imm().then_some(7);
            h.ieth = info.opcode.has_ieth().then_some(8);
            h.deth = info.opcode.has_deth().then_some(Deth { qkey: 0x8001_0002, src_qpn: 0xabcdef });
            let mut buf = [0u8; MAX_HDR_LEN];
            assert_eq!(h.write(0, &mut buf), info.header_len(), "{}", info.name);
            let payload: &[u8] = if info.opcode.has_payload() { b"data" } else { b"" };
            let pkt = build(&flow(), &h, payload);
            let p = parse(&pkt, Some(&flow())).unwrap();
            assert_eq!((p.reth, p.atomic, p.aeth, p.atomic_ack, p.imm, p.ieth), (h.reth, h.atomic, h.aeth, h.atomic_ack, h.imm, h.ieth));
            assert_eq!(p.deth, h.deth);
            assert_eq!(p.payload, payload);
        }
        for v in [0x15u8, 0x18, 0x40, 0x63, 0x66, 0xff] {
            assert_eq!(Opcode::from_u8(v), None, "{v:#x}");
        }
        assert_eq!(Opcode::WriteOnlyImm.name(), "RDMA_WRITE_ONLY_WITH_IMMEDIATE");
        assert!(Opcode::SendFirst.starts_message() && !Opcode::SendFirst.ends_message());
        assert!(!Opcode::ReadRespFirst.starts_message() && Opcode::ReadRespOnly.ends_message());
        assert!(Opcode::CompareSwap.is_request() && Opcode::AtomicAck.is_response());
        assert!(Opcode::UdSendOnlyImm.is_ud() && Opcode::UdSendOnly.is_send() && !Opcode::SendOnly.is_ud());
        // UD SEND with immediate: BTH, DETH, ImmDt in that order.
        let mut u = Headers::new(Opcode::UdSendOnlyImm, 0x12, 3);
        u.deth = Some(Deth { qkey: 0x11223344, src_qpn: 0x55 });
        u.imm = Some(0xa0b0c0d0);
        let b = build(&flow(), &u, b"ud");
        assert_eq!(&b[12..24], &[0x11, 0x22, 0x33, 0x44, 0, 0, 0, 0x55, 0xa0, 0xb0, 0xc0, 0xd0]);
    }

    #[test]
    fn psn_arithmetic_wraps() {
        assert_eq!(psn_add(PSN_MASK, 1), 0);
        assert_eq!(psn_diff(0, PSN_MASK), 1);
        assert_eq!(psn_diff(PSN_MASK, 0), -1);
        assert_eq!(psn_diff(5, 3), 2);
    }

    #[test]
    fn source_ports_in_roce_range() {
        for q in 0..5000 {
            assert!(source_port_for_qpn(q) >= 0xc000);
        }
    }
}
