//! A doorbell reads the rings of the QPs whose bits the client set in its
//! doorbell page (`rnic::doorbell`), not those of all its QPs: with 64 QPs
//! and one posting, one ring is looked at. A client without a page has
//! every QP looked at, as before the page.
mod common;
use std::net::Ipv4Addr;
use std::time::Instant;

use common::direct::{self, dup, Path, SendRing};
use rnic::doorbell::DoorbellPage;
use rnic::engine::Engine;
use rnic::mem::sealed_memfd;
use rnic::proto::{Reply, Request};
use rnic::ring::{SendWqe, Sge};
use rnic::types::{access, Mtu};
use rnic::wire::Opcode;

const LOCAL: Ipv4Addr = Ipv4Addr::new(10, 9, 2, 1);
const PEER: Ipv4Addr = Ipv4Addr::new(10, 9, 2, 2);
const QPS: u32 = 64;
const POSTER: usize = 40;

/// The destination QPNs of the SEND packets the engine has to send now.
fn sends(e: &mut Engine) -> Vec<u32> {
    e.poll_tx(256, Instant::now());
    direct::sent(e, |w| (w.bth.opcode == Opcode::SendOnly).then_some(w.bth.dest_qpn)).into_iter().flatten().collect()
}

#[test]
fn a_doorbell_reads_the_rings_of_the_qps_that_rang() {
    let mut e = Engine::new(LOCAL);
    let mut keep = Vec::new();
    let Reply::Pd(pd) = e.control(1, Request::AllocPd, vec![]).unwrap() else { panic!() };
    let buf = sealed_memfd("buf", 4096).unwrap();
    let iova = 0x7000_0000_0000u64;
    let req = Request::RegMr { pd, iova, len: 4096, access: access::ALL, fd_offset: 0, key: None };
    let Reply::Mr { lkey, .. } = e.control(1, req, vec![dup(&buf)]).unwrap() else { panic!() };
    let (cq, cqfd) = direct::cq(&mut e, 1, 256);
    keep.extend([buf, cqfd]);
    let mut sq_fds = Vec::new();
    let qpns: Vec<u32> = (0..QPS)
        .map(|k| {
            let path = Path { peer: PEER, dest_qpn: 0x100 + k, rq_psn: 0, mtu: Mtu::M1024, max_dest_rd_atomic: 1, timeout: 0 };
            let at = keep.len();
            let qpn = direct::rts_qp(&mut e, pd, cq, &path, &mut keep);
            sq_fds.push(at);
            qpn
        })
        .collect();

    // One QP posts a SEND into its ring, as a client does before it rings.
    let mut sq = SendRing::new(&keep[sq_fds[POSTER]]);
    let mut w = SendWqe { wr_id: 7, opcode: 2, num_sge: 1, ..Default::default() };
    w.sge[0] = Sge { addr: iova, length: 64, lkey };

    let (client_page, fd) = DoorbellPage::create().unwrap();
    let page = DoorbellPage::map(&fd).unwrap();
    sq.post(&w);
    client_page.mark(qpns[POSTER]);
    e.doorbell_marked(1, &page);
    assert_eq!((e.stats.doorbells, e.stats.doorbell_qp_looks), (1, 1), "one doorbell, one QP's rings read");
    assert_eq!(sends(&mut e), vec![0x100 + POSTER as u32], "the marked QP's SEND left");

    // A doorbell with no bit set reads no ring.
    sq.post(&w);
    e.doorbell_marked(1, &page);
    assert_eq!(e.stats.doorbell_qp_looks, 1);

    // Without a page, the client's every QP is looked at.
    e.doorbell(1);
    assert_eq!((e.stats.doorbells, e.stats.doorbell_qp_looks), (3, 1 + QPS as u64));
    assert_eq!(sends(&mut e), vec![0x100 + POSTER as u32]);
}

#[test]
fn a_destroyed_qp_leaves_its_slot() {
    let mut e = Engine::new(LOCAL);
    let mut keep = Vec::new();
    let Reply::Pd(pd) = e.control(1, Request::AllocPd, vec![]).unwrap() else { panic!() };
    let (cq, cqfd) = direct::cq(&mut e, 1, 64);
    keep.push(cqfd);
    let path = Path { peer: PEER, dest_qpn: 0x100, rq_psn: 0, mtu: Mtu::M1024, max_dest_rd_atomic: 1, timeout: 0 };
    let qpn = direct::rts_qp(&mut e, pd, cq, &path, &mut keep);
    e.control(1, Request::DestroyQp { qpn }, vec![]).unwrap();
    let (client_page, fd) = DoorbellPage::create().unwrap();
    let page = DoorbellPage::map(&fd).unwrap();
    client_page.mark(qpn);
    e.doorbell_marked(1, &page);
    assert_eq!(e.stats.doorbell_qp_looks, 0);
}
