"""Why CUDA is not usable here, in one line: the start-up check behind `learner.device` and a
worker's engine device.

A plain `pip install vllm==0.32.0` brings torch 2.13.0 built for CUDA 13.0, which needs NVIDIA
driver 580 or newer; on an older driver torch sees no GPU, and `device = "auto"` would silently
train on the CPU. This module names the reason instead: torch is a CPU build while a GPU is present,
the driver is too old for this torch's CUDA, or every device is hidden (CUDA_VISIBLE_DEVICES).

`diagnose_facts` is a pure decision over probed `Facts` (testable on any machine); `probe` gathers
them (torch's build and `nvidia-smi`), `diagnose` is the two together, and `check_device` turns a
reason into a ConfigError naming the key. Knows nothing of learners, engines or configs beyond that.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess

from echo2.config import ConfigError

# The oldest NVIDIA Linux driver each CUDA build runs on. A CUDA major version runs on its family's
# floor only through minor-version compatibility (CUDA 12.x >= 525, 13.x >= 580: NVIDIA, "CUDA
# Compatibility", Table 1, docs.nvidia.com/deploy/cuda-compatibility/minor-version-compatibility.html);
# the toolkit's own driver is newer ("CUDA Toolkit and Corresponding Driver Versions" in the CUDA
# release notes: 12.8 GA >= 570.26, 12.9 GA >= 575.51.03, 13.0 GA >= 580.65.06). A torch build whose
# CUDA is listed here is held to the toolkit's own driver; any other to its family's floor.
DRIVER_FLOOR = {12: 525, 13: 580}
TOOLKIT_DRIVER = {(12, 8): 570, (12, 9): 575, (13, 0): 580}

SETUP_HINT = "docs/gpu.md"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Facts:
    """What `probe` found. `gpus`: the GPU names nvidia-smi lists (it ignores CUDA_VISIBLE_DEVICES);
    None when nvidia-smi is missing or fails. `cuda_error`: CUDA's own start-up error, when any."""

    torch_version: str
    torch_cuda: str | None  # torch.version.cuda: None for a CPU build
    cuda_available: bool  # torch.cuda.is_available()
    gpus: tuple[str, ...] | None = None
    driver: str | None = None  # nvidia-smi's driver_version, e.g. "575.57.08"
    visible_devices: str | None = None  # $CUDA_VISIBLE_DEVICES; None when unset
    cuda_error: str | None = None


def required_driver(torch_cuda: str) -> int | None:
    """The oldest driver (major number) for a torch built with CUDA `torch_cuda` ("12.9")."""
    major, _, minor = torch_cuda.partition(".")
    key = (int(major), int(minor.split(".")[0] or 0))
    return TOOLKIT_DRIVER.get(key, DRIVER_FLOOR.get(key[0]))


def _hides_every_gpu(visible: str, count: int) -> bool:
    """CUDA_VISIBLE_DEVICES stops at its first invalid entry, so an empty value, or a first entry
    that is an index outside 0..count-1 (such as -1), hides every device (CUDA C Programming Guide,
    "CUDA Environment Variables"). UUIDs (GPU-..., MIG-...) are taken as valid."""
    first = visible.split(",")[0].strip()
    if not first:
        return True
    try:
        return not 0 <= int(first) < count
    except ValueError:
        return False


def diagnose_facts(facts: Facts) -> str | None:
    """None when CUDA is usable; else one line saying why not, and what to do."""
    if facts.cuda_available:
        return None
    if not facts.gpus:
        why = "nvidia-smi is not installed or failed" if facts.gpus is None else "nvidia-smi lists none"
        return f"no NVIDIA GPU found ({why})"
    found = f"nvidia-smi lists {len(facts.gpus)} GPU(s) ({facts.gpus[0]})"
    if facts.torch_cuda is None:
        return (
            f"torch {facts.torch_version} is a CPU build (torch.version.cuda is None) but {found}; "
            f"install the CUDA build: bash scripts/setup.sh gpu ({SETUP_HINT})"
        )
    if facts.visible_devices is not None and _hides_every_gpu(facts.visible_devices, len(facts.gpus)):
        return f"CUDA_VISIBLE_DEVICES={facts.visible_devices!r} hides every GPU, though {found}"
    need = required_driver(facts.torch_cuda)
    have = re.match(r"\d+", facts.driver or "")
    if have and need is not None and int(have.group()) < need:
        return (
            f"NVIDIA driver {facts.driver} is older than {need}, which torch {facts.torch_version} "
            f"(CUDA {facts.torch_cuda}) needs; upgrade the driver or install torch and vLLM built for "
            f"an older CUDA ({SETUP_HINT}, the cu129 route)"
        )
    detail = f": {facts.cuda_error}" if facts.cuda_error else ""
    return f"torch {facts.torch_version} (CUDA {facts.torch_cuda}) cannot use the GPU, though {found}{detail}"


def _nvidia_smi() -> tuple[tuple[str, ...] | None, str | None]:
    """(GPU names, driver version) from nvidia-smi; (None, None) when it is missing or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None, None
    rows = [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]
    return tuple(r[0] for r in rows), (rows[0][-1] if rows else None)


def probe() -> Facts:
    """The facts on this machine. Runs nvidia-smi and tries to start CUDA only when torch
    reports no usable device, so a working GPU costs nothing more than is_available()."""
    import torch

    available = torch.cuda.is_available()
    gpus = driver = error = None
    if not available:
        gpus, driver = _nvidia_smi()
        if gpus and torch.version.cuda is not None:
            try:  # CUDA's own reason ("driver too old", "no CUDA-capable device"), for the message
                torch.cuda.init()
            except Exception as e:  # noqa: BLE001  the message is what we want, whatever its type
                error = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return Facts(
        torch_version=torch.__version__,
        torch_cuda=torch.version.cuda,
        cuda_available=available,
        gpus=gpus,
        driver=driver,
        visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        cuda_error=error,
    )


def diagnose() -> str | None:
    """None when CUDA is usable on this machine, else the one-line reason."""
    return diagnose_facts(probe())


def refusal(facts: Facts, requested: str) -> str | None:
    """The reason to refuse a device setting ("cuda", "auto" or "cpu"), or None to go on: "cuda"
    is refused whenever CUDA is unusable; "auto" only when nvidia-smi lists a GPU that torch cannot
    use (a CPU-only machine trains on its CPU as before); "cpu" never."""
    if requested == "cpu":
        return None
    reason = diagnose_facts(facts)
    if reason is None or (requested == "auto" and not facts.gpus):
        return None
    return f"{requested} requested, but {reason}"


def check_device(requested: str, *, key: str) -> None:
    """Raise ConfigError("KEY: REQUESTED requested, but REASON") when `requested` cannot be honoured.
    The one call for `learner.device` (learning/device.py) and a worker's engine device."""
    if requested == "cpu":
        return
    reason = refusal(probe(), requested)
    if reason is not None:
        raise ConfigError(f"{key}: {reason}")
