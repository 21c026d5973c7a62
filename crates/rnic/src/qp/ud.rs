// SPDX-License-Identifier: GPL-2.0-or-later
//! Unreliable datagram (UD) QPs, as IBTA vol. 1 (9.8, 10.2, C10-93) and
//! the RoCEv2 annex define them and Linux rxe implements them:
//!
//! - SEND and SEND with immediate only, one packet per message (the
//!   message at most the port's active MTU, as rxe's `get_mtu` takes for
//!   UD), BTH + DETH (Q_Key, source QPN)
//!   [+ ImmDt], no ACKs, no retransmission, and no PSN check at the
//!   receiver (each QP numbers its packets from `sq_psn`);
//! - the destination is the WR's (its address handle's GID, the remote
//!   QPN and Q_Key, carried in the WQE's `ud_*` fields); a WR Q_Key with
//!   the high bit set means "the QP's own";
//! - the receiver accepts a datagram only with its QP's Q_Key and a posted
//!   receive (otherwise it is dropped and counted, never NAKed), and
//!   writes the 40-byte GRH in front of the payload: for RoCEv2 over IPv4
//!   20 zero bytes, then the IPv4 header, as rxe and mlx5 do.
//!
//! A UD QP shares the QP struct, its rings and the state machine (with
//! UD's attribute table, [`transition_attrs`]) with RC, and none of the RC
//! transport: its WQEs go from the ring to the wire in one step.

use std::net::Ipv4Addr;

use super::{Ctx, Qp};
use crate::async_events::AsyncKind;
use crate::keys::{gather, scatter};
use crate::ring::{Cqe, SendWqe, MAX_SGE};
use crate::types::mask as m;
use crate::types::{send_flags, wc_flags, Mtu, QpState, QpType, WcOpcode, WcStatus, WrOpcode};
use crate::wire::{psn_add, Deth, Flow, Headers, Opcode, Packet, QPN_MASK, ROCE_PORT};

/// Bytes of the GRH a UD receive buffer starts with.
pub const GRH_LEN: usize = 40;

/// A WR's Q_Key with this bit set sends the QP's own Q_Key (IBTA 10.2.5).
const QKEY_FROM_QP: u32 = 0x8000_0000;

/// The attributes a UD transition requires and those it may take, as in
/// Linux's `qp_state_table` (`ib_modify_qp_is_ok`) for IB_QPT_UD; `None`
/// for no such transition.
pub(super) fn transition_attrs(cur: QpState, new: QpState) -> Option<(u32, u32)> {
    use QpState::{Err, Init, Reset, Rtr, Rts, Sqd, Sqe};
    Some(match (cur, new) {
        (_, Reset) | (_, Err) => (0, 0),
        (Reset, Init) => (m::PKEY_INDEX | m::PORT | m::QKEY, 0),
        (Init, Init) => (0, m::PKEY_INDEX | m::PORT | m::QKEY),
        (Init, Rtr) => (0, m::PKEY_INDEX | m::QKEY),
        (Rtr, Rts) => (m::SQ_PSN, m::CUR_STATE | m::QKEY),
        (Rts, Rts) | (Sqd, Rts) | (Sqe, Rts) => (0, m::CUR_STATE | m::QKEY),
        (Rts, Sqd) => (0, m::EN_SQD_ASYNC_NOTIFY),
        (Sqd, Sqd) => (0, m::PKEY_INDEX | m::QKEY),
        _ => return None,
    })
}

/// Why a UD send WR is refused before it reaches the wire.
enum Refusal {
    /// Larger than the port's active MTU: IBV_WC_LOC_LEN_ERR, the QP
    /// carries on.
    TooLong,
    /// Not a SEND, too many SGEs, or no usable destination (a bad address
    /// handle): IBV_WC_LOC_QP_OP_ERR and the QP goes to ERR, as in rxe.
    Malformed,
    /// A bad lkey or a range outside its MR (LOC_PROT_ERR): the QP goes to
    /// ERR, as an RC requester's local protection error does.
    Local(WcStatus),
}

/// The 40-byte GRH of a RoCEv2-over-IPv4 datagram: 20 zero bytes, then the
/// IPv4 header the packet arrived with. rnicd receives through a UDP socket,
/// so it rebuilds that header from what it knows: the addresses, the length
/// (`udp_payload` bytes of RoCE packet), DF, protocol UDP; TOS 0 and TTL 64
/// are what rnicd's own sockets send, id 0 what DF datagrams carry.
pub fn grh_ipv4(src: Ipv4Addr, dst: Ipv4Addr, udp_payload: usize) -> [u8; GRH_LEN] {
    let mut g = [0u8; GRH_LEN];
    let ip = &mut g[20..];
    ip[0] = 0x45;
    let total = (20 + 8 + udp_payload).min(u16::MAX as usize) as u16;
    ip[2..4].copy_from_slice(&total.to_be_bytes());
    ip[6..8].copy_from_slice(&0x4000u16.to_be_bytes());
    ip[8] = 64;
    ip[9] = 17;
    ip[12..16].copy_from_slice(&src.octets());
    ip[16..20].copy_from_slice(&dst.octets());
    let sum = ip.chunks_exact(2).map(|c| u32::from(u16::from_be_bytes([c[0], c[1]]))).sum::<u32>();
    let folded = (sum & 0xffff) + (sum >> 16);
    let csum = !(((folded & 0xffff) + (folded >> 16)) as u16);
    ip[10..12].copy_from_slice(&csum.to_be_bytes());
    g
}

impl Qp {
    pub fn is_ud(&self) -> bool {
        self.qp_type == QpType::Ud
    }

    /// A UD QP's largest message is the port's active MTU (IBTA C10-93.1.1;
    /// rxe's `get_mtu` gives UD `port.mtu_cap`), not a path MTU of its own:
    /// every datagram is one packet, so a larger one would leave
    /// IP-fragmented. The engine hands it over at create and at every
    /// modify (it follows the interface), and it is kept as the QP's
    /// `path_mtu`, which UD's attribute table never lets a program set.
    pub fn ud_set_port_mtu(&mut self, mtu: Mtu) {
        if self.is_ud() {
            self.attr.path_mtu = mtu;
        }
    }

    /// In ERR, flushes every WQE in the send ring; otherwise the WQEs wait
    /// in the ring for `ud_transmit` (UD keeps no queue of its own: each
    /// WQE leaves and completes in one step, in ring order).
    pub(super) fn ud_pull_sq(&mut self, ctx: &mut Ctx) {
        if self.attr.qp_state != QpState::Err {
            return;
        }
        // What the ring holds now (a client may keep refilling it).
        for _ in 0..self.sq_ring.ready() {
            let Some(w) = self.sq_ring.pop() else { break };
            self.ud_send_done(ctx, &w, WcStatus::WrFlushErr);
        }
    }

    pub(super) fn ud_has_tx_work(&self) -> bool {
        self.sq_ring.ready() > 0 && matches!(self.attr.qp_state, QpState::Rts | QpState::Err)
    }

    /// Sends up to `budget` datagrams from the send ring (RTS only: in SQD
    /// the WQEs stay in the ring).
    pub(super) fn ud_transmit(&mut self, ctx: &mut Ctx, budget: &mut usize) {
        let mut left = self.sq_ring.ready();
        while *budget > 0 && left > 0 && self.attr.qp_state == QpState::Rts {
            let Some(w) = self.sq_ring.pop() else { break };
            *budget -= 1;
            left -= 1;
            match self.ud_send(ctx, &w) {
                Ok(()) => {
                    ctx.stats.ud_sent += 1;
                    if self.sq_sig_all || w.flags & send_flags::SIGNALED != 0 {
                        self.ud_send_done(ctx, &w, WcStatus::Success);
                    }
                }
                Err(Refusal::TooLong) => {
                    ctx.stats.ud_oversize_sends += 1;
                    self.ud_send_done(ctx, &w, WcStatus::LocLenErr);
                }
                Err(Refusal::Malformed) => {
                    ctx.stats.bad_wqes += 1;
                    self.ud_send_done(ctx, &w, WcStatus::LocQpOpErr);
                    self.fail(ctx, AsyncKind::QpFatal);
                }
                Err(Refusal::Local(status)) => {
                    self.ud_send_done(ctx, &w, status);
                    self.fail(ctx, AsyncKind::QpFatal);
                }
            }
        }
        // Unsignaled datagrams are done once sent, without a completion.
        self.publish_done();
    }

    /// One WQE to one packet.
    fn ud_send(&mut self, ctx: &mut Ctx, w: &SendWqe) -> Result<(), Refusal> {
        let opcode = match WrOpcode::from_u8(w.opcode) {
            Some(WrOpcode::Send) => Opcode::UdSendOnly,
            Some(WrOpcode::SendImm) => Opcode::UdSendOnlyImm,
            _ => return Err(Refusal::Malformed),
        };
        let (_, len) = self.validate_send(w).map_err(|()| Refusal::Malformed)?;
        let dest = Ipv4Addr::from(w.ud_dest);
        if dest.is_unspecified() || dest.is_multicast() || dest.is_broadcast() || w.ud_qpn & !QPN_MASK != 0 {
            return Err(Refusal::Malformed);
        }
        if len as usize > self.attr.path_mtu.bytes() {
            return Err(Refusal::TooLong);
        }
        let qkey = if w.ud_qkey & QKEY_FROM_QP != 0 { self.attr.qkey } else { w.ud_qkey };
        let mut h = Headers::new(opcode, w.ud_qpn, self.rt.next_psn);
        h.deth = Some(Deth { qkey, src_qpn: self.qpn });
        h.bth.solicited = w.flags & send_flags::SOLICITED != 0;
        if opcode == Opcode::UdSendOnlyImm {
            h.imm = Some(w.imm);
        }
        let flow = Flow { src: ctx.gid, dst: dest, sport: self.sport, dport: ROCE_PORT };
        let inline = w.flags & send_flags::INLINE != 0;
        let sges = &w.sge[..(w.num_sge as usize).min(MAX_SGE)];
        let (keys, pd) = (&*ctx.keys, self.pd);
        ctx.tx
            .emit(&flow, &h, len as usize, |out| {
                if inline {
                    out.copy_from_slice(&w.inline[..out.len()]);
                    Ok(())
                } else {
                    gather(keys, pd, sges, 0, out)
                }
            })
            .map_err(Refusal::Local)?;
        self.rt.next_psn = psn_add(self.rt.next_psn, 1);
        Ok(())
    }

    fn ud_send_done(&mut self, ctx: &mut Ctx, w: &SendWqe, status: WcStatus) {
        self.rt.sq_retired += 1;
        self.publish_done();
        let cqe = Cqe { wr_id: w.wr_id, qp_num: self.qpn, status: status as u8, opcode: WcOpcode::Send as u8, ..Default::default() };
        ctx.complete(self.send_cq, cqe, false);
    }

    /// A packet for this QP when either the QP or the opcode is UD: a UD
    /// SEND for a UD QP with its Q_Key and a posted receive is delivered,
    /// GRH first; anything else is dropped and counted.
    pub fn ud_on_packet(&mut self, ctx: &mut Ctx, p: &Packet, src: Ipv4Addr, udp_payload: usize) {
        let receiving = matches!(self.attr.qp_state, QpState::Rtr | QpState::Rts | QpState::Sqd);
        let (true, true, true, Some(d)) = (self.is_ud(), p.bth.opcode.is_ud(), receiving, p.deth) else {
            ctx.stats.ud_other_drops += 1;
            return;
        };
        if d.qkey != self.attr.qkey {
            ctx.stats.ud_qkey_drops += 1;
            return;
        }
        let r = if self.srq.is_some() { self.pop_srq(ctx) } else { self.rq_ring.pop() };
        let Some(r) = r else {
            ctx.stats.ud_no_recv_drops += 1;
            return;
        };
        self.rt.rq_retired += 1;
        if r.num_sge as usize > MAX_SGE {
            self.complete_bad_recv(ctx, r.wr_id);
            return self.fail(ctx, AsyncKind::QpFatal);
        }
        let sges = &r.sge[..r.num_sge as usize];
        let grh = grh_ipv4(src, ctx.gid, udp_payload);
        let placed = scatter(ctx.keys, self.pd, sges, 0, &grh).and_then(|()| scatter(ctx.keys, self.pd, sges, GRH_LEN as u64, p.payload));
        let status = match placed {
            Ok(()) => WcStatus::Success,
            // Too small a buffer is the sender's doing: that receive fails,
            // the QP carries on.
            Err(WcStatus::LocLenErr) => WcStatus::LocLenErr,
            Err(_) => WcStatus::LocProtErr,
        };
        let mut cqe = Cqe {
            wr_id: r.wr_id,
            qp_num: self.qpn,
            src_qp: d.src_qpn,
            status: status as u8,
            opcode: WcOpcode::Recv as u8,
            ..Default::default()
        };
        if status == WcStatus::Success {
            ctx.stats.ud_delivered += 1;
            cqe.byte_len = (GRH_LEN + p.payload.len()) as u32;
            cqe.wc_flags = wc_flags::GRH;
            if let Some(i) = p.imm {
                cqe.imm = i;
                cqe.wc_flags |= wc_flags::WITH_IMM;
            }
        }
        ctx.complete(self.recv_cq, cqe, p.bth.solicited);
        if status == WcStatus::LocProtErr {
            // The receive WQE's own keys are bad: the owner's error.
            self.fail(ctx, AsyncKind::QpFatal);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grh_holds_a_valid_ipv4_header_in_its_last_20_bytes() {
        let g = grh_ipv4(Ipv4Addr::new(10, 0, 0, 1), Ipv4Addr::new(10, 0, 0, 2), 36);
        assert_eq!(&g[..20], &[0u8; 20]);
        let ip = &g[20..];
        assert_eq!((ip[0], ip[9]), (0x45, 17));
        assert_eq!(u16::from_be_bytes([ip[2], ip[3]]), 64);
        assert_eq!(&ip[12..16], &[10, 0, 0, 1]);
        assert_eq!(&ip[16..20], &[10, 0, 0, 2]);
        // The one's complement sum over a header with its checksum is 0xffff.
        let sum = ip.chunks_exact(2).map(|c| u32::from(u16::from_be_bytes([c[0], c[1]]))).sum::<u32>();
        assert_eq!((sum & 0xffff) + (sum >> 16), 0xffff);
    }

    #[test]
    fn ud_transitions_take_qkey_not_rc_attributes() {
        let (req, _) = transition_attrs(QpState::Reset, QpState::Init).unwrap();
        assert_eq!(req, m::PKEY_INDEX | m::PORT | m::QKEY);
        let (req, opt) = transition_attrs(QpState::Init, QpState::Rtr).unwrap();
        assert_eq!(req, 0);
        assert_eq!(opt & (m::AV | m::DEST_QPN | m::PATH_MTU), 0);
        assert_eq!(transition_attrs(QpState::Rtr, QpState::Rts).unwrap().0, m::SQ_PSN);
        assert!(transition_attrs(QpState::Reset, QpState::Rts).is_none());
    }
}
