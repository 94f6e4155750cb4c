"""A worker's throughput is known before it is activated: real `Worker`s (in process, tiny model)
registering with a coordinator on 127.0.0.1 port 0 whose scheduler holds them in standby. A plain
worker times a calibration generation and reports it; `--throughput` declares one in the
registration; an emulated worker declares its rate. None of them has had a lease."""

from __future__ import annotations

import asyncio
import threading
import time

from support import TINY

from echo2.config import load_config
from echo2.data.buffer import ReplayBuffer
from echo2.data.tasks import make_task
from echo2.learning.sources.remote import RemoteRollout
from echo2.rollout.worker import Worker
from echo2.rollout.worker_config import WorkerConfig


def test_standby_workers_report_a_calibrated_or_declared_throughput(tmp_path):
    config = load_config(
        TINY,
        {
            "coordinator.token": "t",
            "coordinator.heartbeat_interval": 0.3,
            "coordinator.heartbeat_timeout": 5.0,
            "scheduler.enabled": True,
            "scheduler.t_train": 3600.0,  # a target known at once, so newcomers wait in standby
            "scheduler.sustain_s": 3600.0,  # and nobody is activated during the test
        },
    )
    source = RemoteRollout(
        config=config,
        task=make_task(config.task, seed=0),
        buffer=ReplayBuffer(staleness=0, group_size=config.rollout.group_size),
        vocab_size=100,
        run_dir=tmp_path,
    )
    source.listen()  # no snapshot: the workers wait in standby, unleased
    flags = {"plain": {}, "declared": {"throughput": 3.0}, "emulated": {"emulate": 5.0}}
    workers = [Worker(WorkerConfig(url=source.url, token="t", name=n, **kw)) for n, kw in flags.items()]
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def serve() -> None:
        await asyncio.gather(*(w.run(stop) for w in workers))

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    try:
        figures = {}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(figures) < len(flags):
            time.sleep(0.1)
            with source.state.shared.lock:
                figures = {
                    w.name: source.state.intake.throughput(w, source.state.shared.clock())
                    for w in source.state.registry.workers.values()
                }
                figures = {name: mu for name, mu in figures.items() if mu is not None}
        rows = {r["name"]: r for r in source.state.status()["workers"]}
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=60)
        source.close()
    assert not thread.is_alive()
    assert set(figures) == set(flags), f"no throughput figure for {set(flags) - set(figures)}"
    assert figures["declared"] == 3.0 and figures["emulated"] == 5.0
    assert figures["plain"] > 0, "calibrated"
    assert workers[0].throughput == figures["plain"], "the worker's own timing, as reported"
    assert all(r["state"] == "standby" and r["delivered"] is None for r in rows.values())
    assert source.state.intake.ingestion.next_index == 0, "no lease was issued"
