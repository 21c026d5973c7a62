//! Files written on a user's behalf (`save`, `pmemsave`, `query-ram-digest`'s
//! `filename`): all or nothing, durable when reported done, and never in place
//! of something that is not a file.
//!
//! The rules, in order:
//! - A symbolic link is followed (each level, like `open` would) and the file it
//!   names is replaced; the link itself stays a link.
//! - The target must be a regular file or not exist. A directory, device, FIFO
//!   or socket is refused with an error naming what it is: replacing `/dev/full`
//!   by a regular file, or a FIFO someone reads, is never what the user meant.
//! - The data goes to a new temporary file in the target's directory, created
//!   with `O_EXCL` under a random name (`.NAME.XXXXXX.partial`), so it cannot
//!   take over any other file. Every write error and the `fsync` result are
//!   reported; on any error the temporary file is removed and the target is
//!   untouched.
//! - Then the rename over the target, then an `fsync` of the directory, so a
//!   crash after success leaves the new file, and one before leaves the old.
//! - A new file is readable by its owner only (it holds guest memory); a
//!   replaced file keeps its permission bits.

use anyhow::{bail, Context, Result};
use std::fs::{File, Permissions};
use std::io::{BufWriter, Write};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Most symlink levels followed (Linux's own limit is 40).
const MAX_LINKS: usize = 40;

/// Writes a file at `path` through `fill`, by the rules above. Returns what
/// `fill` returns and the size of the file written.
pub fn write_file<T>(path: &Path, fill: impl FnOnce(&mut BufWriter<File>) -> Result<T>) -> Result<(T, u64)> {
    let target = resolve(path)?;
    let old_mode = check_target(&target)?;
    let dir = parent_dir(&target);
    let name = target.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .suffix(".partial")
        .tempfile_in(&dir)
        .with_context(|| format!("cannot create a temporary file in {}", dir.display()))?;
    if let Some(mode) = old_mode {
        tmp.as_file()
            .set_permissions(Permissions::from_mode(mode))
            .with_context(|| format!("setting the mode of {}", tmp.path().display()))?;
    }
    let what = || format!("writing {}", target.display());
    let mut w = BufWriter::with_capacity(256 << 10, tmp.as_file().try_clone().with_context(what)?);
    let value = fill(&mut w).with_context(what)?;
    let f = w.into_inner().map_err(|e| e.into_error()).with_context(what)?;
    f.sync_all().with_context(|| format!("syncing {} to disk", target.display()))?;
    let bytes = f.metadata().with_context(what)?.len();
    drop(f);
    tmp.persist(&target).map_err(|e| e.error).with_context(|| format!("renaming the new file over {}", target.display()))?;
    File::open(&dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("{} was written, but syncing its directory {} failed", target.display(), dir.display()))?;
    Ok((value, bytes))
}

/// Writes `data` to `path` by the rules above.
pub fn write_bytes(path: &Path, data: &[u8]) -> Result<u64> {
    write_file(path, |w| Ok(w.write_all(data)?)).map(|((), n)| n)
}

/// `path` with every symbolic link followed (the last one may name a file that
/// does not exist yet).
fn resolve(path: &Path) -> Result<PathBuf> {
    let mut p = path.to_path_buf();
    for _ in 0..MAX_LINKS {
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.file_type().is_symlink() => {
                let link = std::fs::read_link(&p).with_context(|| format!("reading the symbolic link {}", p.display()))?;
                p = parent_dir(&p).join(link);
            }
            _ => return Ok(p),
        }
    }
    bail!("{}: too many levels of symbolic links", path.display())
}

/// Refuses a target that exists and is not a regular file; returns the
/// permission bits of a regular file that will be replaced.
fn check_target(target: &Path) -> Result<Option<u32>> {
    let m = match std::fs::symlink_metadata(target) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("cannot inspect {}", target.display())),
    };
    let t = m.file_type();
    let kind = if t.is_file() {
        return Ok(Some(m.permissions().mode() & 0o7777));
    } else if t.is_dir() {
        "a directory"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    };
    bail!("{} is {kind}: only a regular file (or a new name) can be written, so it was left alone", target.display())
}

fn parent_dir(p: &Path) -> PathBuf {
    match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    }

    #[test]
    fn writes_replaces_and_leaves_no_temporary() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("vm.save");
        assert_eq!(write_bytes(&p, b"one").unwrap(), 3);
        std::fs::set_permissions(&p, Permissions::from_mode(0o640)).unwrap();
        write_bytes(&p, b"second").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"second");
        assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o640, "a replaced file keeps its mode");
        assert_eq!(entries(d.path()), ["vm.save"]);
    }

    #[test]
    fn a_failing_fill_leaves_the_old_file() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f");
        write_bytes(&p, b"old").unwrap();
        let e = write_file(&p, |w| -> Result<()> {
            w.write_all(b"half")?;
            bail!("the VM went away")
        })
        .unwrap_err();
        assert!(format!("{e:#}").contains("the VM went away"), "{e:#}");
        assert_eq!(std::fs::read(&p).unwrap(), b"old");
        assert_eq!(entries(d.path()), ["f"]);
    }

    #[test]
    fn symlinks_are_followed_and_stay_links() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("real")).unwrap();
        let link = d.path().join("link");
        std::os::unix::fs::symlink("real/target", &link).unwrap();
        let link2 = d.path().join("link2");
        std::os::unix::fs::symlink("link", &link2).unwrap();
        write_bytes(&link2, b"through two links").unwrap();
        assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
        assert!(std::fs::symlink_metadata(&link2).unwrap().file_type().is_symlink());
        assert_eq!(std::fs::read(d.path().join("real/target")).unwrap(), b"through two links");
        let looped = d.path().join("loop");
        std::os::unix::fs::symlink("loop", &looped).unwrap();
        assert!(format!("{:#}", write_bytes(&looped, b"x").unwrap_err()).contains("too many levels"));
    }

    #[test]
    fn non_regular_targets_are_refused_and_kept() {
        let d = tempfile::tempdir().unwrap();
        let e = write_bytes(d.path(), b"x").unwrap_err();
        assert!(format!("{e:#}").contains("is a directory"), "{e:#}");
        let fifo = d.path().join("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: mkfifo reads one NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = write_bytes(&fifo, b"x").unwrap_err();
        assert!(format!("{e:#}").contains("is a FIFO"), "{e:#}");
        assert!(std::fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo());
        assert_eq!(entries(d.path()), ["fifo"]);
    }

    #[test]
    fn an_old_style_temporary_name_is_not_touched() {
        let d = tempfile::tempdir().unwrap();
        let other = d.path().join("vm.partial");
        std::fs::write(&other, b"someone else's").unwrap();
        write_bytes(&d.path().join("vm.save"), b"new").unwrap();
        assert_eq!(std::fs::read(&other).unwrap(), b"someone else's");
        assert_eq!(entries(d.path()), ["vm.partial", "vm.save"]);
    }
}
