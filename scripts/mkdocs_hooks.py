"""MkDocs hooks for the docs site (mkdocs.yml names this file under `hooks:`).

1. README.md is the site's home page: `on_files` adds it as index.md with each relative link made
   relative to docs/, where the page now sits (`docs/gpu.md` -> `gpu.md`, `configs/quickstart.toml`
   -> `../configs/quickstart.toml`). README.md itself is not touched, so its links keep working on
   GitHub.
2. A link out of docs/ (README's `configs/quickstart.toml`, a page's `../src/echo2/...`): the site
   carries no copy of the repository's other files and pyproject.toml names no repository URL to
   point it at, so `on_page_markdown` renders a link to a file or directory that exists in the
   repository as its text. A link to one that does not exist is left as written: mkdocs reports it
   (validation.links.not_found), and `mkdocs build --strict` fails on it like on any broken link.

Fenced code blocks are left alone: a `[x](y)` there is code, not a link.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(([^)\s]+)\)")
"""`[text](target)` or `![alt](target)`: the target has no spaces (the docs write none)."""
FENCE = re.compile(r"^\s*(```|~~~)")


def _relative(target: str) -> bool:
    """A relative link to a file: no scheme (`https:`, `mailto:`), not `/...`, not `#anchor` alone."""
    return not re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", target) and not target.startswith(("/", "#"))


def _links(markdown: str, rewrite) -> str:
    """`markdown` with rewrite(bang, text, target) -> str applied to each link outside fenced blocks."""
    out, fence = [], None
    for line in markdown.splitlines(keepends=True):
        m = FENCE.match(line)
        if m and fence is None:
            fence = m.group(1)
        elif m and line.strip().startswith(fence):
            fence = None
        elif fence is None:
            line = LINK.sub(lambda m: rewrite(*m.groups()), line)
        out.append(line)
    return "".join(out)


def readme_for_site(readme: str, docs_dir: Path) -> str:
    """README.md's text with its relative links made relative to docs_dir."""
    docs = docs_dir.resolve().as_posix()

    def rewrite(bang: str, text: str, target: str) -> str:
        if _relative(target):
            path, hash_, anchor = target.partition("#")
            moved = posixpath.relpath(posixpath.join(ROOT.as_posix(), path), docs)
            target = moved + ("/" if path.endswith("/") else "") + hash_ + anchor
        return f"{bang}[{text}]({target})"

    return _links(readme, rewrite)


def on_files(files, config):
    docs_dir = Path(config["docs_dir"])
    if files.get_file_from_path("index.md") is not None:
        raise PluginError("docs/index.md exists: the home page is README.md (scripts/mkdocs_hooks.py)")
    readme = (ROOT / "README.md").read_text()
    files.append(File.generated(config, "index.md", content=readme_for_site(readme, docs_dir)))
    return files


def on_page_markdown(markdown, page, config, files):
    docs_dir = Path(config["docs_dir"]).resolve()
    here = (docs_dir / page.file.src_uri).parent

    def rewrite(bang: str, text: str, target: str) -> str:
        if _relative(target) and not bang:
            path = (here / target.split("#", 1)[0]).resolve()
            if not path.is_relative_to(docs_dir) and path.is_relative_to(ROOT) and path.exists():
                return text
        return f"{bang}[{text}]({target})"

    return _links(markdown, rewrite)
