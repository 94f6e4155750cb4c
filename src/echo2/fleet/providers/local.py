"""Worker processes on this machine, talking to the coordinator over loopback through exactly the
code remote workers use.

Two uses: `echo2 run --workers K` starts K identical workers at once, and the `local` provider
(`scheduler.provider = "local"`) offers a pool of slots (POOL.toml: name, count, throughput, price)
that the online scheduler starts and stops one by one. Owns every child's lifetime: all are stopped
(SIGTERM, then SIGKILL after a grace period) when the run ends or is interrupted.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from dataclasses import dataclass

from echo2.fleet.selection import WorkerOffer
from echo2.rollout.worker_config import WorkerConfig, to_argv
from echo2.wire import identity

logger = logging.getLogger(__name__)


@dataclass(slots=True, kw_only=True)
class _Slot:
    offer: WorkerOffer
    proc: subprocess.Popen | None = None
    stopping: bool = False
    failed: bool = False
    """Its process exited without being asked to: never offered again."""
    secret: str | None = None
    """Put in the worker's environment at its start (identity.SLOT_SECRET_ENV): its proof."""


class LocalFleet:
    """Slots for worker processes; `initial` of them (cheapest per unit throughput first) start
    with the run, the rest wait as offers for the scheduler."""

    def __init__(
        self,
        offers: list[WorkerOffer],
        *,
        initial: int,
        threads: int | None = None,
        emulate: bool = False,
    ) -> None:
        self.slots = {o.name: _Slot(offer=o) for o in offers}
        self.initial = min(initial, len(offers))
        self.emulate = emulate
        cores = threads or os.cpu_count() or 1
        # One share of the cores for the learner and one per running worker, so nobody oversubscribes.
        share = max(1, min(len(offers), 8))
        self.worker_threads = max(1, cores // (share + 1))
        self.learner_threads = max(1, cores - self.worker_threads * min(share, self.initial or 1))
        self.url = self.token = None
        self.learner_key = self.ca_file = None
        """The learner key's fingerprint the workers pin, the CA of an https coordinator."""
        self._lock = threading.Lock()  # the scheduler calls in from the coordinator's thread
        self._closed = False

    @classmethod
    def identical(cls, count: int, *, threads: int | None = None, emulate: float | None = None) -> LocalFleet:
        """`echo2 run --workers K [--emulate RATE]`: K workers, all started with the run."""
        offers = [WorkerOffer(name=f"local-{i}", throughput=emulate or 0.0, price=0.0) for i in range(count)]
        return cls(offers, initial=count, threads=threads, emulate=emulate is not None)

    # ------------------------------------------------------------------ lifetime
    def start(self, source) -> None:
        """Called once the coordinator listens: start the initial slots."""
        self.url, self.token = source.url, source.token
        self.learner_key = getattr(source, "fingerprint", None)
        config = getattr(source, "config", None)
        self.ca_file = config.coordinator.tls_cert if config is not None else None
        order = sorted(self.slots.values(), key=lambda s: (s.offer.rho, s.offer.name))
        for slot in order[: self.initial]:
            self.start_slot(slot.offer.name)
        logger.info(
            "started %d local workers (%d threads each) for %s", self.initial, self.worker_threads, self.url
        )

    def start_slot(self, name: str) -> None:
        with self._lock:
            if not self._closed:
                self._start(name)

    def _start(self, name: str) -> None:
        slot = self.slots[name]
        if slot.proc is not None or slot.failed:
            raise ValueError(f"slot {name!r} is running or failed")
        config = WorkerConfig(
            url=self.url,
            token=self.token,
            name=name,
            price_per_hour=slot.offer.price,
            inbound=True,  # relays snapshots to a peer (chain mode)
            relay_host="127.0.0.1",
            emulate=slot.offer.throughput if self.emulate else None,
            learner_key=self.learner_key,
            ca_file=self.ca_file,  # a self-signed certificate is its own CA
        )
        slot.secret = identity.new_secret()  # a fresh one per start
        env = {**os.environ, "ECHO2_TOKEN": self.token, "OMP_NUM_THREADS": str(self.worker_threads)}
        env[identity.SLOT_SECRET_ENV] = slot.secret
        cmd = [sys.executable, "-m", "echo2.cli", "worker", *to_argv(config)]
        cmd += ["--threads", str(self.worker_threads), "-q"]
        slot.proc = subprocess.Popen(cmd, env=env)
        slot.stopping = False
        logger.info("local provider: started %s (pid %d)", name, slot.proc.pid)

    def stop_slot(self, name: str, *, failed: bool = False) -> None:
        """Ask the worker to stop (SIGTERM). The slot is offered again once its process has exited,
        unless `failed` (a worker that went silent is not trusted again)."""
        with self._lock:
            slot = self.slots[name]
            slot.failed = slot.failed or failed
            if slot.proc is not None and slot.proc.poll() is None:
                slot.proc.terminate()
                slot.stopping = True
                logger.info("local provider: stopping %s (pid %d)", name, slot.proc.pid)

    def offers(self) -> list[WorkerOffer]:
        """Slots that can be started now. Reaps exited processes; one that exited unasked is failed."""
        with self._lock:
            free = []
            for slot in self.slots.values():
                if slot.proc is not None and slot.proc.poll() is not None:
                    if not slot.stopping:
                        slot.failed = True
                        logger.warning(
                            "local provider: %s exited with %s", slot.offer.name, slot.proc.returncode
                        )
                    slot.proc = None
                if slot.proc is None and not slot.failed and not self._closed:
                    free.append(slot.offer)
            return free

    def running(self) -> list[WorkerOffer]:
        """Slots whose process runs (started, perhaps not registered yet)."""
        with self._lock:
            return [
                s.offer
                for s in self.slots.values()
                if s.proc is not None and s.proc.poll() is None and not s.stopping
            ]

    def owns(self, name: str) -> bool:
        return name in self.slots

    def proves(self, name: str, proof: str | None) -> bool:
        slot = self.slots.get(name)
        return slot is not None and identity.proves(proof, slot.secret)

    def pid(self, name: str) -> int | None:
        proc = self.slots[name].proc
        return proc.pid if proc is not None else None

    def stop(self, grace: float = 10.0) -> None:
        """Idempotent: SIGTERM every child, wait, SIGKILL the ones still running. Nothing starts after."""
        with self._lock:
            self._closed = True
            procs = [s.proc for s in self.slots.values() if s.proc is not None]
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=grace)
        for s in self.slots.values():
            s.proc = None
