//! A jumbo-frame link (MTU 9000), as RoCE fabrics run: path MTU 4096 packets
//! leave whole with DF set and an ICRC valid for the headers on the wire
//! (before, anything over 1472 bytes left from a non-DF socket whose IP id
//! the ICRC did not cover, and without UDP GSO), and data arrives byte for
//! byte. A path MTU larger than the link is still carried, fragmented by IP:
//! rnicd decides by its interface's MTU.
mod common;
use common::*;
use std::time::Duration;
use verbs::*;

/// The IP fragmentation counters of a host's network namespace:
/// (fragments created, reassemblies done).
fn frag_counters(bed: &Bed, host: usize) -> (u64, u64) {
    let snmp = bed.tb.host(host).sh("cat /proc/net/snmp").unwrap();
    let mut ip = snmp.lines().filter(|l| l.starts_with("Ip:"));
    let names: Vec<&str> = ip.next().unwrap().split_whitespace().collect();
    let values: Vec<&str> = ip.next().unwrap().split_whitespace().collect();
    let get = |n: &str| values[names.iter().position(|x| *x == n).unwrap()].parse::<u64>().unwrap();
    (get("FragCreates"), get("ReasmOKs"))
}

/// WRITE, READ back and a multi-packet SEND of `size` bytes from host 0 to 1.
fn exchange(a: &End, b: &End, size: usize, seed: u64) {
    let data = pattern(seed, size);
    a.buf.write(0, &data);
    a.qp.post_send(&[SendWr::write(1, &[a.mr.sge(0, size)], b.mr.addr, b.mr.rkey)]).unwrap();
    ok(&a.scq);
    assert!(b.buf.read(0, size) == data, "WRITE data differs");
    a.qp.post_send(&[SendWr::read(2, &[a.mr.sge(size, size)], b.mr.addr, b.mr.rkey)]).unwrap();
    ok(&a.scq);
    assert!(a.buf.read(size, size) == data, "READ data differs");
    b.qp.post_recv(&[RecvWr { wr_id: 3, sg_list: &[b.mr.sge(size, size)] }]).unwrap();
    a.qp.post_send(&[SendWr::send(4, &[a.mr.sge(0, size)])]).unwrap();
    let w = ok(&b.rcq);
    assert_eq!(w.byte_len as usize, size);
    ok(&a.scq);
    assert!(b.buf.read(size, size) == data, "SEND data differs");
}

#[test]
fn path_mtu_4096_on_a_jumbo_link_is_not_fragmented() {
    let bed = Bed::with_link_mtu("rnjum", 2, 9000, &[]);
    let size = 4 << 20;

    let before = [frag_counters(&bed, 0), frag_counters(&bed, 1)];
    let (a, b) = pair_sized(&bed, 0, 1, ConnectOpts { mtu: Mtu::M4096, ..Default::default() }, 2 * size, 64);
    exchange(&a, &b, size, 1);
    let after = [frag_counters(&bed, 0), frag_counters(&bed, 1)];
    assert_eq!(before, after, "4096-byte packets on a 9000-byte link must not be IP-fragmented");
    let st = b.ctx.stats().unwrap();
    assert_eq!(st["rx_bad_icrc"], 0, "{st}");

    // 16 KiB packets do not fit the link: IP fragments them, and they still arrive.
    let (a, b) = pair_sized(&bed, 0, 1, ConnectOpts { mtu: Mtu::M16384, ..Default::default() }, 2 * size, 64);
    exchange(&a, &b, size, 2);
    let (frags, reasm) = frag_counters(&bed, 0);
    assert!(frags > after[0].0, "16 KiB packets on a 9000-byte link are fragmented");
    assert!(reasm > after[0].1, "and the READ responses reassembled");
}

#[test]
fn jumbo_packets_carry_df_and_a_wire_valid_icrc() {
    // Without GSO, so that the capture sees the wire packets (see capture.rs).
    let bed = Bed::with_link_mtu("rnjcap", 2, 9000, &["--no-gso"]);
    let mut cap = Capture::start(&bed, 0);
    let (a, b) = pair(&bed, 0, 1, ConnectOpts { mtu: Mtu::M4096, ..Default::default() });
    exchange(&a, &b, 16384, 3);
    std::thread::sleep(Duration::from_millis(500));
    let data = cap.stop();
    assert_eq!(&data[..4], &0xa1b2c3d4u32.to_le_bytes(), "classic pcap");
    let (mut off, mut n, mut full) = (24, 0, 0);
    while off + 16 <= data.len() {
        let len = u32::from_le_bytes(data[off + 8..off + 12].try_into().unwrap()) as usize;
        let ip = &data[off + 16 + 14..off + 16 + len];
        let total = u16::from_be_bytes([ip[2], ip[3]]) as usize;
        let frag = u16::from_be_bytes([ip[6], ip[7]]);
        assert_eq!(frag, 0x4000, "packet {n}: DF set, not a fragment");
        assert!(wire_icrc_ok(ip), "packet {n}: ICRC does not match the wire headers");
        if total > 4096 {
            full += 1;
        }
        n += 1;
        off += 16 + len;
    }
    // 16 KiB each for the WRITE, the READ responses and the SEND: 4 packets of 4 KiB each.
    assert!(full >= 12, "{full} of {n} packets carry 4 KiB");
}

/// The link shrinks under a running QP (9000 -> 1500 on the sender's side):
/// DF sends of 4 KiB packets now fail, rnicd notices, and the transport's
/// resends go out fragmented; WRITEs and SENDs keep arriving intact.
#[test]
fn link_mtu_shrinking_under_a_qp_is_survived() {
    let bed = Bed::with_link_mtu("rnjshr", 2, 9000, &[]);
    let (a, b) = pair_sized(&bed, 0, 1, ConnectOpts { mtu: Mtu::M4096, ..Default::default() }, 2 << 20, 64);
    let one_way = |seed: u64| {
        let size = 1 << 20;
        let data = pattern(seed, size);
        a.buf.write(0, &data);
        a.qp.post_send(&[SendWr::write(1, &[a.mr.sge(0, size)], b.mr.addr, b.mr.rkey)]).unwrap();
        ok(&a.scq);
        assert!(b.buf.read(0, size) == data, "WRITE data differs");
        b.qp.post_recv(&[RecvWr { wr_id: 2, sg_list: &[b.mr.sge(size, size)] }]).unwrap();
        a.qp.post_send(&[SendWr::send(3, &[a.mr.sge(0, size)])]).unwrap();
        assert_eq!(ok(&b.rcq).byte_len as usize, size);
        ok(&a.scq);
        assert!(b.buf.read(size, size) == data, "SEND data differs");
    };
    one_way(1);
    let st = std::process::Command::new("ip").args(["-n", bed.tb.host(0).name(), "link", "set", "eth0", "mtu", "1500"]).status().unwrap();
    assert!(st.success());
    one_way(2);
    let stats = a.ctx.stats().unwrap();
    assert!(stats["send_errors"].as_u64().unwrap() > 0, "the first 4 KiB DF sends were refused: {stats}");
    one_way(3);
}
