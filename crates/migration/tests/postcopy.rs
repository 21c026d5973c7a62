//! Postcopy and hybrid between two VMs of one process over real loopback
//! TCP, real userfaultfd and a real helper process: byte-exact RAM, the
//! dirtier oracle on the destination, RAM clients, recovery after a cut.
//! The tests that name a [`Net`] run over the rdma transport as well: the
//! same bodies, with the pages READ by the destination through the real
//! rnicds of two testbed hosts.

mod common;
use common::*;
use migration::memvm::MemVm;
use migration::postcopy::clients::RamClients;
use migration::qmp::{MigrationSlot, Outcome};
use migration::vm::MigratableVm;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The pages of hybrid's first round in a 64 MiB VM: the first eighth.
const EIGHTH: u64 = 64 * MIB / 4096 / 8;

/// Hash of every page without byte 0 (the dirtier's counter, which the
/// oracle checks instead): what the destination runs on must equal what
/// the source stopped with in every other byte.
fn tail_hashes(vm: &Side) -> Vec<u64> {
    let ram = vm.dynvm.ram();
    (0..ram.pages())
        .map(|p| {
            let page = unsafe { std::slice::from_raw_parts(ram.host_addr.add((p * 4096) as usize), 4096) };
            migration::wire::xxh3(&page[1..])
        })
        .collect()
}

fn assert_same(a: &[u64], b: &[u64]) {
    let diff: Vec<usize> = (0..a.len()).filter(|&i| a[i] != b[i]).collect();
    assert!(diff.is_empty(), "{} pages differ, first {:?}", diff.len(), &diff[..diff.len().min(8)]);
}

/// A source running the dirtier, each dirtier past its first pass, and a
/// destination listening (with `prealloc` or not) on the returned port.
///
/// Until the dirtiers have written their slices once, part of RAM is
/// never-written memory (memfd holes) that goes as zero runs of a few
/// bytes: hybrid's first eighth could then end in a few ms, a window in
/// which a dirtier on a loaded machine may not run at all. After a whole
/// pass the eighth is all data, and a capped link gives it its full time.
fn dirtier_pair(net: &Net, prealloc: bool) -> (Side, Side, u16) {
    let src = Side::on(net, 64 * MIB, 2);
    src.vm.resume().unwrap();
    wait_until("a whole pass of every dirtier", || whole_pass_done(&src));
    let dst = Side::on(net, 64 * MIB, 2);
    let port = dst.incoming_on(net, true, prealloc);
    (src, dst, port)
}

/// The destination, paused, holds what the source stopped with (but for
/// the dirtier's counters, which the oracle checks), and keeps holding the
/// oracle while it runs on.
fn oracle_holds_on_destination(src: &Side, dst: &Side) {
    dst.vm.pause().unwrap();
    assert_same(&tail_hashes(src), &tail_hashes(dst));
    dst.vm.check_oracle().unwrap();
    run_and_check_oracle(&dst.vm, Duration::from_millis(200));
}

fn finish(src: &Side, dst: &Side) -> (Value, Value) {
    let o_src = src.slot.wait();
    let o_dst = dst.slot.wait();
    let s = src.cmd("query-migrate", json!({})).unwrap();
    let d = dst.cmd("query-migrate", json!({})).unwrap();
    assert_eq!(o_src, Some(Outcome::OutgoingCompleted), "source: {s:#}\ndestination: {d:#}");
    assert!(matches!(o_dst, Some(Outcome::IncomingCompleted { .. })), "destination: {d:#}");
    assert_eq!(s["status"], "completed");
    assert_eq!(d["status"], "completed");
    (s, d)
}

/// Lifts `src`'s bandwidth cap once it has left the precopy part (switched,
/// or ended): a low cap held the first eighth of a hybrid's pass open long
/// enough for what a test needs to happen in it, however slowly a loaded
/// host runs the guest or the test; the rest need not crawl.
fn lift_cap_after_the_precopy(src: &Side) {
    let status = || src.cmd("query-migrate", json!({})).unwrap()["status"].as_str().unwrap_or("").to_string();
    wait_until("the end of the precopy part", || !matches!(status().as_str(), "setup" | "active"));
    // Refused only once the migration ended, when no cap matters.
    let _ = src.cmd("migrate-set-parameters", json!({"max_bandwidth": 0}));
}

#[test]
fn postcopy_idle_vm_arrives_byte_exact() {
    for net in Net::each("pcidle") {
        for channels in [1, 4] {
            postcopy_idle(&net, channels);
        }
    }
}

fn postcopy_idle(net: &Net, channels: u32) {
    {
        let src = Side::on(net, 64 * MIB, 1);
        src.vm.fill(16, 12000); // the rest stays zero (memfd holes)
        let dst = Side::on(net, 64 * MIB, 1);
        let port = dst.incoming_on(net, false, false);
        src.cmd("migrate", net.migrate_args(port, json!({"mode": "postcopy", "channels": channels}))).unwrap();
        let (s, d) = finish(&src, &dst);
        assert_eq!(s["mode"], "postcopy");
        assert_eq!(d["transport"], net.name());
        assert!(src.vm.is_paused());
        assert_same(&src.hashes(), &dst.hashes());
        assert_eq!(d["remaining_pages"], 0);
        assert!(s["pages_pushed"].as_u64().unwrap() > 0, "{s:#}");
        assert!(s["downtime_ms"].as_f64().is_some());
        // Zero pages are markers, not 4 KiB each.
        assert!(s["wire_bytes"].as_u64().unwrap() < 12100 * 4096 + 2_000_000, "{s:#}");
    }
}

/// Hybrid of a VM that does not write: its first pass goes in two rounds
/// (an eighth of RAM, then the rest), nothing is dirtied, so it ends as a
/// plain precopy, byte-exact.
#[test]
fn hybrid_of_an_idle_vm_ends_as_precopy() {
    let src = Side::new(64 * MIB, 1);
    src.vm.fill(16, 12000);
    let dst = Side::new(64 * MIB, 1);
    let port = dst.incoming(false);
    src.cmd("migrate", json!({"uri": format!("tcp:127.0.0.1:{port}"), "mode": "hybrid", "channels": 2})).unwrap();
    let (s, _) = finish(&src, &dst);
    assert_eq!(s["postcopy_ms"].as_f64().unwrap_or(0.0), 0.0, "switched: {s:#}");
    assert!(s["rounds"].as_u64().unwrap() >= 2, "{s:#}");
    assert_same(&src.hashes(), &dst.hashes());
}

/// The destination runs the dirtier at once: it faults on pages that have
/// not arrived, they are fetched, and the oracle holds. With a destination
/// whose memfd is preallocated (all pages there, zero) as well: those are
/// caught as minor faults.
#[test]
fn postcopy_dirtier_runs_on_destination_at_once() {
    for net in Net::each("pcdirt") {
        for prealloc in [false, true] {
            postcopy_dirtier(&net, prealloc);
        }
    }
}

fn postcopy_dirtier(net: &Net, prealloc: bool) {
    let (src, dst, port) = dirtier_pair(net, prealloc);
    // A slow push, so the running guest must fault for most pages.
    src.cmd("migrate", net.migrate_args(port, json!({"mode": "postcopy", "channels": 2, "max_bandwidth": 40_000_000u64}))).unwrap();
    let (s, d) = finish(&src, &dst);
    assert!(d["faults"].as_u64().unwrap() > 0, "the guest never waited for a page: {d:#}");
    assert!(s["pages_requested"].as_u64().unwrap() > 0, "{s:#}");
    assert!(d["fault_p50_us"].as_f64().is_some() && d["fault_p99_us"].as_f64().is_some());
    assert_eq!(s["faults"], d["faults"], "the source reports the destination's faults");
    oracle_holds_on_destination(&src, &dst);
}

/// The pages a device reaches (`device_pages`: here the 256 pages each
/// dirtier writes next, which the destination's guest touches first) cross
/// inside the switch: the destination has every one before it runs, and
/// its threads never fault on them, while they fault on the pages after
/// them, which come by the slow push or on request.
#[test]
fn postcopy_brings_the_devices_pages_in_the_switch() {
    for mode in ["postcopy", "hybrid"] {
        let (src, dst, port) = dirtier_pair(&Net::Tcp, false);
        for side in [&src, &dst] {
            side.vm.set_device_reach(256);
        }
        let params = json!({"mode": mode, "channels": 2, "max_bandwidth": 40_000_000u64, "downtime_ms": 0});
        src.cmd("migrate", Net::Tcp.migrate_args(port, params)).unwrap();
        let (s, d) = finish(&src, &dst);
        assert_eq!(s["mode"], mode);
        let dev = &d["device_pages"];
        assert_eq!(dev["named"], 512, "{mode}: {d:#}");
        // Pure postcopy: the destination had none of them; hybrid: those
        // the guest wrote since its pass (with the dirtiers there, most).
        assert!(dev["at_switch"].as_u64().unwrap() > 0, "{mode}: {d:#}");
        assert_eq!(dev["at_switch"], s["device_pages"]["at_switch"], "{mode}: what the source sent: {s:#}\n{d:#}");
        assert_eq!(dev["asked"], 0, "{mode}: the source sent every one: {d:#}");
        assert_eq!(dev["after_resume"], 0, "{mode}: {d:#}");
        let vmm = &d["fault_waits"][0];
        assert_eq!(vmm["device_faults"], 0, "{mode}: {d:#}");
        assert!(d["faults"].as_u64().unwrap() > 0, "{mode}: the guest waited for no page after them: {d:#}");
        oracle_holds_on_destination(&src, &dst);
    }
}

/// A device page damaged on its way in the switch (its bytes differ from
/// its hash) fails the switch before the commit: the destination never
/// runs and the source runs on.
#[test]
fn a_damaged_device_page_fails_the_switch_and_the_source_runs_on() {
    let (src, dst, port) = dirtier_pair(&Net::Tcp, false);
    for side in [&src, &dst] {
        side.vm.set_device_reach(64);
    }
    let params = json!({"mode": "postcopy", "channels": 2, "testing": "corrupt-device-page"});
    let (os, od, st) = migrate(&src, &dst, port, params);
    let Some(Outcome::OutgoingFailed(_)) = os else { panic!("source outcome {os:?}: {st:#}") };
    assert_eq!(st["status"], "failed", "{st:#}");
    assert_eq!(st["committed"], false, "{st:#}");
    let Some(Outcome::IncomingFailed(e)) = od else { panic!("destination outcome {od:?}") };
    assert!(e.contains("corrupted") && e.contains("devices' pages"), "{e}");
    assert!(dst.vm.is_paused(), "the destination must never run");
    assert!(!src.vm.is_paused(), "the source must run on");
    run_and_check_oracle(&src.vm, Duration::from_millis(100));
}

/// Hybrid: a precopy pass whose rest cannot fit the downtime (a zero
/// target never fits), then the switch.
#[test]
fn hybrid_switches_when_the_rest_cannot_fit() {
    for net in Net::each("pchyb") {
        for prealloc in [false, true] {
            hybrid_no_shrink(&net, prealloc);
        }
    }
}

fn hybrid_no_shrink(net: &Net, prealloc: bool) {
    // The dirtiers rewrite data they wrote before (a whole pass is done),
    // which the scan after the first eighth sees through its sample; a
    // guest writing fresh memory is hybrid_switches_for_a_guest_writing_fresh_memory.
    let (src, dst, port) = dirtier_pair(net, prealloc);
    // Capped so that the first eighth (8 MiB) takes 2 s, lifted after the
    // switch: uncapped it took a few ms on loopback, and at 0.2 s a
    // starved vCPU still wrote too little in it on a loaded machine.
    src.cmd("migrate", net.migrate_args(port, json!({"mode": "hybrid", "channels": 2, "downtime_ms": 0, "max_bandwidth": 4_000_000u64})))
        .unwrap();
    lift_cap_after_the_precopy(&src);
    let (s, _) = finish(&src, &dst);
    assert_eq!(s["mode"], "hybrid");
    assert!(s["rounds"].as_u64().unwrap() >= 2, "{s:#}");
    assert!(s["postcopy_ms"].as_f64().unwrap() > 0.0, "never switched: {s:#}");
    // The dirtier writes far faster than a quarter of the link: hybrid's
    // sample sees it and it switches after the first eighth of the pass.
    assert_eq!(s["round_stats"].as_array().unwrap().len(), 1, "did not switch after the first eighth: {s:#}");
    assert_eq!(s["throttle_steps"], 0, "hybrid switches instead of throttling");
    oracle_holds_on_destination(&src, &dst);
}

/// A VM over `net` whose two dirtiers write only past the first eighth
/// of RAM (paused until resumed).
fn past_the_eighth_side(net: &Net) -> Side {
    let vm = MemVm::new(64 * MIB, 2, EIGHTH).unwrap();
    if let Net::Rdma(_) = net {
        vm.ram_pages().seal().unwrap();
    }
    let dynvm: Arc<dyn MigratableVm> = vm.clone();
    Side { vm, dynvm, slot: MigrationSlot::default() }
}

/// Hybrid of a guest that writes only memory it never wrote before, past
/// the first eighth of RAM: every page it writes was a memfd hole when the
/// pass was planned, where the rate sample (data only) has nothing. The
/// scan after the eighth looks at every hole, sees the writes, and hybrid
/// switches after the eighth; the pages arrive byte-exact and the oracle
/// holds on the destination.
#[test]
fn hybrid_switches_for_a_guest_writing_fresh_memory() {
    for net in Net::each("pcfresh") {
        hybrid_fresh_memory(&net);
    }
}

fn hybrid_fresh_memory(net: &Net) {
    let src = past_the_eighth_side(net);
    // The eighth is data, the rest holes.
    src.vm.fill(16, EIGHTH);
    let dst = past_the_eighth_side(net);
    let port = dst.incoming_on(net, true, false);
    // Capped so that the eighth (8 MiB) takes 2 s, lifted after the
    // switch; a zero downtime never fits.
    src.cmd("migrate", net.migrate_args(port, json!({"mode": "hybrid", "channels": 2, "downtime_ms": 0, "max_bandwidth": 4_000_000u64})))
        .unwrap();
    // The guest starts once the pass is planned: all it writes was a hole.
    wait_until("the first round", || src.cmd("query-migrate", json!({})).unwrap()["status"] == "active");
    src.vm.resume().unwrap();
    lift_cap_after_the_precopy(&src);
    let (s, _) = finish(&src, &dst);
    assert!(s["postcopy_ms"].as_f64().unwrap() > 0.0, "never switched: {s:#}");
    assert_eq!(s["round_stats"].as_array().unwrap().len(), 1, "{}: did not switch after the first eighth: {s:#}", net.name());
    oracle_holds_on_destination(&src, &dst);
}

/// Hybrid of a VM that writes a few pages of fresh memory past the first
/// eighth while the eighth is sent (the test writes them; the dirtier
/// stays paused): far too few to switch, so the rest of the pass follows.
/// The scan after the eighth took the record of those writes, so the rest
/// must send those pages as data: as the zero runs of the holes they were,
/// they would be lost. It ends as precopy, byte-exact.
#[test]
fn hybrid_sends_holes_written_during_the_eighth_as_data() {
    for net in Net::each("pchole") {
        let src = Side::on(&net, 64 * MIB, 1);
        src.vm.fill(16, EIGHTH);
        let dst = Side::on(&net, 64 * MIB, 1);
        let port = dst.incoming_on(&net, false, false);
        // Capped so that the eighth (8 MiB) takes 8 s, until the pages are
        // written: they are written during it however slowly this test runs.
        src.cmd("migrate", net.migrate_args(port, json!({"mode": "hybrid", "channels": 2, "max_bandwidth": 1_000_000u64}))).unwrap();
        wait_until("the first round", || src.cmd("query-migrate", json!({})).unwrap()["status"] == "active");
        let written = 64;
        src.vm.fill(6 * EIGHTH, 6 * EIGHTH + written);
        src.cmd("migrate-set-parameters", json!({"max_bandwidth": 0})).unwrap();
        let (s, _) = finish(&src, &dst);
        assert_eq!(s["postcopy_ms"].as_f64().unwrap_or(0.0), 0.0, "{}: switched: {s:#}", net.name());
        assert_same(&src.hashes(), &dst.hashes());
        let rounds = s["round_stats"].as_array().unwrap();
        assert!(rounds.len() >= 2, "{s:#}");
        let rest = &rounds[1];
        let data = rest["pages"].as_u64().unwrap() - rest["zero_pages"].as_u64().unwrap();
        assert_eq!(data, written, "{}: the rest of the pass did not send the written holes as data: {s:#}", net.name());
    }
}

#[test]
fn hybrid_switches_on_migrate_start_postcopy() {
    let src = Side::new(64 * MIB, 2);
    src.vm.resume().unwrap();
    // Until the dirtier has written its slice once, most of the first eighth
    // is never-written memory, which precopy skips: the round then ended in
    // a few ms, before migrate-start-postcopy could arrive, and the test
    // failed by chance on a loaded machine. Wait for a whole pass.
    wait_until("a whole pass of the dirtier", || src.vm.progress() >= 2);
    let dst = Side::new(64 * MIB, 2);
    let port = dst.incoming(true);
    // Capped so that the first eighth (8 MiB) takes 8 s, until the switch
    // asked for has begun; and a downtime it cannot reach.
    src.cmd("migrate", json!({"uri": format!("tcp:127.0.0.1:{port}"), "mode": "hybrid", "downtime_ms": 1, "max_bandwidth": 1_000_000u64}))
        .unwrap();
    wait_until("the first round", || src.cmd("query-migrate", json!({})).unwrap()["status"] == "active");
    src.cmd("migrate-start-postcopy", json!({})).unwrap();
    lift_cap_after_the_precopy(&src);
    let (s, _) = finish(&src, &dst);
    assert!(s["postcopy_ms"].as_f64().unwrap() > 0.0, "{s:#}");
    // Cut short within the eighth: its pages not sent went as missing
    // (and the switch's scan looked only at what was sent).
    let rounds = s["round_stats"].as_array().unwrap();
    assert_eq!(rounds.len(), 1, "{s:#}");
    assert!(rounds[0]["pages"].as_u64().unwrap() < (64 * MIB / 4096) / 8, "{s:#}");
    dst.vm.pause().unwrap();
    dst.vm.check_oracle().unwrap();
}

/// The timeout bounds the precopy part only: once the destination runs,
/// the push must finish however long it takes (cancelling would leave the
/// VM split between two hosts).
#[test]
fn postcopy_push_outlives_the_timeout() {
    for net in Net::each("pctime") {
        for mode in ["postcopy", "hybrid"] {
            push_outlives_the_timeout(&net, mode);
        }
    }
}

fn push_outlives_the_timeout(net: &Net, mode: &str) {
    {
        let src = Side::on(net, 64 * MIB, 1);
        src.vm.fill(16, 16000);
        let dst = Side::on(net, 64 * MIB, 1);
        let port = dst.incoming_on(net, false, false);
        // 62 MiB of data at 20 MB/s: about 3 s, against a 1 s timeout.
        let args = json!({"mode": mode, "timeout_s": 1, "max_bandwidth": 20_000_000u64, "downtime_ms": 1});
        src.cmd("migrate", net.migrate_args(port, args)).unwrap();
        let (s, d) = finish(&src, &dst);
        assert!(s["postcopy_ms"].as_f64().unwrap() > 1000.0, "{mode}: {s:#}");
        if mode == "hybrid" {
            // The first pass was under way at the timeout: cut short, the
            // pages not sent yet went by postcopy. The timeout counts from
            // the command, so a slow set-up can make it cut the first
            // eighth (one round) rather than the rest (two).
            let rounds = s["round_stats"].as_array().unwrap();
            assert!(matches!(rounds.len(), 1 | 2), "{s:#}");
            let sent: u64 = rounds.iter().map(|r| r["pages"].as_u64().unwrap()).sum();
            assert!(sent < 16000, "{s:#}");
        }
        assert_same(&src.hashes(), &dst.hashes());
        assert_eq!(d["remaining_pages"], 0);
    }
}

#[test]
fn postcopy_commands_refused_where_they_make_no_sense() {
    let src = Side::new(16 * MIB, 1);
    let e = src.cmd("migrate-start-postcopy", json!({})).unwrap_err();
    assert!(e.desc.contains("no outgoing migration"), "{e}");
    let e = src.cmd("migrate-recover", json!({"uri": "tcp:127.0.0.1:0"})).unwrap_err();
    assert!(e.desc.contains("no paused"), "{e}");
    let e = src.cmd("migrate", json!({"uri": "tcp:127.0.0.1:1", "resume": true})).unwrap_err();
    assert!(e.desc.contains("no paused"), "{e}");
    let e = src.cmd("migrate", json!({"uri": "tcp:127.0.0.1:1", "mode": "sideways"})).unwrap_err();
    assert!(e.desc.contains("mode"), "{e}");
}

/// A process outside the vmm maps guest RAM and reads pages that have not
/// arrived: it gets their real bytes, never zeros.
#[test]
fn helper_process_reads_missing_pages_correctly() {
    for net in Net::each("pchelp") {
        // Preallocated too: the helper must not read the prealloc's zeros.
        for prealloc in [false, true] {
            helper_reads(&net, prealloc);
        }
    }
}

fn helper_reads(net: &Net, prealloc: bool) {
    // No dirtier: what the helper reads must be exactly the source's RAM.
    let src = Side::on(net, 64 * MIB, 0);
    src.vm.fill(0, 16384);
    let dst = Side::on(net, 64 * MIB, 0);
    let sock = std::env::temp_dir().join(format!("transit-ramc-{}-{prealloc}-{}.sock", std::process::id(), net.name()));
    let clients = RamClients::bind(&sock, dst.dynvm.ram()).unwrap();
    dst.slot.set_ram_clients(clients.clone());
    let mut child =
        Command::new(env!("CARGO_BIN_EXE_ram-client-probe")).arg(&sock).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut stdin = child.stdin.take().unwrap();
    let _guard = Kill(child);
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert!(line.starts_with("ready"), "{line}");
    wait_until("the client joined", || clients.count() == 1);

    let want = src.hashes();
    let port = dst.incoming_on(net, true, prealloc);
    // 256 KiB/s until the reads below are done: the push (over rdma, the
    // destination's READs) moves 64 pages a second, so the pages they read
    // are still missing when read, however slowly this test runs on a
    // loaded host. The cap is lifted for the rest.
    src.cmd("migrate", net.migrate_args(port, json!({"mode": "postcopy", "max_bandwidth": 256 * 1024}))).unwrap();
    wait_until("postcopy", || dst.cmd("query-migrate", json!({})).unwrap()["status"] == "postcopy-active");
    let before = dst.cmd("query-migrate", json!({})).unwrap();
    assert!(before["remaining_pages"].as_u64().unwrap() > 8000, "{before:#}");
    let mut checked = 0;
    for first in [16000u64, 9000, 12345] {
        writeln!(stdin, "read {first} 16").unwrap();
        loop {
            line.clear();
            out.read_line(&mut line).unwrap();
            if line.trim() == "done" {
                break;
            }
            let v: Vec<u64> = line.split_whitespace().map(|x| x.parse().unwrap()).collect();
            assert_eq!(v[2], 0, "page {} read as zeros", v[0]);
            assert_eq!(v[1], want[v[0] as usize], "page {} differs from the source", v[0]);
            checked += 1;
        }
    }
    assert_eq!(checked, 48);
    src.cmd("migrate-set-parameters", json!({"max_bandwidth": 0})).unwrap();
    let (_, d) = finish(&src, &dst);
    assert_eq!(d["ram_clients"], 1);
    assert!(d["faults"].as_u64().unwrap() >= 3, "{d:#}");
    // What the faults cost each process: the helper's three reads each
    // blocked on a missing page (and waited for it), counted as its own.
    let waits = &d["fault_waits"];
    assert_eq!((&waits[0]["name"], &waits[1]["name"]), (&json!("vmm"), &json!("ram-client-probe")), "{waits:#}");
    assert!(waits[1]["faults"].as_u64().unwrap() >= 3 && waits[1]["wait_ms"].as_f64().unwrap() > 0.0, "{waits:#}");
    assert!(waits[1]["last_wake_unix_ms"].as_f64().unwrap() >= waits[1]["first_fault_unix_ms"].as_f64().unwrap(), "{waits:#}");
    assert_same(&want, &dst.hashes());
}

/// `max_bandwidth` changed while postcopy runs applies to it at once, over
/// tcp to the source's push and over rdma to the destination's READs:
/// started at 256 KiB/s (its 64 MiB would take over four minutes), the
/// pages move no faster than the cap lets them; the cap lifted, the rest
/// comes long before the capped rest could have, byte-exact.
#[test]
fn bandwidth_set_during_a_postcopy_applies_to_it() {
    const CAP: u64 = 256 * 1024;
    for net in Net::each("pccap") {
        let src = Side::on(&net, 64 * MIB, 0);
        src.vm.fill(0, 16384);
        let dst = Side::on(&net, 64 * MIB, 0);
        let port = dst.incoming_on(&net, false, false);
        src.cmd("migrate", net.migrate_args(port, json!({"mode": "postcopy", "channels": 2, "max_bandwidth": CAP}))).unwrap();
        wait_until("postcopy", || dst.cmd("query-migrate", json!({})).unwrap()["status"] == "postcopy-active");
        let t = Instant::now();
        let missing0 = dst.cmd("query-migrate", json!({})).unwrap()["remaining_pages"].as_u64().unwrap();
        std::thread::sleep(Duration::from_secs(1));
        let d = dst.cmd("query-migrate", json!({})).unwrap();
        // What the cap lets through since, with a burst of 4 MiB.
        let allowed = ((CAP as f64 * t.elapsed().as_secs_f64()) as u64 + 4 * MIB) / 4096;
        let came = missing0 - d["remaining_pages"].as_u64().unwrap();
        assert!(came <= allowed, "{}: {came} pages came in {:?}, the cap allows {allowed}: {d:#}", net.name(), t.elapsed());
        let p = src.cmd("migrate-set-parameters", json!({"max_bandwidth": 0})).unwrap();
        assert_eq!(p["max_bandwidth"], 0);
        let lifted = Instant::now();
        let (_, d) = finish(&src, &dst);
        // At the old cap the rest would take over 200 s.
        assert!(
            lifted.elapsed() < Duration::from_secs(60),
            "{}: finished {:?} after the cap was lifted: {d:#}",
            net.name(),
            lifted.elapsed()
        );
        assert_same(&src.hashes(), &dst.hashes());
    }
}

/// Every connection breaks mid-postcopy: both ends pause, the source keeps
/// the pages, `migrate resume` through the same path finishes, nothing is
/// lost or stale.
#[test]
fn postcopy_recovers_after_the_connections_break() {
    // Over rdma the proxy carries the control connection only: its cut
    // pauses both ends as over tcp, the READs of the old queue pairs stop,
    // and the recovery sets up new ones. (A cut of the link itself:
    // `rdma_postcopy_recovers_after_the_link_is_cut`.)
    for net in Net::each("pcrecov") {
        recovers_after_the_connections_break(&net);
    }
}

fn recovers_after_the_connections_break(net: &Net) {
    // 128 MiB at 10 MB/s and a guest that faults its way through: the
    // cut below lands long before the last page.
    let src = Side::on(net, 128 * MIB, 2);
    src.vm.resume().unwrap();
    // All data, no holes (which would go as zero runs in no time).
    wait_until("a whole pass of every dirtier", || whole_pass_done(&src));
    let dst = Side::on(net, 128 * MIB, 2);
    let port = dst.incoming_on(net, true, false);
    let proxy = Proxy::start(port, Fault { conn: usize::MAX, ..Default::default() });
    src.cmd("migrate", net.migrate_args(proxy.port, json!({"mode": "postcopy", "channels": 2, "max_bandwidth": 10_000_000u64}))).unwrap();
    wait_until("postcopy", || dst.cmd("query-migrate", json!({})).unwrap()["status"] == "postcopy-active");
    std::thread::sleep(Duration::from_millis(100));
    proxy.cut_all();
    wait_until("the source pauses", || src.cmd("query-migrate", json!({})).unwrap()["status"] == "postcopy-paused");
    wait_until("the destination pauses", || dst.cmd("query-migrate", json!({})).unwrap()["status"] == "postcopy-paused");
    let d = dst.cmd("query-migrate", json!({})).unwrap();
    assert!(d["error"].as_str().unwrap().contains("pages are still on the source"), "{d:#}");
    let e = src.cmd("migrate-cancel", json!({})).unwrap_err();
    assert!(e.desc.contains("postcopy"), "{e}");
    std::thread::sleep(Duration::from_millis(200));
    src.cmd("migrate", net.migrate_args(proxy.port, json!({"resume": true}))).unwrap();
    let (s, d) = finish(&src, &dst);
    assert_eq!(s["recoveries"], 1, "{s:#}");
    assert_eq!(d["recoveries"], 1, "{d:#}");
    assert!(d["paused_ms"].as_f64().unwrap() > 0.0);
    oracle_holds_on_destination(&src, &dst);
}

/// Drop (or stop dropping) every IPv4 packet on host 0's link, both ways,
/// with nftables; ARP still passes. (`Testbed::set_loss` takes at most
/// 99.9999 %.)
fn cut_link(bed: &RdmaBed, cut: bool) {
    let rules = if cut {
        "table netdev linkcut {\n\
           chain rx { type filter hook ingress device \"eth0\" priority -200; meta protocol ip counter drop; }\n\
           chain tx { type filter hook egress device \"eth0\" priority -200; meta protocol ip counter drop; }\n}\n"
    } else {
        ""
    };
    let script = format!("nft -f - <<'EOF'\nadd table netdev linkcut\ndelete table netdev linkcut\n{rules}EOF");
    bed.tb.host(0).sh(&script).unwrap();
}

/// The testbed link between the two rnicds is cut mid-postcopy (nftables
/// drops every IP packet on the source host's link, both ways): the
/// destination's RDMA READs retry out, it pauses and closes the control
/// connection, the source pauses. The link comes back; `migrate-recover`
/// gives the destination a new address, `migrate resume` reconnects with
/// new queue pairs, and the destination ends byte-exact (but for the
/// dirtier's counters) with the oracle holding.
#[test]
fn rdma_postcopy_recovers_after_the_link_is_cut() {
    let net = Net::Rdma(RdmaBed::new("pclink"));
    let Net::Rdma(bed) = &net else { unreachable!() };
    let src = Side::on(&net, 128 * MIB, 2);
    src.vm.resume().unwrap();
    // All data, no holes (which would go as zero runs in no time).
    wait_until("a whole pass of every dirtier", || whole_pass_done(&src));
    let dst = Side::on(&net, 128 * MIB, 2);
    let port = dst.incoming_on(&net, true, false);
    // 128 MiB at 10 MB/s: the cut lands long before the last page.
    src.cmd("migrate", net.migrate_args(port, json!({"mode": "postcopy", "channels": 2, "max_bandwidth": 10_000_000u64}))).unwrap();
    wait_until("postcopy", || dst.cmd("query-migrate", json!({})).unwrap()["status"] == "postcopy-active");
    std::thread::sleep(Duration::from_millis(300));
    cut_link(bed, true);
    let paused = |side: &Side| side.cmd("query-migrate", json!({})).unwrap()["status"] == "postcopy-paused";
    wait_until("the destination pauses", || paused(&dst));
    wait_until("the source pauses", || paused(&src));
    let d = dst.cmd("query-migrate", json!({})).unwrap();
    assert!(d["error"].as_str().unwrap().contains("RDMA READ"), "{d:#}");
    assert!(d["remaining_pages"].as_u64().unwrap() > 0, "the cut came after the last page: {d:#}");
    cut_link(bed, false);
    let r = dst.cmd("migrate-recover", json!({"uri": "tcp:127.0.0.1:0"})).unwrap();
    let new_port = r["port"].as_u64().unwrap() as u16;
    src.cmd("migrate", net.migrate_args(new_port, json!({"resume": true}))).unwrap();
    let (s, d) = finish(&src, &dst);
    assert_eq!(s["recoveries"], 1, "{s:#}");
    assert_eq!(d["recoveries"], 1, "{d:#}");
    assert_eq!(d["transport"], "rdma");
    assert_eq!(d["remaining_pages"], 0);
    oracle_holds_on_destination(&src, &dst);
}

/// The destination goes away during a hybrid's precopy part (its
/// connections cut, and it gives up): before the switch nothing is
/// committed, so the source runs on with its oracle intact and the
/// destination never runs.
#[test]
fn hybrid_destination_gone_before_the_switch() {
    for net in Net::each("pcgone") {
        // The dirtiers are past their first pass (see `dirtier_pair`): the
        // first eighth is all data, and hybrid cannot switch before it is
        // sent. At 1 MB/s its 8 MiB take 8 s, and the cut comes 0.3 s in:
        // the switch can come first only if this thread stalls for over 7 s.
        // (At 4 MB/s, 2 s, a loaded machine once saw the switch first.)
        let (src, dst, port) = dirtier_pair(&net, false);
        let proxy = Proxy::start(port, Fault { conn: usize::MAX, ..Default::default() });
        src.cmd("migrate", net.migrate_args(proxy.port, json!({"mode": "hybrid", "channels": 2, "max_bandwidth": 1_000_000u64}))).unwrap();
        wait_until("the first round", || src.cmd("query-migrate", json!({})).unwrap()["status"] == "active");
        std::thread::sleep(Duration::from_millis(300));
        proxy.cut_all();
        dst.cmd("migrate-cancel", json!({})).unwrap();
        let os = src.slot.wait();
        let s = src.cmd("query-migrate", json!({})).unwrap();
        assert!(matches!(os, Some(Outcome::OutgoingFailed(_))), "{}: {os:?} {s:#}", net.name());
        assert_eq!(s["postcopy_ms"].as_f64().unwrap_or(0.0), 0.0, "{}: switched: {s:#}", net.name());
        let od = dst.slot.wait();
        assert!(matches!(od, Some(Outcome::IncomingFailed(_))), "{}: destination {od:?}", net.name());
        assert!(dst.vm.is_paused(), "{}: the destination must never run", net.name());
        assert!(!src.vm.is_paused(), "{}: the source must run on", net.name());
        run_and_check_oracle(&src.vm, Duration::from_millis(100));
    }
}
