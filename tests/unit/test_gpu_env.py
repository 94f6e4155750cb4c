"""The start-up CUDA diagnosis (echo2.gpu_env): each reason from probed facts, the refusal policy
for cuda/auto/cpu, and the hook in resolve_device that turns it into exit 2 naming learner.device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from echo2 import gpu_env
from echo2.cli import main
from echo2.config import ConfigError, LearnerConfig
from echo2.gpu_env import Facts, diagnose_facts, refusal, required_driver
from echo2.learning.device import resolve_device

TINY = str(Path(__file__).parents[2] / "configs" / "tiny.toml")
H200 = ("NVIDIA H200",)
CU13 = dict(torch_version="2.13.0", torch_cuda="13.0", cuda_available=False)  # PyPI's torch 2.13.0


def test_usable_cuda_has_no_reason():
    assert diagnose_facts(Facts(**{**CU13, "cuda_available": True})) is None


def test_cpu_build_of_torch_beside_a_gpu():
    reason = diagnose_facts(
        Facts(torch_version="2.13.0+cpu", torch_cuda=None, cuda_available=False, gpus=H200)
    )
    assert "CPU build" in reason and "torch.version.cuda is None" in reason and "NVIDIA H200" in reason
    assert "scripts/setup.sh gpu" in reason and "\n" not in reason


@pytest.mark.parametrize(
    "cuda, driver, too_old",
    [
        ("13.0", "575.57.08", True),  # PyPI's torch 2.13.0 (CUDA 13) on a 575 driver
        ("13.0", "580.65.06", False),
        ("12.9", "570.133.20", True),
        ("12.9", "575.51.03", False),
        ("12.8", "565.57.01", True),
        ("12.8", "570.26", False),
        ("12.6", "520.61.05", True),  # below the CUDA 12.x floor
        ("12.6", "535.230.02", False),  # 12.6 is not in the toolkit table: the 12.x floor (525)
    ],
)
def test_driver_too_old_for_this_torch(cuda, driver, too_old):
    facts = Facts(torch_version="2.13.0", torch_cuda=cuda, cuda_available=False, gpus=H200, driver=driver)
    reason = diagnose_facts(facts)
    assert ("is older than" in reason) == too_old, reason
    if too_old:
        assert f"driver {driver}" in reason and f"CUDA {cuda}" in reason and "cu129" in reason


def test_required_driver_follows_nvidia_table():
    assert [required_driver(v) for v in ("13.0", "12.9", "12.8", "12.4", "13.2", "11.8")] == [
        580, 575, 570, 525, 580, None,
    ]  # fmt: skip


@pytest.mark.parametrize("visible", ["", " ", "-1", "3", "-1,0"])
def test_cuda_visible_devices_hiding_every_gpu(visible):
    facts = Facts(**CU13, gpus=("A", "B"), driver="580.65.06", visible_devices=visible)
    assert diagnose_facts(facts).startswith(f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU")


@pytest.mark.parametrize("visible", ["0", "1,0", "GPU-8f6c", "MIG-1234"])
def test_cuda_visible_devices_that_show_a_gpu_is_not_the_reason(visible):
    facts = Facts(**CU13, gpus=("A", "B"), driver="580.65.06", visible_devices=visible, cuda_error="boom")
    reason = diagnose_facts(facts)
    assert "CUDA_VISIBLE_DEVICES" not in reason and reason.endswith(": boom")


def test_no_gpu_at_all():
    assert diagnose_facts(Facts(**CU13)) == "no NVIDIA GPU found (nvidia-smi is not installed or failed)"
    assert diagnose_facts(Facts(**CU13, gpus=())) == "no NVIDIA GPU found (nvidia-smi lists none)"


def test_refusal_policy_for_cuda_auto_and_cpu():
    cpu_only = Facts(torch_version="2.13.0+cpu", torch_cuda=None, cuda_available=False)
    gpu_unusable = Facts(**CU13, gpus=H200, driver="550.54.15")
    assert refusal(cpu_only, "cpu") is None and refusal(gpu_unusable, "cpu") is None
    assert refusal(cpu_only, "auto") is None, "a machine without a GPU still trains on its CPU"
    assert refusal(gpu_unusable, "auto").startswith("auto requested, but NVIDIA driver 550.54.15 is older")
    assert refusal(cpu_only, "cuda").startswith("cuda requested, but no NVIDIA GPU found")
    assert refusal(Facts(**{**CU13, "cuda_available": True}, gpus=H200), "cuda") is None


def fake_machine(monkeypatch, facts: Facts) -> None:
    monkeypatch.setattr(gpu_env, "probe", lambda: facts)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: facts.cuda_available)


def test_resolve_device_refuses_auto_beside_an_unusable_gpu(monkeypatch):
    """The old resolve_device quietly returned the CPU here: the GPU-box user trained on the CPU."""
    fake_machine(monkeypatch, Facts(**CU13, gpus=H200, driver="570.86.15"))
    with pytest.raises(ConfigError, match=r"^learner\.device: auto requested, but NVIDIA driver 570\.86\.15"):
        resolve_device(LearnerConfig(device="auto"))
    assert resolve_device(LearnerConfig(device="cpu")) == torch.device("cpu")


def test_resolve_device_keeps_auto_on_a_cpu_only_machine(monkeypatch):
    fake_machine(monkeypatch, Facts(torch_version="2.13.0+cpu", torch_cuda=None, cuda_available=False))
    assert resolve_device(LearnerConfig(device="auto")) == torch.device("cpu")


def test_cli_exits_2_with_the_one_line_reason(monkeypatch, tmp_path, capsys):
    fake_machine(
        monkeypatch, Facts(torch_version="2.13.0+cpu", torch_cuda=None, cuda_available=False, gpus=H200)
    )
    run_dir = tmp_path / "run"
    assert main(["run", TINY, f"--run.dir={run_dir}", "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "echo2: config error: learner.device: auto requested, but torch 2.13.0+cpu is a CPU build"
    )
    assert len(err.splitlines()) == 1 and not run_dir.exists()


def test_probe_reads_nvidia_smi(monkeypatch, tmp_path):
    """The probe's parsing of `nvidia-smi --query-gpu=name,driver_version --format=csv,noheader`."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf 'NVIDIA H200, 550.54.15\\nNVIDIA H200, 550.54.15\\n'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(
        torch.cuda, "init", lambda: (_ for _ in ()).throw(RuntimeError("driver too old\nmore"))
    )
    facts = gpu_env.probe()
    assert facts.gpus == ("NVIDIA H200", "NVIDIA H200") and facts.driver == "550.54.15"
    assert facts.visible_devices == "1" and facts.torch_version == torch.__version__
    if torch.version.cuda is not None:
        assert facts.cuda_error == "driver too old"


def test_probe_survives_a_failing_nvidia_smi(monkeypatch, tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_env.probe().gpus is None
