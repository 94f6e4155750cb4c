"""The import graph of src/echo2, checked against `ALLOWED`: the one table of which top-level package
may import which, the architecture's single statement (docs/architecture.md shows it, generated
from it: `python tests/unit/test_imports.py` rewrites that block).

Reads the source with `ast` (nothing is imported). Package arrows count every import, lazy ones
(inside functions) included: a lazy import breaks a load-time cycle but not a circle of
responsibilities. Module cycles are checked on module-level imports (the load order) and, for two
modules importing each other, on lazy ones too. Imports under `TYPE_CHECKING` are not arrows.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

ALLOWED: dict[str, set[str]] = {
    # foundations: no other echo2 package
    "config": set(),
    "records": set(),
    "aio": set(),
    "metrics": set(),
    # the contract, the task, models and bytes
    "wire": {"aio", "config", "records"},
    "data": {"config", "records"},
    "models": {"config", "records"},
    "broadcast": {"config"},
    "gpu_env": {"config"},
    "preflight": {"config"},
    "tracking": {"config", "records"},
    # the worker
    "rollout": {"aio", "broadcast", "config", "data", "gpu_env", "models", "preflight", "records", "wire"},
    # who runs (the local provider starts rollout workers by their flags)
    "fleet": {"config", "rollout", "wire"},
    # the learner's HTTP service: never torch, rollout or learning
    "coordinator": {"broadcast", "config", "data", "fleet", "records", "wire"},
    "planning": {"config", "fleet", "rollout"},
    "sim": {"broadcast", "config", "data", "fleet", "planning", "records"},
    # the learner: the only package that builds a coordinator (learning/sources/)
    "learning": {
        "broadcast", "config", "coordinator", "data", "fleet", "gpu_env", "metrics", "models",
        "planning", "preflight", "records", "rollout", "tracking", "wire",
    },
    # entry points (lazy imports, after parsing)
    "api": {"config", "fleet", "learning", "metrics", "planning", "preflight", "rollout"},
    "cli": {"api", "config", "learning", "planning", "preflight", "rollout", "sim", "tracking"},
}  # fmt: skip
"""Top-level package -> the top-level packages it may import (lazy imports included). Exact: an
arrow the code no longer uses is an error too, so the table stays a true picture."""

NEVER = {"coordinator": {"torch", "echo2.rollout", "echo2.learning"}}
"""What a package's modules may not reach, through any chain of imports (lazy ones included)."""

PURE = [
    "echo2.learning.grpo",
    "echo2.data.buffer",
    "echo2.planning.capacity",
    "echo2.fleet.selection",
    "echo2.fleet.scheduler",
    "echo2.broadcast.plan",
    "echo2.broadcast.chunks",
    "echo2.broadcast.bucket",
    "echo2.broadcast.tracker",
    "echo2.broadcast.credits",
    "echo2.wire.errors",
    "echo2.coordinator.registry",
    "echo2.coordinator.leases",
    "echo2.coordinator.activation",
]
"""Policies and formulas shared by the runtime, the simulator and the tests (docs/architecture.md)."""

IO_LIBRARIES = {"aiohttp", "socket", "subprocess", "signal", "http", "urllib", "requests", "threading"}
"""Importing one of these makes a module an I/O module."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _top_level_imports(tree: ast.Module, module: str, is_package: bool) -> set[str]:
    """Absolute names imported at module level (also inside top-level try/if, not TYPE_CHECKING)."""
    found: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    prefix = ".".join(base)
                    name = f"{prefix}.{node.module}" if node.module else prefix
                else:
                    name = node.module or ""
                found.add(name)
                # `from echo2.x import y` may import the submodule echo2.x.y
                found.update(f"{name}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.If) and not _is_type_checking(node):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)

    visit(tree.body)
    return found


def _all_imports(tree: ast.Module, module: str, is_package: bool) -> set[str]:
    """Absolute names imported anywhere in the module, inside functions too (lazy imports)."""
    lazy = ast.Module(
        body=[n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)], type_ignores=[]
    )
    return _top_level_imports(lazy, module, is_package)


def _graph(*, lazy: bool = False) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(echo2 module -> echo2 modules it imports, echo2 module -> top-level libraries it imports):
    module-level imports, or with `lazy` every import (inside functions too)."""
    files = {_module_name(p): p for p in SRC.rglob("*.py")}
    internal: dict[str, set[str]] = {}
    external: dict[str, set[str]] = {}
    read = _all_imports if lazy else _top_level_imports
    for name, path in files.items():
        names = read(ast.parse(path.read_text()), name, path.name == "__init__.py")
        internal[name] = {n for n in names if n in files and n != name}
        external[name] = {n.split(".")[0] for n in names if not n.startswith("echo2")}
    return internal, external


def _io_modules(internal: dict[str, set[str]], external: dict[str, set[str]]) -> set[str]:
    return {m for m, libs in external.items() if libs & IO_LIBRARIES}


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    stack = [start]
    while stack:
        for nxt in graph[stack.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    white, grey, black = 0, 1, 2
    color = dict.fromkeys(graph, white)
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        color[node] = grey
        path.append(node)
        for nxt in sorted(graph[node]):
            if nxt.startswith(node + ".") or node.startswith(nxt + "."):
                continue  # a package and its own submodules load each other by design
            if color[nxt] == grey:
                return path[path.index(nxt) :] + [nxt]
            if color[nxt] == white and (found := dfs(nxt)):
                return found
        color[node] = black
        path.pop()
        return None

    for node in sorted(graph):
        if color[node] == white and (found := dfs(node)):
            return found
    return None


def _package(module: str) -> str:
    """The top-level package or module of echo2 that `module` belongs to (echo2.wire.client ->
    control, echo2.cli -> cli); the root package itself is its own."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _package_graph(internal: dict[str, set[str]]) -> dict[str, set[str]]:
    """Top-level package -> the top-level packages its modules import (arrows to the root
    `echo2/__init__.py` left out: it is the package every module loads first)."""
    graph: dict[str, set[str]] = {}
    for module, imports in internal.items():
        graph.setdefault(_package(module), set())
        for name in imports:
            if name != "echo2" and _package(name) != _package(module):
                graph[_package(module)].add(_package(name))
    return graph


def _arrow_edges(internal: dict[str, set[str]], a: str, b: str) -> list[str]:
    """The module imports behind the package arrow a -> b."""
    return [
        f"{m} -> {n}"
        for m in sorted(internal)
        if _package(m) == a
        for n in sorted(internal[m])
        if n != "echo2" and _package(n) == b
    ]


def test_package_imports_are_the_table():
    """Every arrow between top-level packages, lazy imports included, is one ALLOWED names, and
    every arrow ALLOWED names is used; every package is in the table."""
    internal, _ = _graph(lazy=True)
    packages = _package_graph(internal)
    missing = sorted(set(packages) - set(ALLOWED) - {"echo2"})
    assert not missing, f"packages not in ALLOWED: {missing}"
    assert not set(ALLOWED) - set(packages), f"ALLOWED names no package: {sorted(set(ALLOWED) - set(packages))}"
    extra = [
        f"{a} -> {b}: " + "; ".join(_arrow_edges(internal, a, b))
        for a in sorted(packages)
        if a != "echo2"
        for b in sorted(packages[a] - ALLOWED[a])
    ]
    assert not extra, "imports ALLOWED does not permit:\n" + "\n".join(extra)
    unused = [f"{a} -> {b}" for a in sorted(ALLOWED) for b in sorted(ALLOWED[a] - packages.get(a, set()))]
    assert not unused, "arrows in ALLOWED no import uses (remove them): " + ", ".join(unused)


def test_the_table_and_the_package_graph_have_no_cycle():
    """The table is layered one way, and so is the package graph with lazy imports counted."""
    assert _cycle(ALLOWED) is None, " -> ".join(_cycle(ALLOWED) or [])
    internal, _ = _graph(lazy=True)
    packages = _package_graph(internal)
    cycle = _cycle(packages)
    edges = [e for a, b in zip(cycle or [], (cycle or [])[1:], strict=False) for e in _arrow_edges(internal, a, b)]
    assert cycle is None, " -> ".join(cycle or []) + "\n" + "\n".join(edges)


@pytest.mark.parametrize("package", sorted(NEVER))
def test_what_a_package_never_reaches(package):
    """The coordinator never imports torch, rollout or learning, through any chain of imports."""
    internal, external = _graph(lazy=True)
    for module in sorted(m for m in internal if _package(m) == package):
        reached = _reachable(internal, module) | {module}
        libs = set().union(*(external[m] for m in reached))
        bad = sorted(
            n for n in NEVER[package] if n in libs or any(m == n or m.startswith(n + ".") for m in reached)
        )
        assert not bad, f"{module} reaches {bad}"


def table_markdown() -> str:
    """ALLOWED as docs/architecture.md shows it: one row per package, bottom layers last."""
    order, placed = [], set()
    while len(order) < len(ALLOWED):  # a package after everything it imports
        layer = sorted(p for p in ALLOWED if p not in placed and ALLOWED[p] <= placed)
        order.append(layer)
        placed.update(layer)
    rows = ["| layer | package | may import |", "| --- | --- | --- |"]
    for depth, layer in reversed(list(enumerate(order))):
        for package in layer:
            rows.append(f"| {depth} | `{package}` | {', '.join(sorted(ALLOWED[package])) or '(none)'} |")
    return "\n".join(rows)


BEGIN, END = "<!-- imports table: generated by tests/unit/test_imports.py -->", "<!-- end of imports table -->"
ARCHITECTURE = SRC.parent / "docs" / "architecture.md"


def test_architecture_doc_shows_the_table():
    text = ARCHITECTURE.read_text()
    assert BEGIN in text and END in text, f"docs/architecture.md has no block between {BEGIN!r} and {END!r}"
    shown = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert shown == table_markdown(), "docs/architecture.md's table is out of date: python tests/unit/test_imports.py"


def test_config_imports_no_other_package():
    """Config schemas are importable alone (prime-rl): pydantic and config's own modules only."""
    internal, external = _graph()
    packages = _package_graph(internal)
    assert packages["config"] == set(), f"config imports {sorted(packages['config'])}"
    libs = set().union(*(libs for m, libs in external.items() if _package(m) == "config"))
    assert "torch" not in libs, libs


def test_no_two_modules_import_each_other_even_lazily():
    """A lazy import breaks a load-time cycle but not a circle of responsibilities (api.py and cli.py,
    learning/device.py, distributed.py and step.py once imported each other inside functions)."""
    files = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph = {
        name: {
            n
            for n in _all_imports(ast.parse(path.read_text()), name, path.name == "__init__.py")
            if n in files
        }
        - {name}
        for name, path in files.items()
    }
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_module_import_graph_has_no_cycle():
    internal, _ = _graph()
    assert _cycle(internal) is None, " -> ".join(_cycle(internal) or [])


@pytest.mark.parametrize("module", PURE)
def test_pure_modules_reach_no_io_module(module):
    internal, external = _graph()
    assert module in internal, f"{module} is listed as pure but does not exist"
    io = _io_modules(internal, external)
    reached = _reachable(internal, module) | {module}
    assert not (reached & io), f"{module} reaches I/O modules {sorted(reached & io)}"


def test_the_checker_sees_a_cycle_and_an_io_arrow():
    """The checks above can fail: a cycle and an I/O import are found in a synthetic graph."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    modules = {
        "echo2": set(),
        "echo2.x.a": {"echo2.y", "echo2"},
        "echo2.y": {"echo2.x.b"},
        "echo2.x.b": set(),
    }
    assert _package_graph(modules) == {"echo2": set(), "x": {"y"}, "y": {"x"}}
    assert _cycle(_package_graph(modules)) == ["x", "y", "x"]
    assert _cycle(modules) is None, "no module cycle, only a package one"
    graph = {"pure": {"mid"}, "mid": {"net"}, "net": set()}
    assert "net" in _reachable(graph, "pure")
    assert _io_modules(graph, {"pure": set(), "mid": set(), "net": {"aiohttp"}}) == {"net"}
    tree = ast.parse(
        "import aiohttp\nif TYPE_CHECKING:\n    import socket\ntry:\n    from . import y\nexcept ImportError:\n    pass\n"
    )
    assert _top_level_imports(tree, "echo2.x", False) == {"aiohttp", "echo2", "echo2.y"}
    lazy = ast.parse("def f():\n    from echo2 import cli\n")
    assert _top_level_imports(lazy, "echo2.api", False) == set()
    assert _all_imports(lazy, "echo2.api", False) == {"echo2", "echo2.cli"}
    assert _package_graph({"echo2.x.a": {"echo2.y.b"}, "echo2.y.b": set()}) == {"x": {"y"}, "y": set()}
    lazy_cycle = ast.parse("def f():\n    from echo2.x import a\n")
    assert _all_imports(lazy_cycle, "echo2.y.b", False) & {"echo2.x"}, "lazy imports are arrows of the table"
    assert _cycle({"x": {"y"}, "y": {"x"}}) == ["x", "y", "x"]


if __name__ == "__main__":  # rewrite docs/architecture.md's table from ALLOWED
    text = ARCHITECTURE.read_text()
    head, rest = text.split(BEGIN, 1)
    ARCHITECTURE.write_text(head + BEGIN + "\n" + table_markdown() + "\n" + END + rest.split(END, 1)[1])
