//! One live migration of the PVRDMA VM between testbed hosts, in any mode,
//! and the checks after it: shared by `pvrdma_migrate` and
//! `pvrdma_postcopy`, which parametrise their test bodies over [`Mode`].

use super::*;
use serde_json::{json, Value};
use std::net::Ipv4Addr;
use std::time::Duration;
use vmm::testing::VmProcess;

/// How a migration moves the VM's pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Precopy,
    Postcopy,
    Hybrid,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Precopy => "precopy",
            Mode::Postcopy => "postcopy",
            Mode::Hybrid => "hybrid",
        }
    }

    /// Whether the VM runs on the destination before its pages are in.
    pub fn switches(self) -> bool {
        self != Mode::Precopy
    }
}

/// What runs in the VM: firmware arguments, RAM, and the migration's rate
/// limit (0: none; postcopy needs one for the workloads to run on missing
/// pages for a while).
#[derive(Clone, Copy)]
pub struct Load {
    pub args: &'static str,
    pub memory: &'static str,
    pub max_bandwidth: u64,
}

/// Every workload on one QP each.
pub const PLAIN: Load = Load { args: "count=0", memory: "64M", max_bandwidth: 0 };

/// The `migrate` parameters of a hop in `mode`.
pub fn params(mode: Mode, load: &Load) -> Value {
    let mut p = json!({"mode": mode.name(), "channels": 2});
    if mode.switches() {
        // A downtime target of 0 never fits: hybrid switches to postcopy
        // after its first pass instead of finishing in precopy.
        p["downtime_ms"] = json!(0);
    }
    if load.max_bandwidth > 0 {
        p["max_bandwidth"] = json!(load.max_bandwidth);
    }
    p
}

/// A destination for `gid` on host `h`, waiting for the migration;
/// `pvrdma` adds to its device spec.
pub fn destination(bed: &Bed, h: usize, gid: Ipv4Addr, load: &Load, pvrdma: &str) -> VmProcess {
    bed.vm_sized(h, gid, load.memory, load.args, pvrdma, &["--incoming", "tcp:0.0.0.0:4444", "--keep-after-migrate"])
}

pub fn start_migration(bed: &Bed, src: &VmProcess, to: usize, params: Value) {
    let mut a = params;
    a["uri"] = json!(format!("tcp:{}:4444", bed.tb.host(to).addr(0)));
    src.exec("migrate", a).unwrap();
}

/// Starts a precopy of the VM on `src` to host `to` that goes on with its
/// rounds until the source's device has traced writes into guest RAM (the
/// peer's, and the replies to the guest's own READs and atomics), then
/// lets it finish: [`check_hop`]'s `traced` then checks what tracing
/// saw, not whether a loaded machine let the peer write within a few
/// rounds. It is held by a downtime target of 0 (the device state alone
/// never fits), without auto-converge (the guest runs at full speed), and
/// released by setting the default target of 300 ms, which applies to
/// the running migration from its next round on.
pub fn start_traced_precopy(bed: &Bed, src: &VmProcess, to: usize, load: &Load) {
    let mut p = params(Mode::Precopy, load);
    p["downtime_ms"] = json!(0);
    p["auto_converge"] = json!(false);
    start_migration(bed, src, to, p);
    wait_for("the peer's writes traced during the rounds", LONG, || {
        let st = migration(src);
        assert!(matches!(st["status"].as_str(), Some("setup" | "active")), "a precopy held in its rounds ended: {st:#}");
        let d = pvrdma(src);
        d["tracing"] == true && d["counters"]["traced_pages"].as_u64().unwrap_or(0) > 0
    });
    src.exec("migrate-set-parameters", json!({"downtime_ms": 300})).unwrap();
}

/// The outgoing migration's last status once it ended.
pub fn wait_end(src: &VmProcess) -> Value {
    let mut last = Value::Null;
    wait_for("the migration to end", LONG, || {
        last = migration(src);
        matches!(last["status"].as_str(), Some("completed" | "failed" | "cancelled"))
    });
    last
}

/// The source's status once the VM runs on the destination: the end of a
/// precopy, the switch of a postcopy or hybrid.
pub fn wait_switched(src: &VmProcess) -> Value {
    let mut last = Value::Null;
    wait_for("the switch", LONG, || {
        last = migration(src);
        matches!(last["status"].as_str(), Some("postcopy-active" | "postcopy-paused" | "completed" | "failed" | "cancelled"))
    });
    last
}

/// After `start_migration`: waits for it to complete and for the
/// destination to run; checks what its mode promises. The source's final
/// report.
pub fn finish_hop(src: &VmProcess, dst: &VmProcess, mode: Mode) -> Value {
    let st = wait_end(src);
    assert_eq!(st["status"], "completed", "{st:#}\nsource console:\n{}", src.console());
    assert_eq!(st["mode"], mode.name(), "{st:#}");
    if mode.switches() {
        assert!(st["postcopy_ms"].as_f64().unwrap() > 0.0, "the VM ran on the destination before all pages were in: {st:#}");
        // The destination's rnicd served its faults as a RAM client, and
        // the destination reported what they cost rnicd apart from the
        // vmm's own (every fault is one or the other's).
        assert_eq!(st["ram_clients"], 1, "{st:#}");
        let waits = st["fault_waits"].as_array().expect("fault_waits");
        let names: Vec<&str> = waits.iter().map(|w| w["name"].as_str().unwrap()).collect();
        assert_eq!(names, ["vmm", "rnicd"], "{st:#}");
        let faults: u64 = waits.iter().map(|w| w["faults"].as_u64().unwrap()).sum();
        assert!(faults >= st["faults"].as_u64().unwrap(), "{st:#}");
        // The device's rings and regions crossed in the switch: neither
        // the vmm nor rnicd waited for one of them once the VM ran, unless
        // some were left to the push (beyond the switch's share: a 64 MiB
        // region).
        let d = migration(dst);
        let dev = &d["device_pages"];
        assert!(dev["named"].as_u64().unwrap() > 0, "{d:#}");
        if dev["after_resume"] == 0 {
            for w in waits {
                assert_eq!(w["device_faults"], 0, "{} faulted on a device page: {st:#}\n{d:#}", w["name"]);
            }
        }
    }
    wait_for("the destination to run", LONG, || dst.status().unwrap()["running"] == true);
    eprintln!(
        "hop ({}): downtime {} ms, total {} ms, postcopy {} ms, faults {}, per process {}, the device's pages {}",
        mode.name(),
        st["downtime_ms"],
        st["total_ms"],
        st["postcopy_ms"],
        st["faults"],
        st["fault_waits"],
        migration(dst)["device_pages"]
    );
    st
}

/// Moves the VM from `src` to a new destination on host `to` in `mode`;
/// the destination and the source's final report. The source stays up
/// (`--keep-after-migrate`) for [`check_hop`].
pub fn hop(bed: &Bed, src: &VmProcess, to: usize, gid: Ipv4Addr, load: &Load, mode: Mode) -> (VmProcess, Value) {
    let dst = destination(bed, to, gid, load, "");
    match mode {
        Mode::Precopy => start_traced_precopy(bed, src, to, load),
        _ => start_migration(bed, src, to, params(mode, load)),
    }
    let st = finish_hop(src, &dst, mode);
    (dst, st)
}

/// After a hop: the destination holds the GID, the source does not, the
/// source's device (`traced`: a precopy started by
/// [`start_traced_precopy`] while the peer could reach it) traced the
/// peer's writes during the rounds, and it holds no objects any
/// more; the destination's QPs run. The source quits.
pub fn check_hop(bed: &Bed, src: &mut VmProcess, dst: &VmProcess, (from, to): (usize, usize), gid: Ipv4Addr, traced: bool) {
    assert!(bed.holds(to, gid) && !bed.holds(from, gid), "the GID must be on host {to} only");
    let d = pvrdma(src);
    eprintln!("source device after the hop: {}", d["counters"]);
    assert!(!traced || d["counters"]["traced_pages"].as_u64().unwrap() > 0, "the peer's writes were traced: {d:#}");
    // The source closes its namespace when its main loop sees the
    // migration completed, which may be just after query-migrate says so.
    wait_for("the source's namespace to hold nothing", LONG, || pvrdma(src)["objects"]["qps"] == 0);
    // The namespace itself is gone from the source host's rnicd, though the
    // source process lives on (`--keep-after-migrate`).
    wait_for("the source's rnicd to close the namespace", LONG, || !bed.namespaces(from).contains(&gid.to_string()));
    assert_qps_running(dst);
    quit_and_wait_exit(src, Duration::from_secs(20));
}

/// The checks at the end of a run: the guests' consoles (every VM the run
/// had) and the peer's report, with every workload verified.
pub fn assert_run_clean(consoles: &[String], rep: &Value) {
    for con in consoles {
        assert_guest_clean(con);
    }
    assert_peer_clean(rep);
    for w in ["stream", "ring", "table", "atomic"] {
        assert!(rep["workloads"][w]["verified"].as_u64().unwrap() > 0, "{w}: {rep:#}");
    }
}

/// A -> B -> A (hosts 0, 1, 0) with every workload of `load` running, the
/// first hop in `modes[0]`, the second in `modes[1]`; `during(bed, to)`
/// runs before each hop. Returns the peer's report.
pub fn there_and_back(tag: &str, load: Load, modes: [Mode; 2], during: impl Fn(&Bed, usize)) -> Value {
    let bed = Bed::new(tag);
    let gid = bed.vm_gid(1);
    let mut a = bed.vm_sized(0, gid, load.memory, load.args, "", &["--keep-after-migrate"]);
    let mut peer = Peer::start(&bed, &a, PEER);
    let p0 = a.wait_progress(STEP, LONG).unwrap();
    assert!(bed.holds(0, gid));
    during(&bed, 1);
    let (mut b, _) = hop(&bed, &a, 1, gid, &load, modes[0]);
    check_hop(&bed, &mut a, &b, (0, 1), gid, modes[0] == Mode::Precopy);
    let p1 = b.wait_progress(p0 + STEP, LONG).unwrap();
    during(&bed, 0);
    let (c, _) = hop(&bed, &b, 0, gid, &load, modes[1]);
    check_hop(&bed, &mut b, &c, (1, 0), gid, modes[1] == Mode::Precopy);
    c.wait_progress(p1 + STEP, LONG).unwrap();
    peer.wait_progress(PEER_STEP, LONG);
    // Read before the peer's run ends: once it is gone, the guest's next
    // operations fail, as they should.
    let consoles = [a.console(), b.console(), c.console()];
    assert_qps_running(&c);
    let rep = peer.stop();
    assert_run_clean(&consoles, &rep);
    rep
}
