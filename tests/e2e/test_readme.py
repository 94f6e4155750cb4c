"""The README's commands, in the order written, on the tiny model: each finishes with its
documented result. A README line listed here that is no longer in the README fails the test, so
the two cannot drift apart. Commands that need a GPU, vLLM or ten minutes are left out (listed in
SKIPPED with the reason); `configs/quickstart*.toml` becomes `configs/tiny.toml` and long runs
are cut to a few steps. All runs happen in one scratch directory, as a new user's would.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
README = (ROOT / "README.md").read_text()
ECHO2 = [sys.executable, "-m", "echo2.cli"]
TINY = str(ROOT / "configs" / "tiny.toml")
FAST = ["--run.eval_size=2", "--learner.steps=2"]

SKIPPED = {
    "bash scripts/quickstart.sh": "ten minutes of training; CI runs the same `echo2 run` on the tiny model",
    "bash scripts/test.sh": "it is what CI runs around this test",
    "--rollout.engine=vllm": "the vLLM engine has its own tests (tests/e2e/test_vllm_engine.py)",
    "torchrun": "needs GPUs (tests/e2e/test_readme_gpu.py dry-runs the README's GPU commands)",
}


def in_readme(line: str) -> None:
    squashed = re.sub(r"\s+", " ", README.replace("\\\n", " "))
    assert re.sub(r"\s+", " ", line) in squashed, f"the README no longer says: {line}"


def sh(args: list[str], cwd: Path, *, env: dict | None = None, timeout: float = 300, code: int = 0) -> str:
    out = subprocess.run(
        args,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src"), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == code, (
        f"{' '.join(args)} -> {out.returncode}\n{out.stdout[-1500:]}\n{out.stderr[-3000:]}"
    )
    return out.stdout + out.stderr


@pytest.fixture(scope="module")
def user(tmp_path_factory) -> Path:
    """A scratch directory holding the repository's configs and scripts, as a fresh clone would."""
    home = tmp_path_factory.mktemp("readme")
    for folder in ("configs", "scripts", "scenarios"):
        shutil.copytree(ROOT / folder, home / folder)
    return home


def test_using_it(user):
    in_readme("echo2 run configs/quickstart.toml --dry-run")
    out = sh([*ECHO2, "run", TINY, "--dry-run"], user)
    assert "[model]" in out and 'type = "tiny"' in out and not (user / "runs").exists()

    in_readme("echo2 run configs/quickstart.toml --run.seed=1 --learner.lr=5e-6")
    out = sh([*ECHO2, "run", TINY, "--run.seed=1", "--learner.lr=5e-6", *FAST, "-q"], user)
    assert "held-out accuracy" in out and "runs/tiny-seed1" in out

    in_readme("echo2 run --resume runs/quickstart-seed1 --learner.steps=80")
    sh([*ECHO2, "run", "--resume", "runs/tiny-seed1", "--learner.steps=4", "-q"], user)
    assert len((user / "runs/tiny-seed1/metrics.jsonl").read_text().splitlines()) == 4
    for name in ("config.toml", "metrics.jsonl", "summary.json", "samples.jsonl", "checkpoint/config.json"):
        assert (user / "runs/tiny-seed1" / name).exists(), name

    in_readme("$ echo2 run configs/quickstart.toml --learner.staleness=-1")
    expected = "echo2: config error: learner.staleness: Input should be greater than or equal to 0 (got -1)"
    in_readme(expected)
    out = sh([*ECHO2, "run", TINY, "--learner.staleness=-1"], user, code=2)
    assert out.strip() == expected


def test_plot_and_export(user):
    in_readme(
        "python scripts/plot_runs.py runs/quickstart-seed0 runs/quickstart-seed1 runs/quickstart-seed2 --out runs/quickstart_reward.png"
    )
    for seed in (0, 2):
        sh([*ECHO2, "run", TINY, f"--run.seed={seed}", *FAST, "-q"], user)
    runs = [f"runs/tiny-seed{s}" for s in (0, 1, 2)]
    sh([sys.executable, "scripts/plot_runs.py", *runs, "--out", "runs/quickstart_reward.png"], user)
    assert (user / "runs/quickstart_reward.png").stat().st_size > 10_000

    in_readme("echo2 export runs/quickstart-seed0 runs/quickstart-seed0-hf")
    sh([*ECHO2, "export", "runs/tiny-seed0", "runs/tiny-seed0-hf"], user)
    assert (user / "runs/tiny-seed0-hf/config.json").is_file()


def test_with_rollout_workers(user):
    in_readme("echo2 run configs/quickstart.toml --workers 2 --learner.staleness=2")
    out = sh([*ECHO2, "run", TINY, "--workers", "2", "--learner.staleness=2", *FAST, "-q"], user)
    assert "runs/tiny-seed0-2" in out, "a fresh run directory, not a collision with the earlier run"
    token_file = user / "runs/tiny-seed0-2/coordinator.token"
    assert "token: in runs/tiny-seed0-2/coordinator.token" in out and token_file.is_file()

    learner = "ECHO2_TOKEN=change-me echo2 learner configs/quickstart.toml --coordinator.host=0.0.0.0 --coordinator.port=8765 --learner.staleness=2"
    worker = "ECHO2_TOKEN=change-me echo2 worker --coordinator http://LEARNER_HOST:8765 --name gpu-box-1 --price-per-hour 0.25 --inbound"
    in_readme(learner)
    in_readme(worker)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "ECHO2_TOKEN": "change-me"}
    args = ["learner", TINY, "--coordinator.host=127.0.0.1", f"--coordinator.port={port}"]
    lp = subprocess.Popen([*ECHO2, *args, "--learner.staleness=2", *FAST, "-q"], cwd=user, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    wp = None
    try:
        first = lp.stdout.readline()  # printed once the coordinator listens ("" if the learner died)
        assert first.startswith(f"coordinator: http://127.0.0.1:{port}"), first + lp.stderr.read()[-3000:]
        assert "change-me" not in first and "token: from $ECHO2_TOKEN" in first
        wargs = ["worker", "--coordinator", f"http://127.0.0.1:{port}", "--name", "gpu-box-1"]
        wp = subprocess.Popen([*ECHO2, *wargs, "--price-per-hour", "0.25", "--inbound", "-q"], cwd=user, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        lout, lerr = lp.communicate(timeout=300)
        assert lp.returncode == 0, lerr[-3000:]
        assert "held-out accuracy" in lout
        _, werr = wp.communicate(timeout=60)
        assert wp.returncode == 0, werr[-3000:]
    finally:
        for p in (lp, wp):
            if p is not None and p.poll() is None:
                p.kill()


def test_engines_lora_evaluation(user):
    in_readme("echo2 run configs/quickstart.toml --run.eval_every=5")
    sh([*ECHO2, "run", TINY, "--run.eval_every=1", *FAST, "--run.dir=runs/eval", "-q"], user)
    assert '"eval/accuracy"' in (user / "runs/eval/metrics.jsonl").read_text()
    in_readme("echo2 run configs/quickstart_lora.toml")
    sh([*ECHO2, "run", TINY, "--learner.lora.rank=8", *FAST, "--run.dir=runs/lora", "-q"], user)
    assert (user / "runs/lora/hf/config.json").is_file(), "the merged model"


def test_tracking_and_status_page_lines(user):
    in_readme("echo2 run configs/quickstart.toml --run.report_to='[\"tensorboard\"]'")
    sh([*ECHO2, "run", TINY, '--run.report_to=["tensorboard"]', *FAST, "--run.dir=runs/tb", "-q"], user)
    assert list((user / "runs/tb/tensorboard").glob("events.out.tfevents.*"))


def test_capacity_planning(user):
    plan = "echo2 plan --t-train 1631 --t-bcast 1437 --batch 2048 --staleness 3 --learner-price 12.24 --pool scenarios/plan/paper-rtx5090.toml"
    in_readme(plan)
    out = sh([*ECHO2, *plan.split()[1:]], user)
    assert "required throughput mu_min" in out


def test_the_scheduler_example_completes_its_steps(user):
    example = (
        "echo2 run configs/tiny.toml --scheduler.enabled=true --scheduler.provider=local "
        "--scheduler.pool=configs/pool-emulated.toml --scheduler.emulate=true --scheduler.sustain_s=5"
    )
    in_readme(example)
    try:
        out = sh([*ECHO2, *example.split()[1:], "--run.dir=runs/scheduler", "-q"], user, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("the scheduler example did not finish in 240 s")
    assert "held-out accuracy" in out
    assert len((user / "runs/scheduler/metrics.jsonl").read_text().splitlines()) == 3
