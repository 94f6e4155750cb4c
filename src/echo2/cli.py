"""`echo2` command line. Thin: parse, validate the config, then import the heavy modules.

User mistakes (bad config key, missing file) exit with status 2 and one line naming the key or
file, before anything starts.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from echo2.config import ConfigError, build_config, dump_toml, load_config, parse_overrides, read_toml


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="echo2", description="Cost-efficient RL post-training of LLMs (ECHO-2).")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser(
        "run",
        help="train with GRPO on this machine (learner and rollout take turns)",
        description="Run GRPO from a TOML config. Any field can be overridden: --learner.lr=1e-6.",
        epilog="example: echo2 run configs/quickstart.toml --run.seed=1 --learner.steps=10",
    )
    r.add_argument("config", nargs="?", help="TOML config file (omit with --resume)")
    r.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its checkpoint")
    r.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    r.add_argument("-q", "--quiet", action="store_true", help="no progress bar, warnings only")
    return p


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
    return config, config.run_dir()


def main(argv: list[str] | None = None) -> int:
    args, extra = _parser().parse_known_args(argv)
    try:
        config, run_dir = _resolve(args, extra)
    except ConfigError as e:
        print(f"echo2: config error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(dump_toml(config), end="")
        return 0
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from echo2.learning.loop import run  # heavy: torch, transformers

    try:
        if args.resume:
            from echo2.learning.checkpoint import checkpoint_dir

            checkpoint_dir(run_dir)
        elif (run_dir / "checkpoint").exists():
            raise ConfigError(f"{run_dir}: already holds a run; use --resume {run_dir} or another run.dir")
        summary = run(config, run_dir=run_dir, resume=bool(args.resume), progress=not args.quiet)
    except ConfigError as e:
        print(f"echo2: config error: {e}", file=sys.stderr)
        return 2
    before, after = summary["eval_before"], summary["eval_after"]
    if before and after:
        print(
            f"held-out accuracy: {before['eval/accuracy']:.3f} -> {after['eval/accuracy']:.3f}  ({run_dir})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
