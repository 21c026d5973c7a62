//! Postcopy: the destination runs before all of RAM is there and fetches
//! what it touches (see docs/migration.md, "Postcopy").
//!
//! - [`source`]: the switch, the background push and the urgent server
//! - [`dest`]: the switch, fault handling, completion and recovery
//! - [`place`]: atomic page placement and waking faulting threads
//! - [`faults`]: the destination's fault-reading thread and page requests
//! - [`push`]: the order of the background push (near recent faults first)
//! - [`clients`]: processes other than the vmm that map guest RAM

pub mod clients;
pub(crate) mod dest;
pub mod faults;
pub mod place;
pub mod push;
pub(crate) mod source;
