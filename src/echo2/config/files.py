"""Reading and writing run configurations: TOML files, `--section.key=value` overrides, dotted
keys, and the one-line messages that name the key of a user mistake.

Owns the file and command-line side of the config; the schema is schema.py. Imports no torch, so
`echo2 run --dry-run` and `--help` stay instant.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import tomli_w
from pydantic import ValidationError

from echo2.config.base import ConfigError
from echo2.config.schema import Config


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """`["--learner.lr=1e-6", "--run.seed", "3"]` -> `{"learner.lr": 1e-6, "run.seed": 3}`.

    Values are read as TOML (numbers, booleans, arrays, quoted strings); anything else is a string.
    """
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --section.key=value")
        key, sep, raw = arg[2:].partition("=")
        if not sep:
            if i + 1 >= len(args):
                raise ConfigError(f"{key}: missing value")
            i += 1
            raw = args[i]
        out[key] = _toml_value(raw)
        i += 1
    return out


def _toml_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    """Set `key` ("a.b.c", list items by index: "workers.0.count") in a nested dict, in place."""
    parts = key.split(".")
    node: Any = tree
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        where = ".".join(parts[: i + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"{key}: {where} is not an item of a list of {len(node)}")
            if last:
                node[int(part)] = value
            else:
                node = node[int(part)]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                node = node.setdefault(part, {})
        else:
            raise ConfigError(f"{key}: {'.'.join(parts[:i])} is not a section")


def read_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None


def build_config(tree: dict[str, Any], overrides: dict[str, Any] | None = None) -> Config:
    tree = {k: (dict(v) if isinstance(v, dict) else v) for k, v in tree.items()}
    for key, value in (overrides or {}).items():
        set_dotted(tree, key, value)
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(validation_message(e)) from None


FILE_KEYS = {
    "task": ("train_file", "eval_file"),
    "model": ("file", "tokenizer_file", "path"),
    "scheduler": ("pool",),
    "broadcast": ("key_file",),
}
"""Keys naming files: a relative value in a config file is relative to that file's directory."""


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> Config:
    """The config in `path`, whose relative file names (FILE_KEYS) and custom task modules are
    resolved against the file's own directory; overrides are taken as given (relative to the
    working directory)."""
    tree = read_toml(path)
    anchor_paths(tree, Path(path).resolve().parent)
    return build_config(tree, overrides)


def anchor_paths(tree: dict[str, Any], base: Path) -> None:
    """In place: relative file names under `base` (a hub id or a file found only relative to the
    working directory is left as it is); a custom task's module is also looked up in `base`."""
    for section, keys in FILE_KEYS.items():
        node = tree.get(section)
        if not isinstance(node, dict):
            continue
        for key in keys:
            value = node.get(key)
            if not isinstance(value, str) or not value or value.startswith("pypi:"):
                continue
            if Path(value).expanduser().is_absolute() or value.startswith("~"):
                continue
            if (base / value).exists() or not (key == "path" or Path(value).exists()):
                node[key] = str(base / value)
    task = tree.get("task")
    if isinstance(task, dict) and task.get("type") == "custom":
        given = task.get("pythonpath", [])
        if isinstance(given, list):
            task["pythonpath"] = [str(base / p) if isinstance(p, str) else p for p in given] + [str(base)]


def validation_message(e: ValidationError) -> str:
    """One line naming the dotted key of the first problem pydantic found."""
    err = e.errors()[0]
    # Drop the discriminator tag pydantic inserts ("model.gguf.file" -> "model.file"), only where it
    # sits (right after the section: "task.env.env" is the env task's `env` field).
    tags = ("hf", "gguf", "tiny", "arithmetic", "math", "custom", "env")
    loc = [str(p) for i, p in enumerate(err["loc"]) if not (i == 1 and p in tags)]
    msg = err["msg"].removeprefix("Value error, ")
    key = ".".join(loc)
    if not key or msg.startswith(key + ".") or msg.startswith(key + ":"):  # validators name their key
        return msg
    extra = f" (got {err['input']!r})" if err["type"] not in ("missing", "extra_forbidden") else ""
    return f"{key or '<root>'}: {msg}{extra}"


def dump_toml(config: Config) -> str:
    return tomli_w.dumps(config.model_dump(mode="json", exclude_none=True))
