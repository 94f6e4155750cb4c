"""What the kernel counts, read for the benchmarks' reports: CPU time of the whole machine
(/proc/stat) and of a set of processes (/proc/PID/stat), TCP counters (/proc/net/snmp, netstat)
and the shapers' drops (`tc -s`) over a shaped network's hosts. Reads only; changes nothing, and
knows nothing about what the processes are.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from pathlib import Path
from typing import Any


def cpu_times() -> tuple[float, float] | None:
    """(busy, total) jiffies of all CPUs from /proc/stat; None where there is none."""
    try:
        fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    return sum(fields) - idle, sum(fields)


def busy(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    """Fraction of all CPUs busy between two `cpu_times()` readings; None if either is missing."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def procs_cpu(marker: str) -> float:
    """CPU seconds (user + system) used so far by this process and every process whose command line
    contains `marker` (the workers name the coordinator's URL on theirs)."""
    total, tick, me = 0.0, os.sysconf("SC_CLK_TCK"), str(os.getpid())
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if d.name != me and marker.encode() not in (d / "cmdline").read_bytes():
                continue
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        except (OSError, ValueError, IndexError):
            continue
    return total


def counters(text: str) -> dict[str, int]:
    """`Prefix: name name ...` / `Prefix: value value ...` line pairs (/proc/net/snmp, netstat)."""
    out: dict[str, int] = {}
    lines = text.splitlines()
    for head, vals in zip(lines[::2], lines[1::2], strict=False):
        prefix, _, names = head.partition(":")
        for name, val in zip(names.split(), vals.partition(":")[2].split(), strict=False):
            with contextlib.suppress(ValueError):
                out[f"{prefix}.{name}"] = int(val)
    return out


def net_stats(net: Any) -> dict[str, int]:
    """Totals over a ShapedNetwork's hosts (whole run, warm-up included): TCP segments
    retransmitted, retransmission timeouts, tail-loss probes, and packets the shapers dropped."""
    totals = {"retrans_segs": 0, "tcp_timeouts": 0, "loss_probes": 0, "qdisc_drops": 0}
    keys = {
        "retrans_segs": "Tcp.RetransSegs",
        "tcp_timeouts": "TcpExt.TCPTimeouts",
        "loss_probes": "TcpExt.TCPLossProbes",
    }
    for h in net.all_hosts():
        try:
            p = h.run(["cat", "/proc/net/snmp", "/proc/net/netstat"], timeout=10)
            c = counters(p.stdout)
            for k, name in keys.items():
                totals[k] += c.get(name, 0)
            for argv in (
                ["tc", "-s", "-n", h.netns, "qdisc", "show", "dev", "eth0"],
                ["tc", "-s", "qdisc", "show", "dev", h.veth],
            ):
                out = subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout
                totals["qdisc_drops"] += sum(int(x) for x in re.findall(r"dropped (\d+)", out))
        except (OSError, subprocess.SubprocessError):
            continue
    return totals
