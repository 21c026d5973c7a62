//! How page batches travel on a data channel: over a TCP connection (the
//! batch written whole, raw pages from guest RAM by one vectored write) or
//! over an RDMA queue pair ([`crate::rdma`]: raw pages as RDMA WRITEs from
//! this guest RAM into the destination's, the rest of the batch as a SEND).
//! The channel threads of [`crate::sender`] only see a [`DataSink`].

use crate::wire::{self, BatchWriter};
use anyhow::{bail, Result};
use std::io::{self, Write};
use std::net::TcpStream;

/// The sending end of one data channel.
pub(crate) trait DataSink: Send {
    /// Send the batch and start a new one; returns its bytes on the wire.
    fn send_batch(&mut self, batch: &mut BatchWriter<'_>) -> io::Result<usize>;
    /// The end of round `round` on this channel.
    fn send_sync(&mut self, round: u64) -> io::Result<()>;
    /// The end of the stream, `pages` in all; returns once it is delivered
    /// as far as this transport can tell.
    fn send_eos(&mut self, pages: u64) -> io::Result<()>;
    /// Raw pages must be handed to the batch in guest RAM (never as
    /// private copies): the transport reads them there itself.
    fn raw_pages_in_ram(&self) -> bool {
        false
    }
    /// With several links, a failure of this channel is taken for its
    /// link's: the channel is dropped and its pages go on the others.
    fn fails_over(&self) -> bool {
        self.tcp().is_some()
    }
    /// Called while the channel idles between jobs: an error means it is
    /// broken (its link died under work it had posted).
    fn check_idle(&mut self) -> io::Result<()> {
        Ok(())
    }
    /// The TCP connection under it, if any (postcopy's buffer sizing; link
    /// failover watches and shuts a clone of it).
    fn tcp(&self) -> Option<&TcpStream> {
        None
    }
}

impl DataSink for TcpStream {
    fn send_batch(&mut self, batch: &mut BatchWriter<'_>) -> io::Result<usize> {
        batch.write_to(self)
    }
    fn send_sync(&mut self, round: u64) -> io::Result<()> {
        wire::write_sync(self, round)
    }
    fn send_eos(&mut self, pages: u64) -> io::Result<()> {
        wire::write_eos(self, pages)?;
        self.flush()
    }
    fn tcp(&self) -> Option<&TcpStream> {
        Some(self)
    }
}

/// The transport of an outgoing migration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transport {
    Tcp,
    /// Through the rnicd at this control socket (empty: the one serving
    /// an address of this network namespace, see `verbs::find_socket`).
    Rdma {
        rnicd: String,
    },
}

impl Transport {
    /// The control connection's address and the transport, from a `uri`
    /// (`tcp:HOST:PORT`, `rdma:HOST:PORT`, or `HOST:PORT`) and the
    /// `transport` parameter (`tcp` or `rdma`; the uri's scheme wins when
    /// it names one).
    pub fn from_uri(uri: &str, transport: &str, rnicd: &str) -> Result<(String, Transport)> {
        let (scheme, addr) = match uri.split_once(':') {
            Some((s @ ("tcp" | "rdma"), rest)) => (s, rest),
            _ => (transport, uri),
        };
        if addr.rsplit_once(':').is_none() {
            bail!("bad migration address {uri:?} (expected tcp:HOST:PORT or rdma:HOST:PORT)");
        }
        let t = match scheme {
            "tcp" => Transport::Tcp,
            "rdma" => Transport::Rdma { rnicd: rnicd.to_string() },
            other => bail!("transport must be tcp or rdma, not {other:?}"),
        };
        Ok((addr.to_string(), t))
    }
    /// Its name in the hello.
    pub fn name(&self) -> &'static str {
        match self {
            Transport::Tcp => "tcp",
            Transport::Rdma { .. } => "rdma",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uri_scheme_or_parameter_names_the_transport() {
        assert_eq!(Transport::from_uri("tcp:10.0.0.2:4444", "rdma", "").unwrap(), ("10.0.0.2:4444".into(), Transport::Tcp));
        assert_eq!(
            Transport::from_uri("rdma:10.0.0.2:4444", "tcp", "/s").unwrap(),
            ("10.0.0.2:4444".into(), Transport::Rdma { rnicd: "/s".into() })
        );
        assert_eq!(Transport::from_uri("h:1", "rdma", "").unwrap(), ("h:1".into(), Transport::Rdma { rnicd: String::new() }));
        assert!(Transport::from_uri("h:1", "udp", "").is_err());
        assert!(Transport::from_uri("rdma:nohost", "tcp", "").is_err());
    }
}
