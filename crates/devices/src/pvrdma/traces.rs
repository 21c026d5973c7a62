//! Write traces of the device's memory regions while the VM migrates.
//!
//! rnicd writes guest RAM through its own mapping of the RAM memfd (a
//! peer's WRITE, a SEND into a receive buffer, a READ response, an atomic),
//! which the vmm's own dirty tracking cannot see. While a migration runs,
//! rnicd traces every MR of the device (also those created meanwhile), and
//! the migration engine takes the traced pages every round as one of its
//! dirty sources: a page a peer wrote is sent again. A trace that rnicd could
//! not keep in detail (too many runs) reports the whole MR. An MR destroyed
//! while tracing gives its last trace first, so no write is lost with it.

use super::dev::Dev;
use super::objects::MrInfo;
use super::{lock, Pvrdma};
use std::sync::{Arc, Mutex};

/// Trace blocks: one guest page.
pub(crate) const GRANULARITY: u64 = 4096;

/// Guest pages `[first, first + count)`.
pub type PageRun = (u64, u64);

/// Pages of guest RAM under `len` bytes at `off` of the MR (one run of
/// pages per run of the MR it crosses).
fn pages_of(mr: &MrInfo, off: u64, len: u64) -> impl Iterator<Item = PageRun> + '_ {
    mr.gpa_runs(off, len).map(|(gpa, n)| {
        let first = gpa / GRANULARITY;
        (first, (gpa + n).div_ceil(GRANULARITY) - first)
    })
}

/// Adds the pages of an MR's trace to `out`; returns 1 if the trace was
/// not kept in detail (or not fetched: then every page of the MR may have
/// been written, and all of them are).
fn add_trace(info: &MrInfo, trace: Result<verbs::TraceReport, ()>, out: &mut Vec<PageRun>) -> u64 {
    match trace {
        Ok(t) if !t.all_dirty => {
            out.extend(t.runs.iter().flat_map(|&(off, len)| pages_of(info, off, len)).filter(|r| r.1 > 0));
            0
        }
        _ => {
            out.extend(pages_of(info, 0, info.length));
            1
        }
    }
}

impl Dev {
    /// The traced pages of one MR since its last fetch.
    pub(crate) fn fetch_mr_trace(&mut self, mr: &verbs::Mr, info: &MrInfo, out: &mut Vec<PageRun>) {
        let t = mr.fetch_trace().map_err(|e| tracing::warn!("pvrdma {}: trace of MR {:#x}: {e:#}", self.name, info.key));
        let before = out.len();
        self.counters.trace_overflows += add_trace(info, t, out);
        self.counters.traced_pages += out[before..].iter().map(|r| r.1).sum::<u64>();
    }

    /// Starts tracing an MR (at its creation while a migration runs).
    pub(crate) fn start_mr_trace(&self, mr: &verbs::Mr) -> Result<(), String> {
        if self.traces_wanted() {
            mr.start_trace(GRANULARITY).map_err(|e| format!("pvrdma {}: tracing MR {:#x}: {e:#}", self.name, mr.lkey))?;
        }
        Ok(())
    }

    fn start_traces(&mut self) -> Result<(), String> {
        self.tracing = true;
        self.traced.clear();
        for (_, m) in self.mrs.iter() {
            self.start_mr_trace(&m.mr)?;
        }
        Ok(())
    }

    /// Whether rnicd traces the MRs now (a migration runs).
    pub(crate) fn traces_wanted(&self) -> bool {
        self.tracing && !self.testing.no_traces
    }

    pub(crate) fn take_traced(&mut self) -> Vec<PageRun> {
        let mut out = std::mem::take(&mut self.traced);
        if !self.traces_wanted() || self.last_traces_taken {
            return out;
        }
        let t = std::time::Instant::now();
        // Batched: a round trip per few MRs (FetchTraces), not one per MR.
        // If it fails, every page of every MR may have been written.
        let live: Vec<&verbs::Mr> = self.mrs.iter().map(|(_, m)| &m.mr).collect();
        let traces = self.be.ctx.fetch_traces(&live).unwrap_or_else(|e| {
            tracing::warn!("pvrdma {}: traces of {} MRs: {e:#}", self.name, live.len());
            Vec::new()
        });
        self.add_traces(traces, &mut out);
        if self.paused {
            // The switch's last scan: inside the downtime.
            self.switch.record("last trace fetch", t);
        }
        out
    }

    /// The pause fetched the MRs' last traces with its suspend (`traces`,
    /// one per MR in `mrs` order): they wait for the engine's last scan.
    pub(crate) fn keep_last_traces(&mut self, traces: Vec<verbs::TraceReport>) {
        let mut out = std::mem::take(&mut self.traced);
        self.add_traces(traces, &mut out);
        self.traced = out;
        self.last_traces_taken = true;
    }

    /// Adds `traces` (one per MR, in `mrs` order; a missing one counts the
    /// whole MR) to `out` and the counters.
    fn add_traces(&mut self, traces: Vec<verbs::TraceReport>, out: &mut Vec<PageRun>) {
        let before = out.len();
        let mut traces = traces.into_iter();
        let mut overflows = 0;
        for (_, m) in self.mrs.iter() {
            overflows += add_trace(&m.info, traces.next().ok_or(()), out);
        }
        self.counters.trace_overflows += overflows;
        self.counters.traced_pages += out[before..].iter().map(|r| r.1).sum::<u64>();
    }

    pub(crate) fn stop_traces(&mut self) {
        self.last_traces_taken = false;
        if self.traces_wanted() {
            for (_, m) in self.mrs.iter() {
                let _ = m.mr.stop_trace();
            }
        }
        self.tracing = false;
        self.traced.clear();
    }
}

/// The device's side of the migration engine's dirty log: start, take,
/// stop. Cloned out of the device so that the engine never holds the
/// device itself.
#[derive(Clone)]
pub struct TraceHandle {
    shared: Arc<Mutex<Dev>>,
}

impl TraceHandle {
    /// Traces every MR from now on, and every MR created until [`stop`](Self::stop).
    pub fn start(&self) -> Result<(), String> {
        let mut d = lock(&self.shared);
        let r = d.start_traces();
        if r.is_err() {
            d.stop_traces();
        }
        r
    }

    /// Guest pages rnicd wrote since the previous call (or `start`).
    pub fn take(&self) -> Vec<PageRun> {
        lock(&self.shared).take_traced()
    }

    pub fn stop(&self) {
        lock(&self.shared).stop_traces();
    }
}

impl Pvrdma {
    pub fn traces(&self) -> TraceHandle {
        TraceHandle { shared: self.shared.clone() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_become_guest_pages() {
        let mr = MrInfo { pd_handle: 1, start: 0x1000, length: 3 * 4096, access: 0, flags: 0, runs: vec![(0x5800, 3 * 4096)], key: 1 };
        let pages = |off, len| pages_of(&mr, off, len).collect::<Vec<_>>();
        // Blocks are relative to the MR, which starts mid-page: one block
        // touches two pages.
        assert_eq!(pages(0, 4096), [(5, 2)]);
        assert_eq!(pages(4096, 8192), [(6, 3)]);
        // Clipped at the MR's end.
        assert_eq!(pages(8192, 8192), [(7, 2)]);
    }

    #[test]
    fn scattered_runs_become_their_own_pages() {
        // 0x800 bytes of page 9, then pages 3 and 4, then page 20.
        let runs = vec![(0x9800, 0x800), (0x3000, 0x2000), (0x14000, 0x1000)];
        let mr = MrInfo { pd_handle: 1, start: 0x800, length: 0x3800, access: 0, flags: 0, runs, key: 1 };
        let pages = |off, len| pages_of(&mr, off, len).collect::<Vec<_>>();
        assert_eq!(pages(0, 0x3800), [(9, 1), (3, 2), (20, 1)]);
        assert_eq!(pages(0x700, 0x200), [(9, 1), (3, 1)]);
        assert_eq!(pages(0x2800, 0x2000), [(20, 1)]);
        assert!(pages(0x3800, 0x1000).is_empty());
    }
}
