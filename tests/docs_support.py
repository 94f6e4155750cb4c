"""What the docs tests (tests/unit/test_docs_*.py) share: how markdown is read (code spans and
fenced blocks, prose, GitHub's heading anchors), the config, scenario and pool schemas as sets of
dotted keys, the `echo2` subcommands with their options, and looking a name up in the code (does
`echo2.a.b` define `Name`, which modules are called `state`, which file names exist)."""

from __future__ import annotations

import argparse
import functools
import re
import typing
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


# ---------------------------------------------------------------------------- reading markdown
@dataclass(frozen=True)
class Code:
    line: int
    text: str
    lang: str | None  # None: an inline span; "" or the fence's language


def code_of(text: str) -> list[Code]:
    """Fenced blocks (one Code per block, its language kept) and inline spans outside them."""
    found: list[Code] = []
    prose: list[str] = []
    lines = text.splitlines()
    fence: tuple[int, str, list[str]] | None = None
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            if fence is None:
                fence = (number + 1, stripped[3:].strip(), [])
            else:
                found.append(Code(fence[0], "\n".join(fence[2]), fence[1]))
                fence = None
            prose.append("")
            continue
        if fence is not None:
            fence[2].append(line)
            prose.append("")
        else:
            prose.append(line)
    joined = "\n".join(prose)
    for m in re.finditer(r"`([^`]+)`", joined):
        found.append(Code(joined.count("\n", 0, m.start()) + 1, m.group(1).replace("\n", " "), None))
    return found


def prose_of(text: str) -> str:
    """The text with fenced blocks blanked (line numbers kept)."""
    out, inside = [], False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            inside = not inside
            out.append("")
        else:
            out.append("" if inside else line)
    return "\n".join(out)


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a doc's headings: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    return {
        re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        for m in re.finditer(r"^#+\s+(.*)$", prose_of(markdown), re.M)
    }


# ---------------------------------------------------------------------------- the schemas
def _models_in(annotation) -> tuple[list[type[BaseModel]], bool]:
    """The pydantic models an annotation can hold, and whether it can hold a dict (open keys)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation], False
    origin = typing.get_origin(annotation)
    if origin is dict or annotation is dict:
        return [], True
    models, open_ = [], False
    for arg in typing.get_args(annotation):
        m, o = _models_in(arg)
        models += m
        open_ |= o
    return models, open_


def schema_keys(model: type[BaseModel], prefix: str = "") -> tuple[set[str], set[str]]:
    """(every dotted key of the model, tables included; keys under which anything goes)."""
    keys: set[str] = set()
    open_: set[str] = set()
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        keys.add(key)
        models, is_open = _models_in(field.annotation)
        if is_open:
            open_.add(key)
        for sub in models:
            k, o = schema_keys(sub, key + ".")
            keys |= k
            open_ |= o
    return keys, open_


class Schema:
    def __init__(self, *models: type[BaseModel]) -> None:
        self.keys: set[str] = set()
        self.open: set[str] = set()
        for model in models:
            k, o = schema_keys(model)
            self.keys |= k
            self.open |= o

    def has(self, key: str) -> bool:
        parts = key.split(".")
        return key in self.keys or any(".".join(parts[:i]) in self.open for i in range(1, len(parts)))


def config_schema() -> Schema:
    from echo2.config import Config

    return Schema(Config)


def scenario_schema() -> Schema:
    from echo2.sim.scenario import Scenario

    return Schema(Scenario)


def pool_schema() -> Schema:
    """`echo2 plan --pool` files: [[workers]] tables (planning/plan.py's load_pool)."""
    from echo2.planning.plan import Pool

    return Schema(Pool)


# ---------------------------------------------------------------------------- the parser
def subcommands() -> dict[str, set[str]]:
    """{subcommand: its option strings} from the parser echo2.cli builds."""
    from echo2 import cli

    builder = next(getattr(cli, n) for n in ("build_parser", "parser", "_parser") if hasattr(cli, n))
    parser = builder()
    found: dict[str, set[str]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[name] = set(sub._option_string_actions)
    return found


# ---------------------------------------------------------------------------- looking names up in the code
@functools.cache
def file_names() -> frozenset[str]:
    """Names of the files under src/, tests/, bench/, experiments/ and scripts/."""
    dirs = ("src", "tests", "bench", "experiments", "scripts")
    return frozenset(p.name for d in dirs for p in (ROOT / d).rglob("*") if p.is_file())


@functools.cache
def module_names() -> dict[str, tuple[str, ...]]:
    """Base name of each echo2 module -> the dotted names of the modules of that name."""
    found: dict[str, list[str]] = {}
    for p in (SRC / "echo2").rglob("*.py"):
        if p.name != "__init__.py":
            found.setdefault(p.stem, []).append(".".join(p.relative_to(SRC).with_suffix("").parts))
    return {k: tuple(v) for k, v in found.items()}


def check_module_attr(module: str, attr: str) -> str | None:
    """`models.token_logprobs`: some module named `models` defines `token_logprobs`."""
    if any(check_module(f"{dotted}.{attr}") is None for dotted in module_names()[module]):
        return None
    return f"no module {module}.py defines {attr}"


def check_file_name(path: str, name: str) -> str | None:
    """`data/buffer.py: ReplayBuffer`: the file defines the name (a bare `engine.py: HFEngine`: some
    echo2 module of that base name does)."""
    for base in (ROOT, SRC / "echo2"):
        file = base / path
        if file.is_file():
            if file.is_relative_to(SRC):
                return check_module(".".join(file.relative_to(SRC).with_suffix("").parts) + f".{name}")
            defines = re.search(
                rf"^\s*(?:class|def|async def)\s+{name}\b|^{name}\s*[:=]", file.read_text(), re.M
            )
            return None if defines else f"{path} defines no {name}"
    if "/" not in path and Path(path).stem in module_names():
        return check_module_attr(Path(path).stem, name)
    return "no such file"


def module_file(dotted: str) -> bool:
    """Whether `a.b...` starts with a module of echo2 (`broadcast.plan`, `planning.capacity.mu_min`)."""
    parts = dotted.split(".")
    return len(parts) >= 2 and (SRC / "echo2" / parts[0] / f"{parts[1]}.py").is_file()


def check_module(name: str) -> str | None:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        base = SRC.joinpath(*parts[:i])
        source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if source.is_file():
            rest = parts[i:]
            if not rest:
                return None
            text = source.read_text()
            attr = rest[0]
            if re.search(
                rf"^(?:class|def|async def)\s+{attr}\b|^{attr}\s*[:=]|\bimport\b.*\b{attr}\b", text, re.M
            ):
                return None
            if (base / attr).is_dir() or (base / f"{attr}.py").is_file():
                return None
            return f"{'.'.join(parts[:i])} defines no {attr}"
    return "no such module"
