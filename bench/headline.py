"""The paper's headline on real processes (issue 42 part 1): the same GRPO task, from the same seeds,
run by an ECHO-2 arm and a synchronous baseline on the same shaped network and the same workers.

* **echo2 arm:** `echo2 learner` with S = 3, chain broadcast, delta snapshots;
* **sync arm:** S = 0, star broadcast of full snapshots (`broadcast.delta = false`).

Both arms: one learner process and N real `echo2 worker` processes (HF engine, one torch thread
each), every one in its own network namespace on one bridge (netns.py), shaped by tc TBF: every
worker's link at Bw both ways, the learner's at B0. The learner is pinned to CPU 0 and the workers
to CPU 1 (`taskset`), so generation and training overlap as they would on separate machines; the
workers share their core, as N slow machines would share a fleet's throughput. Evaluation (held-out
accuracy every `--eval-every` steps) runs on the learner's core in both arms, and its time counts.

Per run the raw rows (step, version, wall clock, held-out accuracy, T_bcast, staleness) and the
learner's summary (idle time, bubble ratio) are appended to `--raw` as one JSON line, so a cut run
keeps what finished; headline_report.py turns them into the paired comparison.

    sudo python bench/headline.py --seeds 0 1 2 3 4 --raw docs/bench/headline_runs.jsonl

Link scaling (defaults): the paper's 8B setting sends M = 16 GB over Bw = 100 Mbit/s per worker
against T_train = 1631 s, M / (Bw T_train) = 0.78 (paper inputs, docs/reproduction.md). Here M is
SmolLM2-135M's bf16 snapshot, 269 MB, and T_train about 14 s on one core (measured in a pilot), so
Bw = 200 Mbit/s gives 0.77; B0 = 3 Bw = 600 Mbit/s is the ratio of Figure 4's lowest learner budget
(300 against Bw = 100 Mbit/s), so N = 4 > B0 / Bw workers make the star share the learner's uplink.
The threshold for "time to accuracy" is fixed before the runs: held-out accuracy 0.6 (the quickstart
starts at 0.412), with 0.7 reported beside it (headline_report.py).

Sampling: both arms run `rollout.sampling = "multinomial"` by default. Under the gumbel default the
learner checks a stale record's tokens against its *current* weights, not the version that sampled
them, so at S = 3 a first try refused 4-15 of 32 honest records a step, each a strike (found here;
docs/security.md). The headline compares schedules, not the check; `--sampling gumbel` runs it.

Needs root (network namespaces) and 2 CPUs. Runs alternate arms, and which arm goes first
alternates by seed, so a slow drift of the machine falls on both.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import netns
from netns import ShapedNetwork
from procs import stop_processes

ROOT = Path(__file__).resolve().parent.parent
PORT = 8765
ARMS: dict[str, list[str]] = {
    "echo2": ["--learner.staleness=3", "--broadcast.mode=chain", "--broadcast.delta=true"],
    "sync": ["--learner.staleness=0", "--broadcast.mode=star", "--broadcast.delta=false"],
}
ROW_KEYS = (
    "step", "version", "time/wall", "time/step", "time/train", "time/learner_wait", "eval/accuracy",
    "bcast/version", "bcast/t_q90", "bcast/t_all", "staleness/mean", "staleness/max", "reward/mean",
)  # fmt: skip
SUMMARY_KEYS = (
    "steps", "eval_before", "eval_after", "t_train", "t_bcast", "t_bcast_all", "learner_idle_s",
    "bubble_ratio", "staleness_histogram", "broadcast_mode", "ingest_rejected",
)  # fmt: skip


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a live process (/proc/PID/stat), in seconds."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_listening(ip: str, port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the learner exited with {proc.returncode} before listening")
        try:
            socket.create_connection((ip, port), timeout=1.0).close()
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the learner did not listen on {ip}:{port} in {timeout:.0f} s")


def _tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def run_arm(net: ShapedNetwork, arm: str, seed: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """One run of one arm; returns its raw record (rows, summary, process figures)."""
    run_dir = tmp / f"{arm}-seed{seed}"
    token = secrets.token_hex(16)
    learner_argv = [
        "taskset", "-c", str(args.learner_cpu), sys.executable, "-m", "echo2.cli", "learner", args.config, "-q",
        f"--run.seed={seed}", f"--learner.steps={args.steps}", f"--run.eval_every={args.eval_every}",
        f"--run.eval_size={args.eval_size}", "--run.threads=1", f"--run.dir={run_dir}",
        f"--coordinator.host={net.learner_ip}", f"--coordinator.port={PORT}", f"--coordinator.token={token}",
        f"--broadcast.uplink_budget_mbps={args.b0}", f"--broadcast.worker_mbps={args.bw}",
        f"--rollout.sampling={args.sampling}", *ARMS[arm],
    ]  # fmt: skip
    env = {"ECHO2_TOKEN": token, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    started = time.monotonic()
    log = (tmp / f"{arm}-seed{seed}-learner.log").open("w")
    learner = net.learner.popen(learner_argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    workers: list[subprocess.Popen] = []
    try:
        _wait_listening(net.learner_ip, PORT, learner, timeout=300)
        url = f"http://{net.learner_ip}:{PORT}"
        for i, host in enumerate(net.hosts):
            wlog = (tmp / f"{arm}-seed{seed}-w{i}.log").open("w")
            workers.append(
                host.popen(
                    ["taskset", "-c", str(args.worker_cpu), sys.executable, "-m", "echo2.cli", "worker",
                     f"--coordinator={url}", f"--name=w{i}", "--inbound", "--relay-host=0.0.0.0",
                     "--threads=1", f"--price-per-hour={args.worker_price}", "-q"],
                    env=env, stdout=wlog, stderr=subprocess.STDOUT, cwd=ROOT,
                )
            )  # fmt: skip
        try:
            rc = learner.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{arm} seed {seed}: no end in {args.timeout:.0f} s") from None
        wall = time.monotonic() - started
        worker_cpu = [cpu_seconds(w.pid) for w in workers]
        dead = [i for i, w in enumerate(workers) if w.poll() is not None]
    finally:
        stop_processes([*workers, learner])
        log.close()
    if rc != 0:
        raise RuntimeError(
            f"{arm} seed {seed}: learner exit {rc}: {_tail(tmp / f'{arm}-seed{seed}-learner.log')}"
        )
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return {
        "arm": arm,
        "seed": seed,
        "wall_s": wall,
        "workers": len(net.hosts),
        "workers_exited_early": dead,
        "worker_cpu_s": worker_cpu,
        "rows": [{k: r[k] for k in ROW_KEYS if k in r} for r in rows],
        "summary": {k: summary.get(k) for k in SUMMARY_KEYS},
        "load_avg": os.getloadavg(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/quickstart.toml")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--eval-size", type=int, default=100)
    p.add_argument("--bw", type=float, default=200.0, help="every worker's link, Mbit/s both ways")
    p.add_argument("--b0", type=float, default=600.0, help="the learner's link (uplink budget B0), Mbit/s")
    p.add_argument(
        "--worker-price", type=float, default=0.35, help="USD/h per worker (paper Table 1: RTX 5090)"
    )
    p.add_argument(
        "--sampling",
        default="multinomial",
        help="rollout.sampling in both arms; gumbel's check refuses honest stale records (see the docstring)",
    )
    p.add_argument("--learner-cpu", type=int, default=0)
    p.add_argument("--worker-cpu", type=int, default=1)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds one run may take")
    p.add_argument("--raw", required=True, help="JSON lines file: one line per finished run, appended")
    args = p.parse_args()
    ok, why = ShapedNetwork.available()
    if not ok:
        sys.exit(f"headline: network namespaces unavailable: {why}")
    netns.install_cleanup()
    runs = [(seed, arm) for seed in args.seeds for arm in (args.arms if seed % 2 == 0 else args.arms[::-1])]
    with (
        tempfile.TemporaryDirectory(prefix="echo2-headline-") as tmp,
        ShapedNetwork(args.workers, args.bw, args.b0) as net,
    ):
        for k, (seed, arm) in enumerate(runs):
            print(f"[{k + 1}/{len(runs)}] {arm} seed {seed} ...", flush=True)
            try:
                record = run_arm(net, arm, seed, args, Path(tmp))
            except RuntimeError as e:  # one run failing does not end the others; the raw file says so
                record = {"arm": arm, "seed": seed, "error": str(e)}
                print(f"    failed: {e}", flush=True)
                with open(args.raw, "a") as f:
                    f.write(json.dumps(record) + "\n")
                continue
            record["setting"] = {k: v for k, v in vars(args).items() if k not in ("raw", "seeds", "arms")}
            with open(args.raw, "a") as f:
                f.write(json.dumps(record) + "\n")
            evals = [(r["step"], r["eval/accuracy"]) for r in record["rows"] if "eval/accuracy" in r]
            print(
                f"    {record['wall_s']:.0f} s, bubble {record['summary']['bubble_ratio']}, evals {evals}",
                flush=True,
            )


if __name__ == "__main__":
    main()
