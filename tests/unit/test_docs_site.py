"""The docs build as a site: `mkdocs build --strict` over mkdocs.yml (docs/*.md in its nav, README.md
as the home page through scripts/mkdocs_hooks.py) succeeds, so no page has a broken link or
`#anchor`, and no page under docs/ is left out of the nav. mkdocs-material is in the `test` extra."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from docs_support import ROOT


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
    reason="mkdocs or mkdocs-material is not installed (the `test` extra installs both)",
)
def test_docs_site_builds_strict(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's end-of-life banner, not a warning
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}{result.stderr}"
    assert (tmp_path / "site" / "index.html").is_file(), "no home page (README.md) in the site"
