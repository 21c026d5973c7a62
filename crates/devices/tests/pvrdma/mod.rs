//! A driver for the PVRDMA device written from Rust the way Linux's
//! vmw_pvrdma drives it (DSR, commands in the slot, rings in guest pages,
//! doorbells), on real guest memory (a sealed memfd), against real rnicd
//! processes on testbed hosts.
#![allow(dead_code)]

use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use devices::bus::BusDevice;
use devices::pci::PciFunction;
use devices::pvrdma::{Pvrdma, PvrdmaBar, PvrdmaConfig};
use devices::GuestMemory;
use pvrdma_abi::ib;
use pvrdma_abi::*;
use testbed::rnicd::{build_rnicd, Rnicd};
use testbed::{Testbed, TestbedOpts};
use vm_memory::{Bytes, FileOffset, GuestAddress, GuestRegionMmap};

pub const RAM: u64 = 64 << 20;
pub const T: Duration = Duration::from_secs(20);

/// Hosts with rnicd each; fields drop in order (rnicds, then the testbed).
pub struct Bed {
    pub nics: Vec<Rnicd>,
    pub tb: Testbed,
}

impl Bed {
    pub fn new(prefix: &str, hosts: usize) -> Bed {
        let tb = Testbed::create(TestbedOpts::new(prefix, hosts)).expect("testbed (needs root)");
        let bin = build_rnicd();
        let nics = (0..hosts).map(|i| Rnicd::start(&tb, i, &bin, &[]).expect("start rnicd")).collect();
        Bed { nics, tb }
    }

    /// Adds a VM address (a GID) to host `h` and returns it.
    pub fn vm_gid(&self, h: usize, j: usize) -> Ipv4Addr {
        let g = self.tb.spare_addr(0, j);
        self.tb.host(h).sh(&format!("ip addr add {g}/24 dev eth0")).unwrap();
        g
    }

    pub fn ctx(&self, i: usize) -> verbs::Context {
        verbs::Context::open(Some(&self.nics[i].sock)).unwrap()
    }

    /// The VM of most tests: a device on host 0's rnicd for VM address
    /// (spare) 1, brought up on fresh guest RAM; returns its GID and driver.
    pub fn device(&self) -> (Ipv4Addr, Drv) {
        let gid = self.vm_gid(0, 1);
        let mut d = Drv::new(&self.nics[0].sock, gid);
        d.bring_up();
        (gid, d)
    }

    /// As [`Bed::device`], and a second handle on the guest RAM for the
    /// device that restores this one's state ([`Drv::replace_device`]).
    pub fn movable_device(&self) -> (Ipv4Addr, Drv, OwnedFd) {
        let gid = self.vm_gid(0, 1);
        let (mem, fd) = guest_ram();
        let restore_fd = fd.try_clone().unwrap();
        let mut d = Drv::with_ram(&self.nics[0].sock, gid, mem, fd);
        d.bring_up();
        (gid, d, restore_fd)
    }

    /// Moves VM address `gid` from host `from` to host `to`, as a
    /// migration's switch does.
    pub fn move_gid(&self, gid: Ipv4Addr, from: usize, to: usize) {
        self.tb.host(from).sh(&format!("ip addr del {gid}/24 dev eth0")).unwrap();
        self.tb.host(to).sh(&format!("ip addr add {gid}/24 dev eth0")).unwrap();
    }

    /// A bare-metal peer on host 1 connected to the guest's `qp` (whose
    /// GID is `gid`) both ways: the guest expects `rq_psn` and sends from
    /// `sq_psn`, the peer the other way round.
    pub fn peer_of(&self, d: &mut Drv, qp: &GQp, gid: Ipv4Addr, rq_psn: u32, sq_psn: u32) -> Peer {
        let peer = Peer::new(self.ctx(1));
        d.connect(qp, self.nics[1].addr, peer.qp.qpn, rq_psn, sq_psn);
        peer.connect(gid, qp.qpn, sq_psn, rq_psn);
        peer
    }
}

/// Guest RAM: a sealed memfd mapped as vm-memory, as the vmm has it.
pub fn guest_ram() -> (GuestMemory, OwnedFd) {
    let fd = unsafe { libc::memfd_create(c"pvrdma-test-ram".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    assert!(fd >= 0);
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), RAM as i64) }, 0);
    assert_eq!(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW) }, 0);
    let file = std::fs::File::from(fd.try_clone().unwrap());
    let region = GuestRegionMmap::from_range(GuestAddress(0), RAM as usize, Some(FileOffset::new(file, 0))).unwrap();
    (GuestMemory::from_regions(vec![region]).unwrap(), fd)
}

/// A guest-side QP: its pages and ring geometry.
pub struct GQp {
    pub handle: u32,
    pub qpn: u32,
    pub base: u64,
    pub sq_cnt: u32,
    pub rq_cnt: u32,
    pub sq_stride: u64,
    pub rq_stride: u64,
    pub send_chunks: u32,
    pub sq_tail: u32,
    pub rq_tail: u32,
}

/// A guest-side SRQ: its pages (ring state page, then WQEs) and geometry.
pub struct GSrq {
    pub handle: u32,
    pub base: u64,
    pub cnt: u32,
    pub stride: u64,
    pub tail: u32,
}

pub struct GCq {
    pub handle: u32,
    pub base: u64,
    pub entries: u32,
    pub head: u32,
}

/// The sizes of a guest RC connection's objects ([`Drv::rc_conn`]).
#[derive(Clone, Copy)]
pub struct ConnSpec {
    /// Bytes of the memory region (fresh contiguous pages).
    pub mr_len: u64,
    /// Entries of each of the two CQs.
    pub cq_entries: u32,
    /// Send and receive queue depth.
    pub depth: u32,
    /// SGEs per WQE.
    pub sge: u32,
}

impl Default for ConnSpec {
    fn default() -> ConnSpec {
        ConnSpec { mr_len: 1 << 20, cq_entries: 64, depth: 32, sge: 4 }
    }
}

/// A guest RC connection's objects: PD, MR (guest address `buf`, handle
/// `mr`, key `key`), send CQ, receive CQ and the QP on them (not yet
/// connected).
pub struct Conn {
    pub pd: u32,
    pub buf: u64,
    pub mr: u32,
    pub key: u32,
    pub scq: GCq,
    pub rcq: GCq,
    pub qp: GQp,
}

/// The driver: the device, its BARs, guest memory and a page allocator.
pub struct Drv {
    pub dev: Arc<Mutex<Pvrdma>>,
    pub msix: Arc<Mutex<PvrdmaBar>>,
    pub reg: Arc<Mutex<PvrdmaBar>>,
    pub uar: Arc<Mutex<PvrdmaBar>>,
    pub mem: GuestMemory,
    pub next: u64,
    pub dsr: u64,
    pub cmd: u64,
    pub resp: u64,
    pub async_ring: u64,
    pub cq_ring: u64,
    pub seq: u64,
}

pub const EVENT_RING_PAGES: u32 = 2;
/// Where a test device's BARs start: the 32-bit PCI hole, as in a VM.
pub const BAR_BASE: u64 = devices::layout::PCI_HOLE_BASE;

impl Drv {
    /// A device on `sock`'s rnicd in namespace `gid`, not yet brought up.
    pub fn new(sock: &std::path::Path, gid: Ipv4Addr) -> Drv {
        let (mem, fd) = guest_ram();
        Drv::with_ram(sock, gid, mem, fd)
    }

    /// A device on another rnicd takes this one's place over the same guest
    /// RAM (a restore target); the old device is dropped.
    pub fn replace_device(&mut self, sock: &std::path::Path, gid: Ipv4Addr, fd: OwnedFd) {
        let cfg = PvrdmaConfig::parse(&format!("gid={gid},rnicd={}", sock.display())).unwrap();
        // A restore target: its configuration space comes with the state.
        let dev = Pvrdma::new(cfg, self.mem.clone(), fd, BAR_BASE).expect("device");
        let bars = dev.bars();
        self.msix = bars[0].0.clone();
        self.reg = bars[1].0.clone();
        self.uar = bars[2].0.clone();
        self.dev = Arc::new(Mutex::new(dev));
    }

    /// A device on existing guest RAM (a restore target).
    pub fn with_ram(sock: &std::path::Path, gid: Ipv4Addr, mem: GuestMemory, fd: OwnedFd) -> Drv {
        let cfg = PvrdmaConfig::parse(&format!("gid={gid},rnicd={}", sock.display())).unwrap();
        let mut dev = Pvrdma::new(cfg, mem.clone(), fd, BAR_BASE).expect("device");
        set_bus_master(&mut dev, true);
        let bars = dev.bars();
        Drv {
            msix: bars[0].0.clone(),
            reg: bars[1].0.clone(),
            uar: bars[2].0.clone(),
            dev: Arc::new(Mutex::new(dev)),
            mem,
            next: 1 << 20,
            dsr: 0,
            cmd: 0,
            resp: 0,
            async_ring: 0,
            cq_ring: 0,
            seq: 0,
        }
    }

    pub fn alloc(&mut self, pages: u64) -> u64 {
        let a = self.next;
        self.next += pages * 4096;
        assert!(self.next <= RAM);
        a
    }

    pub fn rd(&self, off: u64) -> u32 {
        let mut b = [0u8; 4];
        self.reg.lock().unwrap().read(off, &mut b);
        u32::from_le_bytes(b)
    }
    pub fn wr(&self, off: u64, v: u32) {
        self.reg.lock().unwrap().write(off, &v.to_le_bytes());
    }
    pub fn doorbell(&self, off: u64, v: u32) {
        self.uar.lock().unwrap().write(off, &v.to_le_bytes());
    }

    pub fn get<T: Pod>(&self, gpa: u64) -> T {
        let mut v = T::zeroed();
        self.mem.read_slice(v.as_bytes_mut(), GuestAddress(gpa)).unwrap();
        v
    }
    pub fn put<T: Pod>(&self, gpa: u64, v: &T) {
        self.mem.write_slice(v.as_bytes(), GuestAddress(gpa)).unwrap();
    }
    pub fn put_bytes(&self, gpa: u64, b: &[u8]) {
        self.mem.write_slice(b, GuestAddress(gpa)).unwrap();
    }
    pub fn get_bytes(&self, gpa: u64, n: usize) -> Vec<u8> {
        let mut v = vec![0u8; n];
        self.mem.read_slice(&mut v, GuestAddress(gpa)).unwrap();
        v
    }

    /// A page directory listing `pages` (one table per 512 pages).
    pub fn pdir(&mut self, pages: &[u64]) -> u64 {
        let dir = self.alloc(1);
        for (t, chunk) in pages.chunks(512).enumerate() {
            let table = self.alloc(1);
            self.put(dir + t as u64 * 8, &table);
            for (i, p) in chunk.iter().enumerate() {
                self.put(table + i as u64 * 8, p);
            }
        }
        dir
    }

    /// `n` fresh contiguous pages and a directory listing them.
    pub fn region(&mut self, n: u64) -> (u64, u64) {
        let base = self.alloc(n);
        let pages: Vec<u64> = (0..n).map(|i| base + i * 4096).collect();
        (base, self.pdir(&pages))
    }

    /// Probe as Linux does: DSR, slots, event rings, DSRLOW/HIGH, IMR, ACTIVATE.
    pub fn bring_up(&mut self) {
        assert_eq!(self.rd(REG_VERSION), VERSION_QPHANDLE);
        self.dsr = self.alloc(1);
        self.cmd = self.alloc(1);
        self.resp = self.alloc(1);
        let (ab, ap) = self.region(EVENT_RING_PAGES as u64);
        let (cb, cp) = self.region(EVENT_RING_PAGES as u64);
        self.async_ring = ab;
        self.cq_ring = cb;
        let dsr = Dsr {
            driver_version: 0x0201_0000,
            gos_info: GosInfo::new(GOS_BITS_64, GOS_TYPE_LINUX, 0, 0),
            cmd_slot_dma: self.cmd,
            resp_slot_dma: self.resp,
            async_ring_pages: RingPageInfo { num_pages: EVENT_RING_PAGES, reserved: 0, pdir_dma: ap },
            cq_ring_pages: RingPageInfo { num_pages: EVENT_RING_PAGES, reserved: 0, pdir_dma: cp },
            uar_pfn64: 0,
            ..Default::default()
        };
        self.put(self.dsr, &dsr);
        self.wr(REG_DSRLOW, self.dsr as u32);
        self.wr(REG_DSRHIGH, (self.dsr >> 32) as u32);
        assert_eq!(self.rd(REG_ERR), 0);
        let caps: DeviceCaps = self.get(self.dsr + Dsr::CAPS_OFFSET as u64);
        assert!(driver_supports(VERSION_QPHANDLE, caps.mode, caps.gid_types), "{caps:?}");
        assert!(caps.max_qp > 0 && caps.max_sge >= 4 && caps.atomic_ops & ATOMIC_OP_FETCH_ADD != 0);
        self.wr(REG_IMR, 0);
        self.wr(REG_CTL, DEVICE_CTL_ACTIVATE);
        assert_eq!(self.rd(REG_ERR), 0);
    }

    /// Posts a command; returns ERR and the response bytes.
    pub fn cmd_raw<C: Pod>(&mut self, c: &C) -> (u32, Vec<u8>) {
        self.put_bytes(self.resp, &[0u8; 256]);
        self.put(self.cmd, c);
        self.wr(REG_REQUEST, 0);
        let err = self.rd(REG_ERR);
        (err, self.get_bytes(self.resp, 256))
    }

    /// Posts a command and checks ack/err; returns the response.
    pub fn cmd<C: Pod, R: Pod>(&mut self, mut c: C) -> Result<R, u8> {
        self.seq += 1;
        let mut h = CmdHdr::read_from(c.as_bytes()).unwrap();
        h.response = self.seq;
        c.as_bytes_mut()[..16].copy_from_slice(h.as_bytes());
        let (err, r) = self.cmd_raw(&c);
        let rh = CmdRespHdr::read_from(&r).unwrap();
        assert_eq!(rh.response, self.seq, "response key echoed");
        assert_eq!(rh.ack, resp_code(h.cmd));
        assert!(self.rd(REG_ICR) & INTR_CAUSE_RESPONSE != 0, "response interrupt pending");
        if rh.err != 0 {
            assert_eq!(err, rh.err as u32, "ERR and hdr.err agree");
            return Err(rh.err);
        }
        assert_eq!(err, 0);
        Ok(R::read_from(&r).unwrap())
    }

    pub fn hdr(cmd: u32) -> CmdHdr {
        CmdHdr { response: 0, cmd, reserved: 0 }
    }

    pub fn create_pd(&mut self) -> u32 {
        let r: CmdCreatePdResp = self.cmd(CmdCreatePd { hdr: Self::hdr(CMD_CREATE_PD), ctx_handle: 0, reserved: [0; 4] }).unwrap();
        r.pd_handle
    }

    /// A memory region over `len` bytes of fresh contiguous pages; returns
    /// (guest address, handle, key).
    pub fn create_mr(&mut self, pd: u32, len: u64) -> (u64, u32, u32) {
        let n = len.div_ceil(4096);
        let (base, pdir) = self.region(n);
        let r: CmdCreateMrResp = self
            .cmd(CmdCreateMr {
                hdr: Self::hdr(CMD_CREATE_MR),
                start: base,
                length: len,
                pdir_dma: pdir,
                pd_handle: pd,
                access_flags: ib::access::LOCAL_WRITE | ib::access::REMOTE_WRITE | ib::access::REMOTE_READ | ib::access::REMOTE_ATOMIC,
                flags: 0,
                nchunks: n as u32,
            })
            .unwrap();
        assert_eq!(r.lkey, r.rkey);
        (base, r.mr_handle, r.lkey)
    }

    /// A memory region over the guest pages `pages` in that order, seen
    /// by peers from `start` (whose page offset is where byte 0 sits in the
    /// first page); returns (handle, key) or the command's error.
    pub fn create_mr_pages(&mut self, pd: u32, pages: &[u64], start: u64, len: u64) -> Result<(u32, u32), u8> {
        let pdir = self.pdir(pages);
        let r: CmdCreateMrResp = self.cmd(CmdCreateMr {
            hdr: Self::hdr(CMD_CREATE_MR),
            start,
            length: len,
            pdir_dma: pdir,
            pd_handle: pd,
            access_flags: ib::access::LOCAL_WRITE | ib::access::REMOTE_WRITE | ib::access::REMOTE_READ | ib::access::REMOTE_ATOMIC,
            flags: 0,
            nchunks: pages.len() as u32,
        })?;
        assert_eq!(r.lkey, r.rkey);
        Ok((r.mr_handle, r.lkey))
    }

    /// A new PD and an RC connection's objects in it, in the order a
    /// driver creates them.
    pub fn rc_conn(&mut self, spec: ConnSpec) -> Conn {
        let pd = self.create_pd();
        self.rc_conn_in(pd, spec)
    }

    /// An RC connection's objects in the existing PD `pd`: MR, send CQ,
    /// receive CQ, QP.
    pub fn rc_conn_in(&mut self, pd: u32, spec: ConnSpec) -> Conn {
        let (buf, mr, key) = self.create_mr(pd, spec.mr_len);
        let scq = self.create_cq(spec.cq_entries);
        let rcq = self.create_cq(spec.cq_entries);
        let qp = self.create_qp(pd, &scq, &rcq, spec.depth, spec.sge);
        Conn { pd, buf, mr, key, scq, rcq, qp }
    }

    pub fn create_cq(&mut self, entries: u32) -> GCq {
        let n = cq_pages(entries);
        let (base, pdir) = self.region(n as u64);
        let r: CmdCreateCqResp = self
            .cmd(CmdCreateCq { hdr: Self::hdr(CMD_CREATE_CQ), pdir_dma: pdir, ctx_handle: 0, cqe: entries, nchunks: n, reserved: [0; 4] })
            .unwrap();
        assert_eq!(r.cqe, entries);
        GCq { handle: r.cq_handle, base, entries, head: 0 }
    }

    pub fn create_qp(&mut self, pd: u32, scq: &GCq, rcq: &GCq, depth: u32, sge: u32) -> GQp {
        let sq_stride = sq_wqe_stride(sge);
        let rq_stride = rq_wqe_stride(sge);
        let sq_pages = queue_pages(depth, sq_stride);
        let rq_pages = queue_pages(depth, rq_stride);
        let total = 1 + sq_pages + rq_pages;
        let (base, pdir) = self.region(total as u64);
        let r: CmdCreateQpRespV2 = self
            .cmd(CmdCreateQp {
                hdr: Self::hdr(CMD_CREATE_QP),
                pdir_dma: pdir,
                pd_handle: pd,
                send_cq_handle: scq.handle,
                recv_cq_handle: rcq.handle,
                max_send_wr: depth,
                max_recv_wr: depth,
                max_send_sge: sge,
                max_recv_sge: sge,
                total_chunks: total as u16,
                send_chunks: sq_pages as u16,
                qp_type: ib::qp_type::RC,
                ..Default::default()
            })
            .unwrap();
        assert_ne!(r.qp_handle, r.qpn, "version 20: the handle is not the QPN");
        GQp {
            handle: r.qp_handle,
            qpn: r.qpn,
            base,
            sq_cnt: depth,
            rq_cnt: depth,
            sq_stride: sq_stride as u64,
            rq_stride: rq_stride as u64,
            send_chunks: sq_pages,
            sq_tail: 0,
            rq_tail: 0,
        }
    }

    /// CREATE_SRQ as Linux sends it for rdma-core's ring (one state page,
    /// then twice the WQE pages); returns the SRQ or the command's error.
    pub fn try_create_srq(&mut self, pd: u32, max_wr: u32, max_sge: u32, limit: u32) -> Result<GSrq, u8> {
        let stride = rq_wqe_stride(max_sge) as u64;
        let n = 1 + 2 * queue_pages(max_wr, stride as usize);
        let (base, pdir) = self.region(n as u64);
        let attrs = SrqAttr { max_wr, max_sge, srq_limit: limit, reserved: 0 };
        let r: CmdCreateSrqResp = self.cmd(CmdCreateSrq {
            hdr: Self::hdr(CMD_CREATE_SRQ),
            pdir_dma: pdir,
            pd_handle: pd,
            nchunks: n,
            attrs,
            srq_type: ib::srq_type::BASIC,
            reserved: [0; 7],
        })?;
        Ok(GSrq { handle: r.srqn, base, cnt: max_wr, stride, tail: 0 })
    }

    pub fn create_srq(&mut self, pd: u32, max_wr: u32, max_sge: u32, limit: u32) -> GSrq {
        self.try_create_srq(pd, max_wr, max_sge, limit).unwrap()
    }

    /// Writes a receive WQE into the SRQ ring and advances prod_tail.
    pub fn put_srq_recv(&self, srq: &mut GSrq, wr_id: u64, sges: &[Sge]) {
        let slot = srq.tail & (srq.cnt - 1);
        let at = srq.base + 4096 + slot as u64 * srq.stride;
        self.put(at, &RqWqeHdr { wr_id, num_sge: sges.len() as u32, total_len: 0 });
        for (i, s) in sges.iter().enumerate() {
            self.put(at + 16 + i as u64 * 16, s);
        }
        srq.tail = idx_inc(srq.tail, srq.cnt);
        self.put(srq.base + RING_STATE_RX_PROD_TAIL, &srq.tail);
    }

    pub fn post_srq_recv(&self, srq: &mut GSrq, wr_id: u64, sges: &[Sge]) {
        self.put_srq_recv(srq, wr_id, sges);
        self.doorbell(UAR_SRQ_OFFSET, UAR_SRQ_RECV | srq.handle);
    }

    /// CREATE_QP with `is_srq`, as Linux sends it for a user QP on an SRQ:
    /// no receive queue, no RQ pages.
    pub fn try_create_qp_on_srq(&mut self, pd: u32, scq: &GCq, rcq: &GCq, srq: u32, depth: u32, sge: u32) -> Result<GQp, u8> {
        let sq_stride = sq_wqe_stride(sge);
        let sq_pages = queue_pages(depth, sq_stride);
        let total = 1 + sq_pages;
        let (base, pdir) = self.region(total as u64);
        let r: CmdCreateQpRespV2 = self.cmd(CmdCreateQp {
            hdr: Self::hdr(CMD_CREATE_QP),
            pdir_dma: pdir,
            pd_handle: pd,
            send_cq_handle: scq.handle,
            recv_cq_handle: rcq.handle,
            srq_handle: srq,
            max_send_wr: depth,
            max_send_sge: sge,
            total_chunks: total as u16,
            send_chunks: sq_pages as u16,
            qp_type: ib::qp_type::RC,
            is_srq: 1,
            ..Default::default()
        })?;
        assert_eq!((r.max_recv_wr, r.max_recv_sge), (0, 0), "no receive queue of its own");
        Ok(GQp {
            handle: r.qp_handle,
            qpn: r.qpn,
            base,
            sq_cnt: depth,
            rq_cnt: 0,
            sq_stride: sq_stride as u64,
            rq_stride: 0,
            send_chunks: sq_pages,
            sq_tail: 0,
            rq_tail: 0,
        })
    }

    pub fn modify(&mut self, qp: &GQp, mask: u32, attrs: QpAttr) -> Result<(), u8> {
        self.cmd::<_, CmdRespHdr>(CmdModifyQp { hdr: Self::hdr(CMD_MODIFY_QP), qp_handle: qp.handle, attr_mask: mask, attrs }).map(|_| ())
    }

    /// RESET -> INIT -> RTR -> RTS towards (gid, qpn), as ib_modify_qp callers do.
    pub fn connect(&mut self, qp: &GQp, gid: Ipv4Addr, dqpn: u32, rq_psn: u32, sq_psn: u32) {
        use ib::qp_attr_mask as m;
        let mut a = QpAttr {
            qp_state: ib::qp_state::INIT,
            port_num: 1,
            qp_access_flags: ib::access::LOCAL_WRITE | ib::access::REMOTE_WRITE | ib::access::REMOTE_READ | ib::access::REMOTE_ATOMIC,
            ..Default::default()
        };
        self.modify(qp, m::STATE | m::PKEY_INDEX | m::PORT | m::ACCESS_FLAGS, a).unwrap();
        a.qp_state = ib::qp_state::RTR;
        a.path_mtu = ib::mtu::MTU_1024;
        a.ah_attr.grh.dgid = Gid::from_ipv4(gid.octets());
        a.dest_qp_num = dqpn;
        a.rq_psn = rq_psn;
        a.max_dest_rd_atomic = 16;
        a.min_rnr_timer = 12;
        self.modify(qp, m::STATE | m::AV | m::PATH_MTU | m::DEST_QPN | m::RQ_PSN | m::MAX_DEST_RD_ATOMIC | m::MIN_RNR_TIMER, a).unwrap();
        a.qp_state = ib::qp_state::RTS;
        a.sq_psn = sq_psn;
        a.timeout = 14;
        a.retry_cnt = 7;
        a.rnr_retry = 7;
        a.max_rd_atomic = 16;
        self.modify(qp, m::STATE | m::SQ_PSN | m::TIMEOUT | m::RETRY_CNT | m::RNR_RETRY | m::MAX_QP_RD_ATOMIC, a).unwrap();
    }

    pub fn query_qp(&mut self, qp: &GQp) -> QpAttr {
        let r: CmdQueryQpResp = self.cmd(CmdQueryQp { hdr: Self::hdr(CMD_QUERY_QP), qp_handle: qp.handle, attr_mask: 0 }).unwrap();
        r.attrs
    }

    /// Writes a send WQE into the SQ and advances prod_tail (no doorbell).
    pub fn put_send(&self, qp: &mut GQp, hdr: SqWqeHdr, sges: &[Sge]) {
        let slot = qp.sq_tail & (qp.sq_cnt - 1);
        let at = qp.base + 4096 + slot as u64 * qp.sq_stride;
        self.put(at, &SqWqeHdr { num_sge: sges.len() as u32, ..hdr });
        for (i, s) in sges.iter().enumerate() {
            self.put(at + 80 + i as u64 * 16, s);
        }
        qp.sq_tail = idx_inc(qp.sq_tail, qp.sq_cnt);
        self.put(qp.base + QP_SQ_RING_OFFSET, &qp.sq_tail);
    }

    pub fn post_send(&self, qp: &mut GQp, hdr: SqWqeHdr, sges: &[Sge]) {
        self.put_send(qp, hdr, sges);
        self.doorbell(UAR_QP_OFFSET, UAR_QP_SEND | qp.handle);
    }

    pub fn post_recv(&self, qp: &mut GQp, wr_id: u64, sges: &[Sge]) {
        self.put_recv(qp, wr_id, sges);
        self.doorbell(UAR_QP_OFFSET, UAR_QP_RECV | qp.handle);
    }

    /// Queues a receive WQE without ringing its doorbell.
    pub fn put_recv(&self, qp: &mut GQp, wr_id: u64, sges: &[Sge]) {
        let slot = qp.rq_tail & (qp.rq_cnt - 1);
        let at = qp.base + (1 + qp.send_chunks as u64) * 4096 + slot as u64 * qp.rq_stride;
        self.put(at, &RqWqeHdr { wr_id, num_sge: sges.len() as u32, total_len: 0 });
        for (i, s) in sges.iter().enumerate() {
            self.put(at + 16 + i as u64 * 16, s);
        }
        qp.rq_tail = idx_inc(qp.rq_tail, qp.rq_cnt);
        self.put(qp.base + QP_RQ_RING_OFFSET, &qp.rq_tail);
    }

    /// Polls as pvrdma_poll_cq does: read the ring, ring POLL when empty.
    pub fn poll(&self, cq: &mut GCq) -> Option<Cqe> {
        self.take(cq).or_else(|| {
            self.doorbell(UAR_CQ_OFFSET, UAR_CQ_POLL | cq.handle);
            self.take(cq)
        })
    }

    /// Takes the next completion from the guest's CQ ring without ringing
    /// anything.
    pub fn take(&self, cq: &mut GCq) -> Option<Cqe> {
        let tail: u32 = self.get(cq.base + RING_STATE_RX_PROD_TAIL);
        let slot = ring_has_data(tail, cq.head, cq.entries).ok()??;
        let cqe: Cqe = self.get(cq.base + CQ_FIRST_CQE_OFFSET + slot as u64 * 64);
        cq.head = idx_inc(cq.head, cq.entries);
        self.put(cq.base + RING_STATE_RX_CONS_HEAD, &cq.head);
        Some(cqe)
    }

    pub fn wait_cqes(&self, cq: &mut GCq, n: usize) -> Vec<Cqe> {
        let t0 = Instant::now();
        let mut out = Vec::new();
        while out.len() < n {
            match self.poll(cq) {
                Some(c) => out.push(c),
                None => {
                    assert!(t0.elapsed() < T, "timed out with {} of {n} completions: {out:?}", out.len());
                    std::thread::sleep(Duration::from_micros(100));
                }
            }
        }
        out
    }

    /// The async events the device posted since the last call.
    pub fn async_events(&self, head: &mut u32) -> Vec<Eqe> {
        let slots = event_ring_slots(EVENT_RING_PAGES, 8);
        let tail: u32 = self.get(self.async_ring + RING_STATE_RX_PROD_TAIL);
        let mut out = Vec::new();
        while let Ok(Some(slot)) = ring_has_data(tail, *head, slots) {
            out.push(self.get(self.async_ring + 4096 + slot as u64 * 8));
            *head = idx_inc(*head, slots);
        }
        self.put(self.async_ring + RING_STATE_RX_CONS_HEAD, head);
        out
    }

    pub fn query(&self) -> serde_json::Value {
        self.dev.lock().unwrap().query()
    }

    /// Writes the PCI command register's bus master enable, as the
    /// driver's `pci_set_master` / `pci_clear_master`.
    pub fn bus_master(&self, on: bool) {
        set_bus_master(&mut self.dev.lock().unwrap(), on);
    }
}

/// Memory space and bus master enable (command bits 1 and 2) as a driver
/// sets them before it touches the device.
pub fn set_bus_master(dev: &mut Pvrdma, on: bool) {
    let cmd = dev.pci_config().read_dword(1) & 0xffff;
    let cmd = if on { cmd | 0x6 } else { (cmd | 0x2) & !0x4 };
    dev.pci_config().write_dword(1, cmd);
    dev.config_written(1);
}

/// A send WQE header.
pub fn sq(wr_id: u64, opcode: u32) -> SqWqeHdr {
    SqWqeHdr { wr_id, opcode, send_flags: ib::send_flags::SIGNALED, ..Default::default() }
}

pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e3779b97f4a7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A bare-metal verbs end on a peer host.
pub struct Peer {
    pub qp: verbs::Qp,
    pub mr: verbs::Mr,
    pub cq: verbs::Cq,
    pub pd: verbs::Pd,
    pub buf: verbs::MemBuf,
    pub ctx: verbs::Context,
}

impl Peer {
    pub fn new(ctx: verbs::Context) -> Peer {
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(256, None).unwrap();
        let mut init = verbs::QpInitAttr::new(&cq, &cq);
        init.cap.max_send_wr = 64;
        init.cap.max_recv_wr = 64;
        let qp = pd.create_qp(&init).unwrap();
        let buf = verbs::MemBuf::new(4 << 20).unwrap();
        let mr = pd.reg_mr(&buf, 0, buf.len(), verbs::access::ALL).unwrap();
        Peer { qp, mr, cq, pd, buf, ctx }
    }

    pub fn connect(&self, gid: Ipv4Addr, qpn: u32, rq_psn: u32, sq_psn: u32) {
        let o = verbs::ConnectOpts { mtu: verbs::Mtu::M1024, sq_psn, ..Default::default() };
        self.qp.connect(&verbs::QpEndpoint { gid, qpn, psn: rq_psn }, &o).unwrap();
    }
}
