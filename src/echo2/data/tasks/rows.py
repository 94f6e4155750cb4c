"""Reading a task's rows from local files: JSONL line by line (errors name the line), and through
the `datasets` library Parquet, Arrow (`.arrow`, or a `save_to_disk` directory), CSV and JSON, as
TRL and verl users hold their prompt sets.

Owns file formats, the column mapping (which column holds the question and which the answer, as
dotted paths into nested columns: "reward_model.ground_truth"), the prompt template (`str.format`
over a row's columns, e.g. "Problem: {problem}") or a column of chat messages (DAPO-Math-17k's
`prompt`), and where the system prompt goes. Only local files are read: nothing here names a hub
dataset, so `datasets` never reaches the network; its tables are kept in memory (no cache is
written). Every row is validated when the task is built: a problem raises `TaskFileError` naming
the file, the line (row) and the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from echo2.config import ConfigError

FORMATS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".json": "json", ".jsonl": "jsonl"}


class TaskFileError(ConfigError):
    """A task data file the user must fix; the message names file, line and field."""


Messages = tuple[dict[str, str], ...]
ROLES = ("system", "user", "assistant")


def read_rows(
    path: str | Path,
    *,
    question_field: str,
    answer_field: str,
    template: str = "{question}",
    messages_field: str | None = None,
    system_prompt: str = "",
) -> list[tuple[Messages, str]]:
    """(chat messages, answer) pairs; line numbers are 1-based (JSONL line, else row + 1).

    The messages are `system_prompt` (unless "") then either the row's own message list
    (`messages_field`) or one user message, `template` over the row's columns with `{question}`
    the question column. Field names are dotted paths into nested columns ("reward_model.ground_truth");
    a column whose name is the whole string, dots and all, is taken first."""
    path = Path(path).expanduser()
    if not path.exists():
        raise TaskFileError(f"{path}: no such file")
    raw = _jsonl(path) if FORMATS.get(path.suffix) == "jsonl" else _through_datasets(path)
    system = ({"role": "system", "content": system_prompt},) if system_prompt else ()
    rows = []
    for lineno, row in raw:
        where = f"{path}:{lineno}"
        if not isinstance(row, dict):
            raise TaskFileError(f"{where}: row is not an object")
        answer = _text(row, answer_field, where)
        if messages_field is not None:
            messages = _messages(row, messages_field, where, has_system_prompt=bool(system))
        else:
            question = _text(row, question_field, where)
            try:
                content = template.format_map({**row, "question": question})
            except KeyError as e:
                raise TaskFileError(f"task.prompt_template: {where} has no column {e.args[0]!r}") from None
            except (ValueError, IndexError) as e:
                raise ConfigError(f"task.prompt_template: {e}") from None
            messages = ({"role": "user", "content": content},)
        rows.append((system + messages, answer))
    if not rows:
        raise TaskFileError(f"{path}: no rows")
    return rows


def _field(row: dict[str, Any], name: str, where: str) -> Any:
    """The value at `name`: the column of that exact name, else the dotted path through nested
    objects (Parquet structs arrive as dicts)."""
    if name in row:
        return row[name]
    node: Any = row
    for i, part in enumerate(name.split(".")):
        if not isinstance(node, dict) or part not in node:
            got = ".".join(name.split(".")[:i])
            why = f" ({got!r} is not an object)" if i and not isinstance(node, dict) else ""
            raise TaskFileError(f"{where}: missing field {name!r}{why}")
        node = node[part]
    return node


def _text(row: dict[str, Any], name: str, where: str) -> str:
    value = _field(row, name, where)
    if isinstance(value, bool) or not isinstance(value, str | int | float) or str(value).strip() == "":
        raise TaskFileError(f"{where}: field {name!r} must be a non-empty string or number")
    return str(value)


def _messages(row: dict[str, Any], name: str, where: str, *, has_system_prompt: bool) -> Messages:
    """A non-empty list of {role, content} messages ending with a user message, a system message
    only first (and then only without task.system_prompt)."""
    value = _field(row, name, where)
    if not isinstance(value, list) or not value:
        raise TaskFileError(f"{where}: field {name!r} must be a non-empty list of {{role, content}} messages")
    messages = []
    for i, m in enumerate(value):
        at = f"{where}: field {name!r} message {i}"
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise TaskFileError(f"{at}: must be {{role: system|user|assistant, content: string}}")
        if not m["content"].strip():
            raise TaskFileError(f"{at}: empty content")
        if m["role"] == "system" and i > 0:
            raise TaskFileError(f"{at}: a system message may only come first")
        if m["role"] == "system" and has_system_prompt:
            raise TaskFileError(f'{at}: the row has its own system message; set task.system_prompt = ""')
        messages.append({"role": m["role"], "content": m["content"]})
    if messages[-1]["role"] != "user":
        raise TaskFileError(f"{where}: field {name!r}: the last message must be the user's")
    return tuple(messages)


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
