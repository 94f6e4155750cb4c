"""Delta snapshots: bytes per publication against the full snapshot, and encode/decode throughput.

Runs the quickstart GRPO loop (configs/quickstart.toml: SmolLM2-135M-Instruct, arithmetic, 4 x 8
rollouts of 16 tokens per step, staleness 0 so every step publishes) in process, one torch thread,
for --steps steps at each --lr, and catches every snapshot the loop makes (`loop.make_snapshot`,
wrapped). Each published version v is serialised as the broadcast sends it
(`learning.sources.remote.serialise`) in fp32 and in bf16 (the bf16 wire snapshot is the fp32 master weights
cast, as `snapshot_state` casts them), and for kappa 1 and 4 the delta from version v - kappa
(`broadcast.delta.encode`) is timed, applied back (`broadcast.delta.apply`, both hash checks
included), timed and checked bit for bit. Throughput is MB (1e6 bytes) of full snapshot per second
of the thread's CPU time (`time.thread_time`: the machine is shared, so wall time is recorded too
but is not a per-core figure); 1 Gbit/s is 125 MB/s.

    OMP_NUM_THREADS=1 python bench/snapshot_delta.py --json docs/bench/snapshot_delta.json
    python bench/snapshot_delta.py --steps 2 --lr 1e-6            # a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from common import write_json

ROOT = Path(__file__).resolve().parents[1]
KAPPAS = (1, 4)
DTYPES = ("fp32", "bf16")
LEVELS = (1, 3)
"""zstd levels compared on the last version of each run (the others use delta.LEVEL)."""


def measure(base: bytes, new: bytes, *, base_version: int, version: int) -> dict:
    """One delta: its size against the full snapshot, how it was stored, encode and decode time."""
    from echo2.broadcast.delta import apply, encode, read_header

    w0, t0 = time.perf_counter(), time.thread_time()
    delta = encode(base, new, base_version=base_version, version=version)
    w1, t1 = time.perf_counter(), time.thread_time()
    out = apply(base, delta)
    w2, t2 = time.perf_counter(), time.thread_time()
    assert out == new, "the delta rebuilt other bytes"
    header, _ = read_header(delta)
    methods = Counter(s.method for s in header.segments)
    method_bytes = Counter()
    for s in header.segments:
        method_bytes[s.method] += s.payload[1] - s.payload[0]
    return {
        "base_version": base_version,
        "version": version,
        "full_bytes": len(new),
        "delta_bytes": len(delta),
        "ratio": len(delta) / len(new),
        "changed_elements": sum(s.count for s in header.segments if s.method == "sparse"),
        "xor_elements": sum((s.end - s.start) // s.width for s in header.segments if s.method == "xor"),
        "methods": dict(methods),
        "method_payload_bytes": dict(method_bytes),
        "encode_s": t1 - t0,
        "decode_s": t2 - t1,
        "encode_wall_s": w1 - w0,
        "decode_wall_s": w2 - w1,
        "encode_mb_s": len(new) / 1e6 / (t1 - t0),
        "decode_mb_s": len(new) / 1e6 / (t2 - t1),
    }


def levels(base: bytes, new: bytes) -> dict:
    from echo2.broadcast.delta import encode

    out = {}
    for level in LEVELS:
        t0 = time.thread_time()
        size = len(encode(base, new, base_version=0, version=1, level=level))
        out[str(level)] = {"ratio": size / len(new), "encode_s": time.thread_time() - t0}
    return out


def one_run(lr: float, steps: int, seed: int) -> dict:
    """Train `steps` quickstart steps at `lr`; the deltas between the published snapshots."""
    import torch

    from echo2.config import load_config
    from echo2.learning import loop
    from echo2.learning.sources.remote import serialise
    from echo2.records import Snapshot

    config = load_config(
        ROOT / "configs" / "quickstart.toml",
        {
            "learner": {"lr": lr, "steps": steps, "dtype": "fp32"},
            "run": {"eval_size": 0, "threads": 1, "checkpoint_every": 0, "seed": seed},
        },
    )
    held: dict[str, dict[int, bytes]] = {d: {} for d in DTYPES}  # the last max(KAPPAS) + 1 versions
    rows: dict[str, list[dict]] = {f"{d}_k{k}": [] for d in DTYPES for k in KAPPAS}
    step_times: list[float] = []
    last = [time.perf_counter()]
    original = loop.make_snapshot

    def recording(model, version, lcfg):
        snapshot = original(model, version, lcfg)
        if version in held["fp32"] or (held["fp32"] and version < max(held["fp32"])):
            return snapshot  # the eval/final install of a version already published
        now = time.perf_counter()
        if held["fp32"]:
            step_times.append(now - last[0])
        wire = {
            "fp32": serialise(snapshot),
            "bf16": serialise(
                Snapshot(version=version, state={k: v.to(torch.bfloat16) for k, v in snapshot.state.items()})
            ),
        }
        for dtype in DTYPES:
            held[dtype][version] = wire[dtype]
            for kappa in KAPPAS:
                if version - kappa in held[dtype]:
                    row = measure(
                        held[dtype][version - kappa],
                        wire[dtype],
                        base_version=version - kappa,
                        version=version,
                    )
                    rows[f"{dtype}_k{kappa}"].append(row)
                    print(
                        f"lr {lr:g} {dtype} kappa {kappa} v{version}: {row['ratio']:.4f} of full, "
                        f"encode {row['encode_mb_s']:.0f} MB/s, decode {row['decode_mb_s']:.0f} MB/s",
                        flush=True,
                    )
            for old in [v for v in held[dtype] if v < version - max(KAPPAS)]:
                del held[dtype][old]
        last[0] = time.perf_counter()
        return snapshot

    loop.make_snapshot = recording
    try:
        with tempfile.TemporaryDirectory(prefix="echo2-snapshot-delta-") as tmp:
            summary = loop.run(config, run_dir=Path(tmp) / "run", progress=False)
    finally:
        loop.make_snapshot = original
    top = max(held["fp32"])
    level_rows = {d: levels(held[d][top - 1], held[d][top]) for d in DTYPES if top - 1 in held[d]}
    from safetensors.torch import load

    params = sum(v.numel() for v in load(held["fp32"][top]).values())
    return {
        "lr": lr,
        "steps": summary["steps"],
        "params": params,
        "train_step_s": step_times,
        "deltas": rows,
        "levels_last_version": level_rows,
    }


def summarise(runs: list[dict]) -> dict:
    out = {}
    for run in runs:
        for key, rows in run["deltas"].items():
            if not rows:
                continue

            def stat(field: str, rows=rows) -> dict:
                xs = [r[field] for r in rows]
                return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}

            per_param = [
                {
                    "encode_ns_per_param": r["encode_s"] / run["params"] * 1e9,
                    "decode_ns_per_param": r["decode_s"] / run["params"] * 1e9,
                }
                for r in rows
            ]
            fields = ("ratio", "encode_mb_s", "decode_mb_s")
            out[f"lr{run['lr']:g}_{key}"] = {f: stat(f) for f in fields} | {
                f: stat(f, per_param) for f in ("encode_ns_per_param", "decode_ns_per_param")
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lr", type=float, nargs="+", default=[1e-5, 1e-6])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    runs: list[dict] = []
    for lr in args.lr:  # the JSON is rewritten after each run, so a partial sweep is reportable
        runs.append(one_run(lr, args.steps, args.seed))
        summary = summarise(runs)
        result = {
            "command": "OMP_NUM_THREADS=1 python " + " ".join(["bench/snapshot_delta.py", *sys.argv[1:]]),
            "model": "SmolLM2-135M-Instruct (GGUF), configs/quickstart.toml",
            "torch_threads": torch.get_num_threads(),
            "link_mb_s_1gbit": 125.0,
            "summary": summary,
            "runs": runs,
        }
        write_json(args.json, result)
    for key, s in summary.items():
        print(
            f"{key}: ratio median {s['ratio']['median']:.4f} [{s['ratio']['min']:.4f}, {s['ratio']['max']:.4f}], "
            f"encode {s['encode_mb_s']['median']:.0f} MB/s, decode {s['decode_mb_s']['median']:.0f} MB/s"
        )


if __name__ == "__main__":
    main()
