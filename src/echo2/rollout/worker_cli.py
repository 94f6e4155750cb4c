"""`echo2 worker`: its flags, their checks, and the worker's start (rollout/worker.py runs it).

A mistake in a flag exits with status 2 and one line naming the flag, before anything connects;
`--dry-run` prints the engine settings this worker would start with and exits. Imports torch and
the worker only once the flags are checked, so `--help` stays instant.
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
from typing import Any

from echo2 import setup_logging
from echo2.config import ConfigError, load_config
from echo2.preflight import check_model_source

log = logging.getLogger("echo2")


def add_parser(sub: Any) -> None:
    """The `worker` subcommand on the CLI's subparsers."""
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


def run(args: argparse.Namespace) -> int:
    """`echo2 worker`: check the flags (exit 2 naming one), then run the worker until stopped."""
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
        return _dry_run(args)
    setup_logging(args.quiet)
    import asyncio

    import torch

    from echo2.control.errors import Quarantined, Refused, Released, Unauthorized
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
    except Quarantined as e:
        print(f"echo2 worker: stopped: quarantined by the coordinator ({e.detail})", file=sys.stderr)
        return 1
    except Released as e:  # registering after the run finished
        log.info("stopping: %s", e.detail or e.reason)
    except Refused as e:  # any other refusal the worker does not act on: one line, not a traceback
        print(f"echo2 worker: stopped: the coordinator refused ({e.reason}: {e.detail})", file=sys.stderr)
        return 1
    except ConnectionError as e:
        print(f"echo2 worker: {e}", file=sys.stderr)
        return 1
    log.info("worker stopped: %s", worker.counts)
    return 0


def _dry_run(args: argparse.Namespace) -> int:
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
