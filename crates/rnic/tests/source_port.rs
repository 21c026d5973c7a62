//! A QP whose QPN-derived UDP source port is already taken on its host (any
//! program may bind an ephemeral port in 0xc000..0xffff; rnicd's own fallback
//! sockets do too) still works: its packets leave from another port and their
//! ICRC is computed for the port on the wire. (An ICRC computed for the taken
//! port would make the peer drop every packet as bad ICRC and the QP end in
//! RETRY_EXC_ERR, now and then in a 1,000-QP move.)
mod common;
use common::*;
use verbs::*;

#[test]
fn qp_whose_source_port_is_taken_still_works() {
    let bed = Bed::new("rnsport", 2);
    let o = ConnectOpts { mtu: Mtu::M1024, retry_cnt: 2, timeout: 12, ..Default::default() };
    let (a, b) = pair(&bed, 0, 1, o);
    // Another program on each host holds the port rnicd would send from.
    let ports = [rnic::wire::source_port_for_qpn(a.qp.qpn), rnic::wire::source_port_for_qpn(b.qp.qpn)];
    let held: Vec<std::net::UdpSocket> = (0..2)
        .map(|h| {
            let (ip, port) = (bed.nics[h].addr, ports[h]);
            bed.tb.host(h).in_netns(move || std::net::UdpSocket::bind((ip, port))).unwrap().expect("bind the QP's source port")
        })
        .collect();

    let data = pattern(3, 1 << 20);
    a.buf.write(0, &data);
    b.buf.write(2 << 20, &data);
    for i in 0..20u64 {
        b.qp.post_recv(&[RecvWr { wr_id: i, sg_list: &[b.mr.sge(4 << 20 | (i as usize * 4096), 4096)] }]).unwrap();
        a.qp.post_recv(&[RecvWr { wr_id: i, sg_list: &[a.mr.sge(4 << 20 | (i as usize * 4096), 4096)] }]).unwrap();
    }
    // Every packet kind in both directions: requests, ACKs, READ responses, atomic ACKs.
    a.qp.post_send(&[SendWr::write(1, &[a.mr.sge(0, 1 << 20)], b.mr.addr, b.mr.rkey)]).unwrap();
    a.qp.post_send(&[SendWr::read(2, &[a.mr.sge(2 << 20, 1 << 20)], b.mr.addr + (2 << 20), b.mr.rkey)]).unwrap();
    a.qp.post_send(&[SendWr::fetch_add(3, &[a.mr.sge(3 << 20, 8)], b.mr.addr + (3 << 20), b.mr.rkey, 5)]).unwrap();
    for i in 0..20u64 {
        a.qp.post_send(&[SendWr::send(10 + i, &[a.mr.sge(i as usize * 100, 3000)])]).unwrap();
        b.qp.post_send(&[SendWr::send(10 + i, &[b.mr.sge(2 << 20 | (i as usize * 100), 3000)])]).unwrap();
    }
    let wa = a.scq.wait(23, T).unwrap();
    let wb = b.scq.wait(20, T).unwrap();
    assert!(wa.iter().chain(&wb).all(|w| w.status == WcStatus::Success), "{wa:?} {wb:?}");
    assert_eq!(b.buf.read(0, 1 << 20), data, "WRITE");
    assert_eq!(a.buf.read(2 << 20, 1 << 20), data, "READ");
    assert_eq!(b.buf.read_u64(3 << 20), 5, "atomic");
    let (ra, rb) = (a.rcq.wait(20, T).unwrap(), b.rcq.wait(20, T).unwrap());
    for (i, (x, y)) in ra.iter().zip(&rb).enumerate() {
        assert_eq!((x.wr_id, x.status, y.wr_id, y.status), (i as u64, WcStatus::Success, i as u64, WcStatus::Success));
        assert_eq!(b.buf.read(4 << 20 | (i * 4096), 3000), data[i * 100..i * 100 + 3000]);
        assert_eq!(a.buf.read(4 << 20 | (i * 4096), 3000), data[i * 100..i * 100 + 3000]);
    }
    for h in 0..2 {
        let s = bed.ctx(h).stats().unwrap();
        assert_eq!(s["rx_bad_icrc"], 0, "host {h}: {s}");
    }
    drop(held);
}
