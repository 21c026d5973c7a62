//! A guest memory region over scattered guest pages (as a Linux user MR
//! over malloc'd memory is), used by a bare-metal peer and by the guest
//! with every access crossing page runs, before and after a save on host A
//! and restore on host B.
mod pvrdma;

use devices::Lifecycle;
use pvrdma::*;
use pvrdma_abi::ib::{wc_opcode, wc_status, wr_opcode};
use pvrdma_abi::*;
use snapshot::Persist;
use verbs::{RecvWr, SendWr, WcStatus};

const PAGE: u64 = 4096;
/// The region's pages, by index into a block of guest pages: out of order,
/// with holes, and two consecutive pages (7, 8) the device merges.
const ORDER: [u64; 7] = [5, 1, 9, 3, 7, 8, 0];
/// Byte 0 sits this far into the first page.
const HEAD: u64 = 0x80;
/// The guest's virtual address of byte 0 (what SGEs and the peer use).
const START: u64 = 0x7f00_0000_0000 + HEAD;
const LEN: u64 = ORDER.len() as u64 * PAGE - HEAD;

/// Where byte `off` of the region is in guest RAM.
fn gpa_of(block: u64, off: u64) -> u64 {
    let at = off + HEAD;
    block + ORDER[(at / PAGE) as usize] * PAGE + at % PAGE
}

fn region_bytes(d: &Drv, block: u64, off: u64, len: u64) -> Vec<u8> {
    (off..off + len).map(|o| d.get_bytes(gpa_of(block, o), 1)[0]).collect()
}

fn put_region(d: &Drv, block: u64, off: u64, data: &[u8]) {
    for (i, b) in data.iter().enumerate() {
        d.put_bytes(gpa_of(block, off + i as u64), &[*b]);
    }
}

/// The peer WRITEs the whole region and READs it back, and runs both
/// atomics on the two words either side of a run boundary.
fn peer_write_read_atomics(d: &Drv, peer: &Peer, block: u64, key: u32, seed: u64) {
    let data = pattern(seed, LEN as usize);
    peer.buf.write(0, &data);
    peer.qp.post_send(&[SendWr::write(seed, &[peer.mr.sge(0, LEN as usize)], START, key)]).unwrap();
    assert_eq!(peer.cq.wait(1, T).unwrap()[0].status, WcStatus::Success);
    assert!(region_bytes(d, block, 0, LEN) == data, "WRITE landed page by page");
    peer.qp.post_send(&[SendWr::read(seed + 1, &[peer.mr.sge(1 << 20, LEN as usize)], START, key)]).unwrap();
    assert_eq!(peer.cq.wait(1, T).unwrap()[0].status, WcStatus::Success);
    assert!(peer.buf.read(1 << 20, LEN as usize) == data, "READ gathered page by page");
    let (last, first) = (PAGE - HEAD - 8, PAGE - HEAD);
    d.put(gpa_of(block, last), &100u64);
    d.put(gpa_of(block, first), &7u64);
    peer.qp
        .post_send(&[
            SendWr::fetch_add(seed + 2, &[peer.mr.sge(2 << 20, 8)], START + last, key, 5),
            SendWr::cmp_swap(seed + 3, &[peer.mr.sge((2 << 20) + 8, 8)], START + first, key, 7, 70),
        ])
        .unwrap();
    assert!(peer.cq.wait(2, T).unwrap().iter().all(|w| w.status == WcStatus::Success));
    assert_eq!((peer.buf.read_u64(2 << 20), peer.buf.read_u64((2 << 20) + 8)), (100, 7));
    assert_eq!((d.get::<u64>(gpa_of(block, last)), d.get::<u64>(gpa_of(block, first))), (105, 70));
}

#[test]
fn scattered_region_both_ways_and_across_save_restore() {
    let bed = Bed::new("pvscat", 3);
    let (gid, mut d, fd_b) = bed.movable_device();
    let pd = d.create_pd();
    let block = d.alloc(12);
    let pages: Vec<u64> = ORDER.iter().map(|p| block + p * PAGE).collect();
    let (_, key) = d.create_mr_pages(pd, &pages, START, LEN).unwrap();
    let mut scq = d.create_cq(64);
    let mut rcq = d.create_cq(64);
    let mut qp = d.create_qp(pd, &scq, &rcq, 32, 4);
    let peer = bed.peer_of(&mut d, &qp, gid, 10, 20);

    peer_write_read_atomics(&d, &peer, block, key, 1);
    // Pages of the block outside the region were never touched.
    for hole in [2u64, 4, 6, 10, 11] {
        assert!(d.get_bytes(block + hole * PAGE, PAGE as usize).iter().all(|&b| b == 0), "page {hole} written");
    }

    // The guest SENDs from the region (gather across runs) and receives
    // into it (scatter across runs); it WRITEs from it to the peer.
    let msg = pattern(10, 9000);
    let off = PAGE - HEAD - 300;
    put_region(&d, block, off, &msg);
    peer.qp.post_recv(&[RecvWr { wr_id: 20, sg_list: &[peer.mr.sge(3 << 20, 9000)] }]).unwrap();
    d.post_send(&mut qp, sq(21, wr_opcode::SEND), &[Sge { addr: START + off, length: 9000, lkey: key }]);
    assert_eq!(d.wait_cqes(&mut scq, 1)[0].status, wc_status::SUCCESS);
    assert_eq!(peer.cq.wait(1, T).unwrap()[0].byte_len, 9000);
    assert!(peer.buf.read(3 << 20, 9000) == msg);
    let back = pattern(11, 12_000);
    peer.buf.write(3 << 20, &back);
    d.post_recv(&mut qp, 22, &[Sge { addr: START + 100, length: 12_000, lkey: key }]);
    peer.qp.post_send(&[SendWr::send(23, &[peer.mr.sge(3 << 20, 12_000)])]).unwrap();
    let c = d.wait_cqes(&mut rcq, 1)[0];
    assert_eq!((c.wr_id, c.status, c.opcode, c.byte_len), (22, wc_status::SUCCESS, wc_opcode::RECV, 12_000), "{c:?}");
    peer.cq.wait(1, T).unwrap();
    assert!(region_bytes(&d, block, 100, 12_000) == back);
    let mut h = sq(24, wr_opcode::RDMA_WRITE);
    h.wr.set_rdma(&WrRdma { remote_addr: peer.mr.addr + (3 << 20) + 20_000, rkey: peer.mr.rkey, reserved: [0; 4] });
    d.post_send(&mut qp, h, &[Sge { addr: START + 100, length: 12_000, lkey: key }]);
    assert_eq!(d.wait_cqes(&mut scq, 1)[0].status, wc_status::SUCCESS);
    assert!(peer.buf.read((3 << 20) + 20_000, 12_000) == back);

    // Save on host A, restore on host B: the region comes back with the
    // same key over the same guest pages.
    d.dev.lock().unwrap().pause();
    let section = d.dev.lock().unwrap().save().expect("save");
    let q = d.query();
    bed.move_gid(gid, 0, 2);
    d.replace_device(&bed.nics[2].sock, gid, fd_b);
    d.dev.lock().unwrap().restore(&section).expect("restore");
    assert_eq!(d.query()["mrs"], q["mrs"], "same keys, addresses and runs");
    d.dev.lock().unwrap().resume();

    peer_write_read_atomics(&d, &peer, block, key, 30);
    assert_eq!(peer.qp.state().unwrap(), verbs::QpState::Rts);
}
