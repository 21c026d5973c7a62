//! `transit demo`, the headline, run as a user runs it (its own testbed of
//! three hosts, rnicd on each, the VM moved A -> B -> A while the peer on
//! host C checks everything), with short stays and a smaller big WRITE.
//! What must hold: it exits successfully and its last line is one JSON
//! object that says so (`ok`, nothing lost or twice, no peer error) and
//! gives, per hop, the VM downtime beside the peer's longest stall at the
//! switch and while the migration ran.

use serde_json::Value;
use std::process::Command;

fn demo(mode: &str) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_transit"))
        .args(["demo", "--mode", mode, "--run-secs", "1", "--bigwrite", "8M"])
        .output()
        .expect("running transit demo");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprintln!("{stderr}{stdout}");
    assert!(out.status.success(), "transit demo --mode {mode} failed");
    let last = stdout.lines().last().expect("no output");
    serde_json::from_str(last).unwrap_or_else(|e| panic!("the last line is not one JSON object ({e}): {last}"))
}

fn check(rep: &Value, mode: &str) {
    assert_eq!(rep["ok"], true, "{rep:#}");
    assert_eq!(rep["oracle"], "pass", "{rep:#}");
    assert_eq!(rep["hops"], 2, "{rep:#}");
    assert_eq!(rep["mode"], mode, "{rep:#}");
    for k in ["peer_errors", "lost", "duplicated"] {
        assert_eq!(rep[k], 0, "{k}: {rep:#}");
    }
    assert!(rep["messages_verified"].as_u64().unwrap() > 0, "{rep:#}");
    let hops = rep["migrations"].as_array().expect("migrations");
    assert_eq!(hops.len(), 2, "{rep:#}");
    for h in hops {
        assert!(h["downtime_ms"].as_f64().unwrap() > 0.0, "{h:#}");
        // Stalls of the peer are timings: present, not bounded here.
        for k in ["peer_gap_ms", "peer_gap_migrating_ms"] {
            assert!(h[k].as_f64().is_some_and(|ms| ms >= 0.0), "{k}: {h:#}");
        }
        assert!(h["peer_gap_target_met"].is_boolean(), "{h:#}");
    }
    assert!(rep["peer_max_stall_ms"].is_number(), "{rep:#}");
}

#[test]
fn demo_moves_the_rdma_vm_there_and_back_in_precopy() {
    check(&demo("precopy"), "precopy");
}

#[test]
fn demo_moves_the_rdma_vm_there_and_back_in_postcopy() {
    check(&demo("postcopy"), "postcopy");
}
