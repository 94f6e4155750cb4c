"""What `echo2 run` / `echo2 learner` decide and check before anything heavy loads or anything is
written: which run directory a run gets, whether the model source can be had, whether the
coordinator's port is free; and removing a run directory that a failed start created.

Runs never collide: a config that does not set `run.dir` gets `runs/{name}-seed{seed}`, or, when
that is taken, the first free `...-2`, `...-3`; a `run.dir` set explicitly that already holds a run
is refused (exit 2) unless the run is resumed. A user mistake raises `ConfigError` naming the key.
Imports no torch or transformers, so these checks answer in well under a second.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

from echo2.config import Config, ConfigError

HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")
"""What the hub accepts as a repository id: `name` or `owner/name`."""

RUN_FILES = ("config.toml", "checkpoint", "checkpoint.old", "metrics.jsonl")
"""Any of these in a directory means a run (finished, running or crashed) lives there."""


def holds_run(path: Path) -> bool:
    return any((path / name).exists() for name in RUN_FILES)


def fresh_run_dir(config: Config) -> Path:
    """The directory a new run writes: `run.dir` as set explicitly (refused if it holds a run), or
    the default template's path with the first free numeric suffix."""
    base = config.run_dir()
    if "dir" in config.run.model_fields_set:
        if holds_run(base):
            raise ConfigError(f"{base}: already holds a run; use --resume {base} or another run.dir")
        return base
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def check_model_source(config: Config) -> None:
    """model.path of an `hf` model: a local directory with config.json, or a hub id; offline
    (HF_HUB_OFFLINE=1) a hub id must already be in the local cache."""
    if config.model.type != "hf":
        return
    raw = config.model.path
    local = Path(raw).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ConfigError(f"model.path: {local}: no model directory (expected {local}/config.json)")
        return
    if raw.startswith(("/", ".", "~")) or not HUB_ID.match(raw) or Path(raw.split("/")[0]).is_dir():
        raise ConfigError(f"model.path: {local}: no such directory")
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(raw, "config.json"), str):
        return  # in the local hub cache
    if _offline():
        raise ConfigError(
            f"model.path: {raw}: no such local directory, and not in the hub cache "
            "(HF_HUB_OFFLINE is set, so it cannot be downloaded)"
        )
    endpoint = hub_endpoint()
    if not reachable(endpoint):
        raise ConfigError(
            f"model.path: {raw}: no such local directory, and the hub ({endpoint}) cannot be reached "
            "to download it"
        )


def hub_endpoint() -> str:
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT") or constants.ENDPOINT


def reachable(url: str, timeout: float = 3.0) -> bool:
    """A TCP connection to the URL's host and port opens within `timeout` (no retries)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname or "", port), timeout=timeout):
            return True
    except OSError:
        return False


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def check_port(host: str, port: int) -> None:
    """A fixed coordinator port (not 0) must be free to bind now; the coordinator binds it again."""
    if port == 0:
        return
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        raise ConfigError(bind_message(host, port, e)) from None


def bind_message(host: str, port: int, error: OSError) -> str:
    why = "address already in use" if error.errno == errno.EADDRINUSE else (error.strerror or str(error))
    return f"coordinator.port: cannot listen on {host}:{port}: {why}"


def one_line(error: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message, shortened: what a one-line error shows."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


@contextlib.contextmanager
def removed_on_failure(run_dir: Path) -> Iterator[None]:
    """Create `run_dir` if needed; if the block fails, remove it again when it was created here,
    so a run that never started leaves nothing half-written."""
    created = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        yield
    except BaseException:
        if created:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
