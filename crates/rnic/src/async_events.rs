//! Asynchronous events (ibv_get_async_event): what rnicd tells a client
//! without being asked, as a NIC raises affiliated events on its event queue.
//!
//! A client that wants them hands rnicd an eventfd (`Request::OpenAsync`);
//! rnicd queues each event for the object's owner and signals that fd, and
//! the client fetches the queue (`Request::FetchAsync`). Clients that never
//! open one get nothing queued.

use std::collections::{HashMap, VecDeque};
use std::os::fd::OwnedFd;

use serde::{Deserialize, Serialize};

use crate::objects::ClientId;

/// The kinds rnicd raises, named after `enum ibv_event_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AsyncKind {
    /// The QP went to ERR on an error of its own (a requester error such as
    /// retry exceeded or a NAK received, or a malformed work request).
    QpFatal,
    /// The responder refused an invalid request and went to ERR.
    QpReqErr,
    /// The responder refused a request that broke a key's access rights or
    /// bounds and went to ERR.
    QpAccessErr,
    /// A completion did not fit in the CQ.
    CqErr,
    /// An SRQ's posted WQEs fell below its armed limit (`object`: the SRQ).
    SrqLimitReached,
}

/// One event: its kind and the QPN or CQ handle it is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AsyncEvent {
    pub kind: AsyncKind,
    pub object: u32,
}

/// Most events queued for a client that does not fetch them; later ones
/// are dropped (a real device's event queue overflows too).
pub const MAX_QUEUED: usize = 1024;

struct Sink {
    fd: OwnedFd,
    queue: VecDeque<AsyncEvent>,
}

/// The clients that asked for events, by client.
#[derive(Default)]
pub struct AsyncSinks {
    sinks: HashMap<ClientId, Sink>,
}

impl AsyncSinks {
    pub fn open(&mut self, client: ClientId, fd: OwnedFd) {
        self.sinks.insert(client, Sink { fd, queue: VecDeque::new() });
    }

    pub fn close(&mut self, client: ClientId) {
        self.sinks.remove(&client);
    }

    /// Queues an event for `client` and signals its fd.
    pub fn raise(&mut self, client: ClientId, ev: AsyncEvent) {
        if let Some(s) = self.sinks.get_mut(&client) {
            if s.queue.len() < MAX_QUEUED {
                s.queue.push_back(ev);
            }
            crate::eventfd::signal(&s.fd);
        }
    }

    /// Takes the events queued for `client`.
    pub fn fetch(&mut self, client: ClientId) -> Vec<AsyncEvent> {
        self.sinks.get_mut(&client).map(|s| s.queue.drain(..).collect()).unwrap_or_default()
    }
}
