"""The learner side of `echo2 bench broadcast`, as its own process (`python -m
echo2.bench.broadcast_learner`, started by the driver in echo2.bench.broadcast): a coordinator
without a model publishes a random warm-up version and then the measured M-byte snapshot, waits for
the install reports, and prints one JSON object with T_bcast at q = 0.9 and 1 and its diagnostics.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from echo2.bench.broadcast import HEARTBEAT_S, MB, PROGRESS_TIMEOUT_S


def _cpu_times() -> tuple[float, float] | None:
    """(busy, total) jiffies of all CPUs from /proc/stat; None where there is none."""
    try:
        fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    return sum(fields) - idle, sum(fields)


def _procs_cpu(marker: str) -> float:
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


def _busy(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def learner_main(argv: Sequence[str] | None = None) -> int:
    """The learner side, as its own process: see the module docstring. Prints `READY <url>` once
    listening, then one JSON object with what it measured."""
    p = argparse.ArgumentParser(
        prog="python -m echo2.bench.broadcast_learner", description=learner_main.__doc__
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--snapshot-bytes", type=int, required=True)
    p.add_argument("--warmup-bytes", type=int, required=True)
    p.add_argument("--chunk-bytes", type=int, required=True)
    p.add_argument("--mode", choices=("chain", "star"), required=True)
    p.add_argument("--uplink-budget-bps", type=float, required=True, help="B0 for planning, bytes/s")
    p.add_argument("--worker-bps", type=float, required=True, help="configured Bw, bytes/s")
    p.add_argument("--uplink-cap-bps", type=float, default=None, help="token-bucket uplink cap, bytes/s")
    p.add_argument(
        "--stream-cap-bps", type=float, default=None, help="token-bucket cap per learner stream, bytes/s"
    )
    p.add_argument("--register-timeout", type=float, default=120.0)
    p.add_argument("--timeout", type=float, required=True, help="seconds allowed for each broadcast")
    args = p.parse_args(argv)
    token = os.environ.get("ECHO2_TOKEN")
    if not token:
        p.error("ECHO2_TOKEN is not set")

    import logging

    logging.basicConfig(level=logging.WARNING)
    from echo2.control.broadcast import BroadcastPolicy
    from echo2.control.coordinator import Coordinator
    from echo2.control.state import CoordinatorState, Limits, WorkerStatus
    from echo2.data.buffer import ReplayBuffer

    state = CoordinatorState(
        buffer=ReplayBuffer(staleness=1, group_size=1),
        limits=Limits(vocab_size=2, max_prompt_tokens=1, max_new_tokens=1, group_size=1),
        group_id_of=str,
        lease_timeout=600.0,
        heartbeat_timeout=max(120.0, args.timeout),
        broadcast=BroadcastPolicy(
            mode=args.mode,
            chunk_size=args.chunk_bytes,
            uplink_budget_bps=args.uplink_budget_bps,
            worker_bps=args.worker_bps,
        ),
    )
    run_info = {
        "broadcast": {
            "progress_timeout_s": PROGRESS_TIMEOUT_S,
            "worker_upload_mbps": None,  # workers get their caps on their own command line
            "worker_download_mbps": None,
        }
    }
    # Diagnostics, wrapped around the state's own calls (the coordinator calls them on this object):
    # when each worker asked for its parent, and how long its chunk streams took.
    streamed: dict[tuple[str, int], float] = {}
    """(worker id, version) -> seconds its chunk streams took (from its install report)."""
    report_installed = state.report_installed

    def record(worker_id: str, version: int, sha256: str, transfers: list) -> None:
        with state.lock:  # read by the main thread under the same lock
            streamed[(worker_id, version)] = sum(t[2] for t in transfers)
            report_installed(worker_id, version, sha256, transfers)

    state.report_installed = record  # type: ignore[method-assign]
    routed: dict[tuple[str, int], float] = {}
    """(worker id, version) -> when it first asked for its parent."""
    route = state.route

    def record_route(worker_id: str, version: int):
        with state.lock:
            routed.setdefault((worker_id, version), time.monotonic())
            return route(worker_id, version)

    state.route = record_route  # type: ignore[method-assign]
    server = Coordinator(
        state,
        token=token,
        run_info=run_info,
        heartbeat_interval=HEARTBEAT_S,
        uplink_bps=args.uplink_cap_bps,
        stream_bps=args.stream_cap_bps,
    )
    result: dict[str, Any] = {}
    try:
        url = server.start(args.host, 0)
        print(f"READY {url}", flush=True)
        deadline = time.monotonic() + args.register_timeout
        while True:
            with state.lock:
                live = sum(w.status is WorkerStatus.ACTIVE for w in state.workers.values())
            if live >= args.workers:
                break
            if time.monotonic() > deadline:
                result["error"] = f"only {live} of {args.workers} workers registered"
                return _emit(result, 1)
            time.sleep(0.05)

        def broadcast(version: int, nbytes: int) -> dict[str, Any]:
            data = os.urandom(nbytes)
            with state.lock:
                sent0 = state.bcast.bytes_served
            cpu0, ours0, t0 = _cpu_times(), _procs_cpu(url), time.monotonic()
            state.publish(version, data, keep=2)
            deadline = time.monotonic() + args.timeout
            while time.monotonic() < deadline:
                with state.lock:
                    if version in state.t_bcast_all:
                        break
                time.sleep(0.02)
            cpu1, ours1, t1 = _cpu_times(), _procs_cpu(url), time.monotonic()
            with state.lock:
                bc = state.bcast
                names = {w.worker_id: w.name for w in state.workers.values()}
                t0_pub = bc.published_at.get(version)
                got = bc.installed_at.get(version, {})
                plan = bc.plans.get(version)
                return {
                    "t_bcast_q90_s": bc.t_bcast[0.9].get(version),
                    "t_bcast_q100_s": bc.t_bcast[1.0].get(version),
                    "installed": len(got),
                    "install_delays_s": sorted(round(at - t0_pub, 4) for at in got.values()),
                    "install_by_worker_s": {names.get(w, w): round(at - t0_pub, 4) for w, at in got.items()},
                    "routed_by_worker_s": {
                        names.get(w, w): round(at - t0_pub, 4)
                        for (w, v), at in routed.items()
                        if v == version
                    },
                    "streaming_by_worker_s": {
                        names.get(w, w): round(streamed[(w, v)], 4) for (w, v) in streamed if v == version
                    },
                    "chains": [[names.get(w, w) for w in c] for c in plan.chains] if plan else [],
                    "learner_mb_sent": (bc.bytes_served - sent0) / MB,
                    "parent_failures": dict(bc.failures),
                    "bw_hat_mbps": bc.bw_hat() * 8 / 1e6,
                    "cpu_busy": _busy(cpu0, cpu1),
                    "bench_cpu_cores": (ours1 - ours0) / (t1 - t0),
                    "wall_s": t1 - t0,
                }

        warm = broadcast(0, args.warmup_bytes)
        result["warmup"] = {k: warm[k] for k in ("t_bcast_q90_s", "t_bcast_q100_s", "installed")}
        if warm["t_bcast_q100_s"] is None:
            result.update(warm)
            result["error"] = f"warm-up: {warm['installed']} of {args.workers} workers installed in time"
            return _emit(result, 1)
        with state.lock:
            # N_ch from the configured budgets, not from what the (small) warm-up measured
            state.bcast.rates.clear()
        time.sleep(0.5)  # the warm-up's install reports and heartbeats settle
        result.update(broadcast(1, args.snapshot_bytes))
        result["loadavg"] = list(os.getloadavg())
        if result["t_bcast_q100_s"] is None:
            result["error"] = (
                f"{result['installed']} of {args.workers} workers installed in {args.timeout:g}s"
            )
            return _emit(result, 1)
        return _emit(result, 0)
    finally:
        state.close()
        server.stop()


def _emit(result: dict[str, Any], code: int) -> int:
    print(json.dumps(result), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(learner_main())
