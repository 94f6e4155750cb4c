"""The docs name only things that exist: every config key, `echo2` command and flag, module and
file path named in README.md and docs/*.md is checked against the code (issue 23, issue 26 item 9).

Extraction rules (simple on purpose; a doc that needs more says it in plain words):

- **Code** is what sits between backticks (inline spans, joined over line breaks) and inside fenced
  blocks. Keys, commands and module names are read from code only; paths from prose as well.
- **Config keys**: in code, `section.key[.sub...]` or `--section.key=value` whose first part is a
  section of the run config (model, task, rollout, learner, coordinator, scheduler, broadcast, run),
  and `[section]`, `[section.sub]`, `[section] key`. Not a key when followed by `(` (a method call,
  `run.run()`) or when its last part is a file extension (`rollout.py`) or a host name's
  (`learner.example.org`). A key is valid when the run
  config's pydantic schema (echo2.config.Config) or the simulator's scenario schema
  (echo2.sim.scenario.Scenario, whose sections share names with the config's) has it; under a
  dict-valued field (`model.chat_template_kwargs`, `task.options`) any sub-key is valid. ```toml
  blocks are parsed and every key path in them is checked the same way (the plan's pool files and
  the simulator's scenario files included).
- **Commands**: in inline spans and bash blocks (in other fenced blocks, output and diagrams, only
  `$ ` lines and the backtick spans inside them), `echo2 SUB ...` up to the end of the line (a
  `\\` continues it), a `#` comment, `;`, `&&`, a backtick, a pipe or `)`. SUB must be a
  subcommand of the parser echo2.cli builds (`echo2 run | learner | worker` names several);
  each `-x`/`--flag` after it must be one of that subcommand's options, `--a/--b` naming two;
  `--section.key=value` is a config override, checked as a key of the run config (`run`,
  `learner`, `plan`) or of the scenario (`simulate`).
- **Modules**: in code, `echo2.a.b[.Name]`: the longest prefix must be a module or package under
  src/, and a name after it must be defined or imported in that module's source.
- **Module attributes**: in code, `module.name` where `module` is the base name of an echo2
  module (`models.token_logprobs`, `errors.from_answer`; not a config section, a package, or a
  file name like `metrics.jsonl`): some module of that name must define `name`.
- **Names in files**: in an inline span, `path.py: Name` (`data/buffer.py: ReplayBuffer`, or a
  bare `engine.py: HFEngine`, for any echo2 module of that base name): the file defines `Name`.
- **File names**: in code, a `name.py` or `name.sh` without a directory (`state.py`) must be the
  name of some file under src/, tests/, bench/ or scripts/ (so a renamed module's old name is found).
- **Links**: a relative markdown link's file must exist (relative to the doc) and its `#anchor`
  must be one of GitHub's anchors for a heading of that file.
- **Paths**: anywhere, words starting `src/echo2/`, `tests/`, `bench/`, `scripts/`, `configs/`,
  `docs/`, `scenarios/` (not after `/` or a word character, so URLs are skipped), and in code
  package-relative module paths `learning/loop.py`, `control/` etc. (resolved under src/echo2/);
  a `#anchor` is dropped, a `*` is a glob that must match something.
- **README layout**: every module under src/echo2/ (but `__init__.py`) and tests/adversarial/ is
  named in the layout block, and every name there exists. An entry is a line indented two spaces
  whose first word is a path (`coordinator/state.py`, `sim/`, `tests/`); bare `name.py` words in it and
  its deeper-indented continuation lines are in the entry's directory, or in the subdirectory the
  last `dir/` word before them named.

Beside these name checks, three docs are held to the code they describe: architecture.md's package
diagram to the import graph (and its list of `RolloutSource` methods to the protocol),
protocol.md's refusal table to wire/errors.py, and config.md's field table to every schema
field. The last tests check that each reader finds the mistakes it should, on made-up docs.

ALLOWED lists what a doc may name that is not ours (or no longer exists, on purpose), with the reason.
"""

from __future__ import annotations

import argparse
import functools
import re
import shlex
import tomllib
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

SECTIONS = ("model", "task", "rollout", "learner", "coordinator", "scheduler", "broadcast", "run")
PATH_ROOTS = ("src/echo2", "tests", "bench", "scripts", "configs", "docs", "scenarios")
PACKAGES = (
    "broadcast", "config", "coordinator", "data", "fleet", "learning", "planning", "rollout", "sim", "wire",
)  # fmt: skip
FILE_EXTENSIONS = {
    "py", "toml", "json", "jsonl", "md", "png", "pem", "sh", "safetensors", "gguf", "txt", "html",
    "csv", "parquet", "yaml", "token", "log", "pt", "bin",
}  # fmt: skip
HOST_SUFFIXES = {"org", "com", "net", "io"}
"""`learner.example.org` is a host name, not a key."""

ALLOWED: dict[str, str] = {
    "bench/NAME.py": "placeholder: any benchmark script",
    "model.generate": "transformers' generate method, not a key",
    "task.train_prompt": "the Task protocol's method (data/tasks/base.py), not a key",
    "coordinator.url": "a file in the run directory, not a key",
    "docs/getting_started/installation/": "a page of vLLM's docs, not ours",
    "_fsdp_init.py": "a file of torch's FSDP2, not ours",
    "my_task.py": "an example name for the reader's own task module",
    "echo2 bench": "the removed subcommand docs/bench/broadcast_n32.json records; docs/benchmarks.md says so",
}
"""Names docs may use that are not ours to check, each with its reason."""


@dataclass(frozen=True)
class Finding:
    doc: str
    line: int
    kind: str  # key | command | flag | module | file | path | link | toml
    name: str
    why: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.kind} {self.name!r}: {self.why}"


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


OVERRIDES = {"run": "config", "learner": "config", "plan": "config", "simulate": "scenario"}
"""Which schema a subcommand's `--section.key=value` overrides are checked against (others take none)."""


# ---------------------------------------------------------------------------- extraction
_SECTIONS = "|".join(SECTIONS)
_ROOTS = "|".join(re.escape(r) for r in PATH_ROOTS)
_PACKAGES = "|".join(PACKAGES)
KEY_RE = re.compile(rf"(?<![\w./\[-])(?:--)?((?:{_SECTIONS})(?:\.[a-z_][a-z0-9_]*)+)(?![\w(])")
TABLE_RE = re.compile(rf"\[((?:{_SECTIONS})(?:\.[a-z_][a-z0-9_]*)*)\](?:[ \t]+([a-z_][a-z0-9_]*)(?![\w(.]))?")
MODULE_RE = re.compile(r"(?<![\w./-])echo2(?:\.[A-Za-z_]\w*)+")
PATH_RE = re.compile(rf"(?<![\w./-])((?:{_ROOTS})/[\w./*{{}},-]*)")
PACKAGE_PATH_RE = re.compile(rf"(?<![\w./-])((?:{_PACKAGES})/(?:[\w]+/)*(?:\w+\.py)?)")
BARE_FILE_RE = re.compile(r"(?<![\w/.-])([\w-]+\.(?:py|sh))\b")
FILE_NAME_RE = re.compile(r"(?<![\w./-])((?:\w+/)*\w+\.py):\s+(\w+)")
MODULE_ATTR_RE = re.compile(r"(?<![\w./-])([a-z_]\w*)\.([A-Za-z_]\w*)\b(?!\.)")
COMMAND_RE = re.compile(r"(?<![\w./-])echo2[ \t]+(.*)")


def shell_part(code: Code) -> str:
    """What of a piece of code may hold commands: inline spans and shell blocks whole; in other
    blocks (output, diagrams, the layout) only `$ ` lines and the backtick spans inside them."""
    if code.lang is None or code.lang in ("bash", "sh", "shell", "console"):
        return code.text
    lines = [line.strip()[2:] for line in code.text.splitlines() if line.strip().startswith("$ ")]
    return "\n".join(lines + re.findall(r"`([^`\n]+)`", code.text))


def keys_in(code: str) -> list[str]:
    keys = []
    for m in KEY_RE.finditer(code):
        key = m.group(1)
        if key.rsplit(".", 1)[1] in FILE_EXTENSIONS | HOST_SUFFIXES:
            continue
        keys.append(key)
    for m in TABLE_RE.finditer(code):
        keys.append(m.group(1) + (f".{m.group(2)}" if m.group(2) else ""))
    return keys


def toml_keys(tree: dict, prefix: str = "") -> list[str]:
    keys = []
    for name, value in tree.items():
        key = f"{prefix}{name}"
        keys.append(key)
        if isinstance(value, dict):
            keys += toml_keys(value, key + ".")
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for item in value:
                keys += toml_keys(item, key + ".")
    return keys


def commands_in(code: str) -> list[list[str]]:
    """The words of each `echo2 ...` command in a piece of code."""
    code = re.sub(r"\\\n", " ", code)
    found = []
    for line in code.splitlines():
        line = re.sub(r"(?:^|\s)#.*", "", line)  # a shell comment
        for m in COMMAND_RE.finditer(line):
            rest = re.split(r"[;`)]|&&", m.group(1))[0]
            try:
                words = shlex.split(rest)
            except ValueError:
                words = rest.split()
            sub = re.match(r"[a-z][\w-]*", words[0]) if words else None
            if sub:  # `echo2 worker:` (a message) names the subcommand too
                found.append([sub.group(0), *words[1:]])
    return found


def paths_in(text: str) -> list[tuple[str, bool]]:
    """(path, is a markdown link target: relative to the doc's directory) in a line of text."""
    out = []
    links = {m.start(1) for m in re.finditer(r"\]\(([^)\s]+)\)", text)}
    for m in PATH_RE.finditer(text):
        path = m.group(1).split("#")[0].rstrip(".,:;)")
        out.append((path, m.start(1) in links))
    return out


def braces(path: str) -> list[str]:
    """`configs/qwen3-{4b,8b}-math.toml` -> both paths (one level of shell braces)."""
    m = re.search(r"\{([^{}]*,[^{}]*)\}", path)
    if not m:
        return [path]
    return [path[: m.start()] + part + path[m.end() :] for part in m.group(1).split(",")]


def check_path(path: str, root: Path = ROOT) -> str | None:
    if path in ALLOWED:
        return None
    for one in braces(path):
        if "*" in one:
            if not list(root.glob(one)):
                return "matches nothing"
        elif not (root / one).exists():
            return "does not exist"
    return None


@functools.cache
def file_names() -> frozenset[str]:
    """Names of the files under src/, tests/, bench/ and scripts/."""
    return frozenset(
        p.name for d in ("src", "tests", "bench", "scripts") for p in (ROOT / d).rglob("*") if p.is_file()
    )


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
    """Whether `a.b...` starts with a module of echo2 (`broadcast.plan`, `control.capacity.mu_min`)."""
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


def check_command(
    words: list[str], parser: dict[str, set[str]], schemas: dict[str, Schema]
) -> list[tuple[str, str, str]]:
    """Problems as (kind, name, why)."""
    problems = []
    sub, rest = words[0], words[1:]
    subs = [sub]
    while len(rest) >= 2 and rest[0] == "|":
        subs.append(rest[1])
        rest = rest[2:]
    for s in subs:
        if s not in parser:
            problems.append(("command", f"echo2 {s}", "no such subcommand"))
    if len(subs) > 1 or sub not in parser:
        return problems
    if "|" in rest:  # a pipe to another program
        rest = rest[: rest.index("|")]
    for word in rest:
        if not word.startswith("-") or word == "-" or re.fullmatch(r"-\d.*", word):
            continue
        for flag in word.split("=", 1)[0].split("/"):
            name = flag.lstrip("-")
            if "." in name:
                schema = OVERRIDES.get(sub)
                if schema is None:
                    problems.append(("flag", f"echo2 {sub} {flag}", "takes no config overrides"))
                elif not schemas[schema].has(name):
                    problems.append(("key", flag, f"not a key of the {schema} (echo2 {sub})"))
            elif flag not in parser[sub]:
                problems.append(("flag", f"echo2 {sub} {flag}", "no such option"))
    return problems


def check_doc(name: str, text: str, parser: dict[str, set[str]], schemas: dict[str, Schema]) -> list[Finding]:
    """Everything wrong in one doc."""
    findings: list[Finding] = []
    keys = schemas["config"]
    scenario = schemas["scenario"]

    def add(line: int, kind: str, what: str, why: str | None) -> None:
        if why and what not in ALLOWED:
            findings.append(Finding(name, line, kind, what, why))

    for code in code_of(text):
        if code.lang == "toml":
            try:
                tree = tomllib.loads(code.text)
            except tomllib.TOMLDecodeError as e:
                add(code.line, "toml", code.text.splitlines()[0] if code.text else "", f"does not parse: {e}")
                continue
            schema = schemas["pool"] if "workers" in tree and "learner" not in tree else None
            for key in toml_keys(tree):
                ok = schema.has(key) if schema else keys.has(key) or scenario.has(key)
                add(code.line, "key", key, None if ok else "in no schema")
            continue
        if code.lang not in ("python", "json"):
            for key in keys_in(code.text):
                if module_file(key):  # `broadcast.plan`: the module echo2.broadcast.plan
                    add(code.line, "module", key, check_module(f"echo2.{key}"))
                else:
                    add(code.line, "key", key, None if keys.has(key) or scenario.has(key) else "in no schema")
        for words in commands_in(shell_part(code)):
            for kind, what, why in check_command(words, parser, schemas):
                add(code.line, kind, what, why)
        for m in MODULE_RE.finditer(code.text):
            add(code.line, "module", m.group(0), check_module(m.group(0)))
        for m in PACKAGE_PATH_RE.finditer(code.text):
            add(code.line, "path", m.group(1), check_path(m.group(1), SRC / "echo2"))
        if code.lang is None:  # an inline span
            for m in FILE_NAME_RE.finditer(code.text):
                add(code.line, "module", m.group(0), check_file_name(*m.groups()))
        for m in MODULE_ATTR_RE.finditer(code.text):
            module, attr = m.groups()
            if module in module_names() and module not in SECTIONS + PACKAGES and attr not in FILE_EXTENSIONS:
                add(code.line, "module", m.group(0), check_module_attr(module, attr))
        for m in BARE_FILE_RE.finditer(code.text):
            add(code.line, "file", m.group(1), None if m.group(1) in file_names() else "no file of that name")
    here = (ROOT / name).parent
    for number, line in enumerate(text.splitlines(), 1):
        for path, is_link in paths_in(line):
            if not is_link:
                add(number, "path", path, check_path(path))
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if not re.match(r"[a-z]+:", target):
                add(number, "link", target, check_link(target, here, text))
    return findings


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a doc's headings: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    return {
        re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        for m in re.finditer(r"^#+\s+(.*)$", prose_of(markdown), re.M)
    }


def check_link(target: str, here: Path, text: str) -> str | None:
    """A relative link: its file exists (relative to the doc) and its `#anchor` is a heading there."""
    path, _, anchor = target.partition("#")
    if path and check_path(path, here):
        return "does not exist"
    if anchor and (path.endswith(".md") or not path):
        doc = (here / path).read_text() if path else text
        if anchor not in anchors(doc):
            return f"no heading #{anchor}"
    return None


@pytest.fixture(scope="module")
def parser() -> dict[str, set[str]]:
    return subcommands()


@pytest.fixture(scope="module")
def schemas() -> dict[str, Schema]:
    return {"config": config_schema(), "scenario": scenario_schema(), "pool": pool_schema()}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_names_only_what_exists(doc: Path, parser, schemas) -> None:
    findings = check_doc(str(doc.relative_to(ROOT)), doc.read_text(), parser, schemas)
    assert not findings, "\n".join(map(str, findings))


# ---------------------------------------------------------------------------- README's layout
def layout_names(text: str) -> list[tuple[int, str]]:
    """(line, path from the repository root) of every file and directory the README's layout block
    names, by the entry rule in this module's docstring."""
    section = text.split("\n## Layout", 1)[1]
    block = next(c for c in code_of(section) if c.lang is not None)
    first = (
        text.count("\n", 0, text.index("\n## Layout")) + 1 + section.count("\n", 0, section.index("```")) + 1
    )
    names: list[tuple[int, str]] = []
    root = entry_dir = current = ""
    for offset, line in enumerate(block.text.splitlines()):
        number = first + offset + 1
        indent = len(line) - len(line.lstrip(" "))
        words = line.split()
        if not words:
            continue
        rest = line
        if indent == 0:  # a top-level directory
            root = words[0] if words[0].endswith("/") else ""
            entry_dir = current = root
            names.append((number, root.rstrip("/")))
            rest = line[len(words[0]) :]
        elif indent == 2:  # an entry under the top-level directory
            head = words[0].rstrip(",")
            path = root + head
            entry_dir = current = path if head.endswith("/") else path.rsplit("/", 1)[0] + "/"
            names.append((number, path.rstrip("/")))
            rest = line[indent + len(words[0]) :]
        for m in re.finditer(
            r"(?<![\w/.`-])([a-z_][\w-]*/)(?![\w])|(?<![\w/.-])([\w-]+\.(?:py|sh|toml))\b", rest
        ):
            if m.group(1):
                current = entry_dir + m.group(1)
                names.append((number, current.rstrip("/")))
            else:
                names.append((number, current + m.group(2)))
    return names


def test_readme_layout_lists_every_module_and_nothing_else():
    names = layout_names((ROOT / "README.md").read_text())
    missing = [f"README.md:{line}: {path}" for line, path in names if not (ROOT / path).exists()]
    assert not missing, "the layout names what does not exist:\n" + "\n".join(missing)
    named = {path for _, path in names}
    modules = [p for p in (SRC / "echo2").rglob("*.py") if p.name != "__init__.py"]
    modules += (ROOT / "tests" / "adversarial").glob("*.py")
    unlisted = sorted(str(p.relative_to(ROOT)) for p in modules if str(p.relative_to(ROOT)) not in named)
    assert not unlisted, "README's layout does not name:\n" + "\n".join(unlisted)


# ---------------------------------------------------------------------------- architecture.md
def _load_test_imports():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_test_imports", Path(__file__).with_name("test_imports.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_architecture_names_the_rollout_source_methods():
    """The methods docs/architecture.md says the loop calls on a source are `RolloutSource`'s
    (read from learning/sources/__init__.py with `ast`: importing it would load torch)."""
    import ast

    tree = ast.parse((SRC / "echo2" / "learning" / "sources" / "__init__.py").read_text())
    protocol = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RolloutSource")
    methods = {n.name for n in protocol.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}
    text = (ROOT / "docs" / "architecture.md").read_text().replace("\n", " ")
    listed = re.search(r"`RolloutSource` methods on either \(([^)]*)\)", text)
    assert listed, "architecture.md no longer lists the RolloutSource methods (update this test)"
    named = set(re.findall(r"`(\w+)`", listed.group(1)))
    assert named == methods, f"doc: {sorted(named)}, code: {sorted(methods)}"


# ---------------------------------------------------------------------------- protocol.md
def refusal_rows() -> list[tuple[str, list[str], list[str]]]:
    """(status, class names, reasons) of each row of protocol.md's refusal table."""
    rows = []
    inside = False
    for line in (ROOT / "docs" / "protocol.md").read_text().splitlines():
        if line.startswith("| status | refusal"):
            inside = True
            continue
        if inside and not line.startswith("|"):
            break
        if inside and "---" not in line:
            cells = [c.strip() for c in line.strip("|").split("|")]
            classes = re.sub(r"\([^)]*\)", "", cells[1])  # "(an `Invalid`)": the family, not the class
            rows.append((cells[0], re.findall(r"`(\w+)`", classes), re.findall(r"`(\w+)`", cells[2])))
    return rows


def test_protocol_refusal_table_matches_errors_py():
    """Each refusal class in docs/protocol.md's table has the row's status; each reason there is
    answered with that status (errors.BY_ANSWER); every reason errors.py knows is in the table."""
    from echo2.wire import client, errors

    rows = refusal_rows()
    assert rows, "no refusal table in docs/protocol.md"
    problems = []
    listed: set[str] = set()
    for status, classes, reasons in rows:
        for name in classes:
            cls = getattr(errors, name, None) or getattr(client, name, None)
            if cls is None:
                problems.append(f"{name}: no such class")
            elif status.isdigit() and getattr(cls, "status", None) != int(status):
                problems.append(f"{name}: status {getattr(cls, 'status', None)}, the doc says {status}")
        listed |= set(reasons)
        if status.isdigit():
            for reason in reasons:
                if (int(status), reason) not in errors.BY_ANSWER and reason in set(errors.Reason):
                    problems.append(f"{reason}: not answered with {status}")
    unlisted = sorted(set(errors.Reason) - listed)
    assert not problems and not unlisted, "\n".join(problems + [f"reasons missing: {unlisted}"])


# ---------------------------------------------------------------------------- config.md
def config_md_fields() -> tuple[set[str], set[str]]:
    """(`section.field` of every row of docs/config.md's field table, a section cell carrying down;
    sections whose row links to another doc, which documents their fields)."""
    found: set[str] = set()
    elsewhere: set[str] = set()
    section = ""
    for line in (ROOT / "docs" / "config.md").read_text().splitlines():
        if not line.startswith("| ") or line.startswith("| ---"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or cells[0] == "section":
            continue
        section = cells[0].strip("`") or section
        if "(section)" in cells[1]:
            found.add(section)
            if re.search(r"\]\([\w/-]+\.md", cells[3]):
                elsewhere.add(section)
        found |= {f"{section}.{name}" for name in re.findall(r"`([a-z_]+)`", cells[1])}
    return found, elsewhere


def test_config_md_lists_every_field():
    """docs/config.md says it lists every config field: its table holds each leaf of the schema
    (sections whose fields are tables of their own, like `rollout.vllm`, count as sections; a
    section row that links to another doc, e.g. docs/fleet.md, covers its fields)."""
    schema = config_schema()
    documented, elsewhere = config_md_fields()
    sections = {k.rsplit(".", 1)[0] for k in schema.keys if "." in k}
    skip = schema.open | elsewhere
    leaves = {k for k in schema.keys if k not in sections and not any(k.startswith(o + ".") for o in skip)}
    assert not documented - schema.keys, f"not in the schema: {sorted(documented - schema.keys)}"
    assert not leaves - documented, f"not in docs/config.md: {sorted(leaves - documented)}"


# ---------------------------------------------------------------------------- the checker can fail
FAKE_DOC = """# A doc with one of each mistake

Set `rollout.kv_cache_gib` (wrong: it lives in `rollout.vllm`), or `[learner] nosuch`.

```bash
echo2 run configs/quickstart.toml --learner.lr=1e-6 --learner.no_such_key=3
echo2 fly configs/quickstart.toml
echo2 worker --coordinator URL --no-such-flag
echo2 worker --learner.lr=1e-6   # the worker takes no overrides
echo2 simulate scenarios/paper/fig4-broadcast.toml --broadcast.storage_mbps=10
```

```toml
[rollout.vllm]
kv_cache_gib = 2
no_such = 1
```

See src/echo2/no_such.py, `coordinator/no_such.py`, `state_ingest.py`, docs/no_such.md, `echo2.wire.errors.NoSuchClass`
`errors.no_such`, `data/buffer.py: NoSuchBuffer`, and `echo2.no_such`, [a heading that is not there](config.md#no-such-heading), [gone](no_such.md).
Fine: `echo2.wire.errors.Stale`, `learning/loop.py`, docs/config.md and
[config](config.md#several-gpus-fsdp2), `run.run()`, `learner.py`, `errors.from_answer`,
`metrics.jsonl`, `data/buffer.py: ReplayBuffer`.
"""


def test_the_checker_finds_each_kind_of_mistake(parser, schemas):
    findings = check_doc("docs/fake.md", FAKE_DOC, parser, schemas)
    got = {(f.kind, f.name) for f in findings}
    assert got == {
        ("key", "rollout.kv_cache_gib"),
        ("key", "learner.nosuch"),
        ("key", "learner.no_such_key"),  # once as a key in code,
        ("key", "--learner.no_such_key"),  # once as an override of `echo2 run`
        ("command", "echo2 fly"),
        ("flag", "echo2 worker --no-such-flag"),
        ("flag", "echo2 worker --learner.lr"),
        ("key", "rollout.vllm.no_such"),
        ("path", "src/echo2/no_such.py"),
        ("path", "coordinator/no_such.py"),
        ("file", "state_ingest.py"),
        ("path", "docs/no_such.md"),
        ("module", "echo2.wire.errors.NoSuchClass"),
        ("module", "echo2.no_such"),
        ("module", "errors.no_such"),
        ("module", "data/buffer.py: NoSuchBuffer"),
        ("link", "config.md#no-such-heading"),
        ("link", "no_such.md"),
    }, "\n".join(map(str, findings))


def test_the_layout_reader_resolves_entries():
    text = """x

## Layout

```
src/echo2/
  coordinator/state.py     the state; its halves state_ingest.py, and models.py
  sim/                 scenario.py, model.py
                       cli.py
tests/                 unit/ (pure), adversarial/ hostile.py
```
"""
    paths = [p for _, p in layout_names(text)]
    assert paths == [
        "src/echo2",
        "src/echo2/coordinator/state.py",
        "src/echo2/coordinator/state_ingest.py",
        "src/echo2/coordinator/models.py",
        "src/echo2/sim",
        "src/echo2/sim/scenario.py",
        "src/echo2/sim/model.py",
        "src/echo2/sim/cli.py",
        "tests",
        "tests/unit",
        "tests/adversarial",
        "tests/adversarial/hostile.py",
    ]
