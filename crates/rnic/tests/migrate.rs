//! A QP moved between two rnicd processes on two testbed hosts while its peer
//! on a third host keeps posting SEND, WRITE, READ and fetch-and-add at full
//! rate: suspend, query the runtime state, recreate PD/CQ/MR with the same
//! keys and addresses on the new host, create the QP suspended from the
//! state, repost the WRs that were not retired, move the GID address, resume.
//! Every message arrives exactly once and in order, every atomic executes
//! exactly once, and the peer's QP never leaves RTS.
//!
//! The moment of the suspend is made, not waited for: nftables rules on the
//! old host hold the moving QP's traffic at chosen PSNs (first its requests
//! from the middle of its RDMA WRITE on, then the peer's responses from there
//! on), so that it is suspended with the WRITE exactly half acknowledged, its
//! RDMA READ answered but the response not received, and its own atomics
//! executed by the peer but not acknowledged.
mod common;
use common::*;
use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use verbs::*;

const MB: usize = 1 << 20;
const KEY: u32 = 0x4d4d00;
const IOVA: u64 = 0x7f00_0000_0000;
/// Peer rounds: each is SEND + WRITE + READ + fetch-and-add.
const ROUNDS: usize = 1500;
/// Rounds the peer may post before the move is over: it is still sending
/// while the QP moves, however slow the machine.
const ROUNDS_BEFORE_MOVE: usize = 1200;
const PEER_DEPTH: usize = 64;
const WSLOT: usize = 32 << 10;
const RSLOT: usize = 16 << 10;

// Layout of the migrating side's memory (M).
const M_W: usize = 0; // peer WRITEs: 64 slots of 32 KiB
const M_R: usize = 2 * MB; // peer READs from here (static pattern)
const M_CNT: usize = 3 * MB; // peer's fetch-and-add counter
const M_FA_RES: usize = 3 * MB + 4096; // M's own fetch-and-add results
const M_SEND_SRC: usize = 3 * MB + 8192; // M's SEND payloads (64 B each)
const M_RECV: usize = 4 * MB; // M's receive buffers (64 B each)
const M_WSRC: usize = 5 * MB; // M's WRITE source (1 MiB)
const M_RDST: usize = 7 * MB; // M's READ destination (256 KiB)

// Layout of the peer's memory (P).
const P_WDST: usize = 0; // M's WRITE lands here (1 MiB)
const P_RSRC: usize = 2 * MB; // M's READ source
const P_CNT: usize = 3 * MB; // M's fetch-and-add counter
const P_FA_RES: usize = 3 * MB + 4096; // peer FA results (128 slots)
const P_RDST: usize = 4 * MB; // peer READ destinations (64 slots of 16 KiB)
const P_SEND_SRC: usize = 5 * MB; // peer SEND payloads (256 slots of 64 B)
const P_RECV: usize = 6 * MB; // peer receive buffers for M's SENDs
const P_WSRC: usize = 7 * MB; // peer WRITE sources (32 slots of 32 KiB)

// M's own requests and their PSNs (path MTU 1024, first PSN 0x1000).
const W_LEN: usize = MB;
const R_LEN: usize = 256 << 10;
const M_SENDS: usize = 40;
const W_FIRST: u32 = 0x1000;
/// The WRITE's middle: packets before it are acknowledged when M is suspended.
const W_HALF: u32 = W_FIRST + (W_LEN / 2048) as u32;
const READ_PSN: u32 = W_FIRST + (W_LEN / 1024) as u32;
const FA1_PSN: u32 = READ_PSN + (R_LEN / 1024) as u32;
const FA2_PSN: u32 = FA1_PSN + 1 + M_SENDS as u32;
/// Above every PSN M uses in this test.
const M_PSN_END: u32 = 0x1fff;

/// A WR of the migrating side, kept so that it can be reposted.
#[derive(Clone, Copy, Debug)]
enum MWr {
    Write { id: u64 },
    Read { id: u64 },
    FetchAdd { id: u64, slot: usize },
    Send { id: u64, seq: usize },
}

fn post_m(qp: &Qp, mr: &Mr, w: MWr) {
    let r = match w {
        MWr::Write { id } => {
            qp.post_send(&[SendWr::write(id, &[mr.sge(M_WSRC, W_LEN)], P_ADDR.with(|a| a.get()) + P_WDST as u64, P_RKEY.with(|k| k.get()))])
        }
        MWr::Read { id } => {
            qp.post_send(&[SendWr::read(id, &[mr.sge(M_RDST, R_LEN)], P_ADDR.with(|a| a.get()) + P_RSRC as u64, P_RKEY.with(|k| k.get()))])
        }
        MWr::FetchAdd { id, slot } => qp.post_send(&[SendWr::fetch_add(
            id,
            &[mr.sge(M_FA_RES + slot * 8, 8)],
            P_ADDR.with(|a| a.get()) + P_CNT as u64,
            P_RKEY.with(|k| k.get()),
            1,
        )]),
        MWr::Send { id, seq } => qp.post_send(&[SendWr::send(id, &[mr.sge(M_SEND_SRC + seq * 64, 64)])]),
    };
    r.unwrap();
}

thread_local! {
    static P_ADDR: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    static P_RKEY: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// The migrating side's objects on one host.
struct Side {
    qp: Qp,
    mr: Mr,
    scq: Cq,
    rcq: Cq,
    _pd: Pd,
    buf: MemBuf,
    _ctx: Context,
}

fn init_attr(scq: &Cq, rcq: &Cq) -> QpInitAttr {
    let mut init = QpInitAttr::new(scq, rcq);
    init.cap.max_send_wr = 256;
    init.cap.max_recv_wr = 2048;
    init
}

fn drain(cq: &Cq, out: &mut Vec<Wc>) {
    let mut wcs = [Wc::default(); 64];
    loop {
        let n = cq.poll(&mut wcs).unwrap();
        out.extend_from_slice(&wcs[..n]);
        if n == 0 {
            break;
        }
    }
}

/// The peer: posts ROUNDS x (SEND, WRITE, READ, FA) towards the migrating QP
/// (no more than `allowed` rounds so far), keeps PEER_DEPTH WRs in flight,
/// checks every completion as it comes.
fn peer_loop(p: &End, progress: &AtomicU64, allowed: &AtomicUsize) {
    for s in 0..32 {
        p.buf.write(P_WSRC + s * WSLOT, &pattern(1000 + s as u64, WSLOT));
    }
    let read_src = pattern(99, MB);
    let total = ROUNDS * 4;
    let (mut posted, mut done) = (0usize, 0usize);
    let mut wcs = [Wc::default(); 64];
    let mut last = Instant::now();
    while done < total {
        while posted < total.min(allowed.load(Ordering::Acquire) * 4) && posted - done < PEER_DEPTH {
            let (round, kind) = (posted / 4, posted % 4);
            let id = posted as u64;
            let wr = match kind {
                0 => {
                    let off = P_SEND_SRC + (round % 256) * 64;
                    let mut msg = vec![0u8; 64];
                    msg[..8].copy_from_slice(&(round as u64).to_le_bytes());
                    msg[8..].copy_from_slice(&pattern(round as u64, 56));
                    p.buf.write(off, &msg);
                    p.qp.post_send(&[SendWr::send(id, &[p.mr.sge(off, 64)])])
                }
                1 => p.qp.post_send(&[SendWr::write(
                    id,
                    &[p.mr.sge(P_WSRC + (round % 32) * WSLOT, WSLOT)],
                    IOVA + (M_W + (round % 64) * WSLOT) as u64,
                    KEY,
                )]),
                2 => p.qp.post_send(&[SendWr::read(
                    id,
                    &[p.mr.sge(P_RDST + (round % 64) * RSLOT, RSLOT)],
                    IOVA + (M_R + (round % 32) * RSLOT) as u64,
                    KEY,
                )]),
                _ => p.qp.post_send(&[SendWr::fetch_add(id, &[p.mr.sge(P_FA_RES + (round % 128) * 8, 8)], IOVA + M_CNT as u64, KEY, 1)]),
            };
            wr.unwrap();
            posted += 1;
        }
        let n = p.scq.poll(&mut wcs).unwrap();
        for w in &wcs[..n] {
            assert_eq!(w.status, WcStatus::Success, "peer completion {w:?}");
            assert_eq!(w.wr_id, done as u64, "peer completions in order");
            let (round, kind) = (done / 4, done % 4);
            if kind == 2 {
                let got = p.buf.read(P_RDST + (round % 64) * RSLOT, RSLOT);
                assert!(got[..] == read_src[(round % 32) * RSLOT..][..RSLOT], "peer READ {round} data");
            }
            if kind == 3 {
                assert_eq!(
                    p.buf.read_u64(P_FA_RES + (round % 128) * 8),
                    round as u64,
                    "fetch-and-add {round} executed exactly once, in order"
                );
            }
            done += 1;
        }
        progress.store(done as u64, Ordering::Relaxed);
        if n > 0 {
            last = Instant::now();
        } else {
            assert!(last.elapsed() < Duration::from_secs(60), "peer made no progress for 60 s ({done}/{total})");
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

/// nftables rules in table `inet rnmig` of host `h` (replacing any earlier ones
/// in one transaction).
fn hold(h: &testbed::Host, chains: &str) {
    h.sh(&format!("nft -f - <<'EOF'\nadd table inet rnmig\ndelete table inet rnmig\ntable inet rnmig {{\n{chains}\n}}\nEOF")).unwrap();
}

fn counter(h: &testbed::Host, name: &str) -> u64 {
    let out = h.sh(&format!("nft list counter inet rnmig {name}")).unwrap();
    let w: Vec<&str> = out.split_whitespace().collect();
    w.iter().position(|x| *x == "packets").and_then(|i| w[i + 1].parse().ok()).unwrap_or_else(|| panic!("counter {name}: {out}"))
}

/// Waits until nft counter `name` exceeds `seen`; meanwhile, if the counter
/// stays put for 2 s (a packet lost on the veth: the QP has no retransmission
/// timer in this phase), suspends and resumes the QP in place, which sends
/// again from `una`. A kick that finds the suspended QP `reached` where the
/// caller waits for it to be returns at once and leaves it suspended: an ACK
/// the counter counted before the caller's last suspend may reach the QP
/// only after its resume, and then the QP resends nothing it acknowledges,
/// so nothing makes the peer send that ACK again. Returns the counter and
/// the number of kicks.
fn wait_counter(h: &testbed::Host, name: &str, seen: u64, qp: &Qp, reached: impl Fn(&QpSnapshot) -> bool) -> (u64, usize) {
    let (mut kicks, mut since) = (0, Instant::now());
    loop {
        let c = counter(h, name);
        if c > seen {
            return (c, kicks);
        }
        if since.elapsed() > Duration::from_secs(2) {
            if kicks >= 30 {
                // Say where M was (the full suite stalled here once, before
                // `reached`).
                let state = qp.query_state().map(|s| format!("{:?}", s.runtime));
                panic!(
                    "nft counter {name} never moved; M's transport state: {state:?}; rules: {}",
                    h.sh("nft list table inet rnmig").unwrap_or_default()
                );
            }
            qp.suspend().unwrap();
            kicks += 1;
            if reached(&qp.query_state().unwrap()) {
                return (counter(h, name), kicks);
            }
            qp.resume().unwrap();
            since = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn qp_moves_between_hosts_while_peer_keeps_sending() {
    // Without UDP GSO: the nftables rules below match each packet's own BTH
    // (on a veth, a GSO batch passes the hooks as one skb with the first
    // segment's headers).
    let bed = Bed::with_args("rnmig", 3, &["--no-gso"]);
    let (h_old, h_peer, h_new) = (bed.tb.host(0), bed.tb.host(1), bed.tb.host(2));
    let gid: Ipv4Addr = bed.tb.spare_addr(0, 7);
    // The old host must not teach the peer its MAC for the GID after the
    // move: its ARP requests use its primary address (arp_announce 2).
    h_old.sh(&format!("sysctl -qw net.ipv4.conf.all.arp_announce=2; ip addr add {gid}/24 dev eth0")).unwrap();

    // The migrating side, in namespace `gid` on the old host.
    let ctx = Context::open_namespace(Some(&bed.nics[0].sock), gid).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let (scq, rcq) = (ctx.create_cq(1024, None).unwrap(), ctx.create_cq(4096, None).unwrap());
    let qp = pd.create_qp(&init_attr(&scq, &rcq)).unwrap();
    let buf = MemBuf::new(8 * MB).unwrap();
    let mr = pd.reg_mr_at(&buf, 0, 8 * MB, access::ALL, Some(KEY), IOVA).unwrap();
    let m = Side { qp, mr, scq, rcq, _pd: pd, buf, _ctx: ctx };
    m.buf.write(M_R, &pattern(99, MB));
    m.buf.write(M_WSRC, &pattern(7, W_LEN));
    for seq in 0..64 {
        m.buf.write(M_SEND_SRC + seq * 64, &[(seq as u64).to_le_bytes().to_vec(), pattern(500 + seq as u64, 56)].concat());
    }

    // The peer, on its own host, unchanged rnicd, default namespace.
    let p = End::new(bed.ctx(1), 8 * MB, 256);
    p.buf.write(P_RSRC, &pattern(55, R_LEN));
    P_ADDR.with(|a| a.set(p.mr.addr));
    P_RKEY.with(|k| k.set(p.mr.rkey));
    let o = ConnectOpts { mtu: Mtu::M1024, rnr_retry: 7, min_rnr_timer: 12, ..Default::default() };
    // M has no retransmission timer (timeout 0 = infinite) until it has
    // moved: the held packets must not make it retransmit on its own and so
    // shift the state it is suspended in. Its only go-back-N resends are the
    // ones every resume does.
    m.qp.connect(&p.qp.endpoint(0x2000), &ConnectOpts { sq_psn: W_FIRST, timeout: 0, ..o }).unwrap();
    p.qp.connect(&m.qp.endpoint(W_FIRST), &ConnectOpts { sq_psn: 0x2000, ..o }).unwrap();
    let (m_qpn, p_qpn) = (m.qp.qpn, p.qp.qpn);

    // Receives on both sides, logged for reposting.
    let recv_log: Vec<u64> = (0..ROUNDS as u64).collect();
    for &i in &recv_log {
        m.qp.post_recv(&[RecvWr { wr_id: i, sg_list: &[m.mr.sge(M_RECV + i as usize * 64, 64)] }]).unwrap();
    }
    for i in 0..200 {
        p.qp.post_recv(&[RecvWr { wr_id: i, sg_list: &[p.mr.sge(P_RECV + i as usize * 64, 64)] }]).unwrap();
    }

    let progress = Arc::new(AtomicU64::new(0));
    let allowed = Arc::new(AtomicUsize::new(ROUNDS_BEFORE_MOVE));
    let (prog, allow) = (progress.clone(), allowed.clone());
    let peer = std::thread::spawn(move || {
        peer_loop(&p, &prog, &allow);
        p
    });
    let t0 = Instant::now();
    while progress.load(Ordering::Relaxed) < 400 {
        if peer.is_finished() || t0.elapsed() > Duration::from_secs(60) {
            let s0 = Context::open(Some(&bed.nics[0].sock)).unwrap().stats().unwrap();
            let s1 = bed.ctx(1).stats().unwrap();
            panic!("peer made no progress ({}): peer host {s1}, old host default namespace {s0}", progress.load(Ordering::Relaxed));
        }
        std::thread::sleep(Duration::from_millis(1));
    }

    // The migrating side's own requests: WRITE (PSNs W_FIRST..READ_PSN),
    // READ (READ_PSN), fetch-and-add (FA1_PSN), 40 SENDs, fetch-and-add (FA2_PSN).
    let mut send_log = vec![MWr::Write { id: 0 }, MWr::Read { id: 1 }, MWr::FetchAdd { id: 2, slot: 0 }];
    send_log.extend((0..M_SENDS).map(|s| MWr::Send { id: 3 + s as u64, seq: s }));
    send_log.push(MWr::FetchAdd { id: 3 + M_SENDS as u64, slot: 1 });
    let udp = "udp dport 4791";
    let requests = "@th,64,8 { 0x00-0x0c, 0x13-0x17 }";
    let responses = "@th,64,8 0x0d-0x12";
    let (bth_qpn, bth_psn) = ("@th,104,24", "@th,136,24");

    // Phase 1: M's requests from the WRITE's middle on do not leave the old
    // host, so the peer acknowledges exactly the first half (its last ACK is
    // for W_HALF - 1, which carries AckReq).
    hold(
        h_old,
        &format!(
            "counter half_ack {{ }}\n\
             chain out {{ type filter hook output priority -10; policy accept;\n\
               {udp} {bth_qpn} {p_qpn:#x} {requests} {bth_psn} {W_HALF:#x}-{M_PSN_END:#x} drop\n}}\n\
             chain in {{ type filter hook input priority -10; policy accept;\n\
               {udp} {bth_qpn} {m_qpn:#x} @th,64,8 0x11 {bth_psn} {:#x} counter name \"half_ack\"\n}}",
            W_HALF - 1
        ),
    );
    for &w in &send_log {
        post_m(&m.qp, &m.mr, w);
    }
    let (mut seen, mut kicks) = (0, 0);
    loop {
        let (c, k) = wait_counter(h_old, "half_ack", seen, &m.qp, |s| s.runtime.una == W_HALF);
        (seen, kicks) = (c, kicks + k);
        // Suspended in place: if the ACK is not processed yet, resume (which
        // resends from una, and the peer acknowledges W_HALF - 1 again).
        m.qp.suspend().unwrap();
        if m.qp.query_state().unwrap().runtime.una == W_HALF {
            break;
        }
        m.qp.resume().unwrap();
    }

    // Phase 2 (M still suspended): its requests flow again, but no response
    // for PSNs from W_HALF on reaches it, except sequence NAKs (which only a
    // lost packet causes; M then resends). The resume resends from W_HALF:
    // the peer places the rest of the WRITE, executes the READ, both atomics
    // and takes the SENDs; their responses are held.
    hold(
        h_old,
        &format!(
            "counter fa_held {{ }}\ncounter held {{ }}\n\
             chain in {{ type filter hook input priority -10; policy accept;\n\
               {udp} {bth_qpn} {m_qpn:#x} @th,64,8 0x11 @th,160,8 & 0xe0 == 0x60 accept\n\
               {udp} {bth_qpn} {m_qpn:#x} @th,64,8 0x12 {bth_psn} {FA2_PSN:#x} counter name \"fa_held\" drop\n\
               {udp} {bth_qpn} {m_qpn:#x} {responses} {bth_psn} {W_HALF:#x}-{M_PSN_END:#x} counter name \"held\" drop\n}}"
        ),
    );
    m.qp.resume().unwrap();
    let (fa, k) = wait_counter(h_old, "fa_held", 0, &m.qp, |_| false);
    kicks += k;
    // Once more in place: the resume resends everything from W_HALF; the peer
    // answers the duplicate atomics from its replay table (they must not
    // execute again: checked at the end), and re-executes the READ.
    m.qp.suspend().unwrap();
    m.qp.resume().unwrap();
    let (_, k) = wait_counter(h_old, "fa_held", fa, &m.qp, |_| false);
    kicks += k;

    // 1. Suspend.
    m.qp.suspend().unwrap();
    let held = counter(h_old, "held");
    assert!(!peer.is_finished() && progress.load(Ordering::Relaxed) < (ROUNDS * 4) as u64, "the peer is still sending");
    h_old.sh("nft delete table inet rnmig").unwrap();
    eprintln!("suspended with {held} responses held back ({kicks} kicks for lost packets)");

    // 2. drain the CQs; 3. query the state.
    let (mut m_swc, mut m_rwc) = (Vec::new(), Vec::new());
    drain(&m.scq, &mut m_swc);
    drain(&m.rcq, &mut m_rwc);
    let st = m.qp.query_state().unwrap();
    assert_eq!(st.version, QP_SNAPSHOT_VERSION);
    let json = serde_json::to_vec(&st).unwrap();
    eprintln!(
        "moving QP {m_qpn:#x}: {} bytes of state, sq_retired {} rq_retired {}, una {:#x} next_psn {:#x} max_sent {:#x}, epsn {:#x}, write in progress {:?}, {} queued responses",
        json.len(), st.runtime.sq_retired, st.runtime.rq_retired, st.runtime.una, st.runtime.next_psn, st.runtime.max_sent,
        st.runtime.epsn, st.runtime.write, st.runtime.resp_queue.len()
    );
    assert_eq!(m_swc.len() as u64, st.runtime.sq_retired, "every retired send WR was signaled and drained");
    assert_eq!(m_rwc.len() as u64, st.runtime.rq_retired);
    assert_eq!(st.runtime.sq_retired, 0, "none of M's WRs is complete");
    assert_eq!(st.runtime.una, W_HALF, "the WRITE is exactly half acknowledged");
    assert_eq!(st.runtime.max_sent, FA2_PSN + 1, "the READ and both atomics were sent");
    assert!(fa >= 1, "the peer executed M's atomics; their responses are not received");
    assert!(!st.runtime.atomic_results.is_empty(), "the peer's recent atomics travel for replay");
    // The state survives a round trip through its serialized form.
    let st: QpSnapshot = serde_json::from_slice(&json).unwrap();

    // 4. "Memory migration": the suspended QP no longer writes, so a copy is exact.
    let image = m.buf.read(0, 8 * MB);

    // 5. Recreate the namespace on the new host: same key, same I/O address, same QPN.
    let ctx2 = Context::open_namespace(Some(&bed.nics[2].sock), gid).unwrap();
    let pd2 = ctx2.alloc_pd().unwrap();
    let (scq2, rcq2) = (ctx2.create_cq(1024, None).unwrap(), ctx2.create_cq(4096, None).unwrap());
    let buf2 = MemBuf::new(8 * MB).unwrap();
    buf2.write(0, &image);
    let mr2 = pd2.reg_mr_at(&buf2, 0, 8 * MB, access::ALL, Some(KEY), IOVA).unwrap();
    let qp2 = pd2.create_qp_suspended(&init_attr(&scq2, &rcq2), &st).unwrap();
    assert_eq!(qp2.qpn, m_qpn);
    // From now on M retransmits on timeouts like any QP (the attribute may
    // change while suspended).
    qp2.modify(&QpAttr { timeout: 14, ..Default::default() }, mask::TIMEOUT).unwrap();
    // 6. Repost what was not retired, in the same order.
    for &w in &send_log[st.runtime.sq_retired as usize..] {
        post_m(&qp2, &mr2, w);
    }
    for &i in &recv_log[st.runtime.rq_retired as usize..] {
        qp2.post_recv(&[RecvWr { wr_id: i, sg_list: &[mr2.sge(M_RECV + i as usize * 64, 64)] }]).unwrap();
    }
    // 7. Move the address: the new host takes it and announces it with
    // gratuitous ARP (as a VMM announces a moved guest). Both hosts hold the
    // address for a moment; both answer with RNR NAKs.
    h_new.sh(&format!("ip addr add {gid}/24 dev eth0")).unwrap();
    h_new.in_netns(move || rnic::announce::gratuitous_arp(gid, 2)).unwrap().unwrap();
    // 8. Resume; the old objects go.
    qp2.resume().unwrap();
    h_old.sh(&format!("ip addr del {gid}/24 dev eth0")).unwrap();
    drop(m);
    let m = Side { qp: qp2, mr: mr2, scq: scq2, rcq: rcq2, _pd: pd2, buf: buf2, _ctx: ctx2 };
    allowed.store(ROUNDS, Ordering::Release);

    // The moved QP keeps working: the rest of its WRs complete, then more.
    let t0 = Instant::now();
    while m_swc.len() < send_log.len() || m_rwc.len() < ROUNDS {
        drain(&m.scq, &mut m_swc);
        drain(&m.rcq, &mut m_rwc);
        assert!(t0.elapsed() < Duration::from_secs(120), "moved QP stalled: {} sends, {} recvs", m_swc.len(), m_rwc.len());
        std::thread::sleep(Duration::from_millis(1));
    }
    let more: Vec<MWr> =
        (M_SENDS..60).map(|s| MWr::Send { id: 100 + s as u64, seq: s }).chain([MWr::FetchAdd { id: 200, slot: 2 }]).collect();
    for &w in &more {
        post_m(&m.qp, &m.mr, w);
    }
    m_swc.extend(m.scq.wait(more.len(), T).unwrap());

    let p = peer.join().expect("peer thread");
    assert_eq!(p.qp.state().unwrap(), QpState::Rts, "the peer never left RTS");

    // Migrating side's sends: all succeeded, in order.
    let ids: Vec<u64> = send_log
        .iter()
        .chain(&more)
        .map(|w| match *w {
            MWr::Write { id } | MWr::Read { id } | MWr::FetchAdd { id, .. } | MWr::Send { id, .. } => id,
        })
        .collect();
    assert!(m_swc.iter().all(|w| w.status == WcStatus::Success), "{m_swc:?}");
    assert_eq!(m_swc.iter().map(|w| w.wr_id).collect::<Vec<_>>(), ids);
    assert_eq!(p.buf.read(P_WDST, W_LEN), pattern(7, W_LEN), "M's WRITE landed whole");
    assert_eq!(m.buf.read(M_RDST, R_LEN), pattern(55, R_LEN), "M's READ data");
    let fa: Vec<u64> = (0..3).map(|s| m.buf.read_u64(M_FA_RES + s * 8)).collect();
    assert_eq!(fa, vec![0, 1, 2], "M's atomics executed exactly once, in order (the held ones answered from the replay table)");
    assert_eq!(p.buf.read_u64(P_CNT), 3);

    // Peer's SENDs: each exactly once, in order, intact.
    assert_eq!(m_rwc.len(), ROUNDS);
    for (i, w) in m_rwc.iter().enumerate() {
        assert_eq!((w.status, w.wr_id, w.byte_len), (WcStatus::Success, i as u64, 64), "receive {i}");
        let got = m.buf.read(M_RECV + i * 64, 64);
        assert_eq!(u64::from_le_bytes(got[..8].try_into().unwrap()), i as u64, "message {i} in order");
        assert_eq!(got[8..], pattern(i as u64, 56)[..], "message {i} intact");
    }
    // Peer's atomics on M's memory executed exactly once.
    assert_eq!(m.buf.read_u64(M_CNT), ROUNDS as u64);
    // Peer's WRITEs: each slot holds the last write into it.
    for slot in 0..64 {
        let last = (0..ROUNDS).filter(|r| r % 64 == slot).max().unwrap();
        assert!(m.buf.read(M_W + slot * WSLOT, WSLOT) == pattern(1000 + (last % 32) as u64, WSLOT), "WRITE slot {slot}");
    }
    // M's SENDs reached the peer exactly once, in order.
    let pw = p.rcq.wait(60, T).unwrap();
    for (i, w) in pw.iter().enumerate() {
        assert_eq!((w.status, w.wr_id), (WcStatus::Success, i as u64));
        assert_eq!(p.buf.read_u64(P_RECV + i * 64), i as u64, "M's message {i} in order");
    }
    assert_eq!(p.rcq.poll(&mut [Wc::default(); 8]).unwrap(), 0, "no duplicate message");
    let stats = p.ctx.stats().unwrap();
    eprintln!("peer rnicd: rnr_naks_received {} timeouts {}", stats["rnr_naks_received"], stats["timeouts"]);
    let _ = h_peer;
}
