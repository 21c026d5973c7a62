//! A QP's transport state for operators and failing tests (`transit rdma
//! qps`, the control request `DumpQps`): what its requester, responder
//! and timers hold at this moment, to tell why a QP does not move (sends
//! outstanding with no timer armed, an endless RNR wait, a window with no
//! room, WQEs left in a ring).

use std::time::Instant;

use serde_json::{json, Value};

use super::Qp;
use crate::wire::psn_diff;

/// µs from `now` to `t` (negative: already past), or null when unset.
fn due_us(t: Option<Instant>, now: Instant) -> Value {
    match t {
        None => Value::Null,
        Some(t) if t >= now => json!(t.duration_since(now).as_micros() as i64),
        Some(t) => json!(-(now.duration_since(t).as_micros() as i64)),
    }
}

impl Qp {
    /// The QP's state as one JSON object (PSNs, window, timers, queues).
    pub fn debug_state(&self, now: Instant) -> Value {
        let rt = &self.rt;
        let a = &self.attr;
        json!({
            "qpn": self.qpn,
            "owner": self.owner,
            "type": format!("{:?}", self.qp_type),
            "state": format!("{:?}", a.qp_state),
            "suspended": self.suspended,
            "awaiting_state": self.awaiting_state,
            "dest": { "gid": a.dest_gid.to_string(), "qpn": a.dest_qp_num },
            "attr": {
                "timeout": a.timeout, "retry_cnt": a.retry_cnt, "rnr_retry": a.rnr_retry,
                "min_rnr_timer": a.min_rnr_timer, "max_rd_atomic": a.max_rd_atomic, "path_mtu": a.path_mtu.bytes(),
            },
            "requester": {
                "next_psn": rt.next_psn, "tx_psn": rt.tx_psn, "una": rt.una, "max_sent": rt.max_sent,
                "in_flight": psn_diff(rt.max_sent, rt.una),
                "cwnd": rt.cwnd, "window": self.window(),
                "retry_left": rt.retry_left, "rnr_left": rt.rnr_left,
                "blocked": self.blocked(), "has_tx_work": self.has_tx_work(now),
                "recovery": self.recovery, "rd_outstanding": self.rd_outstanding,
                "srtt_us": self.srtt_us.round(), "probe_backoff": self.probe_backoff, "timeout_backoff": self.timeout_backoff,
                "sq_outstanding": self.sq.len(), "tx_idx": self.tx_idx, "sq_retired": rt.sq_retired,
                "sq_ring_ready": self.sq_ring.ready(), "max_send_wr": self.cap.max_send_wr,
                "held_local": self.held_local.is_some(),
            },
            "timers_us": {
                "retransmit": due_us(self.retrans_deadline, now),
                "probe": due_us(self.probe_deadline, now),
                "rnr_wait": due_us(self.rnr_until, now),
                "ack_due": due_us(self.ack_due, now),
            },
            "responder": {
                "expected_psn": rt.epsn, "msn": rt.msn, "in_send": rt.in_send, "nak_sent": rt.nak_sent,
                "resp_queue": rt.resp_queue.len(), "held_requests": self.held.len(),
                "rq_posted": self.rq.len(), "rq_ring_ready": self.rq_ring.ready(), "rq_retired": rt.rq_retired,
                "srq": self.srq.as_ref().map(|(id, _)| *id),
            },
        })
    }
}
