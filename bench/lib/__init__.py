"""Shared helpers for the scripts under bench/: a QMP client, two-host network
namespaces with a veth link, raw TCP baselines with iperf3, where the machine's
vCPUs sit around a run, and a Linux guest (Debian's kernel plus a tiny
initramfs) for runs against QEMU."""
