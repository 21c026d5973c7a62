//! A QP made to await its state (what a migration's destination builds
//! ahead of the switch) has what its first packets after the resume need
//! before it resumes: the send socket of its source port is open, and the
//! host's neighbour entry for the peer named at creation is made, by an
//! ARP request from the host's own address: nothing announces the GID,
//! which is not on the host before the commit. A peer is warmed once: the
//! states loaded at the switch ask again only for peers not warmed yet.
mod common;
use common::*;
use std::time::{Duration, Instant};
use verbs::*;

/// Waits up to 5 s for `ok` on host `h`'s output of `cmd`.
fn eventually(bed: &Bed, h: usize, cmd: &str, ok: impl Fn(&str) -> bool) -> String {
    let t0 = Instant::now();
    loop {
        let out = bed.tb.host(h).sh(cmd).unwrap();
        if ok(&out) || t0.elapsed() > Duration::from_secs(5) {
            return out;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_qp_made_to_await_its_state_has_its_socket_and_neighbour_ready() {
    let bed = Bed::new("rnahead", 3);
    let gid = bed.tb.spare_addr(0, 1);
    let (peer, other) = (bed.nics[1].addr, bed.nics[2].addr);
    for ip in [peer, other] {
        bed.tb.host(0).sh(&format!("ip neigh flush to {ip}")).unwrap();
    }
    let ctx = Context::open_namespace(Some(&bed.nics[0].sock), gid).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16, None).unwrap();
    let init = QpInitAttr::new(&cq, &cq);
    let made = ctx
        .create_batch(&[
            NewObject::QpAwaitingState { pd: &pd, init: &init, qpn: 0x700, peer: Some(peer) },
            NewObject::QpAwaitingState { pd: &pd, init: &init, qpn: 0x701, peer: None },
        ])
        .unwrap();

    // Each QP's source port is bound on the GID (with IP_FREEBIND: the
    // address is not on the host).
    for qpn in [0x700, 0x701] {
        let port = rnic::wire::source_port_for_qpn(qpn);
        let bound = eventually(&bed, 0, &format!("ss -Huan 'sport = :{port}'"), |o| o.contains(&format!("{gid}:{port}")));
        assert!(bound.contains(&format!("{gid}:{port}")), "QP {qpn:#x}: no socket on {gid}:{port}: {bound:?}");
    }
    // The named peer's entry is resolved; the other host, named by no
    // QP, has none.
    let entry = eventually(&bed, 0, &format!("ip neigh show {peer}"), |o| o.contains("lladdr"));
    assert!(entry.contains("lladdr"), "host 0 has no neighbour entry for the peer {peer}: {entry:?}");
    assert_eq!(bed.tb.host(0).sh(&format!("ip neigh show {other}")).unwrap().trim(), "");
    // Nobody heard of the GID: it was never announced or asked for.
    for h in [1, 2] {
        assert_eq!(bed.tb.host(h).sh(&format!("ip neigh show {gid}")).unwrap().trim(), "", "host {h}");
    }
    assert!(!bed.tb.host(0).sh("ip -4 -o addr show dev eth0").unwrap().contains(&format!(" {gid}/")));

    // At the switch the states are loaded, each naming its peer again:
    // only a peer not warmed yet (the second QP named none when made) is
    // warmed then; the first QP's peer is not asked for again, even with
    // its entry gone.
    bed.tb.host(0).sh(&format!("ip neigh flush to {peer}")).unwrap();
    ctx.load_qp_states(&[rts_state(0x700, peer), rts_state(0x701, other)]).unwrap();
    let entry = eventually(&bed, 0, &format!("ip neigh show {other}"), |o| o.contains("lladdr"));
    assert!(entry.contains("lladdr"), "host 0 has no neighbour entry for the loaded peer {other}: {entry:?}");
    assert_eq!(bed.tb.host(0).sh(&format!("ip neigh show {peer}")).unwrap().trim(), "", "{peer} was warmed again");
    drop(made);
}
