//! What the migration engine needs from a VM, and nothing more.
//!
//! The vmm implements [`MigratableVm`]; the engine never reaches into vCPUs
//! or devices directly: device and vCPU state cross as a [`StateSet`] of
//! versioned sections (see `snapshot::Persist`).

use crate::pages::{PageRange, PAGE_SIZE};
use snapshot::StateSet;
use std::os::fd::RawFd;

/// Guest RAM as one contiguous shared mapping of a memfd.
#[derive(Debug, Clone, Copy)]
pub struct RamRegion {
    /// Host address of guest physical address 0 in this process.
    pub host_addr: *mut u8,
    /// Bytes of guest RAM (a multiple of 4 KiB).
    pub len: u64,
    /// The memfd behind it (other processes, e.g. rnicd, map it too).
    pub memfd: RawFd,
}

// The mapping lives as long as the VM; the engine only reads and writes
// pages through it, like a DMA engine.
unsafe impl Send for RamRegion {}
unsafe impl Sync for RamRegion {}

impl RamRegion {
    pub fn pages(&self) -> u64 {
        self.len / PAGE_SIZE
    }
    /// Pages of the memfd that hold data (all others are holes: zero).
    pub fn data_ranges(&self) -> std::io::Result<Vec<PageRange>> {
        crate::pages::data_ranges_mapped(self.host_addr, self.memfd, self.len, PAGE_SIZE)
    }
    /// The memfd's holes now, from an earlier look's `holes`: only those
    /// are looked at again, since `SEEK_HOLE` walks every page of a data
    /// range (about 40 ms for 4 GiB) while `SEEK_DATA` skips a hole at
    /// once. Data stays data: a page punched out since is not taken for a
    /// hole (it reads as zeros either way).
    pub fn holes_since(&self, holes: &[PageRange]) -> std::io::Result<Vec<PageRange>> {
        use crate::pages::{complement, data_ranges_within, normalize};
        let total = self.pages();
        let mut data = complement(holes, total);
        data.extend(data_ranges_within(self.memfd, holes, PAGE_SIZE)?);
        Ok(complement(&normalize(data, total), total))
    }
}

/// Asks for transparent huge pages (2 MiB) on a shared mapping of guest
/// RAM: the memory a fault through it allocates comes in huge folios, and
/// every mapping of the memfd (the vmm's, the receive alias, rnicd's) then
/// maps 2 MiB per page-table entry. A migration touches every page of RAM
/// through several mappings: with 4 KiB pages, filling and tearing down
/// those page tables cost about as much CPU as moving the bytes (rnicd's
/// unmap of guest RAM was a fifth of its CPU per migration). Shared memory
/// follows the host's `/sys/kernel/mm/transparent_hugepage/shmem_enabled`:
/// `advise` (or `always`, `within_size`) honours this; `never`, the
/// kernel's default, leaves 4 KiB pages, and then this does nothing.
/// Best effort: an error (no THP in the kernel) is only logged.
pub fn advise_huge_pages(addr: *mut u8, len: usize) {
    // SAFETY: advice on a mapping the caller owns; it changes no contents.
    if unsafe { libc::madvise(addr as *mut libc::c_void, len, libc::MADV_HUGEPAGE) } != 0 {
        tracing::debug!("MADV_HUGEPAGE on guest RAM: {}", std::io::Error::last_os_error());
    }
}

/// Whether shared memory that asks for huge pages ([`advise_huge_pages`])
/// gets them on this host.
pub fn shmem_huge_pages() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled").is_ok_and(|s| {
        s.split_whitespace()
            .find_map(|w| w.strip_prefix('[').and_then(|w| w.strip_suffix(']')))
            .is_some_and(|v| matches!(v, "always" | "within_size" | "advise" | "force"))
    })
}

pub trait MigratableVm: Send + Sync {
    fn ram(&self) -> RamRegion;

    /// Stop all vCPUs and quiesce devices (in-flight device work completes or
    /// is recorded in device state). Returns once nothing writes guest RAM.
    fn pause(&self) -> anyhow::Result<()>;

    /// Let vCPUs and devices run again.
    fn resume(&self) -> anyhow::Result<()>;

    /// vCPU and device state of the paused VM.
    fn save_state(&self) -> anyhow::Result<StateSet>;

    /// Load vCPU and device state into a paused VM built from the same config.
    fn restore_state(&self, state: &StateSet) -> anyhow::Result<()>;

    /// The state at a switch whose early sections went to the destination
    /// (`snapshot::Persist::save_switch`: a device may send only what
    /// changed since its early section).
    fn save_switch_state(&self) -> anyhow::Result<StateSet> {
        self.save_state()
    }

    /// The devices' early sections (`snapshot::Persist::save_early`),
    /// taken while the VM runs: precopy and hybrid send them ahead of
    /// the RAM, and the destination builds them (`prepare_state`) while
    /// the rounds run. Empty: nothing to build ahead.
    fn save_early_state(&self) -> anyhow::Result<StateSet> {
        Ok(StateSet::default())
    }

    /// Destination: build what the early sections describe, ahead of the
    /// state that `restore_state` loads at the switch. An error is logged
    /// and the switch builds the whole state (taking or refusing it).
    fn prepare_state(&self, _early: &StateSet) -> anyhow::Result<()> {
        Ok(())
    }

    /// Destination: the migration failed; what `prepare_state` built goes.
    fn discard_prepared(&self) {}

    /// Guest pages that devices reach without the vCPU once the VM runs on
    /// the destination (a PVRDMA device's rings and memory regions, where
    /// its rnicd moves the peers' data), in the order they matter. Asked
    /// at a postcopy or hybrid switch, while paused: the missing ones cross
    /// inside the switch, up to `postcopy::device::SWITCH_PAGES_MAX`, and
    /// the push sends the rest before other pages, so that a device's
    /// accesses after the restart do not wait for a page on the network.
    fn device_pages(&self) -> Vec<PageRange> {
        Vec::new()
    }

    /// Destination, once `prepare_state` built the early sections: the
    /// pages [`device_pages`](Self::device_pages) will name after the
    /// switch, as far as those sections tell. A postcopy or hybrid
    /// destination allocates them ahead, so that placing them inside the
    /// switch is a copy (allocating a fresh page cost about 3 us here).
    fn device_pages_ahead(&self) -> Vec<PageRange> {
        Vec::new()
    }

    /// Slow the vCPUs to run only (100 - pct)% of the time (auto-converge).
    fn set_cpu_throttle(&self, pct: u8);

    /// A description of the VM shape (RAM size, vCPUs, devices) that must be
    /// identical on both ends of a migration.
    fn shape(&self) -> String;

    /// Expected size in bytes of [`save_state`](Self::save_state)'s encoding,
    /// known while the VM runs; the downtime estimate includes it.
    fn state_size_estimate(&self) -> u64 {
        256 << 10
    }

    /// The paused VM's state has gone to the destination, which loads it
    /// and, on the source's go after its answer, runs the VM. What only one
    /// host may hold at a time is let go here, while the destination loads:
    /// a PVRDMA device's GID, which the destination claims when it resumes
    /// the VM (after the go, so never while this host still holds it). An
    /// error, or a migration that fails later but before the commit, fails
    /// the migration: the VM resumes here and takes back whatever it had
    /// let go.
    fn let_go(&self) -> anyhow::Result<()> {
        Ok(())
    }

    /// Keep `what` for as long as the VM's RAM stays mapped. A source that
    /// migrated away hands over its dirty tracking: the write protection
    /// no longer matters, and ending it while RAM is mapped makes the
    /// kernel walk every page-table entry of RAM (80 ms for 4 GiB) as the
    /// migration ends, where an exiting process drops its mappings first
    /// and skips the walk. By default it ends at once.
    fn retire(&self, what: Box<dyn Send>) {
        drop(what);
    }
}

/// Per-page xxh3 hashes of guest RAM (the byte-exact check of tests).
pub fn page_hashes(ram: &RamRegion) -> Vec<u64> {
    let data = ram.data_ranges().unwrap_or_default();
    let mut is_data = vec![false; (ram.len / PAGE_SIZE) as usize];
    for r in data {
        for p in r.first..r.end() {
            is_data[p as usize] = true;
        }
    }
    let zero = crate::wire::zero_page_xxh3();
    (0..ram.len / PAGE_SIZE)
        .map(|p| {
            if !is_data[p as usize] {
                return zero;
            }
            // SAFETY: within the mapping.
            let s = unsafe { std::slice::from_raw_parts(ram.host_addr.add((p * PAGE_SIZE) as usize), PAGE_SIZE as usize) };
            crate::wire::xxh3(s)
        })
        .collect()
}
