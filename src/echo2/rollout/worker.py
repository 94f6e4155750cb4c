"""A rollout worker: register, install snapshots, lease prompts, generate, score, push, heartbeat.

Owns the worker's side of the protocol (docs/protocol.md) that needs an engine, as a loop:
`Worker.run` is the entry point and reads top to bottom. Its standing with the coordinator
(registration, heartbeats, snapshot following, re-registration after an unknown-worker refusal,
stopping when released, the pinned learner key) is a `Membership` (rollout/membership.py), the
piece it shares with the broadcast-only peer. It acts on the refusals that concern its work
(wire/errors.py): `Stale`, `LeaseExpired` and `Invalid` on a push drop the batch (the coordinator
reissues its prompts; an `Invalid` batch's lease is given back at once); `LeaseLimit` returns every
lease it holds and pauses before leasing again; any other refusal with a 4xx status and a reason
(a rate limit, a conflict, a reason newer than this worker) returns every lease it holds and backs
off, doubling the pause with each refusal in a row; `Quarantined` ends `run` (the CLI stops with
exit status 1). Pushes are retried safely, since ingestion is idempotent. On stop it returns what it
holds. The engine runs in a thread so heartbeats keep flowing while it generates.

A registration reply from a new epoch (the learner restarted) makes the worker, if it runs a
version the new learner has not published, stop leasing until it installs one the learner has.

Throughput: a worker declared with `throughput` (`echo2 worker --throughput X`; an emulated worker
declares its rate) sends that figure in its registration; any other times a calibration generation
of the run's shape once its model is loaded (`CALIBRATION_GROUPS` prompts of the task) and reports
the rate in a heartbeat before its first lease, so that the scheduler ranks it and the coordinator
sizes its leases from the start. The coordinator replaces either figure with what the worker
delivers once it has measured it (coordinator/leases.py: `Delivery`).

Snapshots arrive in a task of their own (`BroadcastClient.follow`: verified chunks from the parent
the coordinator names, relayed to this worker's child with `inbound`) while the worker keeps
generating with the version it has; a complete, verified snapshot is installed between two
generations, at once, and reported to the coordinator.

Torch and the model are imported only when an engine is built.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from echo2.aio import sleep_unless
from echo2.broadcast.chunks import SnapshotBytes
from echo2.records import Trajectory
from echo2.rollout.membership import Membership
from echo2.rollout.worker_config import WorkerConfig
from echo2.wire.client import Unreachable
from echo2.wire.errors import (
    Forbidden,
    Invalid,
    LeaseExpired,
    LeaseLimit,
    Quarantined,
    Refused,
    Released,
    Stale,
    UnknownWorker,
)
from echo2.wire.protocol import LeaseRequest, LeaseResponse, PushRequest, ReturnRequest

if TYPE_CHECKING:
    from echo2.config import Config

logger = logging.getLogger(__name__)

LEASE_LIMIT_PAUSE = 2.0
"""Seconds a worker waits before leasing again after a `lease_limit` refusal."""
REFUSAL_PAUSE = 0.5
REFUSAL_PAUSE_MAX = 30.0
"""Back-off after a refusal the lease loop does not otherwise act on: doubling from the first to
the cap with each refusal in a row."""
CALIBRATION_GROUPS = 2
"""Prompts (at most a step's) of the calibration generation, `group_size` samples each."""


class Worker:
    """A rollout worker: a `Membership` (its standing with the coordinator) and an engine that
    works through leases and installs the snapshots the membership receives."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.member = Membership(
            config,
            version=lambda: self.version,
            throughput=lambda: self.throughput,
            on_new_epoch=self.new_epoch,
        )
        self._counts = {"pushed": 0, "dropped": 0, "lease_limit": 0, "refused": 0}
        self._refusals = 0
        """Refusals in a row (`step` backs off longer after each)."""
        self.held: set[str] = set()
        """Leases granted and neither pushed nor given back: what a stop or a lease_limit returns."""
        self.throughput = config.throughput or config.emulate or 0.0
        """Trajectories/s: declared, else calibrated once the model is loaded, then the last lease's."""
        self.run_config: Config | None = None
        self.engine = None
        self.task = None
        self.engine_ready = asyncio.Event()
        self.engine_lock = asyncio.Lock()
        """Held while generating and while installing: a snapshot goes in between two generations."""

    @property
    def counts(self) -> dict[str, int]:
        return {**self._counts, "reregistered": self.member.reregistered}

    # ------------------------------------------------------------------ the entry point
    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set or the scheduler releases this worker. Raises Unreachable
        (a ConnectionError) if the coordinator stays unreachable while not stopping, and
        `Quarantined` once the coordinator refuses this worker's work for good."""
        try:
            await self.member.serve(stop, install=self.install_snapshot, work=lambda: self._work(stop))
        finally:  # a launched inference server stops with its worker (rollout/server_engine.py)
            close = getattr(self.engine, "close", None)
            if close is not None:
                await asyncio.to_thread(close)

    async def _work(self, stop: asyncio.Event) -> None:
        """Load the model (heartbeats flow meanwhile), report its throughput, then lease until stop."""
        try:
            await self.prepare()
            self.engine_ready.set()
            await self.member.report(stop)  # the calibrated figure, before the first lease
            while not stop.is_set():
                await self.member.as_member(stop, lambda: self.step(stop))
        finally:
            await self.return_held()

    def new_epoch(self, published_version: int) -> None:
        """The learner restarted: what it published before may not be what it publishes now."""
        if self.engine is not None and self.engine.version > published_version:
            self.engine.version = -1  # leases wait for a version this learner published

    async def return_held(self) -> None:
        """Give back every lease held; one the coordinator refuses to take back (expired, or this
        worker is unknown to it) is not held any more, one it could not be asked about still is."""
        for lease_id in sorted(self.held):
            try:
                await self.member.coordinator.return_lease(
                    ReturnRequest(worker_id=self.member.worker_id, lease_id=lease_id)
                )
            except Refused as e:
                logger.info("lease %s not returned: %s %s", lease_id, e.reason, e.detail)
            except Unreachable as e:
                logger.info("could not return lease %s: %r", lease_id, e)
                continue
            self.held.discard(lease_id)

    # ------------------------------------------------------------------ the engine
    @property
    def version(self) -> int:
        """The installed snapshot version (-1 while the model loads)."""
        return self.engine.version if self.engine is not None else -1

    async def prepare(self) -> None:
        """Build the task and the engine from the run config the coordinator sent (in a thread)."""
        if self.run_config is None:
            self.run_config = self.member.registration.run.config()
        await asyncio.to_thread(self._build)
        if self.config.throughput is None and self.config.emulate is None:
            self.throughput = await asyncio.to_thread(self._calibrate)

    def _calibrate(self) -> float:
        """Trajectories/s of one timed generation of the run's shape: the first `CALIBRATION_GROUPS`
        training prompts, `group_size` samples each, scored as a lease's are; the records are
        discarded. A first generation includes warm-up, so this errs low."""
        from echo2.rollout.collect import collect

        cfg = self.run_config
        count = min(CALIBRATION_GROUPS, cfg.rollout.prompts_per_step)
        prompts = [self.task.train_prompt(i) for i in range(count)]
        installed = self.engine.version
        self.engine.version = max(installed, 0)  # records carry a version; these are thrown away
        started = time.monotonic()
        try:
            groups = collect(self.engine, self.task, prompts, n=cfg.rollout.group_size)
        finally:
            self.engine.version = installed
        seconds = max(time.monotonic() - started, 1e-9)
        made = sum(len(g) for g in groups)
        logger.info("calibrated: %.3g trajectories/s (%d in %.2fs)", made / seconds, made, seconds)
        return made / seconds

    def _build(self) -> None:
        from echo2.data.tasks import make_task
        from echo2.models import load_tokenizer
        from echo2.rollout.engines import worker_device, worker_engine

        cfg = self.run_config
        self.task = make_task(cfg.task, seed=cfg.run.seed)
        tok = load_tokenizer(cfg.model)
        if self.config.emulate is not None:
            from echo2.rollout.emulated import EmulatedEngine

            self.engine = EmulatedEngine(tok, rate=self.config.emulate, seed=cfg.run.seed)
            return
        # on this machine's GPU if it has one, in the dtype snapshots arrive in (rollout/engines.py)
        self.engine = worker_engine(
            cfg, tokenizer=tok, engine=self.config.engine, device=worker_device(), server_url=self.config.server_url
        )

    async def step(self, stop: asyncio.Event) -> None:
        """One lease worked through, or a short pause when there is nothing to do. A refusal the
        protocol defines (4xx with a reason) that the membership does not act on never ends the
        worker: it gives back what it holds and backs off, longer after each refusal in a row."""
        try:
            if await self.one_lease():
                self._refusals = 0
                return
            pause = 0.2
        except LeaseLimit as e:  # it thinks we hold too many: give back what we hold, ask later
            self._counts["lease_limit"] += 1
            logger.info("no lease: %s %s; returning %d held", e.reason, e.detail, len(self.held))
            await self.return_held()
            pause = LEASE_LIMIT_PAUSE
        except (UnknownWorker, Forbidden, Released, Quarantined):
            raise  # the membership's to act on (register again, stop)
        except Refused as e:
            if not (400 <= e.status < 500 and e.reason):
                raise
            self._counts["refused"] += 1
            pause = min(REFUSAL_PAUSE * 2**self._refusals, REFUSAL_PAUSE_MAX)
            self._refusals += 1
            logger.warning(
                "refused (%s %s); returning %d held, retrying in %.1fs",
                e.reason,
                e.detail,
                len(self.held),
                pause,
            )
            await self.return_held()
        await sleep_unless(stop, pause)

    async def one_lease(self) -> bool:
        """Lease, generate, push. False when there was nothing to do."""
        cfg = self.run_config
        max_groups = cfg.coordinator.groups_per_lease or cfg.rollout.prompts_per_step
        coordinator, worker_id = self.member.coordinator, self.member.worker_id
        req = LeaseRequest(worker_id=worker_id, version=self.engine.version, max_groups=max_groups)
        try:
            lease = await coordinator.lease(req)
        except Invalid as e:  # e.g. a version this learner never published: wait to install one
            logger.info("no lease: %s %s", e.reason, e.detail)
            return False
        if lease is None:
            return False
        self.held.add(lease.lease_id)
        records = await self._generate(lease)
        push = PushRequest(worker_id=worker_id, lease_id=lease.lease_id, records=records)
        try:
            await coordinator.push(push)
            self._counts["pushed"] += len(records)
        except (Stale, LeaseExpired, Invalid) as e:
            self._counts["dropped"] += len(records)
            logger.info("batch of %d dropped by the coordinator: %s %s", len(records), e.reason, e.detail)
            if isinstance(e, Invalid):  # the lease stays open at the coordinator: give it back now
                await self.return_held()
        self.held.discard(lease.lease_id)
        return True

    async def _generate(self, lease: LeaseResponse) -> list[Trajectory]:
        """The lease's groups' records, generated under the engine lock, off the event loop."""
        import torch

        from echo2.rollout.collect import collect, rollout_seed

        cfg = self.run_config
        prompts = [self.task.train_prompt(i) for i in lease.indices]
        started = time.monotonic()

        def generate():
            torch.manual_seed(rollout_seed(cfg.run.seed, lease.indices[0]))
            seed = lease.sampling_seed if cfg.rollout.sampling == "gumbel" else None  # the lease's noise
            return collect(self.engine, self.task, prompts, n=cfg.rollout.group_size, sampling_seed=seed)

        async with self.engine_lock:
            groups = await asyncio.to_thread(generate)
        records = [r for g in groups for r in g]
        self.throughput = len(records) / max(time.monotonic() - started, 1e-9)
        return records

    async def install_snapshot(self, version: int, data: SnapshotBytes) -> None:
        """Install a verified snapshot (called by the broadcast task) between two generations.

        A full snapshot goes in tensor by tensor from the chunks the relay holds anyway
        (`SafetensorsView`: the engine copies each tensor as it is read), so the worker never
        holds a second copy of it; an adapter (small) is read whole while the engine may still
        generate, since merging it needs every layer. An engine with a `stage` step (the server
        engine: writing its install file) takes it before the lock, while generation goes on."""
        from echo2.records import Snapshot
        from echo2.rollout.safetensors_view import SafetensorsView

        await self.engine_ready.wait()
        # an emulated engine has no weights to load
        snapshot = Snapshot(
            version=version, state={} if self.config.emulate is not None else SafetensorsView(data)
        )
        if snapshot.is_adapter:
            snapshot = Snapshot(version=version, state=await asyncio.to_thread(dict, snapshot.state))
        stage = getattr(self.engine, "stage", None)
        if stage is not None:  # the server engine writes its install file while generation goes on
            await asyncio.to_thread(stage, snapshot)
        async with self.engine_lock:
            await asyncio.to_thread(self.engine.install, snapshot)
        logger.info("installed version %d", version)
