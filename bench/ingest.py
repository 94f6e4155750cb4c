"""Benchmark: coordinator ingestion throughput (records/s) on loopback with concurrent pushers.

The coordinator (real HTTP server, real validation, real buffer) runs in this process; a second
process runs C concurrent clients (asyncio, one aiohttp session each) that register, lease one group
and push its records, as workers do. Records have quickstart sizes (31 prompt and 16 response
tokens, group size 8). The learner side takes complete groups out as they arrive so the buffer
stays small. Reports accepted records/s over the measured window (median of R repeats).

    python bench/ingest.py --clients 16 --seconds 10 --repeats 3 --json docs/bench/ingest.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import threading
import time
import uuid

from common import run_clients, start_drainer, write_json

from echo2.config import CoordinatorConfig
from echo2.coordinator.leases import Limits, Work
from echo2.coordinator.server import Coordinator
from echo2.coordinator.state import CoordinatorState
from echo2.data.buffer import ReplayBuffer

GROUP = 8
TOKEN = "bench"


def clients(url: str, num: int, seconds: float, out: mp.Queue) -> None:
    import aiohttp

    async def one(session: aiohttp.ClientSession, stop_at: float) -> int:
        async with session.post(f"{url}/v1/register", json={"name": "bench"}) as r:
            reply = await r.json()
        wid, mine = reply["worker_id"], {"Authorization": f"Bearer {reply['credential']}"}
        pushed = 0
        while time.monotonic() < stop_at:
            async with session.post(
                f"{url}/v1/lease", json={"worker_id": wid, "version": 0, "max_groups": 1}, headers=mine
            ) as r:
                if r.status != 200:
                    await asyncio.sleep(0.01)
                    continue
                lease = await r.json()
            gid = f"g{lease['indices'][0]}"
            records = [
                {
                    "record_id": uuid.uuid4().hex,
                    "group_id": gid,
                    "prompt_ids": list(range(31)),
                    "response_ids": list(range(16)),
                    "behaviour_logprobs": [-0.5] * 16,
                    "loss_mask": [1] * 16,
                    "reward": 1.0,
                    "version": 0,
                }
                for _ in range(GROUP)
            ]
            body = {"worker_id": wid, "lease_id": lease["lease_id"], "records": records}
            async with session.post(f"{url}/v1/trajectories", json=body, headers=mine) as r:
                if r.status == 200 and time.monotonic() <= stop_at:  # count only inside the window
                    pushed += (await r.json())["accepted"]
        return pushed

    async def main() -> None:
        stop_at = time.monotonic() + seconds
        counts = await run_clients(num, one, stop_at, TOKEN, timeout_s=30)
        out.put(sum(counts))

    asyncio.run(main())


def once(num_clients: int, seconds: float) -> dict:
    buffer = ReplayBuffer(staleness=0, group_size=GROUP)
    state = CoordinatorState(
        CoordinatorConfig(lease_timeout=60, heartbeat_timeout=60, max_leases_per_worker=4),
        work=Work(
            buffer=buffer,
            limits=Limits(vocab_size=50_000, max_prompt_tokens=256, max_new_tokens=32, group_size=GROUP),
            group_id_of=lambda i: f"g{i}",
        ),
    )
    state.publisher.publish(0, b"v0", keep=1)
    server = Coordinator(state, token=TOKEN, run_info={}, heartbeat_interval=1.0)
    url = server.start()
    stop = threading.Event()
    drainer = start_drainer(state.intake, stop)  # the learner's side: take groups as they arrive
    out: mp.Queue = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=clients, args=(url, num_clients, seconds, out))
    t0 = time.monotonic()
    proc.start()
    pushed = out.get(timeout=seconds + 120)
    elapsed = time.monotonic() - t0
    proc.join(timeout=30)
    stop.set()
    drainer.join(timeout=5)
    server.stop()
    assert state.intake.ingestion.accepted >= pushed, "the coordinator stored every push the clients counted"
    # elapsed includes the client process start (about 1 s); the window below is the push window
    return {"accepted": pushed, "records_per_s": pushed / seconds, "wall_s": elapsed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args()
    runs = [once(args.clients, args.seconds) for _ in range(args.repeats)]
    result = {
        "clients": args.clients,
        "seconds": args.seconds,
        "group_size": GROUP,
        "runs": runs,
        "median_records_per_s": statistics.median(r["records_per_s"] for r in runs),
    }
    print(json.dumps(result, indent=2))
    write_json(args.json, result)


if __name__ == "__main__":
    main()
