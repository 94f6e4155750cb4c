"""Every figure in README.md and docs/*.md can be traced to how it was made (issue 23, "Evidence that
holds": no figure without the command that reproduces it and its raw output committed).

A figure is a markdown image `![...](PATH.png)`. For each one:

- the PNG exists (relative to the doc);
- its section (from the heading above it to the next heading of any level; `#` lines inside fenced
  blocks are not headings) names at least one of:
  - **a command that produces it**: `python bench/X.py`, `python experiments/STUDY/X.py` or
    `python scripts/X.py`, `scripts/X.sh`
    (with or without `bash `), where the script exists and the command's own text or the script's
    source names the PNG's file name (`--plot docs/bench/bubble.png`, `"plot": "docs/staleness.png"`);
    or `echo2 SUB ...` with SUB one of the CLI's subcommands, when the command's text names the PNG's
    file name (`echo2 simulate ... --plot docs/reproduction/fig4.png`) or the section calls the
    image a screenshot (of the page that command serves);
  - **its raw output**: a committed file under docs/bench/ or docs/reproduction/ with the PNG's own
    stem and another extension (`docs/reproduction/fig4.json` for `fig4.png`), written as a path
    from the repository root, from the doc's directory, or as a bare file name.

The last tests check that the reader finds the mistakes it should, on made-up docs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RAW_DIRS = (ROOT / "docs" / "bench", ROOT / "docs" / "reproduction")

IMAGE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+\.png)>?(?:\s+\"[^\"]*\")?\s*\)")
SCRIPT_CMD = re.compile(
    r"(?:python3?\s+)((?:bench|experiments|scripts)/[\w./-]+\.py)|(?<![\w/])((?:\./)?scripts/[\w./-]+\.sh)"
)
ECHO2_CMD = re.compile(r"(?<![\w/-])echo2\s+([a-z][\w-]*)")
RAW = re.compile(r"(?<![\w-])((?:docs/)?(?:bench|reproduction)/)?([\w.-]+\.(?:json|jsonl|md|csv|txt|log))\b")


@dataclass(frozen=True)
class Figure:
    doc: Path
    line: int
    target: str
    section: str  # the text of its section


def sections(text: str) -> list[tuple[int, int]]:
    """(first line, last line), 1-based and inclusive, of each section: a heading up to the next."""
    starts = [1]
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6}\s", line) and number != 1:
            starts.append(number)
    total = len(text.splitlines())
    return [(a, (starts[i + 1] - 1) if i + 1 < len(starts) else total) for i, a in enumerate(starts)]


def figures(doc: Path, text: str | None = None) -> list[Figure]:
    text = doc.read_text() if text is None else text
    lines = text.splitlines()
    found = []
    for first, last in sections(text):
        body = "\n".join(lines[first - 1 : last])
        for offset, line in enumerate(lines[first - 1 : last]):
            for m in IMAGE.finditer(line):
                found.append(Figure(doc, first + offset, m.group(1), body))
    return found


def _subcommands() -> set[str]:
    import argparse

    from echo2 import cli

    parser = cli._parser()
    return {
        name
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
        for name in action.choices
    }


def _command_lines(section: str) -> list[str]:
    """Logical lines of the section (a trailing backslash continues a line)."""
    return section.replace("\\\n", " ").splitlines()


def producing_commands(fig: Figure, root: Path = ROOT, subcommands: set[str] | None = None) -> list[str]:
    """The commands in the figure's section that produce it (see the module docstring)."""
    name = Path(fig.target).name
    found = []
    for line in _command_lines(fig.section):
        for m in SCRIPT_CMD.finditer(line):
            rel = (m.group(1) or m.group(2)).removeprefix("./")
            script = root / rel
            if not script.is_file():
                continue
            if name in line or name in script.read_text(errors="replace"):
                found.append(rel)
        screenshot = "screenshot" in fig.section.lower()
        for m in ECHO2_CMD.finditer(line):
            known = m.group(1) in (subcommands if subcommands is not None else _subcommands())
            if known and (name in line[m.start() :] or screenshot):
                found.append(f"echo2 {m.group(1)}")
    return found


def raw_outputs(fig: Figure, root: Path = ROOT) -> list[str]:
    """Committed raw output files with the figure's stem that its section names."""
    stem = Path(fig.target).stem
    raw_dirs = [root / "docs" / "bench", root / "docs" / "reproduction"]
    found = []
    for m in RAW.finditer(fig.section):
        prefix, filename = m.group(1) or "", m.group(2)
        if Path(filename).stem != stem:
            continue
        if prefix:
            base = root / ("docs/" + prefix.removeprefix("docs/"))
            candidates = [base / filename]
        else:
            candidates = [d / filename for d in raw_dirs]
        found += [str(c.relative_to(root)) for c in candidates if c.is_file()]
    return found


def problems(fig: Figure, root: Path = ROOT, subcommands: set[str] | None = None) -> list[str]:
    where = f"{fig.doc.relative_to(root)}:{fig.line}: {fig.target}"
    image = (fig.doc.parent / fig.target).resolve()
    out = []
    if not image.is_file():
        out.append(f"{where}: the image does not exist")
    if not producing_commands(fig, root, subcommands) and not raw_outputs(fig, root):
        out.append(
            f"{where}: its section names neither a command that produces it nor its raw output "
            f"(a committed file docs/bench/ or docs/reproduction/{Path(fig.target).stem}.<not png>)"
        )
    return out


def all_figures() -> list[Figure]:
    return [f for doc in DOCS for f in figures(doc)]


# ---------------------------------------------------------------------------- the docs
def test_docs_have_figures():
    found = all_figures()
    assert len(found) >= 10, found  # README's two, benchmarks' two, reproduction's, staleness'
    assert {f.doc.name for f in found} >= {"README.md", "benchmarks.md", "reproduction.md"}


def test_every_figure_exists_and_is_traced():
    subs = _subcommands()
    found = [p for fig in all_figures() for p in problems(fig, ROOT, subs)]
    assert not found, "figures without their source:\n" + "\n".join(found)


# ---------------------------------------------------------------------------- the reader itself
@pytest.fixture
def tree(tmp_path):
    (tmp_path / "docs" / "bench").mkdir(parents=True)
    (tmp_path / "docs" / "reproduction").mkdir()
    (tmp_path / "bench").mkdir()
    (tmp_path / "scripts").mkdir()
    for png in ("docs/bench/a.png", "docs/bench/b.png", "docs/reproduction/c.png", "docs/shot.png"):
        (tmp_path / png).write_bytes(b"\x89PNG")
    (tmp_path / "docs/reproduction/c.json").write_text("{}")
    (tmp_path / "bench/plot_a.py").write_text('OUT = "docs/bench/a.png"\n')
    (tmp_path / "bench/other.py").write_text("print('no plot')\n")
    return tmp_path


def _check(tree: Path, text: str) -> list[str]:
    doc = tree / "docs" / "x.md"
    doc.write_text(text)
    return [p for fig in figures(doc, text) for p in problems(fig, tree, {"run", "simulate"})]


def test_reader_accepts_a_producing_script(tree):
    assert _check(tree, "# A\n\n```bash\npython bench/plot_a.py --json x\n```\n\n![a](bench/a.png)\n") == []


def test_reader_accepts_a_command_naming_the_png(tree):
    text = "# B\n\n```bash\npython bench/other.py \\\n  --plot docs/bench/b.png\n```\n\n![b](bench/b.png)\n"
    assert _check(tree, text) == []


def test_reader_accepts_raw_output_in_any_spelling(tree):
    for ref in ("docs/reproduction/c.json", "reproduction/c.json", "`c.json`"):
        assert _check(tree, f"# C\n\nRaw output: {ref}.\n\n![c](reproduction/c.png)\n") == [], ref


def test_reader_rejects_a_missing_image(tree):
    (found,) = _check(tree, "# A\n\n`python bench/plot_a.py`\n\n![gone](bench/gone.png)\n")[:1]
    assert "does not exist" in found


def test_reader_rejects_a_section_without_source(tree):
    found = _check(tree, "# A\n\n`python bench/plot_a.py`\n\n## Below\n\n![a](bench/a.png)\n")
    assert len(found) == 1 and "neither a command" in found[0]  # the command is in another section


def test_reader_rejects_commands_that_do_not_produce_it(tree):
    # a script that exists but does not write this PNG; a script that does not exist; another
    # figure's raw output; a raw output that is not committed; an echo2 command, not a screenshot
    for text in (
        "# A\n\n`python bench/other.py`\n\n![b](bench/b.png)\n",
        "# A\n\n`python bench/missing.py --plot docs/bench/b.png`\n\n![b](bench/b.png)\n",
        "# A\n\nRaw output: docs/reproduction/c.json\n\n![b](bench/b.png)\n",
        "# A\n\nRaw output: docs/bench/b.json\n\n![b](bench/b.png)\n",
        "# A\n\n`echo2 run configs/tiny.toml`\n\n![b](shot.png)\n",
    ):
        found = _check(tree, text)
        assert len(found) == 1 and "neither a command" in found[0], text


def test_reader_accepts_an_echo2_command_naming_the_png(tree):
    text = "# D\n\n`echo2 simulate s.toml --json --plot docs/bench/b.png`\n\n![b](bench/b.png)\n"
    assert _check(tree, text) == []
    assert _check(tree, text.replace("echo2 simulate", "echo2 nosuch")) != []


def test_reader_screenshot_of_an_echo2_command(tree):
    text = "# S\n\nA browser screenshot of the page `echo2 run configs/tiny.toml` serves:\n\n![s](shot.png)\n"
    assert _check(tree, text) == []
    assert _check(tree, text.replace("echo2 run", "echo2 nosuch")) != []


def test_reader_ignores_hash_lines_in_fences(tree):
    text = "# A\n\n```bash\n# as root\npython bench/plot_a.py\n```\n\n![a](bench/a.png)\n"
    assert _check(tree, text) == []
