//! The guest pages the device and its rnicd reach without the vCPU: the
//! rings of its QPs, CQs, SRQs and DSR (the device reads and writes them on
//! doorbells and completions) and its memory regions (rnicd moves payload
//! in and out of them for the peers). On a postcopy destination each of
//! these pages that has not arrived yet stalls rnicd's event loop (every
//! QP of that host) or a doorbell, so they cross inside the switch (the
//! rest of them first in the push; `migration::vm::MigratableVm::
//! device_pages`).

use std::collections::HashMap;

use super::delta::Baseline;
use super::dev::Dev;
use super::objects::MrInfo;

const PAGE: u64 = 4096;

/// `(gpa, len)` byte ranges, the rings first (small, and touched on every
/// doorbell), then the memory regions in handle order. DMA regions (all of
/// guest RAM) are left out: they say nothing about which pages matter.
pub(crate) fn device_pages(d: &Dev) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut pages = |list: &[u64]| out.extend(list.iter().map(|&gpa| (gpa, PAGE)));
    if let Some(dsr) = &d.dsr {
        for r in [&dsr.async_ring, &dsr.cq_ring].into_iter().flatten() {
            pages(&r.pages.pages);
        }
    }
    for (_, q) in d.qps.iter() {
        pages(&q.info.pages.pages);
    }
    for (_, c) in d.cqs.iter() {
        pages(&c.ring.pages.pages);
    }
    for (_, s) in d.srqs.iter() {
        pages(&s.info.pages.pages);
    }
    mr_runs(d.mrs.iter().map(|(h, m)| (*h, &m.info)), &mut out);
    out
}

/// The same pages as far as an early section names them (a destination
/// before its switch: the QPs', CQs' and memory regions' pages, not the
/// DSR's and SRQs'): what it allocates ahead of a postcopy switch.
pub(crate) fn early_pages(b: &Baseline) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut pages = |list: &[u64]| out.extend(list.iter().map(|&gpa| (gpa, PAGE)));
    for q in by_handle(&b.qps) {
        pages(&q.pages.pages);
    }
    for c in by_handle(&b.cqs) {
        pages(&c.pages.pages);
    }
    mr_runs(b.mrs.iter().map(|(h, m)| (*h, m)), &mut out);
    out
}

/// The values of `map` in handle order.
fn by_handle<T>(map: &HashMap<u32, T>) -> Vec<&T> {
    let mut v: Vec<_> = map.iter().collect();
    v.sort_by_key(|(h, _)| **h);
    v.into_iter().map(|(_, x)| x).collect()
}

/// The runs of memory regions but DMA ones, in handle order.
fn mr_runs<'a>(mrs: impl Iterator<Item = (u32, &'a MrInfo)>, out: &mut Vec<(u64, u64)>) {
    let mut mrs: Vec<_> = mrs.filter(|(_, m)| m.flags & pvrdma_abi::MR_FLAG_DMA == 0).collect();
    mrs.sort_by_key(|(h, _)| *h);
    for (_, m) in mrs {
        out.extend(m.runs.iter().copied());
    }
}
