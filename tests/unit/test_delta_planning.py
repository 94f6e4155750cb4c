"""Delta snapshots in planning (issue 24): the bytes a publication sends (`capacity.publication_bytes`),
and `echo2 plan`, the simulator's broadcasts and its scheduler's T_bcast estimate all taking them
from that one function."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from echo2.broadcast.plan import broadcast_time
from echo2.cli import main
from echo2.planning import capacity
from echo2.planning.plan import PlanInput, Pool, make_plan, render
from echo2.sim.model import Simulation, simulate
from echo2.sim.report import metrics
from echo2.sim.scenario import validate

ROOT = Path(__file__).resolve().parents[2]
FULL = 16e9

POOL = Pool.model_validate({"workers": [{"name": "w", "count": 12, "throughput": 0.2684, "price": 0.35}]})

SCENARIO = {
    "seed": 0,
    "steps": 16,
    "learner": {"t_train": 100.0, "batch": 64, "group_size": 8, "staleness": 3, "snapshot_gb": 1.0},
    "broadcast": {"topology": "star", "chunk_mib": 1.0, "hop_delay_s": 0.0, "delta": True},
    "workers": [{"name": "w", "count": 4, "throughput": 1.0, "download_mbps": 100.0}],
}


def scenario(**broadcast):
    tree = copy.deepcopy(SCENARIO)
    tree["broadcast"].update(broadcast)
    return validate(tree)


# ---------------------------------------------------------------------------- the bytes
def test_a_worker_holding_the_previous_version_receives_the_ratio():
    assert capacity.publication_bytes(FULL, behind=1, ratio=0.01) == pytest.approx(0.01 * FULL)


@pytest.mark.parametrize("behind", [None, 2, 5])
def test_a_new_or_further_behind_worker_receives_the_full_snapshot(behind):
    assert capacity.publication_bytes(FULL, behind=behind, ratio=0.01) == FULL


def test_deltas_off_send_the_full_snapshot_and_a_current_worker_nothing():
    assert capacity.publication_bytes(FULL, behind=1, delta=False, ratio=0.01) == FULL
    assert capacity.publication_bytes(FULL, behind=0, ratio=0.01) == 0.0


def test_more_allowed_deltas_behind_and_a_ratio_above_one():
    assert capacity.publication_bytes(FULL, behind=2, ratio=0.01, max_behind=2) == pytest.approx(0.01 * FULL)
    assert capacity.publication_bytes(FULL, behind=1, ratio=1.5) == FULL  # never more than the snapshot


def test_the_measured_ratios_are_the_benchmarks_medians():
    """The constant cites docs/bench/snapshot_delta.json: it must say what that file says (lr 1e-6)."""
    summary = json.loads((ROOT / "docs/bench/snapshot_delta.json").read_text())["summary"]
    for (wire, kappa), ratio in capacity.MEASURED_DELTA_RATIO.items():
        measured = summary[f"lr1e-06_{wire}_k{kappa}"]["ratio"]["median"]
        assert ratio == pytest.approx(measured, rel=0.01), (wire, kappa)


def test_delta_ratio_by_kappa():
    k1, k4 = capacity.MEASURED_DELTA_RATIO[("bf16", 1)], capacity.MEASURED_DELTA_RATIO[("bf16", 4)]
    assert capacity.delta_ratio(1) == k1
    assert capacity.delta_ratio(2) == capacity.delta_ratio(4) == k4  # the 4-step delta bounds a 2-step one
    assert capacity.delta_ratio(8) == pytest.approx(2 * k4)  # extrapolated
    assert capacity.delta_ratio(1, "fp32") == capacity.MEASURED_DELTA_RATIO[("fp32", 1)]
    assert capacity.delta_ratio(10_000, "fp32") == 1.0


# ---------------------------------------------------------------------------- the planner
def test_the_planner_predicts_t_bcast_from_the_bytes():
    inp = PlanInput(t_train=1631, t_bcast=1437, batch=2048, staleness=3, gamma=1.0, model="paper")
    plan = make_plan(inp, POOL)
    d = plan["delta"]
    ratio = capacity.delta_ratio(2)
    assert d["prediction"] is True and d["ratio"] == ratio and d["ratio_source"] == "measured"
    assert d["t_bcast"] == pytest.approx(
        1437 * capacity.publication_bytes(FULL, behind=1, ratio=ratio) / FULL
    )
    assert d["mu_min"] == pytest.approx(
        capacity.mu_min(kappa=2, t_train=1631, t_bcast=d["t_bcast"], batch=2048)
    )
    # the plan itself is unchanged: it is the full snapshot's
    assert plan["t_bcast"] == 1437 and plan["active"] == {"w": 9}
    assert d["active"] == {"w": 5} and d["cost_per_step"] < plan["cost_per_step"]


def test_a_given_ratio_and_wire():
    given = make_plan(PlanInput(t_train=10, t_bcast=8, batch=30, staleness=3, delta_ratio=0.5), POOL)
    assert given["delta"]["t_bcast"] == pytest.approx(4.0) and given["delta"]["ratio_source"] == "given"
    fp32 = make_plan(PlanInput(t_train=10, t_bcast=8, batch=30, staleness=3, wire="fp32"), POOL)
    assert fp32["delta"]["ratio"] == capacity.delta_ratio(2, "fp32")


def test_echo2_plan_prints_the_delta_prediction(tmp_path, capsys):
    pool = tmp_path / "pool.toml"
    pool.write_text('[[workers]]\nname = "w"\ncount = 12\nthroughput = 0.2684\nprice = 0.35\n')
    argv = ["plan", "--t-train", "1631", "--t-bcast", "1437", "--batch", "2048", "--staleness", "3"]
    assert main([*argv, "--gamma", "1.0", "--model", "paper", "--pool", str(pool)]) == 0
    out = capsys.readouterr().out
    assert "delta snapshots (PREDICTION)   T_bcast 1437 s full -> 19.69 s delta (ratio 1.37%" in out
    assert "workers 9 -> 5" in out and "lr 1e-6, kappa 4, an upper bound for kappa 2" in out
    assert main([*argv, "--pool", str(pool), "--json", "--delta-ratio", "0.1"]) == 0
    assert json.loads(capsys.readouterr().out)["delta"]["t_bcast"] == pytest.approx(143.7)
    assert main([*argv, "--pool", str(pool), "--delta-ratio", "0"]) == 2
    assert "--delta-ratio" in capsys.readouterr().err


def test_render_of_an_infeasible_plan_names_both():
    inp = PlanInput(t_train=10, t_bcast=50, batch=30, staleness=3, model="paper")
    text = render(make_plan(inp, POOL))
    assert "smallest feasible kappa 6 -> 1" in text


# ---------------------------------------------------------------------------- the simulator
def test_the_simulator_sends_the_bytes_and_its_estimate_agrees_with_the_planner():
    """A star over an unlimited uplink is the fluid model: T_bcast = bytes / Bw, so the simulator's
    estimate (its scheduler's T_bcast before one is measured), its measured T_bcast and the planner's
    prediction from the full snapshot's T_bcast are all the same number."""
    full, delta = Simulation(scenario(delta=False)), Simulation(scenario())
    ratio = capacity.delta_ratio(2)
    assert delta.sc.publication_bytes(1) == capacity.publication_bytes(1e9, behind=1, ratio=ratio)
    n = 4
    expected = broadcast_time(
        n,
        mode="star",
        size_bytes=capacity.publication_bytes(1e9, behind=1, ratio=ratio),
        chunk_bytes=2**20,
        uplink_bps=float("inf"),
        worker_bps=12.5e6,
        hop_delay_s=0.0,
    )
    assert delta.broadcast_estimate(n) == pytest.approx(expected)
    planned = capacity.delta_t_bcast(full.broadcast_estimate(n), ratio=ratio)
    assert delta.broadcast_estimate(n) == pytest.approx(planned, rel=0.01)  # up to the last chunk's rounding
    m = metrics(simulate(scenario()))
    assert m["t_bcast_q90"] == pytest.approx(delta.broadcast_estimate(n), rel=1e-6)
    assert metrics(simulate(scenario(delta=False)))["t_bcast_q90"] == pytest.approx(80.0)  # 1 GB at 100 Mbps


def test_a_worker_too_far_behind_fetches_the_full_snapshot():
    sim = Simulation(scenario(delta_ratio=0.5))
    d, w = sim.dissemination, sim.workers["w-0"]
    d.published_at[:] = [(2, 0.0), (4, 1.0)]
    w.installed = 2
    assert d.behind(w, 4) == 1 and sim.world.publication_bytes(d.behind(w, 4)) == 0.5e9
    w.installed = 0
    assert d.behind(w, 4) == 2 and sim.world.publication_bytes(d.behind(w, 4)) == 1e9
    w.installed = -1
    assert d.behind(w, 4) is None and sim.world.publication_bytes(None) == 1e9


def test_deltas_off_by_default_in_scenarios():
    tree = copy.deepcopy(SCENARIO)
    del tree["broadcast"]["delta"]
    assert validate(tree).publication_bytes(1) == 1e9


def test_skipped_versions_make_the_next_broadcast_a_full_download():
    """Versions 4 and 6 are published while 2 is on its way: 6 goes out next, and every worker holds
    2, two publications behind, so each downloads the full snapshot directly (no chain broadcast)."""
    sim = Simulation(scenario(delta_ratio=0.5))
    d = sim.dissemination
    for v in (2, 4, 6):
        d.publish(v)
    sim.env.run(until=100.0)  # 0.5 GB at 100 Mbps: version 2 installed at 40 s
    assert [p.version for p in d.publications] == [2]
    assert all(w.installed == 2 and w.fetch is not None for w in sim.workers.values())
    sim.env.run(until=125.0)  # then 1 GB each: 80 s more
    assert all(w.installed == 6 and w.fetch is None for w in sim.workers.values())
