//! Memory windows on rnicd's indirect keys (docs/ibverbs.md): an MR
//! registered with MW_BIND lends remote rights it lacks itself to a window
//! bound by a send-queue WR; the bind renames the window's key to the
//! consumer's new rkey (same family: only the low byte differs); a bind of
//! no range, a peer's SEND with invalidate and destroying the key all end
//! its access. Two testbed hosts, each a real rnicd; data verified.
mod common;
use common::*;
use verbs::mkeys::KeyOp;
use verbs::*;

/// A window key family above the 24 bits rnicd numbers its objects with.
const FAMILY: u32 = 0x0123_4500;

/// A bind of window `key` under `new_key` to `range` of `mr`, signaled.
fn bind(key: u32, new_key: u32, acc: u32, mr: &Mr, range: &[Sge]) -> [KeyOp<'static>; 1] {
    [KeyOp::BindWindow { wr_id: 1, key, new_key, iova: mr.addr, access: acc, range: range.first().copied(), signaled: true }]
}

/// A new connected pair of QPs in `c`'s and `d`'s PDs (their CQs first).
fn qps_between(c: &End, d: &End, o: ConnectOpts) -> (Cq, Qp, Cq, Qp) {
    let (cq_c, cq_d) = (c.ctx.create_cq(16, None).unwrap(), d.ctx.create_cq(16, None).unwrap());
    let qp_c = c.pd.create_qp(&QpInitAttr::new(&cq_c, &cq_c)).unwrap();
    let qp_d = d.pd.create_qp(&QpInitAttr::new(&cq_d, &cq_d)).unwrap();
    qp_c.connect(&qp_d.endpoint(0x10_0000), &ConnectOpts { sq_psn: 0xff_fff0, ..o }).unwrap();
    qp_d.connect(&qp_c.endpoint(0xff_fff0), &ConnectOpts { sq_psn: 0x10_0000, ..o }).unwrap();
    (cq_c, qp_c, cq_d, qp_d)
}

#[test]
fn window_bind_renames_and_ends() {
    let bed = Bed::new("mwin", 2);
    let o = ConnectOpts { mtu: Mtu::M1024, ..Default::default() };
    let (a, b) = pair(&bed, 0, 1, o);
    // b's MR grants no remote access itself; windows may lend it.
    let wmr = b.pd.reg_mr(&b.buf, 0, 1 << 20, access::LOCAL_WRITE | access::MW_BIND).unwrap();
    let mut k = b.pd.create_indirect_key(1, Some(FAMILY)).unwrap();
    let _ = &b;
    let range = [wmr.sge(0, 4096)];
    b.qp.post_key_ops(&bind(FAMILY, FAMILY + 1, access::REMOTE_WRITE | access::LOCAL_WRITE, &wmr, &range)).unwrap();
    let w = ok(&b.scq);
    assert_eq!(w.opcode, WcOpcode::BindKey);
    k.renamed(FAMILY + 1);
    // The new key writes; the old one is gone.
    let data = pattern(7, 4096);
    a.buf.write(0, &data);
    a.qp.post_send(&[SendWr::write(2, &[a.mr.sge(0, 4096)], wmr.addr, FAMILY + 1)]).unwrap();
    ok(&a.scq);
    assert_eq!(b.buf.read(0, 4096), data);
    a.qp.post_send(&[SendWr::write(4, &[a.mr.sge(0, 64)], wmr.addr, FAMILY)]).unwrap();
    assert_eq!(one(&a.scq).status, WcStatus::RemAccessErr);

    // The MR's own rkey grants nothing remote (a fresh pair: the old one is in ERR).
    let (a, b) = pair(&bed, 0, 1, o);
    let wmr = b.pd.reg_mr(&b.buf, 0, 1 << 20, access::LOCAL_WRITE | access::MW_BIND).unwrap();
    a.qp.post_send(&[SendWr::write(3, &[a.mr.sge(0, 64)], wmr.addr, wmr.rkey)]).unwrap();
    assert_eq!(one(&a.scq).status, WcStatus::RemAccessErr);
    drop(k);

    // A rename into another family, or an MR without MW_BIND, fail the
    // bind (IBV_WC_MW_BIND_ERR, as rxe).
    let (c, d) = pair(&bed, 0, 1, o);
    let dmr = d.pd.reg_mr(&d.buf, 0, 4096, access::LOCAL_WRITE | access::MW_BIND).unwrap();
    let k1 = d.pd.create_indirect_key(1, Some(FAMILY + 0x1000)).unwrap();
    let r1 = [dmr.sge(0, 4096)];
    let rw = access::REMOTE_WRITE | access::LOCAL_WRITE;
    d.qp.post_key_ops(&bind(k1.key(), k1.key() + 1, rw, &dmr, &r1)).unwrap();
    ok(&d.scq);
    d.qp.post_key_ops(&bind(k1.key() + 1, k1.key() + 0x101, rw, &dmr, &r1)).unwrap();
    assert_eq!(one(&d.scq).status, WcStatus::MwBindErr);
    // The failed rename left the window bound to nothing (d's QP is in ERR
    // now: c writes over new QPs in the same two PDs).
    let (cq_c, qp_c, _cq_d, _qp_d) = qps_between(&c, &d, o);
    qp_c.post_send(&[SendWr::write(11, &[c.mr.sge(0, 64)], dmr.addr, k1.key() + 1)]).unwrap();
    assert_eq!(one(&cq_c).status, WcStatus::RemAccessErr);
    let (_c, d) = pair(&bed, 0, 1, o);
    let plain = d.pd.reg_mr(&d.buf, 0, 4096, access::LOCAL_WRITE).unwrap();
    let k2 = d.pd.create_indirect_key(1, Some(FAMILY + 0x1100)).unwrap();
    let r2 = [plain.sge(0, 4096)];
    d.qp.post_key_ops(&bind(k2.key(), k2.key() + 1, access::REMOTE_WRITE | access::LOCAL_WRITE, &plain, &r2)).unwrap();
    assert_eq!(one(&d.scq).status, WcStatus::MwBindErr);
    // Even an MR that has the rights itself takes no window without
    // MW_BIND (IBA C10-73); the failed bind leaves the window, under the
    // new key its consumer now names it by, bound to nothing.
    let (c, d) = pair(&bed, 0, 1, o);
    let dmr = d.pd.reg_mr(&d.buf, 0, 4096, access::LOCAL_WRITE | access::MW_BIND).unwrap();
    let remote = d.pd.reg_mr(&d.buf, 4096, 4096, access::LOCAL_WRITE | access::REMOTE_WRITE).unwrap();
    let mut k3 = d.pd.create_indirect_key(1, Some(FAMILY + 0x1200)).unwrap();
    let (r3, r4) = ([dmr.sge(0, 4096)], [remote.sge(0, 4096)]);
    d.qp.post_key_ops(&bind(k3.key(), k3.key() + 1, rw, &dmr, &r3)).unwrap();
    ok(&d.scq);
    d.qp.post_key_ops(&bind(k3.key() + 1, k3.key() + 2, access::REMOTE_WRITE, &remote, &r4)).unwrap();
    let w = one(&d.scq);
    assert_eq!((w.status, w.opcode), (WcStatus::MwBindErr, WcOpcode::BindKey));
    k3.renamed(k3.key() + 2);
    let (cq_c, qp_c, _cq_d, _qp_d) = qps_between(&c, &d, o);
    qp_c.post_send(&[SendWr::write(12, &[c.mr.sge(0, 64)], dmr.addr, k3.key() + 2)]).unwrap();
    assert_eq!(one(&cq_c).status, WcStatus::RemAccessErr);
    let (cq_c, qp_c, _cq_d, _qp_d) = qps_between(&c, &d, o);
    qp_c.post_send(&[SendWr::write(13, &[c.mr.sge(0, 64)], dmr.addr, k3.key() + 1)]).unwrap();
    assert_eq!(one(&cq_c).status, WcStatus::RemAccessErr);
    // The MR's own rkey still works: only windows are refused.
    let (cq_c, qp_c, _cq_d, _qp_d) = qps_between(&c, &d, o);
    qp_c.post_send(&[SendWr::write(14, &[c.mr.sge(0, 64)], remote.addr, remote.rkey)]).unwrap();
    ok(&cq_c);
    drop(k3);

    // A bind with no range (type 1's zero-length bind) unbinds under the new key.
    let (a, b) = pair(&bed, 0, 1, o);
    let wmr = b.pd.reg_mr(&b.buf, 0, 1 << 20, access::LOCAL_WRITE | access::MW_BIND).unwrap();
    let range = [wmr.sge(0, 4096)];
    let mut k = b.pd.create_indirect_key(1, Some(FAMILY + 0x2000)).unwrap();
    let base = k.key();
    b.qp.post_key_ops(&bind(base, base + 1, access::REMOTE_WRITE | access::LOCAL_WRITE, &wmr, &range)).unwrap();
    ok(&b.scq);
    b.qp.post_key_ops(&bind(base + 1, base + 2, 0, &wmr, &[])).unwrap();
    ok(&b.scq);
    k.renamed(base + 2);
    a.qp.post_send(&[SendWr::write(5, &[a.mr.sge(0, 64)], wmr.addr, base + 2)]).unwrap();
    assert_eq!(one(&a.scq).status, WcStatus::RemAccessErr);

    // A peer's SEND with invalidate ends a bound window.
    let (a, b) = pair(&bed, 0, 1, o);
    let wmr = b.pd.reg_mr(&b.buf, 0, 1 << 20, access::LOCAL_WRITE | access::MW_BIND).unwrap();
    let range = [wmr.sge(0, 4096)];
    let k = b.pd.create_indirect_key(1, Some(FAMILY + 0x3000)).unwrap();
    let key = k.key();
    b.qp.post_key_ops(&bind(key, key + 1, access::REMOTE_WRITE | access::LOCAL_WRITE, &wmr, &range)).unwrap();
    ok(&b.scq);
    b.qp.post_recv(&[RecvWr { wr_id: 6, sg_list: &[b.mr.sge(2 << 20, 64)] }]).unwrap();
    let mut inv = SendWr::send(7, &[]);
    inv.opcode = WrOpcode::SendInv;
    inv.imm = key + 1;
    a.qp.post_send(&[inv]).unwrap();
    ok(&a.scq);
    ok(&b.rcq);
    a.qp.post_send(&[SendWr::write(8, &[a.mr.sge(0, 64)], wmr.addr, key + 1)]).unwrap();
    assert_eq!(one(&a.scq).status, WcStatus::RemAccessErr);
    drop(k);

    // Destroying a renamed window (its current key) ends its access.
    let (a, b) = pair(&bed, 0, 1, o);
    let wmr = b.pd.reg_mr(&b.buf, 0, 1 << 20, access::LOCAL_WRITE | access::MW_BIND).unwrap();
    let range = [wmr.sge(0, 4096)];
    let mut k = b.pd.create_indirect_key(1, Some(FAMILY + 0x4000)).unwrap();
    let key = k.key();
    b.qp.post_key_ops(&bind(key, key + 0xff, access::REMOTE_WRITE | access::LOCAL_WRITE, &wmr, &range)).unwrap();
    ok(&b.scq);
    k.renamed(key + 0xff);
    a.qp.post_send(&[SendWr::write(9, &[a.mr.sge(0, 64)], wmr.addr, key + 0xff)]).unwrap();
    ok(&a.scq);
    drop(k);
    a.qp.post_send(&[SendWr::write(10, &[a.mr.sge(0, 64)], wmr.addr, key + 0xff)]).unwrap();
    assert_eq!(one(&a.scq).status, WcStatus::RemAccessErr);
}
