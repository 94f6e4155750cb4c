"""Does a poker policy play its cards? (issue 23) The first decision of every hand, split by the
strength of the policy's hole cards, from poker_eval.py's hands files.

A card-blind policy (every fixed baseline but `hand_strength`, the warm-up's target) raises and
folds as often with strong cards as with weak ones; a policy that learned strategy raises more with
strong cards and folds more with weak ones. Strong: a pair or both cards ten or higher (the
`hand_strength` rule's preflop raise). The cards are dealt again from each hand's deal seed
(`PokerEnv.reset`), so nothing but the seed is read from the files. Per policy x opponent: the raise
share of first decisions with strong and with weak cards, their difference with a 95% Newcombe
(Wilson-score) interval, bench/stats.py, and the same for folds facing a bet.

`--runs`: the same split for what a training run sampled (RUN_DIR/samples.jsonl: every episode's
first reply, at temperature 1.0, on training deals each seen once, so the policy meets them fresh;
the run needs `run.samples_per_step` >= its episodes per step). Episodes of one deal share their
cards, so the unit is the deal: each deal's raise share, strong deals against weak ones with
Welch's t-interval, for the first and the last `--window` steps, and the late-minus-early change
of that gap per seed with its t-interval over seeds.

    python experiments/poker/poker_strategy.py --out docs/bench/poker_warm --json docs/bench/poker_warm/strategy.json
    python experiments/poker/poker_strategy.py --runs runs/pw-seed0 runs/pw-seed1 runs/pw-seed2 --window 8 \
        --json docs/bench/poker_warm/training_strategy.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from poker_baselines import strong_preflop

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # the harness the benchmarks share: bench/common.py, bench/stats.py


def hole_cards(seed: int, opponent: str) -> tuple[list[str], bool]:
    """The agent's hole cards in deal `seed` and whether it faces a bet at its first decision
    (against `opponent`, whose draws the deal's seed fixes too)."""
    from echo2.data.envs.poker import PokerEnv

    env = PokerEnv(opponent=opponent)
    env.reset(seed)
    return [f"{c.rank}{c.suit}" for c in env.state.hole_cards[env.agent]], bool(
        env.state.checking_or_calling_amount
    )


def cell(rows: list[dict], opponent: str) -> dict:
    counts = {f"{what}_{s}": 0 for what in ("n", "raise", "facing", "fold") for s in ("strong", "weak")}
    for row in rows:
        cards, facing = hole_cards(row["seed"], opponent)
        s = "strong" if strong_preflop(cards) else "weak"
        first = row["decisions"][0]["cat"]
        counts[f"n_{s}"] += 1
        counts[f"raise_{s}"] += first == "raise"
        if facing:
            counts[f"facing_{s}"] += 1
            counts[f"fold_{s}"] += first == "fold"
    from stats import newcombe_ci

    raise_gap = newcombe_ci(
        counts["raise_strong"], counts["n_strong"], counts["raise_weak"], counts["n_weak"]
    )
    fold_gap = newcombe_ci(
        counts["fold_weak"], counts["facing_weak"], counts["fold_strong"], counts["facing_strong"]
    )
    return counts | {"raise_strong_minus_weak": raise_gap, "fold_weak_minus_strong": fold_gap}


_CARDS = re.compile(r"Cards: (\S\S) (\S\S)\.")
_WORD = re.compile(r"<answer>\s*(fold|check|call|raise|bet|all[- ]?in)")


def _action(completion: str) -> str:
    word = _WORD.match(completion)
    if not word:
        return "malformed"
    w = word.group(1)
    return "raise" if w in ("bet", "raise") or w.startswith("all") else w


def run_deals(run_dir: Path) -> list[dict]:
    """Per step and deal (the prompt's first user turn): strong cards?, raise share of its
    episodes, and the first replies' actions."""
    deals: dict[tuple[int, str], list[str]] = {}
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        cards = _CARDS.search(row["prompt"])
        key = (row["step"], cards.group(1) + cards.group(2))
        deals.setdefault(key, []).append(_action(row["completion"]))
    return [
        {
            "step": step,
            "strong": strong_preflop([cards[:2], cards[2:]]),
            "raise": a.count("raise") / len(a),
            "episodes": len(a),
            "actions": {k: a.count(k) for k in ACTIONS},
        }
        for (step, cards), a in sorted(deals.items())
    ]


ACTIONS = ("fold", "check", "call", "raise", "malformed")


def action_mix(rows: list[dict]) -> dict[str, int]:
    return {k: sum(r["actions"][k] for r in rows) for k in ACTIONS}


def window_gap(rows: list[dict]) -> dict:
    """Strong deals' mean raise share, weak deals', and the difference with Welch's t-interval
    (None when fewer than 2 deals of a kind, or no deal's share varies: no interval to give)."""
    from stats import welch_ci

    a = [r["raise"] for r in rows if r["strong"]]
    b = [r["raise"] for r in rows if not r["strong"]]
    out = {
        "deals_strong": len(a),
        "deals_weak": len(b),
        "raise_strong": sum(a) / len(a) if a else None,
        "raise_weak": sum(b) / len(b) if b else None,
        "gap": None,
    }
    if len(a) >= 2 and len(b) >= 2 and len(set(a + b)) > 1:
        out["gap"] = welch_ci(a, b)
    return out


def _show(w: dict) -> str:
    def share(x):
        return "n/a" if x is None else f"{x:.2f}"

    g = w["gap"]
    gap = "no interval" if g is None else f"{g.estimate:+.3f} [{g.low:+.3f}, {g.high:+.3f}]"
    return (
        f"strong {share(w['raise_strong'])} ({w['deals_strong']} deals), "
        f"weak {share(w['raise_weak'])} ({w['deals_weak']}): {gap}"
    )


def runs_table(run_dirs: list[Path], window: int) -> dict:
    from stats import mean_ci

    out, changes = {}, []
    for run_dir in run_dirs:
        rows = run_deals(run_dir)
        last = max(r["step"] for r in rows)
        early = window_gap([r for r in rows if r["step"] < window])
        late = window_gap([r for r in rows if r["step"] > last - window])
        thirds = [[r for r in rows if r["step"] * 3 // (last + 1) == i] for i in range(3)]
        mix = [action_mix(t) for t in thirds]
        out[run_dir.name] = {
            "steps": last + 1,
            "deals": len(rows),
            "early": early,
            "late": late,
            "actions_by_third": mix,
        }
        if None not in (early["raise_strong"], early["raise_weak"], late["raise_strong"], late["raise_weak"]):
            changes.append(
                (late["raise_strong"] - late["raise_weak"]) - (early["raise_strong"] - early["raise_weak"])
            )
        print(f"{run_dir.name}: raise share of a deal's episodes, steps 0-{window - 1}: {_show(early)}")
        print(f"{' ' * len(run_dir.name)}  steps {last - window + 1}-{last}: {_show(late)}")
        print(
            f"{' ' * len(run_dir.name)}  first replies by thirds of the run, {'/'.join(ACTIONS)}: "
            + "; ".join("/".join(str(m[k]) for k in ACTIONS) for m in mix)
        )
    if len(changes) >= 2:
        c = mean_ci(changes)
        out["late_minus_early_over_seeds"] = c
        print(
            f"(late - early) of strong - weak, over {len(changes)} seeds: {c.estimate:+.3f} [{c.low:+.3f}, {c.high:+.3f}]"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="poker_eval.py's --out (its hands/)")
    ap.add_argument("--runs", type=Path, nargs="+", help="training run directories (their samples.jsonl)")
    ap.add_argument("--window", type=int, default=8, help="steps at the start and at the end (--runs)")
    ap.add_argument("--json")
    args = ap.parse_args()
    from common import write_json
    from poker_eval import read_hands

    command = "python experiments/poker/poker_strategy.py " + " ".join(sys.argv[1:])
    if args.runs:
        table = runs_table(args.runs, args.window)
        write_json(args.json, {"command": command, "runs": json.loads(json.dumps(table, default=_plain))})
        return

    table = {}
    for path in sorted((args.out / "hands").glob("*.jsonl.gz")):
        name = path.name.removesuffix(".jsonl.gz")
        table[name] = cell(read_hands(path), opponent=name.split("__")[1])
    print(
        "| policy x opponent | raise share strong / weak | strong - weak [95%] | fold facing a bet weak / strong | weak - strong [95%] |"
    )
    print("| --- | --- | --- | --- | --- |")
    for name, c in table.items():
        r, f = c["raise_strong_minus_weak"], c["fold_weak_minus_strong"]
        print(
            f"| {name} | {c['raise_strong']}/{c['n_strong']} / {c['raise_weak']}/{c['n_weak']} "
            f"| {r.estimate:+.3f} [{r.low:+.3f}, {r.high:+.3f}] "
            f"| {c['fold_weak']}/{c['facing_weak']} / {c['fold_strong']}/{c['facing_strong']} "
            f"| {f.estimate:+.3f} [{f.low:+.3f}, {f.high:+.3f}] |"
        )
    write_json(args.json, {"command": command, "cells": json.loads(json.dumps(table, default=_plain))})


def _plain(x):
    """An Interval (bench/stats.py) as JSON."""
    return {"estimate": x.estimate, "low": x.low, "high": x.high, "n": x.n, "method": x.method, "df": x.df}


if __name__ == "__main__":
    main()
