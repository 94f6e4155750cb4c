"""A worker's standing with the coordinator, shared by the rollout worker (rollout/worker.py) and
the broadcast-only peer (rollout/broadcast_peer.py), which each compose one `Membership`.

Owns the coordinator client, the relay server and its chunk stores (full snapshots, deltas), the registration and the
`BroadcastClient` it yields, heartbeats, and the relay's reports of what it sent. It acts on the
refusals every worker meets the same way (wire/errors.py): `UnknownWorker` or `Forbidden`
(coordinator restarted, or this worker was marked lost) registers again, by one route (`rejoin`),
whoever sees it first; `Released` (and `RunFinished`) stops the worker. It does not know what the
worker does between heartbeats: its owner says what version it runs and how fast (`version`,
`throughput`) and what to do when the learner restarts (`on_new_epoch`).

Identity: the run token only registers; the reply's credential carries every later call. The
learner's public key is pinned for the run: `learner_key` (a fingerprint) if given, else the key of
the first registration; a different key at any later registration stops the worker (`KeyChanged`).
A registration reply from a new epoch (the learner restarted, e.g. resumed from a checkpoint) makes
the worker forget every snapshot it holds or receives (`BroadcastClient.rewind`) and tells the owner.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable

from echo2.aio import sleep_unless
from echo2.broadcast.chunks import SnapshotBytes
from echo2.broadcast.relay import ChunkStore, RelayServer, mbit
from echo2.rollout.broadcast_client import BroadcastClient, Receiving
from echo2.rollout.worker_config import KeyChanged, PeerConfig, RelayStartError
from echo2.wire import identity
from echo2.wire.client import CoordinatorClient, RetryPolicy, Unreachable
from echo2.wire.errors import Forbidden, Refused, Released, RunFinished, UnknownWorker
from echo2.wire.protocol import HeartbeatRequest, RegisterRequest, RegisterResponse, SentRequest

logger = logging.getLogger(__name__)


class Membership:
    """One worker's registration, heartbeats and snapshot following. `version()` and
    `throughput()` are what the heartbeats (and a registration) report; `on_new_epoch(published)`
    is called when the learner restarted."""

    def __init__(
        self,
        config: PeerConfig,
        *,
        version: Callable[[], int],
        throughput: Callable[[], float] = lambda: 0.0,
        on_new_epoch: Callable[[int], None] = lambda published: None,
    ) -> None:
        self.config = config
        self.version, self.throughput, self.on_new_epoch = version, throughput, on_new_epoch
        self.coordinator: CoordinatorClient | None = None
        self.worker_id: str | None = None
        self.registration: RegisterResponse | None = None
        self.heartbeat_interval = 1.0
        self.store = ChunkStore()
        self.deltas = ChunkStore()
        """Verified delta chunks (issue 24): received, relayed and applied like full ones."""
        self.relay = RelayServer(self.store, deltas=self.deltas)
        self.relay.on_sent = self._on_sent
        self.bcast: BroadcastClient | None = None
        """The broadcast client, once registered."""
        self.pinned_key: str | None = None
        """The learner's public key for this run (hex), from the first registration."""
        self.epoch: str | None = None
        self.reregistered = 0
        self._reports: set[asyncio.Task] = set()
        self._registering = asyncio.Lock()

    # ------------------------------------------------------------------ the whole membership
    async def serve(
        self,
        stop: asyncio.Event,
        *,
        install: Callable[[int, SnapshotBytes], Awaitable[None]],
        work: Callable[[], Awaitable[None]],
    ) -> None:
        """Connect, register, then heartbeat and follow snapshots (`install`ing each) while `work()`
        runs, until it returns. Raises Unreachable (a ConnectionError) if the coordinator stays
        unreachable while not stopping; whatever `work` raises."""
        retry = RetryPolicy(give_up_after=self.config.give_up_after)
        c = self.config
        try:
            async with await CoordinatorClient.create(
                c.url, c.token, retry=retry, stop=stop, ca_file=c.ca_file
            ) as self.coordinator:
                await self._start_relay()
                try:
                    await self.register()
                    await _alongside(work(), self._heartbeat_forever(stop), self.bcast.follow(stop, install))
                finally:
                    await self.relay.stop()
        except Unreachable:
            if not stop.is_set():
                raise
            logger.info("stopping; coordinator unreachable")

    async def as_member(self, stop: asyncio.Event, call: Callable[[], Awaitable[object]]) -> None:
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

    # ------------------------------------------------------------------ heartbeats
    async def _heartbeat_forever(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.report(stop)
            await sleep_unless(stop, self.heartbeat_interval)

    async def report(self, stop: asyncio.Event) -> None:
        """A heartbeat now (version and throughput); a failed one is left to the next."""
        try:
            await self.as_member(stop, self._heartbeat)
        except (Refused, Unreachable) as e:
            logger.debug("heartbeat failed: %r", e)

    async def _heartbeat(self) -> None:
        req = HeartbeatRequest(worker_id=self.worker_id, version=self.version(), throughput=self.throughput())
        await self.coordinator.heartbeat(req)

    # ------------------------------------------------------------------ registration
    async def register(self) -> None:
        c = self.config
        req = RegisterRequest(
            name=c.name,
            hardware=c.hardware,
            price_per_hour=c.price_per_hour,
            throughput=self.throughput(),  # declared; at a re-registration, the last measured
            inbound=c.inbound,
            relay_port=self.relay.port,
            relay_host=c.relay_advertise if self.relay.port is not None else None,
            slot_proof=os.environ.get(identity.SLOT_SECRET_ENV)
            or None,  # set by the provider that started us
        )
        reply = await self.coordinator.register(req)
        self._check_key(reply.public_key)
        self.registration, self.worker_id = reply, reply.worker_id
        self.heartbeat_interval = reply.heartbeat_interval
        if self.bcast is None:
            self.bcast = self._broadcast_client(reply)
        self.bcast.worker_id, self.bcast.public_key = reply.worker_id, reply.public_key
        if self.epoch is not None and reply.epoch != self.epoch:
            logger.warning(
                "the learner restarted (now at version %d); dropping version %d and every snapshot held",
                reply.published_version,
                self.version(),
            )
            self.bcast.rewind()
            self.on_new_epoch(reply.published_version)
        self.epoch = reply.epoch
        logger.info("registered as %s with %s", self.worker_id, c.url)

    def _broadcast_client(self, reply: RegisterResponse) -> BroadcastClient:
        """The BroadcastClient, and the relay's caps, from the first registration reply (the run's
        `broadcast` section, the learner's public key); the flags override the run's caps."""
        bc, c = reply.run.broadcast, self.config
        receiving = Receiving.of(bc, download_mbps=c.download_mbps)
        self.relay.upload_bucket = mbit(c.upload_mbps if c.upload_mbps is not None else bc.worker_upload_mbps)
        self.relay.keepalive_s = receiving.progress_timeout / 4  # well within a receiver's timeout
        return BroadcastClient(
            self.coordinator,
            self.store,
            receiving,
            worker_id=reply.worker_id,
            public_key=reply.public_key,
            deltas=self.deltas,
        )

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

    async def rejoin(self, seen: str | None, refusal: Refused) -> None:
        """The one route back after an unknown-worker refusal of a call made as `seen`: register
        again, unless another task already did (same relay, same store, same engine)."""
        async with self._registering:
            if self.worker_id != seen:
                return
            logger.info("coordinator does not know us (%s); registering again", refusal.detail)
            self.reregistered += 1
            await self.register()

    # ------------------------------------------------------------------ the relay
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


async def _alongside(main: Awaitable[None], *background: Awaitable[None]) -> None:
    """Run `main` to its end with `background` tasks beside it, then cancel them. They end only on
    stop: one that raises first is a bug, re-raised (and `main` cancelled)."""
    main_task = asyncio.ensure_future(main)
    tasks = [asyncio.ensure_future(b) for b in background]
    pending = set(tasks)
    try:
        while not main_task.done():
            done, _ = await asyncio.wait({main_task, *pending}, return_when=asyncio.FIRST_COMPLETED)
            for task in done - {main_task}:
                task.result()
                pending.discard(task)
        main_task.result()
    finally:
        for task in (main_task, *tasks):
            task.cancel()
        await asyncio.gather(main_task, *tasks, return_exceptions=True)
