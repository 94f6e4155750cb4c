"""The local provider end to end: `echo2 run` with scheduler.provider = "local" starts one EMULATED
worker, the scheduler starts more from the pool file as it measures the learner, and every
process it started is stopped when the run ends."""

from __future__ import annotations

from support import TINY

from echo2.cli import main


def test_the_scheduler_starts_workers_from_the_pool(tmp_path, monkeypatch):
    pool = tmp_path / "pool.toml"
    pool.write_text(
        '[[workers]]\nname = "cheap"\ncount = 2\nthroughput = 30.0\nprice = 0.2\n'
        '[[workers]]\nname = "dear"\ncount = 1\nthroughput = 30.0\nprice = 1.0\n'
    )
    started = []
    import echo2.rollout.local_fleet as lf

    real_start = lf.LocalFleet._start

    def spy(self, name):
        started.append(name)
        real_start(self, name)

    monkeypatch.setattr(lf.LocalFleet, "_start", spy)
    run_dir = tmp_path / "run"
    args = ["run", TINY, f"--run.dir={run_dir}", "--learner.steps=25", "--run.eval_size=0", "-q"]
    args += ["--learner.staleness=1", "--coordinator.heartbeat_interval=0.3"]
    args += ["--coordinator.heartbeat_timeout=5", "--scheduler.enabled=true", "--scheduler.provider=local"]
    args += [f"--scheduler.pool={pool}", "--scheduler.emulate=true", "--scheduler.sustain_s=0.5"]
    assert main(args) == 0
    import json

    summary = json.loads((run_dir / "summary.json").read_text())
    assert started[0] == "cheap-0", "the run starts with the lowest price per unit throughput"
    activated = [d["worker"] for d in summary["scheduler_decisions"] if d["action"] == "activate"]
    assert activated and started[1:] == activated, "each activation started one worker process"
    assert activated[0] == "cheap-1", "the cheapest standby first"
    assert summary["steps"] == 25


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
