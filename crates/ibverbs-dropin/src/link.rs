// SPDX-License-Identifier: GPL-2.0-or-later
//! Links the staticlib into libibverbs.so.1 with rdma-core's version nodes.
//!
//! A Rust cdylib carries rustc's own anonymous version script, which GNU ld
//! will not combine with a tagged one; a staticlib linked by `cc -shared
//! -Wl,--version-script` can carry IBVERBS_1.0 ... IBVERBS_PRIVATE_34.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{bail, Context as _};

/// The version script (the exports of Debian's rdma-core 44 libibverbs).
pub const VERSION_SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/libibverbs.map");

/// Where the library goes beside a build's artifacts: `<dir>/ibverbs/libibverbs.so.1`.
pub fn output_dir(profile_dir: &Path) -> PathBuf {
    profile_dir.join("ibverbs")
}

/// Links `<profile_dir>/libibverbs_dropin.a` into
/// `<profile_dir>/ibverbs/libibverbs.so.1` (and a `libibverbs.so` link for
/// programs linking against it). Returns the library's path.
///
/// Safe to run from several processes at once (test binaries run in
/// parallel each link it): every file is written under a name of its own
/// and renamed into place, so a reader sees the old library or the new
/// one, whole, and never a half-written file or a missing link.
pub fn link(profile_dir: &Path) -> anyhow::Result<PathBuf> {
    let archive = profile_dir.join("libibverbs_dropin.a");
    if !archive.exists() {
        bail!("{} is missing: build the ibverbs-dropin crate first", archive.display());
    }
    let dir = output_dir(profile_dir);
    std::fs::create_dir_all(&dir)?;
    let out = dir.join("libibverbs.so.1");
    let tmp = private_name(&dir, "libibverbs.so.1");
    let status = Command::new("cc")
        .arg("-shared")
        .arg("-o")
        .arg(&tmp)
        .arg("-Wl,--whole-archive")
        .arg(&archive)
        .arg("-Wl,--no-whole-archive")
        .arg(format!("-Wl,--version-script={VERSION_SCRIPT}"))
        .args(["-Wl,-soname,libibverbs.so.1", "-Wl,-z,now", "-Wl,--gc-sections"])
        .args(["-lgcc_s", "-lutil", "-lrt", "-lpthread", "-lm", "-ldl", "-lc"])
        .status();
    if !matches!(status, Ok(s) if s.success()) {
        let _ = std::fs::remove_file(&tmp);
    }
    let status = status.context("run cc")?;
    if !status.success() {
        bail!("linking libibverbs.so.1 failed ({status})");
    }
    // Rename: a program that has the old file mapped keeps it.
    rename_into_place(&tmp, &out)?;
    let dev_tmp = private_name(&dir, "libibverbs.so");
    std::os::unix::fs::symlink("libibverbs.so.1", &dev_tmp).with_context(|| format!("symlink {}", dev_tmp.display()))?;
    rename_into_place(&dev_tmp, &dir.join("libibverbs.so"))?;
    Ok(out)
}

/// A name in `dir` for `file` that no other process or call uses.
fn private_name(dir: &Path, file: &str) -> PathBuf {
    static CALLS: AtomicU32 = AtomicU32::new(0);
    let n = CALLS.fetch_add(1, Ordering::Relaxed);
    dir.join(format!(".{file}.{}.{n}.tmp", std::process::id()))
}

fn rename_into_place(tmp: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::rename(tmp, to).map_err(|e| {
        let _ = std::fs::remove_file(tmp);
        anyhow::Error::new(e).context(format!("rename {} to {}", tmp.display(), to.display()))
    })
}
