// SPDX-License-Identifier: GPL-2.0-or-later
//! A minimal Debian guest with Linux's soft-RoCE for QEMU: Debian's own
//! kernel (linux-image-amd64), and an initramfs holding only what the test
//! runs: busybox as the shell, the kernel modules rdma_rxe and virtio-net
//! need (in `modprobe --show-depends` order), iproute2's `rdma`, rdma-core's
//! `ibv_rc_pingpong`, perftest's `ib_write_bw`, the real libibverbs with the
//! rxe provider, and every library they load (from `ldd`). No disk image and
//! no distribution boot: the kernel runs the test's script as /init, which
//! keeps a TCG boot to seconds. Two more savings under TCG: QEMU boots the
//! kernel's uncompressed ELF (its PVH entry) instead of the bzImage, whose
//! xz decompression alone took 20 s on a loaded host, and the modules are
//! packed without their signatures (the kernel does not enforce them; it
//! only marks itself tainted), which saves the hashing on load.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Programs the guest runs, from the host's Debian packages.
const PROGRAMS: &[&str] = &["/usr/bin/busybox", "/usr/bin/rdma", "/usr/bin/ibv_rc_pingpong", "/usr/bin/ib_write_bw"];
/// rdma-core's rxe provider (ibverbs-providers), loaded by libibverbs.
const RXE_PROVIDER: &str = "/usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so";
/// Modules the guest loads; their dependencies come first.
/// crc32_generic: rdma_rxe's ICRC asks the crypto API for "crc32", which a
/// full system would modprobe on demand.
const MODULES: &[&str] = &["crc32_generic", "virtio_pci", "virtio_net", "rdma_rxe"];

/// Newest Debian kernel in /boot: (vmlinuz path, release).
pub fn kernel() -> (PathBuf, String) {
    let mut ks: Vec<PathBuf> = std::fs::read_dir("/boot")
        .expect("/boot")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("vmlinuz-")))
        .collect();
    ks.sort();
    let k = ks.pop().expect("no /boot/vmlinuz-*: install linux-image-amd64 (scripts/setup)");
    let release = k.file_name().unwrap().to_string_lossy().trim_start_matches("vmlinuz-").to_string();
    (k, release)
}

/// The kernel's uncompressed ELF image, extracted once from `bzimage` (an
/// xz stream inside it) into `dir`; QEMU boots it through its PVH entry.
pub fn vmlinux(bzimage: &Path, release: &str, dir: &Path) -> PathBuf {
    let path = dir.join(format!("vmlinux-{release}"));
    if path.exists() {
        return path;
    }
    std::fs::create_dir_all(dir).unwrap();
    let data = std::fs::read(bzimage).expect("read the kernel");
    const XZ_MAGIC: &[u8] = b"\xfd7zXZ\0";
    let at = data.windows(XZ_MAGIC.len()).position(|w| w == XZ_MAGIC).expect("an xz-compressed kernel");
    let tmp = dir.join(format!("vmlinux-{release}.{}", std::process::id()));
    let mut xz = Command::new("xz")
        .args(["-dc", "--single-stream"])
        .stdin(Stdio::piped())
        .stdout(std::fs::File::create(&tmp).unwrap())
        .spawn()
        .expect("xz (xz-utils)");
    // xz stops at the end of the stream; the bytes after it are not its.
    let _ = xz.stdin.take().unwrap().write_all(&data[at..]);
    assert!(xz.wait().unwrap().success(), "xz could not unpack {}", bzimage.display());
    std::fs::rename(&tmp, &path).unwrap();
    path
}

/// A module without its appended signature (struct module_signature and
/// the marker, after the signature itself).
fn unsigned(module: Vec<u8>) -> Vec<u8> {
    const MARKER: &[u8] = b"~Module signature appended~\n";
    let Some(rest) = module.strip_suffix(MARKER) else { return module };
    let sig_len = u32::from_be_bytes(rest[rest.len() - 4..].try_into().unwrap()) as usize;
    let end = rest.len() - 12 - sig_len;
    module[..end].to_vec()
}

/// Module files of `release` to load, in order, each once.
fn module_files(release: &str) -> Vec<PathBuf> {
    let mut seen = BTreeSet::new();
    let mut files = Vec::new();
    for m in MODULES {
        let out = Command::new("modprobe").args(["-S", release, "--show-depends", m]).output().expect("modprobe");
        assert!(out.status.success(), "modprobe --show-depends {m}: {}", String::from_utf8_lossy(&out.stderr));
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            // "insmod /lib/modules/.../x.ko " or "builtin x"
            if let Some(path) = line.strip_prefix("insmod ") {
                let path = path.split_whitespace().next().unwrap().to_string();
                if seen.insert(path.clone()) {
                    files.push(PathBuf::from(path));
                }
            }
        }
    }
    files
}

/// The shared libraries `binary` loads, the dynamic loader included.
fn libraries(binary: &str) -> Vec<String> {
    let out = Command::new("ldd").arg(binary).output().expect("ldd");
    assert!(out.status.success(), "ldd {binary}: {}", String::from_utf8_lossy(&out.stderr));
    let mut libs = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            [_, "=>", path, ..] if path.starts_with('/') => libs.push(path.to_string()),
            [path, ..] if path.starts_with('/') => libs.push(path.to_string()),
            _ => {}
        }
    }
    libs
}

/// A newc cpio archive, written as the kernel's initramfs unpacker reads it.
struct Cpio {
    out: Vec<u8>,
    ino: u32,
    dirs: BTreeSet<String>,
}

impl Cpio {
    fn new() -> Cpio {
        Cpio { out: Vec::new(), ino: 0, dirs: BTreeSet::new() }
    }

    fn entry(&mut self, name: &str, mode: u32, data: &[u8], rdev: (u32, u32)) {
        self.ino += 1;
        let name_z = [name.as_bytes(), b"\0"].concat();
        let fields = [self.ino, mode, 0, 0, 1, 0, data.len() as u32, 0, 0, rdev.0, rdev.1, name_z.len() as u32, 0];
        self.out.extend_from_slice(b"070701");
        for f in fields {
            write!(self.out, "{f:08X}").unwrap();
        }
        self.out.extend_from_slice(&name_z);
        self.pad();
        self.out.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.out.len().is_multiple_of(4) {
            self.out.push(0);
        }
    }

    fn dir(&mut self, path: &str) {
        let mut sofar = String::new();
        for part in path.trim_matches('/').split('/') {
            if !sofar.is_empty() {
                sofar.push('/');
            }
            sofar.push_str(part);
            if self.dirs.insert(sofar.clone()) {
                let d = sofar.clone();
                self.entry(&d, 0o040755, &[], (0, 0));
            }
        }
    }

    fn file(&mut self, path: &str, data: &[u8], perm: u32) {
        let path = path.trim_start_matches('/');
        if let Some((parent, _)) = path.rsplit_once('/') {
            self.dir(parent);
        }
        self.entry(path, 0o100000 | perm, data, (0, 0));
    }

    fn copy(&mut self, host_path: &str, guest_path: &str, perm: u32) {
        let data = std::fs::read(host_path).unwrap_or_else(|e| panic!("{host_path}: {e} (scripts/setup installs it)"));
        self.file(guest_path, &data, perm);
    }

    fn finish(mut self) -> Vec<u8> {
        self.ino = 0;
        self.entry("TRAILER!!!", 0, &[], (0, 0));
        self.out
    }
}

/// Writes the initramfs with `init` (a busybox sh script) as /init into
/// `dir`; returns its path. Modules go to /mods/NN-name.ko in load order.
pub fn build_initramfs(dir: &Path, release: &str, init: &str) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let mut c = Cpio::new();
    for d in ["dev", "proc", "sys", "bin", "tmp", "mods"] {
        c.dir(d);
    }
    c.entry("dev/console", 0o020600, &[], (5, 1));
    let mut libs = BTreeSet::new();
    for p in PROGRAMS.iter().chain([&RXE_PROVIDER]) {
        libs.extend(libraries(p));
    }
    for p in PROGRAMS {
        c.copy(p, &format!("bin/{}", Path::new(p).file_name().unwrap().to_string_lossy()), 0o755);
    }
    // Libraries at the paths the loader looks in (ldd's, and the
    // provider's own directory, where libibverbs dlopens it).
    for l in libs.iter().map(String::as_str).chain([RXE_PROVIDER]) {
        c.copy(l, l, 0o755);
    }
    c.file("etc/libibverbs.d/rxe.driver", b"driver rxe\n", 0o644);
    for (i, m) in module_files(release).iter().enumerate() {
        let name = m.file_name().unwrap().to_string_lossy();
        let data = std::fs::read(m).unwrap_or_else(|e| panic!("{}: {e}", m.display()));
        c.file(&format!("mods/{i:02}-{name}"), &unsigned(data), 0o644);
    }
    c.file("init", init.as_bytes(), 0o755);
    let path = dir.join("initramfs.cpio");
    std::fs::write(&path, c.finish()).unwrap();
    path
}
