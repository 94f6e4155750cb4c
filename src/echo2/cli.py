"""`echo2` command line. Thin: parse, validate the config, then import the heavy modules.

`run` and `learner` call `learning.loop.run` with the `SourceSpec` the flags describe (in process,
a coordinator, local worker processes via `fleet.providers.local`); `worker` is
`rollout.worker_cli` (it runs `rollout.worker.Worker`); `plan` prints `planning.plan.make_plan`; `simulate` hands over to
`sim.cli`. User mistakes (bad config key, missing file, missing token) exit with status 2 and one
line naming the key or file, before anything starts. Knows no policy of its own.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from echo2 import setup_logging
from echo2.config import ConfigError, build_config, dump_toml, load_config, parse_overrides, read_toml
from echo2.preflight import check_model_source, check_port, fresh_run_dir
from echo2.tracking import check_trackers

log = logging.getLogger("echo2")


def _parser() -> argparse.ArgumentParser:
    from echo2 import __version__
    from echo2.learning.export import add_parser as add_export  # light: argparse only
    from echo2.rollout.worker_cli import add_parser as add_worker  # light: argparse only

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
    add_worker(sub)
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
        "--wire",
        choices=("bf16", "fp32"),
        default="bf16",
        help="dtype of the published snapshot (learner.dtype), for the delta prediction (default bf16)",
    )
    pl.add_argument(
        "--delta-ratio",
        type=float,
        default=None,
        metavar="R",
        help="delta bytes / full snapshot bytes for the delta prediction (default: the measured "
        "median for --wire and kappa, docs/bench/snapshot_delta.json)",
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
    pl.add_argument(
        "--catalog",
        choices=("skypilot",),
        help="candidate workers from a GPU price catalog (instead of --pool), with --throughputs",
    )
    pl.add_argument(
        "--catalog-dir",
        metavar="DIR",
        help="catalog in SkyPilot's layout, DIR/CLOUD/vms.csv (default: SkyPilot's own, fetched by sky)",
    )
    pl.add_argument(
        "--throughputs",
        metavar="FILE.toml",
        help="[throughput] ACCELERATOR = trajectories/s of one worker; max_workers per type",
    )
    pl.add_argument(
        "--dry-run",
        action="store_true",
        help="with --catalog: offline (prices from --catalog-dir only); prints the "
        "[[scheduler.skypilot.workers]] tables to rent and starts nothing",
    )
    pl.add_argument("--json", action="store_true", help="print one JSON object")
    from echo2.planning.memory_cli import add_flags as add_memory_flags  # light: argparse only

    add_memory_flags(pl)
    from echo2.sim.cli import add_parser as add_simulate  # light: argparse only

    add_simulate(sub)
    add_export(sub)
    return p


def _plan(args: argparse.Namespace, extra: list[str]) -> int:
    import json

    if args.memory:
        from echo2.planning.memory_cli import run as memory_plan

        return memory_plan(args, extra)
    if extra:
        raise ConfigError(f"unexpected arguments: {' '.join(extra)}")
    pool_from = ("catalog", "throughputs") if args.catalog else ("pool",)
    capacity = ("t_train", "t_bcast", "batch", "staleness", *pool_from)  # required unless --memory
    missing = [f"--{k.replace('_', '-')}" for k in capacity if getattr(args, k) is None]
    if missing:
        raise ConfigError(f"{', '.join(missing)}: required (or --memory CONFIG.toml --gpu NAME)")
    if args.catalog and args.pool:
        raise ConfigError("--pool: give either --pool or --catalog, not both")
    if args.dry_run and not args.catalog_dir:
        raise ConfigError("--catalog-dir: --dry-run reads prices offline, from a catalog directory")

    from pydantic import ValidationError

    from echo2.config import validation_message
    from echo2.planning.plan import PlanInput, load_pool, make_plan, render

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
            wire=args.wire,
            delta_ratio=args.delta_ratio,
        )
    except ValidationError as e:
        raise ConfigError("--" + validation_message(e).replace("_", "-", 1)) from None
    if args.catalog:
        from echo2.planning.catalog import plan_from_catalog

        plan, text = plan_from_catalog(inp, catalog_dir=args.catalog_dir, throughputs=args.throughputs)
        print(json.dumps(plan, indent=2) if args.json else text)
        return 0 if plan["feasible"] else 1
    plan = make_plan(inp, load_pool(args.pool))
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
    setup_logging(args.quiet)
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
    from echo2.learning import distributed

    distributed.leave(0)  # a torchrun rank ends here, past the interpreter's teardown (see there)
    return 0


def _announce(source) -> None:
    """Where the coordinator listens and where its token is; a token the user gave is never printed."""
    where = f"from {source.token_origin}" if source.token_origin else f"in {source.token_file}"
    print(
        f"coordinator: {source.url}  token: {where}  status page: {source.url}/ui  "
        f"learner key: {source.fingerprint}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    args, extra = _parser().parse_known_args(argv)
    try:
        if extra and args.command in ("export", "worker"):  # the others take config overrides
            raise ConfigError(f"unexpected arguments: {' '.join(extra)}")
        if args.command == "simulate":
            from echo2.sim.cli import run as simulate

            return simulate(args, extra)
        if args.command == "export":
            from echo2.learning.export import run as export

            return export(args)
        if args.command == "plan":
            return _plan(args, extra)
        if args.command == "worker":
            from echo2.rollout.worker_cli import run as worker

            return worker(args)
        return _train(args, extra)
    except ConfigError as e:
        print(f"echo2: config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
