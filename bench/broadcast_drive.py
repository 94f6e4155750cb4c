"""The broadcast benchmark's process driving (broadcast.py runs the network and calls these): the
learner's stdout read with deadlines (`_Lines`), the workers' command line, and `drive`, which
starts the learner, then the workers once it listens, and returns the learner's JSON."""

from __future__ import annotations

import json
import queue
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from broadcast_report import BenchSpec


class BenchError(RuntimeError):
    """The benchmark could not run or did not finish (the message says where it stopped)."""


class _Lines:
    """Lines of a child's stdout, read by a thread (so waiting for one has a deadline)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.q: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:
            for line in proc.stdout:  # type: ignore[union-attr]
                self.q.put(line)
            self.q.put(None)

        threading.Thread(target=pump, daemon=True).start()

    def get(self, deadline: float) -> str | None:
        """The next line; None at end of output; TimeoutError past the deadline."""
        try:
            return self.q.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError from None


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:].strip()
    except OSError:
        return ""


def worker_args(url: str, i: int, relay_host: str) -> list[str]:
    return [
        "-m",
        "echo2.rollout.broadcast_peer",
        f"--coordinator={url}",
        f"--name=w{i:02d}",
        "--inbound",
        f"--relay-host={relay_host}",
        "-q",
    ]  # the token comes from ECHO2_TOKEN


def drive(
    spec: BenchSpec,
    start_learner: Callable[[], subprocess.Popen],
    start_worker: Callable[[int, str], subprocess.Popen],
    budget: float,
    logs: Path,
    stop: Callable[[], None] | None,
    on_line: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Start the learner, then the workers once it listens; return the learner's JSON, which it
    must print within `budget` seconds (plus a margin). A `THROTTLE ...` line before it goes to
    `on_line`. `stop` ends the processes (None: the shaped network's teardown does)."""
    try:
        learner = start_learner()
        lines = _Lines(learner)
        start_deadline = time.monotonic() + 60.0
        try:
            first = lines.get(start_deadline)
        except TimeoutError:
            raise BenchError(f"the learner did not start in 60 s: {_tail(logs / 'learner.log')}") from None
        if not first or not first.startswith("READY "):
            raise BenchError(f"the learner did not start: {first!r} {_tail(logs / 'learner.log')}")
        url = first.split()[1]
        workers = [start_worker(i, url) for i in range(spec.workers)]
        # registration + warm-up + measured broadcast, each bounded inside the learner too
        deadline = time.monotonic() + budget + 30.0
        try:
            line = lines.get(deadline)
            while line and line.startswith("THROTTLE ") and on_line is not None:
                on_line(line)
                line = lines.get(deadline)
        except TimeoutError:
            raise BenchError("the learner did not report in time") from None
        dead = [
            f"w{i:02d} (exit {w.returncode}): {_tail(logs / f'w{i}.log', 400)}"
            for i, w in enumerate(workers)
            if w.poll() is not None
        ]
        if not line:
            raise BenchError(f"the learner exited without a result: {_tail(logs / 'learner.log')}")
        result = json.loads(line)
        if "error" in result:
            raise BenchError(f"{result['error']}" + (f"; workers that exited: {dead}" if dead else ""))
        return result
    finally:
        if stop is not None:
            stop()
