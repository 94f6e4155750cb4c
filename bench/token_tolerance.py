"""Per-token disagreement between a bf16 HF engine's behaviour log-probs and the fp32 learner's
recomputation (SmolLM2-135M, arithmetic prompts): what the learner's per-token log-prob check
(learning/verify.py: `TOKEN_LOGRATIO`) must tolerate from an honest worker.

    cd bench && python token_tolerance.py --prompts 16 --n 4 --max-new-tokens 24

Prints the number of tokens, the largest |log ratio| and its quantiles, and the largest |mean| per
record.
"""

from __future__ import annotations

import argparse
import copy
import json

import torch
from common import sample_batch, smollm2

from echo2.config import ArithmeticTaskConfig, RolloutConfig
from echo2.data.tasks import make_task
from echo2.learning.step import response_logprobs
from echo2.rollout.engine import HFEngine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tok, model = smollm2()
    task = make_task(ArithmeticTaskConfig(), seed=0)
    prompts = [task.train_prompt(i) for i in range(args.prompts)]
    rcfg = RolloutConfig(
        prompts_per_step=args.prompts,
        group_size=args.n,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
    )
    engine = HFEngine(copy.deepcopy(model), tok, rcfg, dtype=torch.bfloat16)
    groups = engine.generate(prompts, n=args.n)
    records, batch = sample_batch([s for g in groups for s in g], pad_id=tok.pad_token_id)
    with torch.no_grad():
        logp = response_logprobs(model.eval(), batch, temperature=args.temperature)
    diff = ((logp - batch.behaviour_logprobs) * batch.loss_mask).abs()
    tokens = diff[batch.loss_mask.bool()]
    mean = diff.sum(dim=1) / batch.loss_mask.sum(dim=1).clamp(min=1)
    q = torch.quantile(tokens, torch.tensor([0.5, 0.99, 0.999])).tolist()
    out = {
        "tokens": tokens.numel(),
        "records": len(records),
        "max_abs_token_logratio": tokens.max().item(),
        "p50": q[0],
        "p99": q[1],
        "p999": q[2],
        "max_abs_record_mean": mean.max().item(),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
