"""Every document names only things that exist: every config key, `echo2` command and flag, module,
file path and link named in README.md, docs/*.md and experiments/*/README.md is checked against
the code (issue 23, issue 26 item 9).

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
  name of some file under src/, tests/, bench/, experiments/ or scripts/ (so a renamed module's old
  name is found).
- **Links**: a relative markdown link's file must exist (relative to the doc) and its `#anchor`
  must be one of GitHub's anchors for a heading of that file.
- **Paths**: anywhere, words starting `src/echo2/`, `tests/`, `bench/`, `experiments/`, `scripts/`,
  `configs/`, `docs/`, `scenarios/` (not after `/` or a word character, so URLs are skipped), and in code
  package-relative module paths `learning/loop.py`, `control/` etc. (resolved under src/echo2/);
  a `#anchor` is dropped, a `*` is a glob that must match something.
The documents' own checks are beside this file: README.md's layout (test_docs_readme.py),
architecture.md (test_docs_architecture.py), protocol.md (test_docs_protocol.py), config.md
(test_docs_config.py), the site they build (test_docs_site.py); what they share is
tests/docs_support.py. The last test here checks that the checker finds each kind of mistake it
should, on a made-up doc.

ALLOWED lists what a doc may name that is not ours (or no longer exists, on purpose), with the reason.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from docs_support import (
    ROOT,
    SRC,
    Code,
    Schema,
    anchors,
    check_file_name,
    check_module,
    check_module_attr,
    code_of,
    config_schema,
    file_names,
    module_file,
    module_names,
    pool_schema,
    scenario_schema,
    subcommands,
)

DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "experiments").rglob("README.md")),
]

SECTIONS = ("model", "task", "rollout", "learner", "coordinator", "scheduler", "broadcast", "run")
PATH_ROOTS = ("src/echo2", "tests", "bench", "experiments", "scripts", "configs", "docs", "scenarios")
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
    "experiments/STUDY/NAME.py": "placeholder: any study's script",
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
