"""Helpers shared by the benchmark scripts (run as `python bench/NAME.py`, so this is importable)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: str | None, result: Any) -> None:
    """Write `result` as indented JSON if a path was given (the `--json` option of every bench)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2) + "\n")
