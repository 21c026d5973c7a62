// SPDX-License-Identifier: GPL-2.0-or-later
//! Interoperability with Linux's soft-RoCE: a Debian guest under QEMU (TCG)
//! runs the kernel's `rdma_rxe` on a virtio-net NIC whose tap sits in
//! testbed host 0, which routes between the tap and the testbed link; on
//! host 1, rnicd and the drop-in. rdma-core's `ibv_rc_pingpong --chk`
//! (which checks every buffer) and perftest's `ib_write_bw` run unmodified
//! on both sides, each way round: the guest as server, then as client.
//! Needs root, QEMU, Debian's linux-image-amd64, busybox, ibverbs-providers
//! (scripts/setup). QEMU, rnicd and the programs are killed and the
//! namespaces (with the tap) removed when the test ends, also on failure.

mod common;
mod rxe_guest;

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{finish, lib_dir, profile_dir, rnicd, text};
use testbed::rnicd::Rnicd;
use testbed::{Host, HostChild, Testbed, TestbedOpts};

/// The guest's link: a tap in host 0, which routes it to the testbed.
const TAP_NET: &str = "10.77.0";
const PINGPONG_ITERS: usize = 100;
const PINGPONG_SIZE: usize = 4096;
const WRITE_ITERS: usize = 100;
const WRITE_SIZE: usize = 65536;
/// TCP ports of the programs' exchanges: servers on host 1 (started before
/// the guest boots) and in the guest.
const PP_HOST_PORT: u16 = 18515;
const WB_HOST_PORT: u16 = 18516;
const PP_GUEST_PORT: u16 = 18517;
const WB_GUEST_PORT: u16 = 18518;

/// A directory removed when dropped (the per-run initramfs and console log).
struct RunDir(PathBuf);

impl Drop for RunDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A QEMU guest in a testbed host; killed when dropped.
struct Guest {
    _qemu: HostChild,
    serial: PathBuf,
}

impl Guest {
    fn boot(host: &Host, dir: &Path, kernel: &Path, initrd: &Path) -> Guest {
        let serial = dir.join("serial.log");
        let _ = std::fs::remove_file(&serial);
        let qemu = host
            .command("qemu-system-x86_64")
            .args(["-accel", "tcg", "-m", "512M", "-smp", "1", "-nographic", "-nodefaults", "-no-user-config"])
            .args(["-monitor", "none", "-no-reboot", "-serial"])
            .arg(format!("file:{}", serial.display()))
            .arg("-kernel")
            .arg(kernel)
            .arg("-initrd")
            .arg(initrd)
            .args(["-append", "console=ttyS0 quiet panic=-1"])
            // No option ROM: iPXE would only slow the boot.
            .args(["-netdev", "tap,id=n0,ifname=tap0,script=no,downscript=no"])
            .args(["-device", "virtio-net-pci,netdev=n0,romfile="])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start qemu-system-x86_64 (scripts/setup installs it)");
        Guest { _qemu: HostChild::new(qemu), serial }
    }

    fn console(&self) -> String {
        std::fs::read(&self.serial).map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default()
    }

    /// Waits for `marker` on the console; returns the rest of its line.
    fn wait(&self, marker: &str, timeout: Duration) -> String {
        let t0 = Instant::now();
        loop {
            let text = self.console();
            if let Some(i) = text.find(marker) {
                return text[i + marker.len()..].lines().next().unwrap_or("").to_string();
            }
            assert!(t0.elapsed() < timeout, "guest did not print {marker:?} in {timeout:?}; console:\n{text}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits for the guest's step `name` to end; it must have exited 0.
    fn step_ok(&self, name: &str, timeout: Duration) {
        let rc = self.wait(&format!("STEP-END {name} rc="), timeout);
        assert_eq!(rc.trim(), "0", "guest step {name} failed; console:\n{}", self.console());
    }
}

/// The guest's /init: modules, address, the rxe link, then four steps in
/// order. Its clients connect to servers already waiting on host 1.
fn init_script(guest: Ipv4Addr, gateway: Ipv4Addr, peer: Ipv4Addr) -> String {
    let o = guest.octets();
    let gid = format!("0000:0000:0000:0000:0000:ffff:{:02x}{:02x}:{:02x}{:02x}", o[0], o[1], o[2], o[3]);
    let pp = format!("ibv_rc_pingpong -d rxe0 -g $G -n {PINGPONG_ITERS} -s {PINGPONG_SIZE} --chk");
    let wb = format!("ib_write_bw -d rxe0 -x $G -F -s {WRITE_SIZE} -n {WRITE_ITERS}");
    format!(
        r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in /mods/*.ko; do insmod $m || echo "INSMOD-FAIL $m"; done
ip link set lo up; ip link set eth0 up
ip addr add {guest}/24 dev eth0; ip route add default via {gateway}
rdma link add rxe0 type rxe netdev eth0 || echo RXE-FAIL
# The RoCE v2 GID of the IPv4 address (after the link-local one).
G=
for i in 0 1 2 3 4 5 6 7; do
  [ "$(cat /sys/class/infiniband/rxe0/ports/1/gids/$i 2>/dev/null)" = "{gid}" ] && G=$i && break
done
echo "RXE-UP gid=$G"
step() {{ name=$1; shift; echo "STEP-BEGIN $name"; "$@"; echo "STEP-END $name rc=$?"; }}
step pp-server {pp} -p {PP_GUEST_PORT}
step pp-client {pp} -p {PP_HOST_PORT} {peer}
step wb-server {wb} -p {WB_GUEST_PORT}
step wb-client {wb} -p {WB_HOST_PORT} {peer}
echo ALL-DONE
poweroff -f
"#
    )
}

/// `program args` on host 1's drop-in and rnicd.
fn drop_in(host: &Host, nic: &Rnicd, program: &str, args: &[String]) -> Command {
    let mut c = host.command(program);
    c.args(args).env("LD_LIBRARY_PATH", lib_dir()).env("TRANSIT_RNICD_SOCK", &nic.sock);
    c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    c
}

/// A client on host 1 against a server in the guest, which may not listen
/// yet: it is retried while the TCP exchange cannot connect, never after.
fn client_to_guest(host: &Host, nic: &Rnicd, program: &str, args: &[String]) -> String {
    let t0 = Instant::now();
    loop {
        let out = finish(HostChild::new(drop_in(host, nic, program, args).spawn().expect("client")));
        let t = text(&out);
        if out.status.success() {
            return t;
        }
        assert!(t.contains("Couldn't connect") && t0.elapsed() < Duration::from_secs(60), "{program} {args:?} failed:\n{t}");
        std::thread::sleep(Duration::from_millis(300));
    }
}

fn args(s: &str) -> Vec<String> {
    s.split_whitespace().map(String::from).collect()
}

/// perftest's result rows ("65536  100  ...") in `out`.
fn write_bw_rows(out: &str) -> usize {
    out.lines()
        .filter(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            w.len() >= 4
                && w[0] == WRITE_SIZE.to_string()
                && w[1] == WRITE_ITERS.to_string()
                && w[3].parse::<f64>().is_ok_and(|bw| bw > 0.0)
        })
        .count()
}

#[test]
fn soft_roce_guest_and_drop_in_both_ways() {
    let t0 = Instant::now();
    let (kernel, release) = rxe_guest::kernel();
    let tb = Testbed::create(TestbedOpts::new("rxe", 2)).expect("testbed (needs root)");
    let (router, host) = (tb.host(0), tb.host(1));
    let gateway: Ipv4Addr = format!("{TAP_NET}.1").parse().unwrap();
    let guest_addr: Ipv4Addr = format!("{TAP_NET}.2").parse().unwrap();
    router
        .sh(&format!(
            "ip tuntap add tap0 mode tap && ip addr add {gateway}/24 dev tap0 && ip link set tap0 up && sysctl -qw net.ipv4.ip_forward=1"
        ))
        .expect("tap in host 0");
    host.sh(&format!("ip route add {TAP_NET}.0/24 via {}", router.addr(0))).expect("route to the guest");
    let nic = rnicd(&tb, 1, &[]);

    let pp = format!("-d rnic0 -g 0 -n {PINGPONG_ITERS} -s {PINGPONG_SIZE} --chk");
    let wb = format!("-d rnic0 -x 0 -F -s {WRITE_SIZE} -n {WRITE_ITERS}");
    let pp_server =
        HostChild::new(drop_in(host, &nic, "ibv_rc_pingpong", &args(&format!("{pp} -p {PP_HOST_PORT}"))).spawn().expect("server"));
    let wb_server = HostChild::new(drop_in(host, &nic, "ib_write_bw", &args(&format!("{wb} -p {WB_HOST_PORT}"))).spawn().expect("server"));

    let cache = profile_dir().join("rxe-guest");
    let kernel = rxe_guest::vmlinux(&kernel, &release, &cache);
    let dir = RunDir(cache.join(tb.name()));
    let initrd = rxe_guest::build_initramfs(&dir.0, &release, &init_script(guest_addr, gateway, nic.addr));
    let t_image = t0.elapsed();
    let guest = Guest::boot(router, &dir.0, &kernel, &initrd);
    let up = guest.wait("RXE-UP gid=", Duration::from_secs(180));
    assert!(!up.trim().is_empty(), "rxe0 has no GID for {guest_addr}; console:\n{}", guest.console());
    let t_boot = t0.elapsed();

    // The guest as server: host 1's clients connect to it.
    guest.wait("STEP-BEGIN pp-server", Duration::from_secs(30));
    let c = client_to_guest(host, &nic, "ibv_rc_pingpong", &args(&format!("{pp} -p {PP_GUEST_PORT} {guest_addr}")));
    // Counted both ways.
    let pp_bytes = format!("{} bytes in", 2 * PINGPONG_ITERS * PINGPONG_SIZE);
    assert!(c.contains(&pp_bytes) && c.contains(&format!("GID ::ffff:{guest_addr}")), "{c}");
    guest.step_ok("pp-server", Duration::from_secs(60));
    // The guest as client, against the server waiting since before the boot.
    guest.step_ok("pp-client", Duration::from_secs(60));
    let s = text(&finish(pp_server));
    assert!(s.contains(&pp_bytes), "{s}");
    let t_pingpong = t0.elapsed();

    guest.wait("STEP-BEGIN wb-server", Duration::from_secs(30));
    let c = client_to_guest(host, &nic, "ib_write_bw", &args(&format!("{wb} -p {WB_GUEST_PORT} {guest_addr}")));
    assert_eq!(write_bw_rows(&c), 1, "{c}");
    guest.step_ok("wb-server", Duration::from_secs(120));
    guest.step_ok("wb-client", Duration::from_secs(120));
    let s = text(&finish(wb_server));
    assert_eq!(write_bw_rows(&s), 1, "{s}");
    guest.wait("ALL-DONE", Duration::from_secs(10));

    // Both guest programs reported too: rxe checked every ping-pong buffer.
    let console = guest.console();
    assert_eq!(console.matches(&pp_bytes).count(), 2, "{console}");
    assert_eq!(write_bw_rows(&console), 2, "{console}");
    // Every packet rxe sent passed rnicd's ICRC check, whatever its IP id.
    let stats = verbs::Context::open(Some(&nic.sock)).expect("open rnicd").stats().expect("rnicd stats");
    assert_eq!(stats["rx_bad_icrc"], 0, "{stats}");
    assert!(stats["rx_packets"].as_u64().unwrap() > (WRITE_ITERS * WRITE_SIZE / 1024) as u64, "{stats}");
    eprintln!(
        "rxe: image {:.1} s, boot to rxe0 {:.1} s, ping-pong both ways {:.1} s, ib_write_bw both ways {:.1} s, total {:.1} s",
        t_image.as_secs_f64(),
        (t_boot - t_image).as_secs_f64(),
        (t_pingpong - t_boot).as_secs_f64(),
        (t0.elapsed() - t_pingpong).as_secs_f64(),
        t0.elapsed().as_secs_f64()
    );
}
