"""Part (a) of bench/coordinator_load.py: 1,000 workers heartbeating a coordinator over loopback
while the learner publishes (the scenario and what is reported: coordinator_load.py's docstring).
`heartbeats_once` is one measured run; the clients run in a spawned process."""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import threading
import time

from procs import cpu_list, pinned

from echo2.broadcast.tracker import BroadcastPolicy
from echo2.config import CoordinatorConfig
from echo2.coordinator.leases import Limits, Work
from echo2.coordinator.server import Coordinator
from echo2.coordinator.state import CoordinatorState
from echo2.data.buffer import ReplayBuffer

TOKEN = "bench"
GROUP = 8  # records per group


# ---------------------------------------------------------------------------- (a) heartbeats
def heartbeat_clients(url: str, args: dict, ready: mp.Queue, out: mp.Queue) -> None:
    import aiohttp

    n, interval, seconds = args["workers"], args["interval"], args["seconds"]
    run = {"Authorization": f"Bearer {TOKEN}"}

    async def main() -> None:
        loop = asyncio.get_running_loop()
        rng = random.Random(0)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as s:
            gate = asyncio.Semaphore(32)

            async def register(i: int) -> tuple[str, dict]:
                body = {"name": f"w{i}", "inbound": True, "relay_port": 20000 + i}
                async with gate, s.post(f"{url}/v1/register", json=body, headers=run) as r:
                    reply = await r.json()
                return reply["worker_id"], {"Authorization": f"Bearer {reply['credential']}"}

            workers = await asyncio.gather(*(register(i) for i in range(n)))
            installed = [args["versions"] - 1] * n  # every worker runs the newest version
            pending: list[tuple[float, int] | None] = [None] * n

            async def beat(k: int) -> tuple[int, float]:
                wid, mine = workers[k]
                if pending[k] is not None and loop.time() >= pending[k][0]:
                    installed[k], pending[k] = pending[k][1], None
                body = {"worker_id": wid, "version": installed[k], "throughput": 1.0}
                t0 = time.perf_counter()
                async with s.post(f"{url}/v1/heartbeat", json=body, headers=mine) as r:
                    await r.read()
                    return r.status, time.perf_counter() - t0

            async def once(k: int) -> None:
                async with gate:
                    await beat(k)

            await asyncio.gather(*(once(k) for k in range(n)))  # the bookkeeping now holds every worker
            ready.put("ready")
            start, cpu = loop.time(), time.process_time()
            measure_from, stop_at = start + interval, start + interval + seconds
            latencies: list[float] = []
            errors: dict[int, int] = {}
            seen = args["versions"] - 1
            published_at: list[float] = []

            async def poll() -> None:  # the broadcast client's long poll, one for the whole fleet
                nonlocal seen
                while loop.time() < stop_at:
                    try:
                        async with s.get(
                            f"{url}/v1/published", params={"after": str(seen), "wait": "5"}, headers=run
                        ) as r:
                            version = (await r.json())["version"]
                    except (aiohttp.ClientError, TimeoutError):
                        continue
                    if version > seen:
                        seen = version
                        published_at.append(loop.time())
                        for k in range(n):  # each worker installs it after its own transfer
                            pending[k] = (loop.time() + rng.uniform(0.5, 5.0), version)

            async def worker(k: int, phase: float) -> None:
                await asyncio.sleep(phase)
                due = loop.time()
                while due < stop_at:
                    status, took = await beat(k)
                    if due >= measure_from:
                        latencies.append(took)
                        if status != 200:
                            errors[status] = errors.get(status, 0) + 1
                    due += interval
                    await asyncio.sleep(max(0.0, due - loop.time()))

            poller = asyncio.create_task(poll())
            await asyncio.gather(*(worker(k, rng.uniform(0, interval)) for k in range(n)))
            poller.cancel()
        out.put(
            {
                "latencies": latencies,
                "errors": errors,
                "published": len(published_at),
                "client_cpu_s": time.process_time() - cpu,
                "wall_s": loop.time() - start,
            }
        )

    asyncio.run(main())


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def heartbeats_once(args: argparse.Namespace) -> dict:
    state = CoordinatorState(
        CoordinatorConfig(
            lease_timeout=300.0, heartbeat_timeout=args.heartbeat_timeout, max_leases_per_worker=4
        ),
        work=Work(
            buffer=ReplayBuffer(staleness=1, group_size=GROUP),
            limits=Limits(vocab_size=50_000, max_prompt_tokens=256, max_new_tokens=32, group_size=GROUP),
            group_id_of=lambda i: f"g{i}",
        ),
        broadcast=BroadcastPolicy(mode="chain", chunk_size=4096, uplink_budget_bps=100e6 / 8),
    )
    for v in range(args.versions):  # 64 kept versions, as with a long run at staleness 63
        state.publisher.publish(v, os.urandom(16 * 1024), keep=args.versions)
    server = Coordinator(state, token=TOKEN, run_info={}, heartbeat_interval=args.interval)
    url = server.start()
    ctx = mp.get_context("spawn")
    ready, out = ctx.Queue(), ctx.Queue()
    knobs = {
        "workers": args.workers,
        "interval": args.interval,
        "seconds": args.seconds,
        "versions": args.versions,
    }
    proc = ctx.Process(target=heartbeat_clients, args=(url, knobs, ready, out))
    with pinned(cpu_list(args.client_cpus)):
        proc.start()
    ready.get(timeout=600)
    cpu = time.process_time()
    assert (
        len(state.registry.workers) == args.workers
        and state.publisher.t_bcast_all.get(args.versions - 1) is not None
    )
    stop = threading.Event()

    def learner() -> None:  # publishes a new version every `publish_every` seconds, keeps 64
        version = args.versions
        while not stop.wait(args.publish_every):
            state.publisher.publish(version, os.urandom(16 * 1024), keep=args.versions)
            version += 1

    publisher = threading.Thread(target=learner, daemon=True)
    publisher.start()
    result = out.get(timeout=args.seconds + 600)
    server_cpu = time.process_time() - cpu
    proc.join(timeout=60)
    stop.set()
    publisher.join(timeout=10)
    lost = sum(1 for w in state.registry.workers.values() if w.status.value != "active")
    kept = len(state.publisher.bcast.snapshots)
    server.stop()
    lat = result["latencies"]
    return {
        "heartbeats": len(lat),
        "heartbeats_per_s": len(lat) / args.seconds,
        "p50_ms": pct(lat, 0.50) * 1e3,
        "p95_ms": pct(lat, 0.95) * 1e3,
        "p99_ms": pct(lat, 0.99) * 1e3,
        "max_ms": max(lat) * 1e3,
        "errors": result["errors"],
        "versions_published_in_window": result["published"],
        "versions_kept_at_end": kept,
        "workers_marked_lost": lost,
        "server_cpu_s": server_cpu,
        "client_cpu_s": result["client_cpu_s"],
        "wall_s": result["wall_s"],
        "server_cpu_us_per_heartbeat": server_cpu / len(lat) * 1e6,
    }
