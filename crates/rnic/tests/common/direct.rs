//! Control requests straight to an `Engine` in the test process (no
//! rnicd, no socket): the objects such tests start from, with the memfds
//! their requests carry. The caller keeps the memfds while it uses the
//! objects.

use rnic::engine::Engine;
use rnic::mem::{sealed_memfd, Mapping};
use rnic::objects::ClientId;
use rnic::proto::{Reply, Request};
use rnic::ring::{ring_bytes, Cqe, RecvWqe, Ring, SendWqe, Sge};
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use rnic::types::{access, mask, send_flags, Mtu, QpAttr, QpCap, QpState, QpType};
use rnic::wire::{self, Flow, Headers, Opcode, Packet, Reth, ROCE_PORT};

/// Slots of each ring of a QP made by [`rc_qp`] (and its WRs each way).
pub const QP_DEPTH: u32 = 16;

/// A second descriptor of `fd`: a request takes its memfds by value.
pub fn dup(fd: &OwnedFd) -> OwnedFd {
    // SAFETY: dup of a valid fd; the new one is owned by the result alone.
    unsafe { OwnedFd::from_raw_fd(libc::dup(fd.as_raw_fd())) }
}

/// What READ tests start from: client 1's PD, an MR of `len` bytes at
/// `READ_IOVA` that peers may read (its rkey), and a CQ of 256 entries;
/// the memfds go to `keep`.
pub struct Readable {
    pub pd: u32,
    pub rkey: u32,
    pub cq: u32,
}

/// The I/O address of [`readable`]'s MR.
pub const READ_IOVA: u64 = 0x7000_0000_0000;

pub fn readable(e: &mut Engine, len: u32, keep: &mut Vec<OwnedFd>) -> Readable {
    let Reply::Pd(pd) = e.control(1, Request::AllocPd, vec![]).unwrap() else { panic!("AllocPd answered with another reply") };
    let memfd = sealed_memfd("reads", len as usize).unwrap();
    let req = Request::RegMr { pd, iova: READ_IOVA, len: len.into(), access: access::ALL, fd_offset: 0, key: None };
    let Reply::Mr { rkey, .. } = e.control(1, req, vec![dup(&memfd)]).unwrap() else { panic!("RegMr answered with another reply") };
    keep.push(memfd);
    let (cq, cqfd) = cq(e, 1, 256);
    keep.push(cqfd);
    Readable { pd, rkey, cq }
}

/// `peer` asks each QP of `qpns` (in RTS, expecting `psn`) to READ `len`
/// bytes of [`readable`]'s MR (its rkey `rkey`), each from its own source
/// port.
pub fn ask_reads(e: &mut Engine, peer: Ipv4Addr, qpns: &[u32], psn: u32, rkey: u32, len: u32) {
    let now = std::time::Instant::now();
    for (k, &qpn) in qpns.iter().enumerate() {
        let flow = Flow { src: peer, dst: e.gid, sport: 0xc000 + k as u16, dport: ROCE_PORT };
        let mut h = Headers::new(Opcode::ReadRequest, qpn, psn);
        h.reth = Some(Reth { va: READ_IOVA, rkey, len });
        e.on_packet(&wire::build(&flow, &h, &[]), peer, flow.sport, now);
    }
}

/// A CQ of `cap` entries of client `c`; its ring's memfd.
pub fn cq(e: &mut Engine, c: ClientId, cap: u32) -> (u32, OwnedFd) {
    let fd = sealed_memfd("cq", ring_bytes::<Cqe>(cap)).unwrap();
    let Reply::Cq(cq) = e.control(c, Request::CreateCq { cap, channel: None }, vec![dup(&fd)]).unwrap() else {
        panic!("CreateCq answered with another reply")
    };
    (cq, fd)
}

/// An RC QP of client `c` in RESET, on `pd`, sending and receiving on
/// `cq`: QP_DEPTH WRs each way of `sges` SGEs, `inline` bytes of inline
/// data. Its QPN and its rings' memfds (send, receive).
pub fn rc_qp(e: &mut Engine, c: ClientId, pd: u32, cq: u32, sges: u32, inline: u32) -> (u32, [OwnedFd; 2]) {
    let sq = sealed_memfd("sq", ring_bytes::<SendWqe>(QP_DEPTH)).unwrap();
    let rq = sealed_memfd("rq", ring_bytes::<RecvWqe>(QP_DEPTH)).unwrap();
    let cap = QpCap { max_send_wr: QP_DEPTH, max_recv_wr: QP_DEPTH, max_send_sge: sges, max_recv_sge: sges, max_inline_data: inline };
    let req = Request::CreateQp {
        pd,
        send_cq: cq,
        recv_cq: cq,
        cap,
        sq_sig_all: false,
        sq_slots: QP_DEPTH,
        rq_slots: QP_DEPTH,
        qpn: None,
        restore: None,
        qp_type: QpType::Rc,
    };
    let Reply::Qp { qpn, .. } = e.control(c, req, vec![dup(&sq), dup(&rq)]).unwrap() else {
        panic!("CreateQp answered with another reply")
    };
    (qpn, [sq, rq])
}

/// The path of an RC QP made by [`rts_qp`]: its peer, the PSN it expects
/// first, the path MTU, how many READs or atomics it answers at once, and
/// its IB timeout (0: none, no retransmission timer nor delay signal).
pub struct Path {
    pub peer: Ipv4Addr,
    pub dest_qpn: u32,
    pub rq_psn: u32,
    pub mtu: Mtu,
    pub max_dest_rd_atomic: u8,
    pub timeout: u8,
}

/// An RC QP of client 1 in RTS on `pd` and `cq` (one SGE, no inline data)
/// talking to `path`; its rings' memfds go to `keep`.
pub fn rts_qp(e: &mut Engine, pd: u32, cq: u32, path: &Path, keep: &mut Vec<OwnedFd>) -> u32 {
    let (qpn, rings) = rc_qp(e, 1, pd, cq, 1, 0);
    keep.extend(rings);
    let mut a = QpAttr { qp_state: QpState::Init, qp_access_flags: access::ALL, port_num: 1, ..Default::default() };
    e.control(1, Request::ModifyQp { qpn, attr: a, mask: mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::ACCESS_FLAGS }, vec![])
        .unwrap();
    a.qp_state = QpState::Rtr;
    a.path_mtu = path.mtu;
    a.dest_gid = path.peer;
    a.dest_qp_num = path.dest_qpn;
    a.rq_psn = path.rq_psn;
    a.max_dest_rd_atomic = path.max_dest_rd_atomic;
    let m = mask::STATE | mask::AV | mask::PATH_MTU | mask::DEST_QPN | mask::RQ_PSN | mask::MAX_DEST_RD_ATOMIC | mask::MIN_RNR_TIMER;
    e.control(1, Request::ModifyQp { qpn, attr: a, mask: m }, vec![]).unwrap();
    a.qp_state = QpState::Rts;
    a.timeout = path.timeout;
    let m = mask::STATE | mask::SQ_PSN | mask::TIMEOUT | mask::RETRY_CNT | mask::RNR_RETRY | mask::MAX_QP_RD_ATOMIC;
    e.control(1, Request::ModifyQp { qpn, attr: a, mask: m }, vec![]).unwrap();
    qpn
}

/// The send ring of a QP made by [`rc_qp`], posted to as its client would
/// (the engine finds new WQEs in its next transmit round).
pub struct SendRing {
    ring: Ring<SendWqe>,
    _map: Mapping,
}

impl SendRing {
    /// The ring in `sq`, the QP's send ring memfd.
    pub fn new(sq: &OwnedFd) -> SendRing {
        let len = ring_bytes::<SendWqe>(QP_DEPTH);
        let map = Mapping::map(sq, 0, len).unwrap();
        // SAFETY: the mapping holds `len` bytes and lives as long as the ring.
        let ring = unsafe { Ring::new(map.ptr(), len, QP_DEPTH) }.expect("a ring over the mapping");
        SendRing { ring, _map: map }
    }

    /// Posts `w` (no doorbell).
    pub fn post(&mut self, w: &SendWqe) {
        assert!(self.ring.push(w), "send ring full");
    }

    /// A signaled RDMA WRITE of `len` bytes from [`readable`]'s MR (its
    /// key `key`) to the peer's `remote_addr`/`rkey`.
    pub fn post_write(&mut self, wr_id: u64, key: u32, len: u32, remote_addr: u64, rkey: u32) {
        let mut w = SendWqe { wr_id, opcode: 0, flags: send_flags::SIGNALED, num_sge: 1, remote_addr, rkey, ..Default::default() };
        w.sge[0] = Sge { addr: READ_IOVA, length: len, lkey: key };
        self.post(&w);
    }
}

/// The packets the engine has queued to send, taken from it, each parsed
/// as its receiver would (ICRC included) and mapped by `f`.
pub fn sent<T>(e: &mut Engine, mut f: impl FnMut(&Packet) -> T) -> Vec<T> {
    let gid = e.gid;
    std::mem::take(&mut e.tx.pkts)
        .iter()
        .map(|p| {
            let flow = Flow { src: gid, dst: p.dst, sport: p.sport, dport: ROCE_PORT };
            f(&wire::parse(&p.buf[..p.len], Some(&flow)).expect("rnicd sends valid packets"))
        })
        .collect()
}
