"""T_bcast of a delta snapshot against the full one on the shaped network (issue 24), side by side.

Picks the changed fraction F once (delta_pair.calibrate: the codec's delta of the successor is
`--delta-ratio` x the full snapshot), then runs `python bench/broadcast.py --json` `--runs` times
per form on that same base/successor pair, alternating full (`--full`: broadcast.delta off) and
delta (on), each run in a fresh shaped network: the warm-up publishes the M-byte base, every
worker installs it, and the successor is the measured publication. Writes every run's report and,
per form, the median [min, max] of T_bcast at q = 0.9 and q = 1 and the delta/full ratio of the
medians; for the delta runs also where the time went (per worker: publication until routed,
streaming, and the rest: applying the delta, hashing, the install report).

    python bench/broadcast_delta.py --workers 16 --snapshot-mb 3.2 --uplink-mbps 40 --worker-mbps 5 \\
        --chunk-mb 0.015625 --delta-ratio 0.0066 --runs 3 --json docs/bench/broadcast_delta_n16.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import write_json

FORMS = ("full", "delta")


def spread(xs: list[float]) -> dict[str, float | int]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def where_the_time_went(run: dict) -> dict[str, float]:
    """Per-worker medians and maxima (seconds) of publication -> routed, streaming, and the rest of
    the install time (apply, hash, report), from the learner's per-worker records."""
    routed, streamed, installed = (
        run.get(k) or {} for k in ("routed_by_worker_s", "streaming_by_worker_s", "install_by_worker_s")
    )
    rest = [installed[w] - routed[w] - streamed[w] for w in installed if w in routed and w in streamed]
    out = {}
    for name, xs in (
        ("routed", list(routed.values())),
        ("streaming", list(streamed.values())),
        ("rest", rest),
    ):
        if xs:
            out[f"{name}_median_s"] = statistics.median(xs)
            out[f"{name}_max_s"] = max(xs)
    return out


def one(args, fraction: float, form: str) -> dict:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve().with_name("broadcast.py")),
        f"--workers={args.workers}",
        f"--snapshot-mb={args.snapshot_mb}",
        f"--uplink-mbps={args.uplink_mbps}",
        f"--worker-mbps={args.worker_mbps}",
        "--mode=chain",
        f"--chunk-mb={args.chunk_mb}",
        f"--changed-fraction={fraction!r}",
        f"--seed={args.seed}",
        "--json",
        *(["--full"] if form == "full" else []),
        *(["--loopback"] if args.loopback else []),
    ]
    load = os.getloadavg()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        return {
            "form": form,
            "ok": False,
            "error": (p.stderr or p.stdout).strip()[-2000:],
            "loadavg_before": load,
        }
    report = json.loads(p.stdout.strip().splitlines()[-1])
    report.update(form=form, loadavg_before=list(load), breakdown=where_the_time_went(report))
    return report


def summarize(runs: list[dict]) -> dict:
    out: dict = {}
    for form in FORMS:
        ok = [r for r in runs if r["form"] == form and r.get("ok")]
        if not ok:
            continue
        out[form] = {
            "t_bcast_q90_s": spread([r["t_bcast_q90_s"] for r in ok]),
            "t_bcast_q100_s": spread([r["t_bcast_q100_s"] for r in ok]),
            "learner_mb_sent": spread([r["learner_mb_sent"] for r in ok]),
            "publish_s": spread([r["publish_s"] for r in ok]),
            "forms": [r.get("forms") for r in ok],
        }
        for k in ok[0]["breakdown"]:
            out[form][k] = spread([r["breakdown"][k] for r in ok if k in r["breakdown"]])
    if "full" in out and "delta" in out:
        out["delta_over_full"] = {
            q: out["delta"][q]["median"] / out["full"][q]["median"]
            for q in ("t_bcast_q90_s", "t_bcast_q100_s")
        }
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python bench/broadcast_delta.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--snapshot-mb", type=float, required=True)
    p.add_argument("--uplink-mbps", type=float, required=True)
    p.add_argument("--worker-mbps", type=float, required=True)
    p.add_argument("--chunk-mb", type=float, default=4.0)
    p.add_argument("--delta-ratio", type=float, default=0.0066, help="target delta / full (default 0.0066)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", type=int, default=3, help="runs per form (default 3)")
    p.add_argument("--loopback", action="store_true", help="token buckets on 127.0.0.1 (passed on)")
    p.add_argument("--json", type=Path, default=None, help="write the runs and the summary here")
    args = p.parse_args(argv)
    from delta_pair import calibrate

    fraction, got = calibrate(int(round(args.snapshot_mb * 1e6)), args.delta_ratio, args.seed)
    print(
        f"changed fraction {100 * fraction:.4f}%: delta {got['delta_bytes']} of {got['full_bytes']} bytes "
        f"= {100 * got['ratio']:.3f}% (target {100 * args.delta_ratio:g}%)",
        flush=True,
    )
    runs: list[dict] = []
    t0 = time.monotonic()
    for i in range(args.runs):
        for form in FORMS:
            r = one(args, fraction, form)
            r["run"] = i
            runs.append(r)
            if r.get("ok"):
                print(
                    f"run {i} {form:5s}: T_bcast q=0.9 {r['t_bcast_q90_s']:.3f} s, q=1 {r['t_bcast_q100_s']:.3f} s, "
                    f"learner sent {r['learner_mb_sent']:.3f} MB, forms {r.get('forms')}, {r['breakdown']}",
                    flush=True,
                )
            else:
                print(f"run {i} {form}: FAILED {r.get('error', '')[-500:]}", flush=True)
    summary = summarize(runs)
    print(json.dumps(summary, indent=1))
    if args.json:
        write_json(
            args.json,
            {
                "command": "python bench/broadcast_delta.py "
                + " ".join(sys.argv[1:] if argv is None else argv),
                "changed_fraction": fraction,
                "calibration": got,
                "delta_ratio_target": args.delta_ratio,
                "wall_s": time.monotonic() - t0,
                "summary": summary,
                "runs": runs,
            },
        )
    return 0 if all(r.get("ok") for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
