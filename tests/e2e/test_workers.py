"""Learner + worker processes on loopback, on the tiny model: parity with the in-process loop,
bounded staleness under overlap, and a worker killed mid-run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from support import TINY, run_with_fleet

from echo2.cli import main
from echo2.config import load_config
from echo2.fleet.providers.local import LocalFleet
from echo2.learning.loop import run
from echo2.learning.sources import SourceSpec
from echo2.metrics import read_metrics

HERE = Path(__file__).parent
TOY = ["--task.type=custom", "--task.factory=toy_task:Vowels"]


def remote_toy_config(*, steps: int, heartbeat_timeout: float):
    """The toy task over workers: S = 1, one group per lease, fast heartbeats."""
    return load_config(
        TINY,
        {
            "task.type": "custom",
            "task.factory": "toy_task:Vowels",
            "learner.steps": steps,
            "learner.staleness": 1,
            "run.eval_size": 0,
            "coordinator.heartbeat_interval": 0.5,
            "coordinator.heartbeat_timeout": heartbeat_timeout,
            "coordinator.groups_per_lease": 1,
        },
    )


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="bitwise parity across processes is a CPU property: on an H200 the worker's and the "
    "in-process engine's bf16 rewards matched in one run and parted at step 2 in the next",
)
def test_one_worker_with_s0_matches_the_in_process_loop(tmp_path, monkeypatch):
    """Same task, seeds and prompts: a worker process samples what the in-process loop samples."""
    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.setenv("PYTHONPATH", str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    common = [*TOY, "--learner.steps=4", "--learner.lr=1e-3", "--run.eval_size=0", "--run.threads=1", "-q"]
    # multinomial: both draw from torch's generator, seeded alike (under "gumbel" the in-process loop
    # keys its noise with a seed of its own, a worker with the coordinator's lease seed)
    common.append("--rollout.sampling=multinomial")
    # Both runs in fresh processes: an engine that pins torch's thread pool in this process (vLLM's
    # CPU worker does) must not make the two runs compute with different thread counts.
    for name, extra in (("local", []), ("remote", ["--workers=1"])):
        cmd = [
            sys.executable,
            "-m",
            "echo2.cli",
            "run",
            TINY,
            f"--run.dir={tmp_path / name}",
            *extra,
            *common,
        ]
        assert subprocess.run(cmd, timeout=600).returncode == 0
    local = read_metrics(tmp_path / "local" / "metrics.jsonl")
    remote = read_metrics(tmp_path / "remote" / "metrics.jsonl")
    assert [r["reward/mean"] for r in remote] == [r["reward/mean"] for r in local]
    for a, b in zip(local, remote, strict=True):
        assert abs(a["train/loss"] - b["train/loss"]) < 1e-5
    assert all(r["staleness/max"] == 0 for r in remote)


def test_overlap_with_staleness_bound(tmp_path, monkeypatch):
    """S = 2 with two workers: rollouts overlap training (some records are 1+ versions old) and no
    consumed record is older than S."""
    monkeypatch.setenv("PYTHONPATH", str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run_dir = tmp_path / "run"
    code = main(
        [
            "run",
            TINY,
            f"--run.dir={run_dir}",
            "--workers=2",
            *TOY,
            "--learner.staleness=2",
            "--learner.steps=8",
            "--coordinator.heartbeat_interval=0.2",
            "--run.eval_size=0",
            "-q",
        ]
    )
    assert code == 0
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert max(r["staleness/max"] for r in rows) <= 2
    summary = json.loads((run_dir / "summary.json").read_text())
    hist = {int(k): v for k, v in summary["staleness_histogram"].items()}
    assert sum(hist.values()) == 8 * 2 * 4 and max(hist) <= 2
    assert any(k >= 1 for k in hist), "workers generated while the learner trained"
    assert summary["t_train"] > 0 and 0 <= summary["bubble_ratio"] < 1
    assert summary["t_bcast"] is not None, "workers reported installed versions in heartbeats"


def test_a_worker_killed_mid_run(tmp_path, monkeypatch):
    """Kill one of three workers while it holds a lease: training completes, its lease is reissued, no record is stored
    twice, and /status shows it lost."""
    monkeypatch.setenv("PYTHONPATH", str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    config = remote_toy_config(steps=40, heartbeat_timeout=5.0)
    fleet = LocalFleet.identical(3, threads=2)
    seen: dict = {}

    def on_ready(source) -> None:
        fleet.start(source)
        seen["source"] = source

        def kill_when_busy() -> None:
            deadline = time.monotonic() + 120
            st = source.state
            while time.monotonic() < deadline:
                with st.shared.lock:
                    leased = [lease.worker_id for lease in st.intake.ingestion.leases.values()]
                    names = {w.worker_id: w.name for w in st.registry.workers.values()}
                holding = [w for w in leased if names.get(w) == "local-0"]
                if holding:  # it holds a lease right now
                    os.kill(fleet.pid("local-0"), signal.SIGKILL)
                    seen["killed"] = holding[0]
                    break
                time.sleep(0.05)
            while time.monotonic() < deadline:  # watch /status until the coordinator notices
                req = urllib.request.Request(
                    source.url + "/status", headers={"Authorization": f"Bearer {source.token}"}
                )
                with urllib.request.urlopen(req, timeout=5) as resp:
                    status = json.loads(resp.read())
                if any(
                    w["worker_id"] == seen.get("killed") and w["state"] == "lost" for w in status["workers"]
                ):
                    seen["status"] = status
                    return
                time.sleep(0.2)

        threading.Thread(target=kill_when_busy, daemon=True).start()

    try:
        summary = run(
            config,
            run_dir=tmp_path / "run",
            progress=False,
            source_spec=SourceSpec(remote=True, on_ready=on_ready),
        )
        survivors_alive = sorted(o.name for o in fleet.running())
    finally:
        fleet.stop()
    assert summary["steps"] == 40 and "killed" in seen
    assert "status" in seen, "GET /status reported the killed worker lost while the run went on"
    assert survivors_alive == ["local-1", "local-2"]
    st = seen["source"].state
    assert st.intake.ingestion.reissued >= 1, "the dead worker's lease went back to the queue"
    assert st.intake.ingestion.accepted == len(st.intake.buffer._seen), (
        "every accepted record was stored exactly once"
    )
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 40


def test_a_slow_emulated_pool_completes_its_steps_without_a_reissued_lease(tmp_path):
    """Two EMULATED workers at 2 trajectories/s, groups of 4, a step of 4 groups, a 4 s lease
    timeout: a whole-step lease (16 trajectories, 8 s) would outlive its timeout every time and its
    late push be dropped, so no step would ever complete; leases sized from the declared rate (one
    group, 2 s) finish well inside it, and no lease is reissued."""
    config = load_config(
        TINY,
        {
            "rollout.prompts_per_step": 4,
            "learner.steps": 3,
            "learner.staleness": 1,
            "run.eval_size": 0,
            "coordinator.lease_timeout": 4.0,
            "coordinator.heartbeat_interval": 0.5,
            "coordinator.wait_timeout": 180.0,  # the old whole-step leases: fail, not hang
            "rollout.sampling": "multinomial",  # emulated records: no model's noise drew them
        },
    )
    fleet = LocalFleet.identical(2, threads=1, emulate=2.0)
    seen: dict = {}

    def on_ready(source) -> None:
        fleet.start(source)
        seen["source"] = source

        def at_the_end() -> None:  # before close: leases returned by stopping workers do not count
            with source.state.shared.lock:
                seen["reissued"] = source.state.intake.ingestion.reissued
                seen["expired"] = source.state.intake.ingestion.expired
                seen["rejected"] = dict(source.state.intake.ingestion.rejected)

        source.before_close.append(at_the_end)

    summary = run_with_fleet(config, tmp_path / "run", fleet, on_ready)
    assert summary["steps"] == 3
    assert seen["reissued"] == 0 and seen["expired"] == 0, seen
    assert seen["rejected"] == {}, "no push was dropped"
    sizes = {len(lease.indices) for lease in seen["source"].state.intake.ingestion.leases.values()}
    assert sizes <= {1}


def test_connections_dropped_and_http_server_restarted(tmp_path, monkeypatch):
    """Stop the coordinator's HTTP server mid-run (every worker connection drops), bring it back on
    the same port: workers retry and carry on; every accepted record is consumed, buffered or
    evicted as stale, exactly once."""
    monkeypatch.setenv("PYTHONPATH", str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    config = remote_toy_config(steps=30, heartbeat_timeout=20.0)
    fleet = LocalFleet.identical(2, threads=2)
    seen: dict = {}

    def on_ready(source) -> None:
        fleet.start(source)
        seen["source"] = source

        def outage() -> None:
            st, deadline = source.state, time.monotonic() + 120
            while st.intake.ingestion.accepted < 16 and time.monotonic() < deadline:
                time.sleep(0.05)
            host, port = source.url.removeprefix("http://").split(":")
            source.coordinator.stop()
            seen["accepted_before"] = st.intake.ingestion.accepted
            time.sleep(2.0)
            seen["accepted_during"] = st.intake.ingestion.accepted
            source.coordinator.start(host, int(port))
            seen["restarted"] = True

        threading.Thread(target=outage, daemon=True).start()

    summary = run_with_fleet(config, tmp_path / "run", fleet, on_ready)
    assert seen.get("restarted") and summary["steps"] == 30
    assert seen["accepted_during"] == seen["accepted_before"], "nothing arrives while the server is down"
    st = seen["source"].state
    assert st.intake.ingestion.accepted > seen["accepted_before"], "workers carried on after the restart"
    consumed = 30 * config.rollout.prompts_per_step * config.rollout.group_size
    assert (
        st.intake.ingestion.accepted == consumed + len(st.intake.buffer) + st.intake.buffer.rejected["stale"]
    )
    assert st.intake.ingestion.accepted == len(st.intake.buffer._seen), "no record stored twice"


def test_worker_reregisters_when_the_learner_restarts(tmp_path):
    """`echo2 learner` is SIGKILLed after its first checkpoint and resumed on the same port: the
    running worker (which was never told the run is over) finds itself unknown, registers again and
    feeds the resumed run; when that run finishes, the worker hears `run_finished` and exits 0."""

    env = {**os.environ, "PYTHONPATH": str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run_dir = tmp_path / "run"
    echo2 = [sys.executable, "-m", "echo2.cli"]
    learner = [
        *echo2,
        "learner",
        TINY,
        f"--run.dir={run_dir}",
        *TOY,
        "--learner.steps=8",
        "--run.eval_size=0",
        "--run.checkpoint_every=2",
        "--coordinator.port=0",
        "--coordinator.token=tok",
        "--learner.staleness=1",
        "--run.threads=1",
        "-q",
    ]
    worker_log = (tmp_path / "worker.log").open("w")
    first = subprocess.Popen(learner, env=env)
    url_file = run_dir / "coordinator.url"
    deadline = time.monotonic() + 120
    while not url_file.exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    url = url_file.read_text().strip()  # the port the OS gave the learner (no port probed and reused)
    port = url.rsplit(":", 1)[1]
    worker = subprocess.Popen(
        [
            *echo2,
            "worker",
            "--coordinator",
            url,
            "--token",
            "tok",
            "--threads",
            "1",
            "--give-up-after",
            "120",
        ],
        env=env,
        stderr=worker_log,
    )
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "checkpoint").is_dir():  # a crash after the first checkpoint
            assert first.poll() is None, "the first learner ended before its first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.1)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        assert worker.poll() is None, "a crashed learner tells nobody to stop: the worker keeps retrying"
        resumed = subprocess.run(
            [*echo2, "learner", "--resume", str(run_dir), f"--coordinator.port={port}", "-q"],
            env=env,
            timeout=300,
        )
        assert resumed.returncode == 0
        assert json.loads((run_dir / "summary.json").read_text())["steps"] == 8
        assert worker.wait(timeout=60) == 0, "the worker stops by itself once the resumed run is over"
    finally:
        for p in (first, worker):
            if p.poll() is None:
                p.kill()
                p.wait()
        worker_log.close()
    log = (tmp_path / "worker.log").read_text()
    assert "registering again" in log or "the learner restarted" in log
    assert "run_finished" in log and "Traceback" not in log


def test_sigterm_stops_the_run_and_its_workers(tmp_path):
    """`echo2 run --workers 2` killed with SIGTERM mid-run leaves no worker process behind."""

    env = {**os.environ, "PYTHONPATH": str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "echo2.cli",
            "run",
            TINY,
            "--workers=2",
            *TOY,
            "--learner.steps=100000",
            "--run.eval_size=0",
            f"--run.dir={tmp_path / 'run'}",
            "-q",
        ],
        env=env,
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        time.sleep(0.2)
    pgrep = ["pgrep", "-P", str(proc.pid)]
    children = subprocess.run(pgrep, capture_output=True, text=True).stdout.split()  # with the push parser
    workers = subprocess.run(
        [*pgrep, "-f", "echo2.cli worker"], capture_output=True, text=True
    ).stdout.split()
    assert len(workers) == 2, "two worker processes while training"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    for pid in children:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


@pytest.mark.parametrize("flag", ["--emulate", "--throughput"])
@pytest.mark.parametrize("rate", ["-1", "0"])
def test_worker_refuses_a_rate_that_is_not_positive(flag, rate, capsys):
    """`echo2 worker --emulate -1` (or 0, or the same `--throughput`) exits 2 with one line naming
    the flag, before it loads a model or calls the coordinator (port 9 has nothing listening)."""
    argv = ["worker", "--coordinator", "http://127.0.0.1:9", "--token", "t", flag, rate]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{flag}: must be > 0" in err


@pytest.mark.parametrize("flag", ["--relay-host", "--relay-advertise"])
def test_worker_refuses_a_relay_host_that_is_not_a_host(flag, capsys):
    """A relay host the coordinator would refuse exits 2 naming the flag, not with a traceback."""
    argv = ["worker", "--coordinator", "http://127.0.0.1:9", "--token", "t", "--inbound", flag, "bad host!"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{flag}: not a host name or address" in err
