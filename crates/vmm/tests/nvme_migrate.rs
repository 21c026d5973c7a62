//! Live migration of a VM in the middle of the NVMe verifier at high queue
//! depth: two real `transit vm run --nvme` processes on this machine share
//! the namespace file (the shared storage), the source migrates to the
//! destination over TCP, and the verifier, which checks every block it wrote
//! before and after the move, must end in PASS there.

use serde_json::json;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};
use vmm::testing::{unique_name, VmProcess};

/// Build (if needed) and point `vmm::testing` at the transit binary.
fn transit() -> PathBuf {
    if let Some(p) = std::env::var_os("TRANSIT_BIN") {
        return p.into();
    }
    let exe = std::env::current_exe().unwrap();
    let mut dir = exe.parent().unwrap().to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let target = dir.parent().unwrap().to_path_buf();
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.args(["build", "-q", "-p", "transit", "--bin", "transit"]).env("CARGO_TARGET_DIR", &target).env("UNICORN_NO_PKG_CONFIG", "1");
    if dir.ends_with("release") {
        c.arg("--release");
    }
    assert!(c.status().expect("cargo build -p transit").success(), "building transit failed");
    let bin = dir.join("transit");
    std::env::set_var("TRANSIT_BIN", &bin);
    bin
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[test]
fn live_migration_in_the_middle_of_the_verifier() {
    transit();
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let disk = dir.path().join("shared.img");
    std::fs::File::create(&disk).unwrap().set_len(64 << 20).unwrap();
    let nvme = format!("name=nvme0,queues=4,depth=1024,ns=file:{}", disk.display());
    let vm_args = |extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = ["--memory", "128M", "--workload", "nvme-verify", "--args", "qd=128 queues=2 ops=40000", "--nvme", &nvme]
            .iter()
            .map(|s| s.to_string())
            .collect();
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let port = free_port();
    let uri = format!("tcp:127.0.0.1:{port}");
    let src_args = vm_args(&[]);
    let src = VmProcess::run_local(&unique_name("nvmig-src"), &src_args.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
    let dst_args = vm_args(&["--incoming", &uri]);
    let mut dst = VmProcess::run_local(&unique_name("nvmig-dst"), &dst_args.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();

    // Migrate while the verifier runs at queue depth 128 on two queues.
    src.wait_progress(3000, Duration::from_secs(300)).unwrap();
    src.exec("migrate", json!({ "uri": uri })).unwrap();
    let t = Instant::now();
    let done = loop {
        let st = dst.exec("query-migrate", json!({})).unwrap();
        if matches!(st["status"].as_str(), Some("completed" | "failed" | "cancelled")) {
            break st;
        }
        assert!(t.elapsed() < Duration::from_secs(300), "migration still {st}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(done["status"], "completed", "destination: {done:#}\nsource console:\n{}", src.console());
    let nvme_dst = dst.exec("query-nvme", json!({})).unwrap();
    assert_eq!(nvme_dst[0]["name"], "nvme0", "{nvme_dst}");

    // The verifier finishes on the destination and finds every block
    // intact; the vmm exits with the guest's code.
    let code = dst.wait_exit(Duration::from_secs(600)).unwrap();
    let console = dst.console();
    assert_eq!(code, Some(0), "verifier failed after live migration:\nsource:\n{}\ndestination:\n{console}", src.console());
    assert!(console.contains("nvme-verify: PASS"), "{console}");
    assert!(!src.console().contains("PASS"), "the source stopped before the verifier finished");
}
