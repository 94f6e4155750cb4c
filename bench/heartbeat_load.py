"""Benchmark: honest heartbeats while large pushes arrive (issue 22 case 7), over HTTP on loopback.

The coordinator runs in this process with the arithmetic task's referee (SmolLM2's tokenizer, as
bench/coordinator_load.py), the learner side draining complete groups. A second process runs
`--beaters` honest workers heartbeating every `--beat-interval` seconds and records each latency
as the client sees it, while a third runs one of two loads:

- **stream**: `--pushers` honest workers each lease 512 groups and push their 4,096 records
  (31 prompt and 16 response tokens, 4 of 8 right), again and again: every push is parsed, checked
  at the door, re-scored by the referee and stored.
- **big**: 12 clients push 61 MiB bodies at once, again and again: half of them quarantined (their
  bodies are refused from the headers, unread), half honest workers whose bodies are valid JSON of
  records for a lease they do not hold (parsed and checked, then refused).

Reported per scenario and run: heartbeat p50/p95/p99/max (ms), heartbeats answered, pushes done,
and the machine's load average (other processes share it).

    python bench/heartbeat_load.py --json docs/bench/heartbeat_load.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import statistics
import threading
import time
import uuid

from common import start_drainer, write_json
from coordinator_load import GROUP, TOKEN, honest_groups, pct
from procs import add_cpu_options, cpu_list, pinned, start_on_server_cpus

from echo2.config import CoordinatorConfig
from echo2.coordinator.leases import Limits, Work
from echo2.coordinator.server import Coordinator
from echo2.coordinator.state import CoordinatorState
from echo2.data.buffer import ReplayBuffer
from echo2.wire.validate import reward_range

BIG = 61 * 2**20
STREAM_GROUPS = 512


def beaters(url: str, num: int, interval: float, seconds: float, ready: mp.Queue, out: mp.Queue) -> None:
    import aiohttp

    async def main() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            creds = []
            for i in range(num):
                async with s.post(
                    f"{url}/v1/register",
                    json={"name": f"beat{i}"},
                    headers={"Authorization": f"Bearer {TOKEN}"},
                ) as r:
                    body = await r.json()
                creds.append((body["worker_id"], {"Authorization": f"Bearer {body['credential']}"}))
            ready.put(True)
            latencies, errors = [], 0
            stop_at = time.monotonic() + seconds

            async def one(k: int) -> None:
                nonlocal errors
                wid, headers = creds[k]
                await asyncio.sleep(interval * k / num)
                while time.monotonic() < stop_at:
                    started = time.monotonic()
                    try:
                        async with s.post(
                            f"{url}/v1/heartbeat", json={"worker_id": wid, "version": 0}, headers=headers
                        ) as r:
                            await r.read()
                            ok = r.status == 200
                    except (TimeoutError, aiohttp.ClientError):
                        ok = False
                    latencies.append(time.monotonic() - started) if ok else None
                    errors += not ok
                    await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

            await asyncio.gather(*(one(k) for k in range(num)))
            out.put({"latencies": latencies, "errors": errors})

    asyncio.run(main())


def pushers(
    url: str, scenario: str, num: int, seconds: float, groups: list[dict], out: mp.Queue, go, nice: int
) -> None:
    import aiohttp

    os.nice(nice)  # the load generator yields its core to the beaters (see --load-nice)

    records_of = {g["index"]: g["samples"] for g in groups}
    big_record = {**groups[0]["samples"][0], "record_id": uuid.uuid4().hex}
    one_len = len(json.dumps(big_record)) + 2
    big_records = [{**big_record, "record_id": uuid.uuid4().hex} for _ in range(BIG // one_len)]

    async def main() -> None:
        stop_at = math.inf
        done, refused = 0, {}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:

            async def register() -> tuple[str, dict]:
                async with s.post(
                    f"{url}/v1/register", json={"name": "push"}, headers={"Authorization": f"Bearer {TOKEN}"}
                ) as r:
                    body = await r.json()
                return body["worker_id"], {"Authorization": f"Bearer {body['credential']}"}

            async def stream() -> None:
                nonlocal done
                wid, headers = await register()
                while time.monotonic() < stop_at:
                    async with s.post(
                        f"{url}/v1/lease",
                        json={"worker_id": wid, "version": 0, "max_groups": STREAM_GROUPS},
                        headers=headers,
                    ) as r:
                        if r.status != 200:
                            await asyncio.sleep(0.05)
                            continue
                        lease = await r.json()
                    records = [
                        {**records_of[i % len(records_of)][k % 2], "record_id": uuid.uuid4().hex}
                        for i in lease["indices"]
                        for k in range(GROUP)
                    ]
                    body = {"worker_id": wid, "lease_id": lease["lease_id"], "records": records}
                    async with s.post(f"{url}/v1/trajectories", json=body, headers=headers) as r:
                        reply = await r.json()
                        if r.status == 200:
                            done += 1
                        else:
                            refused[reply["error"]] = refused.get(reply["error"], 0) + 1

            async def big(k: int, wid: str, headers: dict, body: bytes) -> None:
                nonlocal done
                while time.monotonic() < stop_at:
                    try:
                        async with s.post(
                            f"{url}/v1/trajectories",
                            data=body,
                            headers={**headers, "Content-Type": "application/json"},
                        ) as r:
                            reply = await r.json()
                            refused[reply["error"]] = refused.get(reply["error"], 0) + 1
                            done += 1
                    except aiohttp.ClientError as e:  # a refused body: the server closed the connection
                        refused[type(e).__name__] = refused.get(type(e).__name__, 0) + 1
                        done += 1
                        await asyncio.sleep(0.05)

            if scenario == "stream":
                out.put({"register": []})
                await asyncio.get_running_loop().run_in_executor(None, go.wait)
                stop_at = time.monotonic() + seconds
                await asyncio.gather(*(stream() for _ in range(num)))
            else:
                ids = [await register() for _ in range(12)]
                bodies = [  # built before the window: about 61 MiB each
                    json.dumps({"worker_id": wid, "lease_id": "none", "records": big_records}).encode()
                    for wid, _ in ids
                ]
                out.put({"register": [wid for wid, _ in ids], "body_mib": len(bodies[0]) / 2**20})
                await asyncio.get_running_loop().run_in_executor(None, go.wait)  # half are quarantined
                stop_at = time.monotonic() + seconds
                await asyncio.gather(*(big(k, *ids[k], bodies[k]) for k in range(12)))
        out.put({"pushes": done, "refused": refused})

    asyncio.run(main())


def run_once(scenario: str, groups: list[dict], vocab_size: int, args: argparse.Namespace) -> dict:
    from echo2.config import ArithmeticTaskConfig, TinyModelConfig
    from echo2.data.tasks.arithmetic import ArithmeticTask
    from echo2.learning.verify import TaskReferee
    from echo2.models import load_tokenizer

    task = ArithmeticTask(ArithmeticTaskConfig(), seed=0)
    state = CoordinatorState(
        CoordinatorConfig(
            lease_timeout=300.0,
            heartbeat_timeout=60.0,
            groups_per_lease=STREAM_GROUPS,
            max_leases_per_worker=4,
            quarantine_after=10**9,
        ),
        work=Work(
            buffer=ReplayBuffer(staleness=1, group_size=GROUP),
            limits=Limits(
                vocab_size=vocab_size,
                max_prompt_tokens=256,
                max_new_tokens=16,
                group_size=GROUP,
                reward_range=reward_range(task),
            ),
            group_id_of=lambda i: task.train_prompt(i).group_id,
            groups_per_step=args.pushers * STREAM_GROUPS,
        ),
        referee=TaskReferee(task, load_tokenizer(TinyModelConfig())),
    )
    state.publisher.publish(0, b"v0", keep=2)
    server = Coordinator(state, token=TOKEN, run_info={}, heartbeat_interval=2.0)
    url = server.start()
    stop = threading.Event()
    drainer = start_drainer(state.intake, stop)  # the learner's side: take groups as they arrive
    ctx = mp.get_context("spawn")
    ready, beats, pushed, go = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Event()
    load = ctx.Process(
        target=pushers, args=(url, scenario, args.pushers, args.seconds, groups, pushed, go, args.load_nice)
    )
    with pinned(cpu_list(args.client_cpus)):
        load.start()
    registered = pushed.get(timeout=600)
    for wid in registered["register"][::2]:  # half of the big pushers are quarantined
        state.intake.integrity.quarantined.add(wid)
    beat = ctx.Process(
        target=beaters, args=(url, args.beaters, args.beat_interval, args.seconds + 2, ready, beats)
    )
    with pinned(cpu_list(args.client_cpus)):
        beat.start()
    ready.get(timeout=120)
    go.set()
    beat_result = beats.get(timeout=args.seconds + 600)
    push_result = pushed.get(timeout=600)
    load.join(timeout=30)
    beat.join(timeout=30)
    stop.set()
    drainer.join(timeout=5)
    server.stop()
    lat = beat_result["latencies"]
    return {
        "heartbeats": len(lat),
        "errors": beat_result["errors"],
        **{f"p{q}_ms": pct(lat, q / 100) * 1e3 for q in (50, 95, 99)},
        "max_ms": max(lat) * 1e3,
        **push_result,
        "body_mib": registered.get("body_mib"),
        "records_accepted": state.intake.ingestion.accepted,
        "loadavg": os.getloadavg(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenario", choices=["stream", "big"], nargs="+", default=["stream", "big"])
    p.add_argument("--beaters", type=int, default=50)
    p.add_argument("--beat-interval", type=float, default=0.5)
    p.add_argument("--pushers", type=int, default=2)
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument(
        "--load-nice",
        type=int,
        default=10,
        help="niceness of the load process (pushers), which shares the beaters' CPUs here; in a "
        "deployment they are other machines (0: the same priority as the beaters)",
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--groups", type=int, default=6144, help="honest groups built (a stream client wraps past them)"
    )
    add_cpu_options(p)
    p.add_argument("--json")
    args = p.parse_args()
    result: dict = start_on_server_cpus(args)
    groups, vocab_size = honest_groups(args.groups)
    for scenario in args.scenario:
        runs = [run_once(scenario, groups, vocab_size, args) for _ in range(args.repeats)]
        p95 = [r["p95_ms"] for r in runs]
        result[scenario] = {
            "runs": runs,
            "median_p95_ms": statistics.median(p95),
            "range_p95_ms": [min(p95), max(p95)],
        }
        print(scenario, json.dumps({k: v for k, v in result[scenario].items() if k != "runs"}), flush=True)
    result["loadavg_end"] = os.getloadavg()
    write_json(args.json, result)


if __name__ == "__main__":
    main()
