// SPDX-License-Identifier: GPL-2.0-or-later
//! Shared receive queues on the drop-in: rdma-core's unmodified
//! ibv_srq_pingpong between two testbed hosts (each with a real rnicd), and
//! a C program built against the system's <infiniband/verbs.h> that checks
//! the SRQ verbs, the limit event and the errors of bad calls.
//! Needs root (network namespaces) and scripts/setup's packages.

mod common;

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{finish, lib_dir, CCheck, Nic};
use testbed::{HostChild, Testbed, TestbedOpts};

/// Hosts with an rnicd each; rnicds stop before the testbed goes.
struct Bed {
    nics: Vec<Nic>,
    tb: Testbed,
}

impl Bed {
    fn new(prefix: &str, hosts: usize) -> Bed {
        let tb = Testbed::create(TestbedOpts::new(prefix, hosts)).expect("testbed (needs root)");
        let nics = (0..hosts).map(|i| Nic::start(&tb, i)).collect();
        Bed { nics, tb }
    }

    /// `program args` in host `i`, on the drop-in and that host's rnicd.
    fn command(&self, i: usize, program: &str, args: &[&str]) -> Command {
        let mut c = self.tb.host(i).command(program);
        c.args(args);
        c.env("LD_LIBRARY_PATH", lib_dir()).env("TRANSIT_RNICD_SOCK", &self.nics[i].sock);
        c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        c
    }

    fn run(&self, i: usize, program: &str, args: &[&str]) -> Output {
        finish(HostChild::new(self.command(i, program, args).spawn().expect("run program")))
    }

    fn wait_listen(&self, i: usize, port: u16, server: &mut HostChild) {
        let t0 = Instant::now();
        loop {
            let out = self.tb.host(i).sh(&format!("ss -Hltn 'sport = :{port}'")).unwrap_or_default();
            if !out.trim().is_empty() {
                return;
            }
            if let Some(st) = server.try_wait().unwrap() {
                panic!("server exited before listening: {st}");
            }
            assert!(t0.elapsed() < Duration::from_secs(30), "server never listened on {port}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn text(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr)
}

#[test]
fn srq_pingpong_between_hosts() {
    let bed = Bed::new("ibvsrq", 2);
    // 16 QPs share each side's SRQ; --chk verifies every buffer. Polling,
    // then completion events.
    for extra in [&[][..], &["-e"][..]] {
        let mut args = vec!["-d", "rnic0", "-g", "0", "-q", "16", "-n", "200", "-s", "4096", "-c"];
        args.extend_from_slice(extra);
        let mut server = HostChild::new(bed.command(0, "ibv_srq_pingpong", &args).spawn().expect("server"));
        bed.wait_listen(0, 18515, &mut server);
        let addr = bed.nics[0].addr.to_string();
        let mut cargs = args.clone();
        cargs.push(&addr);
        let client = bed.run(1, "ibv_srq_pingpong", &cargs);
        let server = finish(server);
        let (s, c) = (text(&server), text(&client));
        assert!(server.status.success() && client.status.success(), "{extra:?}\n--- server\n{s}\n--- client\n{c}");
        for out in [&s, &c] {
            // 200 exchanges of 4096 bytes each way (spread over the 16 QPs).
            assert!(out.contains("1638400 bytes in") && out.contains("200 iters in"), "{extra:?}:\n{out}");
        }
    }
}

#[test]
fn c_program_srq_verbs_and_bad_calls() {
    let bed = Bed::new("ibvsrqc", 1);
    let exe = CCheck::build("srq_check");
    let out = bed.run(0, exe.path(), &[]);
    let t = text(&out);
    assert!(out.status.success() && t.contains("all ok"), "{t}");
}
