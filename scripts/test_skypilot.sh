#!/usr/bin/env bash
# The SkyPilot bridge against SkyPilot itself (tests/unit/test_skypilot_task.py), offline: every
# worker type's task built and validated by SkyPilot's own Task and Resources classes.
# SkyPilot cannot be installed beside echo2 (skypilot 0.14 pins click<8.2; the huggingface-hub that
# transformers needs wants click>=8.4), so, as in production, it gets a venv of its own (.venv-sky,
# SkyPilot and its pins only) and echo2's tests run in echo2's venv, starting the bridge
# (src/echo2/fleet/providers/skypilot/bridge.py) with .venv-sky's python. Nothing in .venv changes.
# Run by scripts/test.sh after the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-sky/bin/python ] || ! .venv-sky/bin/python -c 'import sky' 2>/dev/null; then
  rm -rf .venv-sky
  python3 -m venv .venv-sky
  .venv-sky/bin/pip install -q --upgrade pip
  .venv-sky/bin/pip install -q "skypilot==0.14.1"
fi
# an earlier version of this script put echo2's venv behind SkyPilot's with a .pth file: no more
sky_site=$(.venv-sky/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -f "$sky_site/zz_echo2_main_venv.pth"
ECHO2_TEST_SKY_PYTHON="$PWD/.venv-sky/bin/python" .venv/bin/python -m pytest -m "not slow" -p no:cacheprovider \
  tests/unit/test_skypilot_task.py tests/unit/test_skypilot_bridge.py "$@"
