//! Helpers of the in-process engine tests: two VMs in one process, real TCP
//! on loopback, and a TCP proxy that injects faults between them.
#![allow(dead_code)]

use migration::memvm::{page_hashes, MemVm};
use migration::qmp::{handle, MigrationSlot, Outcome};
use migration::vm::MigratableVm;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub const MIB: u64 = 1 << 20;

pub struct Side {
    pub vm: Arc<MemVm>,
    pub dynvm: Arc<dyn MigratableVm>,
    pub slot: MigrationSlot,
}

impl Side {
    pub fn new(ram: u64, dirtiers: usize) -> Side {
        let vm = MemVm::new(ram, dirtiers, 16).unwrap();
        let dynvm: Arc<dyn MigratableVm> = vm.clone();
        Side { vm, dynvm, slot: MigrationSlot::default() }
    }
    /// A side for a migration over `net` (rdma: guest RAM sealed, as rnicd
    /// registers only sealed memfds).
    pub fn on(net: &Net, ram: u64, dirtiers: usize) -> Side {
        let s = Side::new(ram, dirtiers);
        if let Net::Rdma(_) = net {
            s.vm.ram_pages().seal().unwrap();
        }
        s
    }
    pub fn cmd(&self, c: &str, a: Value) -> Result<Value, migration::qmp::QmpError> {
        handle(&self.dynvm, &self.slot, c, &a)
    }
    /// Start receiving on an ephemeral loopback port; returns the port.
    pub fn incoming(&self, resume: bool) -> u16 {
        let r = self.cmd("migrate-incoming", json!({"uri": "tcp:127.0.0.1:0", "resume": resume})).unwrap();
        r["port"].as_u64().unwrap() as u16
    }
    /// Listen with `prealloc` (or not), and once preallocated, wait until
    /// the memfd holds every page: the migration then meets a full memfd.
    pub fn incoming_with(&self, resume: bool, prealloc: bool) -> u16 {
        self.incoming_on(&Net::Tcp, resume, prealloc)
    }
    /// [`incoming_with`](Self::incoming_with), for a source that uses `net`.
    pub fn incoming_on(&self, net: &Net, resume: bool, prealloc: bool) -> u16 {
        let args = net.incoming_args(json!({"uri": "tcp:127.0.0.1:0", "resume": resume, "prealloc": prealloc}));
        let r = self.cmd("migrate-incoming", args).unwrap();
        if prealloc {
            let ram = self.dynvm.ram();
            wait_until("the prealloc", || {
                let mut st: libc::stat = unsafe { std::mem::zeroed() };
                let ok = unsafe { libc::fstat(ram.memfd, &mut st) } == 0;
                ok && st.st_blocks as u64 * 512 >= ram.len
            });
        }
        r["port"].as_u64().unwrap() as u16
    }
    pub fn hashes(&self) -> Vec<u64> {
        page_hashes(&self.dynvm.ram())
    }
}

/// Run source -> destination and wait for both ends.
pub fn migrate(src: &Side, dst: &Side, port: u16, params: Value) -> (Option<Outcome>, Option<Outcome>, Value) {
    migrate_on(&Net::Tcp, src, dst, port, params)
}

/// [`migrate`] over `net`.
pub fn migrate_on(net: &Net, src: &Side, dst: &Side, port: u16, params: Value) -> (Option<Outcome>, Option<Outcome>, Value) {
    migrate_on_while(net, src, dst, port, params, |_| {})
}

/// [`migrate_on`], calling `while_running` on the source once the
/// migration has started.
pub fn migrate_on_while(
    net: &Net,
    src: &Side,
    dst: &Side,
    port: u16,
    params: Value,
    while_running: impl FnOnce(&Side),
) -> (Option<Outcome>, Option<Outcome>, Value) {
    src.cmd("migrate", net.migrate_args(port, params)).unwrap();
    while_running(src);
    let o_src = src.slot.wait();
    let o_dst = dst.slot.wait();
    let stats = src.cmd("query-migrate", json!({})).unwrap();
    (o_src, o_dst, stats)
}

/// Let the VM run for `d`, then pause it and check the dirtier oracle.
pub fn run_and_check_oracle(vm: &MemVm, d: Duration) {
    let before = vm.progress();
    vm.resume().unwrap();
    let t = Instant::now();
    while t.elapsed() < d || vm.progress() == before {
        std::thread::sleep(Duration::from_millis(20));
        assert!(t.elapsed() < Duration::from_secs(60), "the dirtier makes no progress");
    }
    vm.pause().unwrap();
    vm.check_oracle().unwrap();
}

/// Every dirtier has written each page of its slice at least once (its
/// first page holds its pass count, 2 once the second pass began): RAM is
/// all data, none of it memfd holes.
pub fn whole_pass_done(vm: &Side) -> bool {
    vm.vm.slices().iter().all(|&(first, _)| vm.vm.ram_pages().page(first)[0] >= 2)
}

pub fn wait_until(what: &str, f: impl Fn() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(60), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[derive(Clone, Copy, Default)]
pub struct Fault {
    /// Which accepted connection (0 = control, 1.. = data) to damage.
    pub conn: usize,
    /// Flip one bit of the byte at this offset of the source->dest bytes.
    pub flip_at: Option<u64>,
    /// Close both directions after this many source->dest bytes.
    pub cut_after: Option<u64>,
    /// Stop forwarding (and reading) after this many source->dest bytes,
    /// the connection left open: a destination or link that hangs.
    pub stall_after: Option<u64>,
}

/// A TCP proxy in front of `target` that injects one fault.
pub struct Proxy {
    pub port: u16,
    stop: Arc<AtomicBool>,
    pub fired: Arc<AtomicBool>,
    conns: Arc<std::sync::Mutex<Vec<TcpStream>>>,
}

impl Proxy {
    pub fn start(target: u16, fault: Fault) -> Proxy {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let stop = Arc::new(AtomicBool::new(false));
        let fired = Arc::new(AtomicBool::new(false));
        let (st, fi) = (stop.clone(), fired.clone());
        let conns = Arc::new(std::sync::Mutex::new(Vec::new()));
        let conns2 = conns.clone();
        l.set_nonblocking(true).unwrap();
        std::thread::spawn(move || {
            let n = AtomicUsize::new(0);
            while !st.load(Ordering::SeqCst) {
                let Ok((c, _)) = l.accept() else {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                };
                c.set_nonblocking(false).unwrap();
                let i = n.fetch_add(1, Ordering::SeqCst);
                let Ok(s) = TcpStream::connect(("127.0.0.1", target)) else { continue };
                conns2.lock().unwrap().extend([c.try_clone().unwrap(), s.try_clone().unwrap()]);
                let f = if i == fault.conn { fault } else { Fault::default() };
                let (c2, s2) = (c.try_clone().unwrap(), s.try_clone().unwrap());
                let fi2 = fi.clone();
                std::thread::spawn(move || pump(c, s, f, fi2));
                std::thread::spawn(move || pump(s2, c2, Fault::default(), Arc::new(AtomicBool::new(false))));
            }
        });
        Proxy { port, stop, fired, conns }
    }

    /// Break every connection made so far (as a link going down would);
    /// new connections still pass.
    pub fn cut_all(&self) {
        for c in self.conns.lock().unwrap().drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

fn pump(mut from: TcpStream, mut to: TcpStream, f: Fault, fired: Arc<AtomicBool>) {
    let mut buf = vec![0u8; 64 << 10];
    let mut off = 0u64;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Some(at) = f.flip_at {
            if at >= off && at < off + n as u64 {
                buf[(at - off) as usize] ^= 0x20;
                fired.store(true, Ordering::SeqCst);
            }
        }
        if let Some(cut) = f.cut_after {
            if off + n as u64 > cut {
                fired.store(true, Ordering::SeqCst);
                break;
            }
        }
        if f.stall_after.is_some_and(|s| off + n as u64 > s) {
            fired.store(true, Ordering::SeqCst);
            // Long enough for any test that uses it; the sockets stay open.
            std::thread::sleep(Duration::from_secs(60));
            break;
        }
        off += n as u64;
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}

/// How pages travel in a test: TCP on loopback, or the rdma transport
/// between the real rnicds of two testbed hosts (the vmm side of each rnicd
/// is this process: its control socket is a path; the control connection
/// stays on loopback, only the queue pairs cross the testbed's link).
pub enum Net {
    Tcp,
    Rdma(RdmaBed),
}

impl Net {
    /// Both transports, each test body runs once over each. The testbed
    /// and its rnicds start only for the rdma run: they take CPU that a
    /// tcp run's timing-sensitive guest would miss.
    pub fn each(name: &str) -> impl Iterator<Item = Net> + '_ {
        (0..2).map(move |i| if i == 0 { Net::Tcp } else { Net::Rdma(RdmaBed::new(name)) })
    }
    pub fn name(&self) -> &'static str {
        match self {
            Net::Tcp => "tcp",
            Net::Rdma(_) => "rdma",
        }
    }
    /// `migrate`'s arguments to a destination listening on `port` (or a
    /// proxy in front of it), with `extra`.
    pub fn migrate_args(&self, port: u16, extra: Value) -> Value {
        let mut a = extra;
        a["uri"] = json!(format!("{}:127.0.0.1:{port}", self.name()));
        if let Net::Rdma(b) = self {
            a["rnicd"] = json!(b.socket(0));
        }
        a
    }
    /// What `migrate-incoming` needs beside its address.
    pub fn incoming_args(&self, mut a: Value) -> Value {
        if let Net::Rdma(b) = self {
            a["rnicd"] = json!(b.socket(1));
        }
        a
    }
}

/// Two testbed hosts, an rnicd on each. Fields drop in order: the rnicds
/// before the testbed.
pub struct RdmaBed {
    nics: Vec<migrate_transit::Rnicd>,
    pub tb: testbed::Testbed,
}

impl RdmaBed {
    pub fn new(name: &str) -> RdmaBed {
        let bin = migrate_transit::transit_bin().expect("building transit");
        let tb = testbed::Testbed::create(testbed::TestbedOpts::new(name, 2)).unwrap();
        let nics = (0..2).map(|i| migrate_transit::Rnicd::start(&bin, &tb, i, &[]).expect("start rnicd")).collect();
        RdmaBed { nics, tb }
    }
    /// rnicd's control socket on host `i`.
    pub fn socket(&self, i: usize) -> String {
        self.nics[i].socket().to_string_lossy().into_owned()
    }
}
