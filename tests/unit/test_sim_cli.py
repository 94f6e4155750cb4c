"""`echo2 simulate` from the command line: scenario files and their errors (exit 2 naming the key or
file), JSON, timeline and sweep plots, and the paper's scenarios validating."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from echo2.cli import main
from echo2.sim.scenario import expand, load_tree

PAPER = sorted(Path(__file__).resolve().parents[2].joinpath("scenarios", "paper").glob("*.toml"))


# ---------------------------------------------------------------------------- scenario files, CLI
def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "s.toml"
    path.write_text(text)
    return str(path)


SMALL = """
steps = 6
[learner]
t_train = 10.0
batch = 16
group_size = 4
staleness = 2
snapshot_gb = 0.1
[[workers]]
name = "w"
count = 3
throughput = 2.0
"""


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ("[broadcast]\nuplink = 3\n", "broadcast.uplink"),
        ("[[faults]]\nworker = 'nobody'\nkind = 'drop'\nat_s = 1.0\n", "faults.0.worker"),
        ("[[faults]]\nworker = 'w-0'\nkind = 'drop'\n", "at_s"),
        ("[sweep]\nx = 'workers.0.count'\nvalues = [1, 0]\n", "workers.0.count"),
        # every worker is a seed with an unlimited uplink: no forwarder to fail (found while running)
        ("[[faults]]\nworker = 'forwarder'\nkind = 'drop'\nstage = 'link'\nat_s = 15.0\n", "faults.0.worker"),
        ("[sweep]\n[[sweep.series]]\nset = { 'learner.batch' = 15 }\n", "learner.batch"),
    ],
)
def test_bad_scenario_exits_2_naming_the_key(tmp_path, capsys, extra, key):
    assert main(["simulate", write(tmp_path, SMALL + extra)]) == 2
    assert key in capsys.readouterr().err


def test_missing_file_and_bad_override_exit_2(tmp_path, capsys):
    assert main(["simulate", str(tmp_path / "nope.toml")]) == 2
    assert "nope.toml" in capsys.readouterr().err
    assert main(["simulate", write(tmp_path, SMALL), "--learner.staleness=-1"]) == 2
    assert "learner.staleness" in capsys.readouterr().err


def test_cli_json_and_timeline_plot(tmp_path, capsys):
    out = tmp_path / "t.png"
    assert main(["simulate", write(tmp_path, SMALL), "--json", "--plot", str(out), "--seed=3"]) == 0
    m = json.loads(capsys.readouterr().out)
    for key in ("wait_per_step", "bubble_ratio", "t_bcast_q90", "t_bcast_q100", "staleness_histogram",
                "rollout_throughput", "cost_per_step", "total_cost"):  # fmt: skip
        assert key in m
    assert m["seed"] == 3 and out.stat().st_size > 0


def test_sweep_table_and_plot(tmp_path, capsys):
    text = SMALL + "[sweep]\nx = 'workers.0.count'\nvalues = [1, 2]\nplan_threshold = true\n"
    out = tmp_path / "s.png"
    assert main(["simulate", write(tmp_path, text), "--plot", str(out)]) == 0
    assert "echo2 plan threshold" in capsys.readouterr().out and out.stat().st_size > 0


@pytest.mark.parametrize("path", PAPER, ids=lambda p: p.name)
def test_paper_scenarios_validate(path):
    assert expand(load_tree(path))
