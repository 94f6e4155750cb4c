"""What a steering worker buys within the verifiable-sampling tolerance (issue 41 item 2).

Honest records are drawn by keyed Gumbel-max (rollout/sampling.py) from SmolLM2-135M-Instruct in
fp32, the quickstart's task and settings (T = 0.8, top_p 1, 16 new tokens). For every wrong answer
the attacker searches one deviation: at each position, each other token whose score is within the
tolerance of the arg-max's, then the honest continuation (every later token the arg-max of its own
noise, so the record passes the learner's check at every other position). A wrong answer is
"bought" when some deviation makes it right. Two deviations or more are not searched (a lower bound
on what a worker with more compute buys).

    cd bench && python gumbel_steering.py --prompts 48 --n 4 --json ../docs/bench/gumbel_steering.json

Prints, per tolerance, wrong answers searched, bought, the share with a 95% Wilson interval, and the
share of positions that had an alternative.
"""

from __future__ import annotations

import argparse
import json

import torch
from common import smollm2, write_json
from stats import wilson_ci

from echo2.config import ArithmeticTaskConfig
from echo2.data.tasks import make_task
from echo2.rollout import sampling
from echo2.rollout.engine import encode_prompt

TEMPERATURE = 0.8
MAX_NEW = 16


@torch.no_grad()
def step_scores(model, ids: list[int], seed: int, key: int, position: int) -> torch.Tensor:
    """Scores [V] (float64) of the token at response `position` after `ids`."""
    logits = model(input_ids=torch.tensor([ids])).logits[0, -1:].float()
    return sampling.scores(
        logits, seed=seed, records=torch.tensor([key]), positions=position, temperature=TEMPERATURE
    )[0]


def decode(model, prompt_ids: list[int], prefix: list[int], seed: int, key: int, eos: int) -> list[int]:
    """`prefix`, continued honestly (each token the arg-max of its keyed scores) to EOS or MAX_NEW."""
    resp = list(prefix)
    while len(resp) < MAX_NEW and (not resp or resp[-1] != eos):
        resp.append(int(step_scores(model, prompt_ids + resp, seed, key, len(resp)).argmax()))
    return resp


def search(model, task, prompt, prompt_ids, resp, seed, key, eos, tolerances, tok) -> tuple[dict, dict]:
    """Per tolerance: was some one-token deviation within it right? And positions with an alternative."""
    bought = {t: False for t in tolerances}
    alternatives = {t: 0 for t in tolerances}
    widest = max(tolerances)
    for p in range(len(resp)):
        s = step_scores(model, prompt_ids + resp[:p], seed, key, p)
        best = s.max()
        near = [
            (float(best - s[c]), int(c))
            for c in torch.nonzero(best - s <= widest).flatten()
            if int(c) != resp[p]
        ]
        for t in tolerances:
            alternatives[t] += any(m <= t for m, _ in near)
        for margin, c in sorted(near):
            if all(bought[t] for t in tolerances if margin <= t):
                continue
            new = decode(model, prompt_ids, resp[:p] + [c], seed, key, eos)
            if task.score(prompt, tok.decode(new, skip_special_tokens=True)).correct:
                for t in tolerances:
                    bought[t] |= margin <= t
    return bought, alternatives


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--tolerances", type=float, nargs="+", default=[0.5, 0.1, 0.01])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok, model = smollm2()
    model.eval()
    task = make_task(ArithmeticTaskConfig(difficulty=1, operations=["+", "-", "*"]), seed=0)
    eos = tok.eos_token_id
    totals = {t: {"bought": 0, "alternatives": 0} for t in args.tolerances}
    wrong = right = positions = 0
    for i in range(args.prompts):
        prompt = task.train_prompt(i)
        prompt_ids = list(encode_prompt(tok, prompt))
        seed = 1000 + i
        for j in range(args.n):
            key = sampling.record_key(prompt.group_id, j)
            resp = decode(model, prompt_ids, [], seed, key, eos)
            if task.score(prompt, tok.decode(resp, skip_special_tokens=True)).correct:
                right += 1
                continue
            wrong += 1
            positions += len(resp)
            bought, alts = search(model, task, prompt, prompt_ids, resp, seed, key, eos, args.tolerances, tok)
            for t in args.tolerances:
                totals[t]["bought"] += bought[t]
                totals[t]["alternatives"] += alts[t]
        rows = {}
        for t in args.tolerances:
            ci = wilson_ci(totals[t]["bought"], max(wrong, 1))
            rows[str(t)] = {
                "bought": totals[t]["bought"],
                "share": totals[t]["bought"] / max(wrong, 1),
                "ci95": [ci.low, ci.high],
                "positions_with_alternative": totals[t]["alternatives"] / max(positions, 1),
            }
        result = {
            "prompts": i + 1,
            "records": (i + 1) * args.n,
            "right": right,
            "wrong": wrong,
            "tolerances": rows,
        }
        print(json.dumps(result), flush=True)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
