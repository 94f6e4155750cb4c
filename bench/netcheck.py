"""Checks of a shaped network, for tests and the self-check (`python bench/netcheck.py`): TCP
transfers between hosts measured against their caps, loopback and reachability, and what a run
left behind (`leftovers`, `purge_stale` for networks of SIGKILLed runs; never run automatically).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from netns import PREFIX, ShapedNetwork, install_cleanup
from netns_host import Host, NetnsError, run

_TCP_SCRIPT = Path(__file__).resolve().with_name("tcp_transfer.py")


def leftovers(prefix: str = PREFIX) -> list[str]:
    """Namespaces and root-namespace links whose names start with `prefix`."""
    out = [n.split()[0] for n in run(["ip", "netns", "list"]).stdout.splitlines() if n.startswith(prefix)]
    for line in run(["ip", "-o", "link", "show"]).stdout.splitlines():
        m = re.match(r"\d+:\s+([^:@\s]+)", line)
        if m and m.group(1).startswith(prefix):
            out.append(m.group(1))
    return out


def purge_stale() -> list[str]:
    """Delete namespaces and links named e2b-<pid>... whose process no longer exists (left by a
    SIGKILLed run); returns the names deleted. Live processes' networks are never touched."""
    gone: list[str] = []
    for name in leftovers(PREFIX):
        m = re.match(rf"{PREFIX}(\d+)", name)
        if not m or _pid_alive(int(m.group(1))):
            continue
        is_ns = name in run(["ip", "netns", "list"]).stdout.split()
        argv = ["ip", "netns", "del", name] if is_ns else ["ip", "link", "del", name]
        if run(argv, check=False).returncode == 0:
            gone.append(name)
    return gone


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def measure_tcp(sender: Host, receiver: Host, nbytes: int, *, timeout: float = 60.0) -> dict[str, float]:
    """Send `nbytes` over one TCP connection from `sender` to `receiver` (pure-Python sockets, one
    process in each namespace). Returns the receiver's view: bytes, seconds (first to last byte),
    mbps over that span (TCP goodput), steady_mbps over the last 80% of the bytes (the bucket starts
    full)."""
    return measure_tcp_many([(sender, receiver)], nbytes, timeout=timeout)[0]


def measure_tcp_many(
    pairs: Sequence[tuple[Host, Host]], nbytes: int, *, timeout: float = 60.0
) -> list[dict[str, float]]:
    """Like measure_tcp, with all (sender, receiver) transfers running at the same time; one result
    per pair, plus "start"/"end" (perf_counter of the receiver's first and last byte, comparable
    across pairs: one host clock)."""
    procs: list[subprocess.Popen] = []
    try:
        rxs = []
        for _, receiver in pairs:
            rx = receiver.popen(
                [sys.executable, str(_TCP_SCRIPT), "recv", receiver.ip, "0"],
                stdout=subprocess.PIPE,
                text=True,
            )
            procs.append(rx)
            rxs.append(rx)
        ports = []
        for rx in rxs:
            line = rx.stdout.readline()  # type: ignore[union-attr]
            if not line.startswith("READY "):
                raise NetnsError(f"receiver did not start: {line!r}")
            ports.append(int(line.split()[1]))
        txs = []
        for (sender, receiver), port in zip(pairs, ports, strict=True):
            tx = sender.popen(
                [sys.executable, str(_TCP_SCRIPT), "send", receiver.ip, str(port), str(nbytes)],
                stdout=subprocess.PIPE,
                text=True,
            )
            procs.append(tx)
            txs.append(tx)
        deadline = time.monotonic() + timeout
        results = []
        for rx, tx in zip(rxs, txs, strict=True):
            out, _ = rx.communicate(timeout=max(0.1, deadline - time.monotonic()))
            tx.communicate(timeout=max(0.1, deadline - time.monotonic()) + 10.0)
            if rx.returncode != 0 or tx.returncode != 0:
                raise NetnsError(
                    f"transfer failed: receiver exit {rx.returncode}, sender exit {tx.returncode}"
                )
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def loopback_ok(host: Host) -> bool:
    code = (
        "import socket;s=socket.socket();s.bind(('127.0.0.1',0));s.listen(1);"
        "c=socket.create_connection(s.getsockname());a,_=s.accept();c.sendall(b'ping');"
        "print(a.recv(4).decode())"
    )
    p = host.run([sys.executable, "-c", code], timeout=10)
    return p.returncode == 0 and p.stdout.strip() == "ping"


def reachable(src: Host, dst: Host) -> bool:
    try:
        r = measure_tcp(src, dst, 64 * 1024, timeout=10.0)
    except (NetnsError, subprocess.SubprocessError, ValueError):
        return False
    return r.get("bytes") == 64 * 1024


def _cap(sender: Host, receiver: Host) -> float | None:
    caps = [c for c in (sender.shape.up_mbps, receiver.shape.down_mbps) if c is not None]
    return min(caps) if caps else None


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python bench/netcheck.py",
        description="Self-check: build a shaped network, check reachability and loopback, measure "
        "TCP rates against the caps, tear down.",
    )
    ap.add_argument("--hosts", type=int, default=3)
    ap.add_argument(
        "--mbps", default="40", help="host cap in Mbit/s; a comma list (e.g. 5,20,40,100) sweeps rates"
    )
    ap.add_argument("--learner-mbps", type=float, default=None, help="learner cap (default: same as --mbps)")
    ap.add_argument("--mb", type=float, default=5.0, help="MB per transfer (default 5)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = ap.parse_args(argv)
    ok, why = ShapedNetwork.available()
    if not ok:
        print(f"shaped network not available: {why}", file=sys.stderr)
        return 2
    rates = [float(x) for x in args.mbps.split(",")]
    if args.hosts < 2:
        ap.error("--hosts must be >= 2")
    nbytes = int(args.mb * 1e6)
    install_cleanup()
    report: dict[str, Any] = {"runs": []}
    say = (lambda *a: None) if args.json else print
    t0 = time.monotonic()
    with ShapedNetwork(args.hosts, rates[0], args.learner_mbps or rates[0]) as net:
        say(f"bridge {net.bridge} {net.bridge_ip}/16 (setup {time.monotonic() - t0:.2f}s)")
        for h in net.all_hosts():
            say(f"  {h.name:8s} {h.ip:12s} netns {h.netns:18s} veth {h.veth}")
        lo = {h.name: loopback_ok(h) for h in net.all_hosts()}
        reach = {h.name: reachable(h, net.learner) for h in net.hosts}
        reach["learner->h0"] = reachable(net.learner, net.hosts[0])
        report.update(subnet=net.subnet, learner_ip=net.learner_ip, loopback=lo, reach_learner=reach)
        say(f"loopback inside each namespace: {lo}")
        say(f"hosts -> learner over the bridge: {reach}")
        for r in rates:
            for h in net.hosts:
                net.reshape(h, r)
            net.reshape(net.learner, args.learner_mbps or r)
            for src, dst in ((net.hosts[0], net.hosts[1]), (net.learner, net.hosts[-1])):
                cap = _cap(src, dst)
                m = measure_tcp(src, dst, nbytes)
                row = {"from": src.name, "to": dst.name, "cap_mbps": cap, **m}
                if cap:
                    row["ratio"] = m["mbps"] / cap
                report["runs"].append(row)
                say(
                    f"{src.name:>7s} -> {dst.name:3s} cap {cap or 0:7.1f} Mbit/s: {m['mbps']:7.1f} Mbit/s "
                    f"({m['mbps'] / cap if cap else 0:5.3f}x; steady {m.get('steady_mbps', 0):7.1f}) "
                    f"{m['bytes'] / 1e6:.1f} MB in {m['seconds']:.2f}s"
                )
            # the learner's upload shared by all hosts at once (star broadcast)
            ms = measure_tcp_many([(net.learner, h) for h in net.hosts], nbytes)
            span = max(m["end"] for m in ms) - min(m["start"] for m in ms)
            agg = sum(m["bytes"] for m in ms) * 8 / span / 1e6
            downs = [h.shape.down_mbps for h in net.hosts]
            caps = [c for c in (net.learner.shape.up_mbps, None if None in downs else sum(downs)) if c]
            cap = min(caps) if caps else None
            row = {"from": "learner", "to": "all", "cap_mbps": cap, "mbps": agg, "seconds": span}
            row["per_host_mbps"] = [m["mbps"] for m in ms]
            if cap:
                row["ratio"] = agg / cap
            report["runs"].append(row)
            say(
                f"learner -> all cap {cap or 0:7.1f} Mbit/s: {agg:7.1f} Mbit/s "
                f"({agg / cap if cap else 0:5.3f}x) aggregate; per host "
                + " ".join(f"{m['mbps']:.1f}" for m in ms)
            )
    report["leftovers"] = leftovers(net.prefix)
    say(f"teardown done; leftovers with {net.prefix}: {report['leftovers'] or 'none'}")
    if args.json:
        print(json.dumps(report))
    bad = not all(lo.values()) or not all(reach.values()) or report["leftovers"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
