"""The broadcast benchmark's arithmetic and report (pure: no processes, no I/O): what a run is
(`BenchSpec`, `check`), what the model predicts for it (`expected`, from broadcast/plan.py), how
long it may take (`broadcast_timeout`), and the report (`summarize`, `render`). broadcast.py runs
the processes; this module does not know how.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import Any

from echo2.broadcast.plan import (
    chain_broadcast_time,
    lower_bound,
    n_chains,
    star_broadcast_time,
)
from echo2.config import SLOW_RELAY_FRACTION

MB = 1e6
"""--snapshot-mb is in MB (10^6 bytes), so M / Bw in seconds is snapshot_mb * 8 / worker_mbps."""
MIB = 2**20
"""--chunk-mb is in MiB, like the config's broadcast.chunk_mb."""
DEFAULT_CHUNK_MB = 4.0
"""broadcast.chunk_mb's default (echo2.config.BroadcastConfig)."""
TBF_GOODPUT = 0.96
"""TCP goodput / TBF cap measured on this kind of machine (netns.py docstring)."""
DEFAULT_PACE = 0.95
"""Just under TBF_GOODPUT: the processes never queue more than their buckets' burst at a shaper."""
PROGRESS_TIMEOUT_S = 10.0
HEARTBEAT_S = 1.0


@dataclass(frozen=True, slots=True)
class BenchSpec:
    workers: int
    """N, the number of worker processes."""
    snapshot_mb: float
    """M in MB (10^6 bytes)."""
    uplink_mbps: float
    """B0, the learner's uplink, Mbit/s."""
    worker_mbps: float
    """Bw, each worker's link (both directions), Mbit/s."""
    mode: str = "chain"
    chunk_mb: float = DEFAULT_CHUNK_MB
    """Chunk size in MiB."""
    pace: float = DEFAULT_PACE
    """With namespaces: the learner's and the relays' own upload caps (the in-process token buckets
    of broadcast.uplink_mbps, learner_stream_mbps at Bw, and worker_upload_mbps) as a fraction of
    the shaped rates; 0: none
    (TCP alone against the tc shapers). Without namespaces the buckets are the links (1.0)."""
    throttle: float | None = None
    """With namespaces: `throttle_after_s` after the measured publication, the forwarder of the
    first chain (a seed with a child) has its upload shaped down to this fraction of Bw, for good;
    one more version is published after the measured one, to show the next plan. None: no throttle."""
    throttle_after_s: float = 2.0
    slow_relay_fraction: float = SLOW_RELAY_FRACTION
    """broadcast.slow_relay_fraction of the learner (0: no demotion of slow relays)."""
    changed_fraction: float | None = None
    """The warm-up is an M-byte bf16 base and the measured version its successor with this fraction
    of the elements changed by one ulp (delta_pair.py); None: random bytes (an eighth of M, then M)."""
    delta: bool = False
    """broadcast.delta of the learner (needs `changed_fraction`): the workers receive the delta."""
    seed: int = 0
    """The base/successor pair's seed."""

    @property
    def snapshot_bytes(self) -> int:
        return int(round(self.snapshot_mb * MB))

    @property
    def chunk_bytes(self) -> int:
        return max(1, int(self.chunk_mb * MIB))

    @property
    def uplink_bps(self) -> float:
        """B0 in bytes/s."""
        return self.uplink_mbps * 1e6 / 8

    @property
    def worker_bps(self) -> float:
        """Bw in bytes/s."""
        return self.worker_mbps * 1e6 / 8

    @property
    def n_chains(self) -> int:
        """N_ch = floor(B0 / Bw) (at most N); 1 chain per worker in star mode."""
        if self.mode == "star":
            return self.workers
        return n_chains(self.uplink_bps, self.worker_bps, self.workers)


def check(spec: BenchSpec) -> None:
    """ValueError naming the flag of the first bad field."""
    if spec.workers < 1:
        raise ValueError(f"--workers: must be >= 1 (got {spec.workers})")
    for flag, value in (
        ("--snapshot-mb", spec.snapshot_mb),
        ("--uplink-mbps", spec.uplink_mbps),
        ("--worker-mbps", spec.worker_mbps),
        ("--chunk-mb", spec.chunk_mb),
    ):
        if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
            raise ValueError(f"{flag}: must be a number > 0 (got {value})")
    if not (isinstance(spec.pace, int | float) and 0 <= spec.pace <= 1):
        raise ValueError(f"--pace: must be in [0, 1] (got {spec.pace})")
    if spec.mode not in ("chain", "star"):
        raise ValueError(f"--mode: must be 'chain' or 'star' (got {spec.mode!r})")
    if spec.snapshot_bytes < 1:
        raise ValueError(f"--snapshot-mb: {spec.snapshot_mb} MB is less than one byte")
    if spec.workers > 1000:
        raise ValueError(f"--workers: at most 1000 (got {spec.workers})")
    if spec.throttle is not None and not (math.isfinite(spec.throttle) and 0 < spec.throttle <= 1):
        raise ValueError(f"--throttle: must be in (0, 1] (got {spec.throttle})")
    if spec.throttle is not None and spec.mode != "chain":
        raise ValueError("--throttle: needs --mode chain (a star has no forwarder)")
    if not (math.isfinite(spec.throttle_after_s) and spec.throttle_after_s >= 0):
        raise ValueError(f"--throttle-after: must be >= 0 (got {spec.throttle_after_s})")
    if spec.changed_fraction is not None and not 0 <= spec.changed_fraction <= 1:
        raise ValueError(f"--changed-fraction: must be in [0, 1] (got {spec.changed_fraction})")
    if spec.changed_fraction is not None and spec.throttle is not None:
        raise ValueError("--throttle: not with a base and successor (--changed-fraction, --delta-ratio)")
    if spec.delta and spec.changed_fraction is None:
        raise ValueError("delta: needs a base and successor (--changed-fraction or --delta-ratio)")
    if not 0 <= spec.slow_relay_fraction < 1:
        raise ValueError(f"--slow-relay-fraction: must be in [0, 1) (got {spec.slow_relay_fraction})")


def expected(spec: BenchSpec) -> dict[str, float | int]:
    """The model's times for this spec, in seconds (DESIGN.md "Broadcast time"; broadcast/plan.py):

    * lower_bound_s = M / Bw: no worker downloads faster than its own link (fluid model, B0 >= Bw);
    * star_fluid_s = N * M / B0: the learner's uplink sends N copies;
    * star_formula_s = M / min(B0 / N, Bw), the star's fluid time (the larger of the two above);
    * chain_formula_s = (K + L - 1) * c / Bw with L = ceil(N / N_ch) hops, K = ceil(M / c)
      chunks of c bytes and no per-hop delay (a veth has none worth counting): the store-and-forward
      pipeline, each hop one chunk behind its parent.
    """
    m, bw, b0, n = spec.snapshot_bytes, spec.worker_bps, spec.uplink_bps, spec.workers
    n_ch = n_chains(b0, bw, n)
    return {
        "n_chains": spec.n_chains,
        "hops": math.ceil(n / n_ch) if spec.mode == "chain" else 1,
        "chunks": math.ceil(m / spec.chunk_bytes),
        "lower_bound_s": lower_bound(m, bw),
        "star_fluid_s": n * m / b0,
        "star_formula_s": star_broadcast_time(n, m, b0, bw),
        "chain_formula_s": chain_broadcast_time(n, n_ch, m, spec.chunk_bytes, bw, 0.0),
    }


def summarize(spec: BenchSpec, measured: dict[str, Any], *, backend: str, reason: str = "") -> dict[str, Any]:
    """One flat report: the spec, the model's times, what the learner measured, and the ratios of
    T_bcast to the lower bound M / Bw. `backend` is "netns" (tc TBF) or "token-bucket"."""
    exp = expected(spec)
    t90, t100 = measured.get("t_bcast_q90_s"), measured.get("t_bcast_q100_s")
    lb = exp["lower_bound_s"]
    out: dict[str, Any] = {
        **asdict(spec),
        "backend": backend,
        "shaping": (
            "tc per namespace link (TBF; HTB on the learner's uplink)"
            if backend == "netns"
            else "in-process token buckets on 127.0.0.1"
        ),
        "pace": spec.pace if backend == "netns" else None,
        "goodput_factor": TBF_GOODPUT if backend == "netns" else 1.0,
        **exp,
        "t_bcast_q90_s": t90,
        "t_bcast_q100_s": t100,
        "ratio_q90": None if t90 is None else t90 / lb,
        "ratio_q100": None if t100 is None else t100 / lb,
        "formula_s": exp["chain_formula_s"] if spec.mode == "chain" else exp["star_formula_s"],
        "installed": measured.get("installed", 0),
        "ok": t100 is not None and measured.get("installed", 0) == spec.workers,
    }
    if reason:
        out["fallback_reason"] = reason
    for k, v in measured.items():
        out.setdefault(k, v)
    return out


def render(s: dict[str, Any]) -> str:
    """The report as a few lines of text."""

    def sec(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.2f} s"

    def ratio(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    chunk = f"{s['chunk_mb']:g} MiB" if s["chunk_mb"] >= 1 else f"{s['chunk_mb'] * 1024:g} KiB"
    layout = (
        f"{s['n_chains']} chains of <= {s['hops']} hops"
        if s["mode"] == "chain"
        else f"star: the learner feeds all {s['workers']}"
    )
    lines = [
        f"snapshot broadcast, {s['mode']}: N = {s['workers']} workers, M = {s['snapshot_mb']:g} MB in "
        f"{s['chunks']} chunks of {chunk}, B0 = {s['uplink_mbps']:g} Mbit/s, "
        f"Bw = {s['worker_mbps']:g} Mbit/s ({layout}); shaping: {s['shaping']}",
        f"  T_bcast   q = 0.9: {sec(s['t_bcast_q90_s'])}   q = 1.0: {sec(s['t_bcast_q100_s'])}   "
        f"({s['installed']}/{s['workers']} installed)",
        f"  lower bound M/Bw: {sec(s['lower_bound_s'])}   ratio T_bcast(q=0.9)/(M/Bw): "
        f"{ratio(s['ratio_q90'])}   (q=1.0: {ratio(s['ratio_q100'])})",
        f"  star fluid N*M/B0: {sec(s['star_fluid_s'])}   chain formula: {sec(s['chain_formula_s'])}"
        f"   star formula: {sec(s['star_formula_s'])}",
    ]
    if s["backend"] == "netns":
        paced = (
            f"the learner and relays pace themselves at {s['pace']:g}x the shaped rates"
            if s["pace"]
            else "no pacing in the processes"
        )
        lines.append(
            f"  (tc counts wire bytes: TCP goodput is about {TBF_GOODPUT:g}x the cap, so the best "
            f"reachable is M/({TBF_GOODPUT:g} Bw) = {sec(s['lower_bound_s'] / TBF_GOODPUT)}; {paced})"
        )
    if s.get("cpu_busy") is not None:
        lines.append(
            f"  CPU during the broadcast: {100 * s['cpu_busy']:.0f}% busy of {os.cpu_count()} cores; "
            f"the benchmark's processes used {s.get('bench_cpu_cores', 0):.2f} cores"
        )
    if s.get("changed_fraction") is not None:
        dc = s.get("delta_check") or {}
        lines.append(
            f"  successor of the installed base, {100 * s['changed_fraction']:.3f}% of the elements "
            f"changed: codec delta {dc.get('delta_bytes', '?')} B = {100 * dc.get('ratio', 0):.3f}% of the "
            f"full; broadcast.delta {'on' if s['delta'] else 'off'}, forms received {s.get('forms')}, "
            f"learner sent {s.get('learner_mb_sent', 0):.3f} MB"
        )
    if s.get("throttle") is not None:
        th, nxt = s.get("throttled") or {}, s.get("next") or {}
        lines.append(
            f"  throttled: {th.get('worker', '?')} (forwarder of {th.get('chain', '?')}) to "
            f"{s['throttle']:g} Bw, {s['throttle_after_s']:g} s after publication; slow reports: "
            f"{s.get('parent_failures', {}).get('slow', 0)}, demoted: {s.get('demoted') or 'none'}; "
            f"chains after: {s.get('chains_after')}"
        )
        lines.append(
            f"  next version: T_bcast q = 0.9: {sec(nxt.get('t_bcast_q90_s'))}   q = 1.0: "
            f"{sec(nxt.get('t_bcast_q100_s'))}   chains {nxt.get('chains')}"
        )
    return "\n".join(lines)


def warmup_bytes(spec: BenchSpec) -> int:
    """The warm-up version: an eighth of M, at least one chunk, at most M (the base: M)."""
    if spec.changed_fraction is not None:
        return spec.snapshot_bytes
    return min(spec.snapshot_bytes, max(spec.chunk_bytes, spec.snapshot_bytes // 8))


def broadcast_timeout(spec: BenchSpec) -> float:
    """Seconds allowed for the measured broadcast: generous against the slower of the two models."""
    exp = expected(spec)
    slowest = exp["lower_bound_s"] / spec.throttle if spec.throttle else 0.0  # nobody demotes it
    return 60.0 + 4.0 * max(exp["star_formula_s"], exp["chain_formula_s"], slowest)
