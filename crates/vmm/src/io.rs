//! The VM's two buses, as the vCPUs reach them.

use crate::hypervisor::IoHandler;
use devices::bus::Bus;

#[derive(Default)]
pub struct Buses {
    pub pio: Bus,
    pub mmio: Bus,
}

impl IoHandler for Buses {
    fn pio_read(&self, port: u16, data: &mut [u8]) {
        if !self.pio.read(port as u64, data) {
            tracing::trace!(port, "IN from an unclaimed port");
        }
    }
    fn pio_write(&self, port: u16, data: &[u8]) {
        if !self.pio.write(port as u64, data) {
            tracing::trace!(port, "OUT to an unclaimed port");
        }
    }
    fn mmio_read(&self, addr: u64, data: &mut [u8]) {
        if !self.mmio.read(addr, data) {
            tracing::debug!(addr, "read from unclaimed MMIO");
        }
    }
    fn mmio_write(&self, addr: u64, data: &[u8]) {
        if !self.mmio.write(addr, data) {
            tracing::debug!(addr, "write to unclaimed MMIO");
        }
    }
}
