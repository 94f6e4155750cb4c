"""docs/protocol.md: its refusal table matches wire/errors.py (each class's status, each reason's
answer, every reason listed)."""

from __future__ import annotations

import re

from docs_support import ROOT


def refusal_rows() -> list[tuple[str, list[str], list[str]]]:
    """(status, class names, reasons) of each row of protocol.md's refusal table."""
    rows = []
    inside = False
    for line in (ROOT / "docs" / "protocol.md").read_text().splitlines():
        if line.startswith("| status | refusal"):
            inside = True
            continue
        if inside and not line.startswith("|"):
            break
        if inside and "---" not in line:
            cells = [c.strip() for c in line.strip("|").split("|")]
            classes = re.sub(r"\([^)]*\)", "", cells[1])  # "(an `Invalid`)": the family, not the class
            rows.append((cells[0], re.findall(r"`(\w+)`", classes), re.findall(r"`(\w+)`", cells[2])))
    return rows


def test_protocol_refusal_table_matches_errors_py():
    """Each refusal class in docs/protocol.md's table has the row's status; each reason there is
    answered with that status (errors.BY_ANSWER); every reason errors.py knows is in the table."""
    from echo2.wire import client, errors

    rows = refusal_rows()
    assert rows, "no refusal table in docs/protocol.md"
    problems = []
    listed: set[str] = set()
    for status, classes, reasons in rows:
        for name in classes:
            cls = getattr(errors, name, None) or getattr(client, name, None)
            if cls is None:
                problems.append(f"{name}: no such class")
            elif status.isdigit() and getattr(cls, "status", None) != int(status):
                problems.append(f"{name}: status {getattr(cls, 'status', None)}, the doc says {status}")
        listed |= set(reasons)
        if status.isdigit():
            for reason in reasons:
                if (int(status), reason) not in errors.BY_ANSWER and reason in set(errors.Reason):
                    problems.append(f"{reason}: not answered with {status}")
    unlisted = sorted(set(errors.Reason) - listed)
    assert not problems and not unlisted, "\n".join(problems + [f"reasons missing: {unlisted}"])
