//! Postcopy: the destination runs before all of RAM is there and fetches
//! what it touches (see docs/migration.md, "Postcopy").
//!
//! - [`source`]: the switch, the background push and the urgent server
//! - [`dest`]: the switch, fault handling, completion and recovery
//! - [`faults`]: the destination's fault-reading thread and page requests
//! - [`fetch`]: the rdma transport's destination, which READs the pages
//! - [`clients`]: processes other than the vmm that map guest RAM
//! - [`device`]: the devices' pages, which cross inside the switch
//!
//! Below it, shared with the precopy rounds' sender and receiver:
//! [`crate::place`] (atomic page placement, waking faulting threads),
//! [`crate::push`] (the order of the background push) and
//! [`crate::priority`] (the fault path ahead of the push).

pub mod clients;
pub(crate) mod dest;
pub mod device;
pub mod faults;
pub(crate) mod fetch;
pub(crate) mod source;
