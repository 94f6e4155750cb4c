#!/usr/bin/env bash
# The GPU check: every section runs, whatever the ones before it did, within its own time budget
# (`timeout`); each is recorded (name, status, seconds, exit code, log file) in OUT/summary.json,
# which is also printed. Sections (docs/gpu.md "GPU tests" says what each test proves):
#   environment    nvidia-smi, torch/vLLM versions, and echo2.gpu_env.diagnose() (fails on a reason)
#   learner        the gpu-marked learner tests: a bf16 learner step on CUDA against the CPU fp32 step
#   vllm_engine    tests/e2e/test_vllm_engine.py on the GPU: generate, install a snapshot in place and
#                  restore it, behaviour log-probs against the learner's recomputation, same seed
#   vllm_gpu       tests/gpu/test_gpu_vllm.py: bf16 engine vs the bf16 learner, per-request seeds
#   colocated      tests/gpu/test_gpu_colocated.py: a learner-sized allocation, then vLLM with the
#                  computed share, against the memory plan
#   fsdp_nccl      tests/gpu/test_gpu_fsdp.py: FSDP2 over NCCL (skipped with its reason on one GPU)
#   run_hf         `echo2 run` of the tiny model, two steps, bf16 learner on CUDA
#   run_vllm       `echo2 run` of SmolLM2-135M, two steps, bf16 learner and the vLLM engine on CUDA
# Usage: bash scripts/gpu_check.sh [OUT_DIR]   (default $OUT, else runs/gpu-check)
#   GPU_CHECK_SECTIONS=learner,run_hf  runs only those; ECHO2_PYTHON picks the interpreter (default:
#   the active venv's, else ./.venv's); GPU_CHECK_MAX_BUDGET=S caps every section's budget at S seconds.
#   Budgets sum to 525 s: under 9 minutes on one GPU.
# Exit status: 0 when no section failed or timed out, else 1. Set up with `bash scripts/setup.sh gpu,test`.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-runs/gpu-check}}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
if [ -n "${ECHO2_PYTHON:-}" ]; then py="$ECHO2_PYTHON"
elif [ -n "${VIRTUAL_ENV:-}" ]; then py="$VIRTUAL_ENV/bin/python"
else py="$PWD/.venv/bin/python"; fi
export ECHO2_VLLM_KV_CACHE_GIB="${ECHO2_VLLM_KV_CACHE_GIB:-4}"
wanted="${GPU_CHECK_SECTIONS:-}"
results="$out/.sections.tsv"
: > "$results"

# section NAME BUDGET_S COMMAND...: run it with its log in OUT/NAME.log; record the outcome.
section() {
  local name="$1" budget="$2" start rc status
  shift 2
  if [ -n "${GPU_CHECK_MAX_BUDGET:-}" ] && [ "$GPU_CHECK_MAX_BUDGET" -lt "$budget" ]; then budget="$GPU_CHECK_MAX_BUDGET"; fi
  if [ -n "$wanted" ] && [[ ",$wanted," != *",$name,"* ]]; then return; fi
  echo "== $name (budget ${budget}s)"
  start=$(date +%s.%N)
  if declare -F "$1" > /dev/null; then set -- bash -c '"$@"' "$name" "$@"; fi  # a function: exported below
  timeout --kill-after=15 "$budget" "$@" > "$out/$name.log" 2>&1
  rc=$?
  local seconds
  seconds=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then status=timeout
  elif [ "$rc" != 0 ]; then status=fail
  # a pytest section's short summary (-rA) names every test: all SKIPPED and none PASSED is "skip"
  # (e.g. FSDP on one GPU). Not the final "N passed" line: under -qq (pyproject's -q and ours) pytest
  # prints none, and every such section read "pass" (issue 42).
  elif grep -Eq '^SKIPPED ' "$out/$name.log" && ! grep -Eq '^PASSED ' "$out/$name.log"; then status=skip
  else status=pass; fi
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$seconds" "$rc" "$out/$name.log" >> "$results"
  echo "   $status in ${seconds}s (exit $rc): $(grep -v '^\s*$' "$out/$name.log" | tail -n 1 | cut -c1-200)"
}

pytest_args=(-p no:cacheprovider -q -rA)  # -rA: every test's outcome, and passed tests' output (MEASURED lines)

environment() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi failed"
  "$py" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'devices', torch.cuda.device_count())"
  "$py" -c "import vllm; print('vllm', vllm.__version__)" || echo "vllm: not importable"
  "$py" -c "
import sys
from echo2.gpu_env import diagnose
reason = diagnose()
print('diagnose: CUDA usable' if reason is None else 'diagnose: ' + reason)
sys.exit(reason is not None)"
}

two_steps() {  # NAME EXTRA_FLAGS...: a two-step run, then its metrics rows
  local run="$out/$1"
  shift
  rm -rf "$run"
  "$py" -m echo2.cli run "$@" --learner.steps=2 --learner.device=cuda --learner.dtype=bf16 --run.dir="$run" -q \
    && "$py" - "$run" <<'EOF'
import json, math, sys
from pathlib import Path

rows = [json.loads(line) for line in (Path(sys.argv[1]) / "metrics.jsonl").read_text().splitlines()]
assert len(rows) == 2, f"{len(rows)} metrics rows, not 2"
keys = ("reward/mean", "train/loss", "train/ratio_mean")
assert all(math.isfinite(r[k]) for r in rows for k in keys), rows
print([{k: round(r[k], 4) for k in keys} for r in rows])
EOF
}

export py out
export -f environment two_steps
section environment 25 environment
section learner 45 "$py" -m pytest "${pytest_args[@]}" -m gpu tests/unit/test_device.py tests/gpu/test_gpu_learner.py
section vllm_engine 120 "$py" -m pytest "${pytest_args[@]}" tests/e2e/test_vllm_engine.py tests/unit/test_engine_choice.py
section vllm_gpu 100 "$py" -m pytest "${pytest_args[@]}" -m gpu tests/gpu/test_gpu_vllm.py
section colocated 90 "$py" -m pytest "${pytest_args[@]}" -m gpu tests/gpu/test_gpu_colocated.py
section fsdp_nccl 40 "$py" -m pytest "${pytest_args[@]}" -m gpu tests/gpu/test_gpu_fsdp.py
section run_hf 35 two_steps tiny-bf16 configs/tiny.toml
section run_vllm 70 two_steps smollm-vllm configs/quickstart.toml --run.eval_size=16 --rollout.engine=vllm

# The summary, in JSON written here (no Python: it must come out even when the interpreter is broken).
json_str() { printf '%s' "$1" | sed -e 's/\\/\\\\/g' -e 's/"/\\"/g' -e 's/\t/ /g' | tr -d '\000-\037'; }
{
  printf '{\n  "python": "%s",\n  "sections": [' "$(json_str "$py")"
  sep=""
  failed=0
  while IFS=$'\t' read -r name status seconds rc log; do
    last=$(grep -v '^\s*$' "$log" 2>/dev/null | tail -n 1 | cut -c1-300)
    printf '%s\n    {"name": "%s", "status": "%s", "seconds": %s, "exit_code": %s, "log": "%s", "last_line": "%s"}' \
      "$sep" "$name" "$status" "$seconds" "$rc" "$(json_str "$log")" "$(json_str "$last")"
    sep=","
    case "$status" in fail|timeout) failed=$((failed + 1)) ;; esac
  done < "$results"
  printf '\n  ],\n  "failed": %d\n}\n' "$failed"
} > "$out/summary.json"
rm -f "$results"
cat "$out/summary.json"
grep -q '"failed": 0' "$out/summary.json"
