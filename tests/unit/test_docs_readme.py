"""README.md's layout block names every module under src/echo2/ (but `__init__.py`) and
tests/adversarial/, and every name there exists. An entry is a line indented two spaces whose
first word is a path (`coordinator/state.py`, `sim/`, `tests/`); bare `name.py` words in it and
its deeper-indented continuation lines are in the entry's directory, or in the subdirectory the
last `dir/` word before them named. The last test checks the reader on a made-up layout."""

from __future__ import annotations

import re

from docs_support import ROOT, SRC, code_of


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
