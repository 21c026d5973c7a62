//! A doorbell reads the rings of the QPs whose bits the client set in its
//! doorbell page (`rnic::doorbell`), not those of all its QPs: with 64 QPs
//! and one posting, one ring is looked at. A client without a page has
//! every QP looked at, as before the page. A post whose QP's bit is still
//! set (rnicd has not yet taken the doorbell) writes no eventfd.
mod common;
use std::net::Ipv4Addr;
use std::time::Instant;

use common::direct::{self, dup, Path, SendRing};
use common::{pair, Bed, T};
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
    assert!(client_page.mark(qpns[POSTER]));
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
    assert!(client_page.mark(qpn));
    e.doorbell_marked(1, &page);
    assert_eq!(e.stats.doorbell_qp_looks, 0);
}

/// A real rnicd and a verbs client posting single WRITEs in bursts, each
/// burst after rnicd has gone idle: the posts that follow a doorbell before
/// rnicd wakes find their QP's bit set and write no eventfd, so each drain
/// of the eventfd finds at most one write (a client that wrote per post
/// left several writes per drain whenever it posted faster than rnicd woke).
#[test]
fn posts_before_rnicd_wakes_write_the_eventfd_once() {
    let bed = Bed::new("rndb", 2);
    let (a, b) = pair(&bed, 0, 1, verbs::ConnectOpts::default());
    let sge = [a.mr.sge(0, 64)];
    for burst in 0..100u64 {
        for i in 0..32u64 {
            let w = verbs::SendWr::write(burst * 32 + i, &sge, b.mr.addr, b.mr.rkey);
            a.qp.post_send(&[if i < 31 { w.unsignaled() } else { w }]).unwrap();
        }
        let w = a.scq.wait(1, T).unwrap();
        assert_eq!(w[0].status, verbs::WcStatus::Success, "{w:?}");
        // Past rnicd's spin, so that the next burst starts with a doorbell.
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    let s = a.ctx.stats().unwrap();
    let (doorbells, writes) = (s["doorbells"].as_u64().unwrap(), s["doorbell_writes"].as_u64().unwrap());
    assert!(doorbells >= 10, "bursts after an idle rnicd ring its doorbell: {doorbells}");
    assert!(writes <= doorbells, "{writes} eventfd writes for {doorbells} doorbells");
}
