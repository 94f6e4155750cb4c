"""Verifiable sampling of environment episodes (rollout/episodes.py, learning/verify.py:
SamplingCheck with `episodes`): false refusals of honest poker episodes and the check's cost. An HF
engine (bf16 or fp32) plays heads-up poker by keyed Gumbel-max, each reply keyed at its positions in
the record; the fp32 learner recomputes the logits of whole episodes and checks every loss-mask
(sampled) token, the env tokens skipped, as `train_step` does.

    cd bench && python episode_sampling_check.py --dtype bfloat16 --deals 32 --n 4

`--first-deal` starts at another training deal, so that two processes of one thread each can share
a long run (deals 0-124 and 125-249; their last lines add up: `--json` writes each one's).

Prints a JSON line after each chunk of deals (cumulative; the last is the result): episodes,
replies and sampled tokens checked, env tokens skipped, records refused, tokens over the tolerance,
margin quantiles, and the check's milliseconds per sampled token (the forward pass excluded: the
step computes the logits anyway), on `--threads` threads.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
from common import margin_stats, smollm2

from echo2.config import EnvTaskConfig, RolloutConfig
from echo2.data.tasks import make_task
from echo2.data.tasks.base import to_tensors
from echo2.learning.step import response_logits
from echo2.learning.verify import sampling_check
from echo2.rollout import sampling
from echo2.rollout.collect import collect
from echo2.rollout.engine import HFEngine

SNAPSHOT = {"bfloat16": "bf16", "float32": "fp32"}
"""The engine's dtype is its snapshots': the check's default tolerance follows it."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--deals", type=int, default=32)
    ap.add_argument("--n", type=int, default=4, help="episodes per deal (group size)")
    ap.add_argument("--chunk", type=int, default=4, help="deals per collect call")
    ap.add_argument("--max-new-tokens", type=int, default=12, help="per reply")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--opponent", default="rule_based")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--first-deal", type=int, default=0)
    ap.add_argument("--json", help="also write the last (cumulative) line here")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    tok, model = smollm2()
    model.eval()
    task = make_task(
        EnvTaskConfig(env=f"poker:heads_up?opponent={args.opponent}", max_turns=4, max_tokens=800), seed=0
    )
    rcfg = RolloutConfig(
        group_size=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=700,
        sampling="gumbel",
    )
    engine = HFEngine(copy.deepcopy(model), tok, rcfg, dtype=getattr(torch, args.dtype))
    totals = {"episodes": 0, "replies": 0, "env_tokens": 0, "records_refused": 0}
    margins, check_s, t_start = [], 0.0, time.perf_counter()
    refused: list[dict] = []
    end = args.first_deal + args.deals
    for start in range(args.first_deal, end, args.chunk):
        prompts = [task.train_prompt(i) for i in range(start, min(end, start + args.chunk))]
        groups = collect(engine, task, prompts, n=args.n, sampling_seed=1000 + start)
        for group in groups:
            batch = to_tensors(group, pad_id=tok.pad_token_id, advantages=[0.0] * len(group))
            with torch.no_grad():
                logits = response_logits(model, batch)
            check = sampling_check(
                rcfg, is_env=True, eos_id=tok.eos_token_id, snapshot_dtype=SNAPSHOT[args.dtype]
            )
            t0 = time.perf_counter()
            bad = check.unsampled(logits, batch.targets, group, check.bad_keys([group]))
            check_s += time.perf_counter() - t0
            margins.append(_margins(logits, batch.targets, group, rcfg))
            totals["episodes"] += len(group)
            totals["replies"] += sum(r.metadata["turns"] for r in group)
            totals["env_tokens"] += sum(len(r.loss_mask) - sum(r.loss_mask) for r in group)
            totals["records_refused"] += int(bad.sum())
            refused += [
                {"group_id": r.group_id, "record_id": r.record_id, "tokens": len(r.response_ids)}
                for r, b in zip(group, bad.tolist(), strict=True)
                if b
            ]
        line = report(args, totals, margins, check_s, refused, time.perf_counter() - t_start, check.tolerance)
    if args.json:
        Path(args.json).write_text(json.dumps(line, indent=1) + "\n")


def _margins(logits, targets, records, rcfg) -> torch.Tensor:
    """Every loss-mask token's margin (the check's own computation, for the quantiles)."""
    num_pos = targets.shape[1]
    mask = torch.zeros(targets.shape, dtype=torch.bool)
    for i, r in enumerate(records):
        mask[i, num_pos - len(r.loss_mask) :] = torch.tensor(r.loss_mask) != 0
    verdict = sampling.check(
        logits,
        targets,
        mask,
        starts=torch.tensor([num_pos - len(r.response_ids) for r in records]),
        seed=[r.metadata[sampling.SEED_KEY] for r in records],
        records=torch.tensor(
            [sampling.record_key(r.group_id, r.metadata[sampling.SAMPLE_KEY]) for r in records]
        ),
        temperature=rcfg.temperature,
        top_p=rcfg.top_p,
    )
    return verdict.margins[mask]


def report(
    args, totals: dict, margins, check_s: float, refused: list, wall_s: float, tolerance: float
) -> dict:
    m = torch.cat(margins)
    line = {
        "dtype": args.dtype,
        "threads": args.threads,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "opponent": args.opponent,
        "deals": [args.first_deal, args.first_deal + args.deals],
        "tolerance": tolerance,
        **totals,
        "refused": refused,
        "sampled_tokens": m.numel(),
        **margin_stats(m),
        "check_ms_per_sampled_token": 1000 * check_s / m.numel(),
        "wall_s": wall_s,
    }
    print(json.dumps(line), flush=True)
    return line


if __name__ == "__main__":
    main()
