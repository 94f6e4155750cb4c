"""Issue 22, case 2 (Done when): a real learner SIGKILLed after an acknowledged push, with the
surrogate case, loses 0 records.

A learner process (tiny model, the e2e toy task, its journal in RUN_DIR) serves a hostile worker
that speaks the protocol itself. After a first step (so a checkpoint exists) the worker pushes a
batch whose record metadata carries a lone surrogate sent raw in the JSON ("\\ud800"), which must
be refused with a 4xx and never journalled, then an honest batch, which is acknowledged (200). The
learner is SIGKILLed (by the pid this test started) before it can train on that batch, resumed with
`--resume`, and the acknowledged records must come back: the resumed learner trains on them (its
`taken` line), with nothing of the surrogate batch anywhere in the journal.

At 97ea5ef the door let the surrogate through: the records were stored, the journal line failed to
encode (a lone surrogate cannot be written as UTF-8) and the push answered 500, not a 4xx; its
retry was answered 200 as duplicates, and records held only in memory were gone after SIGKILL and
resume (docs/security.md, issue 22 case 2). Here the surrogate push must be a 4xx and stored
nowhere, and the acknowledged batch must survive the kill."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hostile import TOKEN, HostileWorker
from support import TINY, free_port, read_journal, stop_processes

E2E = Path(__file__).parents[1] / "e2e"


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, (
            f"the learner exited ({proc.returncode}) waiting for {what}: " + (log.read_text()[-3000:])
        )
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def up(url: str) -> bool:
    try:
        HostileWorker(url, name="probe")
        return True
    except Exception:
        return False


class Producer:
    """Honest records for leased prompts, as a worker makes them: the run's tiny model (same
    seed), tokenizer and toy task, sampled by the HF engine."""

    def __init__(self) -> None:
        sys.path.insert(0, str(E2E))  # toy_task
        from echo2.config import load_config
        from echo2.data.tasks import make_task
        from echo2.models import load_model, load_tokenizer
        from echo2.rollout.engine import HFEngine

        config = load_config(TINY, {"task.type": "custom", "task.factory": "toy_task:Vowels"})
        self.task = make_task(config.task, seed=config.run.seed)
        tokenizer = load_tokenizer(config.model)
        model = load_model(config.model, vocab_size=len(tokenizer), seed=config.run.seed)
        self.engine = HFEngine(model, tokenizer, config.rollout)
        self.group_size = config.rollout.group_size

    def records(self, lease: dict, version: int) -> list[dict]:
        from echo2.rollout.collect import collect

        self.engine.version = version
        prompts = [self.task.train_prompt(i) for i in lease["indices"]]
        groups = collect(
            self.engine, self.task, prompts, n=self.group_size, sampling_seed=lease.get("sampling_seed")
        )
        return [json.loads(json.dumps(r.to_dict())) for g in groups for r in g]


def lease_and_push(worker: HostileWorker, producer: Producer, version: int, groups: int = 1):
    deadline = time.monotonic() + 60
    status, lease = worker.lease(version=version, max_groups=groups)
    while status == 204 and time.monotonic() < deadline:  # no work yet: asked again, as a worker does
        time.sleep(0.2)
        status, lease = worker.lease(version=version, max_groups=groups)
    assert status == 200, lease
    records = producer.records(lease, version)
    return lease, records


def test_sigkill_after_an_acknowledged_push_with_the_surrogate_case_loses_nothing(tmp_path):
    run_dir, port = tmp_path / "run", free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(E2E) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    learner_cmd = [sys.executable, "-m", "echo2.cli", "learner"]
    overrides = [
        "--task.type=custom",
        "--task.factory=toy_task:Vowels",
        "--learner.steps=2",
        "--run.checkpoint_every=1",
        "--run.eval_size=0",
        "--run.threads=1",
        f"--run.dir={run_dir}",
        f"--coordinator.port={port}",
        f"--coordinator.token={TOKEN}",
        "--coordinator.heartbeat_interval=0.5",
        "--coordinator.heartbeat_timeout=30",
    ]
    producer = Producer()
    procs: list[subprocess.Popen] = []

    def start(cmd: list[str], log: Path) -> subprocess.Popen:
        proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
        procs.append(proc)
        return proc

    log1, log2 = tmp_path / "learner1.log", tmp_path / "learner2.log"
    try:
        learner = start([*learner_cmd, TINY, *overrides, "-q"], log1)
        wait_for(lambda: up(url), 120, "the coordinator", learner, log1)
        mallory = HostileWorker(url)
        # step 1 (2 groups), then its checkpoint: what a resume starts from
        for _ in range(2):
            lease, records = lease_and_push(mallory, producer, version=0)
            status, body = mallory.push(lease["lease_id"], records)
            assert status == 200 and body["accepted"] == len(records), body
        wait_for(
            lambda: (
                (run_dir / "checkpoint" / "state.json").is_file()
                and any("published" in e and e["published"] >= 1 for e in read_journal(run_dir))
            ),
            120,
            "step 1's checkpoint and version 1",
            learner,
            log1,
        )
        time.sleep(1.0)  # the checkpoint's swap is done before the kill

        # the surrogate batch: refused at the door, nothing stored
        lease, forged = lease_and_push(mallory, producer, version=1)
        forged[0]["metadata"]["note"] = "\ud800"
        raw = json.dumps({"worker_id": mallory.worker_id, "lease_id": lease["lease_id"], "records": forged})
        assert "\\ud800" in raw  # a lone surrogate, escaped in the JSON text as a worker may send it
        status, body = mallory.call("POST", "/v1/trajectories", raw=raw.encode())
        assert 400 <= status < 500, (status, body)
        forged_ids = {r["record_id"] for r in forged}

        # an honest batch, acknowledged
        lease, records = lease_and_push(mallory, producer, version=1)
        status, body = mallory.push(lease["lease_id"], records)
        assert status == 200 and body == {"accepted": len(records), "duplicates": 0}, body
        acknowledged = {r["record_id"] for r in records}

        os.kill(learner.pid, signal.SIGKILL)  # one group short of step 2: not trained yet
        learner.wait(timeout=30)
        assert learner.returncode == -signal.SIGKILL

        resumed = start([*learner_cmd, "--resume", str(run_dir), "-q"], log2)
        wait_for(lambda: up(url), 120, "the resumed coordinator", resumed, log2)
        mallory = HostileWorker(url, name="mallory2")
        # one more honest group completes step 2 with the replayed one
        lease, records = lease_and_push(mallory, producer, version=1)
        status, body = mallory.push(lease["lease_id"], records)
        assert status == 200, body
        assert resumed.wait(timeout=120) == 0, log2.read_text()[-3000:]
    finally:
        stop_processes(procs)

    lines = read_journal(run_dir)
    starts = [i for i, e in enumerate(lines) if "start" in e]
    assert len(starts) == 2, "two learner epochs"
    before_kill = {rid for e in lines[: starts[1]] if "taken" in e for rid in e["taken"]}
    assert not acknowledged & before_kill, "killed before training it: only the journal holds it"
    in_journal = {r["record_id"] for e in lines[: starts[1]] if "accepted" in e for r in e["accepted"]}
    assert acknowledged <= in_journal, "journalled before it was acknowledged"
    accepted = {r["record_id"] for e in lines if "accepted" in e for r in e["accepted"]}
    assert not forged_ids & accepted, "the surrogate batch was never stored"
    assert "\\ud800" not in (run_dir / "accepted.jsonl").read_text()
    taken: dict[int, list[str]] = {}
    for e in lines:
        if "taken" in e:
            taken[e["version"]] = e["taken"]  # the resumed run's take replaces the killed one's
    trained = {rid for ids in taken.values() for rid in ids}
    lost = acknowledged - trained
    assert not lost, f"{len(lost)} acknowledged records lost after SIGKILL and resume"
