//! The testbed the verbs crate's tests share: hosts in network namespaces,
//! one real rnicd each.

use std::path::PathBuf;
use std::time::Duration;

use testbed::{HostChild, Testbed, TestbedOpts};

/// rnicd next to this test binary (target/<profile>/rnicd).
pub fn rnicd_bin() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let mut d = exe.parent().unwrap().to_path_buf();
    if d.ends_with("deps") {
        d.pop();
    }
    let p = d.join("rnicd");
    assert!(p.exists(), "{} missing: cargo build --release -p rnic --bin rnicd", p.display());
    p
}

/// Testbed hosts, one rnicd each; rnicd processes go before the testbed.
pub struct Bed {
    pub nics: Vec<(HostChild, PathBuf)>,
    pub tb: Testbed,
}

impl Bed {
    pub fn new(prefix: &str, hosts: usize) -> Bed {
        let tb = Testbed::create(TestbedOpts::new(prefix, hosts)).expect("testbed (needs root)");
        let mut nics = Vec::new();
        for i in 0..hosts {
            let h = tb.host(i);
            let sock = std::env::temp_dir().join(format!("{}-h{i}.rnicd.sock", tb.name()));
            let _ = std::fs::remove_file(&sock);
            let args = ["--addr", &h.addr(0).to_string(), "--sock", sock.to_str().unwrap()];
            let child = h.spawn_ready(rnicd_bin().to_str().unwrap(), args, &sock, Duration::from_secs(20)).expect("rnicd did not start");
            nics.push((child, sock));
        }
        Bed { nics, tb }
    }
}

impl Drop for Bed {
    fn drop(&mut self) {
        for (_, s) in self.nics.drain(..) {
            let _ = std::fs::remove_file(s);
        }
    }
}
