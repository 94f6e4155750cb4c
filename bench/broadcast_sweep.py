"""Benchmark: snapshot broadcast time T_bcast versus fleet size N, chain against star (paper 5.5.1,
Figure 4), with real worker processes over TCP in shaped network namespaces.

Runs `python bench/broadcast.py --json` once per (mode, N) and collects the reports; writes them as
JSON and plots T_bcast(q = 0.9) (q = 1 as a thin line) versus N for chain and star beside the lower
bound M / Bw and the star's fluid time N * M / B0. On a shared machine, `--quiet-below` waits (at
most `--quiet-wait` seconds) before each point until the whole machine's CPU is mostly idle, and
every row records how busy it was.

    python bench/broadcast_sweep.py --workers 4 8 16 32 --snapshot-mb 3.2 --uplink-mbps 40 \\
        --worker-mbps 5 --chunk-mb 0.015625 --json docs/bench/broadcast.json --plot docs/bench/broadcast.png
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import write_json
from procstat import busy, cpu_times


def cpu_busy(seconds: float) -> float:
    """Fraction of all CPUs busy over the next `seconds` (the bench's own /proc/stat reader)."""
    before = cpu_times()
    time.sleep(seconds)
    return busy(before, cpu_times()) or 0.0


def wait_quiet(threshold: float, max_wait: float) -> float:
    """Wait until the machine is at most `threshold` busy over 5 s (or `max_wait` passed); returns
    the last reading."""
    deadline = time.monotonic() + max_wait
    while True:
        busy = cpu_busy(5.0)
        if busy <= threshold or time.monotonic() >= deadline:
            return busy
        print(f"  machine {100 * busy:.0f}% busy; waiting for <= {100 * threshold:.0f}%", flush=True)


def one(args, mode: str, n: int) -> dict:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve().with_name("broadcast.py")),
        f"--workers={n}",
        f"--snapshot-mb={args.snapshot_mb}",
        f"--uplink-mbps={args.uplink_mbps}",
        f"--worker-mbps={args.worker_mbps}",
        f"--mode={mode}",
        f"--chunk-mb={args.chunk_mb}",
        f"--pace={args.pace}",
        "--json",
    ]
    if args.loopback:
        cmd.append("--loopback")
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.stderr.strip():
        print("  " + p.stderr.strip().replace("\n", "\n  "), flush=True)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}: exit {p.returncode}")
    return json.loads(p.stdout)


def plot(rows: list[dict], path: str) -> None:
    """Left: T_bcast versus N beside M / Bw and N * M / B0. Right: T_bcast / (M / Bw) with the
    1.10 target and the best TCP can do through the shapers, 1 / 0.96."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ns = sorted({r["workers"] for r in rows})
    r0 = rows[0]
    for mode, color in (("chain", "tab:blue"), ("star", "tab:red")):
        rs = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["workers"])
        if not rs:
            continue
        x = [r["workers"] for r in rs]
        ax.plot(x, [r["t_bcast_q90_s"] for r in rs], "o-", color=color, label=f"{mode}: T_bcast (q = 0.9)")
        ax.plot(
            x, [r["t_bcast_q100_s"] for r in rs], "-", color=color, lw=0.8, alpha=0.6, label=f"{mode}: q = 1"
        )
        ax2.plot(x, [r["ratio_q90"] for r in rs], "o-", color=color, label=f"{mode}: q = 0.9")
        ax2.plot(
            x, [r["ratio_q100"] for r in rs], "-", color=color, lw=0.8, alpha=0.6, label=f"{mode}: q = 1"
        )
    ax.plot(ns, [r0["lower_bound_s"]] * len(ns), "k--", lw=1, label="M / Bw (lower bound)")
    ax.plot(
        ns,
        [n * r0["snapshot_mb"] * 8 / r0["uplink_mbps"] for n in ns],
        "k:",
        lw=1,
        label="N M / B0 (star fluid)",
    )
    ax2.axhline(1.10, color="grey", ls="--", lw=1, label="target 1.10")
    ax2.axhline(1 / r0["goodput_factor"], color="grey", ls=":", lw=1, label="1 / TCP goodput through tc")
    if r0.get("pace"):
        ax2.axhline(1 / r0["pace"], color="tab:green", ls=":", lw=1, label=f"1 / pace ({r0['pace']:g})")
    ax2.axhline(1.0, color="k", ls="--", lw=1, label="M / Bw")
    ax2.set_ylim(0.95, 1.3)
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.set_xticks(ns, [str(n) for n in ns])
        a.set_xlabel("workers N")
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    ax.set_ylabel("T_bcast (s)")
    ax2.set_ylabel("T_bcast / (M / Bw)")
    fig.suptitle(
        f"snapshot broadcast: M = {r0['snapshot_mb']:g} MB, Bw = {r0['worker_mbps']:g} Mbit/s, "
        f"B0 = {r0['uplink_mbps']:g} Mbit/s, chunk {r0['chunk_mb'] * 1024:g} KiB, {r0['backend']}",
        fontsize=9,
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--modes", nargs="+", default=["chain", "star"])
    p.add_argument("--snapshot-mb", type=float, default=3.2)
    p.add_argument("--uplink-mbps", type=float, default=40.0)
    p.add_argument("--worker-mbps", type=float, default=5.0)
    p.add_argument("--chunk-mb", type=float, default=1 / 64)
    p.add_argument("--pace", type=float, default=0.95, help="bench/broadcast.py --pace")
    p.add_argument("--loopback", action="store_true", help="token buckets on 127.0.0.1 instead of namespaces")
    p.add_argument(
        "--quiet-below", type=float, default=None, metavar="FRACTION", help="wait for an idle machine"
    )
    p.add_argument("--quiet-wait", type=float, default=600.0, metavar="SEC")
    p.add_argument("--json")
    p.add_argument("--plot")
    p.add_argument("--replot", metavar="JSON", help="only draw --plot from a sweep's JSON")
    args = p.parse_args()
    if args.replot:
        plot(json.loads(Path(args.replot).read_text())["rows"], args.plot)
        return
    rows = []
    for mode in args.modes:
        for n in args.workers:
            busy_before = (
                wait_quiet(args.quiet_below, args.quiet_wait)
                if args.quiet_below is not None
                else cpu_busy(2.0)
            )
            row = one(args, mode, n)
            row["machine_busy_before"] = busy_before
            row["loadavg_after"] = list(os.getloadavg())
            print(
                f"{mode:5s} N={n:3d}: T_bcast q=0.9 {row['t_bcast_q90_s']:6.2f} s  q=1 {row['t_bcast_q100_s']:6.2f} s"
                f"  ratio {row['ratio_q90']:.3f}  (busy before {100 * busy_before:.0f}%, during "
                f"{100 * row['cpu_busy']:.0f}%, bench {row['bench_cpu_cores']:.2f} cores)",
                flush=True,
            )
            rows.append(row)
    result = {"command": " ".join(sys.argv), "rows": rows}
    write_json(args.json, result)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
