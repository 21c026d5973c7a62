//! Test harness: a testbed of hosts, each running a real rnicd process, and
//! connected QP pairs driven through the verbs API from this test process
//! (control sockets are files, so the test reaches every host's rnicd).
#![allow(dead_code)]

pub mod direct;

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use testbed::rnicd::Rnicd;
use testbed::{Testbed, TestbedOpts};
use verbs::*;

/// Fields drop in order: rnicd processes first, then the testbed.
pub struct Bed {
    pub nics: Vec<Rnicd>,
    pub tb: Testbed,
}

impl Bed {
    /// Packets the kernel dropped on the way between the two hosts: the rate
    /// limiter's queues on host 1's link (its egress, and the fabric's towards
    /// it), the interfaces of both hosts and of the fabric (errors and drops,
    /// both directions), the CPUs' backlogs that a veth hands packets to
    /// (`netdev_max_backlog`, overflowing while a loaded host defers its
    /// receive processing; counted for the whole machine) and the UDP
    /// sockets' receive buffers of both hosts. A loss the stream did not ask
    /// for, but a loss.
    pub fn kernel_drops(&self) -> u64 {
        let tbf = |ns: &str, dev: &str| -> u64 {
            let out =
                std::process::Command::new("ip").args(["netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", dev]).output().unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            text.split("dropped ").skip(1).filter_map(|t| t.split(',').next()?.trim().parse::<u64>().ok()).sum()
        };
        let udp = |h: usize| -> u64 {
            let snmp = self.tb.host(h).sh("cat /proc/net/snmp").unwrap();
            let rows: Vec<Vec<&str>> = snmp.lines().filter(|l| l.starts_with("Udp:")).map(|l| l.split_whitespace().collect()).collect();
            let (names, values) = (&rows[0], &rows[1]);
            ["InErrors", "RcvbufErrors"].iter().map(|k| values[names.iter().position(|n| n == k).unwrap()].parse::<u64>().unwrap()).sum()
        };
        let backlog: u64 = std::fs::read_to_string("/proc/net/softnet_stat")
            .unwrap()
            .lines()
            .filter_map(|l| u64::from_str_radix(l.split_whitespace().nth(1)?, 16).ok())
            .sum();
        // /proc/net/dev of a namespace: per interface, receive errs and drop
        // (fields 3 and 4 after the name), transmit errs and drop (11 and 12).
        let dev = |ns: &str| -> u64 {
            let out = std::process::Command::new("ip").args(["netns", "exec", ns, "cat", "/proc/net/dev"]).output().unwrap();
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter_map(|l| l.split_once(':'))
                .map(|(_, v)| {
                    let f: Vec<u64> = v.split_whitespace().filter_map(|x| x.parse().ok()).collect();
                    [2, 3, 10, 11].iter().filter_map(|&i| f.get(i)).sum::<u64>()
                })
                .sum()
        };
        let links = dev(&self.tb.fabric()) + dev(self.tb.host(0).name()) + dev(self.tb.host(1).name());
        tbf(&self.tb.fabric(), "h1e0") + tbf(self.tb.host(1).name(), "eth0") + links + backlog + udp(0) + udp(1)
    }

    pub fn new(prefix: &str, hosts: usize) -> Bed {
        Bed::with_args(prefix, hosts, &[])
    }

    /// With extra rnicd arguments (e.g. `--no-gso`).
    pub fn with_args(prefix: &str, hosts: usize, extra: &[&str]) -> Bed {
        let tb = Testbed::create(TestbedOpts::new(prefix, hosts)).expect("testbed (needs root)");
        Bed::start(tb, extra)
    }

    /// With every link (both veth ends of each host, and the bridge) at
    /// `mtu`, set before rnicd starts (it reads its interface's MTU).
    pub fn with_link_mtu(prefix: &str, hosts: usize, mtu: u32, extra: &[&str]) -> Bed {
        let tb = Testbed::create(TestbedOpts::new(prefix, hosts)).expect("testbed (needs root)");
        let fab = tb.fabric();
        let ip = |args: &[&str]| {
            let st = std::process::Command::new("ip").args(args).status().expect("ip");
            assert!(st.success(), "ip {args:?}");
        };
        for h in tb.hosts() {
            ip(&["-n", &fab, "link", "set", &format!("h{}e0", h.index()), "mtu", &mtu.to_string()]);
            ip(&["-n", h.name(), "link", "set", "eth0", "mtu", &mtu.to_string()]);
        }
        ip(&["-n", &fab, "link", "set", "br0", "mtu", &mtu.to_string()]);
        Bed::start(tb, extra)
    }

    fn start(tb: Testbed, extra: &[&str]) -> Bed {
        Bed::start_under(tb, &[], extra)
    }

    /// With each rnicd run by `wrapper` (a program and its arguments that
    /// runs the command after them, e.g. `prlimit --nofile=N:N --`).
    pub fn under(prefix: &str, hosts: usize, wrapper: &[&str], extra: &[&str]) -> Bed {
        let tb = Testbed::create(TestbedOpts::new(prefix, hosts)).expect("testbed (needs root)");
        Bed::start_under(tb, wrapper, extra)
    }

    fn start_under(tb: Testbed, wrapper: &[&str], extra: &[&str]) -> Bed {
        let bin = rnicd_bin();
        let cmd: Vec<&str> = wrapper.iter().copied().chain([bin.as_str()]).collect();
        let nics = (0..tb.hosts().len()).map(|i| Rnicd::start_cmd(&tb, i, &cmd, None, extra).expect("start rnicd")).collect();
        Bed { nics, tb }
    }

    pub fn ctx(&self, i: usize) -> Context {
        Context::open(Some(&self.nics[i].sock)).expect("open rnicd")
    }

    /// Kills host i's rnicd (the peer "vanishes").
    pub fn kill(&mut self, i: usize) {
        self.nics[i].kill();
    }
}

/// The rnicd to run: this build's, or `RNICD_BIN` (A/B runs against
/// another build, e.g. `bench/rdma/cap-ab`).
fn rnicd_bin() -> String {
    std::env::var("RNICD_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_rnicd").to_string())
}

/// A consistent state of an RTS QP talking to `dest_gid` (what a
/// migration's switch loads), with requests out and unacknowledged.
pub fn rts_state(qpn: u32, dest_gid: Ipv4Addr) -> QpSnapshot {
    let attr = QpAttr { qp_state: QpState::Rts, dest_gid, dest_qp_num: 0x77, path_mtu: Mtu::M1024, ..Default::default() };
    let runtime = QpRuntime { next_psn: 90, una: 95, tx_psn: 95, max_sent: 100, epsn: 5, ..Default::default() };
    QpSnapshot { version: QP_SNAPSHOT_VERSION, qpn, attr, runtime }
}

/// One end of a connection: its own PD, CQs, QP and a registered buffer.
pub struct End {
    pub qp: Qp,
    pub mr: Mr,
    pub scq: Cq,
    pub rcq: Cq,
    pub pd: Pd,
    pub buf: MemBuf,
    pub ctx: Context,
}

pub const BUF: usize = 8 << 20;

impl End {
    pub fn new(ctx: Context, buf_len: usize, depth: u32) -> End {
        let pd = ctx.alloc_pd().unwrap();
        let scq = ctx.create_cq(depth * 2, None).unwrap();
        let rcq = ctx.create_cq(depth * 2, None).unwrap();
        let mut init = QpInitAttr::new(&scq, &rcq);
        init.cap.max_send_wr = depth;
        init.cap.max_recv_wr = depth;
        init.cap.max_send_sge = 8;
        init.cap.max_recv_sge = 8;
        init.cap.max_inline_data = 256;
        let qp = pd.create_qp(&init).unwrap();
        let buf = MemBuf::new(buf_len).unwrap();
        let mr = pd.reg_mr(&buf, 0, buf.len(), access::ALL).unwrap();
        End { qp, mr, scq, rcq, pd, buf, ctx }
    }
}

/// Two connected ends on hosts a and b.
pub fn pair(bed: &Bed, a: usize, b: usize, o: ConnectOpts) -> (End, End) {
    pair_sized(bed, a, b, o, BUF, 256)
}

pub fn pair_sized(bed: &Bed, a: usize, b: usize, o: ConnectOpts, buf: usize, depth: u32) -> (End, End) {
    let ea = End::new(bed.ctx(a), buf, depth);
    let eb = End::new(bed.ctx(b), buf, depth);
    ea.qp.connect(&eb.qp.endpoint(0x10_0000), &ConnectOpts { sq_psn: 0xff_fff0, ..o }).unwrap();
    eb.qp.connect(&ea.qp.endpoint(0xff_fff0), &ConnectOpts { sq_psn: 0x10_0000, ..o }).unwrap();
    (ea, eb)
}

pub const T: Duration = Duration::from_secs(60);

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

/// Waits until `count` reads `want` (a hang guard of `T`): what a host
/// counts on receipt lags the sender's completion.
pub fn reaches(count: impl Fn() -> u64, want: u64, what: &str) {
    let t = Instant::now();
    while count() != want {
        assert!(t.elapsed() < T, "{what}: {} after {T:?}, not {want}", count());
        std::thread::sleep(Duration::from_millis(5));
    }
}

pub fn one(cq: &Cq) -> Wc {
    cq.wait(1, T).unwrap()[0]
}

pub fn ok(cq: &Cq) -> Wc {
    let w = one(cq);
    assert_eq!(w.status, WcStatus::Success, "{w:?}");
    w
}

/// ICRC of a captured IPv4/UDP/RoCE packet per the RoCEv2 annex, from the wire bytes.
pub fn wire_icrc_ok(ip: &[u8]) -> bool {
    let ihl = (ip[0] & 15) as usize * 4;
    let total = u16::from_be_bytes([ip[2], ip[3]]) as usize;
    let pkt = &ip[..total];
    let mut hdr = pkt[..ihl + 8 + 12].to_vec();
    hdr[1] = 0xff; // TOS
    hdr[8] = 0xff; // TTL
    hdr[10] = 0xff; // IP checksum
    hdr[11] = 0xff;
    hdr[ihl + 6] = 0xff; // UDP checksum
    hdr[ihl + 7] = 0xff;
    hdr[ihl + 8 + 4] = 0xff; // BTH resv8a
    let mut h = crc32fast::Hasher::new();
    h.update(&[0xff; 8]);
    h.update(&hdr);
    h.update(&pkt[ihl + 8 + 12..total - 4]);
    h.finalize().to_le_bytes() == pkt[total - 4..total]
}

/// tshark capturing RoCE (UDP 4791) on host `h`'s eth0 into a pcap file,
/// started and writing before `start` returns. `stop` ends it (SIGINT, so
/// the file is complete) and returns the file's bytes; the file goes away
/// with the value.
pub struct Capture {
    child: std::process::Child,
    pub path: PathBuf,
}

impl Capture {
    pub fn start(bed: &Bed, h: usize) -> Capture {
        let path = std::env::temp_dir().join(format!("{}.pcap", bed.tb.name()));
        let _ = std::fs::remove_file(&path);
        let child = bed
            .tb
            .host(h)
            .command("tshark")
            .args(["-i", "eth0", "-f", "udp port 4791", "-F", "pcap", "-w"])
            .arg(&path)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("tshark");
        let t0 = Instant::now();
        while std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0) < 24 {
            assert!(t0.elapsed() < Duration::from_secs(20), "tshark did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        std::thread::sleep(Duration::from_millis(500));
        Capture { child, path }
    }

    pub fn stop(&mut self) -> Vec<u8> {
        // SAFETY: a signal to our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let _ = self.child.wait();
        std::fs::read(&self.path).unwrap_or_default()
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.path);
    }
}
