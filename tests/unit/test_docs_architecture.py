"""docs/architecture.md: its list of the `RolloutSource` methods the loop calls is the protocol's
(its package table is tests/unit/test_imports.py's)."""

from __future__ import annotations

import re

from docs_support import ROOT, SRC


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
