"""Where the machine's two vCPUs sit, around a bench's runs.

The machine the testbeds run on is itself a virtual machine: its hypervisor
puts the two vCPUs on cores that share a cache or not, and every figure that
hands data between the CPUs follows (docs/testbed.md, "The machine under the
testbed"). `testbed-cli testbed cpu-rtt` measures it; benches take it before
and after each run and compare runs in the same state."""

import json
import subprocess


def cpu_rtt(*testbed_clis):
    """The round trip of a cache line between CPUs 0 and 1 now, as `cpu-rtt --json` prints it
    (`cpu_rtt_ns`, `shared_cache`), from the first of `testbed_clis` that has the command; None if none."""
    for tool in testbed_clis:
        r = subprocess.run([tool, "testbed", "cpu-rtt", "--iters", "20000", "--json"], text=True, capture_output=True)
        if r.returncode == 0:
            return json.loads(r.stdout)
    return None


def cache_state(before, after):
    """Where the vCPUs were through a run, from `cpu_rtt` before and after it: "shared" (a cache),
    "split", "moved" (the placement changed during the run), or None if either was not measured."""
    if not before or not after:
        return None
    states = {"shared" if x["shared_cache"] else "split" for x in (before, after)}
    return states.pop() if len(states) == 1 else "moved"
