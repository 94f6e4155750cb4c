"""Benchmark: the coordinator under load (issue 12), over HTTP on loopback.

(a) **Heartbeats.** 1,000 workers register (each with a relay port, so every one is a possible
    parent in the chain plans) with 64 published versions kept; every worker heartbeats its
    installed version once, so the broadcast bookkeeping holds all of them. Then, for the measured
    window, every worker heartbeats every `--interval` seconds (the default of
    `coordinator.heartbeat_interval`), phases spread uniformly, while the learner publishes a new
    version every `--publish-every` seconds (keeping 64): a worker sees each new version on its
    long poll and, after a simulated transfer of 0.5-5 s, heartbeats the new version from then on.
    So each publication brings 1,000 heartbeats that note a new version (the path that once ran
    `Installs.update` over all kept versions on every heartbeat) among the ones that
    repeat a known version. Reported: the latency of each heartbeat as the client sees it (p50, p95,
    p99, max), errors, and how many live workers the coordinator marked lost.
(b) **Ingestion with validation and re-scoring.** The coordinator as a learner serves it for the
    arithmetic task with SmolLM2's tokenizer: validation at the door (wire/validate.py) and the
    learner's `TaskReferee` (learning/verify.py), which checks each record's prompt ids against the
    leased prompt (chat template and all) and re-scores its response with the task's reward. C
    concurrent clients in a second process register, lease G groups (1, as bench/ingest.py, and 4,
    the quickstart's lease: `coordinator.groups_per_lease` defaults to `rollout.prompts_per_step`)
    and push their 8 records each (31 prompt and 16 response tokens, half of them right, with the
    metadata workers send), repeatedly;
    the learner side drains complete groups. Honest records for the first prompts are built before
    the clients start, so the clients spend their time on HTTP, not on tokenizing. Reported:
    accepted records/s over the window, median of R repeats, with the referee and without it (as
    bench/ingest.py measures), and with the referee and the accepted-records journal
    (coordinator/journal.py, in a temporary directory: what a learner with a run directory does), and the
    records per second of the server process's own CPU time (what one core given to the coordinator
    alone would sustain, the clients being remote).

Both halves run the server in this process and the clients in a spawned one, on whatever cores
the process may use (`taskset -c 0 python bench/coordinator_load.py` puts both on one core).

    python bench/coordinator_load.py --json docs/bench/coordinator_load.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import threading
import time
import uuid

from common import run_clients, start_drainer, write_json
from coordinator_heartbeats import GROUP, TOKEN, heartbeats_once
from procs import add_cpu_options, cpu_list, pinned, start_on_server_cpus

from echo2.config import CoordinatorConfig
from echo2.coordinator.leases import Limits, Work
from echo2.coordinator.server import Coordinator
from echo2.coordinator.state import CoordinatorState
from echo2.data.buffer import ReplayBuffer
from echo2.wire.validate import reward_range

RESPONSE_TOKENS = 16


# ---------------------------------------------------------------------------- (b) ingestion
def honest_groups(count: int) -> tuple[list[dict], int]:
    """Wire records of one group for each of the first `count` training prompts (4 right answers,
    4 wrong, as a worker would score them), and the tokenizer's vocabulary size."""
    from echo2.config import ArithmeticTaskConfig, TinyModelConfig
    from echo2.data.tasks.arithmetic import ArithmeticTask
    from echo2.models import load_tokenizer
    from echo2.rollout.engine import encode_prompt

    tok = load_tokenizer(TinyModelConfig())  # SmolLM2-135M's tokenizer, as in the quickstart
    task = ArithmeticTask(ArithmeticTaskConfig(), seed=0)
    groups = []
    for index in range(count):
        prompt = task.train_prompt(index)
        samples = []
        for answer in (prompt.answer, str(int(prompt.answer) + 1)):
            ids = tok(
                f"Working it out carefully, the result is Answer: {answer}", add_special_tokens=False
            ).input_ids
            ids = ids[:RESPONSE_TOKENS]
            score = task.score(prompt, tok.decode(ids, skip_special_tokens=True))
            samples.append(
                {
                    "group_id": prompt.group_id,
                    "prompt_ids": encode_prompt(tok, prompt),
                    "response_ids": ids,
                    "behaviour_logprobs": [-0.5] * len(ids),
                    "loss_mask": list(task.loss_mask(tuple(ids))),
                    "reward": score.reward,
                    "version": 0,
                    "metadata": {"correct": score.correct, "parsed": score.parsed, "answer": prompt.answer},
                }
            )
        groups.append({"index": index, "samples": samples})
    return groups, len(tok)


def ingest_clients(
    url: str, groups: list[dict], num: int, seconds: float, per_lease: int, out: mp.Queue
) -> None:
    import aiohttp

    records_of = {g["index"]: g["samples"] for g in groups}

    async def one(session: aiohttp.ClientSession, stop_at: float) -> tuple[int, dict]:
        async with session.post(f"{url}/v1/register", json={"name": "bench"}) as r:
            reply = await r.json()
        wid, mine = reply["worker_id"], {"Authorization": f"Bearer {reply['credential']}"}
        pushed, refused, leased, out_of_records = 0, {}, [], False
        while time.monotonic() < stop_at:
            async with session.post(
                f"{url}/v1/lease",
                json={"worker_id": wid, "version": 0, "max_groups": per_lease},
                headers=mine,
            ) as r:
                if r.status != 200:
                    await asyncio.sleep(0.01)
                    continue
                lease = await r.json()
            leased.append(len(lease["indices"]))
            if any(i not in records_of for i in lease["indices"]):  # past the records built beforehand
                out_of_records = True
                break
            records = [
                {**records_of[i][k % 2], "record_id": uuid.uuid4().hex}
                for i in lease["indices"]
                for k in range(GROUP)
            ]
            body = {"worker_id": wid, "lease_id": lease["lease_id"], "records": records}
            async with session.post(f"{url}/v1/trajectories", json=body, headers=mine) as r:
                reply = await r.json()
                if r.status != 200:
                    refused[reply["error"]] = refused.get(reply["error"], 0) + 1
                elif time.monotonic() <= stop_at:  # count only inside the window
                    pushed += reply["accepted"]
        return pushed, refused, leased, out_of_records

    async def main() -> None:
        cpu = time.process_time()
        stop_at = time.monotonic() + seconds
        results = await run_clients(num, one, stop_at, TOKEN, timeout_s=60)
        refused: dict[str, int] = {}
        for _, r, _, _ in results:
            for k, v in r.items():
                refused[k] = refused.get(k, 0) + v
        leased = [n for _, _, sizes, _ in results for n in sizes]
        out.put(
            {
                "accepted": sum(p for p, _, _, _ in results),
                "clients_out_of_records": sum(o for _, _, _, o in results),
                "refused": refused,
                "mean_groups_per_lease": sum(leased) / max(1, len(leased)),
                "client_cpu_s": time.process_time() - cpu,
            }
        )

    asyncio.run(main())


def ingest_once(
    groups: list[dict], vocab_size: int, args: argparse.Namespace, *, referee: bool, journal: bool = False
) -> dict:
    import tempfile
    from pathlib import Path

    from echo2.config import ArithmeticTaskConfig, TinyModelConfig
    from echo2.coordinator.journal import NAME, Journal
    from echo2.data.tasks.arithmetic import ArithmeticTask
    from echo2.learning.verify import TaskReferee
    from echo2.models import load_tokenizer

    task = ArithmeticTask(ArithmeticTaskConfig(), seed=0)
    state = CoordinatorState(
        CoordinatorConfig(
            lease_timeout=300.0,
            heartbeat_timeout=60.0,
            groups_per_lease=args.groups_per_lease,
            max_leases_per_worker=4,
        ),
        work=Work(
            buffer=ReplayBuffer(staleness=1, group_size=GROUP),
            limits=Limits(
                vocab_size=vocab_size,
                max_prompt_tokens=256,
                max_new_tokens=RESPONSE_TOKENS,
                group_size=GROUP,
                reward_range=reward_range(task),
            ),
            group_id_of=lambda i: task.train_prompt(i).group_id,
            groups_per_step=args.clients * args.groups_per_lease,
        ),
        referee=TaskReferee(task, load_tokenizer(TinyModelConfig())) if referee else None,
    )
    scratch = tempfile.TemporaryDirectory(prefix="echo2-bench-journal-") if journal else None
    log = Journal(Path(scratch.name) / NAME, epoch=state.epoch) if scratch is not None else None
    state.intake.journal = log.accepted if log is not None else None  # as learning/sources/remote.py wires it
    state.publisher.publish(0, b"v0", keep=2)
    server = Coordinator(state, token=TOKEN, run_info={}, heartbeat_interval=2.0)
    url = server.start()
    stop = threading.Event()
    drainer = start_drainer(state.intake, stop)  # the learner's side: take groups as they arrive
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    proc = ctx.Process(
        target=ingest_clients,
        args=(url, groups, args.clients, args.ingest_seconds, args.groups_per_lease, out),
    )
    with pinned(cpu_list(args.client_cpus)):
        proc.start()
    cpu, accepted = time.process_time(), state.intake.ingestion.accepted
    result = out.get(timeout=args.ingest_seconds + 600)
    server_cpu, stored = time.process_time() - cpu, state.intake.ingestion.accepted - accepted
    proc.join(timeout=30)
    stop.set()
    drainer.join(timeout=5)
    server.stop()
    journal_bytes = 0
    if scratch is not None:
        journal_bytes = (Path(scratch.name) / NAME).stat().st_size
        log.close()
        scratch.cleanup()
    assert state.intake.ingestion.accepted >= result["accepted"], (
        "the coordinator stored every push the clients counted"
    )
    assert not result["refused"], f"honest pushes were refused: {result['refused']}"
    assert not result["clients_out_of_records"], "clients ran past the records built: raise --groups"
    rejected = dict(state.intake.ingestion.rejected)
    return {
        "accepted": result["accepted"],
        "records_per_s": result["accepted"] / args.ingest_seconds,
        "refused": rejected,
        "groups_used": state.intake.ingestion.next_index,
        "mean_groups_per_lease": result["mean_groups_per_lease"],
        "server_cpu_s": server_cpu,
        "client_cpu_s": result["client_cpu_s"],
        "server_cpu_us_per_record": server_cpu / stored * 1e6,
        "records_per_server_cpu_s": stored / server_cpu,
        "journal_bytes": journal_bytes,
    }


# ---------------------------------------------------------------------------- main
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=1000)
    p.add_argument("--versions", type=int, default=64, help="published versions kept")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between a worker's heartbeats")
    p.add_argument("--heartbeat-timeout", type=float, default=15.0)
    p.add_argument("--publish-every", type=float, default=10.0)
    p.add_argument("--seconds", type=float, default=30.0, help="heartbeat measurement window")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--ingest-seconds", type=float, default=10.0)
    p.add_argument(
        "--groups",
        type=int,
        default=40_000,
        help="honest groups built before ingestion (a client stops past them)",
    )
    p.add_argument(
        "--groups-per-lease",
        type=int,
        nargs="+",
        default=[1, 4],
        help="groups a client leases and pushes at once (8 records each); one ingestion run per value",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--skip", choices=["heartbeats", "ingest", "journal", "baseline"], action="append", default=[]
    )
    add_cpu_options(p)
    p.add_argument("--json")
    args = p.parse_args()
    result: dict = start_on_server_cpus(args)
    if "heartbeats" not in args.skip:
        runs = [heartbeats_once(args) for _ in range(args.repeats)]
        result["heartbeats"] = {
            "runs": runs,
            **{f"median_{k}": statistics.median(r[k] for r in runs) for k in ("p50_ms", "p95_ms", "p99_ms")},
        }
        print(json.dumps(result["heartbeats"], indent=2))
    if "ingest" not in args.skip:
        t0 = time.perf_counter()
        groups, vocab_size = honest_groups(args.groups)
        result["ingest_records_built_s"] = time.perf_counter() - t0
        modes = [("referee", True, False)]
        if "journal" not in args.skip:  # the learner's own configuration: the journal is on with a run dir
            modes.append(("referee_journal", True, True))
        if "baseline" not in args.skip:
            modes.append(("no_referee", False, False))
        for per_lease in args.groups_per_lease:
            for name, on, journal in modes:
                knobs = argparse.Namespace(**{**vars(args), "groups_per_lease": per_lease})
                runs = [
                    ingest_once(groups, vocab_size, knobs, referee=on, journal=journal)
                    for _ in range(args.repeats)
                ]
                key = f"ingest_{name}_{per_lease}_groups_per_lease"
                result[key] = {
                    "runs": runs,
                    "median_records_per_s": statistics.median(r["records_per_s"] for r in runs),
                    "median_records_per_server_cpu_s": statistics.median(
                        r["records_per_server_cpu_s"] for r in runs
                    ),
                }
                print(key, json.dumps({k: v for k, v in result[key].items() if k != "runs"}))
    result["loadavg_end"] = os.getloadavg()
    write_json(args.json, result)


if __name__ == "__main__":
    main()
