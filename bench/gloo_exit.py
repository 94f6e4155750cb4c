"""Benchmark (a reliability check): how often a two-rank gloo job aborts at exit, ending through
interpreter teardown vs through `distributed.leave` (os._exit after flushing).

Each rank joins through `distributed.start`, exchanges orders as the learner does (object
broadcasts and an all-reduce), keeps a reference to the group past `destroy_process_group` as
FSDP2's DeviceMesh does, and ends either by returning (`teardown`) or by `distributed.leave(0)`
(`leave`, what `echo2 run` does under torchrun). A run counts as aborted when torchrun fails and a
rank printed "terminate called without an active exception". The two modes alternate, so a busy
machine loads both alike; `--busy` adds one spinning process per core for the whole run.

    python bench/gloo_exit.py --runs 40 --busy 1 --json docs/bench/gloo_exit.json
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ABORT = "terminate called without an active exception"
MODES = ("teardown", "leave")
KEPT: list = []
"""What outlives the rank's body, as FSDP2's DeviceMesh (in the model's reference cycles) does."""


def rank_body(mode: str) -> None:
    import torch
    import torch.distributed as dist

    from echo2.learning import distributed

    distributed.start(torch.device("cpu"))
    for _ in range(50):
        message = [("train", list(range(100)))] if distributed.rank() == 0 else [None]
        dist.broadcast_object_list(message, src=0)
        dist.all_reduce(torch.ones(1000))
    dist.broadcast_object_list(["stop"] if distributed.rank() == 0 else [None], src=0)
    KEPT.append(dist.group.WORLD)  # the group outlives destroy_process_group
    dist.destroy_process_group()
    if mode == "leave":
        distributed.leave(0)


def one_run(mode: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [__file__, "--rank-body", mode]
    started = time.perf_counter()
    done = subprocess.run(
        cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120
    )
    return {
        "mode": mode,
        "rc": done.returncode,
        "aborted": done.returncode != 0 and ABORT in done.stderr,
        "seconds": round(time.perf_counter() - started, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank-body", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--runs", type=int, default=40, help="runs per mode")
    ap.add_argument("--busy", type=int, default=0, help="spinning processes beside the runs")
    ap.add_argument("--json", help="write the raw runs and the counts here")
    args = ap.parse_args()
    if args.rank_body:
        rank_body(args.rank_body)
        return

    import torch
    from common import write_json
    from tqdm import tqdm

    spin = "import time\nend = time.time() + 3600\nwhile time.time() < end: pass"
    busy = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(args.busy)]
    runs = []
    try:
        for _ in tqdm(range(args.runs), desc="gloo exit", unit="pair"):
            runs += [one_run(mode) for mode in MODES]
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    counts = {
        mode: {
            "runs": sum(r["mode"] == mode for r in runs),
            "aborted": sum(r["aborted"] for r in runs if r["mode"] == mode),
            "failed": sum(r["rc"] != 0 for r in runs if r["mode"] == mode),
        }
        for mode in MODES
    }
    for mode, c in counts.items():
        print(f"{mode:>9}: {c['aborted']} of {c['runs']} runs aborted at exit ({c['failed']} failed in all)")
    write_json(
        args.json,
        {
            "command": "python bench/gloo_exit.py " + " ".join(sys.argv[1:]),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "counts": counts,
            "runs": runs,
        },
    )


if __name__ == "__main__":
    main()
