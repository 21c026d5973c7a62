//! Injected failures: whatever breaks, the source VM runs on with its memory
//! intact, and a destination that did not get everything never runs.
//!
//! The cases that take a [`Net`] run over the rdma transport as well (two
//! testbed hosts, a real rnicd on each, the VMs in this process). Over TCP
//! a proxy flips bytes of a data connection; the rdma transport's data does
//! not cross the proxy (and a packet with a bad ICRC is dropped and resent),
//! so there the damage is made by the source's `testing` parameter where no
//! transport checksum covers it: a page WRITTEN from a damaged copy, a
//! compressed page or a batch table damaged after its hash was taken. The
//! control connection (and the state on it) is TCP on both transports and
//! goes through the proxy on both. A cut or vanished data connection over
//! rdma is a cut link or a killed destination: `rdma_e2e`.

mod common;
use common::*;
use migration::qmp::Outcome;
use migration::vm::MigratableVm;
use migration::wire;
use serde_json::json;
use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

/// A source running the dirtier over 32 MiB.
fn running_source() -> Side {
    running_source_on(&Net::Tcp)
}

/// [`running_source`] over `net`, its dirtier past its first pass: until
/// it has written its slice once, most of RAM is never-written memory
/// (memfd holes) that goes as zero runs of a few bytes, and on a loaded
/// machine a migration could then end with a few hundred KiB on the wire,
/// before a fault placed in its data is reached. After a whole pass every
/// page is data and the dirtier rewrites all of it in each round.
fn running_source_on(net: &Net) -> Side {
    let src = Side::on(net, 32 * MIB, 1);
    src.vm.resume().unwrap();
    wait_until("a whole pass of the dirtier", || src.vm.progress() >= 2);
    src
}

/// After a failed migration: the source is running at full speed, its
/// memory passes the oracle, and it can still migrate successfully.
fn assert_source_intact(src: &Side) {
    assert_source_intact_on(&Net::Tcp, src)
}

/// [`assert_source_intact`], the second migration over `net`.
fn assert_source_intact_on(net: &Net, src: &Side) {
    assert!(!src.vm.is_paused(), "the source must run on");
    assert_eq!(src.vm.throttle(), 0, "throttle must be lifted");
    run_and_check_oracle(&src.vm, Duration::from_millis(100));
    src.vm.resume().unwrap();
    let dst = Side::on(net, 32 * MIB, 1);
    let port = dst.incoming_on(net, true, false);
    let (os, od, st) = migrate_on(net, src, &dst, port, json!({"downtime_ms": 100}));
    assert_eq!(os, Some(Outcome::OutgoingCompleted), "{}: {st:#}", net.name());
    assert_eq!(st["committed"], true);
    assert_eq!(st["transport"], net.name());
    assert_eq!(od, Some(Outcome::IncomingCompleted { resumed: true }));
    // Migrated away: this VM is not sent anywhere again.
    let again = src.cmd("migrate", net.migrate_args(port, json!({}))).unwrap_err();
    assert!(again.desc.contains("already migrated away"), "{}", again.desc);
    dst.vm.pause().unwrap();
    dst.vm.check_oracle().unwrap();
}

fn assert_dest_never_ran(dst: &Side, what: &str) -> String {
    let o = dst.slot.wait();
    let Some(Outcome::IncomingFailed(e)) = o else { panic!("{what}: destination outcome {o:?}") };
    assert!(dst.vm.is_paused(), "{what}: the destination must never run");
    e
}

/// A running source, a destination listening, and between them a proxy
/// that injects `fault`.
fn pair_through(fault: Fault) -> (Side, Side, Proxy) {
    pair_through_on(&Net::Tcp, fault)
}

fn pair_through_on(net: &Net, fault: Fault) -> (Side, Side, Proxy) {
    let src = running_source_on(net);
    let dst = Side::on(net, 32 * MIB, 1);
    let proxy = Proxy::start(dst.incoming_on(net, true, false), fault);
    (src, dst, proxy)
}

/// The proxy passes every byte untouched.
const NO_FAULT: Fault = Fault { conn: usize::MAX, flip_at: None, cut_after: None, stall_after: None };

/// A flip of the byte at `at` of connection `conn`.
fn flip(conn: usize, at: u64) -> Fault {
    Fault { conn, flip_at: Some(at), ..Default::default() }
}

/// Migrate over `net` through a proxy with `fault` (and the source's
/// `testing` fault, if `params` names one): the migration must fail, the
/// destination never run, the source run on intact and migrate again.
/// Returns the source's and the destination's errors.
fn expect_failure(net: &Net, fault: Fault, params: serde_json::Value) -> (String, String) {
    let (src, dst, proxy) = pair_through_on(net, fault);
    // Pages below the dirtier's slice (16) hold data it never changes: sent
    // once, in the first batch of the first channel.
    src.vm.fill(0, 16);
    let (os, _, st) = migrate_on(net, &src, &dst, proxy.port, params);
    if fault.conn != usize::MAX {
        assert!(proxy.fired.load(std::sync::atomic::Ordering::SeqCst), "the fault was never injected");
    }
    let Some(Outcome::OutgoingFailed(se)) = os else { panic!("{}: source outcome {os:?}: {st:#}", net.name()) };
    assert_eq!(st["status"], "failed");
    assert_eq!(st["committed"], false, "a failure before the destination took over");
    let de = assert_dest_never_ran(&dst, "fault");
    assert_source_intact_on(net, &src);
    (se, de)
}

// Data channel 0 starts with a 16-byte preamble, a ~60-byte greeting and
// the first batch: 13 bytes of head, a table of ~530 bytes (a run of 64
// pages and their hashes), its checksum, then the pages from page 0 on.

#[test]
fn corrupted_batch_table_is_detected() {
    for net in Net::each("fltable") {
        let (fault, testing) = match net {
            Net::Tcp => (flip(1, 300), ""),
            // In the SEND that carries the table, after its checksum.
            Net::Rdma(_) => (NO_FAULT, "corrupt-table"),
        };
        let (_se, de) = expect_failure(&net, fault, json!({"channels": 1, "testing": testing}));
        assert!(de.contains("corrupted stream") && de.contains("table"), "{}: {de}", net.name());
    }
}

#[test]
fn corrupted_page_that_is_never_sent_again_fails_the_migration() {
    for net in Net::each("flpage") {
        let (fault, testing) = match net {
            // Inside page 4 (bytes ~17k-21k), which the guest never writes
            // again: no later round replaces it.
            Net::Tcp => (flip(1, 20_000), ""),
            // Page 0, WRITTEN from a damaged copy.
            Net::Rdma(_) => (NO_FAULT, "corrupt-write"),
        };
        let (_se, de) = expect_failure(&net, fault, json!({"channels": 1, "testing": testing}));
        assert!(de.contains("corrupted stream") && de.contains("1 pages arrived damaged"), "{}: {de}", net.name());
    }
}

/// A compressed page damaged after its hash was taken (over rdma: in the
/// SEND that carries it). Pages 0-15 compress and are never written
/// again, so the first compressed page is never replaced.
#[test]
fn corrupted_compressed_page_that_is_never_sent_again_fails_the_migration() {
    for net in Net::each("flcomp") {
        let (_se, de) = expect_failure(&net, NO_FAULT, json!({"channels": 1, "compress": "lz4", "testing": "corrupt-compressed"}));
        assert!(de.contains("corrupted stream") && de.contains("1 pages arrived damaged"), "{}: {de}", net.name());
    }
}

#[test]
fn corrupted_state_on_control_connection_is_detected() {
    for net in Net::each("flstate") {
        // The control connection carries hello (~200 bytes) then, at the
        // end, the state blob; flip a byte inside the blob. It is TCP over
        // the rdma transport too.
        let (_se, de) = expect_failure(&net, flip(0, 2000), json!({"channels": 1}));
        assert!(de.contains("checksum") || de.contains("corrupt"), "{}: {de}", net.name());
    }
}

#[test]
fn the_testing_parameter_takes_known_faults_only() {
    let src = Side::new(16 * MIB, 1);
    let e = src.cmd("migrate-set-parameters", json!({"testing": "flip-everything"})).unwrap_err();
    assert!(e.desc.contains("corrupt-write"), "{e}");
}

#[test]
fn dropped_data_connection_mid_migration() {
    // Cut the first data channel early: it always carries pages, however the
    // others share the work, so the fault fires whatever the machine's speed.
    let (se, de) = expect_failure(&Net::Tcp, Fault { conn: 1, cut_after: Some(256 << 10), ..Default::default() }, json!({"channels": 4}));
    assert!(!se.is_empty() && !de.is_empty());
}

#[test]
fn destination_gone_mid_migration() {
    // All of the destination disappears: the source sees resets everywhere.
    let (src, dst, proxy) = pair_through(Fault { conn: 1, cut_after: Some(1 << 20), ..Default::default() });
    src.cmd("migrate", json!({"uri": format!("tcp:127.0.0.1:{}", proxy.port), "channels": 1})).unwrap();
    wait_until("the fault", || proxy.fired.load(std::sync::atomic::Ordering::SeqCst));
    dst.cmd("migrate-cancel", json!({})).unwrap(); // the destination gives up too
    let os = src.slot.wait();
    assert!(matches!(os, Some(Outcome::OutgoingFailed(_))), "{os:?}");
    assert_dest_never_ran(&dst, "destination gone");
    assert_source_intact(&src);
}

#[test]
fn timeout_cancels_cleanly() {
    for net in Net::each("fltime") {
        let src = running_source_on(&net);
        let dst = Side::on(&net, 32 * MIB, 1);
        let port = dst.incoming_on(&net, true, false);
        // 2 MB/s for 32 MiB cannot finish in 2 s.
        let (os, _, st) = migrate_on(&net, &src, &dst, port, json!({"max_bandwidth": 2_000_000u64, "timeout_s": 2}));
        assert!(matches!(os, Some(Outcome::OutgoingFailed(_))), "{}: {os:?}", net.name());
        assert_eq!(st["status"], "cancelled", "{st:#}");
        assert!(st["error"].as_str().unwrap().contains("time"), "{st:#}");
        assert_dest_never_ran(&dst, "timeout");
        assert_source_intact_on(&net, &src);
    }
}

#[test]
fn hybrid_with_a_stalled_destination_is_cancelled_after_its_timeout() {
    // The destination stops reading a data connection: hybrid's timeout
    // cuts its round short, but the stalled batch never drains and the
    // round is never confirmed, so switching to postcopy is no way out.
    // It must end (cancelled), not wait for the connection for good.
    // The stall lands in the first eighth (4 MiB, all data: the dirtier is
    // past its first pass), so hybrid cannot switch after the eighth.
    let (src, dst, proxy) = pair_through(Fault { conn: 1, stall_after: Some(1 << 20), ..Default::default() });
    let (os, _, st) = migrate(&src, &dst, proxy.port, json!({"mode": "hybrid", "channels": 1, "timeout_s": 2}));
    assert!(proxy.fired.load(std::sync::atomic::Ordering::SeqCst), "the stall was never injected");
    assert!(matches!(os, Some(Outcome::OutgoingFailed(_))), "{os:?}");
    assert_eq!(st["status"], "cancelled", "{st:#}");
    assert!(st["error"].as_str().unwrap().contains("timed out"), "{st:#}");
    assert_eq!(st["committed"], false);
    assert_dest_never_ran(&dst, "stalled destination");
    assert_source_intact(&src);
}

#[test]
fn migrate_cancel_by_command() {
    for net in Net::each("flcancel") {
        let src = running_source_on(&net);
        let dst = Side::on(&net, 32 * MIB, 1);
        let port = dst.incoming_on(&net, true, false);
        src.cmd("migrate", net.migrate_args(port, json!({"max_bandwidth": 4_000_000u64}))).unwrap();
        wait_until("the migration to be active", || src.cmd("query-migrate", json!({})).unwrap()["status"] == "active");
        src.cmd("migrate-cancel", json!({})).unwrap();
        let os = src.slot.wait();
        assert!(matches!(os, Some(Outcome::OutgoingFailed(_))), "{}: {os:?}", net.name());
        assert_eq!(src.cmd("query-migrate", json!({})).unwrap()["status"], "cancelled");
        assert_dest_never_ran(&dst, "cancel");
        assert_source_intact_on(&net, &src);
    }
}

#[test]
fn newer_stream_version_is_refused_by_destination() {
    let dst = Side::new(32 * MIB, 1);
    let port = dst.incoming(true);
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    wire::write_preamble(&mut s, wire::VERSION + 1, wire::ROLE_CONTROL).unwrap();
    let e = assert_dest_never_ran(&dst, "version");
    assert!(e.contains(&format!("version {} is not supported", wire::VERSION + 1)), "{e}");
    // The reply is our own preamble, so the peer can tell why.
    let mut buf = [0u8; 16];
    s.read_exact(&mut buf).unwrap();
    assert_eq!(&buf[..8], b"TRNSTMIG");
}

#[test]
fn destination_speaking_another_version_is_refused_by_source() {
    let src = running_source();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let fake = std::thread::spawn(move || {
        let (mut c, _) = l.accept().unwrap();
        let mut b = [0u8; 16];
        c.read_exact(&mut b).unwrap();
        wire::write_preamble(&mut c, 7, wire::ROLE_CONTROL).unwrap();
        std::thread::sleep(Duration::from_millis(200));
    });
    src.cmd("migrate", json!({"uri": format!("tcp:127.0.0.1:{port}")})).unwrap();
    let os = src.slot.wait();
    let Some(Outcome::OutgoingFailed(e)) = os else { panic!("{os:?}") };
    assert!(e.contains("destination: the peer speaks stream version 7; this build speaks version"), "{e}");
    fake.join().unwrap();
    assert_source_intact(&src);
}

#[test]
fn shape_mismatch_is_refused() {
    for net in Net::each("flshape") {
        let src = running_source_on(&net);
        let dst = Side::on(&net, 16 * MIB, 1);
        let port = dst.incoming_on(&net, true, false);
        let (os, _, _) = migrate_on(&net, &src, &dst, port, json!({}));
        let Some(Outcome::OutgoingFailed(e)) = os else { panic!("{}: {os:?}", net.name()) };
        assert!(e.contains("shape differs"), "{e}");
        assert_dest_never_ran(&dst, "shape");
        assert_source_intact_on(&net, &src);
    }
}

#[test]
fn bad_commands_get_clear_errors() {
    let src = Side::new(16 * MIB, 1);
    for (cmd, args) in [
        ("migrate", json!({})),
        ("migrate", json!({"uri": "nonsense"})),
        ("migrate", json!({"uri": "tcp:127.0.0.1:1", "channels": 0})),
        ("migrate", json!({"uri": "tcp:127.0.0.1:1", "compress": "gzip"})),
        ("migrate-incoming", json!({"uri": "tcp:256.1.1.1:5"})),
        ("migrate-set-parameters", json!({"downtime_ms": "soon"})),
        ("no-such-command", json!({})),
    ] {
        let e = src.cmd(cmd, args.clone()).err();
        let ok_async = cmd == "migrate" && args.get("uri").is_some_and(|u| u == "nonsense");
        if ok_async {
            // Accepted, then fails in the engine with a clear message.
            let o = src.slot.wait();
            assert!(matches!(o, Some(Outcome::OutgoingFailed(ref m)) if m.contains("address")), "{o:?}");
        } else {
            assert!(e.is_some(), "{cmd} {args} must fail");
        }
    }
    let p = src.cmd("migrate-set-parameters", json!({"channels": 3, "compress": "zstd:5"})).unwrap();
    assert_eq!(p["channels"], 3);
    assert_eq!(src.cmd("query-migrate-parameters", json!({})).unwrap()["compress"], "zstd:5");
}
