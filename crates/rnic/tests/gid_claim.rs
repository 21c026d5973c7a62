//! A namespace's owner moves its GID through rnicd: a claim adds the
//! address beside rnicd's own (same interface and prefix) and announces it,
//! so a neighbour's ARP entry points at the claiming host at once; a
//! release removes it; a namespace that closes releases what it claimed;
//! the daemon's own address is not a GID that moves.
mod common;
use common::*;
use std::time::{Duration, Instant};
use verbs::*;

fn holds(bed: &Bed, h: usize, gid: std::net::Ipv4Addr) -> bool {
    bed.tb.host(h).sh("ip -4 -o addr show dev eth0").unwrap().contains(&format!(" {gid}/24"))
}

/// Host `h`'s neighbour entry for `ip`, after sending it a datagram (which
/// makes `h` resolve the address).
fn neighbour_mac(bed: &Bed, h: usize, ip: std::net::Ipv4Addr) -> String {
    let _ = bed.tb.host(h).sh(&format!("bash -c 'echo x > /dev/udp/{ip}/9'; sleep 0.2"));
    bed.tb.host(h).sh(&format!("ip neigh show {ip}")).unwrap()
}

#[test]
fn claim_moves_the_gid_and_release_or_close_gives_it_up() {
    let bed = Bed::new("rngid", 3);
    let gid = bed.tb.spare_addr(0, 1);
    let a = Context::open_namespace(Some(&bed.nics[0].sock), gid).unwrap();
    let b = Context::open_namespace(Some(&bed.nics[1].sock), gid).unwrap();
    assert!(!holds(&bed, 0, gid) && !holds(&bed, 1, gid), "a namespace alone does not answer for its GID");

    a.claim_gid().unwrap();
    a.claim_gid().expect("claiming twice is harmless");
    assert!(holds(&bed, 0, gid) && !holds(&bed, 1, gid));
    let seen_a = neighbour_mac(&bed, 2, gid);
    assert!(seen_a.contains("lladdr"), "{seen_a}");

    // The move: released on host 0, then claimed on host 1, whose
    // announcement updates host 2's entry without waiting for it to age.
    a.release_gid().unwrap();
    assert!(!holds(&bed, 0, gid));
    b.claim_gid().unwrap();
    assert!(holds(&bed, 1, gid));
    let mac = |h: usize| bed.tb.host(h).sh("cat /sys/class/net/eth0/address").unwrap().trim().to_string();
    assert!(seen_a.contains(&mac(0)), "{seen_a}");
    let seen_b = bed.tb.host(2).sh(&format!("ip neigh show {gid}")).unwrap();
    assert!(seen_b.contains(&mac(1)), "host 2 follows the announcement: {seen_b}");

    // The namespace's last client goes: host 1 stops answering for it.
    drop(b);
    let t0 = Instant::now();
    while holds(&bed, 1, gid) {
        assert!(t0.elapsed() < Duration::from_secs(10), "host 1 kept {gid} after its namespace closed");
        std::thread::sleep(Duration::from_millis(20));
    }

    // rnicd's own address never moves.
    let own = bed.ctx(0);
    let Err(e) = own.claim_gid() else { panic!("the daemon's own address must be refused") };
    assert!(format!("{e:#}").contains("own address"), "{e:#}");
    assert!(own.release_gid().is_err());
    drop(a);
}

/// A migration's destination claims the GID and resumes its QPs in one
/// request: both happen, the claim first; a claim that fails resumes
/// nothing.
#[test]
fn claim_and_resume_in_one_request() {
    let bed = Bed::new("rngcr", 2);
    let connect = |a: &End, b: &End| {
        a.qp.connect(&b.qp.endpoint(0x10_0000), &ConnectOpts { sq_psn: 0xff_fff0, ..Default::default() }).unwrap();
        b.qp.connect(&a.qp.endpoint(0xff_fff0), &ConnectOpts { sq_psn: 0x10_0000, ..Default::default() }).unwrap();
    };

    // A claim the daemon refuses (its own address): the QP stays suspended.
    let (own, peer) = (End::new(bed.ctx(0), 4096, 16), End::new(bed.ctx(1), 4096, 16));
    connect(&own, &peer);
    own.ctx.suspend_qps(&[&own.qp]).unwrap();
    let Err(e) = own.ctx.claim_gid_and_resume_qps(&[&own.qp]) else { panic!("the daemon's own address must be refused") };
    assert!(format!("{e:#}").contains("own address"), "{e:#}");
    own.ctx.resume_qps(&[&own.qp]).expect("the failed claim left the QP suspended");

    // A namespace's claim: the address is here and the QP runs.
    let gid = bed.tb.spare_addr(0, 1);
    let ns = Context::open_namespace(Some(&bed.nics[0].sock), gid).unwrap();
    let (moved, peer) = (End::new(ns, 4096, 16), End::new(bed.ctx(1), 4096, 16));
    connect(&moved, &peer);
    moved.ctx.suspend_qps(&[&moved.qp]).unwrap();
    assert!(!holds(&bed, 0, gid));
    moved.ctx.claim_gid_and_resume_qps(&[&moved.qp]).unwrap();
    assert!(holds(&bed, 0, gid));
    assert!(moved.ctx.resume_qps(&[&moved.qp]).is_err(), "the QP resumed with the claim");
}
