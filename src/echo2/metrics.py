"""Metrics as JSON lines: one `dict[str, float]` per step, keys named `area/metric`."""

from __future__ import annotations

import json
from pathlib import Path


class MetricsWriter:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a")

    def write(self, row: dict[str, float]) -> None:
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
