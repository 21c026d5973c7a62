"""Two "hosts" as Linux network namespaces joined by a veth pair, for
benchmarks. Everything created here is removed by close(), which runs on
normal exit, on exceptions, on Ctrl-C and on SIGTERM (see install_signal_exit).

    with TwoHosts() as tb:
        p = tb.popen("b", ["iperf3", "-s"])
        tb.run("a", ["iperf3", "-c", tb.addr("b")])
        tb.cap_rate("a", "1gbit")   # tc tbf on a's veth, egress a -> b
"""

import os
import re
import signal
import subprocess
import sys
import time


def install_signal_exit():
    """Turn SIGINT/SIGTERM/SIGHUP into SystemExit so `with` blocks clean up
    (SIGINT too: a script started in the background inherits it ignored)."""

    def handler(signum, _frame):
        print(f"interrupted by signal {signum}; cleaning up", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


class TwoHosts:
    SUBNET = "10.213.{}.{}"

    def __init__(self, prefix="qb"):
        # Unique per process so parallel runs never collide.
        tag = f"{prefix}{os.getpid()}"
        self.prefix = prefix
        self.ns = {"a": f"{tag}a", "b": f"{tag}b"}
        self.dev = {"a": f"{tag}-va", "b": f"{tag}-vb"}
        octet = os.getpid() % 250 + 1
        self.ip = {"a": self.SUBNET.format(octet, 1), "b": self.SUBNET.format(octet, 2)}
        self.procs = []
        self.up = False

    def __enter__(self):
        try:
            self.setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def sweep_stale(self):
        """Remove namespaces of earlier runs that were SIGKILLed (owner pid gone)."""
        out = _ip("netns", "list", check=False).stdout
        for line in out.splitlines():
            m = re.fullmatch(rf"{self.prefix}(\d+)[ab]", line.split()[0]) if line.strip() else None
            if not m or os.path.exists(f"/proc/{m.group(1)}"):
                continue
            ns = line.split()[0]
            for pid in _ip("netns", "pids", ns, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", ns, check=False)

    def setup(self):
        self.sweep_stale()
        for h in ("a", "b"):
            _ip("netns", "add", self.ns[h])
        self.up = True
        _ip("link", "add", self.dev["a"], "netns", self.ns["a"], "type", "veth",
            "peer", "name", self.dev["b"], "netns", self.ns["b"])
        for h in ("a", "b"):
            n = self.ns[h]
            _ip("-n", n, "link", "set", "lo", "up")
            _ip("-n", n, "addr", "add", f"{self.ip[h]}/24", "dev", self.dev[h])
            _ip("-n", n, "link", "set", self.dev[h], "up")

    def addr(self, host):
        return self.ip[host]

    def wrap(self, host, argv):
        return ["ip", "netns", "exec", self.ns[host], *argv]

    def run(self, host, argv, **kw):
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.wrap(host, argv), **kw)

    def popen(self, host, argv, **kw):
        # `ip netns exec` execs argv, so the pid is the program's own.
        p = subprocess.Popen(self.wrap(host, argv), start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def kill(self, p, grace=3.0):
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(grace)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if p in self.procs:
            self.procs.remove(p)

    def cap_rate(self, host, rate):
        """Cap egress of `host`'s veth (e.g. "1gbit"); rate=None removes it."""
        n, d = self.ns[host], self.dev[host]
        subprocess.run(["tc", "-n", n, "qdisc", "del", "dev", d, "root"], capture_output=True)
        if rate:
            subprocess.run(["tc", "-n", n, "qdisc", "add", "dev", d, "root", "tbf",
                            "rate", rate, "burst", "256kb", "latency", "50ms"],
                           check=True, capture_output=True, text=True)

    def close(self):
        for p in list(self.procs):
            try:
                self.kill(p)
            except Exception:
                pass
        if self.up:
            for h in ("a", "b"):
                _ip("netns", "del", self.ns[h], check=False)
            self.up = False


def wait_port(tb, host, port, timeout=10.0):
    """Wait until something listens on TCP `port` in `host`'s namespace."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = tb.run(host, ["ss", "-Hltn", f"sport = :{port}"]).stdout
        if out.strip():
            return True
        time.sleep(0.05)
    return False
