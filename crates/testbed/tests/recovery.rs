//! An interrupted run is cleaned up by the next one; `down` works after a crash.

use std::process::{Command, Stdio};
use testbed::{Testbed, TestbedOpts};

fn netns_names() -> Vec<String> {
    let out = Command::new("ip").args(["netns", "list"]).output().unwrap();
    String::from_utf8(out.stdout).unwrap().lines().filter_map(|l| l.split_whitespace().next()).map(String::from).collect()
}

fn pid_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => !s[s.rfind(')').unwrap() + 1..].trim_start().starts_with('Z'),
        Err(_) => false,
    }
}

/// Not a test by itself: the child process of `killed_owner_is_swept_by_next_create`.
#[test]
#[allow(clippy::zombie_processes)] // the process is killed with its owner, on purpose
fn owner_child_helper() {
    let Some(report) = std::env::var_os("TB_OWNER_CHILD") else { return };
    let tb = Testbed::create(TestbedOpts::new("tb-crash", 2)).unwrap();
    let sleeper = tb.host(1).command("sleep").arg("1000").spawn().unwrap();
    // A file, not stdout: the test harness may capture stdout.
    let tmp = std::path::PathBuf::from(&report).with_extension("tmp");
    std::fs::write(&tmp, format!("TESTBED {} {}", tb.name(), sleeper.id())).unwrap();
    std::fs::rename(tmp, report).unwrap();
    loop {
        std::thread::park();
    }
}

#[test]
fn killed_owner_is_swept_by_next_create() {
    let report = std::env::temp_dir().join(format!("tb-owner-child-{}", std::process::id()));
    let _ = std::fs::remove_file(&report);
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "owner_child_helper", "--test-threads=1"])
        .env("TB_OWNER_CHILD", &report)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let line = loop {
        if let Ok(line) = std::fs::read_to_string(&report) {
            break line;
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the owner child exited ({status}) before making its testbed");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let _ = std::fs::remove_file(&report);
    let mut words = line.split_whitespace().skip(1);
    let name = words.next().unwrap().to_string();
    let sleeper: u32 = words.next().unwrap().parse().unwrap();
    assert!(netns_names().contains(&format!("{name}-h1")));
    assert!(pid_alive(sleeper));

    child.kill().unwrap(); // SIGKILL: no destructor runs
    child.wait().unwrap();

    let _next = Testbed::create(TestbedOpts::new("tb-next", 1)).unwrap();
    let left: Vec<String> = netns_names().into_iter().filter(|n| n.starts_with(&format!("{name}-"))).collect();
    assert!(left.is_empty(), "namespaces of the dead owner survive: {left:?}");
    assert!(!pid_alive(sleeper), "a process of the dead owner's testbed survives");
    assert!(!std::path::Path::new(&format!("{}/{name}.json", testbed::STATE_DIR)).exists());
}

#[test]
fn down_works_without_a_state_file() {
    let name = format!("tb-nostate-{}", std::process::id());
    let opts = TestbedOpts { exact_name: true, persistent: true, ..TestbedOpts::new(&name, 2) };
    let tb = Testbed::create(opts).unwrap();
    let sleeper = tb.host(0).command("sleep").arg("1000").spawn().unwrap().id();
    drop(tb);
    assert!(netns_names().contains(&format!("{name}-fab")), "a persistent testbed outlives its handle");
    std::fs::remove_file(format!("{}/{name}.json", testbed::STATE_DIR)).unwrap();
    let listed = testbed::list().unwrap();
    assert!(listed.iter().any(|t| t.name == name && t.orphan), "shown as an orphan");
    testbed::down(&name).unwrap();
    assert!(!netns_names().iter().any(|n| n.starts_with(&format!("{name}-"))));
    assert!(!pid_alive(sleeper));
    assert!(testbed::down(&name).is_err(), "second down: unknown testbed");
}

#[test]
fn a_failure_while_building_removes_what_was_built() {
    // A rate of 0 is refused after the namespaces exist.
    let r = Testbed::create(TestbedOpts::new("tb-fail", 2).rate_mbit(0));
    assert!(format!("{:#}", r.err().unwrap()).contains("rate of 0"));
    let prefix = format!("tb-fail-{}-", std::process::id());
    assert!(!netns_names().iter().any(|n| n.starts_with(&prefix)), "{:?}", netns_names());
    let states = std::fs::read_dir(testbed::STATE_DIR).unwrap();
    assert!(!states.flatten().any(|e| e.file_name().to_string_lossy().starts_with(&prefix)));
}

#[test]
fn bad_requests_get_clear_errors() {
    let e = |r: anyhow::Result<Testbed>| format!("{:#}", r.err().expect("must fail"));
    assert!(e(Testbed::create(TestbedOpts::new("tb-bad", 0))).contains("1 to"));
    assert!(e(Testbed::create(TestbedOpts::new("tb-bad", 1).nics(3))).contains("1 or 2 NICs"));
    assert!(e(Testbed::create(TestbedOpts::new("bad/name", 1))).contains("bad testbed name"));
    assert!(e(Testbed::open("tb-no-such-testbed")).contains("no testbed named"));
    let tb = Testbed::create(TestbedOpts::new("tb-bad", 1)).unwrap();
    assert!(format!("{:#}", tb.set_loss(0, 0, 150.0).unwrap_err()).contains("between 0 and 100"));
    assert!(format!("{:#}", tb.set_dup(3, 0, 1.0).unwrap_err()).contains("no host 3"));
    let dup_name = TestbedOpts { exact_name: true, ..TestbedOpts::new(tb.name(), 1) };
    assert!(e(Testbed::create(dup_name)).contains("already exists"));
}
