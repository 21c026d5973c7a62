//! What `testing=no-traces` adds at the pause, so that its negative
//! control (crates/transit/tests/pvrdma_migrate.rs) cannot pass by chance.
//!
//! Without traces, a page a peer writes is lost on the destination only if
//! the peer wrote it after the page's last RAM round and the guest reads it
//! there. A guest that consumed everything before its vCPUs stopped, or a
//! peer that was not scheduled in the last moments on a loaded host, reads
//! nothing stale: the check saw no loss although the mechanism was off.
//! So, with the vCPUs stopped and the QPs not yet suspended, the pause
//! waits until a peer has used up every receive a QP had posted: each of
//! those messages was written into guest RAM after every RAM round, none
//! was read by the guest, and a queue's receive buffers span more than a
//! page the guest itself never writes (which no round sends again).

use std::time::{Duration, Instant};

use super::dev::Dev;

/// The longest the pause waits (then it goes on, and the control fails
/// visibly: the guest sees no loss).
const HOLD: Duration = Duration::from_secs(10);

impl Dev {
    /// Waits until one QP that had receives posted in rnicd has none left.
    pub(crate) fn hold_until_peers_fill_a_receive_queue(&mut self) {
        let t = Instant::now();
        let posted: Vec<u32> = self.qps.iter().filter(|(_, q)| !q.info.rq_out.is_empty()).map(|(h, _)| *h).collect();
        while t.elapsed() < HOLD {
            // Completions move to the CQs' pending lists, which the pause
            // drains and the device state carries.
            for h in self.cqs.handles() {
                self.pull_cq(h);
            }
            if posted.iter().any(|h| self.qps.get(*h).is_some_and(|q| q.info.rq_out.is_empty())) {
                self.switch.record("negative control: a peer filled a receive queue", t);
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        tracing::warn!("pvrdma {}: testing=no-traces: no peer filled a receive queue within {HOLD:?}", self.name);
    }
}
