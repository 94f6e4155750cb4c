"""The README's GPU commands (section "GPUs"), each read from the README itself and run with
`--dry-run` (or, for the memory plan, as written): the configs, flags and worker settings they
name must validate on any machine. The install commands are played with a fake pip in
tests/unit/test_install_routes.py; the GPU runs themselves are scripts/gpu_check.sh's."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
README = (ROOT / "README.md").read_text()
GPUS = README[README.index("### GPUs") : README.index("### Multi-turn environments")]


def commands(prefix: str) -> list[tuple[dict[str, str], list[str]]]:
    """The GPU section's code lines whose command (after any VAR=value) starts with `prefix`, as
    (env, argv); a comment after a command is dropped."""
    code = "\n".join(re.findall(r"```bash\n(.*?)```", GPUS, flags=re.S))
    found = []
    for line in code.splitlines():
        words = shlex.split(line, comments=True)
        env = {}
        while words and re.fullmatch(r"[A-Z0-9_]+=.*", words[0]):
            key, _, value = words.pop(0).partition("=")
            env[key] = value
        if " ".join(words).startswith(prefix):
            found.append((env, words))
    assert found, f"the README's GPU section no longer has a `{prefix}` command"
    return found


def command(prefix: str) -> tuple[dict[str, str], list[str]]:
    [found] = commands(prefix)
    return found


def echo2(args: list[str], env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "echo2.cli", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src"), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"{args} -> {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return done.stdout + done.stderr


def test_install_commands_are_the_tested_routes():
    """Played with a fake pip by tests/unit/test_install_routes.py (gpu route, and ECHO2_CUDA=cu129)."""
    found = commands("bash scripts/setup.sh gpu,test")
    assert [env for env, _ in found] == [{}, {"ECHO2_CUDA": "cu129"}]
    assert all(argv == ["bash", "scripts/setup.sh", "gpu,test"] for _, argv in found)


def test_memory_plan_command():
    env, argv = command("echo2 plan --memory")
    out = echo2(argv[1:], env)
    assert (
        "colocated (learner + vLLM on one H200)" in out
        and "DOES NOT FIT" not in out.split("as configured")[1]
    )


def test_one_gpu_command():
    env, argv = command("echo2 run configs/qwen3-4b-math.toml")
    assert argv == ["echo2", "run", "configs/qwen3-4b-math.toml"]
    out = echo2([*argv[1:], "--dry-run"], env)
    assert 'engine = "vllm"' in out and 'device = "cuda"' in out


def test_four_gpu_learner_under_torchrun():
    env, argv = command("torchrun --standalone --nproc-per-node 4")
    assert env == {"ECHO2_TOKEN": "change-me"}
    module = argv.index("-m")
    assert (
        argv[:module] == ["torchrun", "--standalone", "--nproc-per-node", "4"]
        and argv[module + 1] == "echo2.cli"
    )
    out = echo2([*argv[module + 2 :], "--dry-run"], env)  # what each rank parses
    assert 'host = "0.0.0.0"' in out and "port = 8765" in out and "qwen3-8b" in out.lower()


def test_worker_on_a_consumer_gpu():
    env, argv = command("echo2 worker --coordinator http://LEARNER_HOST:8765 --name rtx5090-0")
    assert (
        env["CUDA_VISIBLE_DEVICES"] == "0"
        and "--engine" in argv
        and argv[argv.index("--engine") + 1] == "vllm"
    )
    out = echo2([*argv[1:], "--dry-run"], env)
    assert "vllm" in out


@pytest.mark.parametrize("line", ["bash scripts/gpu_check.sh", "tests/e2e/test_readme_gpu.py"])
def test_the_section_points_at_its_checks(line):
    assert line in GPUS
