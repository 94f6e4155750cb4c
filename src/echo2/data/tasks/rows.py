"""Reading a task's rows from local files: JSONL line by line (errors name the line), and through
the `datasets` library Parquet, Arrow (`.arrow`, or a `save_to_disk` directory), CSV and JSON, as
TRL and verl users hold their prompt sets.

Owns file formats, the column mapping (which column holds the question and which the answer) and
the prompt template (`str.format` over a row's columns, e.g. "Problem: {problem}"). Only local
files are read: nothing here names a hub dataset, so `datasets` never reaches the network; its
tables are kept in memory (no cache is written). Every row is validated when the task is built: a
problem raises `TaskFileError` naming the file, the line (row) and the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from echo2.config import ConfigError

FORMATS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".json": "json", ".jsonl": "jsonl"}


class TaskFileError(ConfigError):
    """A task data file the user must fix; the message names file, line and field."""


def read_rows(
    path: str | Path, *, question_field: str, answer_field: str, template: str = "{question}"
) -> list[tuple[str, str]]:
    """(prompt text, answer) pairs; line numbers are 1-based (JSONL line, else row + 1). The
    template's `{question}` is the question column; any other `{name}` is that column."""
    path = Path(path)
    if not path.exists():
        raise TaskFileError(f"{path}: no such file")
    raw = _jsonl(path) if FORMATS.get(path.suffix) == "jsonl" else _through_datasets(path)
    rows = []
    for lineno, row in raw:
        if not isinstance(row, dict):
            raise TaskFileError(f"{path}:{lineno}: row is not an object")
        values = []
        for fld in (question_field, answer_field):
            if fld not in row:
                raise TaskFileError(f"{path}:{lineno}: missing field {fld!r}")
            value = row[fld]
            if (
                isinstance(value, bool)
                or not isinstance(value, str | int | float)
                or str(value).strip() == ""
            ):
                raise TaskFileError(f"{path}:{lineno}: field {fld!r} must be a non-empty string or number")
            values.append(str(value))
        try:
            prompt = template.format_map({**row, "question": values[0]})
        except KeyError as e:
            raise TaskFileError(
                f"task.prompt_template: {path}:{lineno} has no column {e.args[0]!r}"
            ) from None
        except (ValueError, IndexError) as e:
            raise ConfigError(f"task.prompt_template: {e}") from None
        rows.append((prompt, values[1]))
    if not rows:
        raise TaskFileError(f"{path}: no rows")
    return rows


def _jsonl(path: Path) -> list[tuple[int, Any]]:
    raw = []
    with path.open() as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                raw.append((lineno, json.loads(line)))
            except json.JSONDecodeError as e:
                raise TaskFileError(f"{path}:{lineno}: invalid JSON: {e.msg}") from None
    return raw


def _through_datasets(path: Path) -> list[tuple[int, Any]]:
    from datasets import Dataset

    kind = "dataset" if path.is_dir() else FORMATS.get(path.suffix)
    if kind is None:
        raise TaskFileError(
            f"{path}: unknown format (use .jsonl, .json, .parquet, .arrow, .csv or a datasets directory)"
        )
    try:
        if kind == "dataset":
            from datasets import load_from_disk

            data = load_from_disk(str(path), keep_in_memory=True)
            if not isinstance(data, Dataset):
                raise TaskFileError(f"{path}: holds several splits; name one split's directory")
        elif kind == "arrow":
            data = Dataset.from_file(str(path), in_memory=True)
        else:
            reader = {"parquet": Dataset.from_parquet, "csv": Dataset.from_csv, "json": Dataset.from_json}[
                kind
            ]
            data = reader(str(path), keep_in_memory=True)
    except TaskFileError:
        raise
    except Exception as e:  # pyarrow / datasets errors of every kind: one line naming the file
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TaskFileError(f"{path}: cannot read as {kind}: {text}") from None
    return list(enumerate(data.to_list(), start=1))
