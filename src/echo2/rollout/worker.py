"""A rollout worker: register, install snapshots, lease prompts, generate, score, push, heartbeat.

Owns the worker's side of the protocol (docs/protocol.md) and its fault tolerance: every call has a
timeout; pushes are retried with backoff (ingestion is idempotent, so a retry never double-counts);
an unknown-worker answer (coordinator restarted, or this worker was marked lost) re-registers; a
stale or expired answer drops the batch (the coordinator reissues its prompts). On stop it returns
its lease. The engine runs in a thread so heartbeats keep flowing while it generates.

Snapshots arrive in a task of their own (`echo2.broadcast.relay`: verified chunks from the parent
the coordinator names, relayed to this worker's child with `--inbound`) while the worker keeps
generating with the version it has; a complete, verified snapshot is installed between two
generations, at once, and reported to the coordinator.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import aiohttp
import torch

from echo2.broadcast.client import BroadcastClient, CoordinatorError, client_for
from echo2.broadcast.relay import FAULT_FLIP_BYTE_ENV, ChunkStore, RelayServer
from echo2.config import Config
from echo2.control.protocol import API

logger = logging.getLogger(__name__)


class RelayStartError(Exception):
    """The relay server could not listen where the flags say."""


CallFailed = CoordinatorError  # one exception for a refused coordinator call (status, JSON body)


class Worker:
    def __init__(
        self,
        *,
        url: str,
        token: str,
        name: str,
        price_per_hour: float = 0.0,
        hardware: str = "cpu",
        inbound: bool = False,
        give_up_after: float = 300.0,
        emulate: float | None = None,
        relay_host: str = "0.0.0.0",
        relay_port: int = 0,
        relay_advertise: str | None = None,
        upload_mbps: float | None = None,
        download_mbps: float | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.name = name
        self.price_per_hour = price_per_hour
        self.hardware = hardware
        self.give_up_after = give_up_after
        self.inbound = inbound
        """Accepts inbound connections: runs a relay server on relay_host:relay_port."""
        self.relay_host, self.relay_port, self.relay_advertise = relay_host, relay_port, relay_advertise
        self.upload_mbps, self.download_mbps = upload_mbps, download_mbps
        """Caps in Mbit/s; None takes the run's broadcast.worker_upload_mbps / worker_download_mbps."""
        self.emulate = emulate
        """Trajectories/s of an EmulatedEngine instead of a model (capacity experiments only)."""
        self.worker_id: str | None = None
        self.config: Config | None = None
        self.engine = None
        self.task = None
        self.throughput = 0.0
        self.lease_id: str | None = None
        self.counts = {"pushed": 0, "dropped": 0, "reregistered": 0}
        self.store = ChunkStore()
        self.relay = RelayServer(
            self.store, token=token, fault_flip_byte=os.environ.get(FAULT_FLIP_BYTE_ENV) == "1"
        )
        self.bcast: BroadcastClient | None = None
        self.engine_ready = asyncio.Event()
        self.engine_lock = asyncio.Lock()
        """Held while generating and while installing: a snapshot goes in between two generations."""

    # ------------------------------------------------------------------ HTTP
    async def _call(self, method: str, path: str, body: dict | None = None) -> Any:
        async with self.session.request(method, self.url + path, json=body) as resp:
            if resp.status == 204:
                return None
            data = await resp.json(content_type=None)
            if resp.status >= 400:
                raise CallFailed(resp.status, data)
            return data

    async def _retry(self, what: str, fn, stop: asyncio.Event):
        """Retry on connection trouble and 5xx with backoff, up to give_up_after seconds."""
        delay, start = 0.2, time.monotonic()
        while True:
            try:
                return await fn()
            except (aiohttp.ClientError, TimeoutError) as e:
                problem = repr(e)
            except CallFailed as e:
                if e.status < 500:
                    raise
                problem = str(e)
            if stop.is_set() or time.monotonic() - start > self.give_up_after:
                raise ConnectionError(f"{what}: gave up after {time.monotonic() - start:.0f}s: {problem}")
            logger.info("%s failed (%s); retrying in %.1fs", what, problem, delay)
            try:
                await asyncio.wait_for(stop.wait(), timeout=delay)
            except TimeoutError:
                pass
            delay = min(delay * 2, 5.0)

    # ------------------------------------------------------------------ steps
    async def register(self, stop: asyncio.Event) -> None:
        body = {
            "name": self.name,
            "hardware": self.hardware,
            "price_per_hour": self.price_per_hour,
            "throughput": self.emulate or 0.0,
            "inbound": self.inbound,
        }
        if self.relay.port is not None:
            body["relay_port"] = self.relay.port
            if self.relay_advertise:
                body["relay_host"] = self.relay_advertise
        reply = await self._retry("register", lambda: self._call("POST", f"{API}/register", body), stop)
        self.worker_id = reply["worker_id"]
        self.heartbeat_interval = reply["heartbeat_interval"]
        if self.config is None:
            from echo2.config import build_config

            self.config = build_config(reply["run"])
        if self.bcast is None:
            self.bcast = client_for(
                self.url,
                self.token,
                self.worker_id,
                self.store,
                self.relay,
                reply,
                upload_mbps=self.upload_mbps,
                download_mbps=self.download_mbps,
            )
        self.bcast.worker_id, self.bcast.public_key = self.worker_id, reply["public_key"]
        logger.info("registered as %s with %s", self.worker_id, self.url)

    def _build(self) -> None:
        from echo2.data.tasks import make_task
        from echo2.learning.model import load_model, load_tokenizer
        from echo2.rollout.engine import HFEngine

        cfg = self.config
        self.task = make_task(cfg.task, seed=cfg.run.seed)
        tok = load_tokenizer(cfg.model)
        if self.emulate:
            from echo2.rollout.emulated import EmulatedEngine

            self.engine = EmulatedEngine(tok, rate=self.emulate, seed=cfg.run.seed)
            return
        model = load_model(cfg.model, vocab_size=len(tok), seed=cfg.run.seed)
        self.engine = HFEngine(model, tok, cfg.rollout, version=-1)

    async def install_snapshot(self, version: int, data: bytes) -> None:
        """Install a verified snapshot (called by the broadcast task): parse it while the engine
        may still generate, then swap it in between two generations."""
        from safetensors.torch import load

        from echo2.records import Snapshot

        await self.engine_ready.wait()
        # an emulated engine has no weights to load
        state = {} if self.emulate else await asyncio.to_thread(load, data)
        async with self.engine_lock:
            await asyncio.to_thread(self.engine.install, Snapshot(version=version, state=state))
        logger.info("installed version %d", version)

    async def heartbeat_forever(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                body = {
                    "worker_id": self.worker_id,
                    "version": self.engine.version if self.engine is not None else -1,  # still loading
                    "throughput": self.throughput,
                }
                await self._call("POST", f"{API}/heartbeat", body)
            except (aiohttp.ClientError, TimeoutError, CallFailed) as e:
                logger.debug("heartbeat failed: %r", e)  # the main loop handles re-registration
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.heartbeat_interval)
            except TimeoutError:
                pass

    async def one_lease(self, stop: asyncio.Event) -> bool:
        """Lease, generate, push. False when there was nothing to do."""
        from echo2.rollout.collect import collect, rollout_seed

        cfg = self.config
        body = {
            "worker_id": self.worker_id,
            "version": self.engine.version,
            "max_groups": cfg.coordinator.groups_per_lease or cfg.rollout.prompts_per_step,
        }
        lease = await self._retry("lease", lambda: self._call("POST", f"{API}/lease", body), stop)
        if lease is None:
            return False
        self.lease_id = lease["lease_id"]
        prompts = [self.task.train_prompt(i) for i in lease["indices"]]
        started = time.monotonic()

        def generate():
            torch.manual_seed(rollout_seed(cfg.run.seed, lease["indices"][0]))
            return collect(self.engine, self.task, prompts, n=cfg.rollout.group_size)

        async with self.engine_lock:
            groups = await asyncio.to_thread(generate)
        records = [r.to_dict() for g in groups for r in g]
        self.throughput = len(records) / max(time.monotonic() - started, 1e-9)
        push = {"worker_id": self.worker_id, "lease_id": self.lease_id, "records": records}
        try:
            await self._retry("push", lambda: self._call("POST", f"{API}/trajectories", push), stop)
            self.counts["pushed"] += len(records)
        except CallFailed as e:
            if e.status == 404:
                raise
            self.counts["dropped"] += len(records)
            logger.info("batch of %d dropped by the coordinator: %s", len(records), e.body)
        self.lease_id = None
        return True

    async def return_lease(self) -> None:
        if self.lease_id and self.worker_id:
            try:
                body = {"worker_id": self.worker_id, "lease_id": self.lease_id}
                await asyncio.wait_for(self._call("POST", f"{API}/lease/return", body), timeout=5)
            except (aiohttp.ClientError, TimeoutError, CallFailed) as e:
                logger.info("could not return lease %s: %r", self.lease_id, e)

    # ------------------------------------------------------------------ main loop
    async def run(self, stop: asyncio.Event) -> None:
        try:
            await self._run(stop)
        except ConnectionError:
            if not stop.is_set():
                raise
            logger.info("stopping; coordinator unreachable")

    async def _run(self, stop: asyncio.Event) -> None:
        headers = {"Authorization": f"Bearer {self.token}"}
        timeout = aiohttp.ClientTimeout(total=120, connect=10)
        async with aiohttp.ClientSession(headers=headers, timeout=timeout) as self.session:
            if self.inbound:
                try:
                    await self.relay.start(self.relay_host, self.relay_port)
                except OSError as e:  # port in use, unknown host: the user's flags
                    raise RelayStartError(
                        f"--relay-host/--relay-port: cannot listen on {self.relay_host}:{self.relay_port} ({e})"
                    ) from None
            beat = bcast = None
            try:
                await self.register(stop)
                beat = asyncio.create_task(self.heartbeat_forever(stop))  # alive while the model loads
                bcast = asyncio.create_task(self.bcast.follow(stop, self.install_snapshot))
                await asyncio.to_thread(self._build)
                self.engine_ready.set()
                while not stop.is_set():
                    if bcast.done():  # it only ends on stop; anything else is a bug to surface
                        bcast.result()
                    try:
                        if not await self.one_lease(stop):
                            try:
                                await asyncio.wait_for(stop.wait(), timeout=0.2)
                            except TimeoutError:
                                pass
                    except CallFailed as e:
                        if e.status == 410:  # released by the scheduler: its provider stops us
                            logger.info("released by the coordinator (%s); stopping", e.body)
                            stop.set()
                            break
                        if e.status != 404 or stop.is_set():
                            raise
                        logger.info("coordinator does not know us (%s); registering again", e.body)
                        self.counts["reregistered"] += 1
                        await self.register(stop)
            finally:
                await self.return_lease()
                for task in (beat, bcast):
                    if task is not None:
                        task.cancel()
                await asyncio.gather(*(t for t in (beat, bcast) if t is not None), return_exceptions=True)
                if self.bcast is not None:
                    await self.bcast.close()
                await self.relay.stop()
