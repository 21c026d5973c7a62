//! Write traces never miss a written page: random WRITEs, SENDs, READ
//! responses and atomics into a traced MR, checked against a byte-by-byte
//! comparison of the memory before and after each fetch; too many dirty runs
//! turn into "all dirty".
mod common;
use common::*;
use verbs::*;

const G: u64 = 4096;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[test]
fn trace_never_misses_a_written_page() {
    let bed = Bed::new("rntrace", 2);
    let o = ConnectOpts { mtu: Mtu::M1024, ..Default::default() };
    let (a, b) = pair(&bed, 0, 1, o);
    a.buf.write(0, &pattern(11, BUF));
    b.buf.write(0, &pattern(12, BUF));

    // Bad requests are refused clearly.
    assert!(format!("{:#}", b.mr.fetch_trace().unwrap_err()).contains("not being traced"));
    assert!(b.mr.start_trace(1000).is_err());
    b.mr.start_trace(G).unwrap();

    let mut rng = Rng(0x5eed);
    let bl = BUF as u64;
    for round in 0..40 {
        let prev = b.buf.read(0, BUF);
        let mut written = 0u64;
        for k in 0..1 + rng.below(12) {
            let id = round * 100 + k;
            match rng.below(5) {
                0 => {
                    let len = 1 + rng.below(300_000);
                    let (src, dst) = (rng.below(bl - len), rng.below(bl - len));
                    a.qp.post_send(&[SendWr::write(id, &[a.mr.sge(src as usize, len as usize)], b.mr.addr + dst, b.mr.rkey)]).unwrap();
                    ok(&a.scq);
                    written += len + 2 * G;
                }
                1 => {
                    let len = 1 + rng.below(60_000);
                    let (src, dst) = (rng.below(bl - len), rng.below(bl - len));
                    b.qp.post_recv(&[RecvWr { wr_id: id, sg_list: &[b.mr.sge(dst as usize, len as usize)] }]).unwrap();
                    a.qp.post_send(&[SendWr::send(id, &[a.mr.sge(src as usize, len as usize)])]).unwrap();
                    ok(&a.scq);
                    ok(&b.rcq);
                    written += len + 2 * G;
                }
                2 => {
                    // READ responses land in the traced MR.
                    let len = 1 + rng.below(200_000);
                    let (src, dst) = (rng.below(bl - len), rng.below(bl - len));
                    b.qp.post_send(&[SendWr::read(id, &[b.mr.sge(dst as usize, len as usize)], a.mr.addr + src, a.mr.rkey)]).unwrap();
                    ok(&b.scq);
                    written += len + 2 * G;
                }
                3 => {
                    let at = rng.below(bl / 8) * 8;
                    a.qp.post_send(&[SendWr::fetch_add(id, &[a.mr.sge(0, 8)], b.mr.addr + at, b.mr.rkey, 1 + rng.below(1000))]).unwrap();
                    ok(&a.scq);
                    written += G;
                }
                _ => {
                    // Atomic result written into the traced MR by b's own CAS on a.
                    let (at, res) = (rng.below(bl / 8) * 8, rng.below(bl / 8) * 8);
                    let cmp = a.buf.read_u64(at as usize);
                    b.qp.post_send(&[SendWr::cmp_swap(id, &[b.mr.sge(res as usize, 8)], a.mr.addr + at, a.mr.rkey, cmp, rng.next())])
                        .unwrap();
                    ok(&b.scq);
                    written += G;
                }
            }
        }
        let t = b.mr.fetch_trace().unwrap();
        let cur = b.buf.read(0, BUF);
        assert_eq!(t.granularity, G);
        assert!(!t.all_dirty, "round {round}: a few writes fit in the run list");
        let mut changed = 0;
        for (blk, (p, c)) in prev.chunks(G as usize).zip(cur.chunks(G as usize)).enumerate() {
            if let Some(i) = p.iter().zip(c).position(|(x, y)| x != y) {
                let off = blk as u64 * G + i as u64;
                assert!(t.is_dirty(off), "round {round}: byte {off:#x} changed but the trace missed it");
                changed += 1;
            }
        }
        let dirty: u64 = t.runs.iter().map(|r| r.1).sum();
        assert!(dirty <= written, "round {round}: trace reports {dirty} bytes for at most {written} written");
        assert!(changed > 0 || dirty == 0 || written > 0);
    }

    // Nothing written since the last fetch: an empty trace.
    let t = b.mr.fetch_trace().unwrap();
    assert!(!t.all_dirty && t.runs.is_empty(), "{t:?}");

    // More dirty runs than a reply holds: "all dirty", then clear again.
    // (512-byte blocks, every other one written: 1,100 runs.)
    b.mr.start_trace(512).unwrap();
    for k in 0..1100u64 {
        let dst = k * 1024;
        a.qp.post_send(&[SendWr::write(k, &[a.mr.sge(0, 8)], b.mr.addr + dst, b.mr.rkey).unsignaled()]).unwrap();
        if k % 100 == 99 {
            a.qp.post_send(&[SendWr::write(k, &[a.mr.sge(0, 8)], b.mr.addr + dst, b.mr.rkey)]).unwrap();
            ok(&a.scq);
        }
    }
    let t = b.mr.fetch_trace().unwrap();
    assert!(t.all_dirty && t.is_dirty(0), "{} runs", t.runs.len());
    let t = b.mr.fetch_trace().unwrap();
    assert!(!t.all_dirty && t.runs.is_empty());

    // Stopped: fetching is refused again.
    b.mr.stop_trace().unwrap();
    assert!(b.mr.fetch_trace().is_err());
}
