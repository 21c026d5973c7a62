//! A guest CQ given more completions than it holds: rnicd's CQ of the
//! guest's size overruns, its completions are lost, and the device tells
//! the guest with one CQ_ERR async event (counted in `cq_overruns`)
//! instead of polling the CQ as empty for ever.
mod pvrdma;

use pvrdma::*;
use pvrdma_abi::ib;
use pvrdma_abi::*;
use verbs::{SendWr, WcStatus};

#[test]
fn an_overrun_cq_raises_cq_err_once() {
    let bed = Bed::new("pvd-cqov", 2);
    let (gid, mut d) = bed.device();
    let mut c = d.rc_conn(ConnSpec { cq_entries: 4, ..Default::default() });
    let peer = bed.peer_of(&mut d, &c.qp, gid, 1, 2);
    let (buf, key) = (c.buf, c.key);
    let mut ev_head = 0;
    assert!(d.async_events(&mut ev_head).is_empty());
    // Six receives and six messages, the guest not polling meanwhile:
    // the fifth completion finds rnicd's receive CQ of 4 full.
    for i in 0..6u64 {
        d.post_recv(&mut c.qp, i, &[Sge { addr: buf + i * 256, length: 256, lkey: key }]);
    }
    for _ in 0..6 {
        peer.qp.post_send(&[SendWr::send(1, &[peer.mr.sge(0, 64)])]).unwrap();
    }
    for _ in 0..6 {
        assert_eq!(peer.cq.wait(1, T).unwrap()[0].status, WcStatus::Success);
    }
    assert!(d.poll(&mut c.rcq).is_none(), "an overrun CQ's completions are lost");
    assert_eq!(d.async_events(&mut ev_head), vec![Eqe { event_type: ib::event::CQ_ERR, info: c.rcq.handle }]);
    assert_eq!(d.query()["counters"]["cq_overruns"], 1);
    // Polled again: nothing, and no second event.
    assert!(d.poll(&mut c.rcq).is_none());
    assert!(d.async_events(&mut ev_head).is_empty(), "CQ_ERR is raised once per CQ");
    assert_eq!(d.query()["counters"]["cq_overruns"], 1);
}
