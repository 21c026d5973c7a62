//! Postcopy over the rdma transport, destination side: the pages the
//! destination lacks are READ from the source's registered guest RAM by
//! this side's rnicd, straight into the memfd (no vmm thread on either
//! side touches their bytes, and the source's CPU does nothing for them).
//!
//! One thread, the *fetcher*, does all of it: the pages threads fault on
//! (asked by the fault thread through [`RequestSink`](super::faults::RequestSink))
//! go first, on their own queue pairs, with the pages after them
//! (prefetch); the rest of the source's plan follows on the bulk queue
//! pairs, near the latest fault first ([`PushQueue`]). Each link has an
//! urgent and a bulk queue pair: every link's bulk queue pair is kept busy,
//! and each fault's READ goes to the link with the fewest urgent READs out
//! (in turn on a tie).
//!
//! A link whose READ fails (retry exceeded: the link is cut) is dropped:
//! its queue pairs are destroyed first (nothing of theirs lands after),
//! then the pages of its READs still out are unclaimed and read again on
//! the links left, faults first. Only when no link is left does the
//! fetcher fail (and the migration pauses for a recovery). A page is claimed in the placer
//! *before* its READ is posted, so it is written once, by rnicd, while no
//! process maps it: a fault on it waits for the claim; a second ask for
//! it is dropped. Only when the READ completed is the page mapped into the
//! vmm (`UFFDIO_CONTINUE`, which wakes its waiters): it counts as arrived
//! then. READs carry no hashes: after the switch the source's vCPUs are
//! stopped, so the page read is the page the source holds, and each packet
//! is checked by its ICRC on the way.

use crate::pages::PageRange;
use crate::place::{Placer, Via};
use crate::push::{Claim, PushQueue};
use crate::ratelimit::TokenBucket;
use crate::rdma::{PageReader, READS_IN_FLIGHT, READ_BULK, READ_QPS, READ_URGENT};
use crate::stats::Control;
use anyhow::{anyhow, Result};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;
use verbs::{Wc, WcStatus};

/// Most pages of one READ: a whole raw run, as a batch's WRITE.
const READ_RUN: u64 = crate::wire::MAX_RAW_RUN as u64;
/// Bulk READs outstanding: 8 x 256 KiB is several milliseconds of a
/// 10 Gbit/s link, enough to keep it busy, and a fault on a page the bulk
/// claimed waits for at most that.
const BULK_IN_FLIGHT: usize = 8;
/// How long the fetcher sleeps on the CQ while READs are out: asks that
/// arrive meanwhile wait at most this.
const CQ_WAIT: Duration = Duration::from_micros(200);
/// How long an idle fetcher sleeps on its asks (it then looks whether it
/// must stop).
const IDLE_WAIT: Duration = Duration::from_millis(20);

/// Pages a fault wants now, and the prefetch after them.
pub(crate) type Ask = (Vec<u64>, Vec<u64>);

/// A READ in flight.
#[derive(Clone, Copy)]
struct Pending {
    link: usize,
    qp: usize,
    run: PageRange,
    via: Via,
}

/// The fetcher thread of one connection to the source.
pub(crate) struct Fetcher {
    /// The background's cap.
    cap: Arc<TokenBucket>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Result<()>>>,
}

impl Fetcher {
    /// Start fetching with `reader`: asks come on `asks`, the background
    /// plan is `queue` (filled when the source's plan arrives, refilled
    /// on a recovery).
    pub(crate) fn start(
        reader: PageReader,
        placer: Arc<Placer>,
        queue: Arc<PushQueue>,
        asks: Receiver<Ask>,
        ctl: Arc<Control>,
    ) -> Result<Fetcher> {
        let stop = Arc::new(AtomicBool::new(false));
        let s2 = stop.clone();
        let cap = Arc::new(TokenBucket::default());
        let c2 = cap.clone();
        let thread = std::thread::Builder::new().name("postcopy-rdma-read".into()).spawn(move || {
            let tally = ctl.clone();
            let _cpu = crate::stats::CpuTally::new(&tally, true);
            crate::priority::fault_path_priority();
            let slots = vec![None; reader.links() * READ_QPS * READS_IN_FLIGHT];
            let live = (0..reader.links()).filter(|&k| reader.is_live(k)).count();
            link_stats(&ctl, &reader);
            let mut f = Fetch {
                reader,
                placer,
                queue,
                asks,
                ctl,
                slots,
                claims: Vec::new(),
                cap: c2,
                now: Vec::new(),
                soon: Vec::new(),
                turn: 0,
                live,
            };
            let r = f.run(&s2);
            // Whatever did not land goes back: a recovery reads it again.
            f.give_back();
            r
        })?;
        Ok(Fetcher { cap, stop, thread: Some(thread) })
    }

    /// Keep the background reads to `bytes_per_s` (0: no cap).
    pub(crate) fn set_cap(&self, bytes_per_s: u64) {
        self.cap.set_rate(bytes_per_s);
    }

    /// The thread ended: with an error if its queue pairs broke.
    pub(crate) fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(|t| t.is_finished())
    }

    /// Stop (if running) and say why it ended.
    pub(crate) fn stop(&mut self) -> Result<()> {
        self.stop.store(true, Ordering::SeqCst);
        match self.thread.take() {
            Some(t) => t.join().map_err(|_| anyhow!("the RDMA fetcher panicked"))?,
            None => Ok(()),
        }
    }
}

impl Drop for Fetcher {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// The destination's `links` statistics: what each link's READs carried.
/// A recovery's reader starts over on the same links: their figures go on.
fn link_stats(ctl: &Control, reader: &PageReader) {
    let mut st = ctl.stats.lock().unwrap();
    let same = st.links.len() == reader.links() && st.links.iter().enumerate().all(|(k, l)| l.addr == reader.addr(k));
    if !same {
        st.links = (0..reader.links()).map(|k| crate::links::LinkStat { addr: reader.addr(k).to_string(), ..Default::default() }).collect();
    }
    for l in st.links.iter_mut() {
        l.channels += READ_QPS as u32;
        l.failed = false;
    }
}

/// The channel a fault thread asks through.
pub(crate) fn ask_channel() -> (Sender<Ask>, Receiver<Ask>) {
    std::sync::mpsc::channel()
}

struct Fetch {
    reader: PageReader,
    placer: Arc<Placer>,
    queue: Arc<PushQueue>,
    asks: Receiver<Ask>,
    ctl: Arc<Control>,
    /// READs in flight by work request id.
    slots: Vec<Option<Pending>>,
    claims: Vec<Claim>,
    /// No bulk READ is posted while it owes (a cap changed meanwhile
    /// repays the debt at the new rate, as the source's senders do).
    cap: Arc<TokenBucket>,
    /// Pages asked for now and as prefetch, not yet READ (no free slot,
    /// or read again after their link was dropped).
    now: Vec<u64>,
    soon: Vec<u64>,
    /// Where the search for a link for the next fault READ starts.
    turn: usize,
    /// Links not dropped.
    live: usize,
}

impl Fetch {
    fn run(&mut self, stop: &AtomicBool) -> Result<()> {
        let mut wc = [Wc::default(); 32];
        while !stop.load(Ordering::SeqCst) && !self.placer.is_complete() {
            let busy = self.slots.iter().any(Option::is_some);
            // Asks first: a thread waits on each. With nothing in flight,
            // sleep on them until the bulk may go on.
            let idle = match (busy, self.queue.left() > 0) {
                (true, _) => Duration::ZERO,
                (false, true) => self.cap.owed().unwrap_or(Duration::ZERO).min(IDLE_WAIT),
                (false, false) => IDLE_WAIT,
            };
            let first = if idle.is_zero() {
                self.asks.try_recv().ok()
            } else {
                match self.asks.recv_timeout(idle) {
                    Ok(a) => Some(a),
                    Err(RecvTimeoutError::Timeout) => None,
                    // The sink is gone: the connection is being closed.
                    Err(RecvTimeoutError::Disconnected) => return Ok(()),
                }
            };
            for (n, s) in first.into_iter().chain(std::iter::from_fn(|| self.asks.try_recv().ok())) {
                self.now.extend(n);
                self.soon.extend(s);
            }
            if !self.now.is_empty() || !self.soon.is_empty() {
                self.read_asked()?;
            }
            self.read_bulk()?;
            self.reap(&mut wc)?;
        }
        Ok(())
    }

    /// Take the completions of every link with READs out, sharing
    /// [`CQ_WAIT`] among them; a failed one drops its link.
    fn reap(&mut self, wc: &mut [Wc]) -> Result<()> {
        let busy: Vec<usize> = (0..self.reader.links()).filter(|&k| self.slots.iter().flatten().any(|p| p.link == k)).collect();
        let wait = CQ_WAIT / busy.len().max(1) as u32;
        for k in busy {
            let done = self.reader.completions(k, wc, wait)?.to_vec();
            for w in done {
                if w.status != WcStatus::Success {
                    self.drop_link(k, &format!("RDMA READ failed: {:?}", w.status))?;
                    break;
                }
                self.landed(w.wr_id as usize)?;
            }
        }
        Ok(())
    }

    /// `link` failed: destroy its queue pairs, then read the pages of its
    /// READs out again elsewhere (faults' pages first, the bulk's back to
    /// the plan). Fails when no link is left.
    fn drop_link(&mut self, link: usize, why: &str) -> Result<()> {
        self.reader.drop_link(link);
        self.live -= 1;
        for slot in self.slots.iter_mut().filter(|s| s.is_some_and(|p| p.link == link)) {
            let p = slot.take().expect("a READ in flight");
            self.placer.unclaim(p.run);
            match (p.qp, p.via) {
                (READ_BULK, _) => self.queue.give_back(p.run.first, p.run.count),
                (_, Via::Request) => self.now.extend(p.run.first..p.run.end()),
                _ => self.soon.extend(p.run.first..p.run.end()),
            }
        }
        {
            let mut st = self.ctl.stats.lock().unwrap();
            if let Some(l) = st.links.get_mut(link) {
                l.channels_lost += READ_QPS as u32;
                l.failed = true;
                l.error.get_or_insert_with(|| why.to_string());
            }
        }
        if self.live == 0 {
            return Err(anyhow!("{why} (on every link)"));
        }
        tracing::warn!("postcopy: READs to {} dropped ({why}); reading on the links left", self.reader.addr(link));
        Ok(())
    }

    /// The live link with the fewest READs out on `qp` below `limit`,
    /// searched from the turn of the last choice on.
    fn free_link(&mut self, qp: usize, limit: usize) -> Option<usize> {
        let n = self.reader.links();
        let best = (0..n)
            .map(|i| (self.turn + i) % n)
            .filter(|&k| self.reader.is_live(k))
            .map(|k| (self.in_flight(k, qp), k))
            .filter(|&(out, _)| out < limit)
            .min_by_key(|&(out, _)| out)?
            .1;
        self.turn = best + 1;
        Some(best)
    }

    /// READ what faults ask for, on the urgent queue pairs: the pages
    /// nobody claimed yet, in runs. Pages that find no free slot stay in
    /// `now`/`soon` for the next turn.
    fn read_asked(&mut self) -> Result<()> {
        let (mut now, mut soon) = (std::mem::take(&mut self.now), std::mem::take(&mut self.soon));
        let r = self.read_lists(&mut now, &mut soon);
        // Pages of a link dropped meanwhile came back here too.
        now.append(&mut self.now);
        soon.append(&mut self.soon);
        (self.now, self.soon) = (now, soon);
        r
    }

    fn read_lists(&mut self, now: &mut Vec<u64>, soon: &mut Vec<u64>) -> Result<()> {
        for (list, via) in [(now, Via::Request), (soon, Via::Push)] {
            list.sort_unstable();
            list.dedup();
            let mut i = 0;
            while i < list.len() {
                let p = list[i];
                let mut n = 1;
                while i + (n as usize) < list.len() && list[i + n as usize] == p + n && n < READ_RUN {
                    n += 1;
                }
                // The background must not read these again; it goes on
                // from here (the guest will likely touch what follows).
                self.queue.requested(p, n);
                let (mut at, end) = (p, p + n);
                while at < end {
                    let Some(link) = self.free_link(READ_URGENT, READS_IN_FLIGHT) else {
                        list.retain(|&q| q >= at);
                        return Ok(());
                    };
                    at = self.read_claimed(link, READ_URGENT, at, end - at, via)?.unwrap_or(end);
                }
                i += n as usize;
            }
            list.clear();
        }
        Ok(())
    }

    /// Keep every link's bulk queue pair busy with the source's plan.
    fn read_bulk(&mut self) -> Result<()> {
        while let Some(link) = self.free_link(READ_BULK, BULK_IN_FLIGHT) {
            if self.cap.owed().is_some() {
                return Ok(());
            }
            if !self.queue.claim(READ_RUN, &mut self.claims) {
                return Ok(());
            }
            let claims = std::mem::take(&mut self.claims);
            // Charged as claimed, known-zero pages free (a burst of at
            // most 50 ms, as the source's bucket allows).
            self.cap.charge(claims.iter().filter(|c| !c.known_zero).map(|c| c.count * crate::dirty::PAGE_SIZE).sum());
            for (k, c) in claims.iter().enumerate() {
                if c.known_zero {
                    self.placer.place_zero(c.first, c.count, Via::Push);
                    continue;
                }
                if let Some(stopped) = self.read_claimed(link, READ_BULK, c.first, c.count, Via::Push)? {
                    // No free slot: what is left goes back to the plan.
                    self.queue.give_back(stopped, c.first + c.count - stopped);
                    for r in &claims[k + 1..] {
                        self.queue.give_back(r.first, r.count);
                    }
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    fn in_flight(&self, link: usize, qp: usize) -> usize {
        self.slots.iter().flatten().filter(|p| p.link == link && p.qp == qp).count()
    }

    /// Claim the pages of `[first, first + count)` nobody claimed yet and
    /// post one READ per run of them on `link`'s `qp`. `Some(page)` if
    /// that queue pair ran out of slots there (that page and those after
    /// it are not claimed).
    fn read_claimed(&mut self, link: usize, qp: usize, first: u64, count: u64, via: Via) -> Result<Option<u64>> {
        let end = (first + count).min(self.placer.total());
        let mut p = first;
        while p < end {
            if self.in_flight(link, qp) >= READS_IN_FLIGHT {
                return Ok(Some(p));
            }
            if !self.placer.claim(p) {
                p += 1;
                continue;
            }
            let run = p;
            p += 1;
            while p < end && self.placer.claim(p) {
                p += 1;
            }
            let r = PageRange { first: run, count: p - run };
            let slot = self.slots.iter().position(Option::is_none).expect("a free slot below the limit");
            if let Err(e) = self.reader.read(link, qp, slot as u64, r.first, r.count) {
                // A queue pair in error refuses new work: its link is gone.
                self.placer.unclaim(r);
                self.drop_link(link, &format!("posting a READ: {e:#}"))?;
                return Ok(Some(r.first));
            }
            self.slots[slot] = Some(Pending { link, qp, run: r, via });
        }
        Ok(None)
    }

    /// READ `slot` completed: its pages are in the memfd, map them.
    fn landed(&mut self, slot: usize) -> Result<()> {
        let Some(p) = self.slots.get_mut(slot).and_then(Option::take) else {
            return Err(anyhow!("a READ completion for slot {slot}, which has none in flight"));
        };
        let bytes = p.run.count * crate::dirty::PAGE_SIZE;
        crate::receiver::count_batch(&self.ctl, p.run.count, bytes);
        if let Some(l) = self.ctl.stats.lock().unwrap().links.get_mut(p.link) {
            l.wire_bytes += bytes;
        }
        self.placer.map_claimed(p.run, p.via)
    }

    /// The connection ends with READs out: their pages did not (surely)
    /// land; whoever comes next reads them again.
    fn give_back(&mut self) {
        for p in self.slots.iter_mut().filter_map(Option::take) {
            self.placer.unclaim(p.run);
        }
    }
}
