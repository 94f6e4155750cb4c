#!/usr/bin/env bash
# SkyPilot's own Task and Resources classes, offline (tests/unit/test_skypilot_task.py), in a venv of
# their own: skypilot 0.14 pins click<8.2, which the main venv's wandb and huggingface-hub refuse.
# .venv-sky holds SkyPilot and its pins; a .pth file then adds the main venv behind them (torch,
# pytest, echo2 itself), so nothing in .venv changes. Run by scripts/test.sh after the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
main_site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ ! -x .venv-sky/bin/python ] || ! .venv-sky/bin/python -c 'import sky' 2>/dev/null; then
  rm -rf .venv-sky
  python3 -m venv .venv-sky
  .venv-sky/bin/pip install -q --upgrade pip
  .venv-sky/bin/pip install -q "skypilot==0.14.1"  # before the .pth below: pip must not see .venv
fi
sky_site=$(.venv-sky/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import site; site.addsitedir('$main_site')" >"$sky_site/zz_echo2_main_venv.pth"
.venv-sky/bin/python -m pytest -m "not slow" -p no:cacheprovider tests/unit/test_skypilot_task.py tests/unit/test_skypilot.py "$@"
