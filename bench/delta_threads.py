"""The delta codec on one core against all cores, wall clock (issue 42 part 3: "encode and decode on
all cores ... >= 1.8x one core, and above 125 MB/s of full snapshot per second").

A base and successor from `delta_pair.Pair` (bf16 tensors in a transformer's shapes, weights
N(0, 0.02); the successor has `--fraction` of the elements moved by one ulp at random places, what
the quickstart's bf16 steps at lr 1e-6 do: 0.64% per step, docs/benchmarks.md "Delta snapshots"),
of `--mb` MB (269 = SmolLM2-135M's bf16 wire snapshot). `broadcast.delta.encode` and `apply` are
timed with `threads=1` and with `threads=N` (default: every core), the two alternating run by run,
wall clock (`time.perf_counter`); each delta is checked to be the same bytes on both, and each
rebuild bit for bit. Decode is timed as a worker runs it (the base's SHA-256 given: the worker took
it when it received the base, rollout/broadcast_client.py) and, beside it, hashing the base again
(`decode_hashing_base_s`, the path before that change and of a caller that holds no digest). Medians over `--runs` and the ratio of the medians; throughput is MB (1e6
bytes) of full snapshot per wall second (1 Gbit/s is 125 MB/s).

    OMP_NUM_THREADS=1 python bench/delta_threads.py --json docs/bench/delta_threads.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from common import write_json
from delta_pair import Pair


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=269.0, help="full snapshot size, MB")
    ap.add_argument("--fraction", type=float, default=0.0064, help="elements changed")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the all-cores side")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from echo2.broadcast.delta import apply, encode

    pair = Pair(int(args.mb * 1e6), args.seed)
    base, new = pair.base, pair.successor(args.fraction)
    mb = len(new) / 1e6
    import hashlib

    base_sha256 = hashlib.sha256(base).hexdigest()
    sides = {n: {"encode_s": [], "decode_s": [], "decode_hashing_base_s": []} for n in (1, args.threads)}
    reference = None
    for run in range(args.runs):
        for n in (1, args.threads) if run % 2 == 0 else (args.threads, 1):
            delta, enc = timed(lambda n=n: encode(base, new, base_version=0, version=1, threads=n))
            if reference is None:
                reference = delta
            assert delta == reference, "the delta depends on the thread count"
            out, dec = timed(lambda n=n, delta=delta: apply(base, delta, threads=n, base_sha256=base_sha256))
            assert out == new, "the rebuild differs from the successor"
            out, dec_hb = timed(lambda n=n, delta=delta: apply(base, delta, threads=n))
            assert out == new, "the rebuild differs from the successor"
            sides[n]["encode_s"].append(enc)
            sides[n]["decode_s"].append(dec)
            sides[n]["decode_hashing_base_s"].append(dec_hb)
            print(f"run {run} threads {n}: encode {enc:.3f} s, decode {dec:.3f} s "
                  f"(hashing the base: {dec_hb:.3f} s)", file=sys.stderr)  # fmt: skip
    result: dict = {
        "command": " ".join(
            ["python", "bench/delta_threads.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "full_mb": mb,
        "delta_bytes": len(reference),
        "delta_ratio": len(reference) / len(new),
        "fraction": args.fraction,
        "cores": os.cpu_count(),
        "load_average": os.getloadavg(),
        "sides": {},
    }
    for n, t in sides.items():
        e, d = statistics.median(t["encode_s"]), statistics.median(t["decode_s"])
        result["sides"][str(n)] = {
            **t,
            "encode_median_s": e,
            "decode_median_s": d,
            "encode_mb_s": mb / e,
            "decode_mb_s": mb / d,
            "decode_hashing_base_median_s": statistics.median(t["decode_hashing_base_s"]),
        }
    one, many = result["sides"]["1"], result["sides"][str(args.threads)]
    result["encode_speedup"] = one["encode_median_s"] / many["encode_median_s"]
    result["decode_speedup"] = one["decode_median_s"] / many["decode_median_s"]
    result["decode_hashing_base_speedup"] = one["decode_hashing_base_median_s"] / many["decode_hashing_base_median_s"]
    result["decode_one_core_before_over_all_cores"] = one["decode_hashing_base_median_s"] / many["decode_median_s"]
    print(
        f"{mb:.0f} MB, delta {100 * result['delta_ratio']:.2f}%: encode {one['encode_mb_s']:.0f} -> "
        f"{many['encode_mb_s']:.0f} MB/s ({result['encode_speedup']:.2f}x on {args.threads} threads), "
        f"decode {one['decode_mb_s']:.0f} -> {many['decode_mb_s']:.0f} MB/s ({result['decode_speedup']:.2f}x); "
        f"hashing the base: {result['decode_hashing_base_speedup']:.2f}x"
    )
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
