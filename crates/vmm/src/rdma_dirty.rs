//! A PVRDMA device's write traces as a dirty source of the migration
//! engine: rnicd writes guest RAM through its own mapping of the memfd,
//! which the engine's userfaultfd tracking of the vmm's mapping never sees.

use devices::pvrdma::TraceHandle;
use migration::dirty::DirtySource;
use migration::pages::PageRange;

pub struct PvrdmaTraces(pub TraceHandle);

impl DirtySource for PvrdmaTraces {
    fn start(&self) -> anyhow::Result<()> {
        self.0.start().map_err(anyhow::Error::msg)
    }

    fn take_dirty(&self) -> anyhow::Result<Vec<PageRange>> {
        Ok(self.0.take().into_iter().map(|(first, count)| PageRange { first, count }).collect())
    }

    fn stop(&self) {
        self.0.stop()
    }
}
