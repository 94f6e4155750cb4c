"""`python bench/broadcast.py`: time one snapshot broadcast to N real worker processes (paper 5.5.1,
Figure 4) over TCP, each worker in its own network namespace with tc shaping its link.

What runs (`run_bench`):

* a **learner process** (broadcast_learner.py, run as a script): a coordinator without a model
  (a state with a dummy replay buffer), listening on the learner host's address. It waits for
  the N workers to register, publishes a small random warm-up version (an eighth of M) and waits
  until every worker installed it, then publishes a random M-MB snapshot and waits (bounded) until
  every worker reported installing it. T_bcast at q = 0.9 and q = 1 is the coordinator's own
  measurement, from publication to install report (broadcast/tracker.py). It prints one JSON line
  and exits.
* **N broadcast-only workers** (`python -m echo2.rollout.broadcast_peer --inbound`): each registers as a
  relay, follows the published versions, receives each from the parent the coordinator names,
  relays it to its child while receiving, and reports the install.

Shaping with network namespaces (`ShapedNetwork.available()`: root, iproute2, a kernel with TBF;
HTB is assumed too, and a kernel without it fails the run with the tc error). The learner is the
network's learner host and worker i is host i. Each worker's link is
shaped at Bw in both directions by TBF (netns.py). The learner's link is shaped at B0 in
both directions; its upload by HTB with one class (and queue) per worker under the B0 cap, so the
streams share the uplink fairly, as the coordinator's token bucket shares it in-process (a TBF has
a single FIFO, and this kernel has no fq_codel or sfq to put under it). The shapers count wire
bytes, so TCP goodput is about 0.96 of a cap (netns.py): the best a worker can do is
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

With `--throttle F` (namespaces, chain mode) the learner names the forwarder of the first chain
(`THROTTLE <name> <chain>` on its stdout) right after the measured publication, and the driver
shapes that worker's upload down to F x Bw `--throttle-after` seconds later, for good (a relay gone
slow mid-broadcast: its child should report it `slow` and the coordinator demote it; with
`--slow-relay-fraction 0` it does not). The learner then publishes one more version, whose T_bcast
shows the next plan (docs/benchmarks.md, "A relay throttled to a tenth mid-broadcast").

With `--changed-fraction F` (or `--delta-ratio R`, which picks F so that the codec's delta is R
times the full snapshot) the warm-up is an M-byte base of bf16 tensors and the measured version its
successor, F of the elements moved by one ulp (delta_pair.py), published with `broadcast.delta` on
(the workers, holding the base, receive the delta) or, with `--full`, off. broadcast_delta.py
alternates the two forms on the same pair.

This file starts, watches and stops the processes, and is the entry point (`main`, which also
makes the shaped network's teardown run at exit and on SIGTERM/SIGHUP). The arithmetic and the
report (`BenchSpec`, `check`, `expected`, `summarize`, `render`) are broadcast_report.py's, the
learner process broadcast_learner.py's, the network netns.py's.

    python bench/broadcast.py --workers 32 --snapshot-mb 3.2 --uplink-mbps 40 --worker-mbps 5 \\
        --mode chain --chunk-mb 0.015625
"""

from __future__ import annotations

import argparse
import json
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from broadcast_drive import BenchError, drive, worker_args
from broadcast_report import BenchSpec, broadcast_timeout, check, render, summarize, warmup_bytes

from echo2.config import SLOW_RELAY_FRACTION

LEARNER_SCRIPT = Path(__file__).resolve().with_name("broadcast_learner.py")


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
    from netns import ShapedNetwork
    from procs import child_env, stop_processes
    from procstat import net_stats
    from shaping import htb_uplink_commands

    if loopback:
        ok, why = False, "--loopback"
    else:
        ok, why = ShapedNetwork.available()
    if not ok:
        if spec.throttle:
            raise BenchError(f"--throttle needs network namespaces ({why})")
        log(f"network namespaces unavailable ({why}): using in-process token buckets")
    token = secrets.token_hex(16)
    timeout = broadcast_timeout(spec) if timeout is None else timeout
    register_timeout = 30.0 + 2.0 * spec.workers
    learner_args = [
        str(LEARNER_SCRIPT),
        f"--workers={spec.workers}",
        f"--snapshot-bytes={spec.snapshot_bytes}",
        f"--warmup-bytes={warmup_bytes(spec)}",
        f"--chunk-bytes={spec.chunk_bytes}",
        f"--mode={spec.mode}",
        f"--uplink-budget-bps={spec.uplink_bps}",
        f"--worker-bps={spec.worker_bps}",
        f"--timeout={timeout}",
        f"--register-timeout={register_timeout}",
        f"--slow-relay-fraction={spec.slow_relay_fraction}",
        *(["--throttle"] if spec.throttle else []),
        *(
            [f"--changed-fraction={spec.changed_fraction}", f"--seed={spec.seed}"]
            if spec.changed_fraction is not None
            else []
        ),
        *(["--delta"] if spec.delta else []),
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
                            h.python(*worker_args(url, i, "0.0.0.0"), *extra_w),
                            env=env,
                            stdout=subprocess.DEVNULL,
                            stderr=err,
                        )

                throttled: dict[str, Any] = {}

                def throttle(line: str) -> None:
                    """`THROTTLE <name> <chain>`: shape that worker's upload down, throttle_after_s on."""
                    _, name, chain = line.split()
                    host = net.host(int(name.lstrip("w")))
                    up = spec.worker_mbps * (spec.throttle or 1.0)

                    def apply() -> None:
                        net.reshape(host, (up, spec.worker_mbps))
                        throttled["at_s"] = time.monotonic() - t_line

                    t_line = time.monotonic()
                    throttled.update(worker=name, chain=chain.split(","), up_mbps=up)
                    threading.Timer(spec.throttle_after_s, apply).start()

                measured = drive(
                    spec,
                    start_learner,
                    start_worker,
                    2 * register_timeout + 3 * timeout,
                    logs,
                    stop=None,
                    on_line=throttle,
                )
                measured["net_stats"] = net_stats(net)
                if throttled:
                    measured["throttled"] = throttled
            backend = "netns"
        else:
            learner_args.append(f"--uplink-cap-bps={spec.uplink_bps}")
            procs: list[subprocess.Popen] = []
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
                        [sys.executable, *worker_args(url, i, "127.0.0.1"), *caps],
                        env=child_env(env),
                        stdout=subprocess.DEVNULL,
                        stderr=err,
                        start_new_session=True,
                    )
                procs.append(p)
                return p

            measured = drive(
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


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the flags, run one benchmark, print the report; 1 if it did not finish, 2 on bad flags.
    Every shaped network still up is torn down at exit and on SIGTERM/SIGHUP."""
    p = argparse.ArgumentParser(
        prog="python bench/broadcast.py",
        description="Snapshot broadcast (paper 5.5.1): N broadcast-only worker processes receive a "
        "random M-MB snapshot over TCP, each in its own network namespace with tc TBF shaping its link "
        "(the learner's at B0, each worker's at Bw); without namespaces, token buckets on 127.0.0.1. "
        "Prints T_bcast at q = 0.9 and 1.0, the lower bound M/Bw and their ratio.",
        epilog="example (docs/benchmarks.md): python bench/broadcast.py --workers 32 --snapshot-mb 3.2 "
        "--uplink-mbps 40 --worker-mbps 5 --mode chain --chunk-mb 0.015625",
    )
    p.add_argument("--workers", type=int, required=True, metavar="N", help="worker processes")
    p.add_argument("--snapshot-mb", type=float, required=True, metavar="M", help="snapshot size, MB (10^6 B)")
    p.add_argument("--uplink-mbps", type=float, required=True, metavar="B0", help="learner uplink, Mbit/s")
    p.add_argument(
        "--worker-mbps", type=float, required=True, metavar="BW", help="each worker's link, Mbit/s"
    )
    p.add_argument("--mode", default="chain", help="chain (N_ch = floor(B0/BW) relay chains) or star")
    p.add_argument(
        "--chunk-mb",
        type=float,
        default=4.0,
        metavar="C",
        help="chunk size, MiB (default 4, as broadcast.chunk_mb)",
    )
    p.add_argument(
        "--pace",
        type=float,
        default=0.95,
        metavar="F",
        help="with namespaces: the learner's (in total at B0 and per stream at Bw) and the relays' "
        "own upload caps as a fraction of the shaped rates (default 0.95, just under TCP's goodput; 0: none)",
    )
    p.add_argument(
        "--loopback", action="store_true", help="use token buckets on 127.0.0.1 even if namespaces work"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SEC",
        help="give up on a broadcast after SEC seconds (default 60 + 4x the model's time)",
    )
    p.add_argument(
        "--throttle",
        type=float,
        default=None,
        metavar="F",
        help="with namespaces, chain mode: shape the first chain's forwarder's upload down to F x Bw "
        "mid-broadcast (--throttle-after), and publish one more version to show the next plan",
    )
    p.add_argument(
        "--throttle-after",
        type=float,
        default=2.0,
        metavar="SEC",
        help="seconds after the measured publication (default 2)",
    )
    p.add_argument(
        "--slow-relay-fraction",
        type=float,
        default=SLOW_RELAY_FRACTION,
        metavar="X",
        help="the learner's broadcast.slow_relay_fraction (default 0.75; 0: slow relays are not demoted)",
    )
    successor = p.add_mutually_exclusive_group()
    successor.add_argument(
        "--changed-fraction",
        type=float,
        default=None,
        metavar="F",
        help="publish an M-byte bf16 base as the warm-up and measure its successor, F of the "
        "elements changed by one ulp (bench/delta_pair.py), with broadcast.delta on (see --full)",
    )
    successor.add_argument(
        "--delta-ratio",
        type=float,
        default=None,
        metavar="R",
        help="as --changed-fraction, with F chosen so the codec's delta is R x the full snapshot "
        "(0.0066: bf16, lr 1e-6, kappa 1, docs/benchmarks.md)",
    )
    p.add_argument(
        "--full", action="store_true", help="with a successor: broadcast.delta off (the full snapshot)"
    )
    p.add_argument("--seed", type=int, default=0, help="the base/successor pair's seed (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    fraction = args.changed_fraction
    if args.delta_ratio is not None:
        from delta_pair import calibrate

        try:
            fraction, got = calibrate(int(round(args.snapshot_mb * 1e6)), args.delta_ratio, args.seed)
        except ValueError as e:
            p.error(f"--delta-ratio: {e}")
        print(
            f"--delta-ratio {args.delta_ratio:g}: {100 * fraction:.4f}% of the elements changed gives "
            f"{100 * got['ratio']:.3f}% ({got['delta_bytes']} of {got['full_bytes']} bytes)",
            file=sys.stderr,
        )
    if args.full and fraction is None:
        p.error("--full: needs --changed-fraction or --delta-ratio")
    spec = BenchSpec(
        workers=args.workers,
        snapshot_mb=args.snapshot_mb,
        uplink_mbps=args.uplink_mbps,
        worker_mbps=args.worker_mbps,
        mode=args.mode,
        chunk_mb=args.chunk_mb,
        pace=args.pace,
        throttle=args.throttle,
        throttle_after_s=args.throttle_after,
        slow_relay_fraction=args.slow_relay_fraction,
        changed_fraction=fraction,
        delta=fraction is not None and not args.full,
        seed=args.seed,
    )
    try:
        check(spec)
    except ValueError as e:
        p.error(str(e))
    if args.timeout is not None and not args.timeout > 0:
        p.error(f"--timeout: must be > 0 (got {args.timeout})")
    import netns

    netns.install_cleanup()
    try:
        summary = run_bench(spec, loopback=args.loopback, timeout=args.timeout)
    except BenchError as e:
        print(f"bench/broadcast.py: {e}", file=sys.stderr)
        return 1
    print(json.dumps(summary) if args.json else render(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
