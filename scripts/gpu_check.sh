#!/usr/bin/env bash
# The GPU check: on a machine with a CUDA device, in an environment with echo2 and the GPU build of
# vLLM installed (pip install vllm==0.32.0 && pip install -e ".[test]"), run
#   1. the vLLM engine tests on the GPU: generate, install a new snapshot in place and restore it,
#      behaviour log-probs against the learner's recomputation (tests/e2e/test_vllm_engine.py);
#   2. the `gpu`-marked tests: a bf16 learner step on CUDA against the CPU fp32 step;
#   3. a two-step run of the tiny configuration with a bf16 learner on CUDA, then the same two steps
#      with the vLLM engine on SmolLM2-135M (the tiny model's head size is below what vLLM supports).
# Usage: bash scripts/gpu_check.sh [OUT_DIR]   (default runs/gpu-check); exits 1 on the first failure.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/gpu-check}"
[ -n "${VIRTUAL_ENV:-}" ] || { [ -x .venv/bin/python ] && . .venv/bin/activate; } || true
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: torch sees no CUDA device here; nothing to check" >&2
  exit 1
fi
python -c "import vllm" || { echo "gpu_check: vllm is not installed (pip install vllm==0.32.0)" >&2; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python -c "import torch, vllm; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'vllm', vllm.__version__)"
mkdir -p "$out"
export ECHO2_VLLM_KV_CACHE_GIB="${ECHO2_VLLM_KV_CACHE_GIB:-4}"

echo "== 1. vLLM engine on the GPU"
pytest -p no:cacheprovider -q tests/e2e/test_vllm_engine.py tests/unit/test_engine_choice.py
echo "== 2. gpu-marked tests (bf16 learner step on CUDA)"
pytest -p no:cacheprovider -q -m gpu tests
echo "== 3. two-step runs"
rm -rf "$out/tiny-bf16" "$out/smollm-vllm"
echo2 run configs/tiny.toml --learner.steps=2 --learner.device=cuda --learner.dtype=bf16 \
  --run.dir="$out/tiny-bf16" -q
echo2 run configs/quickstart.toml --learner.steps=2 --run.eval_size=16 --learner.device=cuda \
  --learner.dtype=bf16 --rollout.engine=vllm --run.dir="$out/smollm-vllm" -q
python - "$out" <<'EOF'
import json, sys
from pathlib import Path

for run in ("tiny-bf16", "smollm-vllm"):
    rows = [json.loads(line) for line in (Path(sys.argv[1]) / run / "metrics.jsonl").read_text().splitlines()]
    print(run, [{k: round(r[k], 4) for k in ("reward/mean", "train/loss", "train/ratio_mean")} for r in rows])
EOF
echo "gpu_check: all passed"
