"""The pure parts of time_to_accuracy.py (no I/O, no training): a run's figures from its per-step
times and evaluations, which runs a `--resume` keeps and which it still has to run, and the summary
over seeds per side and per pair of sides (bench/stats.py's intervals; the wording rules in
time_to_accuracy.py's docstring). Tested by tests/experiments/test_time_to_accuracy.py."""

from __future__ import annotations

import math
import re
from dataclasses import asdict

import numpy as np
from stats import bootstrap_ci, mean_ci, welch_ci, word_comparison

PROMPTS, GROUP = 4, 8  # configs/quickstart.toml's rollout.prompts_per_step, rollout.group_size
RECORDS = PROMPTS * GROUP
SETTINGS = ("steps", "eval_every", "eval_size", "target", "threads")
"""The options a run's result depends on: `--resume` reuses a run only if all of them match."""
BEFORE = re.compile(r"held-out accuracy before training: ([0-9.]+)")


# ---------------------------------------------------------------- pure parts (tests/experiments/test_time_to_accuracy.py)
def first_reaching(evals: list[tuple[int, float, float]], target: float) -> dict | None:
    """(step, cumulative seconds, accuracy) rows -> the first at or above target."""
    for step, seconds, acc in evals:
        if acc >= target:
            return {"step": step, "seconds": seconds, "accuracy": acc}
    return None


def eval_due(step: int, eval_every: int, steps: int) -> bool:
    """Whether the evaluation follows training step `step` (1-based): every `eval_every`, and the last."""
    return step % eval_every == 0 or step == steps


def run_record(
    step_seconds: list[float],
    step_tokens: list[int],
    evals: list[tuple[int, float]],
    target: float,
) -> dict:
    """One run's figures from its per-step wall times and generated tokens and its (step, accuracy)
    evaluations (step 0 = before training): the evaluations with cumulative training seconds, the
    first at or above `target` (None if none), and seconds, steps and tokens to it; seconds per step
    and tokens per second over the steps up to the target (all steps run if never reached).
    Steps after the first reaching evaluation (a run stopped late) are not counted."""
    if len(step_seconds) != len(step_tokens):
        raise ValueError(f"{len(step_seconds)} step times but {len(step_tokens)} token counts")
    cum = np.concatenate([[0.0], np.cumsum(step_seconds)]).tolist()
    rows = [(s, cum[s], acc) for s, acc in evals if s < len(cum)]
    reached = first_reaching(rows, target)
    upto = reached["step"] if reached else len(step_seconds)
    seconds, tokens = cum[upto], int(sum(step_tokens[:upto]))
    return {
        "evals": [list(r) for r in rows if reached is None or r[0] <= reached["step"]],
        "reached": reached,
        "seconds_to_target": reached["seconds"] if reached else None,
        "steps_to_target": reached["step"] if reached else None,
        "tokens_to_target": tokens if reached else None,
        "steps_counted": upto,
        "train_seconds": seconds,
        "generated_tokens": tokens,
        "seconds_per_step": seconds / upto if upto else None,
        "tokens_per_step": tokens / upto if upto else None,
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "step_seconds": list(step_seconds[:upto]),
        "step_tokens": [int(t) for t in step_tokens[:upto]],
    }


def sides_of(engines: list[str], trl: bool) -> list[str]:
    return [f"echo2-{e}" for e in engines] + (["trl"] if trl else [])


def plan(sides: list[str], seeds: list[int]) -> list[tuple[str, int]]:
    """(side, seed) runs interleaved by seed: seed 0 of every side, then seed 1, ..."""
    return [(side, seed) for seed in seeds for side in sides]


def settings_of(args) -> dict:
    return {k: getattr(args, k) for k in SETTINGS}


def kept_runs(previous: dict | None, settings: dict) -> list[dict]:
    """The runs of an earlier JSON (`--resume`) with the same settings; a run repeated keeps its last."""
    kept: dict[tuple[str, int], dict] = {}
    for r in (previous or {}).get("runs", []):
        if r.get("settings") == settings:
            kept[(r["side"], r["seed"])] = r
    return list(kept.values())


def to_run(todo: list[tuple[str, int]], done: list[dict]) -> list[tuple[str, int]]:
    """The planned runs not already done (resume skips them), in plan order."""
    have = {(r["side"], r["seed"]) for r in done}
    return [x for x in todo if x not in have]


def _median(a: np.ndarray) -> float:
    return float(np.median(a))


def side_summary(runs: list[dict], target: float) -> dict:
    """n, the runs that never reached the target (seeds, steps run, best accuracy), and over the runs
    that reached it: median seconds to target with a percentile-bootstrap interval, mean with a
    t interval, steps and tokens to target; seconds per step and tokens per second over all runs.
    With some runs unreached, the times over the reached ones understate the side's time:
    `median_seconds_lower_bound` counts each unreached run at its training time (a lower bound)."""
    runs = sorted(runs, key=lambda r: r["seed"])
    hit = [r for r in runs if r["reached"] is not None]
    miss = [r for r in runs if r["reached"] is None]
    secs = [r["seconds_to_target"] for r in hit]
    out: dict = {
        "n": len(runs),
        "seeds": [r["seed"] for r in runs],
        "reached": len(hit),
        "not_reached": [
            {
                "seed": r["seed"],
                "steps_run": r["steps_counted"],
                "train_seconds": r["train_seconds"],
                "best_accuracy": max((e[2] for e in r["evals"]), default=None),
            }
            for r in miss
        ],
        "seconds_to_target": dict(zip([r["seed"] for r in hit], secs, strict=True)),
        "steps_to_target": [r["steps_to_target"] for r in hit],
        "tokens_to_target": [r["tokens_to_target"] for r in hit],
        "over": f"the {len(hit)} runs of {len(runs)} that reached {target}",
    }
    if secs:
        out["median_seconds"] = _median(np.asarray(secs))
    if miss and runs:
        out["median_seconds_lower_bound"] = _median(
            np.asarray([r["seconds_to_target"] if r["reached"] else r["train_seconds"] for r in runs])
        )
    if len(secs) >= 2:
        out["median_seconds_ci"] = asdict(bootstrap_ci(secs, stat=_median))
        out["mean_seconds_ci"] = asdict(mean_ci(secs))
    for key in ("seconds_per_step", "tokens_per_step", "tokens_per_s"):
        xs = [r[key] for r in runs if r[key] is not None]
        out[key] = {"values": xs}
        if len(xs) >= 2:
            out[key] |= asdict(mean_ci(xs))
    return out


def compare(a_runs: list[dict], b_runs: list[dict], a: str, b: str) -> dict:
    """Time to target of side a against side b on the seeds where both reached it: the ratio of
    medians a/b with a percentile-bootstrap interval (seeds resampled jointly, bench/stats.py's
    `bootstrap_ci` over seed indices), worded by `word_comparison` on log(ratio) (not resolved
    when the interval covers a ratio of 1), and the difference of means with Welch's interval."""
    sa = {r["seed"]: r["seconds_to_target"] for r in a_runs if r["reached"]}
    sb = {r["seed"]: r["seconds_to_target"] for r in b_runs if r["reached"]}
    seeds = sorted(set(sa) & set(sb))
    out: dict = {"seeds": seeds, "left_out_seeds": sorted((set(sa) | set(sb)) - set(seeds))}
    if len(seeds) < 2:
        out["text"] = f"{a} vs {b}: fewer than 2 seeds where both reached the target, no interval"
        return out
    x = np.array([sa[s] for s in seeds])
    y = np.array([sb[s] for s in seeds])

    def log_ratio(idx: np.ndarray) -> float:
        i = idx.astype(int)
        return math.log(np.median(x[i]) / np.median(y[i]))

    lr = bootstrap_ci(np.arange(len(seeds), dtype=float), stat=log_ratio)
    verdict = word_comparison(lr, a=f"log median {a}", b=f"log median {b}")
    ratio = [math.exp(v) for v in (lr.estimate, lr.low, lr.high)]
    where = (
        "not resolved (the interval covers 1)"
        if not verdict.resolved
        else (f"{a} faster" if ratio[0] < 1 else f"{a} slower")
    )
    out |= {
        "ratio_of_medians": ratio[0],
        "ratio_ci": [ratio[1], ratio[2]],
        "ratio_method": lr.method + ", seeds resampled jointly",
        "resolved": verdict.resolved,
        "words": verdict.text,
        "text": f"median time {a} / {b} = {ratio[0]:.2f} [95% {ratio[1]:.2f}, {ratio[2]:.2f}], "
        f"n = {len(seeds)} seeds: {where}",
    }
    if len(sa) >= 2 and len(sb) >= 2:
        d = welch_ci(list(sa.values()), list(sb.values()))
        out["mean_difference_seconds"] = asdict(d)
        out["mean_difference_words"] = word_comparison(d, a=a, b=b, unit=" s", digits=1).text
    return out


def summarize(runs: list[dict], sides: list[str], target: float) -> dict:
    by = {s: [r for r in runs if r["side"] == s] for s in sides}
    out: dict = {"sides": {s: side_summary(by[s], target) for s in sides if by[s]}, "comparisons": {}}
    present = [s for s in sides if by[s]]
    for i, a in enumerate(present):
        for b in present[i + 1 :]:
            out["comparisons"][f"{a} / {b}"] = compare(by[a], by[b], a, b)
    return out
