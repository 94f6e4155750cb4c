"""The reading side of experiments/poker/poker_eval.py: decision categories and histograms, the
paired difference of two policies on the same deals, and `summarize` / `markdown`, which turn
docs/bench/poker/hands/*.jsonl.gz and runs.json into summary.json and summary.md (what each
figure is: poker_eval.py's docstring). No play, no model."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

from poker_baselines import BASELINES

CATEGORIES = ("fold", "check", "call", "raise", "malformed")


# ---------------------------------------------------------------------------- pure parts
def category(applied: str, malformed: bool) -> str:
    """A decision's histogram bin from the env's log entry ("you raise to 3" -> "raise")."""
    if malformed:
        return "malformed"
    word = applied.removeprefix("you ").split()[0]
    if word not in CATEGORIES:
        raise ValueError(f"unknown action {applied!r}")
    return word


def histogram(hands: list[dict]) -> dict[str, int]:
    """Decisions per category over hands (each hand's `decisions`: [{"cat": ...}, ...])."""
    counts = Counter(d["cat"] for h in hands for d in h["decisions"])
    unknown = set(counts) - set(CATEGORIES)
    if unknown:
        raise ValueError(f"unknown categories {sorted(unknown)}")
    return {c: counts.get(c, 0) for c in CATEGORIES}


def paired(a: list[dict], b: list[dict], key: str = "chips"):
    """`stats.paired_ci` of a - b over the deals both played (matched by deal seed, not position).
    ValueError when a deal seat differs between the two (then they are not the same deal)."""
    from stats import paired_ci

    bs = {h["seed"]: h for h in b}
    both = [h for h in a if h["seed"] in bs]
    for h in both:
        if h["seat"] != bs[h["seed"]]["seat"]:
            raise ValueError(f"deal {h['seed']}: seat {h['seat']} vs {bs[h['seed']]['seat']}")
    return paired_ci([h[key] for h in both], [bs[h["seed"]][key] for h in both])


def read_hands(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def summarize(out: Path) -> dict:
    """summary.json's content from out/hands/*.jsonl.gz and out/runs.json."""
    from stats import mean_ci

    meta = json.loads((out / "runs.json").read_text()) if (out / "runs.json").exists() else {}
    cells: dict[str, dict[str, list[dict]]] = {}
    for path in sorted((out / "hands").glob("*.jsonl.gz")):
        policy, opponent = path.name.removesuffix(".jsonl.gz").split("__")
        cells.setdefault(opponent, {})[policy] = read_hands(path)
    table = []
    for opponent, by_policy in cells.items():
        for policy, hands in by_policy.items():
            iv = mean_ci([h["chips"] for h in hands])
            decisions = sum(len(h["decisions"]) for h in hands)
            hist = histogram(hands)
            row = {
                "policy": policy,
                "opponent": opponent,
                "hands": len(hands),
                "chips_mean": iv.estimate,
                "chips_ci95": [iv.low, iv.high],
                "return_mean": sum(h["return"] for h in hands) / len(hands),
                "malformed_hand_share": sum(h["malformed"] for h in hands) / len(hands),
                "malformed_decision_share": hist["malformed"] / max(1, decisions),
                "decisions_per_hand": decisions / len(hands),
                "histogram": hist,
                "histogram_share": {k: v / max(1, decisions) for k, v in hist.items()},
                "auto_actions": dict(Counter(a.split()[1] for h in hands for a in h["auto"])),
                "truncated_share": sum(h["truncated"] for h in hands) / len(hands),
                **meta.get(f"{policy}__{opponent}", {}),
            }
            table.append(row)
    comparisons = []
    for opponent, by_policy in cells.items():
        for policy, hands in by_policy.items():
            if policy.startswith("model"):  # against every baseline and the untrained model
                bases = [*BASELINES, *sorted(p for p in by_policy if p.endswith("_initial") and p != policy)]
            else:  # a baseline against always check/call: the bar that format alone reaches
                bases = [] if policy == "check_call" else ["check_call"]
            for base in bases:
                if base not in by_policy:
                    continue
                iv = paired(hands, by_policy[base])
                same = {h["seed"]: h["chips"] for h in by_policy[base]}
                comparisons.append(
                    {
                        "opponent": opponent,
                        "policy": policy,
                        "baseline": base,
                        "hands": iv.n,
                        "diff_mean": iv.estimate,
                        "diff_ci95": [iv.low, iv.high],
                        "method": iv.method,
                        "identical_hands": sum(
                            h["chips"] == same[h["seed"]] for h in hands if h["seed"] in same
                        ),
                    }
                )
    return {"table": table, "paired": comparisons}


def markdown(summary: dict) -> str:
    def iv(lo_hi, est) -> str:
        return f"{est:+.3f} [{lo_hi[0]:+.3f}, {lo_hi[1]:+.3f}]"

    lines = [
        "| opponent | policy | hands | chips/hand (BB), mean [95% CI] | malformed (hands / decisions) | "
        "decisions: fold / check / call / raise / malformed |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in sorted(summary["table"], key=lambda r: (r["opponent"], r["policy"])):
        h = r["histogram"]
        lines.append(
            f"| {r['opponent']} | {r['policy']} | {r['hands']} | {iv(r['chips_ci95'], r['chips_mean'])} | "
            f"{r['malformed_hand_share']:.3f} / {r['malformed_decision_share']:.3f} | "
            + " / ".join(str(h[c]) for c in CATEGORIES)
            + " |"
        )
    lines += [
        "",
        "| opponent | policy | minus | hands | paired difference (BB/hand), mean [95% CI] | identical hands |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for c in summary["paired"]:
        lines.append(
            f"| {c['opponent']} | {c['policy']} | {c['baseline']} | {c['hands']} | "
            f"{iv(c['diff_ci95'], c['diff_mean'])} | {c['identical_hands']} |"
        )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- CLI
