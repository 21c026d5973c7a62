//! Control messages larger than one datagram travel in a memfd
//! (`rnic::proto::spill`): a batch over hundreds of QPs is one request and one
//! reply, and a bad spilled request is refused without harm.
mod common;

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use bincode::Options as _;

use common::*;
use verbs::*;

/// A connected QP's state as a source's rnicd would give it.
fn state(qpn: u32, peer: std::net::Ipv4Addr) -> QpSnapshot {
    let attr = QpAttr { qp_state: QpState::Rts, dest_gid: peer, dest_qp_num: 0x10_0000 + qpn, rnr_retry: 7, ..Default::default() };
    let runtime = QpRuntime { next_psn: qpn * 3, una: qpn * 3, max_sent: qpn * 3, epsn: qpn * 5, ..Default::default() };
    QpSnapshot { version: QP_SNAPSHOT_VERSION, qpn, attr, runtime }
}

#[test]
fn batches_larger_than_a_message_are_one_request_each() {
    const QPS: u32 = 600;
    let bed = Bed::new("rnspill", 2);
    let gid = bed.tb.spare_addr(0, 1);
    let ctx = Context::open_namespace(Some(&bed.nics[0].sock), gid).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64, None).unwrap();
    let mut init = QpInitAttr::new(&cq, &cq);
    (init.cap.max_send_wr, init.cap.max_recv_wr) = (4, 4);
    let states: Vec<QpSnapshot> = (0..QPS).map(|i| state(0x100 + i, bed.nics[1].addr)).collect();
    // Far more than one datagram: the states alone.
    let one = serde_json::to_vec(&states[0]).unwrap().len();
    assert!(one * QPS as usize > 4 * fdmsg::MAX_MSG, "{one} bytes a state");

    let objects: Vec<NewObject> = states.iter().map(|s| NewObject::Qp { pd: &pd, init: &init, qpn: None, state: Some(s) }).collect();
    let before = ctx.stats().unwrap()["control_requests"].as_u64().unwrap();
    let made = ctx.create_batch(&objects).expect("one spilled CreateBatch");
    let qps: Vec<Qp> = made.into_iter().map(|m| if let Made::Qp(q) = m { q } else { panic!("not a QP") }).collect();
    let refs: Vec<&Qp> = qps.iter().collect();
    assert_eq!(qps.iter().map(|q| q.qpn).collect::<Vec<_>>(), states.iter().map(|s| s.qpn).collect::<Vec<_>>());

    // Created suspended, so all are connected: the suspend names them all
    // and its spilled reply carries every state as it went in.
    let got = ctx.suspend_connected_states(&refs).expect("one spilled reply");
    assert_eq!(got.len(), QPS as usize);
    for (g, s) in got.iter().zip(&states) {
        assert_eq!(
            (g.qpn, g.attr.dest_qp_num, g.runtime.next_psn, g.runtime.epsn),
            (s.qpn, s.attr.dest_qp_num, s.runtime.next_psn, s.runtime.epsn)
        );
    }
    let again = ctx.query_qp_states(&refs).unwrap();
    assert_eq!(again.iter().map(|s| s.runtime.epsn).collect::<Vec<_>>(), states.iter().map(|s| s.runtime.epsn).collect::<Vec<_>>());
    // The batch, the suspend, the query and this stats request.
    let after = ctx.stats().unwrap()["control_requests"].as_u64().unwrap();
    assert_eq!(after - before, 4, "one request each");
}

/// A memfd holding `bytes`, as a client would spill them.
fn memfd(bytes: &[u8]) -> OwnedFd {
    // SAFETY: plain syscalls on a descriptor we own.
    unsafe {
        let fd = libc::memfd_create(c"spill".as_ptr(), libc::MFD_CLOEXEC);
        assert!(fd >= 0);
        assert_eq!(libc::write(fd, bytes.as_ptr().cast(), bytes.len()), bytes.len() as isize);
        OwnedFd::from_raw_fd(fd)
    }
}

#[test]
fn bad_spilled_requests_are_refused_and_harm_nothing() {
    let bed = Bed::new("rnspbad", 1);
    let raw = |bytes: &[u8], fds: &[i32]| -> String {
        // SAFETY: a new socket, owned at once.
        let sock = unsafe { OwnedFd::from_raw_fd(libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0)) };
        let ua = nix::sys::socket::UnixAddr::new(&bed.nics[0].sock).unwrap();
        nix::sys::socket::connect(sock.as_raw_fd(), &ua).unwrap();
        fdmsg::send_bytes(&sock, bytes, fds).unwrap();
        let mut buf = vec![0u8; fdmsg::MAX_MSG];
        let (n, _) = fdmsg::recv(&sock, &mut buf).unwrap().unwrap();
        String::from_utf8_lossy(&buf[..n]).into_owned()
    };
    let spilled = |len: u64| format!(r#"{{"Spilled":{{"len":{len}}}}}"#).into_bytes();
    let binary = |len: u64| format!(r#"{{"Spilled":{{"len":{len},"format":"Bincode"}}}}"#).into_bytes();
    // Bincode of LoadQpStates (variant index, then the states' count as a
    // varint) claiming 2^60 states in 10 bytes.
    let variant = bincode::DefaultOptions::new().serialize(&rnic::proto::Request::LoadQpStates { states: vec![] }).unwrap();
    let mut huge = variant[..variant.len() - 1].to_vec();
    huge.extend([0xfd, 0, 0, 0, 0, 0, 0, 0, 0x10]);
    let cases: Vec<(Vec<u8>, Option<OwnedFd>, &str)> = vec![
        (spilled(10), None, "needs its memfd"),
        (spilled(100), Some(memfd(b"{\"QueryDevice\"")), "shorter than it says"),
        (spilled(1 << 40), Some(memfd(b"\"QueryDevice\"")), "at most"),
        (spilled(spilled(13).len() as u64), Some(memfd(&spilled(13))), "inside a spilled"),
        (spilled(7), Some(memfd(b"garbage")), "malformed spilled"),
        (spilled(7), Some(std::fs::File::open("/dev/null").unwrap().into()), "must be in a memfd"),
        (binary(7), Some(memfd(b"garbage")), "malformed spilled"),
        (binary(huge.len() as u64), Some(memfd(&huge)), "malformed spilled"),
        (binary(3), Some(memfd(b"\"Qu")), "malformed spilled"),
    ];
    for (msg, fd, why) in &cases {
        let fds: Vec<i32> = fd.iter().map(|f| f.as_raw_fd()).collect();
        let r = raw(msg, &fds);
        assert!(r.contains("Err") && r.contains(why), "{}: {r}", String::from_utf8_lossy(msg));
    }
    // A well-formed spilled request is served like any other.
    let ok = br#""QueryDevice""#;
    let r = raw(&spilled(ok.len() as u64), &[memfd(ok).as_raw_fd()]);
    assert!(r.contains("Device"), "{r}");
    let ctx = bed.ctx(0);
    ctx.query_device().expect("rnicd serves on");
    let st = ctx.stats().unwrap();
    assert!(st["bad_client_requests"].as_u64().unwrap() >= cases.len() as u64, "{st}");
}
