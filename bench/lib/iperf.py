"""Raw TCP throughput between two hosts of a TwoHosts testbed (iperf3)."""

import json

from . import netns


def raw_tcp_gbps(tb, streams, seconds=4, src="a", dst="b", port=5201):
    server = tb.popen(dst, ["iperf3", "-s", "-1", "-p", str(port)],
                      stdout=open("/dev/null", "w"), stderr=open("/dev/null", "w"))
    try:
        netns.wait_port(tb, dst, port)
        r = tb.run(src, ["iperf3", "-c", tb.addr(dst), "-p", str(port), "-P", str(streams),
                         "-t", str(seconds), "-J"])
        if r.returncode != 0:
            raise RuntimeError(f"iperf3 failed: {r.stdout[-500:]} {r.stderr[-500:]}")
        end = json.loads(r.stdout)["end"]
        return end["sum_received"]["bits_per_second"] / 1e9
    finally:
        tb.kill(server)
