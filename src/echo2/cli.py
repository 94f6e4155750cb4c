"""`echo2` command line. Thin: parse, validate the config, then import the heavy modules.

`run` and `learner` call `learning.loop.run` with the `SourceSpec` the flags describe (in process,
a coordinator, local worker processes via `rollout.local_fleet`); `worker` runs
`rollout.worker.Worker`; `plan` prints `control.plan.make_plan`; `simulate` hands over to
`sim.cli`. User mistakes (bad config key, missing file, missing token) exit with status 2 and one
line naming the key or file, before anything starts. Knows no policy of its own.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import socket
import sys
from pathlib import Path

from echo2.config import ConfigError, build_config, dump_toml, load_config, parse_overrides, read_toml
from echo2.preflight import check_model_source, check_port, fresh_run_dir
from echo2.tracking import check_trackers

log = logging.getLogger("echo2")


def _parser() -> argparse.ArgumentParser:
    from echo2 import __version__
    from echo2.export import add_parser as add_export  # light: argparse only

    p = argparse.ArgumentParser(prog="echo2", description="Cost-efficient RL post-training of LLMs (ECHO-2).")
    p.add_argument("--version", action="version", version=f"echo2 {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in (
        ("run", "train with GRPO: in process, or with --workers K local worker processes"),
        ("learner", "serve the coordinator and train on what remote workers push"),
    ):
        r = sub.add_parser(
            name,
            help=help_,
            description=f"{help_}. Any config field can be overridden: --learner.lr=1e-6.",
            epilog=f"example: echo2 {name} configs/quickstart.toml --run.seed=1 --learner.steps=10",
        )
        r.add_argument("config", nargs="?", help="TOML config file (omit with --resume)")
        r.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its checkpoint")
        r.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
        r.add_argument("-q", "--quiet", action="store_true", help="no progress bar, warnings only")
        if name == "run":
            r.add_argument(
                "--workers",
                type=int,
                default=0,
                metavar="K",
                help="start K worker processes on loopback (0: learner and rollout take turns)",
            )
            r.add_argument(
                "--emulate",
                type=float,
                default=None,
                metavar="RATE",
                help="EMULATION: the K workers run no model and yield RATE trajectories/s each",
            )
    w = sub.add_parser(
        "worker",
        help="generate rollouts for a learner's coordinator",
        description="Register with a coordinator, install its snapshots, lease prompts, "
        "generate, score and push trajectories until stopped (SIGTERM/Ctrl-C).",
    )
    w.add_argument("--coordinator", required=True, metavar="URL", help="e.g. http://10.0.0.2:8765")
    w.add_argument(
        "--token", default=os.environ.get("ECHO2_TOKEN"), help="bearer token (default $ECHO2_TOKEN)"
    )
    w.add_argument("--name", default=socket.gethostname(), help="worker name shown in /status")
    w.add_argument("--price-per-hour", type=float, default=0.0, help="USD per hour, for cost accounting")
    w.add_argument("--hardware", default="cpu", help="free-form description shown in /status")
    w.add_argument(
        "--inbound",
        action="store_true",
        help="this host accepts inbound connections: serve snapshot chunks to a peer (relay role) "
        "on --relay-host:--relay-port",
    )
    w.add_argument("--relay-host", default="0.0.0.0", help="address the relay binds (default 0.0.0.0)")
    w.add_argument("--relay-port", type=int, default=0, help="relay port (default 0: any free port)")
    w.add_argument(
        "--relay-advertise",
        default=None,
        metavar="HOST",
        help="host peers reach the relay at (default: the address the coordinator sees)",
    )
    w.add_argument(
        "--upload-mbps",
        type=float,
        default=None,
        help="cap on relay upload, Mbit/s (default: the run's broadcast.worker_upload_mbps)",
    )
    w.add_argument(
        "--download-mbps",
        type=float,
        default=None,
        help="cap on snapshot download, Mbit/s (default: the run's broadcast.worker_download_mbps)",
    )
    w.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    w.add_argument(
        "--give-up-after",
        type=float,
        default=300.0,
        metavar="SEC",
        help="stop retrying an unreachable coordinator after this long",
    )
    w.add_argument(
        "--emulate",
        type=float,
        default=None,
        metavar="RATE",
        help="EMULATION for capacity experiments: no model, random responses at RATE trajectories/s",
    )
    w.add_argument(
        "--throughput",
        type=float,
        default=None,
        metavar="RATE",
        help="trajectories/s this worker declares at registration (default: the --emulate rate, else "
        "a calibration generation is timed once the model is loaded); the coordinator replaces it "
        "with what the worker delivers once measured",
    )
    w.add_argument(
        "--learner-key",
        default=None,
        metavar="FINGERPRINT",
        help="the learner key's fingerprint, as `echo2 run` logs it (default: trust the first key "
        "seen, and stop if it ever changes)",
    )
    w.add_argument("--ca-file", default=None, metavar="PEM", help="CA to verify an https coordinator with")
    w.add_argument(
        "--engine",
        choices=("hf", "vllm"),
        default=None,
        help="the engine this worker generates with, on its GPU if it has one (default: the run's "
        "rollout.engine)",
    )
    w.add_argument(
        "--dry-run",
        action="store_true",
        help="check the flags, print this worker's engine settings (engine, device, dtype, vLLM "
        "arguments) as JSON and exit without connecting",
    )
    w.add_argument(
        "--config",
        default=None,
        metavar="TOML",
        help="with --dry-run: the run config to resolve the settings for (a worker otherwise gets "
        "it from the coordinator)",
    )
    w.add_argument("-q", "--quiet", action="store_true", help="warnings only")
    pl = sub.add_parser(
        "plan",
        help="rollout throughput and the cheapest worker pool that keeps the learner busy",
        description="Capacity planning (ECHO-2 section 3.3-3.4): the throughput mu_min that "
        "keeps the learner saturated, and the minimum-cost workers that reach "
        "gamma * mu_min. With --memory CONFIG.toml --gpu NAME: the GPU memory plan instead.",
    )
    pl.add_argument("--t-train", type=float, metavar="SEC", help="seconds per learner step")
    pl.add_argument("--t-bcast", type=float, metavar="SEC", help="snapshot dissemination time")
    pl.add_argument("--batch", type=float, metavar="R", help="trajectories per learner step")
    pl.add_argument("--staleness", type=int, metavar="S", help="staleness bound S")
    pl.add_argument(
        "--kappa", type=int, default=None, metavar="K", help="publish period (default max(1, S-1))"
    )
    pl.add_argument("--gamma", type=float, default=1.1, metavar="G", help="safety factor (default 1.1)")
    pl.add_argument(
        "--model",
        choices=("continuous", "paper"),
        default="continuous",
        help="capacity model: 'continuous' (default) for echo2's workers, which keep generating "
        "during a broadcast; 'paper' for the paper's cycle model, in which they stop",
    )
    pl.add_argument(
        "--learner-price",
        type=float,
        default=0.0,
        metavar="USD_PER_HOUR",
        help="hourly price of the learner's machines",
    )
    pl.add_argument(
        "--pool",
        metavar="POOL.toml",
        help="[[workers]] tables with name, count, throughput (trajectories/s), price (USD/h)",
    )
    pl.add_argument("--json", action="store_true", help="print one JSON object")
    from echo2.memplan_cli import add_flags as add_memory_flags  # light: argparse only

    add_memory_flags(pl)
    from echo2.sim.cli import add_parser as add_simulate  # light: argparse only

    add_simulate(sub)
    add_export(sub)
    return p


def _plan(args: argparse.Namespace, extra: list[str]) -> int:
    import json

    if args.memory:
        from echo2.memplan_cli import run as memory_plan

        return memory_plan(args, extra)
    if extra:
        raise ConfigError(f"unexpected arguments: {' '.join(extra)}")
    capacity = ("t_train", "t_bcast", "batch", "staleness", "pool")  # required unless --memory
    missing = [f"--{k.replace('_', '-')}" for k in capacity if getattr(args, k) is None]
    if missing:
        raise ConfigError(f"{', '.join(missing)}: required (or --memory CONFIG.toml --gpu NAME)")

    from pydantic import ValidationError

    from echo2.config import validation_message
    from echo2.control.plan import PlanInput, make_plan, render

    try:
        inp = PlanInput(
            t_train=args.t_train,
            t_bcast=args.t_bcast,
            batch=args.batch,
            staleness=args.staleness,
            kappa=args.kappa,
            gamma=args.gamma,
            learner_price=args.learner_price,
            model=args.model,
        )
    except ValidationError as e:
        raise ConfigError("--" + validation_message(e).replace("_", "-", 1)) from None
    plan = make_plan(inp, _load_pool(args.pool))
    print(json.dumps(plan, indent=2) if args.json else render(plan))
    return 0 if plan["feasible"] else 1  # infeasible: no pool of this kind keeps the learner busy


def _resolve(args: argparse.Namespace, extra: list[str]):
    overrides = parse_overrides(extra)
    if args.resume:
        if args.config:
            raise ConfigError("give either CONFIG or --resume RUN_DIR, not both")
        run_dir = Path(args.resume)
        saved = run_dir / "config.toml"
        if not saved.is_file():
            raise ConfigError(f"{run_dir}: not a run directory (no config.toml)")
        return build_config(read_toml(saved), overrides), run_dir
    if not args.config:
        raise ConfigError("missing CONFIG (or --resume RUN_DIR)")
    config = load_config(args.config, overrides)
    return config, fresh_run_dir(config)


def _setup_logging(quiet: bool) -> None:
    logging.basicConfig(
        level=logging.WARNING if quiet else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _train(args: argparse.Namespace, extra: list[str]) -> int:
    workers = getattr(args, "workers", 0)
    if workers < 0:
        raise ConfigError("--workers: must be >= 0")
    config, run_dir = _resolve(args, extra)
    if args.dry_run:
        print(dump_toml(config), end="")
        return 0
    if args.resume:
        from echo2.learning.checkpoint import checkpoint_dir

        checkpoint_dir(run_dir)
    check_model_source(config)  # a missing directory, or a hub id while offline: before torch loads
    check_trackers(config.run.report_to)
    if args.command == "learner" or workers or config.scheduler.provider == "local":
        check_port(config.coordinator.host, config.coordinator.port)
    _setup_logging(args.quiet)
    from echo2.api import Echo2

    # SIGTERM unwinds like Ctrl-C, so `finally` blocks stop worker children and the coordinator.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    summary = Echo2(config, run_dir=run_dir).run(
        workers=workers,
        emulate=getattr(args, "emulate", None),
        serve=args.command == "learner",
        on_ready=_announce,
        resume=bool(args.resume),
        progress=not args.quiet,
    )
    before, after = summary["eval_before"], summary["eval_after"]
    if before and after:
        print(
            f"held-out accuracy: {before['eval/accuracy']:.3f} -> {after['eval/accuracy']:.3f}  ({run_dir})"
        )
        if "eval/outcome_mean" in after:
            print(
                "held-out outcome per episode: "
                f"{before['eval/outcome_mean']:+.3f} +- {before['eval/outcome_ci95']:.3f} -> "
                f"{after['eval/outcome_mean']:+.3f} +- {after['eval/outcome_ci95']:.3f} "
                f"({after['eval/count']:.0f} episodes); malformed actions "
                f"{before['eval/malformed_frac']:.3f} -> {after['eval/malformed_frac']:.3f}"
            )
    return 0


def _announce(source) -> None:
    """Where the coordinator listens and where its token is; a token the user gave is never printed."""
    where = f"from {source.token_origin}" if source.token_origin else f"in {source.token_file}"
    print(
        f"coordinator: {source.url}  token: {where}  status page: {source.url}/ui  "
        f"learner key: {source.fingerprint}",
        flush=True,
    )


def _load_pool(path):
    """A POOL.toml (`echo2 plan --pool`, `scheduler.pool`); a mistake names the file and the key."""
    from pydantic import ValidationError

    from echo2.config import validation_message
    from echo2.control.plan import Pool

    try:
        return Pool.model_validate(read_toml(path))
    except ValidationError as e:
        raise ConfigError(f"{path}: {validation_message(e)}") from None


def _worker(args: argparse.Namespace) -> int:
    if not args.token:
        raise ConfigError("--token: missing (or set ECHO2_TOKEN)")
    if not re.fullmatch(r"https?://[^/\s]+/?", args.coordinator):
        raise ConfigError(f"--coordinator: not an http:// or https:// URL: {args.coordinator!r}")
    for flag in ("upload_mbps", "download_mbps", "emulate", "throughput"):
        if getattr(args, flag) is not None and not getattr(args, flag) > 0:
            raise ConfigError(f"--{flag.replace('_', '-')}: must be > 0")
    if not 0 <= args.relay_port <= 65535:
        raise ConfigError("--relay-port: must be in 0..65535")
    from echo2.control.protocol import HOST_PATTERN  # light: pydantic only

    for flag in ("relay_host", "relay_advertise"):
        value = getattr(args, flag, None)
        if value is not None and not re.fullmatch(HOST_PATTERN, value):
            raise ConfigError(f"--{flag.replace('_', '-')}: not a host name or address: {value!r}")
    if args.ca_file is not None and not Path(args.ca_file).is_file():
        raise ConfigError(f"--ca-file: no such file {args.ca_file}")
    if args.learner_key is not None and not re.fullmatch(r"[0-9a-fA-F]{16,64}", args.learner_key):
        raise ConfigError("--learner-key: not a key fingerprint (16 to 64 hex digits)")
    if args.config is not None and not args.dry_run:
        raise ConfigError(
            "--config: only with --dry-run (a worker takes the run config from the coordinator)"
        )
    if args.dry_run:
        return _worker_dry_run(args)
    _setup_logging(args.quiet)
    import asyncio

    import torch

    from echo2.broadcast.relay import FAULT_FLIP_BYTE_ENV
    from echo2.control.client import Released, Unauthorized
    from echo2.rollout.worker import KeyChanged, RelayStartError, Worker, WorkerConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    worker = Worker(
        WorkerConfig(
            url=args.coordinator,
            token=args.token,
            name=args.name,
            price_per_hour=args.price_per_hour,
            hardware=args.hardware,
            inbound=args.inbound,
            give_up_after=args.give_up_after,
            emulate=args.emulate,
            throughput=args.throughput,
            relay_host=args.relay_host,
            relay_port=args.relay_port,
            relay_advertise=args.relay_advertise,
            upload_mbps=args.upload_mbps,
            download_mbps=args.download_mbps,
            fault_flip_byte=os.environ.get(FAULT_FLIP_BYTE_ENV) == "1",
            learner_key=args.learner_key,
            ca_file=args.ca_file,
            engine=args.engine,
        )
    )

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await worker.run(stop)

    try:
        asyncio.run(main())
    except Unauthorized as e:
        raise ConfigError(f"--token: the coordinator refused it ({e.body})") from None
    except RelayStartError as e:
        raise ConfigError(str(e)) from None
    except KeyChanged as e:
        print(f"echo2 worker: stopped: {e}", file=sys.stderr)
        return 1
    except Released as e:  # registering after the run finished
        log.info("stopping: %s", e.detail or e.reason)
    except ConnectionError as e:
        print(f"echo2 worker: {e}", file=sys.stderr)
        return 1
    log.info("worker stopped: %s", worker.counts)
    return 0


def _worker_dry_run(args: argparse.Namespace) -> int:
    """`echo2 worker --dry-run`: the engine settings this worker would start with, as JSON, for
    --config's run (else only what the flags and this machine decide); nothing connects."""
    import json

    if args.emulate is not None:
        settings: dict = {"engine": f"emulated ({args.emulate} trajectories/s, no model)", "device": "cpu"}
    else:
        from echo2.rollout.engines import worker_device, worker_settings

        device = worker_device()
        if args.config is None:
            settings = {
                "engine": args.engine or "(the run's rollout.engine)",
                "device": str(device),
                "dtype": "(the run's snapshot dtype)",
            }
        else:
            config = load_config(args.config)
            check_model_source(config)
            settings = worker_settings(config, engine=args.engine, device=device)
    print(json.dumps(settings, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    args, extra = _parser().parse_known_args(argv)
    try:
        if args.command == "simulate":
            from echo2.sim.cli import run as simulate

            return simulate(args, extra)
        if args.command == "export":
            if extra:
                raise ConfigError(f"unexpected arguments: {' '.join(extra)}")
            from echo2.export import run as export

            return export(args)
        if args.command == "plan":
            return _plan(args, extra)
        if args.command == "worker":
            if extra:
                raise ConfigError(f"unexpected arguments: {' '.join(extra)}")
            return _worker(args)
        return _train(args, extra)
    except ConfigError as e:
        print(f"echo2: config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
