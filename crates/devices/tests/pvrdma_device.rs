//! The PVRDMA device driven the way Linux's vmw_pvrdma drives it, on real
//! guest memory, against real rnicd processes on testbed hosts, with a
//! bare-metal verbs peer on another host. Needs root (network namespaces)
//! and the rnicd binary (`cargo build --release -p rnic`).
mod pvrdma;

use std::time::Duration;

use pvrdma::*;
use pvrdma_abi::ib::{self, wc_opcode, wc_status, wr_opcode};
use pvrdma_abi::*;
use verbs::{RecvWr, SendWr, WcOpcode, WcStatus};

/// Bring-up, every command, and SEND/RECV (with immediate), RDMA WRITE
/// (with immediate), RDMA READ and both atomics between the guest and a
/// bare-metal peer, data checked byte for byte both ways.
#[test]
fn every_command_and_operation_with_a_bare_metal_peer() {
    let bed = Bed::new("pvdev", 2);
    let (gid, mut d) = bed.device();

    // Commands a driver runs at probe and for a user context.
    let bind = CmdCreateBind {
        hdr: Drv::hdr(CMD_CREATE_BIND),
        mtu: 1024,
        vlan: 0xfff,
        index: 0,
        new_gid: Gid::from_ipv4(gid.octets()).raw,
        gid_type: ib::gid_type::ROCE_UDP_ENCAP,
        reserved: [0; 3],
    };
    d.cmd::<_, CmdRespHdr>(bind).unwrap();
    let port: CmdQueryPortResp = d.cmd(CmdQueryPort { hdr: Drv::hdr(CMD_QUERY_PORT), port_num: 1, reserved: [0; 7] }).unwrap();
    assert_eq!(port.attrs.state, ib::port_state::ACTIVE);
    assert!(port.attrs.gid_tbl_len >= 1 && port.attrs.max_mtu == ib::mtu::MTU_4096);
    let pkey: CmdQueryPkeyResp = d.cmd(CmdQueryPkey { hdr: Drv::hdr(CMD_QUERY_PKEY), port_num: 1, index: 0, reserved: [0; 6] }).unwrap();
    assert_eq!(pkey.pkey, 0xffff);
    let uc: CmdCreateUcResp = d.cmd(CmdCreateUc { hdr: Drv::hdr(CMD_CREATE_UC), pfn64: (BAR_BASE >> 12) + 1 }).unwrap();
    let upd: CmdCreatePdResp = d.cmd(CmdCreatePd { hdr: Drv::hdr(CMD_CREATE_PD), ctx_handle: uc.ctx_handle, reserved: [0; 4] }).unwrap();
    d.cmd::<_, CmdRespHdr>(CmdDestroyPd { hdr: Drv::hdr(CMD_DESTROY_PD), pd_handle: upd.pd_handle, reserved: [0; 4] }).unwrap();
    d.cmd::<_, CmdRespHdr>(CmdDestroyUc { hdr: Drv::hdr(CMD_DESTROY_UC), ctx_handle: uc.ctx_handle, reserved: [0; 4] }).unwrap();

    // The objects of one connection.
    let Conn { pd, buf, mr: _mrh, key, mut scq, mut rcq, mut qp } = d.rc_conn(ConnSpec::default());
    let peer = bed.peer_of(&mut d, &qp, gid, 500, 700);
    let a = d.query_qp(&qp);
    assert_eq!(a.qp_state, ib::qp_state::RTS);
    assert_eq!(a.dest_qp_num, peer.qp.qpn);
    assert_eq!(a.ah_attr.grh.dgid.ipv4(), Some(bed.nics[1].addr.octets()));

    // SEND with immediate, guest -> peer, two SGEs.
    let msg = pattern(1, 6000);
    d.put_bytes(buf, &msg);
    peer.qp.post_recv(&[RecvWr { wr_id: 9, sg_list: &[peer.mr.sge(0, 8192)] }]).unwrap();
    let sges = [Sge { addr: buf, length: 2000, lkey: key }, Sge { addr: buf + 2000, length: 4000, lkey: key }];
    d.post_send(&mut qp, SqWqeHdr { ex: 0xdead_beefu32.to_be(), ..sq(101, wr_opcode::SEND_WITH_IMM) }, &sges);
    let c = d.wait_cqes(&mut scq, 1)[0];
    assert_eq!((c.wr_id, c.status, c.opcode, c.qp), (101, wc_status::SUCCESS, wc_opcode::SEND, qp.handle as u64), "{c:?}");
    let w = peer.cq.wait(1, T).unwrap()[0];
    assert_eq!((w.wr_id, w.status, w.opcode, w.byte_len, w.imm_data), (9, WcStatus::Success, WcOpcode::Recv, 6000, 0xdead_beef));
    assert_eq!(peer.buf.read(0, 6000), msg);

    // SEND with immediate, peer -> guest.
    let back = pattern(2, 3000);
    peer.buf.write(100_000, &back);
    d.post_recv(&mut qp, 55, &[Sge { addr: buf + 200_000, length: 4096, lkey: key }]);
    peer.qp.post_send(&[SendWr::send(1, &[peer.mr.sge(100_000, 3000)]).with_imm(0x1234_5678)]).unwrap();
    let c = d.wait_cqes(&mut rcq, 1)[0];
    assert_eq!((c.wr_id, c.status, c.opcode, c.byte_len), (55, wc_status::SUCCESS, wc_opcode::RECV, 3000), "{c:?}");
    assert_eq!(u32::from_be(c.imm_data), 0x1234_5678);
    assert!(c.wc_flags & ib::wc_flags::WITH_IMM != 0);
    assert_eq!(c.src_qp, peer.qp.qpn);
    assert_eq!(d.get_bytes(buf + 200_000, 3000), back);
    peer.cq.wait(1, T).unwrap();

    // RDMA WRITE, guest -> peer, 300 KB.
    let big = pattern(3, 300_000);
    d.put_bytes(buf + 300_000, &big);
    let mut h = sq(102, wr_opcode::RDMA_WRITE);
    h.wr.set_rdma(&WrRdma { remote_addr: peer.mr.addr + 1_000_000, rkey: peer.mr.rkey, reserved: [0; 4] });
    d.post_send(&mut qp, h, &[Sge { addr: buf + 300_000, length: 300_000, lkey: key }]);
    let c = d.wait_cqes(&mut scq, 1)[0];
    assert_eq!((c.wr_id, c.status, c.opcode), (102, wc_status::SUCCESS, wc_opcode::RDMA_WRITE), "{c:?}");
    assert_eq!(peer.buf.read(1_000_000, 300_000), big);

    // RDMA WRITE with immediate, peer -> guest (the guest's rkey and address
    // are what it told the peer: the namespace's own key, identity).
    let w2 = pattern(4, 70_000);
    peer.buf.write(2_000_000, &w2);
    d.post_recv(&mut qp, 56, &[]);
    peer.qp.post_send(&[SendWr::write(2, &[peer.mr.sge(2_000_000, 70_000)], buf + 600_000, key).with_imm(77)]).unwrap();
    let c = d.wait_cqes(&mut rcq, 1)[0];
    assert_eq!((c.wr_id, c.status, c.opcode, c.byte_len), (56, wc_status::SUCCESS, wc_opcode::RECV_RDMA_WITH_IMM, 70_000), "{c:?}");
    assert_eq!(u32::from_be(c.imm_data), 77);
    assert_eq!(d.get_bytes(buf + 600_000, 70_000), w2);
    peer.cq.wait(1, T).unwrap();

    // RDMA READ, guest <- peer.
    let r = pattern(5, 50_000);
    peer.buf.write(3_000_000, &r);
    let mut h = sq(103, wr_opcode::RDMA_READ);
    h.wr.set_rdma(&WrRdma { remote_addr: peer.mr.addr + 3_000_000, rkey: peer.mr.rkey, reserved: [0; 4] });
    d.post_send(&mut qp, h, &[Sge { addr: buf + 700_000, length: 50_000, lkey: key }]);
    let c = d.wait_cqes(&mut scq, 1)[0];
    assert_eq!((c.wr_id, c.status, c.opcode, c.byte_len), (103, wc_status::SUCCESS, wc_opcode::RDMA_READ, 50_000), "{c:?}");
    assert_eq!(d.get_bytes(buf + 700_000, 50_000), r);

    // Peer READs the guest.
    peer.qp.post_send(&[SendWr::read(3, &[peer.mr.sge(3_500_000, 70_000)], buf + 600_000, key)]).unwrap();
    assert_eq!(peer.cq.wait(1, T).unwrap()[0].status, WcStatus::Success);
    assert_eq!(peer.buf.read(3_500_000, 70_000), w2);

    // Atomics on a peer counter: fetch-and-add, then compare-and-swap.
    peer.buf.write_u64(4_000_000, 1000);
    let mut h = sq(104, wr_opcode::ATOMIC_FETCH_AND_ADD);
    h.wr.set_atomic(&WrAtomic { remote_addr: peer.mr.addr + 4_000_000, compare_add: 5, swap: 0, rkey: peer.mr.rkey, reserved: 0 });
    d.post_send(&mut qp, h, &[Sge { addr: buf + 800_000, length: 8, lkey: key }]);
    let c = d.wait_cqes(&mut scq, 1)[0];
    assert_eq!((c.wr_id, c.status, c.opcode), (104, wc_status::SUCCESS, wc_opcode::FETCH_ADD), "{c:?}");
    assert_eq!(d.get::<u64>(buf + 800_000), 1000);
    let mut h = sq(105, wr_opcode::ATOMIC_CMP_AND_SWP);
    h.wr.set_atomic(&WrAtomic { remote_addr: peer.mr.addr + 4_000_000, compare_add: 1005, swap: 42, rkey: peer.mr.rkey, reserved: 0 });
    d.post_send(&mut qp, h, &[Sge { addr: buf + 800_008, length: 8, lkey: key }]);
    let c = d.wait_cqes(&mut scq, 1)[0];
    assert_eq!((c.wr_id, c.status, c.opcode), (105, wc_status::SUCCESS, wc_opcode::COMP_SWAP), "{c:?}");
    assert_eq!(d.get::<u64>(buf + 800_008), 1005);
    assert_eq!(peer.buf.read_u64(4_000_000), 42);

    // Unsignaled WQEs complete silently; the next signaled one reports.
    let mut h = sq(106, wr_opcode::RDMA_WRITE);
    h.send_flags = 0;
    h.wr.set_rdma(&WrRdma { remote_addr: peer.mr.addr, rkey: peer.mr.rkey, reserved: [0; 4] });
    d.put_send(&mut qp, h, &[Sge { addr: buf, length: 100, lkey: key }]);
    let mut h = sq(107, wr_opcode::RDMA_WRITE);
    h.wr.set_rdma(&WrRdma { remote_addr: peer.mr.addr + 100, rkey: peer.mr.rkey, reserved: [0; 4] });
    d.post_send(&mut qp, h, &[Sge { addr: buf + 100, length: 100, lkey: key }]);
    let c = d.wait_cqes(&mut scq, 1)[0];
    assert_eq!(c.wr_id, 107);
    std::thread::sleep(Duration::from_millis(50));
    assert!(d.poll(&mut scq).is_none(), "no CQE for the unsignaled WQE");
    assert_eq!(d.query()["qps"][0]["sq_outstanding"], 0, "both copies dropped");

    // Arming: the notifier posts a CQ notification for the next completion.
    d.doorbell(UAR_CQ_OFFSET, UAR_CQ_ARM | rcq.handle);
    d.post_recv(&mut qp, 57, &[Sge { addr: buf, length: 64, lkey: key }]);
    peer.qp.post_send(&[SendWr::send(4, &[peer.mr.sge(0, 64)])]).unwrap();
    let t0 = std::time::Instant::now();
    loop {
        let tail: u32 = d.get(d.cq_ring + RING_STATE_RX_PROD_TAIL);
        if tail != 0 {
            break;
        }
        assert!(t0.elapsed() < T, "no CQ notification");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(d.get::<Cqne>(d.cq_ring + 4096).info, rcq.handle);
    assert!(d.rd(REG_ICR) & INTR_CAUSE_CQ != 0);
    assert_eq!(d.wait_cqes(&mut rcq, 1)[0].wr_id, 57);
    peer.cq.wait(1, T).unwrap();

    // RESIZE_CQ while empty; then tear down in the driver's order.
    let r: CmdResizeCqResp = d.cmd(CmdResizeCq { hdr: Drv::hdr(CMD_RESIZE_CQ), cq_handle: scq.handle, cqe: 32 }).unwrap();
    assert_eq!(r.cqe, 32);
    scq.entries = 32;
    scq.head = 0;
    let q = d.query();
    assert_eq!(q["objects"]["qps"], 1, "{q}");
    assert_eq!(q["counters"]["cqes"], 9, "six send and three receive completions: {q}");
    let r: CmdDestroyQpResp = d.cmd(CmdDestroyQp { hdr: Drv::hdr(CMD_DESTROY_QP), qp_handle: qp.handle, reserved: [0; 4] }).unwrap();
    assert_eq!(r.events_reported, 0);
    for (cmd, h) in [(CMD_DESTROY_CQ, scq.handle), (CMD_DESTROY_CQ, rcq.handle), (CMD_DESTROY_MR, _mrh), (CMD_DESTROY_PD, pd)] {
        d.cmd::<_, CmdRespHdr>(CmdDestroyCq { hdr: Drv::hdr(cmd), cq_handle: h, reserved: [0; 4] }).unwrap();
    }
    d.cmd::<_, CmdRespHdr>(CmdDestroyBind { hdr: Drv::hdr(CMD_DESTROY_BIND), index: 0, dest_gid: [0; 16], reserved: [0; 4] }).unwrap();
    assert_eq!(d.query()["objects"], serde_json::json!({"contexts": 0, "pds": 0, "mrs": 0, "cqs": 0, "qps": 0, "srqs": 0}));
    d.wr(REG_CTL, DEVICE_CTL_RESET);
    assert_eq!(d.rd(REG_ERR), 0);
}
