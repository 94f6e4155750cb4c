"""experiments/staleness/staleness_report.py (issue 23's powered staleness study): arms, seed-paired comparisons and
their wording, on rows worked by hand."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def sr():
    return importlib.import_module("staleness_report")  # experiments/staleness/ on sys.path: conftest.py


def rows(arm: dict[tuple[int, str], list[float]]) -> list[dict]:
    return [
        {
            "lag": lag,
            "correction": c,
            "seed": s,
            "accuracy_last3": v,
            "name": f"lag={lag},correction={c},seed={s}",
        }
        for (lag, c), values in arm.items()
        for s, v in enumerate(values)
    ]


def test_arm_means_and_a_paired_difference_worked_by_hand(sr):
    rep = sr.report(rows({(0, "clip"): [0.80, 0.70, 0.90], (8, "clip"): [0.78, 0.69, 0.86]}))
    lag0 = next(a for a in rep["arms"] if a["arm"] == "lag 0 clip")
    assert lag0["n"] == 3 and lag0["mean"] == pytest.approx(0.80)
    # sd 0.1, se 0.1/sqrt(3), t(0.975, 2) = 4.303: 0.80 +- 0.2484
    assert lag0["ci95"] == pytest.approx([0.80 - 0.24843, 0.80 + 0.24843], abs=1e-4)
    c = next(c for c in rep["comparisons"] if c["a"] == "lag 8 clip" and c["b"] == "lag 0 clip")
    # differences -0.02, -0.01, -0.04: mean -0.02333, sd 0.015275, se 0.008819, half-width 0.03795
    assert c["n_pairs"] == 3 and c["diff"] == pytest.approx(-0.023333, abs=1e-5)
    assert c["ci95"] == pytest.approx([-0.023333 - 0.037946, -0.023333 + 0.037946], abs=1e-4)
    assert c["verdict"] == "costs at most 0.10"  # contains 0, low end above -0.10
    # an arm with no rows has neither a mean nor an interval
    lag4 = next(a for a in rep["arms"] if a["arm"] == "lag 4 clip")
    assert lag4["n"] == 0 and "mean" not in lag4


@pytest.mark.parametrize(
    ("low", "high", "expected"),
    [
        (0.01, 0.2, "higher"),
        (-0.2, -0.01, "lower"),
        (-0.05, 0.03, "costs at most 0.10"),
        (-0.3, 0.1, "not resolved"),
    ],
)
def test_verdict_rules(sr, low, high, expected):
    assert sr.verdict(low, high, 0.10) == expected


def test_only_seeds_in_both_arms_are_paired(sr):
    rep = sr.report(rows({(0, "clip"): [0.8, 0.7, 0.9, 0.6], (4, "clip"): [0.7, 0.8]}))
    c = next(c for c in rep["comparisons"] if c["a"] == "lag 4 clip")
    assert c["seeds"] == [0, 1] and c["diff"] == pytest.approx(0.0)


def test_command_line_writes_json_and_markdown(tmp_path):
    src = tmp_path / "rows.json"
    src.write_text(
        json.dumps({"settings": {}, "rows": rows({(0, "clip"): [0.8, 0.7], (8, "clip"): [0.7, 0.75]})})
    )
    out_json, out_md, png = tmp_path / "r.json", tmp_path / "r.md", tmp_path / "r.png"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "experiments" / "staleness" / "staleness_report.py"),
            str(src),
            "--json",
            str(out_json),
            "--md",
            str(out_md),
            "--plot",
            str(png),
        ],
        check=True,
        capture_output=True,
    )
    assert json.loads(out_json.read_text())["arms"][0]["n"] == 2
    assert "| lag 8 clip - lag 0 clip | 2 |" in out_md.read_text()
    assert png.stat().st_size > 0


def test_curves_average_the_seeds_at_each_evaluation(sr):
    curve = lambda acc: {"eval_step": [0, 8, 16], "eval_accuracy": acc}  # noqa: E731
    rs = [
        {"lag": 0, "correction": "clip", "seed": 0, "curve": curve([0.4, 0.6, 0.8])},
        {"lag": 0, "correction": "clip", "seed": 1, "curve": curve([0.4, 0.8, 0.6])},
        {"lag": 8, "correction": "clip", "seed": 0, "curve": curve([0.4, 0.5, 0.5])},  # one seed: no curve
    ]
    c = sr.curves(rs)
    assert c["lag 0 clip"]["step"] == [0, 8, 16] and c["lag 0 clip"]["mean"] == pytest.approx([0.4, 0.7, 0.7])
    assert c["lag 0 clip"]["low"][0] == pytest.approx(0.4) and c["lag 8 clip"]["step"] == []


def _study(tmp_path, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "staleness" / "staleness_study.py"), *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )


def test_study_merge_joins_files_and_refuses_a_row_twice_or_other_settings(tmp_path):
    """staleness_study --merge: the files several instances wrote (one per seed on a GPU machine, or
    one per core) become one results file, table and plot; a row in two files, or files run with
    other settings, are refused (exit status != 0, nothing written)."""
    study = json.loads((ROOT / "docs" / "bench" / "staleness_powered.json").read_text())
    a, b = study["rows"][:2], study["rows"][2:4]
    for name, part, settings in (("a", a, study["settings"]), ("b", b, study["settings"])):
        (tmp_path / f"{name}.json").write_text(json.dumps({"settings": settings, "rows": part}))
    out = ["--json", "m.json", "--table", "m.md", "--plot", "m.png"]
    done = _study(tmp_path, "--merge", "a.json", "b.json", *out)
    assert done.returncode == 0, done.stderr
    merged = json.loads((tmp_path / "m.json").read_text())
    assert [r["name"] for r in merged["rows"]] == [r["name"] for r in a + b]
    assert (tmp_path / "m.png").stat().st_size > 0 and "| `" in (tmp_path / "m.md").read_text()

    twice = _study(
        tmp_path, "--merge", "a.json", "a.json", "--json", "t.json", "--table", "t.md", "--plot", "t.png"
    )
    assert twice.returncode != 0 and "in two files" in twice.stderr and not (tmp_path / "t.json").exists()
    other = {**study["settings"], "steps": 14}
    (tmp_path / "c.json").write_text(json.dumps({"settings": other, "rows": b}))
    mixed = _study(
        tmp_path, "--merge", "a.json", "c.json", "--json", "x.json", "--table", "x.md", "--plot", "x.png"
    )
    assert mixed.returncode != 0 and "other settings" in mixed.stderr and not (tmp_path / "x.json").exists()
