//! `transit-rdma`'s perftest-style tools between two testbed hosts, each
//! with its own rnicd: the latency tests in both wait disciplines (sleeping
//! on the receive CQ's channel, and `--busy-poll`) and SEND bandwidth with
//! the receiver's `--rx-depth`, each checked by its JSON report. Real rnicd
//! and tool processes; nothing is mocked.

use std::process::Output;
use std::time::{Duration, Instant};

mod common;
use common::Bed;

const TOOL: &str = env!("CARGO_BIN_EXE_transit-rdma");

impl Bed {
    /// Runs `transit-rdma TEST` as server on host 1 and client on host 0
    /// with the same options; returns the client's JSON report.
    fn pair(&self, test: &str, opts: &[&str]) -> serde_json::Value {
        let sock = |h: usize| self.nics[h].sock.to_str().unwrap().to_string();
        let mut server = self.tb.host(1).spawn(TOOL, [test, "--sock", &sock(1)].into_iter().chain(opts.iter().copied())).unwrap();
        let peer = self.tb.host(1).addr(0).to_string();
        let out: Output = self.tb.host(0).command(TOOL).args([test, &peer, "--sock", &sock(0), "--json"]).args(opts).output().unwrap();
        assert!(out.status.success(), "{test} {opts:?}: {}", String::from_utf8_lossy(&out.stderr));
        let t0 = Instant::now();
        while server.try_wait().unwrap().is_none() {
            assert!(t0.elapsed() < Duration::from_secs(20), "{test} server did not end after its client");
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(server.wait().unwrap().success(), "{test} server failed");
        let text = String::from_utf8_lossy(&out.stdout);
        serde_json::from_str(text.lines().last().expect("a report line")).expect("a JSON report")
    }
}

fn assert_latency(rep: &serde_json::Value, test: &str, iters: u64) {
    assert_eq!(rep["test"], test, "{rep}");
    assert_eq!(rep["iters"], iters, "{rep}");
    let p50 = rep["lat_p50_us"].as_f64().expect("p50");
    let p99 = rep["lat_p99_us"].as_f64().expect("p99");
    assert!(p50 > 0.0 && p99 >= p50, "{rep}");
}

/// Every latency message is signaled and its completion reaped, so a run
/// longer than the send queue (128) and CQ completes; both ways of waiting
/// deliver every answer.
#[test]
fn latency_tests_complete_sleeping_and_busy_polling() {
    let bed = Bed::new("vtlat", 2);
    for test in ["send-lat", "write-lat"] {
        let name = test.replace('-', "_");
        let rep = bed.pair(test, &["--iters", "1000", "--port", "18521"]);
        assert_latency(&rep, &name, 1000);
        // Busy polling on a shared host may cost a time slice per round
        // trip: a few iterations show that it works.
        let rep = bed.pair(test, &["--iters", "100", "--busy-poll", "--port", "18522"]);
        assert_latency(&rep, &name, 100);
    }
}

/// The SEND receiver posts `--rx-depth` receives (here more than the old
/// fixed 256) and reposts them: the run delivers data.
#[test]
fn send_bw_with_a_deep_receive_queue() {
    let bed = Bed::new("vtsbw", 2);
    for depth in ["512", "1024"] {
        let rep = bed.pair("send-bw", &["--size", "4096", "--duration", "0.5", "--rx-depth", depth, "--port", "18523"]);
        assert_eq!(rep["test"], "send_bw", "{rep}");
        assert!(rep["gbps"].as_f64().expect("gbps") > 0.0, "{rep}");
        assert!(rep["iters"].as_u64().expect("iters") > 0, "{rep}");
    }
}

/// A depth outside what the tool takes is refused before anything starts.
#[test]
fn rx_depth_out_of_range_is_refused() {
    let out = std::process::Command::new(TOOL).args(["send-bw", "--rx-depth", "8"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("rx-depth"), "{}", String::from_utf8_lossy(&out.stderr));
}
