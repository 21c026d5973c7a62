//! The migration engine. It knows a VM only through [`vm::MigratableVm`].
//!
//! - [`dirty`]: write tracking (uffd async write-protect + PAGEMAP_SCAN)
//! - [`source`] / [`dest`]: the two ends of a migration; [`postcopy`]: its
//!   postcopy part (userfaultfd on the destination)
//! - [`wire`]: the versioned stream format; [`compress`]: per-page codecs
//! - [`links`]: several destination addresses, one per link; [`control_conn`]:
//!   the control connection on every link
//! - [`qmp`]: the control-socket commands the vmm forwards
//! - [`memvm`]: a small VM (memfd RAM + dirtier threads) for tests and benches
//! - [`testing`]: damage injected on purpose (the `testing` parameter)

pub mod acceptor;
pub mod compress;
pub mod control_conn;
pub mod cputime;
pub mod dest;
pub mod dirty;
pub mod links;
pub mod memvm;
pub mod pages;
pub mod place;
pub mod postcopy;
pub(crate) mod priority;
pub mod push;
pub mod qmp;
pub mod ratelimit;
pub mod rdma;
pub mod receiver;
pub mod sender;
pub mod source;
pub mod stats;
pub mod testing;
pub mod transport;
pub mod vm;
pub mod wire;
