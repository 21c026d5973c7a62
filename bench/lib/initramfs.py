"""A Linux guest for QEMU runs: Debian's kernel and a one-file initramfs
(a static /init built with gcc), written as a newc cpio without external tools."""

import glob
import os
import stat
import subprocess
import sys


def find_kernel():
    """Newest /boot/vmlinuz-*, or None (install Debian's linux-image-amd64)."""
    kernels = sorted(glob.glob("/boot/vmlinuz-*"))
    return kernels[-1] if kernels else None


def ensure_kernel():
    k = find_kernel()
    if k:
        return k
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    # apt's chatter goes to stderr: a bench's stdout is its table and JSON.
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, stdout=sys.stderr)
    subprocess.run(["apt-get", "install", "-y", "-qq", "linux-image-amd64"], check=True, env=env,
                   stdout=sys.stderr)
    k = find_kernel()
    if not k:
        raise RuntimeError("linux-image-amd64 installed but no /boot/vmlinuz-* found")
    return k


def _newc_entry(name, mode, data=b"", rdev=(0, 0), ino=1):
    name_b = name.encode() + b"\0"
    fields = [ino, mode, 0, 0, 1, 0, len(data), 0, 0, rdev[0], rdev[1], len(name_b), 0]
    hdr = b"070701" + b"".join(b"%08X" % f for f in fields)
    out = hdr + name_b
    out += b"\0" * (-len(out) % 4)
    out += data
    out += b"\0" * (-len(out) % 4)
    return out


def write_cpio(path, files):
    """files: list of (name, mode, data, rdev) with mode incl. the file type."""
    blob = b""
    for i, (name, mode, data, rdev) in enumerate(files, start=1):
        blob += _newc_entry(name, mode, data, rdev, ino=i)
    blob += _newc_entry("TRAILER!!!", 0, ino=0)
    with open(path, "wb") as f:
        f.write(blob)


def build_initramfs(init_c, outdir):
    """Compile init_c statically and pack it as /init. Returns the cpio path."""
    os.makedirs(outdir, exist_ok=True)
    init_bin = os.path.join(outdir, "init")
    subprocess.run(["gcc", "-O2", "-static", "-Wall", "-o", init_bin, init_c], check=True)
    with open(init_bin, "rb") as f:
        init = f.read()
    cpio = os.path.join(outdir, "initramfs.cpio")
    write_cpio(cpio, [
        ("dev", stat.S_IFDIR | 0o755, b"", (0, 0)),
        ("dev/console", stat.S_IFCHR | 0o600, b"", (5, 1)),
        ("proc", stat.S_IFDIR | 0o755, b"", (0, 0)),
        ("init", stat.S_IFREG | 0o755, init, (0, 0)),
    ])
    return cpio
