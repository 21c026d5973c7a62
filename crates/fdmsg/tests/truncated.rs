//! Messages that do not arrive whole are errors, and leave no descriptor open.

use std::os::fd::{AsRawFd, OwnedFd};

use nix::sys::socket::{socketpair, AddressFamily, SockFlag, SockType};

fn pair() -> (OwnedFd, OwnedFd) {
    socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC).unwrap()
}

/// Tests count this process's descriptors: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

#[test]
fn whole_message_with_fds_arrives() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (a, b) = pair();
    let f = std::fs::File::open("/proc/self/exe").unwrap();
    fdmsg::send(&a, &serde_json::json!({"op": "hello", "n": 7}), &[f.as_raw_fd()]).unwrap();
    let (v, fds): (serde_json::Value, _) = fdmsg::recv_json(&b).unwrap().unwrap();
    assert_eq!(v["n"], 7);
    assert_eq!(fds.len(), 1);
    drop(a);
    assert!(fdmsg::recv_json::<serde_json::Value>(&b).unwrap().is_none(), "end of stream");
}

#[test]
fn truncated_data_is_an_error() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (a, b) = pair();
    let f = std::fs::File::open("/proc/self/exe").unwrap();
    let before = open_fds();
    fdmsg::send_bytes(&a, &[b'x'; 100], &[f.as_raw_fd()]).unwrap();
    let mut small = [0u8; 10];
    let e = fdmsg::recv(&b, &mut small).unwrap_err();
    assert!(matches!(e, fdmsg::Error::Truncated(10)), "{e}");
    assert_eq!(open_fds(), before, "the descriptor that came with it is closed");
    // The next message is read whole: the cut one did not leave a tail.
    fdmsg::send(&a, &"next", &[]).unwrap();
    let (v, _): (String, _) = fdmsg::recv_json(&b).unwrap().unwrap();
    assert_eq!(v, "next");
}

#[test]
fn too_many_fds_is_an_error_and_closes_them() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (a, b) = pair();
    let files: Vec<_> = (0..fdmsg::MAX_FDS + 3).map(|_| std::fs::File::open("/proc/self/exe").unwrap()).collect();
    let raw: Vec<_> = files.iter().map(|f| f.as_raw_fd()).collect();
    // The sender refuses to send more than MAX_FDS...
    assert!(matches!(fdmsg::send(&a, &1, &raw), Err(fdmsg::Error::TooManyFds { .. })));
    // ...and a receiver refuses them from a peer that does not.
    let iov = [std::io::IoSlice::new(b"1")];
    let cm = [nix::sys::socket::ControlMessage::ScmRights(&raw)];
    nix::sys::socket::sendmsg::<()>(a.as_raw_fd(), &iov, &cm, nix::sys::socket::MsgFlags::empty(), None).unwrap();
    let before = open_fds();
    let mut buf = [0u8; 64];
    let e = fdmsg::recv(&b, &mut buf).unwrap_err();
    assert!(matches!(e, fdmsg::Error::TooManyFds { n } if n == fdmsg::MAX_FDS + 3), "{e}");
    assert_eq!(open_fds(), before, "every received descriptor is closed");
}

#[test]
fn oversized_message_is_refused_by_the_sender() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (a, _b) = pair();
    let big = vec![0u8; fdmsg::MAX_MSG + 1];
    assert!(matches!(fdmsg::send_bytes(&a, &big, &[]), Err(fdmsg::Error::TooLarge(_))));
}

/// A socket that records arrival times hands each message's out beside
/// its descriptors; one that does not, none.
#[test]
fn arrival_time_comes_with_the_message_when_asked_for() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (a, b) = pair();
    let f = std::fs::File::open("/proc/self/exe").unwrap();
    let mut buf = vec![0u8; fdmsg::MAX_MSG];
    fdmsg::send(&a, &"plain", &[f.as_raw_fd()]).unwrap();
    let r = fdmsg::recv_stamped(&b, &mut buf).unwrap().unwrap();
    assert!(r.queued_at.is_none());
    assert_eq!(r.fds.len(), 1);

    nix::sys::socket::setsockopt(&b, nix::sys::socket::sockopt::ReceiveTimestampns, &true).unwrap();
    let before = std::time::SystemTime::now();
    fdmsg::send(&a, &"stamped", &[f.as_raw_fd()]).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    let r = fdmsg::recv_stamped(&b, &mut buf).unwrap().unwrap();
    assert_eq!(&buf[..r.len], b"\"stamped\"");
    assert_eq!(r.fds.len(), 1, "descriptors still arrive beside the time");
    let at = r.queued_at.expect("arrival time");
    assert!(at >= before - std::time::Duration::from_millis(5), "{at:?} {before:?}");
    assert!(at.elapsed().unwrap() >= std::time::Duration::from_millis(20), "queued before the receiver slept");
}

extern "C" fn on_usr1(_: libc::c_int) {}

/// A receive on a socket with a timeout (SO_RCVTIMEO, which the kernel
/// never restarts after a signal handler) that a signal interrupts goes on
/// waiting: the message sent after the signal is what it returns.
#[test]
fn a_signal_while_waiting_does_not_end_the_receive() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (a, b) = pair();
    let limit = nix::sys::time::TimeVal::new(10, 0);
    nix::sys::socket::setsockopt(&b, nix::sys::socket::sockopt::ReceiveTimeout, &limit).unwrap();
    // A handler (not the default action, which would end the process).
    let act = nix::sys::signal::SigAction::new(
        nix::sys::signal::SigHandler::Handler(on_usr1),
        nix::sys::signal::SaFlags::SA_RESTART,
        nix::sys::signal::SigSet::empty(),
    );
    unsafe { nix::sys::signal::sigaction(nix::sys::signal::Signal::SIGUSR1, &act) }.unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        tx.send(unsafe { libc::pthread_self() }).unwrap();
        let mut buf = [0u8; 64];
        fdmsg::recv(&b, &mut buf).map(|r| r.map(|(n, _)| buf[..n].to_vec()))
    });
    let thread = rx.recv().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(100));
    assert_eq!(unsafe { libc::pthread_kill(thread, libc::SIGUSR1) }, 0);
    std::thread::sleep(std::time::Duration::from_millis(100));
    fdmsg::send_bytes(&a, b"after the signal", &[]).unwrap();
    assert_eq!(waiter.join().unwrap().unwrap().unwrap(), b"after the signal");
}
