//! `transit rdma peer` as the bench responder of a guest's `pvrdma-bench`
//! workload (crates/guest/src/pvrdma/bench.rs): the guest's IDs carry
//! `bench=1 gid= write.qpn= write.psn= lat.qpn= lat.psn=`; this side answers
//! `gid= big.addr= big.rkey= write.qpn= write.psn= lat.qpn= lat.psn=`,
//! then gives the guest's WRITEs a 1 MiB target and answers every SEND on
//! the latency QP with a SEND of the same size, waiting on its CQ the way
//! `transit rdma send-lat`'s server does (a completion channel on the
//! receive CQ, so that the two sides of the comparison use the CPU alike;
//! every pong signaled, its completion on a send CQ that wakes nobody and
//! is reaped before the next pong), until `--duration` is over.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use anyhow::Context as _;

use super::{Info, PeerArgs};
use crate::*;

const TARGET_LEN: usize = 1 << 20;
const DEPTH: u32 = 64;

/// Runs the responder; `publish` gets this side's IDs.
pub fn serve(a: &PeerArgs, g: &Info, publish: impl FnOnce(&str) -> anyhow::Result<()>) -> anyhow::Result<()> {
    let gid: Ipv4Addr = g.gid()?;
    let ctx = Context::open(a.sock.as_deref())?;
    let pd = ctx.alloc_pd()?;
    let target = MemBuf::new(TARGET_LEN)?;
    let tmr = pd.reg_mr(&target, 0, TARGET_LEN, access::LOCAL_WRITE | access::REMOTE_WRITE)?;
    let pong = MemBuf::new(2 * 4096)?;
    let pmr = pd.reg_mr(&pong, 0, pong.len(), access::LOCAL_WRITE)?;
    let mtu = Mtu::from_bytes(a.mtu).context("MTU must be 256..4096")?;
    let mut me = Info::default();
    me.set("gid", ctx.gid());
    me.set("big.addr", format!("{:#x}", tmr.addr));
    me.set("big.rkey", tmr.rkey);
    let chan = ctx.create_comp_channel()?;
    let mut qps = Vec::new();
    for (w, psn) in [("write", 0x10_0000u32), ("lat", 0x20_0000)] {
        // The latency QP's receive CQ wakes this side; its send CQ only
        // gets polled, as `transit rdma send-lat`'s.
        let cq = ctx.create_cq(2 * DEPTH, (w == "lat").then_some(&chan))?;
        let scq = ctx.create_cq(2 * DEPTH, None)?;
        let mut init = QpInitAttr::new(&scq, &cq);
        init.cap.max_send_wr = DEPTH;
        init.cap.max_recv_wr = DEPTH;
        let qp = pd.create_qp(&init)?;
        let remote = QpEndpoint { gid, qpn: g.u32(&format!("{w}.qpn"))?, psn: g.u32(&format!("{w}.psn"))? & 0xff_ffff };
        let opts = ConnectOpts { mtu, timeout: a.timeout, min_rnr_timer: 1, sq_psn: psn, ..Default::default() };
        qp.connect(&remote, &opts).with_context(|| format!("connecting the {w} QP"))?;
        me.set(&format!("{w}.qpn"), qp.qpn);
        me.set(&format!("{w}.psn"), psn);
        qps.push((qp, cq, scq));
    }
    let (lqp, lcq, lscq) = &qps[1];
    let recv_sge = [pmr.sge(0, 4096)];
    for k in 0..DEPTH as u64 / 2 {
        lqp.post_recv(&[RecvWr { wr_id: k, sg_list: &recv_sge }])?;
    }
    publish(&me.line())?;
    let deadline = a.duration.map(|d| Instant::now() + Duration::from_secs_f64(d));
    let mut wcs = [Wc::default(); 16];
    let mut answered = 0u64;
    while deadline.is_none_or(|d| Instant::now() < d) {
        let n = lcq.poll_or_wait(&mut wcs, &chan, Duration::ZERO, Duration::from_millis(20))?;
        for wc in &wcs[..n] {
            if wc.status != WcStatus::Success {
                anyhow::bail!("latency QP completion failed: {:?} after {answered} answers", wc.status);
            }
            if wc.opcode == WcOpcode::Recv {
                let sge = [pmr.sge(4096, wc.byte_len as usize)];
                let wr = SendWr::send(u64::MAX, &sge);
                // Signaled, as `transit rdma send-lat`'s server and
                // ib_send_lat post theirs: the guest's side then ACKs at
                // once rather than on its ACK timer. The completions of
                // earlier pongs are reaped first, without waiting.
                reap_sends(lscq)?;
                lqp.post_send(&[wr])?;
                lqp.post_recv(&[RecvWr { wr_id: wc.wr_id, sg_list: &recv_sge }])?;
                answered += 1;
            }
        }
        let (_, wcq, wscq) = &qps[0];
        let _ = wcq.poll(&mut wcs)?;
        let _ = wscq.poll(&mut wcs)?;
    }
    println!("{{\"ok\": true, \"answered\": {answered}}}");
    Ok(())
}

/// Takes the send completions that are there, failing on an error one.
fn reap_sends(cq: &Cq) -> anyhow::Result<()> {
    let mut w = [Wc::default(); 16];
    loop {
        let n = cq.poll(&mut w)?;
        if let Some(bad) = w[..n].iter().find(|c| c.status != WcStatus::Success) {
            anyhow::bail!("pong {} failed: {:?}", bad.wr_id, bad.status);
        }
        if n < w.len() {
            return Ok(());
        }
    }
}
