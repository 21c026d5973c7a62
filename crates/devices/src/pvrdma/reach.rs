//! The guest pages the device and its rnicd reach without the vCPU: the
//! rings of its QPs, CQs, SRQs and DSR (the device reads and writes them on
//! doorbells and completions) and its memory regions (rnicd moves payload
//! in and out of them for the peers). On a postcopy destination each of
//! these pages that has not arrived yet stalls rnicd's event loop (every
//! QP of that host) or a doorbell, so the source pushes them first
//! (`migration::vm::MigratableVm::device_pages`).

use super::dev::Dev;

/// `(gpa, len)` byte ranges, the rings first (small, and touched on every
/// doorbell), then the memory regions in handle order. DMA regions (all of
/// guest RAM) are left out: they say nothing about which pages matter.
pub(crate) fn device_pages(d: &Dev) -> Vec<(u64, u64)> {
    const PAGE: u64 = 4096;
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
    let mut mrs: Vec<_> = d.mrs.iter().filter(|(_, m)| m.info.flags & pvrdma_abi::MR_FLAG_DMA == 0).collect();
    mrs.sort_by_key(|(h, _)| **h);
    for (_, m) in mrs {
        out.extend(m.info.runs.iter().copied());
    }
    out
}
