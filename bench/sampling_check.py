"""Verifiable sampling at the learner (rollout/sampling.py, learning/verify.py: SamplingCheck):
false refusals of honest records and the check's cost. An HF or vLLM engine (bf16 or fp32) samples by
keyed Gumbel-max; the fp32 learner recomputes the logits and checks every token's margin (arg-max
score - the sampled token's score, in units of logits / T) against `sampling.TOLERANCE`, and the
engine's behaviour log-probs against its own (`logprob_diff_max`).

    cd bench && python sampling_check.py --dtype bfloat16 --prompts 64 --n 8 --max-new-tokens 24
    cd bench && python sampling_check.py --dtype float32 --prompts 16 --n 8 --max-new-tokens 24
    cd bench && python sampling_check.py --engine vllm --dtype float32 --prompts 16 --n 8

Prints a JSON line after each chunk of prompts (cumulative; the last is the result): tokens and records checked, records and tokens over the tolerance, margin
quantiles, and the check's seconds per record and per token (the forward pass excluded: the step
computes the logits anyway), on `--threads` threads.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch
from common import margin_stats, sample_batch, smollm2, smollm2_dir

from echo2.config import ArithmeticTaskConfig, RolloutConfig
from echo2.data.tasks import make_task
from echo2.learning.step import response_logits
from echo2.models import token_logprobs
from echo2.rollout import sampling
from echo2.rollout.sampling import SamplingKeys, record_key

GAPS = (0.1, 0.35, 0.5, 1.0)
"""Tolerances the --alternatives figures are given for."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=8, help="prompts per generate call")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--alternatives",
        action="store_true",
        help="also count, per position, the tokens whose score is within the tolerance of the "
        "arg-max's: what a worker could pick instead (full-vocabulary noise: slower)",
    )
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    tok, model = smollm2()
    model.eval()
    task = make_task(ArithmeticTaskConfig(), seed=0)
    rcfg = RolloutConfig(
        group_size=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        sampling="gumbel",
    )
    if args.engine == "vllm":
        from echo2.rollout.vllm_engine import VLLMEngine

        rcfg = rcfg.model_copy(update={"engine": "vllm"})
        source = smollm2_dir()
        engine = VLLMEngine(source, tok, rcfg, dtype=args.dtype, threads=args.threads)
    else:
        from echo2.rollout.engine import HFEngine

        engine = HFEngine(copy.deepcopy(model), tok, rcfg, dtype=getattr(torch, args.dtype))
    margins, bad_records, records_checked, check_s, alternatives = [], 0, 0, 0.0, []
    lp_diff, gen_s = 0.0, 0.0
    for start in range(0, args.prompts, args.chunk):
        prompts = [task.train_prompt(i) for i in range(start, min(args.prompts, start + args.chunk))]
        keys = SamplingKeys(seed=1000 + start, groups=tuple(p.group_id for p in prompts))
        t0 = time.perf_counter()
        groups = engine.generate(prompts, n=args.n, keys=keys)
        gen_s += time.perf_counter() - t0
        for prompt, group in zip(prompts, groups, strict=True):
            rows = [s for s in group]
            recs, batch = sample_batch(rows, pad_id=tok.pad_token_id, group_id=prompt.group_id)
            with torch.no_grad():
                logits = response_logits(model, batch)
            own = token_logprobs(logits, batch.targets, temperature=args.temperature)
            diff = ((own - batch.behaviour_logprobs) * batch.loss_mask).abs().max().item()
            lp_diff = max(lp_diff, diff)
            num_pos = batch.targets.shape[1]
            starts = torch.tensor([num_pos - len(r.response_ids) for r in recs])
            mask = torch.arange(num_pos)[None, :] >= starts[:, None]
            t0 = time.perf_counter()
            rec_keys = torch.tensor([record_key(prompt.group_id, j) for j in range(len(recs))])
            verdict = sampling.check(
                logits,
                batch.targets,
                mask,
                starts=starts,
                seed=[keys.seed] * len(recs),
                records=rec_keys,
                temperature=args.temperature,
                top_p=args.top_p,
            )
            check_s += time.perf_counter() - t0
            margins.append(verdict.margins[mask])
            if args.alternatives:
                for k in range(num_pos):
                    rows = mask[:, k].nonzero().flatten()
                    if rows.numel():
                        total = sampling.scores(
                            logits[rows, k],
                            seed=keys.seed,
                            records=rec_keys[rows],
                            positions=k - starts[rows],
                            temperature=args.temperature,
                            top_p=args.top_p,
                        )
                        gap = total.max(-1, keepdim=True).values - total  # [b, V]
                        alternatives.extend([[int((gap <= t).sum()) - 1 for t in GAPS] for gap in gap])
            bad_records += int((~verdict.ok).sum())
            records_checked += len(recs)
        extra = {"logprob_diff_max": lp_diff, "generate_s": gen_s}
        report(
            args,
            margins,
            bad_records,
            records_checked,
            check_s,
            alternatives,
            vocab=logits.shape[-1],
            **extra,
        )


def report(
    args,
    margins,
    bad_records: int,
    records_checked: int,
    check_s: float,
    alternatives,
    *,
    vocab: int,
    **extra,
) -> None:
    m = torch.cat(margins)
    print(
        json.dumps(
            {
                "engine": args.engine,
                "dtype": args.dtype,
                "threads": args.threads,
                "temperature": args.temperature,
                "top_p": args.top_p,
                "tolerance": sampling.TOLERANCE,
                "tokens": m.numel(),
                "records": records_checked,
                "records_refused": bad_records,
                **margin_stats(m),
                "check_s_per_record": check_s / records_checked,
                "check_ms_per_token": 1000 * check_s / m.numel(),
                "vocab": int(vocab),
                **extra,
                **(
                    {
                        f"positions_with_an_alternative_within_{t}": sum(a[i] > 0 for a in alternatives)
                        / len(alternatives)
                        for i, t in enumerate(GAPS)
                    }
                    if alternatives
                    else {}
                ),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
