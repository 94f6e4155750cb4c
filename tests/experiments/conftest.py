"""The studies' tests import their modules the way the studies' scripts do (`python
experiments/STUDY/X.py` puts its own folder first on sys.path, and the script adds bench/, the
harness): each study's folder and bench/ go on sys.path here, for this directory only."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for folder in (ROOT / "bench", *sorted(p for p in (ROOT / "experiments").iterdir() if p.is_dir())):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
