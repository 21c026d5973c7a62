//! `transit rdma peer` on its own testbed host against the guest side of
//! the workload protocol (crates/verbs/src/peer.rs), played here through
//! the verbs API on another host: every workload checked on both sides,
//! under 1% loss, and violations (a torn table row, a lost message) reported.
//! Real rnicd processes and a real peer process; nothing is mocked.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::sync::atomic::{fence, Ordering};
use std::time::{Duration, Instant};

use verbs::peer::{check, fill, Info, HELLO, RING, STREAM_TO_GUEST, STREAM_TO_PEER, TABLE, TABLE_ROW};
use verbs::*;

mod common;
use common::Bed;

/// The peer process; killed if the test fails before it ends.
struct PeerProc {
    child: Child,
    out: BufReader<std::process::ChildStdout>,
    /// The guest's IDs as the peer read them.
    ids: PathBuf,
}

impl Drop for PeerProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.ids);
    }
}

impl PeerProc {
    fn start(bed: &Bed, host: usize, guest: &Info, extra: &[&str]) -> (PeerProc, Info) {
        let f = std::env::temp_dir().join(format!("{}-guest.info", bed.tb.name()));
        std::fs::write(&f, guest.line()).unwrap();
        let mut cmd = bed.tb.host(host).command(env!("CARGO_BIN_EXE_transit-rdma"));
        cmd.args(["peer", "--guest", f.to_str().unwrap(), "--sock", bed.nics[host].sock.to_str().unwrap(), "--stall", "30"])
            .args(extra)
            .stdout(Stdio::piped())
            .stdin(Stdio::null());
        let mut child = cmd.spawn().unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert!(!line.is_empty(), "the peer printed nothing");
        (PeerProc { child, out, ids: f }, Info::parse(&line))
    }

    /// The JSON report (last line) and whether the peer exited 0.
    fn report(mut self) -> (serde_json::Value, bool) {
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut self.out, &mut rest).unwrap();
        let ok = self.child.wait().unwrap().success();
        let last = rest.lines().last().expect("no report").to_string();
        (serde_json::from_str(&last).unwrap_or_else(|e| panic!("bad report {last:?}: {e}")), ok)
    }
}

#[derive(Clone, Copy, Default)]
struct Faults {
    /// Rewrite table rows without bumping their version.
    tear_table: bool,
    /// Never send stream message 5.
    skip_stream_5: bool,
}

const SIZE: usize = 256;
const DEPTH: usize = 32;
const SLOTS: u64 = 16;
const REC: usize = 128;
const ROWS: u64 = 8;

/// The guest side of every workload, through the verbs API.
struct Guest {
    buf: MemBuf,
    mr: Mr,
    chans: Vec<(&'static str, Qp, Cq)>,
    _pd: Pd,
    ctx: Context,
}

// Offsets in the guest region.
const RX: usize = 0;
const TX: usize = RX + DEPTH * SIZE;
const RING_AT: usize = TX + DEPTH * SIZE;
const TABLE_AT: usize = RING_AT + SLOTS as usize * REC;
const WORDS: usize = TABLE_AT + ROWS as usize * TABLE_ROW;
const HELLO_AT: usize = WORDS + 64 * 8;

impl Guest {
    fn new(ctx: Context) -> Guest {
        let pd = ctx.alloc_pd().unwrap();
        let buf = MemBuf::new(HELLO_AT + 64).unwrap();
        let mr = pd.reg_mr(&buf, 0, buf.len(), access::ALL).unwrap();
        let mut chans = Vec::new();
        for w in ["stream", "ring", "table", "atomic"] {
            let cq = ctx.create_cq(512, None).unwrap();
            let mut init = QpInitAttr::new(&cq, &cq);
            init.cap.max_send_wr = 128;
            init.cap.max_recv_wr = 128;
            let qp = pd.create_qp(&init).unwrap();
            chans.push((w, qp, cq));
        }
        for r in 0..ROWS {
            buf.write(TABLE_AT + r as usize * TABLE_ROW, &fill(0, r << 32 | TABLE, TABLE_ROW));
        }
        buf.write(HELLO_AT, &HELLO.to_le_bytes());
        Guest { buf, mr, chans, _pd: pd, ctx }
    }

    fn info(&self, count: u64) -> Info {
        let mut i = Info::default();
        i.set("gid", self.ctx.gid());
        for (k, (w, qp, _)) in self.chans.iter().enumerate() {
            i.set(&format!("{w}.qpn"), qp.qpn);
            i.set(&format!("{w}.psn"), 0x100 * (k + 1));
        }
        i.set("size", SIZE);
        i.set("count", count);
        i.set("ring.addr", format!("{:#x}", self.mr.addr + RING_AT as u64));
        i.set("ring.rkey", self.mr.rkey);
        i.set("ring.slots", SLOTS);
        i.set("ring.rec", REC);
        i.set("table.addr", format!("{:#x}", self.mr.addr + TABLE_AT as u64));
        i.set("table.rkey", self.mr.rkey);
        i.set("table.rows", ROWS);
        i
    }

    fn chan(&self, w: &str) -> (&Qp, &Cq) {
        let c = self.chans.iter().find(|c| c.0 == w).unwrap();
        (&c.1, &c.2)
    }

    /// Connects, posts receives, says hello on every QP, then runs every
    /// workload `count` times, checking what the peer sent. Returns the
    /// violations it saw.
    fn run(&self, peer: &Info, count: u64, faults: Faults) -> Vec<String> {
        let o = ConnectOpts { mtu: Mtu::M1024, timeout: 14, min_rnr_timer: 1, ..Default::default() };
        let pgid = peer.gid().unwrap();
        for (k, (w, qp, _)) in self.chans.iter().enumerate() {
            let remote = QpEndpoint { gid: pgid, qpn: peer.u32(&format!("{w}.qpn")).unwrap(), psn: peer.u32(&format!("{w}.psn")).unwrap() };
            qp.connect(&remote, &ConnectOpts { sq_psn: 0x100 * (k as u32 + 1), ..o }).unwrap();
        }
        let (sqp, scq) = self.chan("stream");
        let (rqp, rcq) = self.chan("ring");
        let (_, tcq) = self.chan("table");
        let (aqp, acq) = self.chan("atomic");
        for k in 0..DEPTH {
            sqp.post_recv(&[RecvWr { wr_id: k as u64, sg_list: &[self.mr.sge(RX + k * SIZE, SIZE)] }]).unwrap();
        }
        for k in 0..SLOTS {
            rqp.post_recv(&[RecvWr { wr_id: k, sg_list: &[] }]).unwrap();
        }
        let hello = [self.mr.sge(HELLO_AT, 16)];
        for (_, qp, _) in &self.chans {
            qp.post_send(&[SendWr::send(u64::MAX, &hello)]).unwrap();
        }
        let rkey = peer.u32("rkey").unwrap();
        let credit_at = peer.num("ring.credit").unwrap();
        let (counter_at, ops_at) = (peer.num("atomic.counter").unwrap(), peer.num("atomic.ops").unwrap());
        let mut v = Vec::new();
        let (mut tx_next, mut tx_done, mut rx_expect) = (0u64, 0u64, 0u64);
        let (mut ring_expect, mut table_updates) = (0u64, 0u64);
        let (mut atomic_i, mut atomic_busy) = (0u64, false);
        let mut word = 0usize; // rotating source words for credit / ops writes
        let mut wcs = [Wc::default(); 32];
        let t0 = Instant::now();
        let sends = if faults.skip_stream_5 { count - 1 } else { count };
        let done = |tx_done: u64, rx: u64, ring: u64, table: u64, atomic: u64| {
            tx_done == sends && rx == count && ring == count && table >= count && atomic == count
        };
        while !done(tx_done, rx_expect, ring_expect, table_updates, atomic_i) {
            assert!(
                t0.elapsed() < Duration::from_secs(120),
                "guest stalled: tx {tx_done} rx {rx_expect} ring {ring_expect} atomic {atomic_i}"
            );
            // stream
            // Without the fault, WR i carries message i; with it, message 5 is never sent.
            while tx_next < sends && tx_next - tx_done < DEPTH as u64 {
                let seq = if faults.skip_stream_5 && tx_next >= 5 { tx_next + 1 } else { tx_next };
                let off = TX + (tx_next % DEPTH as u64) as usize * SIZE;
                self.buf.write(off, &fill(seq, seq | STREAM_TO_PEER, SIZE));
                let sge = [self.mr.sge(off, SIZE)];
                let mut wr = SendWr::send(seq, &sge);
                if seq % 2 == 1 {
                    wr = wr.with_imm(seq as u32);
                }
                sqp.post_send(&[wr]).unwrap();
                tx_next += 1;
            }
            let n = scq.poll(&mut wcs).unwrap();
            for wc in &wcs[..n] {
                assert_eq!(wc.status, WcStatus::Success, "stream {wc:?}");
                match wc.opcode {
                    WcOpcode::Send if wc.wr_id != u64::MAX => tx_done += 1,
                    WcOpcode::Send => {}
                    _ => {
                        let off = RX + wc.wr_id as usize * SIZE;
                        let d = self.buf.read(off, SIZE);
                        let seq = u64::from_le_bytes(d[..8].try_into().unwrap());
                        if seq != rx_expect || check(&d, seq, seq | STREAM_TO_GUEST).is_some() {
                            v.push(format!("stream: got {seq}, expected {rx_expect}"));
                        }
                        if (seq % 2 == 1) != (wc.wc_flags & wc_flags::WITH_IMM != 0) {
                            v.push(format!("stream: message {seq} immediate flag"));
                        }
                        rx_expect = seq + 1;
                        sqp.post_recv(&[RecvWr { wr_id: wc.wr_id, sg_list: &[self.mr.sge(off, SIZE)] }]).unwrap();
                    }
                }
            }
            // ring
            let n = rcq.poll(&mut wcs).unwrap();
            for wc in &wcs[..n] {
                assert_eq!(wc.status, WcStatus::Success, "ring {wc:?}");
                if wc.opcode != WcOpcode::RecvRdmaWithImm {
                    continue;
                }
                let k = wc.imm_data as u64;
                let off = RING_AT + (k % SLOTS) as usize * REC;
                if k != ring_expect as u32 as u64 || check(&self.buf.read(off, REC), ring_expect, ring_expect | RING).is_some() {
                    v.push(format!("ring: record {k}, expected {ring_expect}"));
                }
                ring_expect += 1;
                rqp.post_recv(&[RecvWr { wr_id: 0, sg_list: &[] }]).unwrap();
                if ring_expect % (SLOTS / 2) == 0 || ring_expect == count {
                    let w = WORDS + (word % 32) * 8;
                    word += 1;
                    self.buf.write_u64(w, ring_expect);
                    rqp.post_send(&[SendWr::write(1, &[self.mr.sge(w, 8)], credit_at, rkey)]).unwrap();
                }
            }
            // table: one seqlock update per turn
            if table_updates < count || !done(tx_done, rx_expect, ring_expect, count, atomic_i) {
                let r = table_updates % ROWS;
                let at = TABLE_AT + r as usize * TABLE_ROW;
                let ver = self.buf.read_u64(at);
                let next = if faults.tear_table { ver } else { ver + 2 };
                if !faults.tear_table {
                    self.buf.write_u64(at, ver + 1);
                    fence(Ordering::SeqCst);
                }
                let seed_v = if faults.tear_table { ver + 2 + 2 * table_updates } else { next };
                self.buf.write(at + 8, &fill(0, r << 32 | seed_v | TABLE, TABLE_ROW)[8..]);
                fence(Ordering::SeqCst);
                self.buf.write_u64(at, next);
                table_updates += 1;
            }
            let _ = tcq.poll(&mut wcs).unwrap();
            // atomic: one operation at a time, then its count to the peer
            if !atomic_busy && atomic_i < count {
                let res = [self.mr.sge(WORDS + 63 * 8, 8)];
                let wr = if atomic_i % 2 == 0 {
                    SendWr::fetch_add(2, &res, counter_at, rkey, 1)
                } else {
                    SendWr::cmp_swap(2, &res, counter_at, rkey, atomic_i, atomic_i + 1)
                };
                aqp.post_send(&[wr]).unwrap();
                atomic_busy = true;
            }
            let n = acq.poll(&mut wcs).unwrap();
            for wc in &wcs[..n] {
                assert_eq!(wc.status, WcStatus::Success, "atomic {wc:?}");
                if wc.wr_id != 2 {
                    continue;
                }
                let old = self.buf.read_u64(WORDS + 63 * 8);
                if old != atomic_i {
                    v.push(format!("atomic: operation {atomic_i} returned {old}"));
                }
                atomic_i += 1;
                atomic_busy = false;
                let w = WORDS + (word % 32) * 8;
                word += 1;
                self.buf.write_u64(w, atomic_i);
                aqp.post_send(&[SendWr::write(3, &[self.mr.sge(w, 8)], ops_at, rkey)]).unwrap();
            }
        }
        v
    }
}

fn run_case(prefix: &str, loss: f64, count: u64, faults: Faults) -> (serde_json::Value, bool, Vec<String>) {
    let bed = Bed::new(prefix, 3);
    if loss > 0.0 {
        for h in [0, 2] {
            bed.tb.set_loss(h, 0, loss).unwrap();
        }
    }
    let guest = Guest::new(Context::open(Some(&bed.nics[0].sock)).unwrap());
    let (peer, pinfo) = PeerProc::start(&bed, 2, &guest.info(count), &["--timeout", "12"]);
    let violations = guest.run(&pinfo, count, faults);
    let (rep, ok) = peer.report();
    (rep, ok, violations)
}

#[test]
fn every_workload_verified_on_both_sides() {
    let (rep, ok, v) = run_case("pr-ok", 0.0, 2000, Faults::default());
    assert!(v.is_empty(), "guest side: {v:?}");
    assert!(ok && rep["ok"] == true, "{rep:#}");
    for w in ["stream", "ring", "table", "atomic"] {
        assert!(rep["workloads"][w]["verified"].as_u64().unwrap() > 0, "{w}: {rep:#}");
        assert_eq!(rep["workloads"][w]["done"], true, "{w}: {rep:#}");
    }
    assert_eq!(rep["workloads"]["stream"]["verified"], 2000);
    assert_eq!(rep["workloads"]["stream"]["bytes_verified"], 2000 * SIZE);
    assert_eq!(rep["workloads"]["ring"]["verified"], 2000);
    assert_eq!(rep["workloads"]["atomic"]["detail"]["counter"], 2000);
    assert_eq!(rep["error_completions"], 0);
}

#[test]
fn exactly_once_under_one_percent_loss() {
    let (rep, ok, v) = run_case("pr-loss", 1.0, 3000, Faults::default());
    assert!(v.is_empty(), "guest side: {v:?}");
    assert!(ok && rep["ok"] == true, "{rep:#}");
    assert_eq!(rep["lost"], 0);
    assert_eq!(rep["duplicated"], 0);
    assert_eq!(rep["workloads"]["stream"]["verified"], 3000);
    assert_eq!(rep["workloads"]["atomic"]["detail"]["counter"], 3000);
}

#[test]
fn torn_rows_and_lost_messages_are_reported() {
    let (rep, ok, _) = run_case("pr-bad", 0.0, 300, Faults { tear_table: true, skip_stream_5: true });
    assert!(!ok && rep["ok"] == false, "{rep:#}");
    assert_eq!(rep["workloads"]["stream"]["lost"], 1, "{rep:#}");
    assert!(rep["workloads"]["table"]["detail"]["torn"].as_u64().unwrap_or(0) > 0, "{rep:#}");
    let text = rep["violations"].to_string();
    assert!(text.contains("torn read") && text.contains("never came"), "{text}");
}
