//! The testbed the verbs crate's tests share: hosts in network namespaces,
//! one real rnicd each.

use testbed::rnicd::{build_rnicd, Rnicd};
use testbed::{Testbed, TestbedOpts};

/// Testbed hosts, one rnicd each; rnicd processes go before the testbed.
pub struct Bed {
    pub nics: Vec<Rnicd>,
    pub tb: Testbed,
}

impl Bed {
    pub fn new(prefix: &str, hosts: usize) -> Bed {
        let tb = Testbed::create(TestbedOpts::new(prefix, hosts)).expect("testbed (needs root)");
        let bin = build_rnicd();
        let nics = (0..hosts).map(|i| Rnicd::start(&tb, i, &bin, &[]).expect("rnicd did not start")).collect();
        Bed { nics, tb }
    }
}
