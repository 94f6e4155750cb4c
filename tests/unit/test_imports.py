"""The import graph of src/echo2: no cycles between modules nor between top-level packages, and
arrows only from I/O code to pure code.

Reads the source with `ast` (nothing is imported), so it sees the module-level imports that decide
the load order; imports inside functions (the CLI's lazy imports) and under `TYPE_CHECKING` are
not arrows of the graph.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

PURE = [
    "echo2.learning.grpo",
    "echo2.data.buffer",
    "echo2.control.capacity",
    "echo2.control.selection",
    "echo2.control.scheduler",
    "echo2.broadcast.plan",
    "echo2.broadcast.chunks",
    "echo2.broadcast.bucket",
    "echo2.control.errors",
    "echo2.control.registry",
    "echo2.control.leases",
    "echo2.control.fleet",
    "echo2.control.credits",
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


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(echo2 module -> echo2 modules it imports, echo2 module -> top-level libraries it imports)."""
    files = {_module_name(p): p for p in SRC.rglob("*.py")}
    internal: dict[str, set[str]] = {}
    external: dict[str, set[str]] = {}
    for name, path in files.items():
        names = _top_level_imports(ast.parse(path.read_text()), name, path.name == "__init__.py")
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
    """The top-level package or module of echo2 that `module` belongs to (echo2.control.client ->
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


def test_the_package_graph_has_no_cycle():
    """Packages are layered one way (docs/architecture.md): config and records at the bottom, the
    broadcast byte layer, the control plane, rollout, learning, then the CLI."""
    internal, _ = _graph()
    packages = _package_graph(internal)
    cycle = _cycle(packages)
    edges = [
        f"{m} -> {n}"
        for a, b in zip(cycle or [], (cycle or [])[1:], strict=False)
        for m in sorted(internal)
        if _package(m) == a
        for n in sorted(internal[m])
        if n != "echo2" and _package(n) == b
    ]
    assert cycle is None, " -> ".join(cycle or []) + "\n" + "\n".join(edges)


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


def test_the_import_graph_has_no_cycle():
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
