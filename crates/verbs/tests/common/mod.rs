//! The testbed the verbs crate's tests share: hosts in network namespaces,
//! one real rnicd each.

use std::path::PathBuf;

use testbed::rnicd::{build_bin, Rnicd};
use testbed::{Testbed, TestbedOpts};

/// rnicd next to this test binary (target/<profile>/rnicd).
pub fn rnicd_bin() -> PathBuf {
    let p = build_bin("rnicd");
    assert!(p.exists(), "{} missing: cargo build --release -p rnic --bin rnicd", p.display());
    p
}

/// Testbed hosts, one rnicd each; rnicd processes go before the testbed.
pub struct Bed {
    pub nics: Vec<Rnicd>,
    pub tb: Testbed,
}

impl Bed {
    pub fn new(prefix: &str, hosts: usize) -> Bed {
        let tb = Testbed::create(TestbedOpts::new(prefix, hosts)).expect("testbed (needs root)");
        let bin = rnicd_bin();
        let nics = (0..hosts).map(|i| Rnicd::start(&tb, i, &bin, &[]).expect("rnicd did not start")).collect();
        Bed { nics, tb }
    }
}
