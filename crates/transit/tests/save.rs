//! `save` and `pmemsave` from a real vmm process: every write and sync error
//! is reported, the target is replaced whole or not at all, and only a regular
//! file is ever replaced.

use serde_json::json;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
use vmm::testing::{unique_name, VmProcess};

/// A small tmpfs mounted for one test, unmounted (and its directory removed) on drop.
struct SmallFs(PathBuf);

impl SmallFs {
    fn mount(name: &str, size: &str) -> SmallFs {
        let dir = std::env::temp_dir().join(format!("transit-{name}-fs"));
        std::fs::create_dir_all(&dir).unwrap();
        let st = Command::new("mount").args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"]).arg(&dir).status().unwrap();
        assert!(st.success(), "mount tmpfs on {}", dir.display());
        SmallFs(dir)
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

fn dirtier_vm(prefix: &str) -> VmProcess {
    let vm = VmProcess::run_local(&unique_name(prefix), &["--memory", "32M", "--workload", "dirtier"]).unwrap();
    vm.wait_progress(1, Duration::from_secs(60)).unwrap();
    vm
}

#[test]
fn save_to_a_full_filesystem_or_a_device_fails_and_changes_nothing() {
    let vm = dirtier_vm("savefull");
    // 32 MiB of dirtied RAM cannot fit in 1 MiB.
    let fs = SmallFs::mount(&vm.name, "1m");
    let old = fs.0.join("vm.save");
    std::fs::write(&old, b"the previous save").unwrap();
    let e = vm.exec("save", json!({"filename": old})).unwrap_err().to_string();
    assert!(e.contains("No space left on device"), "{e}");
    assert_eq!(std::fs::read(&old).unwrap(), b"the previous save", "a failed save leaves the old file");
    assert_eq!(entries(&fs.0), ["vm.save"], "no temporary file is left behind");
    let e = vm.exec("pmemsave", json!({"val": 0, "size": 8 << 20, "filename": fs.0.join("mem")})).unwrap_err().to_string();
    assert!(e.contains("No space left on device"), "{e}");
    assert_eq!(entries(&fs.0), ["vm.save"]);

    // A device is never replaced by a regular file.
    for cmd in ["save", "pmemsave"] {
        let e = vm.exec(cmd, json!({"filename": "/dev/full", "val": 0, "size": 4096})).unwrap_err().to_string();
        assert!(e.contains("/dev/full is a character device"), "{cmd}: {e}");
        assert!(std::fs::symlink_metadata("/dev/full").unwrap().file_type().is_char_device());
    }
    let e = vm.exec("save", json!({"filename": fs.0})).unwrap_err().to_string();
    assert!(e.contains("is a directory"), "{e}");

    // The VM is still whole: it saves where there is room and runs on.
    let dir = tempfile::tempdir().unwrap();
    let r = vm.exec("save", json!({"filename": dir.path().join("ok.save")})).unwrap();
    assert_eq!(r["bytes"].as_u64().unwrap(), std::fs::metadata(dir.path().join("ok.save")).unwrap().len());
    vm.exec("cont", json!({})).unwrap();
    assert_eq!(vm.status().unwrap()["status"], "running");
}

#[test]
fn save_follows_symlinks_and_leaves_neighbours_alone() {
    let vm = dirtier_vm("savelink");
    let dir = tempfile::tempdir().unwrap();
    // The name the old code used for its temporary file belongs to someone else here.
    std::fs::write(dir.path().join("vm.partial"), b"not ours").unwrap();
    std::fs::create_dir(dir.path().join("real")).unwrap();
    std::os::unix::fs::symlink("real/vm.save", dir.path().join("vm.save")).unwrap();

    let r = vm.exec("save", json!({"filename": dir.path().join("vm.save")})).unwrap();
    let link = std::fs::symlink_metadata(dir.path().join("vm.save")).unwrap();
    assert!(link.file_type().is_symlink(), "the link stays a link");
    let real = dir.path().join("real/vm.save");
    assert_eq!(r["bytes"].as_u64().unwrap(), std::fs::metadata(&real).unwrap().len());
    vmm::savefile::open(&real).expect("the link's target is a whole save file");
    assert_eq!(std::fs::read(dir.path().join("vm.partial")).unwrap(), b"not ours");
    assert_eq!(entries(dir.path()), ["real", "vm.partial", "vm.save"]);
    assert_eq!(entries(&dir.path().join("real")), ["vm.save"]);

    // pmemsave follows the same rules.
    vm.exec("pmemsave", json!({"val": 0, "size": 4096, "filename": dir.path().join("vm.save")})).unwrap();
    assert_eq!(std::fs::metadata(&real).unwrap().len(), 4096);
    assert!(std::fs::symlink_metadata(dir.path().join("vm.save")).unwrap().file_type().is_symlink());
}
