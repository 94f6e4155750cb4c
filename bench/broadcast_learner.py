"""The learner side of the broadcast benchmark, as its own process (`python
bench/broadcast_learner.py`, started by the driver in broadcast.py): a coordinator without a model
publishes a random warm-up version and then the measured M-byte snapshot, waits for the install
reports, and prints one JSON object with T_bcast at q = 0.9 and 1 and its diagnostics.

The coordinator's publisher is a `BenchPublisher`, a Publisher that also records when each worker
first asked for its parent, how long its chunk streams took and when it reported a parent; it
changes no decision the state makes. With `--throttle` it names the forwarder the driver is to
throttle (`THROTTLE <name> <chain>` on stdout) and publishes one more version after the measured
one, whose T_bcast shows the next plan.

With `--changed-fraction F` the two publications are a base and its successor (delta_pair.py:
bf16 safetensors of the same tensors, F of the elements moved by one ulp) instead of random bytes:
the warm-up publishes the M-byte base, every worker installs it, then the successor is measured.
With `--delta` the coordinator publishes the delta beside it (`broadcast.delta`), and the workers,
holding the base, receive the delta; the codec's delta / full ratio is measured before publishing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from broadcast_report import HEARTBEAT_S, MB, PROGRESS_TIMEOUT_S
from procstat import busy, cpu_times, procs_cpu

from echo2.broadcast.tracker import BroadcastPolicy
from echo2.config import SLOW_RELAY_FRACTION, CoordinatorConfig
from echo2.coordinator.leases import Limits, Work
from echo2.coordinator.publisher import Publisher
from echo2.coordinator.state import CoordinatorState
from echo2.data.buffer import ReplayBuffer


class BenchPublisher(Publisher):
    """A publisher that also records, for each (worker id, version), when the worker first asked
    for its parent (`routed`, monotonic seconds) and how long its chunk streams took (`streamed`,
    seconds, from its install report); both are read under the state's lock. Every decision is
    Publisher's."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.routed: dict[tuple[str, int], float] = {}
        self.streamed: dict[tuple[str, int], float] = {}
        self.reported: list[tuple[str, int, str | None, str, str, float]] = []
        """(worker id, version, parent id, reason, detail, monotonic seconds) of every failure report."""

    def route(self, worker_id: str, version: int, **form) -> tuple[str | None, str | None, str]:
        with self.shared.lock:
            self.routed.setdefault((worker_id, version), time.monotonic())
            return super().route(worker_id, version, **form)

    def report_failure(
        self, worker_id: str, version: int, parent_id: str | None, reason: str, detail: str = ""
    ) -> tuple[str | None, str | None, str]:
        with self.shared.lock:
            self.reported.append((worker_id, version, parent_id, reason, detail[:200], time.monotonic()))
            return super().report_failure(worker_id, version, parent_id, reason, detail)

    def report_installed(
        self, worker_id: str, version: int, sha256: str, transfers: list[tuple[str | None, int, float]]
    ) -> None:
        with self.shared.lock:
            self.streamed[(worker_id, version)] = sum(t[2] for t in transfers)
            super().report_installed(worker_id, version, sha256, transfers)


def bench_state(
    *,
    mode: str,
    chunk_bytes: int,
    uplink_budget_bps: float,
    worker_bps: float,
    timeout: float,
    slow_relay_fraction: float = SLOW_RELAY_FRACTION,
    delta: bool = False,
) -> CoordinatorState:
    """The learner's state, with a `BenchPublisher`: no model (a dummy replay buffer and limits),
    broadcasts planned from the configured budgets, and workers kept while a broadcast of `timeout`
    seconds runs."""
    return CoordinatorState(
        CoordinatorConfig(
            lease_timeout=600.0, heartbeat_timeout=max(120.0, timeout), max_leases_per_worker=4
        ),
        work=Work(
            buffer=ReplayBuffer(staleness=1, group_size=1),
            limits=Limits(vocab_size=2, max_prompt_tokens=1, max_new_tokens=1, group_size=1),
            group_id_of=str,
        ),
        publisher=BenchPublisher,
        broadcast=BroadcastPolicy(
            mode=mode,
            chunk_size=chunk_bytes,
            uplink_budget_bps=uplink_budget_bps,
            worker_bps=worker_bps,
            slow_relay_fraction=slow_relay_fraction,
            delta=delta,
        ),
    )


def learner_main(argv: Sequence[str] | None = None) -> int:
    """The learner side, as its own process: see the module docstring. Prints `READY <url>` once
    listening, then one JSON object with what it measured."""
    p = argparse.ArgumentParser(prog="python bench/broadcast_learner.py", description=learner_main.__doc__)
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
    p.add_argument("--slow-relay-fraction", type=float, default=SLOW_RELAY_FRACTION)
    p.add_argument(
        "--throttle",
        action="store_true",
        help="after the measured publication print `THROTTLE <name> <chain>` (the forwarder of the "
        "first chain with a child, for the driver to throttle), and publish one more version after it",
    )
    p.add_argument(
        "--changed-fraction",
        type=float,
        default=None,
        help="publish a base and its successor with this fraction of the bf16 elements changed "
        "(delta_pair.py) instead of random bytes",
    )
    p.add_argument("--seed", type=int, default=0, help="the base/successor pair's seed")
    p.add_argument("--delta", action="store_true", help="broadcast.delta: publish deltas")
    p.add_argument("--register-timeout", type=float, default=120.0)
    p.add_argument("--timeout", type=float, required=True, help="seconds allowed for each broadcast")
    args = p.parse_args(argv)
    token = os.environ.get("ECHO2_TOKEN")
    if not token:
        p.error("ECHO2_TOKEN is not set")

    import logging

    logging.basicConfig(level=logging.WARNING)
    from echo2.coordinator.registry import WorkerStatus
    from echo2.coordinator.server import Coordinator

    state = bench_state(
        mode=args.mode,
        chunk_bytes=args.chunk_bytes,
        uplink_budget_bps=args.uplink_budget_bps,
        worker_bps=args.worker_bps,
        timeout=args.timeout,
        slow_relay_fraction=args.slow_relay_fraction,
        delta=args.delta,
    )
    run_info = {
        "broadcast": {
            "progress_timeout_s": PROGRESS_TIMEOUT_S,
            "worker_upload_mbps": None,  # workers get their caps on their own command line
            "worker_download_mbps": None,
            "min_relay_mbps": 0.0,  # as before the run view was typed: the bench's relays have no stall floor
        }
    }
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
            with state.shared.lock:
                live = sum(w.status is WorkerStatus.ACTIVE for w in state.registry.workers.values())
            if live >= args.workers:
                break
            if time.monotonic() > deadline:
                result["error"] = f"only {live} of {args.workers} workers registered"
                return _emit(result, 1)
            time.sleep(0.05)

        snapshots: dict[int, bytes] = {}
        if args.changed_fraction is not None:  # the warm-up is the base, the measured its successor
            snapshots = successor_pair(args.snapshot_bytes, args.changed_fraction, args.seed, result)

        def broadcast(version: int, nbytes: int, announce: bool = False) -> dict[str, Any]:
            data = snapshots.get(version) or os.urandom(nbytes)
            with state.shared.lock:
                sent0 = state.publisher.bcast.bytes_served
            cpu0, ours0, t0 = cpu_times(), procs_cpu(url), time.monotonic()
            state.publisher.publish(version, data, keep=2)
            t0_mono = time.monotonic()
            if announce:  # the forwarder of the first chain with a child, for the driver to throttle
                with state.shared.lock:
                    names = {w.worker_id: w.name for w in state.registry.workers.values()}
                    chain = next(c for c in state.publisher.bcast.plans[version].chains if len(c) > 1)
                print(f"THROTTLE {names[chain[0]]} {','.join(names[w] for w in chain)}", flush=True)
            deadline = time.monotonic() + args.timeout
            while time.monotonic() < deadline:
                with state.shared.lock:
                    if version in state.publisher.t_bcast_all:
                        break
                time.sleep(0.02)
            cpu1, ours1, t1 = cpu_times(), procs_cpu(url), time.monotonic()
            with state.shared.lock:
                bc = state.publisher.bcast
                names = {w.worker_id: w.name for w in state.registry.workers.values()}
                t0_pub = bc.installs.published_at.get(version)
                got = bc.installs.installed_at.get(version, {})
                plan = bc.plans.get(version)
                return {
                    "t_bcast_q90_s": bc.installs.t_bcast[0.9].get(version),
                    "t_bcast_q100_s": bc.installs.t_bcast[1.0].get(version),
                    "installed": len(got),
                    "install_delays_s": sorted(round(at - t0_pub, 4) for at in got.values()),
                    "install_by_worker_s": {names.get(w, w): round(at - t0_pub, 4) for w, at in got.items()},
                    "routed_by_worker_s": {
                        names.get(w, w): round(at - t0_pub, 4)
                        for (w, v), at in state.publisher.routed.items()
                        if v == version
                    },
                    "streaming_by_worker_s": {
                        names.get(w, w): round(t, 4)
                        for (w, v), t in state.publisher.streamed.items()
                        if v == version
                    },
                    "chains": [[names.get(w, w) for w in c] for c in plan.chains] if plan else [],
                    "learner_mb_sent": (bc.bytes_served - sent0) / MB,
                    "parent_failures": dict(bc.failures),
                    "failure_reports_s": [
                        [
                            names.get(w, w),
                            names.get(p, p or "learner"),
                            reason,
                            detail,
                            round(at - t0_mono, 4),
                        ]
                        for w, v, p, reason, detail, at in state.publisher.reported
                        if v == version
                    ],
                    "bw_hat_mbps": bc.bw_hat() * 8 / 1e6,
                    "cpu_busy": busy(cpu0, cpu1),
                    "bench_cpu_cores": (ours1 - ours0) / (t1 - t0),
                    "wall_s": t1 - t0,
                    "publish_s": t0_mono - t0,
                    "snapshot_bytes": len(data),
                    "forms": dict(Counter(state.publisher.forms.get(version, {}).values())),
                    "delta_stats": dict(state.publisher.delta_stats),
                }

        warm = broadcast(0, args.warmup_bytes)
        result["warmup"] = {k: warm[k] for k in ("t_bcast_q90_s", "t_bcast_q100_s", "installed")}
        if warm["t_bcast_q100_s"] is None:
            result.update(warm)
            result["error"] = f"warm-up: {warm['installed']} of {args.workers} workers installed in time"
            return _emit(result, 1)
        with state.shared.lock:
            # N_ch from the configured budgets, not from what the (small) warm-up measured
            state.publisher.bcast.credits.rates.clear()
        time.sleep(0.5)  # the warm-up's install reports and heartbeats settle
        result.update(broadcast(1, args.snapshot_bytes, announce=args.throttle))
        result["loadavg"] = list(os.getloadavg())
        if result["t_bcast_q100_s"] is None:
            result["error"] = (
                f"{result['installed']} of {args.workers} workers installed in {args.timeout:g}s"
            )
            return _emit(result, 1)
        if args.throttle:  # the next plan, with the throttled worker still slow
            with state.shared.lock:
                names = {w.worker_id: w.name for w in state.registry.workers.values()}
                result["demoted"] = sorted(
                    names[w] for w, st in state.publisher.bcast.stats.items() if st.demoted
                )
                result["chains_after"] = [
                    [names[w] for w in c] for c in state.publisher.bcast.plans[1].chains
                ]
                result["peer_mbps"] = (state.publisher.bcast.peer_bps() or 0.0) * 8 / 1e6
                state.publisher.bcast.credits.rates.clear()  # N_ch from the configured budgets again
            time.sleep(0.5)
            nxt = broadcast(2, args.snapshot_bytes)
            result["next"] = {
                k: nxt[k]
                for k in ("t_bcast_q90_s", "t_bcast_q100_s", "installed", "chains", "install_by_worker_s")
            }
        return _emit(result, 0)
    finally:
        state.close()
        server.stop()


def successor_pair(nbytes: int, fraction: float, seed: int, result: dict[str, Any]) -> dict[int, bytes]:
    """{0: the base, 1: its successor} (delta_pair.py); what the codec makes of them, measured
    before publishing, goes to stderr and into `result["delta_check"]`."""
    from delta_pair import Pair, delta_ratio

    pair = Pair(nbytes, seed)
    base, new = pair.base, pair.successor(fraction)
    check = delta_ratio(base, new)
    check.update(
        changed_fraction=fraction,
        seed=seed,
        tensors=len(pair.shapes),
        base_sha256=hashlib.sha256(base).hexdigest(),
        sha256=hashlib.sha256(new).hexdigest(),
    )
    result["delta_check"] = check
    print(
        f"successor: {100 * fraction:.3f}% of the elements changed; delta {check['delta_bytes']} B / "
        f"full {check['full_bytes']} B = {100 * check['ratio']:.3f}%",
        file=sys.stderr,
        flush=True,
    )
    return {0: base, 1: new}


def _emit(result: dict[str, Any], code: int) -> int:
    print(json.dumps(result), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(learner_main())
