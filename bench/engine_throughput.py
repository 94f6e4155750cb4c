"""Benchmark: rollout tokens/s of the vLLM engine against the HF engine on SmolLM2-135M-Instruct.

Same prompts (the arithmetic task's first P training problems, chat template), same n samples per
prompt, same length cap and temperature, one engine after the other in this process (HF first, so
vLLM's thread settings cannot slow it). tokens/s = generated tokens (EOS included) / wall time of
one `generate` call; prints each repeat and the median. Also times one in-place snapshot install
into the running vLLM engine and the largest |log ratio| of its behaviour log-probs against the
learner's fp32 recomputation. Needs the `vllm` extra.

    python bench/engine_throughput.py --prompts 16 --n 8 --max-new-tokens 16 --repeats 3
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
from common import sample_batch, smollm2, smollm2_dir, write_json

from echo2.config import ArithmeticTaskConfig, RolloutConfig
from echo2.data.tasks import make_task
from echo2.learning.step import response_logprobs
from echo2.records import Snapshot
from echo2.rollout.engine import HFEngine
from echo2.rollout.vllm_engine import VLLMEngine


def tokens_per_s(engine, prompts, *, n: int, repeats: int) -> tuple[list[float], list]:
    rates, last = [], None
    for r in range(repeats):
        torch.manual_seed(r)
        t0 = time.perf_counter()
        last = engine.generate(prompts, n=n)
        dt = time.perf_counter() - t0
        rates.append(sum(len(s.response_ids) for g in last for s in g) / dt)
    return rates, last


def max_log_ratio(model, tok, groups, temperature: float) -> float:
    _, batch = sample_batch([s for g in groups for s in g], pad_id=tok.pad_token_id)
    with torch.no_grad():
        logp = response_logprobs(model.eval(), batch, temperature=temperature)
    return ((logp - batch.behaviour_logprobs) * batch.loss_mask).abs().max().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", help="vLLM weights: float32 (as the learner) or bfloat16")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    tok, model = smollm2()
    task = make_task(ArithmeticTaskConfig(), seed=0)
    prompts = [task.train_prompt(i) for i in range(args.prompts)]
    rcfg = RolloutConfig(
        prompts_per_step=args.prompts,
        group_size=args.n,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
    )
    out = {"config": vars(args)}

    hf = HFEngine(copy.deepcopy(model), tok, rcfg)
    out["hf_tokens_per_s"], _ = tokens_per_s(hf, prompts, n=args.n, repeats=args.repeats)
    del hf

    t0 = time.perf_counter()
    engine = VLLMEngine(smollm2_dir(), tok, rcfg, dtype=args.dtype, threads=args.threads)
    out["vllm_start_s"] = time.perf_counter() - t0
    out["vllm_tokens_per_s"], groups = tokens_per_s(engine, prompts, n=args.n, repeats=args.repeats)
    out["vllm_max_abs_log_ratio"] = max_log_ratio(model, tok, groups, args.temperature)
    t0 = time.perf_counter()
    engine.install(Snapshot(version=1, state=model.state_dict()))
    out["vllm_install_s"] = time.perf_counter() - t0

    for name in ("hf", "vllm"):
        rates = out[f"{name}_tokens_per_s"]
        print(
            f"{name:5s} tokens/s: {', '.join(f'{r:.0f}' for r in rates)}  median {statistics.median(rates):.0f}"
        )
    print(
        f"vllm: start {out['vllm_start_s']:.1f} s, install {out['vllm_install_s']:.2f} s, "
        f"max |log ratio| {out['vllm_max_abs_log_ratio']:.2e}"
    )
    print(json.dumps(out))
    write_json(args.json, out)


if __name__ == "__main__":
    main()
