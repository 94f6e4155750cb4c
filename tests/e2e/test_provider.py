"""The local provider end to end: `echo2 run` with scheduler.provider = "local" starts one EMULATED
worker, the scheduler starts more from the pool file as it measures the learner, and every
process it started is stopped when the run ends."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from support import TINY

from echo2.cli import main


def test_the_scheduler_starts_workers_from_the_pool(tmp_path):
    """The run starts the cheapest offer, the scheduler activates the cheapest standby once it has
    measured the learner, each activation starts one worker process, and SIGTERM stops them all.
    The run is stopped when that has been seen (it is not sized to outlast anything)."""
    pool = tmp_path / "pool.toml"
    pool.write_text(
        '[[workers]]\nname = "cheap"\ncount = 2\nthroughput = 30.0\nprice = 0.2\n'
        '[[workers]]\nname = "dear"\ncount = 1\nthroughput = 30.0\nprice = 1.0\n'
    )
    run_dir = tmp_path / "run"
    args = ["run", TINY, f"--run.dir={run_dir}", "--learner.steps=100000", "--run.eval_size=0", "-q"]
    args += ["--learner.staleness=1", "--coordinator.heartbeat_interval=0.3", "--coordinator.token=tok"]
    args += ["--coordinator.heartbeat_timeout=5", "--scheduler.enabled=true", "--scheduler.provider=local"]
    args += [f"--scheduler.pool={pool}", "--scheduler.emulate=true", "--scheduler.sustain_s=0.5"]
    proc = subprocess.Popen([sys.executable, "-m", "echo2.cli", *args])
    try:
        status = wait_for_activation(run_dir, proc, timeout=240)
        pgrep = ["pgrep", "-P", str(proc.pid)]
        children = subprocess.run(
            pgrep, capture_output=True, text=True
        ).stdout.split()  # with the push parser
        workers = subprocess.run(
            [*pgrep, "-f", "echo2.cli worker"], capture_output=True, text=True
        ).stdout.split()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    activated = [d["worker"] for d in status["scheduler_decisions"] if d["action"] == "activate"]
    names = sorted(w["name"] for w in status["workers"])
    assert names[0] == "cheap-0", "the run starts with the lowest price per unit throughput"
    assert activated[0] == "cheap-1", "the cheapest standby first"
    assert names == sorted(["cheap-0", *activated]), "each activation started one worker process"
    assert len(workers) == len(names), "one process per started worker"
    for pid in children:
        assert subprocess.run(["kill", "-0", pid], capture_output=True).returncode != 0, (
            "stopped with the run"
        )


def wait_for_activation(run_dir: Path, proc: subprocess.Popen, *, timeout: float) -> dict:
    """/status once an activated worker has registered (polled; bounded in time)."""
    deadline = time.monotonic() + timeout
    url_file = run_dir / "coordinator.url"
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.3)
        if not url_file.exists():
            continue
        req = urllib.request.Request(
            url_file.read_text().strip() + "/status", headers={"Authorization": "Bearer tok"}
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            status = json.loads(resp.read())
        activated = {d["worker"] for d in status["scheduler_decisions"] if d["action"] == "activate"}
        if activated and activated <= {w["name"] for w in status["workers"]}:
            return status
    raise AssertionError(f"no activated worker registered within {timeout} s (exit code {proc.poll()})")


def test_provider_mistakes_exit_2(tmp_path, capsys):
    base = ["run", TINY, f"--run.dir={tmp_path / 'r'}", "--scheduler.enabled=true"]
    assert main([*base, "--scheduler.provider=local"]) == 2
    assert "scheduler.pool" in capsys.readouterr().err
    assert main([*base, "--scheduler.provider=local", f"--scheduler.pool={tmp_path / 'no.toml'}"]) == 2
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text('[[workers]]\nname = "x"\ncount = 1\nthroughput = 1.0\n')
    assert main([*base, "--scheduler.provider=local", f"--scheduler.pool={bad}"]) == 2
    err = capsys.readouterr().err
    assert "bad.toml" in err and "price" in err
    pool = tmp_path / "ok.toml"
    pool.write_text('[[workers]]\nname = "x"\ncount = 1\nthroughput = 1.0\nprice = 1.0\n')
    assert main([*base, "--scheduler.provider=local", f"--scheduler.pool={pool}", "--workers=2"]) == 2
    assert "--workers" in capsys.readouterr().err
