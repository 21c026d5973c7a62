//! `transit demo`: the main demo. By default the RDMA headline
//! (crates/transit/src/demo/rdma.rs): a VM with a PVRDMA device and a
//! bare-metal peer, live-migrated A -> B -> A. With `--no-rdma`, the memory
//! demo: two hosts (network namespaces), a VM running the memory dirtier on
//! host A is live-migrated A -> B -> A while it runs, and after each hop
//! every page must be consistent (QEMU's dirtier oracle); `--save-restore`
//! moves it once by save file instead.

use anyhow::{bail, Result};
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use vmm::testing::{unique_name, TempPath, VmProcess};

mod rdma;

#[derive(clap::Args)]
pub struct DemoArgs {
    /// Guest RAM of the demo VM.
    #[arg(long, default_value = "256M")]
    pub memory: String,
    /// Seconds the VM runs on each host before it moves.
    #[arg(long, default_value_t = 3)]
    pub run_secs: u64,
    /// Parallel TCP channels of each live migration.
    #[arg(long, default_value_t = 4)]
    pub channels: u32,
    /// Move the VM once with save/restore instead of live migration.
    #[arg(long)]
    pub save_restore: bool,
    /// How each live migration moves RAM: precopy, postcopy (the VM runs on
    /// the destination at once and fetches pages on fault) or hybrid.
    #[arg(long, default_value = "precopy", value_parser = ["precopy", "postcopy", "hybrid"])]
    pub mode: String,
    /// The memory demo (a VM running the dirtier, no RDMA) instead of the
    /// RDMA headline.
    #[arg(long)]
    pub no_rdma: bool,
    /// RDMA demo: RC QPs the guest's workloads spread over (4 to 256).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(4..=256))]
    pub qps: u32,
    /// RDMA demo: the size of the guest's big RDMA WRITE, repeated (0: none).
    #[arg(long, default_value = "64M")]
    pub bigwrite: String,
}

pub(crate) fn step(msg: &str) {
    eprintln!("==> {msg}");
}

fn oracle(vm: &VmProcess) -> Result<Value> {
    let r = vm.exec("check-dirtier", json!({}))?;
    if r["bad_pages"] != 0 {
        bail!("memory oracle FAILED on {}: {r}", vm.name);
    }
    Ok(r)
}

pub fn run(a: DemoArgs) -> Result<()> {
    if !a.no_rdma && !a.save_restore {
        return rdma::run(a);
    }
    if a.save_restore {
        save_restore(a)
    } else {
        live(a)
    }
}

/// Start a VM on `host` waiting for an incoming migration on port `port`.
fn incoming(host: &testbed::Host, me: &std::path::Path, name: &str, memory: &str, port: u16) -> Result<VmProcess> {
    let uri = format!("tcp:0.0.0.0:{port}");
    VmProcess::start(host.command(me), name, &["--log", "warn", "vm", "run", "--name", name, "--memory", memory, "--incoming", &uri])
}

/// Migrate `src` to `dst` (listening on `to`), wait for the end, check the
/// destination: it runs, and the dirtier oracle holds.
fn hop(src: &mut VmProcess, dst: &VmProcess, to: &str, channels: u32, mode: &str) -> Result<Value> {
    src.exec("migrate", json!({"uri": format!("tcp:{to}"), "channels": channels, "mode": mode}))?;
    let t0 = Instant::now();
    let stats = loop {
        let st = src.exec("query-migrate", json!({}))?;
        match st["status"].as_str().unwrap_or("") {
            "completed" => break st,
            "failed" | "cancelled" => bail!("migration {}: {}", st["status"], st["error"]),
            _ => {}
        }
        if t0.elapsed() > Duration::from_secs(600) {
            bail!("migration did not finish in 10 minutes");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    src.wait_exit(Duration::from_secs(30))?;
    let p0 = dst.status()?["guest_progress"].as_u64().unwrap_or(0);
    dst.wait_progress(p0 + 1, Duration::from_secs(60))?;
    dst.exec("stop", json!({}))?;
    let check = oracle(dst)?;
    dst.exec("cont", json!({}))?;
    let faults = if mode == "precopy" {
        String::new()
    } else if stats["postcopy_ms"].as_f64().unwrap_or(0.0) == 0.0 {
        " (converged before switching to postcopy)".to_string()
    } else {
        format!(", {} faults served (p99 {:.0} us)", stats["faults"], stats["fault_p99_us"].as_f64().unwrap_or(0.0))
    };
    eprintln!(
        "    done in {:.2} s: downtime {:.1} ms, {} rounds, {:.2} Gbit/s{faults}; the guest runs on; oracle holds on {} pages",
        stats["total_ms"].as_f64().unwrap_or(0.0) / 1000.0,
        stats["downtime_ms"].as_f64().unwrap_or(0.0),
        stats["rounds"],
        stats["throughput_gbps"].as_f64().unwrap_or(0.0),
        check["pages"]
    );
    Ok(json!({"total_ms": stats["total_ms"], "downtime_ms": stats["downtime_ms"], "rounds": stats["rounds"], "pages": check["pages"],
              "migration_mode": mode, "faults": stats["faults"]}))
}

/// What both demos start from: two hosts, and a VM running the dirtier on A.
struct Setup {
    tb: testbed::Testbed,
    me: std::path::PathBuf,
    name: String,
    vm: VmProcess,
}

fn setup(a: &DemoArgs) -> Result<Setup> {
    let me = std::env::current_exe()?;
    step("creating a testbed with two hosts (network namespaces on a bridge)");
    let tb = testbed::Testbed::create(testbed::TestbedOpts::new("demo", 2))?;
    let (ha, hb) = (tb.host(0), tb.host(1));
    eprintln!("    host A = {} ({}), host B = {} ({})", ha.name(), ha.addr(0), hb.name(), hb.addr(0));
    let name = unique_name("demo");
    step(&format!("starting VM {name} on host A: {} of RAM, running the memory dirtier", a.memory));
    let vm = VmProcess::start(
        ha.command(&me),
        &name,
        &["--log", "warn", "vm", "run", "--name", &name, "--memory", &a.memory, "--workload", "dirtier"],
    )?;
    std::thread::sleep(Duration::from_secs(a.run_secs));
    let passes = vm.wait_progress(1, Duration::from_secs(60))?;
    eprintln!("    the guest made {passes} passes over its memory");
    Ok(Setup { tb, me, name, vm })
}

fn live(a: DemoArgs) -> Result<()> {
    let t0 = Instant::now();
    let Setup { tb, me, name, vm: mut on_a } = setup(&a)?;
    let (ha, hb) = (tb.host(0), tb.host(1));
    let mut hops = Vec::new();

    step(&format!("live-migrating it ({}) to host B over {} TCP channels while it runs", a.mode, a.channels));
    let mut on_b = incoming(hb, &me, &format!("{name}-b"), &a.memory, 4440)?;
    hops.push(hop(&mut on_a, &on_b, &format!("{}:4440", hb.addr(0)), a.channels, &a.mode)?);
    drop(on_a);
    std::thread::sleep(Duration::from_secs(a.run_secs));

    step("and back to host A");
    let back = incoming(ha, &me, &format!("{name}-a2"), &a.memory, 4441)?;
    hops.push(hop(&mut on_b, &back, &format!("{}:4441", ha.addr(0)), a.channels, &a.mode)?);
    drop(on_b);
    back.exec("quit", json!({}))?;
    drop(back);
    drop(tb);
    println!(
        "Transit demo: a VM with {} of RAM, dirtying memory as fast as it can, was live-migrated \
         A -> B -> A; the dirtier oracle held after each hop ({:.1} s in all).",
        a.memory,
        t0.elapsed().as_secs_f64()
    );
    println!("{}", json!({"ok": true, "hops": hops.len(), "oracle": "pass", "mode": "live", "migrations": hops}));
    Ok(())
}

fn save_restore(a: DemoArgs) -> Result<()> {
    let t0 = Instant::now();
    let Setup { tb, me, name, vm: mut vm_a } = setup(&a)?;
    let hb = tb.host(1);

    step("saving the VM on host A");
    let file = TempPath::new(&format!("{name}.snap"));
    let saved = vm_a.exec("save", json!({"filename": file.path()}))?;
    let digest_a = vm_a.exec("query-ram-digest", json!({}))?;
    let check_a = oracle(&vm_a)?;
    eprintln!(
        "    {} MiB file ({} data pages, {} zero pages); oracle holds ({} pages)",
        saved["bytes"].as_u64().unwrap_or(0) >> 20,
        saved["data_pages"],
        saved["zero_pages"],
        check_a["pages"]
    );
    vm_a.kill();

    step("restoring it on host B");
    let name_b = format!("{name}-b");
    let vm_b = VmProcess::start(hb.command(&me), &name_b, &["--log", "warn", "vm", "restore", file.path().to_str().unwrap(), "--paused"])?;
    let digest_b = vm_b.exec("query-ram-digest", json!({}))?;
    if digest_a != digest_b {
        bail!("RAM on host B differs from host A: {digest_a} vs {digest_b}");
    }
    oracle(&vm_b)?;
    eprintln!("    RAM identical to host A (digest {})", digest_b["digest"]);
    vm_b.exec("cont", json!({}))?;
    let before = vm_b.status()?["guest_progress"].as_u64().unwrap_or(0);
    std::thread::sleep(Duration::from_secs(a.run_secs));
    vm_b.wait_progress(before + 1, Duration::from_secs(60))?;
    vm_b.exec("stop", json!({}))?;
    let check_b = oracle(&vm_b)?;
    let after = vm_b.status()?["guest_progress"].as_u64().unwrap_or(0);
    eprintln!("    the guest continued on host B: {} more passes, oracle holds", after - before);
    drop(vm_b);
    drop(tb);

    println!(
        "Transit demo: a VM with {} of RAM moved from host A to host B by save/restore; \
         every page passed the dirtier oracle before and after ({} pages checked) in {:.1} s.",
        a.memory,
        check_b["pages"],
        t0.elapsed().as_secs_f64()
    );
    println!("{}", json!({"ok": true, "hops": 1, "oracle": "pass", "mode": "save-restore", "pages": check_b["pages"]}));
    Ok(())
}
