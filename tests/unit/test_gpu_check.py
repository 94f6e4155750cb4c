"""scripts/gpu_check.sh on a CPU: every section runs after a failure or a timeout, and the summary
is valid JSON naming each section's status, seconds, exit code and log (a fake interpreter plays
the sections; the environment section also runs for real, with this venv's python)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
SECTIONS = [
    "environment",
    "learner",
    "vllm_engine",
    "vllm_gpu",
    "colocated",
    "fsdp_nccl",
    "run_hf",
    "run_vllm",
]

# pytest's output as the script gets it: pyproject's -q and the script's make -qq, which prints no
# final "N passed" line, only the -rA short summary (PASSED / SKIPPED / FAILED per test)
FAKE_PYTHON = r"""#!/usr/bin/env bash
echo "python $*" >> "$FAKE_LOG"
case " $* " in
  *" tests/gpu/test_gpu_vllm.py"*) echo "F"; echo "FAILED tests/gpu/test_gpu_vllm.py::test_a"; exit 1 ;;
  *" tests/gpu/test_gpu_fsdp.py"*) echo "s [100%]"; echo "SKIPPED [1] FSDP2 over NCCL needs 2 GPUs"; exit 0 ;;
  *" tests/gpu/test_gpu_colocated.py"*) echo "s. [100%]"; echo "PASSED tests/gpu/test_gpu_colocated.py::test_b"
    echo "SKIPPED [1] tests/gpu/test_gpu_colocated.py:9: no vllm"; exit 0 ;;
  *" -m pytest "*) echo "... [100%]"; echo "PASSED tests/gpu/test_x.py::test_a"; exit 0 ;;
  *"--rollout.engine=vllm"*) sleep 30 ;;
  *" -m echo2.cli run "*) exit 0 ;;
  *" - "*) cat > /dev/null; echo "[{'reward/mean': 0.5}]" ;;
  *) echo 'diagnose: CUDA usable "quoted" \ back' ;;
esac
"""


def gpu_check(tmp_path: Path, env: dict) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=240,
    )
    summary = json.loads((out / "summary.json").read_text())
    assert json.loads(done.stdout[done.stdout.index("{\n") :]) == summary, "the summary is printed too"
    return done, summary


def test_every_section_runs_after_a_failure_and_a_timeout(tmp_path):
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name, text in {
        "python": FAKE_PYTHON,
        "nvidia-smi": "#!/bin/sh\necho 'NVIDIA H200, 143771 MiB, 580.65.06'\n",
    }.items():
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(0o755)
    env = {
        "ECHO2_PYTHON": str(bin_ / "python"),
        "PATH": f"{bin_}:{os.environ['PATH']}",
        "FAKE_LOG": str(tmp_path / "log"),
        "GPU_CHECK_MAX_BUDGET": "3",
    }
    done, summary = gpu_check(tmp_path, env)
    assert done.returncode == 1
    got = {s["name"]: s for s in summary["sections"]}
    assert list(got) == SECTIONS, "every section, in order, after vllm_gpu failed"
    assert {n: s["status"] for n, s in got.items()} == {
        **dict.fromkeys(SECTIONS, "pass"), "vllm_gpu": "fail", "fsdp_nccl": "skip", "run_vllm": "timeout"
    }  # fmt: skip
    assert summary["failed"] == 2 and summary["python"] == env["ECHO2_PYTHON"]
    assert (
        got["vllm_gpu"]["exit_code"] == 1
        and got["vllm_gpu"]["last_line"] == "FAILED tests/gpu/test_gpu_vllm.py::test_a"
    )
    assert got["run_vllm"]["exit_code"] == 124 and 2.5 < got["run_vllm"]["seconds"] < 20
    assert got["environment"]["last_line"] == 'diagnose: CUDA usable "quoted" \\ back'
    assert all(Path(s["log"]).is_file() and s["seconds"] >= 0 for s in summary["sections"])
    calls = (tmp_path / "log").read_text()
    assert (
        "-m pytest -p no:cacheprovider -q -rA -m gpu tests/unit/test_device.py tests/gpu/test_gpu_learner.py"
        in calls
    )
    assert (
        "-m echo2.cli run configs/tiny.toml --learner.steps=2 --learner.device=cuda --learner.dtype=bf16"
        in calls
    )


def test_environment_section_with_this_venv_on_a_cpu(tmp_path):
    """Only the sections asked for; the real interpreter named explicitly; the diagnosis recorded."""
    env = {"ECHO2_PYTHON": sys.executable, "GPU_CHECK_SECTIONS": "environment", "PATH": "/usr/bin:/bin"}
    done, summary = gpu_check(tmp_path, env)
    [section] = summary["sections"]
    assert section["name"] == "environment" and section["exit_code"] in (0, 1)
    if section["exit_code"] == 1:  # no usable GPU here: the one-line reason is the section's last line
        assert section["status"] == "fail" and section["last_line"].startswith(
            "diagnose: no NVIDIA GPU found"
        )
        assert done.returncode == 1
