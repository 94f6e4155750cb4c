#!/usr/bin/env bash
# Set up, then GRPO on SmolLM2-135M-Instruct for arithmetic (time, memory and disk: README.md).
# Extra arguments go to `echo2 run`, e.g. scripts/quickstart.sh --run.seed=1
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
[ -n "${VIRTUAL_ENV:-}" ] || . .venv/bin/activate
echo2 run configs/quickstart.toml "$@"
