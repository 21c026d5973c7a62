//! Memory regions over several runs of one memfd (a VM's scattered pages):
//! WRITE, READ, SEND/RECV, atomics and indirect keys crossing run
//! boundaries, write traces by region offset, and the control checks on
//! run lists, between two testbed hosts each running a real rnicd process.
mod common;
use common::*;
use verbs::*;

const PAGE: u64 = 4096;
/// The region starts this far into its first page.
const HEAD: u64 = 0x100;
/// Buffer pages of the region, in region order: out of order, with holes,
/// and two adjacent pages (9, 10) that rnicd merges into one run.
const PAGES: [u64; 7] = [3, 1, 7, 5, 9, 10, 0];
const BASE: u64 = 1 << 20;
const IOVA: u64 = 0x7000_0000_0000 + HEAD;
const LEN: u64 = PAGES.len() as u64 * PAGE - HEAD;

/// The runs `(buffer offset, len)` of the region.
fn runs() -> Vec<(u64, u64)> {
    let mut r: Vec<(u64, u64)> = PAGES.iter().map(|p| (BASE + p * PAGE, PAGE)).collect();
    r[0] = (r[0].0 + HEAD, PAGE - HEAD);
    r
}

/// Where byte `off` of the region lives in the buffer.
fn buf_off(off: u64) -> usize {
    let at = off + HEAD;
    (BASE + PAGES[(at / PAGE) as usize] * PAGE + at % PAGE) as usize
}

/// Bytes [off, off+len) of the region, read through the buffer.
fn region_bytes(buf: &MemBuf, off: u64, len: u64) -> Vec<u8> {
    (off..off + len).map(|o| buf.read(buf_off(o), 1)[0]).collect()
}

const RW: u32 = access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC;

#[test]
fn scattered_region_every_operation_crosses_runs() {
    let bed = Bed::new("rnscat", 2);
    let o = ConnectOpts { mtu: Mtu::M1024, ..Default::default() };
    let (a, b) = pair(&bed, 0, 1, o);
    let smr = b.pd.reg_mr_runs(&b.buf, &runs(), RW, None, IOVA).unwrap();
    assert_eq!((smr.addr, smr.len as u64), (IOVA, LEN));
    smr.start_trace(512).unwrap();

    // A multi-packet WRITE over the whole region lands page by page; the
    // holes between its pages stay untouched.
    let data = pattern(1, LEN as usize);
    a.buf.write(0, &data);
    a.qp.post_send(&[SendWr::write(1, &[a.mr.sge(0, LEN as usize)], IOVA, smr.rkey)]).unwrap();
    ok(&a.scq);
    assert_eq!(region_bytes(&b.buf, 0, LEN), data);
    for hole in [2u64, 4, 6, 8, 11] {
        assert!(b.buf.read((BASE + hole * PAGE) as usize, PAGE as usize).iter().all(|&x| x == 0), "page {hole} written");
    }
    assert!(b.buf.read((BASE + PAGES[0] * PAGE) as usize, HEAD as usize).iter().all(|&x| x == 0), "bytes before the region written");
    // The trace reports region offsets: the whole region.
    let t = smr.fetch_trace().unwrap();
    assert!(!t.all_dirty);
    assert!((0..LEN).step_by(512).all(|o| t.is_dirty(o)), "{t:?}");

    // A short WRITE across one boundary marks only its blocks.
    let w2 = pattern(2, 3000);
    a.buf.write(1 << 20, &w2);
    let off = 2 * PAGE - HEAD - 1000;
    a.qp.post_send(&[SendWr::write(2, &[a.mr.sge(1 << 20, 3000)], IOVA + off, smr.rkey)]).unwrap();
    ok(&a.scq);
    assert_eq!(region_bytes(&b.buf, off, 3000), w2);
    let t = smr.fetch_trace().unwrap();
    assert!(t.is_dirty(off) && t.is_dirty(off + 2999) && !t.is_dirty(0) && !t.is_dirty(LEN - 1), "{t:?}");

    // READ of the whole region, and of a piece across the merged pages.
    let want = region_bytes(&b.buf, 0, LEN);
    a.qp.post_send(&[SendWr::read(3, &[a.mr.sge(2 << 20, LEN as usize)], IOVA, smr.rkey)]).unwrap();
    ok(&a.scq);
    assert_eq!(a.buf.read(2 << 20, LEN as usize), want);
    let off = 5 * PAGE - HEAD - 10;
    a.qp.post_send(&[SendWr::read(4, &[a.mr.sge(3 << 20, 5000)], IOVA + off, smr.rkey)]).unwrap();
    ok(&a.scq);
    assert_eq!(a.buf.read(3 << 20, 5000), want[off as usize..off as usize + 5000]);

    // Atomics on the last word of a run and the first word of the next.
    let last = PAGE - HEAD - 8;
    let first = PAGE - HEAD;
    b.buf.write_u64(buf_off(last), 100);
    b.buf.write_u64(buf_off(first), 7);
    a.qp.post_send(&[
        SendWr::fetch_add(5, &[a.mr.sge(4 << 20, 8)], IOVA + last, smr.rkey, 5),
        SendWr::cmp_swap(6, &[a.mr.sge((4 << 20) + 8, 8)], IOVA + first, smr.rkey, 7, 70),
    ])
    .unwrap();
    a.scq.wait(2, T).unwrap().iter().for_each(|w| assert_eq!(w.status, WcStatus::Success, "{w:?}"));
    assert_eq!((a.buf.read_u64(4 << 20), a.buf.read_u64((4 << 20) + 8)), (100, 7));
    assert_eq!((b.buf.read_u64(buf_off(last)), b.buf.read_u64(buf_off(first))), (105, 70));

    // SEND scattered into a receive buffer of the region, and b's SEND
    // gathered from it (local access through the lkey).
    let s = pattern(3, 9000);
    a.buf.write(5 << 20, &s);
    let roff = PAGE - HEAD - 500;
    b.qp.post_recv(&[RecvWr { wr_id: 7, sg_list: &[smr.sge(roff as usize, 9000)] }]).unwrap();
    a.qp.post_send(&[SendWr::send(8, &[a.mr.sge(5 << 20, 9000)])]).unwrap();
    assert_eq!(ok(&b.rcq).byte_len, 9000);
    ok(&a.scq);
    assert_eq!(region_bytes(&b.buf, roff, 9000), s);
    a.qp.post_recv(&[RecvWr { wr_id: 9, sg_list: &[a.mr.sge(6 << 20, 9000)] }]).unwrap();
    b.qp.post_send(&[SendWr::send(10, &[smr.sge(roff as usize, 9000)])]).unwrap();
    assert_eq!(ok(&a.rcq).byte_len, 9000);
    ok(&b.scq);
    assert_eq!(a.buf.read(6 << 20, 9000), s);

    // An indirect key bound to a range of the region crossing runs.
    let k = b.pd.create_indirect_key(2, None).unwrap();
    let kiova = 0x2000_0000u64;
    b.qp.post_bind(11, k.key(), kiova, RW, &[smr.sge(1000, 5000), b.mr.sge(7 << 20, 1000)], true).unwrap();
    ok(&b.scq);
    let kd = pattern(4, 6000);
    a.buf.write(7 << 20, &kd);
    a.qp.post_send(&[SendWr::write(12, &[a.mr.sge(7 << 20, 6000)], kiova, k.key())]).unwrap();
    ok(&a.scq);
    assert_eq!(region_bytes(&b.buf, 1000, 5000), kd[..5000]);
    assert_eq!(b.buf.read(7 << 20, 1000), kd[5000..]);

    // A WRITE running past the region's end is refused, nothing written.
    let before = region_bytes(&b.buf, LEN - 8, 8);
    a.qp.post_send(&[SendWr::write(13, &[a.mr.sge(0, 16)], IOVA + LEN - 8, smr.rkey)]).unwrap();
    assert_eq!(one(&a.scq).status, WcStatus::RemAccessErr);
    assert_eq!(region_bytes(&b.buf, LEN - 8, 8), before);
}

#[test]
fn scattered_region_bad_run_lists_are_refused() {
    let bed = Bed::new("rnscbad", 1);
    let ctx = bed.ctx(0);
    let pd = ctx.alloc_pd().unwrap();
    let buf = MemBuf::new(1 << 20).unwrap();
    let size = buf.len() as u64;
    // (what is wrong, runs, iova)
    type Case = (&'static str, Vec<(u64, u64)>, u64);
    let bad: Vec<Case> = vec![
        ("no runs", vec![], 0),
        ("run outside the memfd", vec![(0, PAGE), (size, PAGE)], 0),
        ("run crossing the memfd end", vec![(0, PAGE), (size - PAGE, 2 * PAGE)], 0),
        ("empty run", vec![(0, PAGE), (4 * PAGE, 0)], 0),
        ("boundary off a page", vec![(0, PAGE - 8), (4 * PAGE, PAGE)], 0),
        ("run starting off a page", vec![(0, PAGE), (4 * PAGE + 8, PAGE)], 0),
        ("iova with another page offset", vec![(HEAD, PAGE - HEAD), (4 * PAGE, PAGE)], 0x1000),
        ("overflowing run", vec![(0, PAGE), (4 * PAGE, u64::MAX)], 0),
        ("too many runs", (0..=2048u64).map(|i| ((i % 128) * 2 * PAGE, PAGE)).collect(), 0),
    ];
    for (what, runs, iova) in bad {
        assert!(pd.reg_mr_runs(&buf, &runs, RW, None, iova).is_err(), "{what} accepted");
    }
    // The daemon still serves the client; adjacent runs are one region.
    let mr = pd.reg_mr_runs(&buf, &[(0, PAGE), (PAGE, PAGE), (8 * PAGE, 100)], RW, None, 0).unwrap();
    assert_eq!(mr.len as u64, 2 * PAGE + 100);
}
