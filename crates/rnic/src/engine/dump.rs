//! `DumpQps`: every QP's and SRQ's state in one namespace (see
//! `qp::debug`), with the namespace's counters.

use std::time::Instant;

use serde_json::{json, Value};

use super::Engine;

impl Engine {
    /// The namespace's QPs (by QPN), SRQs and counters as JSON.
    pub fn dump_qps(&self, now: Instant) -> Value {
        let mut qps: Vec<_> = self.qps.iter().collect();
        qps.sort_by_key(|(n, _)| **n);
        let srqs: Vec<Value> = self
            .srqs
            .iter()
            .map(|(id, s)| {
                let s = crate::srq::lock(s);
                json!({ "srq": id, "owner": s.owner, "posted": s.posted(), "max_wr": s.attr.max_wr, "limit": s.attr.srq_limit })
            })
            .collect();
        json!({
            "gid": self.gid.to_string(),
            "qps": qps.into_iter().map(|(_, q)| q.debug_state(now)).collect::<Vec<_>>(),
            "srqs": srqs,
            "stats": serde_json::to_value(&self.stats).unwrap_or_default(),
        })
    }
}
