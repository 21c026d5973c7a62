//! rnicd's file descriptors against clients that take too many: a client
//! past its completion channel limit, and a daemon near its RLIMIT_NOFILE,
//! refuse the request with an error that says why; the client keeps its
//! connection and objects, other clients keep working, and once
//! descriptors are closed the same requests succeed.
mod common;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;

use common::*;
use nix::sys::socket::{connect, sendmsg, socket, AddressFamily, ControlMessage, MsgFlags, SockFlag, SockType, UnixAddr};
use rnic::proto::{Reply, Request, Response};
use verbs::*;

fn refusals(ctx: &Context) -> u64 {
    ctx.stats().unwrap()["descriptor_refusals"].as_u64().unwrap()
}

/// One WRITE between two fresh clients of hosts 0 and 1: rnicd serves.
fn transfer_works(bed: &Bed) {
    let (a, b) = pair_sized(bed, 0, 1, ConnectOpts::default(), 1 << 16, 16);
    a.buf.write(0, &pattern(3, 4096));
    a.qp.post_send(&[SendWr::write(1, &[a.mr.sge(0, 4096)], b.mr.addr, b.mr.rkey)]).unwrap();
    assert_eq!(ok(&a.scq).wr_id, 1);
    assert_eq!(b.buf.read(0, 4096), pattern(3, 4096));
}

/// A client of `sock` that sends a request with `n` descriptors beside
/// it, more than rnicd has free: the kernel installs what fits and flags
/// the message. Returns rnicd's answer to it and to a query after it on
/// the same connection.
fn request_with_too_many_fds(sock: &Path, n: usize) -> (Response, Response) {
    let s = socket(AddressFamily::Unix, SockType::SeqPacket, SockFlag::SOCK_CLOEXEC, None).unwrap();
    connect(s.as_raw_fd(), &UnixAddr::new(sock).unwrap()).unwrap();
    let devnull: Vec<OwnedFd> = (0..n).map(|_| std::fs::File::open("/dev/null").unwrap().into()).collect();
    let raw: Vec<i32> = devnull.iter().map(|f| f.as_raw_fd()).collect();
    let bytes = serde_json::to_vec(&Request::QueryDevice).unwrap();
    let iov = [std::io::IoSlice::new(&bytes)];
    sendmsg::<UnixAddr>(s.as_raw_fd(), &iov, &[ControlMessage::ScmRights(&raw)], MsgFlags::empty(), None).unwrap();
    let first = fdmsg::recv_json::<Response>(&s).unwrap().expect("an answer").0;
    fdmsg::send(&s, &Request::QueryDevice, &[]).unwrap();
    let second = fdmsg::recv_json::<Response>(&s).unwrap().expect("an answer").0;
    (first, second)
}

#[test]
fn a_client_past_its_channel_limit_is_refused_and_others_are_not() {
    let bed = Bed::with_args("rnfdch", 2, &["--max-channels-per-client", "8"]);
    let a = bed.ctx(0);
    let mut held: Vec<CompChannel> = (0..8).map(|_| a.create_comp_channel().unwrap()).collect();
    let err = a.create_comp_channel().map(|_| ()).expect_err("a ninth channel is refused");
    assert!(format!("{err:#}").contains("--max-channels-per-client"), "{err:#}");
    assert_eq!(refusals(&a), 1);
    // The client keeps its connection and objects: a CQ on a channel it holds.
    let cq = a.create_cq(16, Some(&held[0])).unwrap();
    // Another client has a limit of its own.
    let b = bed.ctx(0);
    let others: Vec<CompChannel> = (0..8).map(|_| b.create_comp_channel().unwrap()).collect();
    // A closed channel makes room again.
    held.pop();
    held.push(a.create_comp_channel().expect("room after closing one"));
    transfer_works(&bed);
    drop((cq, held, others));
}

#[test]
fn a_daemon_short_of_descriptors_refuses_requests_and_keeps_its_clients() {
    const LIMIT: usize = 200;
    let nofile = format!("--nofile={LIMIT}:{LIMIT}");
    let bed = Bed::under("rnfdlim", 2, &["prlimit", &nofile, "--"], &["--max-channels-per-client", "100000"]);
    let a = bed.ctx(0);
    let mut held = Vec::new();
    let err = loop {
        match a.create_comp_channel() {
            Ok(c) => held.push(c),
            Err(e) => break e,
        }
        assert!(held.len() < LIMIT, "{} channels under a limit of {LIMIT} descriptors", held.len());
    };
    assert!(format!("{err:#}").contains("short of file descriptors"), "{err:#}");
    // rnicd's own descriptors (a dozen here) and the reserve (64) leave
    // well over 72 for channels: a refusal before that came too early.
    assert!(held.len() > 72, "refused after {} channels: the reserve is larger than it should be", held.len());
    // The client is still connected and its objects still work.
    a.query_device().unwrap();
    a.create_cq(16, Some(&held[0])).map(|_| ()).expect_err("a CQ passes a memfd: refused too");
    // Descriptors the kernel could not install: the request is answered
    // (refused), and its connection serves the next one.
    let pid = bed.nics[0].pid().unwrap();
    let open = || std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count();
    let before = open();
    match request_with_too_many_fds(&bed.nics[0].sock, 200) {
        (Err(e), Ok(Reply::Device(_))) => assert!(e.contains("short of file descriptors"), "{e}"),
        other => panic!("{other:?}"),
    }
    // What the kernel did install was closed (the connection is gone too).
    reaches(|| (open() <= before) as u64, 1, "rnicd's descriptors back to their count");
    // A new client still gets in (the reserve for clients is smaller) and
    // is refused only what needs descriptors, with the same answer.
    let b = bed.ctx(0);
    b.query_device().unwrap();
    let err = b.alloc_pd().and_then(|pd| b.create_cq(16, None).map(|cq| (pd, cq))).map(|_| ()).expect_err("short");
    assert!(format!("{err:#}").contains("short of file descriptors"), "{err:#}");
    assert!(refusals(&b) >= 2);
    // Closing channels gives the descriptors back: the same requests work.
    held.truncate(10);
    let cq = a.create_cq(16, Some(&held[0])).unwrap();
    let bcq = b.create_cq(16, None).unwrap();
    transfer_works(&bed);
    drop((cq, bcq, held));
}
