"""docs/gpu.md's commands, each read from the doc itself and run on any machine, as
tests/e2e/test_readme_gpu.py does for the README's GPU section.

- ```bash blocks: every line is a command. `echo2 ...` is run with `--dry-run` appended (unless it
  is there already), `echo2 plan ...` as written; under `torchrun ... -m echo2.cli ARGS` the ARGS
  are run with `--dry-run`, what each rank parses; `VAR=value` before a command is its environment.
  The commands that need a GPU, the network or an install are NOT_RUN, each with its reason; a
  line that is neither fails the test until it is run or listed.
- Inline spans: a complete `echo2 SUB ARG...` (table cells like "`echo2 run configs/tiny.toml`")
  is run the same way. A span with a placeholder (`CONFIG`, `RUN.toml`, `...`, `[--gpus N]`) is a
  synopsis and a bare `echo2 SUB` a mention: neither is run; MENTIONS are the spans with arguments
  that name a command or flag without being one to type.

Host placeholders (`LEARNER_HOST`, any `*_HOST`) become 127.0.0.1: a dry run connects to nothing.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from docs_support import code_of

ROOT = Path(__file__).parents[2]
DOC = ROOT / "docs" / "gpu.md"
TEXT = DOC.read_text()
HOST = re.compile(r"\b[A-Z][A-Z0-9_]*_HOST\b")
PLACEHOLDER = re.compile(r"\.\.\.|\[|\b[A-Z][A-Z0-9_]{2,}\b")

NOT_RUN = {
    "hf download": "downloads a model or data set from the Hugging Face Hub: needs the network and tens of GB",
    "bash scripts/gpu_check": "the GPU checks themselves (gpu_check.sh, gpu_check_offline.sh): need a CUDA device",
    "bash scripts/setup.sh": "installs packages; its routes are played with a fake pip in tests/unit/test_install_routes.py",
    "nvidia-smi": "reads the NVIDIA driver: needs a GPU",
}
"""Prefixes of the bash lines not run here, each with its reason. torchrun itself is not run either:
its `-m echo2.cli ...` part is (one process per GPU needs the GPUs)."""

MENTIONS = {
    "echo2 plan --memory": "names the memory plan; its synopsis is the first line of the section",
    "echo2 worker --dry-run": "names the flag whose output tests/unit/test_engines.py checks (it also "
    "passes --coordinator and --token, which a worker needs)",
}
"""Inline spans with arguments that name a command or a flag rather than give one to type."""


@dataclass
class Command:
    line: int
    argv: list[str]  # what echo2.cli parses: the words after `echo2` (or `-m echo2.cli`)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def shown(self) -> str:
        return "echo2 " + shlex.join(self.argv)


def bash_lines() -> list[tuple[int, str]]:
    """(line number, text) of each command in the ```bash blocks, `\\`-continued lines joined."""
    found, inside, pending = [], False, None
    for number, line in enumerate(TEXT.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            inside = stripped == "```bash"
            continue
        if not inside or not stripped or stripped.startswith("#"):
            continue
        start, text = pending or (number, "")
        text += line.rstrip("\\").strip() + " "
        pending = (start, text) if line.rstrip().endswith("\\") else None
        if pending is None:
            found.append((start, text.strip()))
    return found


def classify(line: int, text: str) -> Command | str:
    """The command to run for a bash line, or the reason it is not run."""
    words = shlex.split(HOST.sub("127.0.0.1", text), comments=True)
    env = {}
    while words and re.fullmatch(r"[A-Z0-9_]+=.*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if words[:1] == ["echo2"]:
        return Command(line, words[1:], env)
    if "echo2.cli" in words and words[words.index("echo2.cli") - 1] == "-m":
        return Command(line, words[words.index("echo2.cli") + 1 :], env)
    joined = " ".join(words)
    for prefix, reason in NOT_RUN.items():
        if joined.startswith(prefix):
            return reason
    return ""


def inline_commands() -> list[Command]:
    found = []
    for code in code_of(TEXT):
        text = HOST.sub("127.0.0.1", code.text.strip())
        if code.lang is not None or not text.startswith("echo2 ") or len(text.split()) < 3:
            continue  # a block, not a command, or a bare `echo2 SUB`
        if PLACEHOLDER.search(text) or text in MENTIONS:
            continue
        found.append(Command(code.line, shlex.split(text)[1:]))
    return found


def runnable() -> list[Command]:
    """Every command to run, bash blocks first, each command once (at its first line)."""
    commands = [c for c in (classify(*bl) for bl in bash_lines()) if isinstance(c, Command)]
    commands += inline_commands()
    seen, unique = set(), []
    for c in commands:
        key = (c.shown, tuple(sorted(c.env.items())))
        if key not in seen:
            seen.add(key)
            unique.append(c)
    return unique


def echo2(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "echo2.cli", *argv],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src"), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_every_bash_line_is_run_or_listed():
    lines = bash_lines()
    assert lines, "docs/gpu.md has no ```bash block (update this test)"
    unclassified = [f"docs/gpu.md:{n}: {t}" for n, t in lines if classify(n, t) == ""]
    assert not unclassified, "run these in this test, or add them to NOT_RUN with the reason:\n" + "\n".join(
        unclassified
    )


@pytest.mark.parametrize("command", runnable(), ids=lambda c: f"gpu.md:{c.line} {c.shown}")
def test_command_runs(command: Command):
    """`echo2 plan` as written (it reads and prints, exit 0 when the plan fits); the rest with
    --dry-run, which validates the config, flags and engine settings and starts nothing."""
    argv = list(command.argv)
    if argv[0] != "plan" and "--dry-run" not in argv:
        argv.append("--dry-run")
    done = echo2(argv, command.env)
    assert done.returncode == 0, (
        f"docs/gpu.md:{command.line}: {command.shown} -> exit {done.returncode}\n"
        f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    )


def test_memory_plan_prints_what_the_doc_shows():
    """The output block after "`echo2 plan --memory configs/qwen3-4b-math.toml --gpu h200` (exit 0):"
    is an excerpt of what the command prints: each of its lines, in order."""
    span = "`echo2 plan --memory configs/qwen3-4b-math.toml --gpu h200` (exit 0):"
    assert span in TEXT, "docs/gpu.md no longer shows the Qwen3-4B memory plan (update this test)"
    shown = TEXT.split(span, 1)[1].split("```", 2)[1].strip("\n").splitlines()
    done = echo2(shlex.split(span.split("`")[1])[1:], {})
    assert done.returncode == 0, done.stdout + done.stderr
    printed = iter(done.stdout.splitlines())
    missing = [line for line in shown if not any(line.rstrip() == out.rstrip() for out in printed)]
    assert not missing, "docs/gpu.md shows lines the plan does not print (in this order):\n" + "\n".join(
        missing
    )
