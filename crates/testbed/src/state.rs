//! State files under /run/transit-testbed/: one JSON file per testbed naming its
//! owner process, so that a testbed whose owner died can be found and removed.

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::fs::{self, File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::PathBuf;

pub const STATE_DIR: &str = "/run/transit-testbed";

/// The process that owns a testbed; `start_time` guards against pid reuse.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct Owner {
    pub pid: i32,
    pub start_time: u64,
}

impl Owner {
    pub fn me() -> Owner {
        let pid = std::process::id() as i32;
        Owner { pid, start_time: start_time(pid).unwrap_or(0) }
    }

    pub fn is_alive(&self) -> bool {
        start_time(self.pid) == Some(self.start_time)
    }
}

/// Field 22 of /proc/PID/stat: when the process started, in clock ticks since boot.
fn start_time(pid: i32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may contain spaces; the fields after it don't.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct State {
    pub name: String,
    /// Picks the subnets: 10.(200+nic).INDEX.0/24.
    pub index: u8,
    pub hosts: usize,
    pub nics: usize,
    /// None: made by the CLI, lives until `transit testbed down`.
    pub owner: Option<Owner>,
}

pub fn state_path(name: &str) -> PathBuf {
    PathBuf::from(STATE_DIR).join(format!("{name}.json"))
}

pub fn ensure_dir() -> Result<()> {
    fs::create_dir_all(STATE_DIR).with_context(|| format!("cannot create {STATE_DIR}"))
}

pub fn read(name: &str) -> Result<Option<State>> {
    let path = state_path(name);
    match fs::read_to_string(&path) {
        Ok(text) => Ok(Some(serde_json::from_str(&text).with_context(|| format!("damaged state file {}", path.display()))?)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("cannot read {}", path.display())),
    }
}

/// Writes atomically (temp file + rename) so a crash never leaves half a file.
pub fn write(state: &State) -> Result<()> {
    let path = state_path(&state.name);
    let tmp = path.with_extension(format!("json.tmp{}", std::process::id()));
    fs::write(&tmp, serde_json::to_vec_pretty(state)?).with_context(|| format!("cannot write {}", tmp.display()))?;
    fs::rename(&tmp, &path).with_context(|| format!("cannot write {}", path.display()))
}

pub fn remove(name: &str) {
    let _ = fs::remove_file(state_path(name));
}

/// Every readable state file; damaged ones are reported and skipped.
pub fn all() -> Vec<State> {
    let Ok(dir) = fs::read_dir(STATE_DIR) else { return Vec::new() };
    let mut out = Vec::new();
    for entry in dir.flatten() {
        let file = entry.file_name().to_string_lossy().into_owned();
        if let Some(name) = file.strip_suffix(".json") {
            match read(name) {
                Ok(Some(s)) => out.push(s),
                Ok(None) => {}
                Err(e) => tracing::warn!("skipping {file}: {e:#}"),
            }
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// An exclusive lock over the state directory, held while testbeds are swept and
/// indexes allocated, so concurrent processes never pick the same index.
pub struct DirLock(#[allow(dead_code)] File);

impl DirLock {
    pub fn acquire() -> Result<DirLock> {
        ensure_dir()?;
        let path = PathBuf::from(STATE_DIR).join("lock");
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        loop {
            // SAFETY: flock on a descriptor we own; the lock is released when the file closes.
            let r = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) };
            if r == 0 {
                return Ok(DirLock(file));
            }
            let err = std::io::Error::last_os_error();
            if err.kind() != std::io::ErrorKind::Interrupted {
                return Err(err).context("cannot lock the testbed state directory");
            }
        }
    }
}

/// The lowest index no state file uses (call with the lock held).
pub fn free_index() -> Result<u8> {
    let used: Vec<u8> = all().iter().map(|s| s.index).collect();
    match (0..=255u8).find(|i| !used.contains(i)) {
        Some(i) => Ok(i),
        None => bail!("all 256 testbed indexes are in use; remove some with `transit testbed down`"),
    }
}
