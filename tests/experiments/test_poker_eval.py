"""experiments/poker/poker_eval.py's, poker_summary.py's and poker_baselines.py's pure parts (issue 23,
"Evidence that holds"): the hand-strength rule and its preflop split, the decision histogram, the
paired difference over the same deals; and, where pokerkit is installed, that the always-fold/check
baseline is exactly the env's rule for a malformed reply."""

from __future__ import annotations

import importlib
import math

import pytest


@pytest.fixture
def pe():
    return importlib.import_module("poker_eval")  # experiments/poker/ and bench/ on sys.path: conftest.py


@pytest.fixture
def ps():
    return importlib.import_module("poker_summary")


@pytest.fixture
def pb():
    return importlib.import_module("poker_baselines")


@pytest.mark.parametrize(
    ("hole", "board", "made"),
    [
        (["Ah", "Kd"], ["2c", "7s", "9h"], False),  # high card
        (["Ah", "Kd"], ["Ac", "7s", "9h"], True),  # a pair with the board
        (["Ah", "Kd"], ["7c", "7s", "9h"], True),  # the board's pair counts (as pokerkit's label)
        (["Ah", "2h"], ["5h", "9h", "Jh"], True),  # flush
        (["Ah", "2d"], ["3c", "4s", "5h"], True),  # the wheel: the ace plays low
        (["Ah", "Kd"], ["Qc", "Js", "Th"], True),  # broadway
        (["Ah", "Kd"], ["Qc", "Js", "9h"], False),  # four to a straight
        (["Kh", "2d"], ["Ac", "3s", "4h", "9c"], False),  # K-A-2-3-4 does not wrap
    ],
)
def test_made_hand(pb, hole, board, made):
    assert pb.made_hand(hole, board) is made


@pytest.mark.parametrize(
    ("hole", "strong"),
    [
        (["Ah", "Kd"], True),
        (["Th", "Jd"], True),
        (["Th", "9d"], False),
        (["2h", "2d"], True),
        (["7h", "2d"], False),
    ],
)
def test_strong_preflop(pb, hole, strong):
    assert pb.strong_preflop(hole) is strong


def test_hand_strength_rule(pb):
    act = pb.hand_strength_action
    pre = {"board": [], "pot": 1.5, "can_raise": True}
    assert act(["Ah", "Kd"], **pre, to_call=0.5, max_bet=1) == "raise 3"  # two cards ten or higher
    assert act(["Qh", "Qd"], **pre, to_call=2, max_bet=3) == "raise 9"  # three times the bet faced
    assert act(["5h", "5d"], board=[], pot=40, can_raise=False, to_call=10, max_bet=20) == "call"
    assert act(["7h", "2d"], **pre, to_call=0.5, max_bet=1) == "fold"
    assert act(["7h", "2d"], **pre, to_call=0, max_bet=1) == "check"
    assert act(["Th", "9d"], **pre, to_call=0.5, max_bet=1) == "fold"  # 9 is under ten
    assert act(["Jh", "Td"], **pre, to_call=0.5, max_bet=1) == "raise 3"  # ten is high enough
    post = {"board": ["7c", "2s", "Kh"], "pot": 4, "max_bet": 0, "can_raise": True}
    assert act(["7h", "3d"], **post, to_call=0) == "raise 2"  # a pair: half the pot
    assert act(["7h", "3d"], **post, to_call=2) == "call"
    assert act(["Ah", "Qd"], **post, to_call=2) == "fold"
    assert act(["Ah", "Qd"], **post, to_call=0) == "check"
    assert (
        act(["7h", "3d"], board=["7c", "2s", "Kh"], pot=1, max_bet=0, can_raise=True, to_call=0) == "raise 1"
    )


def test_category_and_histogram(ps):
    assert ps.category("you raise to 3", False) == "raise"
    assert ps.category("you call", False) == "call"
    assert ps.category("you check", True) == "malformed"  # the default action a malformed reply got
    with pytest.raises(ValueError):
        ps.category("you shove", False)
    hands = [
        {"decisions": [{"cat": "malformed"}, {"cat": "check"}]},
        {"decisions": [{"cat": "raise"}]},
        {"decisions": []},
        {"decisions": [{"cat": "malformed"}, {"cat": "fold"}]},
    ]
    assert ps.histogram(hands) == {"fold": 1, "check": 1, "call": 0, "raise": 1, "malformed": 2}
    with pytest.raises(ValueError):
        ps.histogram([{"decisions": [{"cat": "bet"}]}])


def _hands(chips_by_seed, seat="sb"):
    return [{"seed": s, "seat": seat, "chips": c} for s, c in chips_by_seed]


def test_paired_difference_matches_deals_by_seed(ps):
    a = _hands([(10, 1.0), (11, 2.0), (12, 3.0), (13, 4.0), (99, 50.0)])  # 99: only a played it
    b = _hands([(13, 1.0), (12, 1.0), (11, 0.0), (10, 0.0)])  # another order
    iv = ps.paired(a, b)
    # differences 1, 2, 2, 3: mean 2, sd sqrt(2/3), se sqrt(2/3)/2, t(0.975, 3) = 3.182
    half = 3.182446 * math.sqrt(2 / 3) / 2
    assert iv.n == 4 and iv.estimate == pytest.approx(2.0)
    assert (iv.low, iv.high) == pytest.approx((2 - half, 2 + half), abs=1e-5)
    with pytest.raises(ValueError, match="seat"):
        ps.paired(a, _hands([(10, 0.0), (11, 0.0)], seat="bb"))


def test_hands_file_round_trip_is_byte_identical(pe, ps, tmp_path):
    rows = [{"i": 0, "seed": 5, "chips": -0.5, "decisions": [{"cat": "fold", "applied": "you fold"}]}]
    pe.write_hands(tmp_path / "a.jsonl.gz", rows)
    pe.write_hands(tmp_path / "b.jsonl.gz", rows)
    assert (tmp_path / "a.jsonl.gz").read_bytes() == (tmp_path / "b.jsonl.gz").read_bytes()
    assert ps.read_hands(tmp_path / "a.jsonl.gz") == rows


def test_runs_file_keeps_every_writers_entries(pe, tmp_path):
    """`play` processes side by side (one per core) each merge their entries into runs.json: none is
    lost (reading at start and writing at the end lost seed 3's entries in docs/bench/poker_warm)."""
    import multiprocessing as mp

    path = tmp_path / "out" / "runs.json"
    ctx = mp.get_context("fork")
    procs = [
        ctx.Process(target=pe.record_runs, args=(path, {f"p{k}__{n}": {"n": n} for n in range(20)}))
        for k in range(6)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    runs = __import__("json").loads(path.read_text())
    assert len(runs) == 6 * 20
    assert sorted(q.name for q in path.parent.iterdir()) == ["runs.json"]  # no lock or temporary file left


@pytest.mark.parametrize("opponent", ["call_station", "rule_based"])
def test_fold_check_baseline_is_the_malformed_rule(pe, opponent):
    """The reviewer's observation as a check: on every deal, always fold/check wins exactly the chips
    of a policy whose every reply is malformed (the env then checks if it can, else folds)."""
    pytest.importorskip("pokerkit")
    from echo2.data.envs.poker import PokerEnv

    seeds = pe.deal_seeds(40)
    make = lambda: PokerEnv(opponent=opponent, stack_bb=20)  # noqa: E731
    rows = pe.play_baseline("fold_check", make, seeds, max_turns=2)
    assert [r["seed"] for r in rows] == seeds and not any(r["malformed"] for r in rows)
    for row, seed in zip(rows, seeds, strict=True):
        env = pe.Recorded(make())
        env.reset(seed)
        total = 0.0
        for _ in range(2):
            result = env.step("<answer>no idea</answer>")
            total += result.reward
            if result.done:
                break
        else:
            total += env.finish()
        assert env.result() == row["chips"], seed
        assert total == pytest.approx(row["chips"] - len(env.decisions))  # penalty 1 per malformed reply
        assert all(d["cat"] == "malformed" for d in env.decisions)
    assert {r["seat"] for r in rows} == {"sb", "bb"}
