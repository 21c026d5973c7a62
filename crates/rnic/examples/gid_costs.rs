//! What moving a GID costs rnicd: `gid::claim` (the address added beside
//! rnicd's own and announced by gratuitous ARP) and `gid::release`, both
//! inside a migration's downtime. Each is timed N times (wall time, as
//! the downtime counts it) in a private network namespace with one veth
//! link; the median and the 90th percentile are printed in microseconds.
//!
//! `cargo run --release -p rnic --example gid_costs [N]` (default 500; as
//! root: it makes a network namespace).

use std::net::Ipv4Addr;
use std::process::Command;
use std::time::Instant;

fn ip(args: &str) {
    let ok = Command::new("ip").args(args.split_whitespace()).status().is_ok_and(|s| s.success());
    assert!(ok, "ip {args} failed");
}

fn summary(name: &str, mut us: Vec<f64>) {
    us.sort_by(f64::total_cmp);
    let at = |q: f64| us[((us.len() - 1) as f64 * q).round() as usize];
    println!("{name:<8} median {:8.1} us   p90 {:8.1} us   ({} runs)", at(0.5), at(0.9), us.len());
}

fn main() {
    let n: usize = std::env::args().nth(1).map_or(500, |a| a.parse().expect("N: a count"));
    // SAFETY: a fresh network namespace for this single-threaded process.
    if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
        panic!("unshare(CLONE_NEWNET): {} (run as root)", std::io::Error::last_os_error());
    }
    ip("link set lo up");
    ip("link add h0 type veth peer name p0");
    ip("addr add 10.77.0.1/24 dev h0");
    ip("link set h0 up");
    ip("link set p0 up");
    let (host, gid) = (Ipv4Addr::new(10, 77, 0, 1), Ipv4Addr::new(10, 77, 0, 50));
    let (mut claims, mut releases) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for _ in 0..n {
        let t = Instant::now();
        rnic::gid::claim(gid, host).expect("claim");
        claims.push(t.elapsed().as_secs_f64() * 1e6);
        assert!(rnic::gid::is_local(gid));
        let t = Instant::now();
        rnic::gid::release(gid).expect("release");
        releases.push(t.elapsed().as_secs_f64() * 1e6);
        assert!(!rnic::gid::is_local(gid));
    }
    summary("claim", claims);
    summary("release", releases);
}
