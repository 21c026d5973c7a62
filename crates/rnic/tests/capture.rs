//! A capture of rnicd traffic, decoded by tshark's InfiniBand/RoCEv2 dissector:
//! opcodes, PSNs, QPNs and UDP source ports as sent, and every ICRC valid over
//! the real IPv4/UDP headers on the wire (checked here independently of
//! rnicd's code, since tshark 4.0 shows the ICRC but does not verify it).
mod common;
use common::*;
use std::time::Duration;
use verbs::*;

#[test]
fn tshark_decodes_capture_with_valid_icrc() {
    // Without UDP GSO: a capture on a veth sees a GSO batch as one super-packet
    // (as tcpdump sees TSO), not the wire packets the kernel cuts it into.
    let bed = Bed::with_args("rncap", 2, &["--no-gso"]);
    let mut cap = Capture::start(&bed, 0);

    // No retransmission timer (timeout 0): the list of requests checked
    // below is each sent once, where a loss probe would resend one on a
    // host too loaded to run the responder's rnicd within a few ms.
    let (a, b) = pair(&bed, 0, 1, ConnectOpts { mtu: Mtu::M1024, timeout: 0, ..Default::default() });
    a.buf.write(0, &pattern(9, 8192));
    b.qp.post_recv(&[RecvWr { wr_id: 1, sg_list: &[b.mr.sge(0, 4096)] }]).unwrap();
    a.qp.post_send(&[SendWr::send(1, &[a.mr.sge(0, 2500)])]).unwrap(); // 3 packets
    ok(&a.scq);
    // The receive the immediate consumes is there first: posted after the
    // WRITE, it could come late, and the RNR NAK and the resend it causes
    // would add packets to the opcode list checked below.
    b.qp.post_recv(&[RecvWr { wr_id: 2, sg_list: &[] }]).unwrap();
    a.qp.post_send(&[SendWr::write(2, &[a.mr.sge(0, 3000)], b.mr.addr + 8192, b.mr.rkey).with_imm(5)]).unwrap();
    ok(&a.scq);
    a.qp.post_send(&[SendWr::read(3, &[a.mr.sge(16384, 2100)], b.mr.addr, b.mr.rkey)]).unwrap(); // 3 responses
    ok(&a.scq);
    a.qp.post_send(&[SendWr::cmp_swap(4, &[a.mr.sge(32768, 8)], b.mr.addr + 64, b.mr.rkey, 0, 1)]).unwrap();
    a.qp.post_send(&[SendWr::fetch_add(5, &[a.mr.sge(32776, 8)], b.mr.addr + 64, b.mr.rkey, 1)]).unwrap();
    a.scq.wait(2, T).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let data = cap.stop();

    let out = std::process::Command::new("tshark")
        .arg("-r")
        .arg(&cap.path)
        .args([
            "-T",
            "fields",
            "-E",
            "separator=,",
            "-e",
            "ip.src",
            "-e",
            "udp.srcport",
            "-e",
            "infiniband.bth.opcode",
            "-e",
            "infiniband.bth.destqp",
            "-e",
            "infiniband.bth.psn",
            "-e",
            "infiniband.invariant.crc",
        ])
        .output()
        .expect("tshark -r");
    let text = String::from_utf8_lossy(&out.stdout);
    let rows: Vec<Vec<String>> = text.lines().map(|l| l.split(',').map(String::from).collect()).collect();
    let from_a: Vec<&Vec<String>> = rows.iter().filter(|r| r[0] == bed.nics[0].addr.to_string()).collect();
    let from_b: Vec<&Vec<String>> = rows.iter().filter(|r| r[0] == bed.nics[1].addr.to_string()).collect();
    let num = |s: &str| if let Some(h) = s.strip_prefix("0x") { u32::from_str_radix(h, 16).unwrap() } else { s.parse::<u32>().unwrap() };
    // Requests A -> B: opcodes in order, PSNs consecutive from A's sq_psn (wrapping at 2^24).
    let ops: Vec<u32> = from_a.iter().map(|r| num(&r[2])).collect();
    assert_eq!(ops, vec![0, 1, 2, 6, 7, 9, 12, 19, 20], "request opcodes as tshark decodes them: {text}");
    let mut psn = 0xff_fff0u32;
    for (i, r) in from_a.iter().enumerate() {
        assert_eq!(num(&r[3]), b.qp.qpn, "dest QP");
        assert_eq!(num(&r[4]), psn, "PSN of request {i}");
        psn = (psn + if ops[i] == 12 { 3 } else { 1 }) & 0xff_ffff;
        assert_eq!(num(&r[1]), rnic::wire::source_port_for_qpn(a.qp.qpn) as u32, "UDP source port from the QPN");
        assert!(!r[5].is_empty(), "tshark shows the ICRC");
    }
    // Responses B -> A: ACKs, READ response first/middle/last, atomic ACKs.
    let rops: Vec<u32> = from_b.iter().map(|r| num(&r[2])).collect();
    assert!(from_b.iter().all(|r| num(&r[3]) == a.qp.qpn));
    for want in [17, 13, 14, 15, 18] {
        assert!(rops.contains(&want), "response opcode {want} missing: {rops:?}");
    }

    // Every captured packet's ICRC is right for the headers on the wire.
    assert_eq!(&data[..4], &0xa1b2c3d4u32.to_le_bytes(), "classic pcap");
    let mut off = 24;
    let mut n = 0;
    while off + 16 <= data.len() {
        let len = u32::from_le_bytes(data[off + 8..off + 12].try_into().unwrap()) as usize;
        let frame = &data[off + 16..off + 16 + len];
        let ip = &frame[14..];
        assert_eq!(ip[9], 17, "UDP");
        assert!(wire_icrc_ok(ip), "packet {n}: ICRC does not match the wire headers");
        n += 1;
        off += 16 + len;
    }
    assert_eq!(n, rows.len());
    assert!(n >= 15);
}
