from __future__ import annotations

import json

import pytest

from echo2.cli import main
from echo2.planning.plan import PlanInput, Pool, make_plan

POOL = Pool.model_validate(
    {
        "workers": [
            {"name": "cheap", "count": 6, "throughput": 1.0, "price": 0.3},
            {"name": "fast", "count": 2, "throughput": 3.0, "price": 0.75},
        ]
    }
)


def test_plan_hand_computed_paper_model():
    # kappa = max(1, S - 1) = 2; mu_min = 2 * 30 / (2 * 10 - 5) = 4; target 4.4
    plan = make_plan(
        PlanInput(t_train=10, t_bcast=5, batch=30, staleness=3, learner_price=2.0, model="paper"), POOL
    )
    assert (
        plan["kappa"] == 2
        and plan["mu_min"] == pytest.approx(4.0)
        and plan["mu_target"] == pytest.approx(4.4)
    )
    assert plan["feasible"] and plan["throughput"] >= 4.4
    assert plan["active"] == {"cheap": 2, "fast": 1}  # 5.0/s for $1.35; greedy takes 2 fast: $1.50
    assert plan["cost_per_hour"] == pytest.approx(2.0 + 1.35)
    assert plan["greedy_cost_per_hour"] == pytest.approx(2.0 + 1.5)
    assert plan["bubble_ratio"] == 0.0 and plan["cost_per_step"] == pytest.approx(3.35 * 10 / 3600)
    assert plan["staleness_bound"] == 3  # tightened: 2 + ceil(0.5 * 5 / 10)


def test_plan_hand_computed_continuous_model():
    # echo2's workers keep generating: mu_min = max(R / T_train, R / ((S - kappa + 1) T_train - T_bcast))
    # = max(3, 30 / 15) = 3 (the paper's 4 is higher); target 3.3 -> 1 fast + 1 cheap (4.0/s, $1.05)
    plan = make_plan(PlanInput(t_train=10, t_bcast=5, batch=30, staleness=3), POOL)
    assert plan["model"] == "continuous" and plan["mu_min"] == pytest.approx(3.0)
    assert plan["active"] == {"cheap": 1, "fast": 1} and plan["cost_per_hour"] == pytest.approx(1.05)
    assert plan["bubble_ratio"] == 0.0 and plan["step_seconds"] == pytest.approx(10.0)
    # bound at T_step = 10: 2 + ceil((5 + 30 / 4) / 10) - 1 = 3, within S
    assert plan["staleness_bound"] == 3 and plan["staleness_bound_within_s"]


def test_plan_infeasible_kappa_names_the_smallest_feasible_one():
    plan = make_plan(PlanInput(t_train=10, t_bcast=25, batch=30, staleness=2), POOL)
    assert plan["mu_min"] is None and not plan["feasible"] and plan["smallest_feasible_kappa"] == 3
    assert plan["bubble_ratio"] > 0


def write_pool(tmp_path, text):
    path = tmp_path / "pool.toml"
    path.write_text(text)
    return str(path)


def test_cli_json_keys(tmp_path, capsys):
    pool = write_pool(tmp_path, '[[workers]]\nname = "a"\ncount = 3\nthroughput = 2.0\nprice = 0.5\n')
    assert (
        main(
            [
                "plan",
                "--t-train",
                "10",
                "--t-bcast",
                "5",
                "--batch",
                "30",
                "--staleness",
                "3",
                "--pool",
                pool,
                "--json",
            ]
        )
        == 0
    )
    got = json.loads(capsys.readouterr().out)
    for key in (
        "mu_min",
        "mu_target",
        "feasible",
        "kappa",
        "staleness_bound",
        "active",
        "cost_per_hour",
        "cost_per_step",
        "greedy_cost_per_hour",
        "bubble_ratio",
    ):
        assert key in got
    assert got["model"] == "continuous" and got["active"] == {"a": 2}  # mu_min = 30 / 10; 2 x 2.0/s


@pytest.mark.parametrize(
    ("args", "pool_text", "message"),
    [
        (["--t-train", "0"], None, "--t-train"),
        (["--t-bcast", "-1"], None, "--t-bcast"),
        (["--staleness", "-1"], None, "--staleness"),
        (["--kappa", "0"], None, "--kappa"),
        (["--kappa", "5"], None, "--kappa: 5 > max(1, S - 1) = 2"),  # S = 3: the learner refuses it too
        (["--kappa", "3"], None, "--kappa"),
        (["--gamma", "0.9"], None, "--gamma"),
        ([], "workers = []\n", "pool.toml: workers"),
        ([], '[[workers]]\nname = "a"\ncount = 1\nthroughput = 1.0\n', "pool.toml: workers.0.price"),
        (
            [],
            '[[workers]]\nname = "a"\ncount = 1\nthroughput = 1.0\nprice = 1\nspeed = 2\n',
            "pool.toml: workers.0.speed",
        ),
        ([], "[[workers]\n", "pool.toml: invalid TOML"),
    ],
)
def test_cli_bad_input_exits_2(tmp_path, capsys, args, pool_text, message):
    pool = write_pool(
        tmp_path, pool_text or '[[workers]]\nname = "a"\ncount = 1\nthroughput = 1.0\nprice = 1\n'
    )
    base = {"--t-train": "10", "--t-bcast": "5", "--batch": "30", "--staleness": "3"}
    base.update(dict(zip(args[::2], args[1::2], strict=True)))
    argv = ["plan", *[x for kv in base.items() for x in kv], "--pool", pool]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_plan_says_whether_s_is_inside_the_staleness_study(tmp_path, capsys):
    """docs/staleness.md's powered study bounds the cost of lags 0-8 at 0.10: `echo2 plan` says so, and
    what is not ruled out, for S <= 8 and warns beyond."""
    pool = write_pool(tmp_path, '[[workers]]\nname = "a"\ncount = 3\nthroughput = 2.0\nprice = 0.5\n')
    args = ["plan", "--t-train", "10", "--t-bcast", "5", "--batch", "30", "--pool", pool]
    assert main([*args, "--staleness", "8"]) == 0
    out = capsys.readouterr().out
    assert "S = 8 is inside the lags measured (<= 8): 6 seeds per arm bound the cost at 0.10" in out
    assert "not ruled out" in out
    main([*args, "--staleness", "11"])
    assert "S = 11 is BEYOND the lags measured" in capsys.readouterr().out
    inside = make_plan(PlanInput(t_train=10, t_bcast=5, batch=30, staleness=4), POOL)
    beyond = make_plan(PlanInput(t_train=10, t_bcast=5, batch=30, staleness=9), POOL)
    assert inside["staleness_studied"] and not beyond["staleness_studied"]
