"""`echo2 bench broadcast`: time one snapshot broadcast to N real worker processes (paper 5.5.1,
Figure 4) over TCP, each worker in its own network namespace with tc shaping its link.

What runs (`run_bench`):

* a **learner process** (`python -m echo2.bench.broadcast`, `learner_main`): a coordinator without a
  model (a state with a dummy replay buffer), listening on the learner host's address. It waits for
  the N workers to register, publishes a small random warm-up version (an eighth of M) and waits
  until every worker installed it, then publishes a random M-MB snapshot and waits (bounded) until
  every worker reported installing it. T_bcast at q = 0.9 and q = 1 is the coordinator's own
  measurement, from publication to install report (control/broadcast.py). It prints one JSON line
  and exits.
* **N broadcast-only workers** (`python -m echo2.broadcast.peer --inbound`): each registers as a
  relay, follows the published versions, receives each from the parent the coordinator names,
  relays it to its child while receiving, and reports the install.

Shaping with network namespaces (`ShapedNetwork.available()`: root, iproute2, a kernel with TBF;
HTB is assumed too, and a kernel without it fails the run with the tc error). The learner is the network's learner host and worker i is host i. Each worker's link is
shaped at Bw in both directions by TBF (echo2.bench.netns). The learner's link is shaped at B0 in
both directions; its upload by HTB with one class (and queue) per worker under the B0 cap, so the
streams share the uplink fairly, as the coordinator's token bucket shares it in-process (a TBF has
a single FIFO, and this kernel has no fq_codel or sfq to put under it). The shapers count wire
bytes, so TCP goodput is about 0.96 of a cap (echo2.bench.netns): the best a worker can do is
M / (0.96 Bw); the lower bound reported is M / Bw all the same.

On top, the system paces itself, as the paper's learner streams to each seed "at rate Bw": the
coordinator's uplink bucket (broadcast.uplink_mbps) at `pace` x B0 and each relay's upload bucket
(worker_upload_mbps) at `pace` x Bw, by default 0.95, just under the goodput of the links. With
`pace` 0 only TCP meets the shapers: its start-up overshoots their short queues, drops and
retransmission timeouts follow, and a stalled relay delays every worker below it for good (links
of equal rate cannot catch up), which costs several percent at N = 32 (docs/benchmarks.md).

Without namespaces (or with `--loopback`) everything runs on 127.0.0.1 and the links are the
in-process token buckets (the coordinator's uplink bucket at B0, each worker's upload and download
buckets at Bw), which count payload bytes.

The plan. Chain mode lays the workers out as N_ch = floor(B0 / Bw) chains from the configured
budgets: the rates the warm-up measured are forgotten before the measured publication, so the
coordinator's Bw estimate is the configured Bw. Star mode has the learner feed every worker.

The pure parts (`BenchSpec`, `check`, `expected`, `summarize`, `render`) hold the arithmetic
and the report; the rest starts, watches and stops processes. The learner process itself is
echo2.bench.broadcast_learner.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import re
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from echo2.broadcast.plan import (
    chain_broadcast_time,
    lower_bound,
    n_chains,
    star_broadcast_time,
)

MB = 1e6
"""--snapshot-mb is in MB (10^6 bytes), so M / Bw in seconds is snapshot_mb * 8 / worker_mbps."""
MIB = 2**20
"""--chunk-mb is in MiB, like the config's broadcast.chunk_mb."""
DEFAULT_CHUNK_MB = 4.0
"""broadcast.chunk_mb's default (echo2.config.BroadcastConfig)."""
TBF_GOODPUT = 0.96
"""TCP goodput / TBF cap measured on this kind of machine (echo2.bench.netns docstring)."""
DEFAULT_PACE = 0.95
"""Just under TBF_GOODPUT: the processes never queue more than their buckets' burst at a shaper."""
PROGRESS_TIMEOUT_S = 10.0
HEARTBEAT_S = 1.0


# ================================================================================= pure parts
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
    return "\n".join(lines)


# ================================================================================= the driver
class BenchError(RuntimeError):
    """The benchmark could not run or did not finish (the message says where it stopped)."""


def warmup_bytes(spec: BenchSpec) -> int:
    """The warm-up version: an eighth of M, at least one chunk, at most M."""
    return min(spec.snapshot_bytes, max(spec.chunk_bytes, spec.snapshot_bytes // 8))


def broadcast_timeout(spec: BenchSpec) -> float:
    """Seconds allowed for the measured broadcast: generous against the slower of the two models."""
    exp = expected(spec)
    return 60.0 + 4.0 * max(exp["star_formula_s"], exp["chain_formula_s"])


class _Lines:
    """Lines of a child's stdout, read by a thread (so waiting for one has a deadline)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.q: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:
            for line in proc.stdout:  # type: ignore[union-attr]
                self.q.put(line)
            self.q.put(None)

        threading.Thread(target=pump, daemon=True).start()

    def get(self, deadline: float) -> str | None:
        """The next line; None at end of output; TimeoutError past the deadline."""
        try:
            return self.q.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError from None


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:].strip()
    except OSError:
        return ""


def htb_uplink_commands(netns: str, dev: str, mbps: float, dest_ips: Sequence[str]) -> list[list[str]]:
    """tc commands that cap `dev`'s egress at `mbps` with HTB and give each destination its own
    class and queue, so flows to different hosts share the cap fairly (what the coordinator's own
    token bucket does in-process; a plain TBF has one FIFO, where the flows that happen to hold
    more of the queue take more of the uplink). The kernel here has no fq_codel or sfq to put
    under the TBF instead. Rates and bucket sizes follow echo2.bench.netns's TBF: a leaf's
    guaranteed rate is mbps / len(dest_ips), and any leaf may borrow up to the whole cap."""
    from echo2.bench.netns import BURST_TIME, MIN_BURST, MIN_LIMIT, QUEUE_TIME

    rate_bytes = mbps * 1e6 / 8
    burst = max(MIN_BURST, int(rate_bytes * BURST_TIME))
    limit = max(MIN_LIMIT, burst + int(rate_bytes * QUEUE_TIME))
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


def _counters(text: str) -> dict[str, int]:
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
    """Totals over the shaped network's hosts (whole run, warm-up included): TCP segments
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
            c = _counters(p.stdout)
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


def run_bench(
    spec: BenchSpec,
    *,
    loopback: bool = False,
    timeout: float | None = None,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
) -> dict[str, Any]:
    """Run the benchmark and return `summarize`'s report. Uses network namespaces when available
    (unless `loopback`), otherwise says why on `log` and uses token buckets on 127.0.0.1. Each
    broadcast may take `timeout` seconds (default `broadcast_timeout(spec)`), the workers
    30 + 2 N seconds to register. Raises BenchError if it could not run or not every worker
    installed the snapshot in time."""
    check(spec)
    from echo2.bench.netns import ShapedNetwork

    if loopback:
        ok, why = False, "--loopback"
    else:
        ok, why = ShapedNetwork.available()
    if not ok:
        log(f"network namespaces unavailable ({why}): using in-process token buckets")
    token = secrets.token_hex(16)
    timeout = broadcast_timeout(spec) if timeout is None else timeout
    register_timeout = 30.0 + 2.0 * spec.workers
    learner_args = [
        "-m",
        "echo2.bench.broadcast_learner",
        f"--workers={spec.workers}",
        f"--snapshot-bytes={spec.snapshot_bytes}",
        f"--warmup-bytes={warmup_bytes(spec)}",
        f"--chunk-bytes={spec.chunk_bytes}",
        f"--mode={spec.mode}",
        f"--uplink-budget-bps={spec.uplink_bps}",
        f"--worker-bps={spec.worker_bps}",
        f"--timeout={timeout}",
        f"--register-timeout={register_timeout}",
    ]
    env = {"ECHO2_TOKEN": token}
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="echo2-bench-bcast-") as tmp:
        logs = Path(tmp)
        if ok:
            with ShapedNetwork(spec.workers, spec.worker_mbps, spec.uplink_mbps) as net:
                ips = [h.ip for h in net.hosts]
                for cmd in htb_uplink_commands(net.learner.netns, "eth0", spec.uplink_mbps, ips):
                    p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
                    if p.returncode != 0:
                        raise BenchError(f"{' '.join(cmd)}: {(p.stderr or p.stdout).strip()}")
                setup_s = time.monotonic() - t_start

                # the system's own caps (broadcast.uplink_mbps, worker_upload_mbps), if any
                extra_l = (
                    [
                        f"--uplink-cap-bps={spec.uplink_bps * spec.pace}",
                        f"--stream-cap-bps={spec.worker_bps * spec.pace}",
                    ]
                    if spec.pace
                    else []
                )
                extra_w = [f"--upload-mbps={spec.worker_mbps * spec.pace}"] if spec.pace else []

                def start_learner() -> subprocess.Popen:
                    with (logs / "learner.log").open("w") as err:
                        return net.learner.popen(
                            net.learner.python(*learner_args, *extra_l, f"--host={net.learner_ip}"),
                            env=env,
                            stdout=subprocess.PIPE,
                            stderr=err,
                            text=True,
                        )

                def start_worker(i: int, url: str) -> subprocess.Popen:
                    h = net.host(i)
                    with (logs / f"w{i}.log").open("w") as err:
                        return h.popen(
                            h.python(*_worker_args(url, i, "0.0.0.0"), *extra_w),
                            env=env,
                            stdout=subprocess.DEVNULL,
                            stderr=err,
                        )

                measured = _drive(
                    spec, start_learner, start_worker, register_timeout + 2 * timeout, logs, stop=None
                )
                measured["net_stats"] = net_stats(net)
            backend = "netns"
        else:
            learner_args.append(f"--uplink-cap-bps={spec.uplink_bps}")
            procs: list[subprocess.Popen] = []
            from echo2.bench.netns import child_env, stop_processes

            setup_s = 0.0

            def start_learner() -> subprocess.Popen:
                with (logs / "learner.log").open("w") as err:
                    p = subprocess.Popen(
                        [sys.executable, *learner_args, "--host=127.0.0.1"],
                        env=child_env(env),
                        stdout=subprocess.PIPE,
                        stderr=err,
                        text=True,
                        start_new_session=True,
                    )
                procs.append(p)
                return p

            def start_worker(i: int, url: str) -> subprocess.Popen:
                caps = [f"--upload-mbps={spec.worker_mbps}", f"--download-mbps={spec.worker_mbps}"]
                with (logs / f"w{i}.log").open("w") as err:
                    p = subprocess.Popen(
                        [sys.executable, *_worker_args(url, i, "127.0.0.1"), *caps],
                        env=child_env(env),
                        stdout=subprocess.DEVNULL,
                        stderr=err,
                        start_new_session=True,
                    )
                procs.append(p)
                return p

            measured = _drive(
                spec,
                start_learner,
                start_worker,
                register_timeout + 2 * timeout,
                logs,
                stop=lambda: stop_processes(procs, grace=5.0),
            )
            backend = "token-bucket"
    measured["setup_s"] = setup_s
    measured["total_s"] = time.monotonic() - t_start
    return summarize(spec, measured, backend=backend, reason="" if ok else why)


def _worker_args(url: str, i: int, relay_host: str) -> list[str]:
    return [
        "-m",
        "echo2.broadcast.peer",
        f"--coordinator={url}",
        f"--name=w{i:02d}",
        "--inbound",
        f"--relay-host={relay_host}",
        "-q",
    ]  # the token comes from ECHO2_TOKEN


def _drive(
    spec: BenchSpec,
    start_learner: Callable[[], subprocess.Popen],
    start_worker: Callable[[int, str], subprocess.Popen],
    budget: float,
    logs: Path,
    stop: Callable[[], None] | None,
) -> dict[str, Any]:
    """Start the learner, then the workers once it listens; return the learner's JSON, which it
    must print within `budget` seconds (plus a margin). `stop` ends the processes (None: the shaped
    network's teardown does)."""
    try:
        learner = start_learner()
        lines = _Lines(learner)
        start_deadline = time.monotonic() + 60.0
        try:
            first = lines.get(start_deadline)
        except TimeoutError:
            raise BenchError(f"the learner did not start in 60 s: {_tail(logs / 'learner.log')}") from None
        if not first or not first.startswith("READY "):
            raise BenchError(f"the learner did not start: {first!r} {_tail(logs / 'learner.log')}")
        url = first.split()[1]
        workers = [start_worker(i, url) for i in range(spec.workers)]
        # registration + warm-up + measured broadcast, each bounded inside the learner too
        deadline = time.monotonic() + budget + 30.0
        try:
            line = lines.get(deadline)
        except TimeoutError:
            raise BenchError("the learner did not report in time") from None
        dead = [
            f"w{i:02d} (exit {w.returncode}): {_tail(logs / f'w{i}.log', 400)}"
            for i, w in enumerate(workers)
            if w.poll() is not None
        ]
        if not line:
            raise BenchError(f"the learner exited without a result: {_tail(logs / 'learner.log')}")
        result = json.loads(line)
        if "error" in result:
            raise BenchError(f"{result['error']}" + (f"; workers that exited: {dead}" if dead else ""))
        return result
    finally:
        if stop is not None:
            stop()


if __name__ == "__main__":  # the learner process lives in broadcast_learner.py
    from echo2.bench.broadcast_learner import learner_main

    sys.exit(learner_main())
