"""Start a QEMU VM (TCG, direct kernel boot, serial to a file, QMP on a unix
socket) inside one host of a TwoHosts testbed, and wait for console markers."""

import os
import time

from .qmp import QMP


class QemuVM:
    def __init__(self, tb, host, workdir, name, kernel, initrd, append, mem_gib,
                 incoming=False, smp=1):
        self.tb, self.host, self.name = tb, host, name
        self.qmp_path = os.path.join(workdir, f"{name}.qmp")
        self.serial_path = os.path.join(workdir, f"{name}.serial")
        self.stderr_path = os.path.join(workdir, f"{name}.stderr")
        for p in (self.qmp_path, self.serial_path):
            if os.path.exists(p):
                os.unlink(p)
        argv = [
            "qemu-system-x86_64", "-accel", "tcg", "-m", f"{mem_gib}G", "-smp", str(smp),
            "-nographic", "-nodefaults", "-no-user-config", "-monitor", "none",
            "-serial", f"file:{self.serial_path}",
            "-qmp", f"unix:{self.qmp_path},server=on,wait=off",
            "-kernel", kernel, "-initrd", initrd, "-append", append,
        ]
        if incoming:
            argv += ["-incoming", "defer"]
        self.stderr = open(self.stderr_path, "w")
        self.proc = tb.popen(host, argv, stdin=open(os.devnull), stdout=self.stderr,
                             stderr=self.stderr)
        self.qmp = None
        try:
            self.qmp = QMP(self.qmp_path, timeout=30)
        except Exception:
            self.stop()
            raise RuntimeError(f"{name}: QEMU did not start: {self.stderr_tail()}")

    def stderr_tail(self, n=400):
        try:
            with open(self.stderr_path) as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def serial(self):
        try:
            with open(self.serial_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def wait_serial(self, marker, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if marker in self.serial():
                return True
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: QEMU exited: {self.stderr_tail()}")
            time.sleep(0.2)
        return False

    def stop(self):
        if self.qmp:
            self.qmp.close()
            self.qmp = None
        self.tb.kill(self.proc)
        self.stderr.close()
