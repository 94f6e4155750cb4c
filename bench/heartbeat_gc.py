"""Benchmark: the coordinator process's garbage-collection pauses during the heartbeat bench's
stream of 4,096-record pushes, with and without `coordinator.FREEZE_HEAP` (gc.freeze at start).

One `heartbeat_load.py` stream run per setting and repeat, the same processes and CPUs; this
process (the coordinator's) records every collection's generation and duration through
`gc.callbacks`. The server process holds the bench's prebuilt honest groups, about 420,000
containers: about what a quickstart learner holds at start (400,000: torch, the model, the
tokenizer), which is what a full collection walks without the freeze.

    cd bench && python heartbeat_gc.py --server-cpus 0 --client-cpus 1 --json ../docs/bench/heartbeat_gc.json
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import heartbeat_load
from common import write_json
from procs import add_cpu_options, start_on_server_cpus

from echo2.coordinator import server as coordinator

PAUSES: list[tuple[int, float]] = []
_started: list[float] = []


def on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _started.append(time.perf_counter())
    elif _started:
        PAUSES.append((info["generation"], time.perf_counter() - _started.pop()))


def counted_from_start(start):
    """Coordinator.start, then the pauses so far forgotten: what is counted is the collections from
    the coordinator's start (its own freezing collection excluded) to the end of the run."""

    def wrapped(self, *args, **kwargs):
        url = start(self, *args, **kwargs)
        PAUSES.clear()
        return url

    return wrapped


def one_run(freeze: bool, groups, vocab_size, args) -> dict:
    coordinator.FREEZE_HEAP = freeze
    result = heartbeat_load.run_once("stream", groups, vocab_size, args)
    out = {k: result[k] for k in ("p50_ms", "p95_ms", "p99_ms", "max_ms", "heartbeats", "pushes", "loadavg")}
    for g in (0, 1, 2):
        ms = [s * 1e3 for gen, s in PAUSES if gen == g]
        out[f"gen{g}"] = {
            "n": len(ms),
            "total_ms": sum(ms),
            "median_ms": statistics.median(ms) if ms else None,
            "max_ms": max(ms, default=None),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--groups", type=int, default=6144)
    p.add_argument("--json")
    add_cpu_options(p)
    args = p.parse_args()
    result = start_on_server_cpus(args)
    run_args = argparse.Namespace(
        beaters=50, beat_interval=0.5, pushers=2, seconds=15.0, load_nice=10, client_cpus=args.client_cpus
    )
    groups, vocab_size = heartbeat_load.honest_groups(args.groups)
    gc.callbacks.append(on_gc)
    coordinator.Coordinator.start = counted_from_start(coordinator.Coordinator.start)
    for freeze in (False, True):  # interleaved by repeat, so both see the same machine
        result[f"freeze_{'on' if freeze else 'off'}"] = []
    for _ in range(args.repeats):
        for freeze in (False, True):
            run = one_run(freeze, groups, vocab_size, run_args)
            result[f"freeze_{'on' if freeze else 'off'}"].append(run)
            print(
                f"freeze {'on ' if freeze else 'off'}: heartbeat p95 {run['p95_ms']:.1f} ms, max "
                f"{run['max_ms']:.1f} ms; full collections {run['gen2']['n']}, median "
                f"{run['gen2']['median_ms'] or 0:.1f} ms, max {run['gen2']['max_ms'] or 0:.1f} ms",
                flush=True,
            )
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
