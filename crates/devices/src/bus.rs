//! Port-I/O and MMIO buses: address ranges routed to devices.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, RwLock};

/// A device as the guest reaches it through loads, stores, IN and OUT.
///
/// `offset` is relative to the start of the range the device was inserted at.
/// Accesses the device does not understand must be ignored (reads return
/// all ones), never panic: a guest can write anything anywhere.
pub trait BusDevice: Send {
    fn read(&mut self, offset: u64, data: &mut [u8]);
    fn write(&mut self, offset: u64, data: &[u8]);
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BusError {
    #[error("range {base:#x}+{len:#x} overlaps a device already on the bus")]
    Overlap { base: u64, len: u64 },
    #[error("empty range at {0:#x}")]
    Empty(u64),
}

type Entry = (u64, Arc<Mutex<dyn BusDevice>>);

/// Ranges keyed by start address.
#[derive(Default)]
pub struct Bus {
    ranges: RwLock<BTreeMap<u64, Entry>>,
}

impl Bus {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn insert(&self, dev: Arc<Mutex<dyn BusDevice>>, base: u64, len: u64) -> Result<(), BusError> {
        if len == 0 {
            return Err(BusError::Empty(base));
        }
        let mut r = self.ranges.write().unwrap();
        let end = base.checked_add(len).ok_or(BusError::Overlap { base, len })?;
        // The nearest range below must end before us; the next must start after.
        if let Some((&b, &(l, _))) = r.range(..end).next_back() {
            if b + l > base {
                return Err(BusError::Overlap { base, len });
            }
        }
        r.insert(base, (len, dev));
        Ok(())
    }

    fn find(&self, addr: u64) -> Option<(u64, Arc<Mutex<dyn BusDevice>>)> {
        let r = self.ranges.read().unwrap();
        let (&base, (len, dev)) = r.range(..=addr).next_back()?;
        (addr - base < *len).then(|| (base, dev.clone()))
    }

    /// Returns false when nothing is mapped at `addr` (reads then see all ones).
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.find(addr) {
            Some((base, dev)) => {
                dev.lock().unwrap().read(addr - base, data);
                true
            }
            None => {
                data.fill(0xff);
                false
            }
        }
    }

    /// Returns false when nothing is mapped at `addr` (the write is dropped).
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.find(addr) {
            Some((base, dev)) => {
                dev.lock().unwrap().write(addr - base, data);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Reg(u8);
    impl BusDevice for Reg {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            data.fill(self.0.wrapping_add(offset as u8));
        }
        fn write(&mut self, _offset: u64, data: &[u8]) {
            self.0 = data[0];
        }
    }

    #[test]
    fn routes_and_refuses_overlap() {
        let bus = Bus::new();
        bus.insert(Arc::new(Mutex::new(Reg(1))), 0x100, 0x10).unwrap();
        bus.insert(Arc::new(Mutex::new(Reg(9))), 0x110, 0x10).unwrap();
        assert_eq!(bus.insert(Arc::new(Mutex::new(Reg(0))), 0x10f, 2), Err(BusError::Overlap { base: 0x10f, len: 2 }));
        assert_eq!(bus.insert(Arc::new(Mutex::new(Reg(0))), 0xf8, 0x10), Err(BusError::Overlap { base: 0xf8, len: 0x10 }));
        let mut b = [0u8; 1];
        assert!(bus.read(0x102, &mut b));
        assert_eq!(b[0], 3);
        assert!(bus.write(0x110, &[5]));
        assert!(bus.read(0x111, &mut b));
        assert_eq!(b[0], 6);
        assert!(!bus.read(0x120, &mut b));
        assert_eq!(b[0], 0xff);
    }
}
