"""`echo2 worker`: the subcommand and the worker's start (rollout/worker.py runs it).

The worker's flags are `WorkerConfig`'s fields, checked by it alone (rollout/worker_config.py);
this module adds only the process's own (`--threads`, `--dry-run`, `--config`, `-q`). A mistake in
a flag exits with status 2 and one line naming the flag, before anything connects; `--dry-run`
prints the engine settings this worker would start with and exits. Imports torch and the worker
only once the flags are checked, so `--help` stays instant.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from typing import Any

from echo2 import setup_logging
from echo2.config import ConfigError, load_config
from echo2.preflight import check_model_source
from echo2.rollout.worker_config import KeyChanged, RelayStartError, WorkerConfig, add_flags, from_flags

log = logging.getLogger("echo2")


def add_parser(sub: Any) -> None:
    """The `worker` subcommand on the CLI's subparsers."""
    w = sub.add_parser(
        "worker",
        help="generate rollouts for a learner's coordinator",
        description="Register with a coordinator, install its snapshots, lease prompts, "
        "generate, score and push trajectories until stopped (SIGTERM/Ctrl-C).",
    )
    add_flags(w, WorkerConfig, token=os.environ.get("ECHO2_TOKEN"), name=socket.gethostname())
    w.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
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


def run(args: argparse.Namespace) -> int:
    """`echo2 worker`: check the flags (exit 2 naming one), then run the worker until stopped."""
    config = from_flags(WorkerConfig, args)
    if args.config is not None and not args.dry_run:
        raise ConfigError(
            "--config: only with --dry-run (a worker takes the run config from the coordinator)"
        )
    if args.dry_run:
        return _dry_run(args, config)
    setup_logging(args.quiet)
    import asyncio

    import torch

    from echo2.rollout.server_launch import ServerDied, ServerStartError
    from echo2.rollout.worker import Worker
    from echo2.wire.errors import Quarantined, Refused, Released, SlotUnproven, Unauthorized

    if args.threads:
        torch.set_num_threads(args.threads)
    worker = Worker(config)

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
    except Quarantined as e:
        print(f"echo2 worker: stopped: quarantined by the coordinator ({e.detail})", file=sys.stderr)
        return 1
    except SlotUnproven as e:  # --name is a provider's slot, and this process was not started in it
        print(f"echo2 worker: stopped: --name: {e.detail}", file=sys.stderr)
        return 1
    except Released as e:  # registering after the run finished
        log.info("stopping: %s", e.detail or e.reason)
    except Refused as e:  # any other refusal the worker does not act on: one line, not a traceback
        print(f"echo2 worker: stopped: the coordinator refused ({e.reason}: {e.detail})", file=sys.stderr)
        return 1
    except (ConnectionError, ServerDied, ServerStartError) as e:  # ServerDown is a ConnectionError
        print(f"echo2 worker: stopped: {e}", file=sys.stderr)
        return 1
    log.info("worker stopped: %s", worker.counts)
    return 0


def _dry_run(args: argparse.Namespace, worker: WorkerConfig) -> int:
    """`echo2 worker --dry-run`: the engine settings this worker would start with, as JSON, for
    --config's run (else only what the flags and this machine decide); nothing connects."""
    import json

    if worker.emulate is not None:
        settings: dict = {"engine": f"emulated ({worker.emulate} trajectories/s, no model)", "device": "cpu"}
    else:
        from echo2.rollout.engines import worker_device, worker_settings

        device = worker_device()
        if args.config is None:
            settings = {
                "engine": worker.engine or "(the run's rollout.engine)",
                "device": str(device),
                "dtype": "(the run's snapshot dtype)",
            }
        else:
            config = load_config(args.config)
            check_model_source(config)
            settings = worker_settings(config, engine=worker.engine, device=device, server_url=worker.server_url)
    print(json.dumps(settings, indent=2))
    return 0
