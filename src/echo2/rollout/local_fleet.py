"""`echo2 run --workers K`: K worker processes on this machine, talking to the coordinator over
loopback through exactly the code remote workers use. Owns their lifetime: every child is stopped
(SIGTERM, then SIGKILL after a grace period) when the run ends or is interrupted.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

logger = logging.getLogger(__name__)


class LocalFleet:
    def __init__(self, num_workers: int, *, threads: int | None = None, emulate: float | None = None) -> None:
        self.emulate = emulate
        cores = threads or os.cpu_count() or 1
        # One share of the cores for the learner and one per worker, so nobody oversubscribes.
        self.worker_threads = max(1, cores // (num_workers + 1))
        self.learner_threads = max(1, cores - self.worker_threads * num_workers)
        self.num_workers = num_workers
        self.procs: list[subprocess.Popen] = []

    def start(self, source) -> None:
        env = {**os.environ, "ECHO2_TOKEN": source.token, "OMP_NUM_THREADS": str(self.worker_threads)}
        for i in range(self.num_workers):
            cmd = [
                sys.executable,
                "-m",
                "echo2.cli",
                "worker",
                "--coordinator",
                source.url,
                "--name",
                f"local-{i}",
                "--threads",
                str(self.worker_threads),
                "-q",
            ]
            if self.emulate:
                cmd += ["--emulate", str(self.emulate)]
            self.procs.append(subprocess.Popen(cmd, env=env))
        logger.info(
            "started %d local workers (%d threads each) for %s",
            self.num_workers,
            self.worker_threads,
            source.url,
        )

    def stop(self, grace: float = 10.0) -> None:
        """Idempotent: SIGTERM every child, wait, SIGKILL the ones still running."""
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=grace)
        self.procs.clear()
