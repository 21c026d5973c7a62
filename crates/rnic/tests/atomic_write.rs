//! RDMA atomic write (IBTA 1.5, `IBV_WR_ATOMIC_WRITE`) between two rnicd
//! hosts: the 8 bytes land at an aligned address as one store and complete
//! as `IBV_WC_ATOMIC_WRITE`; a misaligned target is refused (a NAK, the
//! requester's WR fails and its QP goes to ERR), as rxe refuses it.
mod common;
use common::*;
use verbs::*;

#[test]
fn atomic_write_lands_aligned_and_misaligned_is_refused() {
    let bed = Bed::new("rnaw", 2);
    let (a, b) = pair(&bed, 0, 1, ConnectOpts::default());
    let word = 0x1122_3344_5566_7788u64.to_ne_bytes();
    let dst = b.mr.addr + 64;
    let aw = |id, at| SendWr { remote_addr: at, rkey: b.mr.rkey, ..SendWr::new(id, WrOpcode::AtomicWrite, &[]).with_inline(&word) };
    a.qp.post_send(&[aw(1, dst)]).unwrap();
    let w = ok(&a.scq);
    assert_eq!((w.wr_id, w.opcode), (1, WcOpcode::AtomicWrite));
    assert_eq!(b.buf.read(64, 8), word);
    assert_eq!(b.buf.read(56, 8), [0; 8], "wrote outside its 8 bytes");
    assert_eq!(b.buf.read(72, 8), [0; 8], "wrote outside its 8 bytes");

    a.qp.post_send(&[aw(2, dst + 4)]).unwrap();
    let w = one(&a.scq);
    assert_eq!((w.wr_id, w.status), (2, WcStatus::RemInvReqErr), "{w:?}");
    let mut want = word.to_vec();
    want.extend_from_slice(&[0; 8]);
    assert_eq!(b.buf.read(64, 16), want, "a refused atomic write changed memory");
    assert_eq!(a.qp.state().unwrap(), QpState::Err);
}
