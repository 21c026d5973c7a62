//! With TRANSIT_VERBS_AVOID_RNICD_CPU=1, a thread that posts to a QP
//! moves off the CPU its rnicd runs on, and keeps its affinity mask
//! (crates/verbs/src/placement.rs).
mod common;

use std::time::{Duration, Instant};

use verbs::placement::{current_cpu, last_cpu};
use verbs::*;

fn set_affinity(pid: i32, cpus: &[usize]) {
    // SAFETY: cpu_set_t is plain data, filled with CPU_SET; a valid size and pointer.
    unsafe {
        let mut m: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus {
            libc::CPU_SET(c, &mut m);
        }
        assert_eq!(libc::sched_setaffinity(pid, std::mem::size_of::<libc::cpu_set_t>(), &m), 0, "sched_setaffinity({pid}, {cpus:?})");
    }
}

fn affinity() -> Vec<usize> {
    // SAFETY: as above; pid 0 is the calling thread.
    unsafe {
        let mut m: libc::cpu_set_t = std::mem::zeroed();
        assert_eq!(libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut m), 0);
        (0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &m)).collect()
    }
}

/// Puts the calling thread on `cpu` with `mask` (holding `cpu`) as its affinity.
fn run_on(cpu: usize, mask: &[usize]) {
    set_affinity(0, &[cpu]);
    set_affinity(0, mask);
    assert_eq!(current_cpu(), Some(cpu));
}

#[test]
fn a_posting_thread_moves_off_its_rnicds_cpu() {
    let mine = affinity();
    if mine.len() < 2 {
        eprintln!("skipped: this thread may run on one CPU only ({mine:?})");
        return;
    }
    let (cpu, other) = (mine[0], mine[1]);
    let bed = common::Bed::new("vplace", 1);
    let sock = &bed.nics[0].sock;
    assert_eq!(bed.tb.hosts().len(), 1);
    // Read when a context opens; this test is alone in its binary.
    std::env::set_var("TRANSIT_VERBS_AVOID_RNICD_CPU", "1");
    let rnicd = bed.nics[0].pid().expect("rnicd runs") as i32;
    // rnicd's event loop (its main thread) on `cpu` alone.
    set_affinity(rnicd, &[cpu]);

    let ctx = Context::open(Some(sock)).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64, None).unwrap();
    let (qa, qb) = (pd.create_qp(&QpInitAttr::new(&cq, &cq)).unwrap(), pd.create_qp(&QpInitAttr::new(&cq, &cq)).unwrap());
    let buf = MemBuf::new(1 << 16).unwrap();
    let mr = pd.reg_mr(&buf, 0, buf.len(), access::ALL).unwrap();
    let o = ConnectOpts { mtu: Mtu::M1024, ..Default::default() };
    qa.connect(&qb.endpoint(100), &ConnectOpts { sq_psn: 200, ..o }).unwrap();
    qb.connect(&qa.endpoint(200), &ConnectOpts { sq_psn: 100, ..o }).unwrap();
    // The control calls above ran rnicd; wait until it shows on `cpu`.
    let t0 = Instant::now();
    while last_cpu(&std::fs::read(format!("/proc/{rnicd}/stat")).unwrap()) != Some(cpu) {
        assert!(t0.elapsed() < Duration::from_secs(5), "rnicd never ran on CPU {cpu}");
        ctx.query_port(1).unwrap();
    }

    // On rnicd's CPU with another allowed: the post moves the thread there,
    // and the mask stays as it was.
    // Posts a WRITE; returns the CPU the thread is on right after the post
    // (waiting for the completion may move it again).
    let write = |id| {
        qa.post_send(&[SendWr::write(id, &[mr.sge(0, 64)], mr.addr + 4096, mr.rkey)]).unwrap();
        let after = current_cpu();
        let wc = cq.wait(1, Duration::from_secs(10)).unwrap();
        assert_eq!(wc[0].status, WcStatus::Success, "{wc:?}");
        after
    };
    run_on(cpu, &[cpu, other]);
    assert_ne!(write(1), Some(cpu), "the posting thread stayed on rnicd's CPU");
    assert_eq!(affinity(), vec![cpu, other], "the thread's affinity changed");

    // A thread that may run on rnicd's CPU only stays there.
    std::thread::scope(|s| {
        s.spawn(|| {
            run_on(cpu, &[cpu]);
            assert_eq!(write(2), Some(cpu));
            assert_eq!(affinity(), vec![cpu]);
        });
    });
    set_affinity(0, &mine);
}
