//! The port's active MTU follows the link: the largest path MTU whose
//! packets (payload + 64 bytes of RoCEv2 headers) fit the MTU of the
//! interface holding the namespace's address, 1024 on a 1500-byte link and
//! 4096 on a 9000-byte one. A queue pair connected with the verbs crate's
//! defaults takes it, so its packets leave whole, not as IP fragments.
mod common;
use common::*;
use verbs::*;

/// IP fragments a host's network namespace created so far.
fn frags_created(bed: &Bed, host: usize) -> u64 {
    let snmp = bed.tb.host(host).sh("cat /proc/net/snmp").unwrap();
    let mut ip = snmp.lines().filter(|l| l.starts_with("Ip:"));
    let names: Vec<&str> = ip.next().unwrap().split_whitespace().collect();
    let values: Vec<&str> = ip.next().unwrap().split_whitespace().collect();
    values[names.iter().position(|x| *x == "FragCreates").unwrap()].parse().unwrap()
}

/// query_port says `want`; a default-connected QP takes it and a 1 MiB
/// WRITE and READ leave unfragmented.
fn check(bed: &Bed, want: Mtu) {
    for i in 0..2 {
        assert_eq!(bed.ctx(i).query_port(1).unwrap().active_mtu, want, "host {i}'s port");
    }
    let before = [frags_created(bed, 0), frags_created(bed, 1)];
    let size = 1 << 20;
    let (a, b) = pair_sized(bed, 0, 1, ConnectOpts::default(), 2 * size, 16);
    assert_eq!(a.qp.query().unwrap().0.path_mtu, want, "the default path MTU is the port's");
    let data = pattern(7, size);
    a.buf.write(0, &data);
    a.qp.post_send(&[SendWr::write(1, &[a.mr.sge(0, size)], b.mr.addr, b.mr.rkey)]).unwrap();
    ok(&a.scq);
    a.qp.post_send(&[SendWr::read(2, &[a.mr.sge(size, size)], b.mr.addr, b.mr.rkey)]).unwrap();
    ok(&a.scq);
    assert!(a.buf.read(size, size) == data, "data differs");
    assert_eq!([frags_created(bed, 0), frags_created(bed, 1)], before, "no packet was IP-fragmented");
    // Asking for less than the port's is honoured.
    let (c, _d) = pair(bed, 0, 1, ConnectOpts { mtu: Mtu::M512, ..Default::default() });
    assert_eq!(c.qp.query().unwrap().0.path_mtu, Mtu::M512);
}

#[test]
fn a_1500_byte_link_gives_active_mtu_1024() {
    let bed = Bed::new("rnpm15", 2);
    check(&bed, Mtu::M1024);
}

#[test]
fn a_9000_byte_link_gives_active_mtu_4096() {
    let bed = Bed::with_link_mtu("rnpm90", 2, 9000, &[]);
    check(&bed, Mtu::M4096);
}

#[test]
fn a_namespace_follows_its_gid_once_claimed() {
    let bed = Bed::with_link_mtu("rnpmns", 2, 9000, &[]);
    let gid = bed.tb.spare_addr(0, 1);
    let ns = Context::open_namespace(Some(&bed.nics[0].sock), gid).unwrap();
    // No interface holds the GID yet: 1024 fits any Ethernet link.
    assert_eq!(ns.query_port(1).unwrap().active_mtu, Mtu::M1024);
    ns.claim_gid().unwrap();
    assert_eq!(ns.query_port(1).unwrap().active_mtu, Mtu::M4096, "claimed on the 9000-byte link");
}
