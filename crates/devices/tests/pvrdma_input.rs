//! Bad input to the PVRDMA device: every malformed request gets an error
//! status (ERR, the response's err, a CQE status, an async event) and
//! nothing else; a seeded fuzz loop over commands, doorbells and WQEs; two
//! devices with the same QPNs and keys on one rnicd beside each other.
mod pvrdma;

use std::net::Ipv4Addr;

use devices::bus::BusDevice;
use pvrdma::*;
use pvrdma_abi::ib::{self, wc_status, wr_opcode};
use pvrdma_abi::*;
use verbs::{RecvWr, SendWr, WcStatus};

const EPERM: u32 = 1;
const ENOMEM: u8 = 12;
const EFAULT: u8 = 14;
const EINVAL: u8 = 22;
const ENOSYS: u8 = 38;

/// One guest connection to a fresh peer end.
fn connection(d: &mut Drv, bed: &Bed, gid: Ipv4Addr) -> (Conn, Peer) {
    let c = d.rc_conn(ConnSpec::default());
    let peer = bed.peer_of(d, &c.qp, gid, 1, 2);
    (c, peer)
}

/// A WRITE guest -> peer and a SEND peer -> guest, checked byte for byte.
fn round_trip(d: &mut Drv, c: &mut Conn, peer: &Peer, seed: u64) {
    let Conn { qp, scq, rcq, buf, key, .. } = c;
    let (buf, key) = (*buf, *key);
    let data = pattern(seed, 5000);
    d.put_bytes(buf, &data);
    let mut h = sq(seed, wr_opcode::RDMA_WRITE);
    h.wr.set_rdma(&WrRdma { remote_addr: peer.mr.addr, rkey: peer.mr.rkey, reserved: [0; 4] });
    d.post_send(qp, h, &[Sge { addr: buf, length: 5000, lkey: key }]);
    let c = d.wait_cqes(scq, 1)[0];
    assert_eq!((c.wr_id, c.status), (seed, wc_status::SUCCESS), "{c:?}");
    assert_eq!(peer.buf.read(0, 5000), data);
    let back = pattern(seed + 1, 700);
    peer.buf.write(10_000, &back);
    d.post_recv(qp, seed + 1, &[Sge { addr: buf + 8192, length: 4096, lkey: key }]);
    peer.qp.post_send(&[SendWr::send(1, &[peer.mr.sge(10_000, 700)])]).unwrap();
    let c = d.wait_cqes(rcq, 1)[0];
    assert_eq!((c.wr_id, c.status, c.byte_len), (seed + 1, wc_status::SUCCESS, 700), "{c:?}");
    assert_eq!(d.get_bytes(buf + 8192, 700), back);
    assert_eq!(peer.cq.wait(1, T).unwrap()[0].status, WcStatus::Success);
}

#[test]
fn malformed_requests_get_error_statuses_and_harm_nothing() {
    let bed = Bed::new("pvbad", 2);
    let gid = bed.vm_gid(0, 1);
    let mut d = Drv::new(&bed.nics[0].sock, gid);

    // Commands and doorbells before the device is up.
    d.wr(REG_REQUEST, 0);
    assert_eq!(d.rd(REG_ERR), EPERM);
    d.doorbell(UAR_QP_OFFSET, UAR_QP_SEND | 1);
    assert_eq!(d.rd(REG_ERR), EPERM);
    d.wr(REG_CTL, DEVICE_CTL_ACTIVATE);
    assert_eq!(d.rd(REG_ERR), EPERM, "ACTIVATE before a DSR");
    // A DSR outside guest RAM.
    d.wr(REG_DSRLOW, 0);
    d.wr(REG_DSRHIGH, 0x100);
    assert_eq!(d.rd(REG_ERR), EFAULT as u32);
    // A DSR whose event ring directory is outside RAM.
    let dsr = d.alloc(1);
    d.put(dsr, &Dsr { async_ring_pages: RingPageInfo { num_pages: 2, reserved: 0, pdir_dma: RAM + 4096 }, ..Default::default() });
    d.wr(REG_DSRLOW, dsr as u32);
    d.wr(REG_DSRHIGH, 0);
    assert_eq!(d.rd(REG_ERR), EINVAL as u32);
    // Command and response slots outside guest RAM or not whole pages:
    // refused at DSRHIGH, before any command could run without a way to
    // answer it.
    let slot = d.alloc(1);
    for (cmd_slot, resp_slot) in [(slot, RAM + 4096), (slot + 8, slot), (RAM, slot)] {
        d.put(dsr, &Dsr { cmd_slot_dma: cmd_slot, resp_slot_dma: resp_slot, ..Default::default() });
        d.wr(REG_DSRLOW, dsr as u32);
        d.wr(REG_DSRHIGH, 0);
        assert_eq!(d.rd(REG_ERR), EFAULT as u32, "slots {cmd_slot:#x} / {resp_slot:#x}");
        d.wr(REG_CTL, DEVICE_CTL_ACTIVATE);
        assert_eq!(d.rd(REG_ERR), EPERM, "ACTIVATE after a refused DSR");
    }
    d.bring_up();
    d.wr(REG_CTL, DEVICE_CTL_ACTIVATE);
    assert_eq!(d.rd(REG_ERR), EPERM, "ACTIVATE twice");
    d.wr(REG_CTL, 7);
    assert_eq!(d.rd(REG_ERR), EPERM, "unknown CTL value");

    // Unknown commands, an SRQ of no WQEs in no PD, bad handles.
    let (err, _) = d.cmd_raw(&Drv::hdr(99));
    assert_eq!(err, EINVAL as u32);
    assert_eq!(d.cmd::<_, CmdCreateSrqResp>(CmdCreateSrq { hdr: Drv::hdr(CMD_CREATE_SRQ), ..Default::default() }).err(), Some(EINVAL));
    let pd = d.create_pd();
    let bad_pd = CmdCreateMr { hdr: Drv::hdr(CMD_CREATE_MR), pd_handle: 999, flags: MR_FLAG_DMA, ..Default::default() };
    assert_eq!(d.cmd::<_, CmdCreateMrResp>(bad_pd).err(), Some(EINVAL));
    for cmd in [CMD_DESTROY_QP, CMD_DESTROY_CQ, CMD_DESTROY_MR, CMD_DESTROY_PD, CMD_DESTROY_UC, CMD_DESTROY_SRQ, CMD_QUERY_SRQ] {
        assert_eq!(
            d.cmd::<_, CmdRespHdr>(CmdDestroyQp { hdr: Drv::hdr(cmd), qp_handle: 4242, reserved: [0; 4] }).err(),
            Some(EINVAL),
            "cmd {cmd}"
        );
    }
    let m = CmdModifyQp { hdr: Drv::hdr(CMD_MODIFY_QP), qp_handle: 7, attr_mask: 1, attrs: QpAttr::default() };
    assert_eq!(d.cmd::<_, CmdRespHdr>(m).err(), Some(EINVAL));
    assert_eq!(d.cmd::<_, CmdQueryQpResp>(CmdQueryQp { hdr: Drv::hdr(CMD_QUERY_QP), qp_handle: 7, attr_mask: 0 }).err(), Some(EINVAL));
    assert_eq!(
        d.cmd::<_, CmdQueryPortResp>(CmdQueryPort { hdr: Drv::hdr(CMD_QUERY_PORT), port_num: 2, reserved: [0; 7] }).err(),
        Some(EINVAL)
    );

    // Page directories pointing outside guest RAM, at a table outside it,
    // at pages outside it, or unaligned.
    let cq = |pdir: u64| CmdCreateCq { hdr: Drv::hdr(CMD_CREATE_CQ), pdir_dma: pdir, ctx_handle: 0, cqe: 64, nchunks: 2, reserved: [0; 4] };
    assert_eq!(d.cmd::<_, CmdCreateCqResp>(cq(RAM + 8192)).err(), Some(EINVAL));
    assert_eq!(d.cmd::<_, CmdCreateCqResp>(cq(!4095)).err(), Some(EINVAL));
    let dir = d.alloc(1);
    d.put(dir, &(RAM + (1 << 30)));
    assert_eq!(d.cmd::<_, CmdCreateCqResp>(cq(dir)).err(), Some(EFAULT), "table outside RAM");
    let (_, good) = d.region(2);
    let table: u64 = d.get(good);
    d.put(table + 8, &(RAM - 2048));
    assert_eq!(d.cmd::<_, CmdCreateCqResp>(cq(good)).err(), Some(EFAULT), "page outside RAM, unaligned");
    assert_eq!(d.cmd::<_, CmdCreateCqResp>(CmdCreateCq { cqe: 48, ..cq(good) }).err(), Some(EINVAL), "not a power of two");
    // Memory regions over scattered pages: accepted; with a page outside
    // guest RAM or unaligned, longer than its pages, or scattered into more
    // runs than rnicd takes: refused.
    let (a, b) = (d.alloc(1), d.alloc(2) + 4096);
    let pdir = d.pdir(&[a, b]);
    let mr = CmdCreateMr {
        hdr: Drv::hdr(CMD_CREATE_MR),
        start: a,
        length: 8192,
        pdir_dma: pdir,
        pd_handle: pd,
        access_flags: 1,
        flags: 0,
        nchunks: 2,
    };
    assert!(d.cmd::<_, CmdCreateMrResp>(mr).is_ok(), "scattered pages");
    assert_eq!(d.create_mr_pages(pd, &[a, RAM], 0, 8192).err(), Some(EFAULT), "page outside RAM");
    assert_eq!(d.create_mr_pages(pd, &[a, b + 8], 0, 8192).err(), Some(EFAULT), "unaligned page");
    let mr_long = CmdCreateMr { length: 3 * 4096, pdir_dma: d.pdir(&[a, a + 4096]), ..mr };
    assert_eq!(d.cmd::<_, CmdCreateMrResp>(mr_long).err(), Some(EINVAL), "longer than its pages");
    let many: Vec<u64> = (0..=verbs::MAX_REGION_RUNS).map(|i| if i % 2 == 0 { a } else { b }).collect();
    assert_eq!(d.create_mr_pages(pd, &many, 0, many.len() as u64 * 4096).err(), Some(ENOMEM), "too many runs");
    assert!(d.create_mr_pages(pd, &many[..verbs::MAX_REGION_RUNS], 0, 4096 * verbs::MAX_REGION_RUNS as u64).is_ok(), "as many as it takes");
    // QPs of kinds the device does not make, and impossible geometry.
    let scq = d.create_cq(64);
    let qp = |qp_type, wr, sge, chunks| CmdCreateQp {
        hdr: Drv::hdr(CMD_CREATE_QP),
        pdir_dma: dir,
        pd_handle: pd,
        send_cq_handle: scq.handle,
        recv_cq_handle: scq.handle,
        max_send_wr: wr,
        max_recv_wr: wr,
        max_send_sge: sge,
        max_recv_sge: sge,
        total_chunks: chunks,
        send_chunks: 1,
        qp_type,
        ..Default::default()
    };
    assert_eq!(d.cmd::<_, CmdCreateQpRespV2>(qp(ib::qp_type::UD, 8, 1, 3)).err(), Some(ENOSYS));
    assert_eq!(d.cmd::<_, CmdCreateQpRespV2>(qp(ib::qp_type::RC, 8, 9, 3)).err(), Some(EINVAL), "too many SGEs");
    assert_eq!(d.cmd::<_, CmdCreateQpRespV2>(qp(ib::qp_type::RC, 7, 1, 3)).err(), Some(EINVAL), "depth not a power of two");
    assert_eq!(d.cmd::<_, CmdCreateQpRespV2>(qp(ib::qp_type::RC, 1024, 8, 3)).err(), Some(EINVAL), "rings larger than their pages");
    // Each QP's page list is kept (and saved): no more than twice what
    // its rings need.
    assert_eq!(d.cmd::<_, CmdCreateQpRespV2>(qp(ib::qp_type::RC, 8, 1, u16::MAX)).err(), Some(EINVAL), "pages far beyond its rings");
    assert_eq!(d.query()["objects"]["qps"], 0);

    // A working connection, then bad input on its rings and WQEs.
    let (mut c, peer) = connection(&mut d, &bed, gid);
    round_trip(&mut d, &mut c, &peer, 10);
    let Conn { mut qp, mut scq, buf, key, .. } = c;
    let mut ev_head = 0;
    // Too many SGEs: a LOC_LEN_ERR completion for that WQE.
    let sges = [Sge { addr: buf, length: 8, lkey: key }; 4];
    let at = qp.base + 4096 + (qp.sq_tail & (qp.sq_cnt - 1)) as u64 * qp.sq_stride;
    d.put_send(&mut qp, sq(501, wr_opcode::SEND), &sges);
    d.put(at, &SqWqeHdr { num_sge: 5, ..sq(501, wr_opcode::SEND) });
    d.doorbell(UAR_QP_OFFSET, UAR_QP_SEND | qp.handle);
    assert_eq!(d.rd(REG_ERR), 7, "E2BIG");
    let c = d.wait_cqes(&mut scq, 1)[0];
    assert_eq!((c.wr_id, c.status), (501, wc_status::LOC_LEN_ERR), "{c:?}");
    assert_eq!(d.query()["qps"][0]["broken"], true);
    // The QP is in error now; a doorbell on it is refused.
    d.doorbell(UAR_QP_OFFSET, UAR_QP_SEND | qp.handle);
    assert_eq!(d.rd(REG_ERR), 5, "EIO: the device no longer reads this QP's rings");
    assert!(d.async_events(&mut ev_head).is_empty(), "a bad WQE is reported by its CQE only");

    // A fresh connection: an unsupported opcode, an SGE outside its MR.
    let (mut c2, peer2) = connection(&mut d, &bed, gid);
    round_trip(&mut d, &mut c2, &peer2, 20);
    let Conn { qp: mut qp2, scq: mut scq2, buf: buf2, key: key2, .. } = c2;
    let mut h = sq(600, wr_opcode::RDMA_WRITE);
    h.wr.set_rdma(&WrRdma { remote_addr: peer2.mr.addr, rkey: peer2.mr.rkey, reserved: [0; 4] });
    d.post_send(&mut qp2, h, &[Sge { addr: buf2 + (1 << 20) - 16, length: 64, lkey: key2 }]);
    let c = d.wait_cqes(&mut scq2, 1)[0];
    assert_eq!((c.wr_id, c.status), (600, wc_status::LOC_PROT_ERR), "SGE beyond its MR: {c:?}");
    let (Conn { qp: mut qp3, scq: mut scq3, .. }, _peer3) = connection(&mut d, &bed, gid);
    d.post_send(&mut qp3, sq(700, wr_opcode::LOCAL_INV), &[]);
    let c = d.wait_cqes(&mut scq3, 1)[0];
    assert_eq!((c.wr_id, c.status), (700, wc_status::LOC_QP_OP_ERR), "{c:?}");

    // Ring indices outside [0, 2N): ERR, a QP_FATAL async event, nothing read.
    let (mut c4, peer4) = connection(&mut d, &bed, gid);
    round_trip(&mut d, &mut c4, &peer4, 30);
    let qp4 = c4.qp;
    d.put(qp4.base + QP_SQ_RING_OFFSET, &(2 * qp4.sq_cnt + 5));
    d.doorbell(UAR_QP_OFFSET, UAR_QP_SEND | qp4.handle);
    assert_eq!(d.rd(REG_ERR), 34, "ERANGE");
    let ev = d.async_events(&mut ev_head);
    assert_eq!(ev, vec![Eqe { event_type: ib::event::QP_FATAL, info: qp4.handle }]);
    assert!(d.rd(REG_ICR) & INTR_CAUSE_ASYNC != 0);

    // A doorbell for a destroyed QP, and for a CQ that never existed.
    let h5 = qp3.handle;
    d.cmd::<_, CmdDestroyQpResp>(CmdDestroyQp { hdr: Drv::hdr(CMD_DESTROY_QP), qp_handle: h5, reserved: [0; 4] }).unwrap();
    let before = d.query()["counters"]["bad_doorbells"].as_u64().unwrap();
    d.doorbell(UAR_QP_OFFSET, UAR_QP_SEND | UAR_QP_RECV | h5);
    d.doorbell(UAR_CQ_OFFSET, UAR_CQ_POLL | 4000);
    d.doorbell(UAR_SRQ_OFFSET, UAR_SRQ_RECV | 1);
    assert_eq!(d.query()["counters"]["bad_doorbells"].as_u64().unwrap(), before + 3);

    // After all of it, a new connection works as before.
    let (mut c6, peer6) = connection(&mut d, &bed, gid);
    round_trip(&mut d, &mut c6, &peer6, 40);
    let (buf6, key6) = (c6.buf, c6.key);
    // A peer WRITE with a wrong rkey fails at the peer (remote access error).
    peer6.qp.post_send(&[SendWr::write(1, &[peer6.mr.sge(0, 64)], buf6, key6 ^ 0x5a5a)]).unwrap();
    assert_eq!(peer6.cq.wait(1, T).unwrap()[0].status, WcStatus::RemAccessErr);
}

/// Two VMs' devices on one rnicd, different GIDs, the same QPNs and keys,
/// each talking to its own QP on the same peer host without interference.
#[test]
fn two_devices_with_the_same_ids_beside_each_other() {
    let bed = Bed::new("pvtwo", 2);
    let (g1, g2) = (bed.vm_gid(0, 1), bed.vm_gid(0, 2));
    let mut d1 = Drv::new(&bed.nics[0].sock, g1);
    let mut d2 = Drv::new(&bed.nics[0].sock, g2);
    d1.bring_up();
    d2.bring_up();
    let (mut c1, p1) = connection(&mut d1, &bed, g1);
    let (mut c2, p2) = connection(&mut d2, &bed, g2);
    let (b1, k1, b2, k2) = (c1.buf, c1.key, c2.buf, c2.key);
    assert_eq!((c1.qp.qpn, k1, c1.qp.handle), (c2.qp.qpn, k2, c2.qp.handle), "both namespaces hand out the same IDs");
    assert_eq!(b1, b2, "and the same guest addresses");
    for round in 0..20u64 {
        // Each peer QP writes its own pattern to the same (address, rkey) of
        // its own VM, then both VMs write back.
        let (x1, x2) = (pattern(round * 2, 4096), pattern(round * 2 + 1, 4096));
        p1.buf.write(0, &x1);
        p2.buf.write(0, &x2);
        p1.qp.post_send(&[SendWr::write(1, &[p1.mr.sge(0, 4096)], b1 + 65536, k1)]).unwrap();
        p2.qp.post_send(&[SendWr::write(1, &[p2.mr.sge(0, 4096)], b2 + 65536, k2)]).unwrap();
        assert_eq!(p1.cq.wait(1, T).unwrap()[0].status, WcStatus::Success);
        assert_eq!(p2.cq.wait(1, T).unwrap()[0].status, WcStatus::Success);
        assert_eq!(d1.get_bytes(b1 + 65536, 4096), x1);
        assert_eq!(d2.get_bytes(b2 + 65536, 4096), x2);
        round_trip(&mut d1, &mut c1, &p1, 100 + round * 4);
        round_trip(&mut d2, &mut c2, &p2, 102 + round * 4);
    }
    let _ = RecvWr { wr_id: 0, sg_list: &[] };
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Seeded fuzzing of commands, doorbells, ring indices and WQEs on a live
/// device with a connected QP: no panic, no access outside guest RAM (guest
/// RAM is all the device can reach), and afterwards a reset device and a
/// neighbour device on the same rnicd both still work.
#[test]
fn fuzzed_commands_doorbells_and_wqes() {
    let bed = Bed::new("pvfuzz", 2);
    let (g1, g2) = (bed.vm_gid(0, 1), bed.vm_gid(0, 2));
    let mut n = Drv::new(&bed.nics[0].sock, g2);
    n.bring_up();
    let (mut nc, np) = connection(&mut n, &bed, g2);
    let mut d = Drv::new(&bed.nics[0].sock, g1);
    d.bring_up();
    let (Conn { mut qp, scq, rcq, buf, key, .. }, _peer) = connection(&mut d, &bed, g1);
    // An SRQ with a QP on it, whose ring the loop fuzzes too.
    let spd = d.create_pd();
    let mut srq = d.create_srq(spd, 32, 2, 4);
    let _sqp = d.try_create_qp_on_srq(spd, &scq, &rcq, srq.handle, 16, 1).unwrap();
    let seed = std::env::var("PVRDMA_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5eed_1234_u64);
    let mut rng = Rng(seed | 1);
    let addr = |rng: &mut Rng| match rng.below(4) {
        0 => rng.next(),
        1 => RAM - rng.below(8192),
        _ => rng.below(RAM) & !0xfff,
    };
    for i in 0..3000 {
        match rng.below(7) {
            0 | 1 => {
                // A command with a real code and random (sometimes plausible) fields.
                let mut raw = [0u8; CMD_REQ_MAX_SIZE];
                for b in raw.iter_mut() {
                    *b = rng.next() as u8;
                }
                let mut h = CmdHdr::read_from(&raw).unwrap();
                h.cmd = rng.below(CMD_MAX as u64 + 2) as u32;
                raw[..16].copy_from_slice(h.as_bytes());
                if rng.below(2) == 0 {
                    // Small handles and in-RAM addresses reach deeper.
                    raw[16..20].copy_from_slice(&(rng.below(4) as u32).to_le_bytes());
                    raw[16..24].copy_from_slice(&addr(&mut rng).to_le_bytes());
                    raw[24..28].copy_from_slice(&(rng.below(4) as u32).to_le_bytes());
                }
                if h.cmd == CMD_DESTROY_QP && u32::from_le_bytes(raw[16..20].try_into().unwrap()) == qp.handle {
                    continue; // keep the QP whose rings the loop also fuzzes
                }
                d.put_bytes(d.cmd, &raw);
                d.wr(REG_REQUEST, 0);
            }
            2 => {
                let off = [0u64, 4, 8, rng.below(4096)][rng.below(4) as usize];
                let v = (rng.next() as u32 & 0xff00_0000) | rng.below(5) as u32;
                d.doorbell(off + rng.below(2) * 4096, v);
            }
            3 => {
                // A random send WQE, sometimes with a garbage tail.
                let mut h = SqWqeHdr::read_from(&pattern(i, 80)).unwrap();
                h.opcode = rng.below(16) as u32;
                h.num_sge = rng.below(6) as u32;
                let sges: Vec<Sge> = (0..h.num_sge)
                    .map(|_| Sge {
                        addr: if rng.below(2) == 0 { buf + rng.below(1 << 20) } else { addr(&mut rng) },
                        length: rng.below(70_000) as u32,
                        lkey: if rng.below(2) == 0 { key } else { rng.next() as u32 },
                    })
                    .collect();
                d.put_send(&mut qp, h, &sges[..sges.len().min(4)]);
                if rng.below(10) == 0 {
                    d.put(qp.base + QP_SQ_RING_OFFSET, &(rng.next() as u32));
                }
                d.doorbell(UAR_QP_OFFSET, UAR_QP_SEND | qp.handle);
            }
            4 => {
                let n_sge = rng.below(3) as usize;
                let sges: Vec<Sge> =
                    (0..n_sge).map(|_| Sge { addr: addr(&mut rng), length: rng.next() as u32, lkey: rng.next() as u32 }).collect();
                d.post_recv(&mut qp, i, &sges);
                if rng.below(10) == 0 {
                    d.put(qp.base + QP_RQ_RING_OFFSET, &(rng.next() as u32));
                }
            }
            5 => {
                // A random SRQ WQE (up to one SGE too many), sometimes with
                // a garbage producer index.
                let n_sge = rng.below(4) as usize;
                let sges: Vec<Sge> =
                    (0..n_sge).map(|_| Sge { addr: addr(&mut rng), length: rng.next() as u32, lkey: rng.next() as u32 }).collect();
                d.put_srq_recv(&mut srq, i, &sges);
                if rng.below(10) == 0 {
                    d.put(srq.base + RING_STATE_RX_PROD_TAIL, &(rng.next() as u32));
                }
                d.doorbell(UAR_SRQ_OFFSET, UAR_SRQ_RECV | srq.handle);
            }
            _ => {
                // Register writes other than RESET (tested below).
                let off = [REG_DSRLOW, REG_DSRHIGH, REG_IMR, REG_MACL, REG_ICR, REG_ERR, 0x400][rng.below(7) as usize];
                d.wr(off, rng.next() as u32);
                let mut b = [0u8; 4];
                d.msix.lock().unwrap().write(rng.below(0x4000) & !3, &(rng.next() as u32).to_le_bytes());
                d.msix.lock().unwrap().read(rng.below(0x4000) & !3, &mut b);
            }
        }
        if i % 500 == 0 {
            round_trip(&mut n, &mut nc, &np, 1000 + i);
        }
    }
    // The fuzzed device resets and works again; its neighbour never stopped.
    d.wr(REG_CTL, DEVICE_CTL_RESET);
    assert_eq!(d.rd(REG_ERR), 0);
    assert_eq!(d.query()["objects"]["qps"], 0);
    d.next = 32 << 20;
    d.bring_up();
    let (mut c, p) = connection(&mut d, &bed, g1);
    round_trip(&mut d, &mut c, &p, 5000);
    round_trip(&mut n, &mut nc, &np, 6000);
}
