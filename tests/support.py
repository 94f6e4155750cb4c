"""Helpers shared by the test files: importable as `support` (pyproject.toml puts tests/ on
pytest's pythonpath). Fixtures live in conftest.py; plain values and builders live here."""

from __future__ import annotations

import asyncio
import copy
import json
import signal
import socket
import subprocess
from pathlib import Path

from echo2.config import CoordinatorConfig, LearnerConfig
from echo2.coordinator.leases import Limits, Work
from echo2.coordinator.state import CoordinatorState
from echo2.data.buffer import ReplayBuffer
from echo2.rollout.broadcast_peer import BroadcastPeer
from echo2.rollout.worker_config import PeerConfig

TINY = str(Path(__file__).parents[1] / "configs" / "tiny.toml")
"""The tiny random-model configuration every end-to-end test starts from."""

LIMITS = Limits(vocab_size=100, max_prompt_tokens=8, max_new_tokens=4, group_size=2)


class FakeClock:
    """A clock the test moves by hand: `clock.now += 5`."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_state(clock: FakeClock | None = None, *, groups_per_step: int = 1024, **extra) -> CoordinatorState:
    """A coordinator state over a tiny vocabulary: S = 1, groups of 2, group ids g0, g1, ...;
    lease timeout 30 s, heartbeat timeout 10 s, 4 leases per worker. `extra` sets `[coordinator]`
    keys (e.g. `groups_per_lease`) and the state's other arguments (`scheduler`, `broadcast`, ...)."""
    section = {"lease_timeout": 30.0, "heartbeat_timeout": 10.0, "max_leases_per_worker": 4}
    section |= {k: extra.pop(k) for k in list(extra) if k in CoordinatorConfig.model_fields}
    work = Work(
        buffer=ReplayBuffer(staleness=1, group_size=2),
        limits=LIMITS,
        group_id_of=lambda i: f"g{i}",
        groups_per_step=groups_per_step,
    )
    if clock is not None:
        extra["clock"] = clock
    return CoordinatorState(CoordinatorConfig(**section), work=work, **extra)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_journal(run_dir: Path) -> list[dict]:
    """The run's journal (RUN_DIR/accepted.jsonl) as dicts, whole lines only; [] before it exists."""
    path = run_dir / "accepted.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def stop_processes(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every process still running, then wait for each, killing any not gone within 30 s."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def checked_train_step(model, tok, groups, check, *, temperature: float, micro_batch_tokens: int) -> dict:
    """One `train_step` (lr 1e-4) on a copy of `model` under the learner's `check`; its stats."""
    from echo2.learning.step import make_optimizer, train_step

    model = copy.deepcopy(model)
    lcfg = LearnerConfig(lr=1e-4, micro_batch_tokens=micro_batch_tokens)
    return train_step(
        model,
        make_optimizer(model, lcfg),
        groups,
        lcfg,
        pad_id=tok.pad_token_id,
        temperature=temperature,
        check=check,
    )


def run_with_fleet(config, run_dir: Path, fleet, on_ready) -> dict:
    """The learner loop over workers (`SourceSpec(remote=True)`), `on_ready(source)` called once the
    coordinator listens (it starts `fleet`); the fleet is stopped however the run ends."""
    from echo2.learning.loop import run
    from echo2.learning.sources import SourceSpec

    try:
        return run(
            config, run_dir=run_dir, progress=False, source_spec=SourceSpec(remote=True, on_ready=on_ready)
        )
    finally:
        fleet.stop()


class Fleet:
    """Broadcast-only workers in this event loop; `kill` cancels one (its relay cuts its streams)."""

    def __init__(self, url: str, n: int, *, token: str, first: int = 0, **kw) -> None:
        local = {"url": url, "token": token, "inbound": True, "relay_host": "127.0.0.1"}
        self.peers = [BroadcastPeer(PeerConfig(**local, name=f"p{first + i}", **kw)) for i in range(n)]
        self.stop = asyncio.Event()
        self.tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> Fleet:
        self.tasks = [asyncio.create_task(p.run(self.stop)) for p in self.peers]
        while not all(p.client is not None for p in self.peers):  # registered, following
            await asyncio.sleep(0.02)
            for t in self.tasks:
                if t.done():
                    t.result()
        return self

    async def __aexit__(self, *exc) -> None:
        self.stop.set()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def by_id(self, worker_id: str) -> BroadcastPeer:
        return next(p for p in self.peers if p.worker_id == worker_id)

    async def kill(self, peer: BroadcastPeer) -> None:
        task = self.tasks[self.peers.index(peer)]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def installed(self, version: int, peers=None) -> None:
        while not all(version in p.installed for p in peers or self.peers):
            await asyncio.sleep(0.02)


class FakeProvider:
    """A provider (fleet/provider.py) that records start/stop calls; a started slot runs until
    stopped, and its worker proves it with the secret drawn at its start (`secrets`)."""

    def __init__(self, offers) -> None:
        from echo2.fleet.selection import WorkerOffer

        self.all = {name: WorkerOffer(name=name, throughput=mu, price=price) for name, mu, price in offers}
        self.live: set[str] = set()
        self.failed: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        self.secrets: dict[str, str] = {}

    def offers(self):
        return [o for n, o in self.all.items() if n not in self.live and n not in self.failed]

    def running(self):
        return [self.all[n] for n in sorted(self.live)]

    def owns(self, name):
        return name in self.all

    def proves(self, name, proof):
        from echo2.wire import identity

        return identity.proves(proof, self.secrets.get(name))

    def start_slot(self, name):
        from echo2.wire import identity

        self.calls.append(("start", name))
        self.live.add(name)
        self.secrets[name] = identity.new_secret()

    def stop_slot(self, name, *, failed=False):
        self.calls.append(("stop-failed" if failed else "stop", name))
        self.live.discard(name)
        if failed:
            self.failed.add(name)
