//! Damage injected on purpose, for the tests that show the destination
//! catches what the transport cannot repair: the `testing` migration
//! parameter. Over TCP a proxy can flip bytes on the wire; over RDMA a
//! packet with a bad ICRC is dropped and resent, so the damage has to be
//! made where no checksum of the transport covers it: in a page after its
//! hash was taken, or in a frame after its checksum was. Each fault fires
//! once per migration, on the first page or frame it fits. A migration
//! without the parameter (every real one) never reaches this code.

use std::sync::atomic::{AtomicU8, Ordering};

/// What to damage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Fault {
    /// rdma: the first raw page of a batch leaves as a WRITE from a copy
    /// with one byte flipped (the source's RAM untouched).
    CorruptWrite = 1,
    /// The first compressed page: its last byte flipped after the page's
    /// hash was taken (an lz4 block ends in literals, so it still
    /// decompresses, to other bytes). Any transport.
    CorruptCompressed = 2,
    /// rdma: a byte of the first batch table flipped in the SEND buffer
    /// after the table's checksum was taken.
    CorruptTable = 3,
    /// Postcopy and hybrid over tcp: the first device page with data that
    /// crosses in the switch leaves from a copy with one byte flipped,
    /// with the right page's hash.
    CorruptDevicePage = 4,
}

impl Fault {
    /// The parameter's value: "" (none), `corrupt-write`,
    /// `corrupt-compressed`, `corrupt-table` or `corrupt-device-page`.
    pub fn parse(s: &str) -> Result<Option<Fault>, String> {
        match s {
            "" => Ok(None),
            "corrupt-write" => Ok(Some(Fault::CorruptWrite)),
            "corrupt-compressed" => Ok(Some(Fault::CorruptCompressed)),
            "corrupt-table" => Ok(Some(Fault::CorruptTable)),
            "corrupt-device-page" => Ok(Some(Fault::CorruptDevicePage)),
            other => Err(format!("testing must be corrupt-write, corrupt-compressed, corrupt-table or corrupt-device-page, not {other:?}")),
        }
    }
}

/// The fault armed for one migration.
#[derive(Default)]
pub struct Injector {
    armed: AtomicU8,
}

impl Injector {
    pub fn arm(&self, f: Option<Fault>) {
        self.armed.store(f.map_or(0, |f| f as u8), Ordering::SeqCst);
    }
    /// Whether `f` is armed; true once only (it disarms).
    pub fn fire(&self, f: Fault) -> bool {
        self.armed.load(Ordering::Relaxed) == f as u8 && self.armed.compare_exchange(f as u8, 0, Ordering::SeqCst, Ordering::SeqCst).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fault_fires_once_and_only_its_own() {
        let i = Injector::default();
        assert!(!i.fire(Fault::CorruptWrite));
        i.arm(Fault::parse("corrupt-table").unwrap());
        assert!(!i.fire(Fault::CorruptWrite));
        assert!(i.fire(Fault::CorruptTable));
        assert!(!i.fire(Fault::CorruptTable));
        assert!(Fault::parse("").unwrap().is_none());
        assert!(Fault::parse("flip").unwrap_err().contains("corrupt-write"));
    }
}
