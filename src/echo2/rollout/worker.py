"""A rollout worker: register, install snapshots, lease prompts, generate, score, push, heartbeat.

Owns the worker's side of the protocol (docs/protocol.md) as a loop: `Worker.run` is the entry
point and reads top to bottom. It talks to the coordinator only through a `CoordinatorClient`
(control/client.py: every call has a timeout, transient failures are retried by one policy) and
acts on its refusals (control/errors.py): `UnknownWorker` (coordinator restarted, or this worker was
marked lost) registers again, by one route (`rejoin`), whoever sees it first; `Released` (and
`RunFinished`) stops the worker; `Stale`, `LeaseExpired` and `Invalid` on a push drop the batch (the
coordinator reissues its prompts; an `Invalid` batch's lease is given back at once); `LeaseLimit`
returns every lease it holds and pauses before leasing again; `Quarantined` ends `run` (the CLI
stops with exit status 1). Pushes are retried safely, since ingestion is idempotent. On stop it
returns what it holds.
The engine runs in a thread so heartbeats keep flowing while it generates.

Identity: the run token only registers; the reply's credential carries every later call. The
learner's public key is pinned for the run: `learner_key` (a fingerprint) if given, else the key of
the first registration; a different key at any later registration stops the worker (`KeyChanged`).
A registration reply from a new epoch (the learner restarted, e.g. resumed from a checkpoint) makes
the worker forget every snapshot it holds or receives and, if it runs a version the new learner has
not published, stop leasing until it installs one the learner has.

Throughput: a worker declared with `throughput` (`echo2 worker --throughput X`; an emulated worker
declares its rate) sends that figure in its registration; any other times a calibration generation
of the run's shape once its model is loaded (`CALIBRATION_GROUPS` prompts of the task) and reports
the rate in a heartbeat before its first lease, so that the scheduler ranks it and the coordinator
sizes its leases from the start. The coordinator replaces either figure with what the worker
delivers once it has measured it (control/leases.py: `Delivery`).

Snapshots arrive in a task of their own (`BroadcastClient.follow`: verified chunks from the parent
the coordinator names, relayed to this worker's child with `inbound`) while the worker keeps
generating with the version it has; a complete, verified snapshot is installed between two
generations, at once, and reported to the coordinator.

The loop does not know what an engine is made of: `prepare`, `step`, `install_snapshot` and
`version` are what a worker without an engine (`echo2.rollout.broadcast_peer.BroadcastPeer`) replaces.
Torch and the model are imported only when an engine is built, so that peer stays torch-free.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from echo2.broadcast.chunks import SnapshotBytes
from echo2.broadcast.relay import ChunkStore, RelayServer
from echo2.control import identity
from echo2.control.client import CoordinatorClient, RetryPolicy, Unreachable
from echo2.control.errors import (
    Forbidden,
    Invalid,
    LeaseExpired,
    LeaseLimit,
    Refused,
    Released,
    RunFinished,
    Stale,
    UnknownWorker,
)
from echo2.control.protocol import (
    HeartbeatRequest,
    LeaseRequest,
    LeaseResponse,
    PushRequest,
    RegisterRequest,
    RegisterResponse,
    ReturnRequest,
    SentRequest,
)
from echo2.rollout.broadcast_client import BroadcastClient, client_for, sleep_unless
from echo2.rollout.worker_config import KeyChanged, RelayStartError, WorkerConfig

if TYPE_CHECKING:
    from echo2.config import Config

__all__ = ["KeyChanged", "RelayStartError", "Worker", "WorkerConfig"]

logger = logging.getLogger(__name__)

LEASE_LIMIT_PAUSE = 2.0
"""Seconds a worker waits before leasing again after a `lease_limit` refusal."""
CALIBRATION_GROUPS = 2
"""Prompts (at most a step's) of the calibration generation, `group_size` samples each."""


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.coordinator: CoordinatorClient | None = None
        self.worker_id: str | None = None
        self.registration: RegisterResponse | None = None
        self.heartbeat_interval = 1.0
        self.store = ChunkStore()
        self.relay = RelayServer(self.store)
        self.relay.on_sent = self._on_sent
        self.pinned_key: str | None = None
        """The learner's public key for this run (hex), from the first registration."""
        self.epoch: str | None = None
        self._reports: set[asyncio.Task] = set()
        self.bcast: BroadcastClient | None = None
        self.counts = {"pushed": 0, "dropped": 0, "reregistered": 0, "lease_limit": 0}
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
        self._registering = asyncio.Lock()

    # ------------------------------------------------------------------ the entry point
    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set or the scheduler releases this worker. Raises Unreachable
        (a ConnectionError) if the coordinator stays unreachable while not stopping, and
        `Quarantined` once the coordinator refuses this worker's work for good."""
        retry = RetryPolicy(give_up_after=self.config.give_up_after)
        try:
            async with await CoordinatorClient.create(
                self.config.url, self.config.token, retry=retry, stop=stop, ca_file=self.config.ca_file
            ) as self.coordinator:
                await self._start_relay()
                try:
                    await self._serve(stop)
                finally:
                    await self.return_held()
                    await self.relay.stop()
        except Unreachable:
            if not stop.is_set():
                raise
            logger.info("stopping; coordinator unreachable")

    async def _serve(self, stop: asyncio.Event) -> None:
        await self.register()
        beat = asyncio.create_task(self._heartbeat_forever(stop))  # alive while the model loads
        bcast = asyncio.create_task(self.bcast.follow(stop, self.install_snapshot))
        try:
            await self.prepare()
            self.engine_ready.set()
            await self._report_throughput(stop)
            while not stop.is_set():
                _surface(beat, bcast)
                await self._as_member(stop, lambda: self.step(stop))
        finally:
            for task in (beat, bcast):
                task.cancel()
            await asyncio.gather(beat, bcast, return_exceptions=True)

    async def _as_member(self, stop: asyncio.Event, call: Callable[[], Awaitable[object]]) -> None:
        """Run `call`; an unknown-worker refusal registers again, a release stops the worker."""
        seen = self.worker_id
        try:
            await call()
        except (UnknownWorker, Forbidden) as e:  # Forbidden: our credential is not (or no longer) valid
            await self.rejoin(seen, e)
        except Released as e:
            if isinstance(e, RunFinished):
                logger.info("the run is over (run_finished); stopping")
            else:
                logger.info("released by the coordinator (%s); stopping", e.detail)
            stop.set()

    async def _heartbeat_forever(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self._as_member(stop, self._heartbeat)
            except (Refused, Unreachable) as e:  # the next beat tries again
                logger.debug("heartbeat failed: %r", e)
            await sleep_unless(stop, self.heartbeat_interval)

    async def _report_throughput(self, stop: asyncio.Event) -> None:
        """A heartbeat now, so the coordinator has the calibrated figure before the first lease."""
        try:
            await self._as_member(stop, self._heartbeat)
        except (Refused, Unreachable) as e:  # the heartbeat task reports it again
            logger.debug("throughput report failed: %r", e)

    async def _heartbeat(self) -> None:
        req = HeartbeatRequest(worker_id=self.worker_id, version=self.version, throughput=self.throughput)
        await self.coordinator.heartbeat(req)

    # ------------------------------------------------------------------ membership
    async def register(self) -> None:
        c = self.config
        req = RegisterRequest(
            name=c.name,
            hardware=c.hardware,
            price_per_hour=c.price_per_hour,
            throughput=self.throughput,  # declared; at a re-registration, the last measured
            inbound=c.inbound,
            relay_port=self.relay.port,
            relay_host=c.relay_advertise if self.relay.port is not None else None,
        )
        reply = await self.coordinator.register(req)
        self._check_key(reply.public_key)
        self.registration, self.worker_id = reply, reply.worker_id
        self.heartbeat_interval = reply.heartbeat_interval
        if self.bcast is None:
            self.bcast = client_for(
                self.coordinator,
                reply.worker_id,
                self.store,
                self.relay,
                reply,
                upload_mbps=c.upload_mbps,
                download_mbps=c.download_mbps,
            )
        self.bcast.worker_id, self.bcast.public_key = reply.worker_id, reply.public_key
        if self.epoch is not None and reply.epoch != self.epoch:
            self.new_epoch(reply.published_version)
        self.epoch = reply.epoch
        logger.info("registered as %s with %s", self.worker_id, c.url)

    def _check_key(self, public_key: str) -> None:
        given, pinned = self.config.learner_key, self.pinned_key
        got = identity.fingerprint(public_key)
        if given is not None and not identity.same_fingerprint(given, public_key):
            raise KeyChanged(
                f"learner key {got[:16]}... is not the one given (--learner-key {given[:16]}...)"
            )
        if pinned is not None and public_key != pinned:
            raise KeyChanged(
                f"learner key changed from {identity.fingerprint(pinned)[:16]}... to {got[:16]}... "
                "at re-registration (restart the worker to trust a new run's key)"
            )
        self.pinned_key = public_key

    def new_epoch(self, published_version: int) -> None:
        """The learner restarted: what it published before may not be what it publishes now."""
        logger.warning(
            "the learner restarted (now at version %d); dropping version %d and every snapshot held",
            published_version,
            self.version,
        )
        self.bcast.rewind()
        if self.engine is not None and self.engine.version > published_version:
            self.engine.version = -1  # leases wait for a version this learner published

    def _on_sent(self, version: int, child: str, nbytes: int, seconds: float) -> None:
        """The relay's account of a stream it served, sent to the coordinator in the background."""
        if self.worker_id is None or self.coordinator is None:
            return
        req = SentRequest(
            worker_id=self.worker_id, version=version, child_id=child, bytes=nbytes, seconds=seconds
        )
        task = asyncio.ensure_future(self._report_sent(req))
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    async def _report_sent(self, req: SentRequest) -> None:
        try:
            await self.coordinator.report_sent(req)
        except (Refused, Unreachable, OSError) as e:
            logger.debug("relay account of version %d not delivered: %r", req.version, e)

    async def rejoin(self, seen: str | None, refusal: Refused) -> None:
        """The one route back after an unknown-worker refusal of a call made as `seen`: register
        again, unless another task already did (same relay, same store, same engine)."""
        async with self._registering:
            if self.worker_id != seen:
                return
            logger.info("coordinator does not know us (%s); registering again", refusal.detail)
            self.counts["reregistered"] += 1
            await self.register()

    async def _start_relay(self) -> None:
        c = self.config
        if not c.inbound:
            return
        try:
            await self.relay.start(c.relay_host, c.relay_port)
        except OSError as e:  # port in use, unknown host: the user's flags
            raise RelayStartError(
                f"--relay-host/--relay-port: cannot listen on {c.relay_host}:{c.relay_port} ({e})"
            ) from None

    async def return_held(self) -> None:
        """Give back every lease held; one the coordinator refuses to take back (expired, or this
        worker is unknown to it) is not held any more, one it could not be asked about still is."""
        for lease_id in sorted(self.held):
            try:
                await self.coordinator.return_lease(
                    ReturnRequest(worker_id=self.worker_id, lease_id=lease_id)
                )
            except Refused as e:
                logger.info("lease %s not returned: %s %s", lease_id, e.reason, e.detail)
            except Unreachable as e:
                logger.info("could not return lease %s: %r", lease_id, e)
                continue
            self.held.discard(lease_id)

    # ------------------------------------------------------------------ the engine (what a peer replaces)
    @property
    def version(self) -> int:
        """The installed snapshot version (-1 while the model loads)."""
        return self.engine.version if self.engine is not None else -1

    async def prepare(self) -> None:
        """Build the task and the engine from the run config the coordinator sent (in a thread)."""
        from echo2.config import build_config

        if self.run_config is None:
            self.run_config = build_config(self.registration.run)
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
        self.engine = worker_engine(cfg, tokenizer=tok, engine=self.config.engine, device=worker_device())

    async def step(self, stop: asyncio.Event) -> None:
        """One lease worked through, or a short pause when there is nothing to do."""
        try:
            if await self.one_lease():
                return
            pause = 0.2
        except LeaseLimit as e:  # it thinks we hold too many: give back what we hold, ask later
            self.counts["lease_limit"] += 1
            logger.info("no lease: %s %s; returning %d held", e.reason, e.detail, len(self.held))
            await self.return_held()
            pause = LEASE_LIMIT_PAUSE
        await sleep_unless(stop, pause)

    async def one_lease(self) -> bool:
        """Lease, generate, push. False when there was nothing to do."""
        cfg = self.run_config
        max_groups = cfg.coordinator.groups_per_lease or cfg.rollout.prompts_per_step
        req = LeaseRequest(worker_id=self.worker_id, version=self.engine.version, max_groups=max_groups)
        try:
            lease = await self.coordinator.lease(req)
        except Invalid as e:  # e.g. a version this learner never published: wait to install one
            logger.info("no lease: %s %s", e.reason, e.detail)
            return False
        if lease is None:
            return False
        self.held.add(lease.lease_id)
        records = await self._generate(lease)
        push = PushRequest(worker_id=self.worker_id, lease_id=lease.lease_id, records=records)
        try:
            await self.coordinator.push(push)
            self.counts["pushed"] += len(records)
        except (Stale, LeaseExpired, Invalid) as e:
            self.counts["dropped"] += len(records)
            logger.info("batch of %d dropped by the coordinator: %s %s", len(records), e.reason, e.detail)
            if isinstance(e, Invalid):  # the lease stays open at the coordinator: give it back now
                await self.return_held()
        self.held.discard(lease.lease_id)
        return True

    async def _generate(self, lease: LeaseResponse) -> list[dict]:
        """The lease's groups as wire records, generated under the engine lock, off the event loop."""
        import torch

        from echo2.rollout.collect import collect, rollout_seed

        cfg = self.run_config
        prompts = [self.task.train_prompt(i) for i in lease.indices]
        started = time.monotonic()

        def generate():
            torch.manual_seed(rollout_seed(cfg.run.seed, lease.indices[0]))
            return collect(self.engine, self.task, prompts, n=cfg.rollout.group_size)

        async with self.engine_lock:
            groups = await asyncio.to_thread(generate)
        records = [r.to_dict() for g in groups for r in g]
        self.throughput = len(records) / max(time.monotonic() - started, 1e-9)
        return records

    async def install_snapshot(self, version: int, data: SnapshotBytes) -> None:
        """Install a verified snapshot (called by the broadcast task) between two generations.

        A full snapshot goes in tensor by tensor from the chunks the relay holds anyway
        (`SafetensorsView`: the engine copies each tensor as it is read), so the worker never
        holds a second copy of it; an adapter (small) is read whole while the engine may still
        generate, since merging it needs every layer."""
        from echo2.records import Snapshot
        from echo2.rollout.safetensors_view import SafetensorsView

        await self.engine_ready.wait()
        # an emulated engine has no weights to load
        snapshot = Snapshot(
            version=version, state={} if self.config.emulate is not None else SafetensorsView(data)
        )
        if snapshot.is_adapter:
            snapshot = Snapshot(version=version, state=await asyncio.to_thread(dict, snapshot.state))
        async with self.engine_lock:
            await asyncio.to_thread(self.engine.install, snapshot)
        logger.info("installed version %d", version)


def _surface(*tasks: asyncio.Task) -> None:
    """Re-raise what ended a background task: they only end on stop, anything else is a bug."""
    for task in tasks:
        if task.done():
            task.result()
