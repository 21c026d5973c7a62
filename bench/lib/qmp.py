"""A small client for QEMU's QMP protocol over a unix socket.

Events that arrive between replies are kept in `events` so callers can wait
for them (e.g. MIGRATION status changes) without losing any."""

import json
import os
import socket
import time


class QMPError(RuntimeError):
    pass


class QMP:
    def __init__(self, path, timeout=30.0):
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                self.sock.close()
                if time.monotonic() > deadline:
                    raise QMPError(f"QMP socket {path} did not appear within {timeout}s")
                time.sleep(0.05)
        self.sock.settimeout(timeout)
        self.buf = b""
        self.events = []
        greeting = self._read()
        if "QMP" not in greeting:
            raise QMPError(f"unexpected QMP greeting: {greeting}")
        self.execute("qmp_capabilities")

    def _read(self):
        while b"\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise QMPError("QMP connection closed")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def execute(self, command, **arguments):
        msg = {"execute": command}
        if arguments:
            msg["arguments"] = arguments
        self.sock.sendall(json.dumps(msg).encode() + b"\n")
        while True:
            reply = self._read()
            if "event" in reply:
                self.events.append(reply)
                continue
            if "error" in reply:
                raise QMPError(f"{command}: {reply['error'].get('desc', reply['error'])}")
            return reply.get("return")

    def event_times(self, name):
        """Host times (s) of the events called `name` received so far."""
        return [e["timestamp"]["seconds"] + e["timestamp"]["microseconds"] / 1e6
                for e in self.events if e.get("event") == name]

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def wait_for_path(path, timeout):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
