"""Issue 22, case 1: one worker cannot stall the run or crash honest workers.

What was seen at commit 97ea5ef: a worker leased 2 prompts, pushed one valid record per prompt,
returned the lease and repeated every 0.2 s. Returned prompts are handed out first, so an honest
worker's whole groups were refused (`group_overflow`) and the partial groups never completed; the
honest worker, holding 2 open leases, got 429 `lease_limit` and `echo2 worker` exited 1; the learner
waited at one version until `wait_timeout` and exited 1; the attacker got no strike.

Now a push carries whole groups (`partial_group`, a strike), so a group is admitted from one lease,
whole; a lease given back with nothing pushed counts against its worker past an allowance; and the
worker's lease loop backs off on any refusal with a reason instead of dying."""

from __future__ import annotations

import asyncio
import threading
import time

from hostile import TOKEN, Door, HostileWorker
from support import TINY, run_with_fleet

from echo2.config import load_config
from echo2.rollout.worker import Worker
from echo2.rollout.worker_config import WorkerConfig


def _return(worker: HostileWorker, lease_id: str) -> tuple[int, object]:
    return worker.call("POST", "/v1/lease/return", {"worker_id": worker.worker_id, "lease_id": lease_id})


def test_a_partial_group_is_refused_and_the_returned_prompts_go_whole_to_an_honest_worker(
    door: Door, mallory: HostileWorker
):
    lease_id, records = door.honest_lease(mallory)
    one_each = list({r["group_id"]: r for r in records}.values())  # one valid record per prompt
    before = door.snapshot()
    status, body = mallory.push(lease_id, one_each)
    assert status == 422 and body["error"] == "partial_group", body
    after = door.snapshot()
    assert after["buffer"] == before["buffer"] and after["seen"] == before["seen"], "nothing stored"
    assert door.state.intake.integrity.strikes[mallory.worker_id] == 1
    assert _return(mallory, lease_id)[0] == 200
    assert door.state.intake.integrity.unpushed[mallory.worker_id] == 0, "a push reached it: not unpushed"

    honest = HostileWorker(door.url, "honest")
    lease_id, records = door.honest_lease(honest)  # the returned prompts, handed out first
    assert {r["group_id"] for r in records} == {r["group_id"] for r in one_each}
    status, body = honest.push(lease_id, records)
    assert status == 200 and body["accepted"] == len(records), body
    assert door.train(len({r["group_id"] for r in records}))["train/skipped_step"] == 0.0


def test_returning_leases_without_pushing_strikes_past_the_allowance(door: Door, mallory: HostileWorker):
    allowance = door.state.intake.max_leases_per_worker
    strikes = door.state.intake.integrity.strikes
    for _ in range(allowance):
        status, lease = mallory.lease()
        assert status == 200 and _return(mallory, lease["lease_id"])[0] == 200
    assert strikes[mallory.worker_id] == 0, "an honest worker gives back what it holds, once"
    for _ in range(door.state.intake.integrity.quarantine_after):
        status, lease = mallory.lease()
        assert status == 200, lease
        assert _return(mallory, lease["lease_id"])[0] == 200
    assert mallory.worker_id in door.state.intake.integrity.quarantined
    assert mallory.lease()[0] == 403

    honest = HostileWorker(door.url, "honest")  # a stored push resets the count
    for _ in range(2):
        for _ in range(allowance):
            _, lease = honest.lease()
            _return(honest, lease["lease_id"])
        lease_id, records = door.honest_lease(honest)
        assert honest.push(lease_id, records)[0] == 200
    assert strikes[honest.worker_id] == 0


def test_the_stall_loop_at_5_hz_beside_an_honest_worker(tmp_path):
    """The learner completes its steps and the honest worker (an in-process `Worker`, emulated
    engine) is still running at the end; the attacker is quarantined."""
    config = load_config(
        TINY,
        {
            "coordinator.token": TOKEN,
            "coordinator.heartbeat_interval": 0.2,
            "coordinator.wait_timeout": 60.0,  # a stall fails the run instead of hanging it
            "learner.steps": 3,
            "learner.staleness": 1,
            "run.eval_size": 0,
            "rollout.sampling": "multinomial",  # the emulated engine samples no model's noise
        },
    )
    seen: dict = {}
    stop = asyncio.Event()
    loop = asyncio.new_event_loop()
    attack_stop = threading.Event()
    attacks: list[tuple[int, str]] = []

    def attacker(source) -> None:
        """Lease 2 prompts, push one valid record per prompt, return the lease, every 0.2 s."""
        from echo2.data.tasks import make_task
        from echo2.models import load_tokenizer
        from echo2.rollout.collect import collect
        from echo2.rollout.emulated import EmulatedEngine

        task = make_task(config.task, seed=config.run.seed)
        engine = EmulatedEngine(load_tokenizer(config.model), rate=1e6, seed=1)
        mallory = HostileWorker(source.url)
        while not attack_stop.is_set():
            engine.version = max(source.state.shared.published_version, 0)
            status, lease = mallory.lease(version=engine.version, max_groups=2)
            if status == 200:
                groups = collect(engine, task, [task.train_prompt(i) for i in lease["indices"]], n=1)
                records = [g[0].to_dict() for g in groups]
                attacks.append(mallory.push(lease["lease_id"], records)[:1] + ("push",))
                attacks.append(_return(mallory, lease["lease_id"])[:1] + ("return",))
            else:
                attacks.append((status, "lease"))
            attack_stop.wait(0.2)
        seen["mallory"] = mallory.worker_id

    def on_ready(source) -> None:
        seen["honest"] = Worker(WorkerConfig(url=source.url, token=TOKEN, name="honest", emulate=40.0))
        seen["task"] = asyncio.run_coroutine_threadsafe(seen["honest"].run(stop), loop)
        threading.Thread(target=attacker, args=(source,), daemon=True).start()

        def at_the_end() -> None:  # before close: the run's end stops every worker
            seen["honest_running"] = not seen["task"].done()
            attack_stop.set()
            with source.state.shared.lock:
                seen["quarantined"] = set(source.state.intake.integrity.quarantined)
                seen["rejected"] = dict(source.state.intake.ingestion.rejected)

        source.before_close.append(at_the_end)

    class Fleet:
        def stop(self) -> None:
            attack_stop.set()
            loop.call_soon_threadsafe(stop.set)

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    started = time.monotonic()
    try:
        summary = run_with_fleet(config, tmp_path / "run", Fleet(), on_ready)
    finally:
        loop.call_soon_threadsafe(stop.set)
        try:
            seen["task"].result(timeout=30)
        except Exception as e:  # noqa: BLE001 - reported below
            seen["error"] = e
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
    assert summary["steps"] == 3
    assert seen["honest_running"], seen.get("error")
    assert "error" not in seen, seen["error"]
    assert seen["mallory"] in seen["quarantined"], (attacks[:10], seen)
    assert ("partial_group" in seen["rejected"]) and "group_overflow" not in seen["rejected"], seen
    counts = seen["honest"].counts
    assert counts["pushed"] > 0 and counts["dropped"] == 0, counts
    assert time.monotonic() - started < 60
