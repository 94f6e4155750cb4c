from __future__ import annotations

from echo2.config import ArithmeticTaskConfig
from echo2.data.tasks import make_task
from echo2.records import Snapshot
from echo2.rollout.collect import collect
from echo2.rollout.emulated import EmulatedEngine


def test_emulated_engine_paces_to_its_rate_and_makes_valid_records(tiny):
    _, tok = tiny
    slept = []
    engine = EmulatedEngine(tok, rate=4.0, sleep=slept.append)
    engine.install(Snapshot(version=3, state={}))
    task = make_task(ArithmeticTaskConfig(), seed=0)
    groups = collect(engine, task, [task.train_prompt(i) for i in range(2)], n=4)
    assert len(slept) == 1 and 1.5 < slept[0] <= 2.0  # 8 trajectories at 4/s take 2 s
    records = [r for g in groups for r in g]
    assert len(records) == 8 and all(r.version == 3 and len(r.response_ids) == 4 for r in records)
    assert all(t < len(tok) for r in records for t in r.response_ids)
