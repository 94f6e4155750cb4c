"""tc command lines for the shaped network (pure: builds argv lists, runs nothing): a host's caps
(`Shape`), a TBF per direction of a link (`tbf_args`), and HTB on the learner's uplink with one
class per destination (`htb_uplink_commands`). netns.py runs them; the choice of burst and queue
sizes is explained in its docstring.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MIN_BURST = 64 * 1024  # bytes: at least one 64 KiB GSO super-packet
BURST_TIME = 0.001  # seconds of traffic at the shaped rate
QUEUE_TIME = 0.050  # seconds of traffic TBF may queue behind the bucket
MIN_LIMIT = 128 * 1024  # bytes

Rate = float | int | None


@dataclass(frozen=True)
class Shape:
    """Caps of one host's link in Mbit/s: up = host -> bridge, down = bridge -> host; None = unshaped."""

    up_mbps: float | None = None
    down_mbps: float | None = None

    @classmethod
    def of(cls, spec: Shape | Rate | tuple[Rate, Rate]) -> Shape:
        """A Shape from a Shape, one rate for both directions, or an (up, down) pair."""
        if isinstance(spec, Shape):
            return spec
        if isinstance(spec, tuple):
            up, down = spec
            return cls(_rate(up), _rate(down))
        return cls(_rate(spec), _rate(spec))


def _rate(x: Rate) -> float | None:
    if x is None:
        return None
    x = float(x)
    if not x > 0:
        raise ValueError(f"rate must be > 0 Mbit/s or None, got {x}")
    return x


def _bucket(mbps: float) -> tuple[int, int]:
    """(burst, limit) in bytes for a shaper at `mbps` (netns.py docstring)."""
    rate_bytes = mbps * 1e6 / 8
    burst = max(MIN_BURST, int(rate_bytes * BURST_TIME))
    return burst, max(MIN_LIMIT, burst + int(rate_bytes * QUEUE_TIME))


def tbf_args(mbps: float) -> list[str]:
    """tc arguments (after `root`) for a TBF at `mbps` Mbit/s."""
    burst, limit = _bucket(mbps)
    return ["tbf", "rate", f"{int(round(mbps * 1e6))}bit", "burst", str(burst), "limit", str(limit)]


def htb_uplink_commands(netns: str, dev: str, mbps: float, dest_ips: Sequence[str]) -> list[list[str]]:
    """tc commands that cap `dev`'s egress at `mbps` with HTB and give each destination its own
    class and queue, so flows to different hosts share the cap fairly (what the coordinator's own
    token bucket does in-process; a plain TBF has one FIFO, where the flows that happen to hold
    more of the queue take more of the uplink). The kernel here has no fq_codel or sfq to put
    under the TBF instead. Rates and bucket sizes follow the TBF's: a leaf's guaranteed rate is
    mbps / len(dest_ips), and any leaf may borrow up to the whole cap."""
    burst, limit = _bucket(mbps)
    cap = f"{int(round(mbps * 1e6))}bit"
    share = f"{max(1, int(mbps * 1e6 / max(1, len(dest_ips))))}bit"
    buckets = f"burst {burst} cburst {burst} quantum 65536"
    lines = [
        f"qdisc replace dev {dev} root handle 1: htb default 2",
        f"class add dev {dev} parent 1: classid 1:1 htb rate {cap} ceil {cap} {buckets}",
        f"class add dev {dev} parent 1:1 classid 1:2 htb rate {share} ceil {cap} {buckets}",
        f"qdisc add dev {dev} parent 1:2 bfifo limit {limit}",
    ]
    for i, ip in enumerate(dest_ips):
        cls = f"1:{i + 16:x}"
        lines += [
            f"class add dev {dev} parent 1:1 classid {cls} htb rate {share} ceil {cap} {buckets}",
            f"qdisc add dev {dev} parent {cls} bfifo limit {limit}",
            f"filter add dev {dev} parent 1: protocol ip prio 1 u32 match ip dst {ip}/32 flowid {cls}",
        ]
    return [["tc", "-n", netns, *line.split()] for line in lines]
