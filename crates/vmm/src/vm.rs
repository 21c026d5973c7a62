//! One VM: RAM, buses, devices, vCPUs, and its run state.

use crate::config::VmConfig;
use crate::hypervisor::{unicorn::UnicornHypervisor, Hypervisor, VcpuState};
use crate::io::Buses;
use crate::memory::GuestRam;
use crate::vcpus::VcpuSet;
use anyhow::{anyhow, bail, Context, Result};
use devices::apic::Apics;
use devices::console::DebugConsole;
use devices::layout::*;
use devices::mailbox::Mailbox;
use devices::nvme::{NvmeConfig, NvmeController};
use devices::pci::PciRoot;
use devices::platform::{GuestClock, Platform, PlatformEvents};
use devices::pvrdma::{Pvrdma, PvrdmaConfig};
use devices::VmDevice;
use serde::Serialize;
use snapshot::{Section, StateSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use vm_memory::{Bytes, GuestAddress};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum RunState {
    /// Built, waiting for state from a save file or an incoming migration.
    Inmigrate,
    Running,
    Paused,
    /// The source after a completed outgoing migration.
    Postmigrate,
    /// The guest reported it is done (platform exit register).
    Shutdown,
    /// A vCPU hit something it cannot continue from.
    InternalError,
}

const VCPU_STATE_VERSION: u32 = 1;

/// The state section that records every PCI BAR (`Vm::pci_layout`); its
/// name cannot be a device's (device names have no ':').
const PCI_LAYOUT_SECTION: &str = "layout:pci";
const PCI_LAYOUT_VERSION: u32 = 1;

/// One BAR of one PCI function, as saved.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
struct PciBar {
    dev: u8,
    slot: u8,
    addr: u64,
    size: u64,
    wide: bool,
}

pub struct Vm {
    pub config: VmConfig,
    ram: GuestRam,
    buses: Arc<Buses>,
    devices: Vec<(String, Arc<Mutex<dyn VmDevice>>)>,
    pci: Arc<Mutex<PciRoot>>,
    mailbox: Arc<Mutex<Mailbox>>,
    nvme: Vec<Arc<Mutex<NvmeController>>>,
    pvrdma: Vec<Arc<Mutex<Pvrdma>>>,
    vcpus: Mutex<VcpuSet>,
    apics: Arc<Apics>,
    clock: Arc<GuestClock>,
    events: Arc<PlatformEvents>,
    console_history: Arc<Mutex<Vec<String>>>,
    state: Mutex<RunState>,
    /// What must live as long as RAM is mapped (a migrated-away source's
    /// dirty tracking); last, so dropped after RAM.
    retired: Mutex<Vec<Box<dyn Send>>>,
}

/// Where console lines go.
pub type ConsoleSink = Box<dyn FnMut(&str) + Send>;

impl Vm {
    /// Build the machine with all vCPUs paused and RAM empty.
    pub fn build(config: VmConfig, console: ConsoleSink) -> Result<Arc<Vm>> {
        config.validate()?;
        let ram = GuestRam::new(&config.name, config.memory)?;
        let buses = Arc::new(Buses::default());
        let apics = Apics::new(config.vcpus);
        let clock = GuestClock::new();
        let mut devices: Vec<(String, Arc<Mutex<dyn VmDevice>>)> = Vec::new();

        let console = DebugConsole::new(console);
        let console_history = console.history();
        let console = Arc::new(Mutex::new(console));
        buses.pio.insert(console.clone(), DEBUGCON_PORT as u64, 1)?;
        devices.push(("console".into(), console));

        let platform = Platform::new(clock.clone());
        let events = platform.events();
        let platform = Arc::new(Mutex::new(platform));
        buses.mmio.insert(platform.clone(), PLATFORM_ADDR, 0x1000)?;
        devices.push(("platform".into(), platform));

        let mailbox = Arc::new(Mutex::new(Mailbox::new()));
        buses.mmio.insert(mailbox.clone(), MAILBOX_ADDR, devices::mailbox::SIZE)?;
        devices.push(("mailbox".into(), mailbox.clone()));

        let pci = Arc::new(Mutex::new(PciRoot::new()));
        buses.pio.insert(pci.clone(), PCI_CONFIG_ADDRESS as u64, 8)?;

        let mut nvme = Vec::new();
        let mut bar = PCI_BAR_BASE;
        for spec in &config.nvme {
            let cfg = NvmeConfig::parse(spec).map_err(|e| anyhow!("--nvme {spec:?}: {e}"))?;
            let name = cfg.name.clone();
            if devices.iter().any(|(n, _)| *n == name) {
                bail!("two devices are named {name:?}; give each NVMe controller its own name=");
            }
            let ctrl = NvmeController::new(cfg, ram.memory().clone(), bar).map_err(|e| anyhow!("NVMe controller {name}: {e}"))?;
            let ctrl = Arc::new(Mutex::new(ctrl));
            buses.mmio.insert(ctrl.clone(), bar, NvmeController::BAR0_SIZE)?;
            pci.lock().unwrap().add(ctrl.clone()).ok_or_else(|| anyhow!("no free PCI slot for {name}"))?;
            devices.push((name, ctrl.clone()));
            nvme.push(ctrl);
            bar += NvmeController::BAR0_SIZE;
        }

        // PVRDMA's BARs are 32-bit (Linux's vmw_pvrdma finds them at BARs
        // 0, 1 and 2): they take the 32-bit PCI hole below 4 GiB.
        let mut bar = PCI_HOLE_BASE;
        let mut pvrdma = Vec::new();
        for spec in &config.pvrdma {
            let cfg = PvrdmaConfig::parse(spec).map_err(|e| anyhow!("--pvrdma {spec:?}: {e}"))?;
            let name = cfg.name.clone();
            if devices.iter().any(|(n, _)| *n == name) {
                bail!("two devices are named {name:?}; give each PVRDMA device its own name=");
            }
            bar = bar.next_multiple_of(devices::pvrdma::BAR_ALIGN);
            if bar + devices::pvrdma::BAR_SPAN > PCI_HOLE_BASE + PCI_HOLE_SIZE {
                bail!("PVRDMA device {name}: no room left in the 32-bit PCI hole");
            }
            // rnicd maps guest RAM itself for the device's memory regions.
            let memfd = std::os::fd::OwnedFd::from(ram.memfd().try_clone().context("duplicating the guest RAM memfd")?);
            let dev = Pvrdma::new(cfg, ram.memory().clone(), memfd, bar).map_err(|e| anyhow!("PVRDMA device {name}: {e}"))?;
            dev.set_msi_sink(apics.clone());
            for (b, addr, size) in dev.bars() {
                buses.mmio.insert(b, addr, size)?;
            }
            let dev = Arc::new(Mutex::new(dev));
            pci.lock().unwrap().add(dev.clone()).ok_or_else(|| anyhow!("no free PCI slot for {name}"))?;
            devices.push((name, dev.clone()));
            pvrdma.push(dev);
            bar += devices::pvrdma::BAR_SPAN;
        }

        let hv: Arc<dyn Hypervisor> = Arc::new(UnicornHypervisor);
        let vcpus = VcpuSet::start(hv, config.vcpus, ram.host_addr(), ram.size(), buses.clone(), apics.clone())?;
        Ok(Arc::new(Vm {
            config,
            ram,
            buses,
            devices,
            pci,
            mailbox,
            nvme,
            pvrdma,
            vcpus: Mutex::new(vcpus),
            apics,
            clock,
            events,
            console_history,
            state: Mutex::new(RunState::Inmigrate),
            retired: Mutex::default(),
        }))
    }

    /// Load the firmware and point the vCPUs at it; the VM stays paused.
    pub fn boot(&self) -> Result<()> {
        let fw = &self.config.firmware;
        let mut f = std::fs::File::open(fw).with_context(|| format!("opening firmware {}", fw.display()))?;
        use linux_loader::loader::KernelLoader;
        let loaded = linux_loader::loader::Elf::load(self.ram.memory(), None, &mut f, Some(GuestAddress(FIRMWARE_ADDR)))
            .map_err(|e| anyhow!("loading firmware {}: {e}", fw.display()))?;
        let firmware_end = (loaded.kernel_end + 0xfff) & !0xfff;
        if firmware_end > self.ram.size() {
            bail!("firmware does not fit in {} MiB of RAM", self.ram.size() >> 20);
        }
        let entry = elf_entry(fw)?;
        let mem = self.ram.memory();
        mem.write_slice(self.config.cmdline.as_bytes(), GuestAddress(CMDLINE_ADDR))?;
        let info = BootInfo {
            magic: BOOT_MAGIC,
            ram_size: self.ram.size(),
            num_vcpus: self.config.vcpus,
            _pad: 0,
            mmio_base: MMIO_BASE,
            cmdline_addr: CMDLINE_ADDR,
            cmdline_len: self.config.cmdline.len() as u64,
            firmware_end,
        };
        mem.write_slice(&info.to_bytes(), GuestAddress(BOOT_INFO_ADDR))?;
        let vcpus = self.vcpus.lock().unwrap();
        let mut states = vcpus.states()?;
        for (i, s) in states.iter_mut().enumerate() {
            s.rip = entry;
            s.gprs[5] = BOOT_INFO_ADDR; // rdi
            s.gprs[4] = i as u64; // rsi
            s.gprs[7] = 0; // rsp: the firmware sets its own stack
        }
        vcpus.set_states(&states)?;
        drop(vcpus); // the state lock is taken before the vCPUs' (see `run_state`)
        *self.state.lock().unwrap() = RunState::Paused;
        Ok(())
    }

    pub fn run_state(&self) -> RunState {
        let mut st = self.state.lock().unwrap();
        // Fold in what the guest and vCPUs reported since.
        if *st == RunState::Running {
            if self.events.exit_code.load(Ordering::SeqCst) >= 0 {
                *st = RunState::Shutdown;
            } else if self.vcpus.lock().unwrap().status().iter().any(|s| s.error.is_some()) {
                *st = RunState::InternalError;
            }
        }
        *st
    }

    pub fn set_run_state(&self, s: RunState) {
        *self.state.lock().unwrap() = s;
    }

    /// Exit code the guest reported, if it exited.
    pub fn guest_exit_code(&self) -> Option<u32> {
        let c = self.events.exit_code.load(Ordering::SeqCst);
        (c >= 0).then_some(c as u32)
    }

    pub fn guest_progress(&self) -> u64 {
        self.events.progress.load(Ordering::Relaxed)
    }

    pub fn guest_time_ns(&self) -> u64 {
        self.clock.now_ns()
    }

    pub fn console_lines(&self) -> Vec<String> {
        self.console_history.lock().unwrap().clone()
    }

    pub fn ram(&self) -> &GuestRam {
        &self.ram
    }

    pub fn buses(&self) -> &Arc<Buses> {
        &self.buses
    }

    /// The vCPUs' local APICs, where devices deliver their MSIs.
    pub fn apics(&self) -> &Arc<Apics> {
        &self.apics
    }

    pub fn pci(&self) -> &Arc<Mutex<PciRoot>> {
        &self.pci
    }

    /// The guest's out-of-band channel (`mailbox-read` / `mailbox-write`).
    pub fn mailbox(&self) -> &Arc<Mutex<Mailbox>> {
        &self.mailbox
    }

    /// The NVMe controller called `name`, or the first one.
    pub fn nvme(&self, name: Option<&str>) -> Option<&Arc<Mutex<NvmeController>>> {
        match name {
            None => self.nvme.first(),
            Some(n) => self.nvme.iter().find(|c| c.lock().unwrap().name() == n),
        }
    }

    pub fn pvrdma_devices(&self) -> &[Arc<Mutex<Pvrdma>>] {
        &self.pvrdma
    }

    /// Writes to guest RAM that the vmm's own tracking cannot see (rnicd's,
    /// through its mapping of the RAM memfd): the migration engine's extra
    /// dirty sources.
    pub fn dirty_sources(&self) -> Vec<Arc<dyn migration::dirty::DirtySource>> {
        self.pvrdma.iter().map(|d| Arc::new(crate::rdma_dirty::PvrdmaTraces(d.lock().unwrap().traces())) as _).collect()
    }

    /// The VM runs on another host now: its RDMA objects go from this one.
    pub fn close_rdma(&self) {
        for d in &self.pvrdma {
            d.lock().unwrap().close();
        }
    }

    pub fn nvme_controllers(&self) -> &[Arc<Mutex<NvmeController>>] {
        &self.nvme
    }

    pub fn vcpu_status(&self) -> Vec<crate::vcpus::VcpuStatus> {
        self.vcpus.lock().unwrap().status()
    }

    /// Stop vCPUs, then quiesce devices; nothing writes guest RAM after this.
    pub fn pause(&self) {
        self.interrupt_device_waits(true);
        self.vcpus.lock().unwrap().pause();
        self.quiesce();
    }

    /// A vCPU asleep in a device's wait (a PVRDMA WAIT doorbell) is inside
    /// its MMIO exit, where a kick does not reach it: the devices end such
    /// waits while the vCPUs stop (`on`), or again let them sleep after a
    /// pause that gave up. A resumed device lets them sleep again itself.
    fn interrupt_device_waits(&self, on: bool) {
        for d in &self.pvrdma {
            d.lock().unwrap().interrupt_waits(on);
        }
    }

    /// As [`Vm::pause`] for a control command, which must answer promptly:
    /// waits at most `bound` for the vCPUs. When one does not stop (blocked
    /// on a page an incoming postcopy has not brought), nothing is stopped,
    /// the VM runs on as before, and the error says which vCPUs and why.
    pub fn try_pause(&self, bound: std::time::Duration) -> Result<()> {
        self.interrupt_device_waits(true);
        // The vCPU set's lock is released before the state lock is taken
        // (`run_state` takes them in the other order) and before
        // `vcpu_status` takes it again: held across the match, it deadlocked.
        let paused = self.vcpus.lock().unwrap().try_pause(bound);
        let late = match paused {
            Ok(()) => {
                self.quiesce();
                return Ok(());
            }
            Err(late) => {
                self.interrupt_device_waits(false);
                late
            }
        };
        let status = self.vcpu_status();
        let waiting: Vec<usize> = late.iter().copied().filter(|&i| status.get(i).is_some_and(|s| s.waiting_for_page)).collect();
        let list = |v: &[usize]| v.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(", ");
        if waiting.is_empty() {
            bail!("vCPU {} did not stop within {bound:?}; the VM was left running", list(&late));
        }
        bail!(
            "vCPU {} cannot stop: it waits for a page of guest memory that has not arrived (an incoming postcopy migration); \
             nothing was stopped and the VM was left running",
            list(&waiting)
        )
    }

    fn quiesce(&self) {
        for (_, d) in &self.devices {
            d.lock().unwrap().pause();
        }
        self.clock.set_running(false);
        let mut st = self.state.lock().unwrap();
        if *st == RunState::Running {
            *st = RunState::Paused;
        }
    }

    pub fn resume(&self) -> Result<()> {
        let st = self.run_state();
        match st {
            RunState::Paused => {}
            RunState::Inmigrate => bail!("the VM has not received its state yet (it waits for a migration or a restore)"),
            RunState::Running => return Ok(()),
            other => bail!("cannot run a VM in state {other:?}"),
        }
        for (_, d) in &self.devices {
            d.lock().unwrap().resume();
        }
        self.clock.set_running(true);
        *self.state.lock().unwrap() = RunState::Running;
        self.vcpus.lock().unwrap().resume();
        Ok(())
    }

    pub fn is_paused(&self) -> bool {
        self.vcpus.lock().unwrap().is_paused()
    }

    /// Architectural state of every vCPU; the VM must be paused.
    pub fn vcpu_states(&self) -> Result<Vec<VcpuState>> {
        self.vcpus.lock().unwrap().states()
    }

    /// vCPU and device state; the VM must be paused.
    pub fn save_state(&self) -> Result<StateSet> {
        self.save_state_with(|d| d.save())
    }

    /// The state at a migration's switch after the early sections went
    /// (`Persist::save_switch`: devices may send only what changed since).
    pub fn save_switch_state(&self) -> Result<StateSet> {
        self.save_state_with(|d| d.save_switch())
    }

    fn save_state_with(&self, save: impl Fn(&dyn VmDevice) -> snapshot::Result<Section>) -> Result<StateSet> {
        let vcpus = self.vcpus.lock().unwrap();
        let mut set = StateSet::default();
        for (i, s) in vcpus.states()?.iter().enumerate() {
            set.push(Section::encode(&format!("cpu{i}"), VCPU_STATE_VERSION, s));
        }
        for (_, d) in &self.devices {
            set.push(save(&*d.lock().unwrap())?);
        }
        set.push(Section::encode(PCI_LAYOUT_SECTION, PCI_LAYOUT_VERSION, &self.pci_layout()));
        Ok(set)
    }

    /// The devices' early sections (`Persist::save_early`), taken while
    /// the VM runs.
    pub fn save_early_state(&self) -> Result<StateSet> {
        let mut set = StateSet::default();
        for (_, d) in &self.devices {
            if let Some(s) = d.lock().unwrap().save_early()? {
                set.push(s);
            }
        }
        Ok(set)
    }

    /// Builds what early sections describe in the devices they name (an
    /// incoming migration, before its state arrives). Every device is
    /// given its section, even after another's failed (each keeps the
    /// section its state at the switch may be a delta over); the first
    /// error is returned.
    pub fn prepare_state(&self, early: &StateSet) -> Result<()> {
        let mut first = Ok(());
        for s in &early.sections {
            let r = match self.devices.iter().find(|(name, _)| *name == s.name) {
                Some((_, d)) => d.lock().unwrap().prepare(s).map_err(anyhow::Error::from),
                None => Err(anyhow::anyhow!("the early state names a device {:?} this VM does not have", s.name)),
            };
            if first.is_ok() {
                first = r;
            }
        }
        first
    }

    /// Drops what `prepare_state` built (the migration failed).
    pub fn discard_prepared(&self) {
        for (_, d) in &self.devices {
            d.lock().unwrap().discard_prepared();
        }
    }

    /// Where every PCI function's BARs are: the guest keeps these
    /// addresses in its own memory, so a restored VM must have the same.
    fn pci_layout(&self) -> Vec<PciBar> {
        let pci = self.pci.lock().unwrap();
        let mut out = Vec::new();
        for (dev, f) in pci.functions() {
            let mut f = f.lock().unwrap();
            let cfg = f.pci_config();
            for slot in 0..6 {
                if let Some(b) = cfg.bar(slot) {
                    out.push(PciBar { dev, slot: slot as u8, addr: b.addr, size: b.size, wide: cfg.bar_is_64bit(slot) });
                }
            }
        }
        out
    }

    /// Refuses state saved by a machine whose PCI BARs lay elsewhere.
    fn check_pci_layout(&self, set: &StateSet) -> Result<()> {
        let mine = self.pci_layout();
        let Ok(section) = set.get(PCI_LAYOUT_SECTION) else {
            if self.pvrdma.is_empty() {
                return Ok(()); // NVMe's 64-bit BARs have not moved
            }
            bail!(
                "the saved state does not say where its PCI BARs were: it comes from a vmm that put PVRDMA's BARs above 4 GiB as 64-bit BARs, \
                 and its guest would look for the device there; this vmm puts them as 32-bit BARs in the PCI hole at {PCI_HOLE_BASE:#x} \
                 (boot the VM again instead)"
            );
        };
        let saved: Vec<PciBar> = section.decode(PCI_LAYOUT_VERSION)?;
        if saved != mine {
            bail!("the saved VM's PCI BARs {saved:?} are not this VM's {mine:?}: its guest would address its devices where they are not");
        }
        Ok(())
    }

    /// Load state saved from a VM of the same shape; the VM must be paused.
    pub fn restore_state(&self, set: &StateSet) -> Result<()> {
        let vcpus = self.vcpus.lock().unwrap();
        let mut states = Vec::new();
        for i in 0..self.config.vcpus {
            let s: VcpuState = set.get(&format!("cpu{i}"))?.decode(VCPU_STATE_VERSION)?;
            states.push(s);
        }
        if set.get(&format!("cpu{}", self.config.vcpus)).is_ok() {
            bail!("saved state has more vCPUs than this VM ({})", self.config.vcpus);
        }
        self.check_pci_layout(set)?;
        for (name, d) in &self.devices {
            d.lock().unwrap().restore(set.get(name)?)?;
        }
        vcpus.set_states(&states)?;
        drop(vcpus);
        let mut st = self.state.lock().unwrap();
        if *st == RunState::Inmigrate {
            *st = RunState::Paused;
        }
        Ok(())
    }

    pub fn set_cpu_throttle(&self, pct: u8) {
        self.vcpus.lock().unwrap().set_throttle(pct);
    }

    pub fn cpu_throttle(&self) -> u8 {
        self.vcpus.lock().unwrap().throttle()
    }

    /// Stop the vCPU threads for good (the process is about to exit).
    pub fn shutdown(&self) {
        self.vcpus.lock().unwrap().shutdown();
    }
}

/// The ELF entry point (linux-loader reports load addresses, not the entry).
fn elf_entry(path: &std::path::Path) -> Result<u64> {
    use std::io::Read;
    let mut hdr = [0u8; 32];
    std::fs::File::open(path)?.read_exact(&mut hdr)?;
    if &hdr[..4] != b"\x7fELF" || hdr[4] != 2 {
        bail!("{} is not a 64-bit ELF file", path.display());
    }
    Ok(u64::from_le_bytes(hdr[24..32].try_into().unwrap()))
}

/// `(gpa, len)` byte ranges as page ranges, in their order (neighbours merged).
fn page_ranges(bytes: impl Iterator<Item = (u64, u64)>) -> Vec<migration::pages::PageRange> {
    let page = migration::pages::PAGE_SIZE;
    let mut out: Vec<migration::pages::PageRange> = Vec::new();
    for (gpa, len) in bytes {
        let (first, end) = (gpa / page, (gpa + len).div_ceil(page));
        match out.last_mut() {
            Some(r) if r.first + r.count == first => r.count += end - first,
            _ if end > first => out.push(migration::pages::PageRange { first, count: end - first }),
            _ => {}
        }
    }
    out
}

impl migration::vm::MigratableVm for Vm {
    fn ram(&self) -> migration::vm::RamRegion {
        migration::vm::RamRegion { host_addr: self.ram.host_addr(), len: self.ram.size(), memfd: self.ram.memfd_raw() }
    }
    fn pause(&self) -> Result<()> {
        Vm::pause(self);
        Ok(())
    }
    fn resume(&self) -> Result<()> {
        Vm::resume(self)
    }
    fn save_state(&self) -> Result<StateSet> {
        Vm::save_state(self)
    }
    fn restore_state(&self, s: &StateSet) -> Result<()> {
        Vm::restore_state(self, s)
    }
    fn save_switch_state(&self) -> Result<StateSet> {
        Vm::save_switch_state(self)
    }
    fn save_early_state(&self) -> Result<StateSet> {
        Vm::save_early_state(self)
    }
    fn prepare_state(&self, early: &StateSet) -> Result<()> {
        Vm::prepare_state(self, early)
    }
    fn discard_prepared(&self) {
        Vm::discard_prepared(self)
    }
    fn set_cpu_throttle(&self, pct: u8) {
        Vm::set_cpu_throttle(self, pct)
    }
    fn shape(&self) -> String {
        self.config.shape()
    }
    fn retire(&self, what: Box<dyn Send>) {
        self.retired.lock().unwrap().push(what);
    }
    /// The PVRDMA devices' GIDs leave this host (the destination claims
    /// them when it resumes the VM).
    fn let_go(&self) -> Result<()> {
        for d in &self.pvrdma {
            d.lock().unwrap().release_gid().map_err(anyhow::Error::msg)?;
        }
        Ok(())
    }
    /// The PVRDMA devices' rings and memory regions, as page ranges.
    fn device_pages(&self) -> Vec<migration::pages::PageRange> {
        page_ranges(self.pvrdma.iter().flat_map(|d| d.lock().unwrap().device_pages()))
    }
    /// The same, as the early sections the PVRDMA devices received name them.
    fn device_pages_ahead(&self) -> Vec<migration::pages::PageRange> {
        page_ranges(self.pvrdma.iter().flat_map(|d| d.lock().unwrap().early_pages()))
    }
    /// Small for vCPUs and devices, except memory-backed NVMe namespaces:
    /// their bytes travel in the state, and the downtime estimate must see them.
    fn state_size_estimate(&self) -> u64 {
        let namespaces: u64 = self
            .config
            .nvme
            .iter()
            .filter_map(|spec| NvmeConfig::parse(spec).ok())
            .flat_map(|c| c.namespaces)
            .map(|ns| match ns.backend {
                devices::nvme::BackendSpec::Memory { size } => size,
                devices::nvme::BackendSpec::File { .. } => 0,
            })
            .sum();
        (256 << 10) + namespaces
    }
}
