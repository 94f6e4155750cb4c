"""A learner SIGKILLed mid-run and resumed, with its workers left running (tiny model, toy task):
no accepted record is lost, none is trained twice, and the workers, who held versions the resumed
learner has not published, are back to producing admissible records within two heartbeat timeouts.

The audit trail is the run's own journal (RUN_DIR/accepted.jsonl, coordinator/journal.py): every batch
accepted, every set of records handed to the learner (the last `taken` line of each version is the
run's lineage after a resume) and every publication, with wall-clock times."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from support import TINY, free_port, read_journal, stop_processes

HERE = Path(__file__).parent
HEARTBEAT_TIMEOUT = 5.0


def wait_for(predicate, timeout: float, what: str, procs=()) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        for p in procs:
            assert p.poll() is None, f"{p.args[:4]} exited with {p.returncode} while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def test_learner_killed_and_resumed_loses_nothing_and_trains_nothing_twice(tmp_path):
    run_dir, port = tmp_path / "run", free_port()
    env = {**os.environ, "PYTHONPATH": str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    learner_cmd = [sys.executable, "-m", "echo2.cli", "learner"]
    overrides = [
        "--task.type=custom",
        "--task.factory=toy_task:Vowels",
        "--learner.steps=10",
        "--learner.staleness=2",
        "--run.checkpoint_every=3",
        "--run.eval_size=0",
        "--run.threads=1",
        f"--run.dir={run_dir}",
        f"--coordinator.port={port}",
        "--coordinator.token=tok",
        "--coordinator.groups_per_lease=1",
        "--coordinator.heartbeat_interval=0.5",
        f"--coordinator.heartbeat_timeout={HEARTBEAT_TIMEOUT}",
    ]
    url = f"http://127.0.0.1:{port}"
    worker_cmd = [sys.executable, "-m", "echo2.cli", "worker", "--coordinator", url, "--token", "tok"]
    procs: list[subprocess.Popen] = []

    def start(cmd: list[str], log: str) -> subprocess.Popen:
        out = (tmp_path / log).open("w")
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        procs.append(proc)
        return proc

    try:
        learner = start([*learner_cmd, TINY, *overrides, "-q"], "learner1.log")
        workers = [start([*worker_cmd, "--name", f"w{i}", "--threads", "1"], f"w{i}.log") for i in range(2)]
        # Kill once a checkpoint exists and the run has moved past it (records accepted since).
        wait_for(
            lambda: (run_dir / "checkpoint").is_dir() and steps_done(run_dir) >= 4,
            240,
            "a checkpoint and a step past it",
            [learner, *workers],
        )
        os.kill(learner.pid, signal.SIGKILL)
        learner.wait(timeout=30)

        resumed = start([*learner_cmd, "--resume", str(run_dir), "-q"], "learner2.log")
        assert resumed.wait(timeout=300) == 0, (tmp_path / "learner2.log").read_text()[-3000:]
    finally:
        stop_processes(procs)

    lines = read_journal(run_dir)
    starts = [i for i, e in enumerate(lines) if "start" in e]
    assert len(starts) == 2, "two learner epochs"
    accepted = [r["record_id"] for e in lines if "accepted" in e for r in e["accepted"]]
    assert len(accepted) == len(set(accepted)), "no record accepted twice"
    lineage: dict[int, list[str]] = {}
    for e in lines:
        if "taken" in e:
            lineage[e["version"]] = e[
                "taken"
            ]  # the resumed run's take of a version replaces the killed one's
    trained = [rid for ids in lineage.values() for rid in ids]
    assert sorted(lineage) == list(range(10))
    assert len(trained) == len(set(trained)), "no record trained twice"
    assert set(trained) <= set(accepted)

    state = json.loads((run_dir / "checkpoint" / "state.json").read_text())
    source = state["source"]
    left = [r["record_id"] for group in source["buffer"]["groups"] for r in group]
    left += [r["record_id"] for r in source.get("held", [])]
    stale = source["buffer"]["rejected"].get("stale", 0)
    lost = set(accepted) - set(trained) - set(left)
    assert len(lost) == stale, (
        f"{len(lost)} accepted records neither trained nor kept ({stale} evicted stale)"
    )
    assert state["step"] == 10

    # Back to admissible records within two heartbeat timeouts of the resumed learner's first publication.
    second = lines[starts[1] :]
    published = next(e["t"] for e in second if "published" in e)
    first_accepted = next(e["t"] for e in second if "accepted" in e and e["t"] >= published)
    assert first_accepted - published <= 2 * HEARTBEAT_TIMEOUT, first_accepted - published
    # Workers held versions newer than the resumed learner published, and recovered from it.
    resumed_at = next(e["published"] for e in second if "published" in e)
    killed_at = max(e["published"] for e in lines[: starts[1]] if "published" in e)
    assert killed_at > resumed_at, "the kill left workers ahead of the checkpoint"
    log = "".join((tmp_path / f"w{i}.log").read_text() for i in range(2))
    assert "the learner restarted" in log
    assert len(Counter(e["epoch"] for e in lines if "published" in e)) == 2


@pytest.mark.parametrize("flag", ["--learner-key=xyz"])
def test_worker_flags_are_checked(flag, capsys):
    from echo2.cli import main

    assert main(["worker", "--coordinator", "http://127.0.0.1:1", "--token", "t", flag]) == 2
    assert "--learner-key" in capsys.readouterr().err
