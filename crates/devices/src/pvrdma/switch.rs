//! Where the device's share of a switchover goes: the phases of the last
//! pause, save, restore, GID move and resume, each with its duration, as
//! `query-pvrdma` shows them under `switch` (bench/pvrdma-migrate prints
//! them beside the migration engine's steps).

use std::time::Instant;

use serde::Serialize;

#[derive(Clone, Debug, Default, Serialize)]
pub(crate) struct SwitchLog {
    /// (phase, ms) in the order they ran.
    pub phases: Vec<(String, f64)>,
    /// Bytes of the last device state saved or restored.
    pub state_bytes: u64,
    /// Whether it was a delta over the early section (`delta.rs`).
    pub delta: bool,
    /// Objects in it: PDs, MRs, CQs, QPs, WQEs reposted.
    pub objects: [usize; 5],
    /// Destination: objects built ahead from the early section (PDs, MRs,
    /// CQs, QPs), and how many of them the state still had unchanged.
    pub early_built: [usize; 4],
    pub early_kept: [usize; 4],
}

impl SwitchLog {
    /// A new switchover starts (the source's pause, the destination's
    /// restore): the previous one's phases go.
    pub fn begin(&mut self) {
        *self = SwitchLog::default();
    }

    /// `phase` ran from `since` until now.
    pub fn record(&mut self, phase: &str, since: Instant) {
        self.phases.push((phase.to_string(), since.elapsed().as_secs_f64() * 1e3));
    }
}
