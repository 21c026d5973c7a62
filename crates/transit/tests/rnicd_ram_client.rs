//! rnicd as a postcopy RAM client, with real processes and no device: a
//! destination vmm receives a VM by postcopy while a bare-metal peer READs
//! from and WRITEs into a memory region that rnicd maps over that vmm's
//! guest RAM, on pages that have not arrived yet. Joined, rnicd's accesses
//! wait for the pages: the peer never reads zeros or a stale page, and what
//! it wrote is neither lost to the page's later arrival nor written onto a
//! hole. Not joined (the control), the same READ returns the hole's zeros.
//!
//! Host 0 runs the source and destination vmms and rnicd 0, which holds the
//! "guest side" QP and the memory region; host 1 runs the peer's rnicd.
//! The test process drives both QPs through the verbs API (control sockets
//! are files) and plays the part of the vmm's device: it takes the guest
//! RAM memfd from the destination's RAM socket and hands rnicd one end.

use migration::postcopy::clients::RamClient;
use serde_json::{json, Value};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;
use std::time::{Duration, Instant};
use testbed::rnicd::Rnicd;
use testbed::{Testbed, TestbedOpts};
use verbs::{access, ConnectOpts, Context, MemBuf, QpInitAttr, SendWr, Sge, WcStatus};
use vmm::testing::{transit_bin, unique_name, TempPath, VmProcess};

const MIB: u64 = 1 << 20;
const RAM: u64 = 64 * MIB;
const PAGE: u64 = 4096;
const T: Duration = Duration::from_secs(60);

/// Fields drop in order: VMs, then rnicd processes, then the testbed.
struct Bed {
    src: VmProcess,
    dst: VmProcess,
    nics: Vec<Rnicd>,
    _tb: Testbed,
    ram_sock: TempPath,
}

/// `transit rnicd` on host `i`, on the fixture's temporary socket.
fn start_rnicd(tb: &Testbed, i: usize) -> Rnicd {
    Rnicd::start_cmd(tb, i, &[transit_bin().to_str().unwrap(), "rnicd"], None, &[]).expect("start rnicd")
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < T, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn status(vm: &VmProcess) -> Value {
    vm.exec("query-migrate", json!({})).unwrap()
}

fn bed(tag: &str) -> Bed {
    let tb = Testbed::create(TestbedOpts::new(tag, 2)).expect("testbed (needs root)");
    let nics: Vec<Rnicd> = (0..2).map(|i| start_rnicd(&tb, i)).collect();
    let name = unique_name(tag);
    let src = VmProcess::start(
        tb.host(0).command(transit_bin()),
        &name,
        &["vm", "run", "--name", &name, "--memory", "64M", "--workload", "fill", "--keep-after-migrate"],
    )
    .unwrap();
    let ram_sock = TempPath::new(&format!("{name}.ram.sock"));
    let dname = format!("{name}-d");
    let dst = VmProcess::start(
        tb.host(0).command(transit_bin()),
        &dname,
        &[
            "vm",
            "run",
            "--name",
            &dname,
            "--memory",
            "64M",
            "--workload",
            "fill",
            "--incoming",
            "tcp:127.0.0.1:4444",
            "--paused",
            "--ram-socket",
            ram_sock.path().to_str().unwrap(),
        ],
    )
    .unwrap();
    wait_for("the RAM socket", || ram_sock.path().exists());
    Bed { src, dst, nics, _tb: tb, ram_sock }
}

/// All of a paused VM's RAM.
fn ram_of(vm: &VmProcess) -> Vec<u8> {
    let f = TempPath::new(&unique_name("ram"));
    vm.exec("pmemsave", json!({"val": 0, "size": RAM, "filename": f.path()})).unwrap();
    std::fs::read(f.path()).unwrap()
}

/// A connection to the vmm's RAM socket that said hello and whose welcome
/// has arrived (not read): what the vmm's own device hands rnicd.
fn admitted_socket(path: &Path) -> OwnedFd {
    use nix::sys::socket::{connect, socket, AddressFamily, SockFlag, SockType, UnixAddr};
    let s = socket(AddressFamily::Unix, SockType::SeqPacket, SockFlag::SOCK_CLOEXEC, None).unwrap();
    connect(s.as_raw_fd(), &UnixAddr::new(path).unwrap()).unwrap();
    ram_client::send(s.as_fd(), &json!({"op": "hello", "name": "rnicd"}), None).unwrap();
    let mut fds = [nix::poll::PollFd::new(s.as_fd(), nix::poll::PollFlags::POLLIN)];
    assert_eq!(nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(5000u16)).unwrap(), 1, "no welcome from the vmm");
    s
}

/// The nice values of the threads of the rnicd that serves `sock`.
fn rnicd_thread_nices(sock: &Path) -> Vec<i64> {
    let sock = sock.to_str().unwrap();
    let pid = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .find(|pid| {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let args: Vec<&[u8]> = cmd.split(|&b| b == 0).collect();
            args.contains(&b"rnicd".as_slice()) && args.contains(&sock.as_bytes())
        })
        .expect("rnicd's process");
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|t| {
            let stat = std::fs::read_to_string(t.ok()?.path().join("stat")).ok()?;
            // Field 19 (nice), counted after the command name's ")".
            stat.rsplit_once(')')?.1.split_whitespace().nth(16)?.parse().ok()
        })
        .collect()
}

/// Copies `data` to the start of the peer's buffer (no operation in flight).
fn put(buf: &MemBuf, data: &[u8]) {
    assert!(data.len() <= buf.len());
    // SAFETY: inside the buffer; rnicd does not touch it between operations.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), buf.as_ptr(), data.len()) };
}

/// The first `len` bytes of the peer's buffer.
fn get(buf: &MemBuf, len: u64) -> Vec<u8> {
    assert!(len as usize <= buf.len());
    // SAFETY: as in `put`.
    unsafe { std::slice::from_raw_parts(buf.as_ptr(), len as usize) }.to_vec()
}

#[test]
fn peer_reads_and_writes_pages_not_yet_migrated_through_a_joined_rnicd() {
    run(true);
}

#[test]
fn without_joining_rnicd_reads_holes_as_zeros() {
    run(false);
}

fn run(join: bool) {
    let b = bed(if join { "rcjoin" } else { "rcnone" });
    b.src.wait_progress(1, T).unwrap();
    // A stopped source: every page the destination should end up with is
    // known before the migration starts.
    b.src.exec("stop", json!({})).unwrap();
    let mut want = ram_of(&b.src);

    // The guest's side on host 0: an MR over all of the destination's guest
    // RAM (I/O address = guest physical address), as the PVRDMA device has.
    let memfd = {
        let c = RamClient::connect(b.ram_sock.path(), "test-mr").unwrap();
        c.memfd.try_clone().unwrap()
        // The connection closes here: the vmm drops this client at advise.
    };
    let ctx0 = Context::open(Some(&b.nics[0].sock)).unwrap();
    if join {
        assert_eq!(ctx0.join_ram_client(admitted_socket(b.ram_sock.path())).unwrap(), RAM);
    }
    let pd0 = ctx0.alloc_pd().unwrap();
    let mr = pd0.reg_mr_fd(memfd.as_raw_fd(), 0, RAM as usize, access::ALL, 0).unwrap();
    let (scq0, rcq0) = (ctx0.create_cq(64, None).unwrap(), ctx0.create_cq(64, None).unwrap());
    let qp0 = pd0.create_qp(&QpInitAttr::new(&scq0, &rcq0)).unwrap();

    // The bare-metal peer on host 1.
    let ctx1 = Context::open(Some(&b.nics[1].sock)).unwrap();
    let pd1 = ctx1.alloc_pd().unwrap();
    let buf = MemBuf::new(MIB as usize).unwrap();
    let lmr = pd1.reg_mr(&buf, 0, buf.len(), access::ALL).unwrap();
    let (scq1, rcq1) = (ctx1.create_cq(64, None).unwrap(), ctx1.create_cq(64, None).unwrap());
    let qp1 = pd1.create_qp(&QpInitAttr::new(&scq1, &rcq1)).unwrap();
    qp0.connect(&qp1.endpoint(100), &ConnectOpts { sq_psn: 200, ..Default::default() }).unwrap();
    qp1.connect(&qp0.endpoint(200), &ConnectOpts { sq_psn: 100, ..Default::default() }).unwrap();
    let op = |wr: SendWr| {
        qp1.post_send(&[wr]).unwrap();
        let wc = scq1.wait(1, T).unwrap()[0];
        assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
    };
    let read = |gpa: u64, len: u64| -> Vec<u8> {
        put(&buf, &vec![0xee; len as usize]);
        op(SendWr::read(1, &[Sge { addr: lmr.addr, length: len as u32, lkey: lmr.lkey }], gpa, mr.rkey));
        get(&buf, len)
    };

    // 256 KiB/s until the checks below are done: the push moves 64 pages a
    // second, so the pages they touch are still missing when touched,
    // however slowly the test runs on a loaded host. The cap is lifted
    // for the rest.
    b.src.exec("migrate", json!({"uri": "tcp:127.0.0.1:4444", "mode": "postcopy", "max_bandwidth": 256 * 1024})).unwrap();
    wait_for("postcopy", || status(&b.dst)["status"] == "postcopy-active");
    let before = status(&b.dst);
    assert!(before["remaining_pages"].as_u64().unwrap() > 8000, "{before:#}");

    if !join {
        // A page far up guest RAM is still a hole on the destination.
        let got = read(16000 * PAGE, PAGE);
        assert!(got.iter().all(|&x| x == 0), "rnicd read the page although it had not arrived and rnicd did not join");
        return;
    }

    // READs of pages not yet here, one page and several pages at once.
    for (first, pages) in [(16000u64, 1u64), (9000, 1), (12345, 1), (15000, 16)] {
        let (gpa, len) = (first * PAGE, pages * PAGE);
        let got = read(gpa, len);
        for p in 0..pages as usize {
            let page = &got[p * PAGE as usize..][..PAGE as usize];
            assert!(page.iter().any(|&x| x != 0), "page {} read as zeros", first + p as u64);
        }
        assert!(got == want[gpa as usize..][..len as usize], "pages {first}+{pages} differ from the source");
    }

    // WRITEs into pages not yet here: a few bytes in one page, and a run
    // across three pages. Read back at once, then the page's arrival must
    // not undo them (checked on the whole RAM at the end).
    for (gpa, len, seed) in [(14000 * PAGE + 1000, 100u64, 7u8), (13000 * PAGE + 2000, 2 * PAGE + 500, 9)] {
        let data: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
        put(&buf, &data);
        op(SendWr::write(2, &[Sge { addr: lmr.addr, length: len as u32, lkey: lmr.lkey }], gpa, mr.rkey));
        want[gpa as usize..][..len as usize].copy_from_slice(&data);
        let (first, last) = (gpa / PAGE * PAGE, (gpa + len).div_ceil(PAGE) * PAGE);
        let got = read(first, last - first);
        assert!(got == want[first as usize..last as usize], "WRITE at {gpa:#x}: the pages read back are not source + write");
    }
    let during = status(&b.dst);
    assert!(during["remaining_pages"].as_u64().unwrap() > 0, "the migration ended before the checks: {during:#}");
    // While the vmm it serves is in postcopy, rnicd's event loop runs
    // ahead of the push (nice -10), and only then.
    assert_eq!(ctx0.stats().unwrap()["ram_clients_in_postcopy"], 1);
    let nices = rnicd_thread_nices(&b.nics[0].sock);
    assert!(nices.contains(&-10), "no thread of rnicd at nice -10 during postcopy: {nices:?}");
    // What the faults cost rnicd, as the destination reports it so far:
    // some, and waited for. Not how many: a fault maps the arrived pages
    // after the one it waited for too (fault-around), so how many of the
    // accesses above fault depends on what the push had placed by then.
    let waits = &during["fault_waits"];
    assert_eq!(waits[1]["name"], "rnicd", "{waits:#}");
    // The destination reads these at the query, not at its last periodic
    // update, and counts a wait before it wakes the thread: the accesses
    // above may all end within one update period. On failure, the whole
    // status: whether the push outran the test's accesses (remaining
    // pages, bytes and rate so far).
    assert!(
        waits[1]["faults"].as_u64().unwrap() >= 1 && waits[1]["wait_ms"].as_f64().unwrap() > 0.0,
        "rnicd's faults: {waits:#}\nthe destination now: {during:#}\nat postcopy-active: {before:#}\nthe source now: {:#}",
        status(&b.src)
    );

    b.src.exec("migrate-set-parameters", json!({"max_bandwidth": 0})).unwrap();
    wait_for("the destination to complete", || {
        let s = status(&b.src);
        assert_ne!(s["status"], "failed", "{s:#}");
        status(&b.dst)["status"] == "completed"
    });
    let d = status(&b.dst);
    assert_eq!(d["ram_clients"], 1, "{d:#}");
    assert_eq!(ctx0.stats().unwrap()["ram_clients_in_postcopy"], 0);
    let nices = rnicd_thread_nices(&b.nics[0].sock);
    assert!(!nices.contains(&-10), "rnicd kept nice -10 after postcopy: {nices:?}");
    // The VM stayed paused: no fault was the vmm's own, and rnicd's are
    // counted as its own.
    let waits = &d["fault_waits"];
    assert_eq!((&waits[0]["name"], &waits[0]["faults"]), (&json!("vmm"), &json!(0)), "{waits:#}");
    assert_eq!(waits[1]["faults"], d["faults"], "{waits:#}");
    // The destination VM stayed paused: every fault was rnicd's.
    assert!(d["faults"].as_u64().unwrap() >= 4, "{d:#}");
    eprintln!(
        "rnicd's faults: {}, wait per fault p50 {} us, p99 {} us, max {} us",
        d["faults"], d["fault_p50_us"], d["fault_p99_us"], d["fault_max_us"]
    );
    let got = ram_of(&b.dst);
    let bad: Vec<usize> = (0..(RAM / PAGE) as usize).filter(|&p| got[p * 4096..][..4096] != want[p * 4096..][..4096]).collect();
    assert!(bad.is_empty(), "{} pages differ from source + peer writes, first {:?}", bad.len(), &bad[..bad.len().min(8)]);
}

/// The wiring: a destination vmm (`--incoming`) with a PVRDMA device makes
/// that device's rnicd a RAM client by itself, and rnicd lets go of it when
/// the vmm goes away; a vmm that is not a destination does not.
#[test]
fn an_incoming_pvrdma_vm_makes_its_rnicd_a_ram_client() {
    let tb = Testbed::create(TestbedOpts::new("rcwire", 1)).expect("testbed (needs root)");
    let h = tb.host(0);
    let nic = start_rnicd(&tb, 0);
    let sock = nic.sock.clone();
    let gid = tb.spare_addr(0, 0);
    h.sh(&format!("ip addr add {gid}/24 dev eth0")).unwrap();
    let spec = format!("gid={gid},rnicd={}", sock.display());
    let ctx = Context::open(Some(&sock)).unwrap();
    let joined = || ctx.stats().unwrap()["ram_clients"].as_u64().unwrap();

    let name = unique_name("rcwire");
    let vm = |name: &str, incoming: bool| {
        let mut args = vec!["vm", "run", "--name", name, "--memory", "64M", "--workload", "idle", "--pvrdma", &spec];
        if incoming {
            args.extend(["--incoming", "tcp:127.0.0.1:4444"]);
        }
        VmProcess::start(h.command(transit_bin()), name, &args).unwrap()
    };
    let mut plain = vm(&name, false);
    plain.status().unwrap();
    assert_eq!(joined(), 0, "a VM that is not a migration destination needs no RAM client");
    plain.kill();

    let mut dst = vm(&format!("{name}-d"), true);
    dst.status().unwrap();
    assert_eq!(joined(), 1);
    dst.kill();
    wait_for("rnicd to let the vmm go", || joined() == 0);
}

/// Bad input: a socket without the vmm's welcome, or a welcome whose
/// memory is not a sealed memfd, is refused with a clear error; rnicd goes
/// on serving and joined nothing.
#[test]
fn join_requests_without_a_proper_welcome_are_refused() {
    use nix::sys::socket::{socketpair, AddressFamily, SockFlag, SockType};
    let tb = Testbed::create(TestbedOpts::new("rcbad", 1)).expect("testbed (needs root)");
    let nic = start_rnicd(&tb, 0);
    let sock = nic.sock.clone();
    let ctx = Context::open(Some(&sock)).unwrap();
    let pair = || socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC).unwrap();

    // Nothing queued: rnicd must not wait for it.
    let (_vmm, theirs) = pair();
    let t0 = Instant::now();
    let e = ctx.join_ram_client(theirs).unwrap_err();
    assert!(format!("{e:#}").contains("welcome"), "{e:#}");
    assert!(t0.elapsed() < Duration::from_secs(2), "rnicd waited for a welcome");

    // A welcome with a memfd that could shrink under rnicd.
    let (vmm, theirs) = pair();
    // SAFETY: plain syscalls; results checked.
    let fd = unsafe { libc::memfd_create(c"not-sealed".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0 && unsafe { libc::ftruncate(fd, RAM as libc::off_t) } == 0);
    ram_client::send(vmm.as_fd(), &json!({"op": "welcome", "ram_bytes": RAM}), Some(fd)).unwrap();
    unsafe { libc::close(fd) };
    let e = ctx.join_ram_client(theirs).unwrap_err();
    assert!(format!("{e:#}").contains("sealed"), "{e:#}");

    // A message that is not a welcome.
    let (vmm, theirs) = pair();
    ram_client::send(vmm.as_fd(), &json!({"op": "postcopy-advise"}), None).unwrap();
    let e = ctx.join_ram_client(theirs).unwrap_err();
    assert!(format!("{e:#}").contains("expected welcome"), "{e:#}");

    assert_eq!(ctx.stats().unwrap()["ram_clients"], 0);
    assert!(ctx.query_device().is_ok(), "rnicd still serves");
}
