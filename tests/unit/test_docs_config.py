"""docs/config.md: its field table lists every field of the run config's schema, and nothing
the schema lacks."""

from __future__ import annotations

import re

from docs_support import ROOT, config_schema


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
