"""What a simulated run shares and records: the world every process group runs in (clock, random
stream, scenario, workers, buffer), workers' state and history, learner steps, broadcasts, faults.

Plain dataclasses filled by the process groups (`sim.learner`, `sim.rollout`, `sim.dissemination`,
`sim.fleet`, `sim.faults`) and read by `sim.report`; no SimPy logic beyond the event a worker waits
on.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field

import simpy

from echo2.broadcast.plan import ChainPlan, PeerStats
from echo2.data.buffer import ReplayBuffer
from echo2.sim.scenario import Scenario, WorkerSpec


@dataclass(slots=True, kw_only=True)
class SimWorker:
    id: str
    spec: WorkerSpec
    stats: PeerStats = field(default_factory=PeerStats)
    active: bool = False
    dropped_at: float | None = None
    lost: bool = False
    """Marked lost by the coordinator (heartbeat timeout after a drop)."""
    installed: int = -1
    paused: bool = False
    link_factor: float = 1.0
    rollout_factor: float = 1.0
    busy: bool = False
    """Inside a generation round."""
    changed: simpy.Event | None = None
    """Triggered when its state changes (rate, pause, install, stop)."""
    fetch: simpy.Process | None = None
    billed: list[list[float]] = field(default_factory=list)
    """[start, end] of every active period (end = inf while still active)."""
    versions: list[tuple[float, int]] = field(default_factory=list)
    """(time, installed version) at every install."""
    generating: list[tuple[float, float]] = field(default_factory=list)
    """(time, nominal trajectories/s being generated: mu * slowdown, or 0) at every change."""
    factors: list[tuple[float, float]] = field(default_factory=lambda: [(0.0, 1.0)])
    """(time, rollout slowdown factor) at every change."""
    samples: deque[tuple[float, float]] = field(default_factory=deque)
    sample_sum: float = 0.0
    produced: int = 0
    """Groups delivered."""

    @property
    def alive(self) -> bool:
        return self.dropped_at is None

    @property
    def can_generate(self) -> bool:
        return self.active and self.alive and self.installed >= 0 and not self.paused

    @property
    def known_active(self) -> bool:
        """Active as far as the coordinator knows (a dropped worker counts until marked lost)."""
        return self.active or (not self.alive and not self.lost)

    @property
    def mu(self) -> float:
        return self.spec.throughput * self.rollout_factor


@dataclass(frozen=True, slots=True, kw_only=True)
class World:
    """What every process group of one run shares. One `rng` drives every draw, so a seed fixes
    the run; the order in which the groups draw from it is part of the model."""

    sc: Scenario
    env: simpy.Environment
    rng: random.Random
    workers: dict[str, SimWorker]
    buffer: ReplayBuffer
    """One record per GRPO group (all samples of a group share a version, so admission is the same
    as per trajectory)."""

    @property
    def kappa(self) -> int:
        return self.sc.learner.publish_every

    @property
    def snapshot_bytes(self) -> float:
        return self.sc.learner.snapshot_bytes

    def publication_bytes(self, behind: int | None) -> float:
        """Bytes a worker `behind` publications behind receives (None: nothing installed), with
        broadcast.delta and its ratio (`planning.capacity.publication_bytes`)."""
        return self.sc.publication_bytes(behind)

    @property
    def uplink_bps(self) -> float:
        """The learner's uplink B0 in bytes/s (inf: unlimited)."""
        return self.sc.broadcast.uplink_mbps * 1e6 / 8


@dataclass(slots=True, kw_only=True)
class StepRecord:
    step: int
    requested: float
    """When the learner asked for the batch."""
    wait: float
    train: float
    staleness: list[int]
    """Learner version - record version, one entry per group consumed."""


@dataclass(slots=True, kw_only=True)
class Publication:
    version: int
    time: float
    receivers: list[str]
    plan: ChainPlan
    started: float
    """When the broadcast started (later than `time` when it waited for the previous one)."""
    installs: dict[str, float] = field(default_factory=dict)
    demoted: list[tuple[float, str]] = field(default_factory=list)
    """(time, relay) of every relay its child reported slow during this broadcast."""

    def t_bcast(self, q: float, alive: set[str]) -> float | None:
        """Seconds until a share q of the receivers still alive installed it (None if never)."""
        n = sum(1 for w in self.receivers if w in alive)
        need = max(1, math.ceil(q * n - 1e-9))
        times = sorted(t for w, t in self.installs.items() if w in alive)
        return times[need - 1] - self.time if len(times) >= need else None


@dataclass(slots=True, kw_only=True)
class FaultRecord:
    index: int
    time: float
    worker: str
    kind: str
    stage: str | None
    """What slowed ("link" or "rollout"); None for a drop."""
    factor: float | None


TARGET_QUANTILE = 0.9
"""The scheduler's T_bcast is measured until this share of workers installed (q = 1 / gamma, paper
5.1), as the coordinator does."""


def lognormal_factor(rng: random.Random, sigma: float) -> float:
    """A mean-one lognormal factor (1.0 exactly when sigma = 0)."""
    return rng.lognormvariate(-sigma * sigma / 2, sigma) if sigma > 0 else 1.0
