"""The child processes a benchmark starts: the environment they run with (`child_env`: echo2's
`src` and the venv first, so `python -m echo2...` works inside a network namespace too) and how
they are stopped (`stop_processes`, by the Popen objects the caller holds, never by name). Knows
nothing about namespaces or what the children do.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import echo2

SRC_DIR = Path(echo2.__file__).resolve().parents[1]
"""The directory holding the echo2 package this process imported (a checkout's `src`)."""


def child_env(extra: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """The caller's environment plus what a `python -m echo2...` child needs: PYTHONPATH with echo2's
    `src` first, and (in a venv) VIRTUAL_ENV and the venv's `bin` first on PATH. `extra` overrides;
    a None value removes the variable."""
    env = dict(os.environ)
    pp = [str(SRC_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(SRC_DIR)]
    env["PYTHONPATH"] = os.pathsep.join(pp)
    if sys.prefix != sys.base_prefix:
        venv_bin = str(Path(sys.executable).parent)
        env["VIRTUAL_ENV"] = sys.prefix
        path = [p for p in env.get("PATH", "").split(os.pathsep) if p and p != venv_bin]
        env["PATH"] = os.pathsep.join([venv_bin, *path])
    for k, v in (extra or {}).items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def stop_processes(procs: Sequence[subprocess.Popen], grace: float = 3.0) -> list[str]:
    """SIGTERM each process we started (its whole group when it leads one), SIGKILL what is left
    after `grace` seconds; returns the ones that would not exit."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGTERM) if _leads_group(p) else p.terminate()
    deadline = time.monotonic() + grace
    errors = []
    for p in live:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL) if _leads_group(p) else p.kill()
            try:
                p.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                errors.append(f"process {p.pid} did not exit")
    return errors


def _leads_group(p: subprocess.Popen) -> bool:
    try:
        return os.getpgid(p.pid) == p.pid
    except ProcessLookupError:
        return False


def cpu_list(text: str | None) -> set[int] | None:
    """`--server-cpus 0` / `--client-cpus 1,2-3` as a set of CPUs (None: not given)."""
    if not text:
        return None
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def add_cpu_options(parser) -> None:
    """`--server-cpus` / `--client-cpus` on a load bench's argparse parser."""
    parser.add_argument("--server-cpus", help="CPUs of the coordinator's process (its threads, its parser)")
    parser.add_argument("--client-cpus", help="CPUs of the client processes, e.g. 1 (default: the server's)")


def start_on_server_cpus(args) -> dict:
    """Pins this process (the server's side) to `--server-cpus` when given; returns the result header
    every load bench writes: its arguments, its CPUs and the load average at its start."""
    if args.server_cpus:
        os.sched_setaffinity(0, cpu_list(args.server_cpus))
    return {"args": vars(args), "cpus": sorted(os.sched_getaffinity(0)), "loadavg": os.getloadavg()}


@contextlib.contextmanager
def pinned(cpus: set[int] | None):
    """The calling thread on `cpus` for the block (None: unchanged): a process or thread started
    inside it inherits them, so a bench can keep its clients off the server's core."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
