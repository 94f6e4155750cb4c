"""Benchmark: echo2's rollout generation and GRPO training step against TRL's GRPOTrainer.

Same model (SmolLM2-135M-Instruct, fp32), same prompts (the arithmetic task's training problems),
same batch (P prompts x n samples), same generation length and temperature, same machine, run one
after the other in this process. Reports median tokens/s per step for generation (completion
tokens / generation time) and training (prompt + completion tokens / training time) and the ratios.

TRL's time is split with a timer around `GRPOTrainer._generate` (generation) inside each optimizer
step timed by a callback; training = step - generation (TRL's scoring and bookkeeping included).

    python bench/trl_compare.py --steps 6 --json docs/bench/trl_compare.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from pathlib import Path

import torch
from common import smollm2, smollm2_dir, trl_grpo_config, write_json

from echo2.config import ArithmeticTaskConfig, LearnerConfig, RolloutConfig
from echo2.data.tasks import make_task
from echo2.learning.step import make_optimizer, train_step
from echo2.rollout.collect import collect
from echo2.rollout.engine import HFEngine


def run_echo2(args, task, prompts_per_step):
    tok, model = smollm2()
    rcfg = RolloutConfig(
        prompts_per_step=args.prompts,
        group_size=args.n,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
    )
    lcfg = LearnerConfig(lr=args.lr, micro_batch_tokens=args.micro_batch_tokens)
    engine = HFEngine(copy.deepcopy(model), tok, rcfg)
    opt = make_optimizer(model, lcfg)
    rows = []
    for step, prompts in enumerate(prompts_per_step):
        torch.manual_seed(step)
        t0 = time.perf_counter()
        groups = collect(engine, task, prompts, n=args.n)
        t1 = time.perf_counter()
        stats = train_step(model, opt, groups, lcfg, pad_id=tok.pad_token_id, temperature=args.temperature)
        t2 = time.perf_counter()
        engine.model.load_state_dict(model.state_dict())
        records = [r for g in groups for r in g]
        rows.append(
            {
                "gen_s": t1 - t0,
                "train_s": t2 - t1,
                "completion_tokens": sum(len(r.response_ids) for r in records),
                "train_tokens": stats["train/tokens"],
            }
        )
    nonembed = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    return rows, nonembed


def run_trl(args, task, prompts_per_step):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    path = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    flat = [p for ps in prompts_per_step for p in ps]
    answers = {p.messages[-1]["content"]: p for p in flat}
    dataset = Dataset.from_list([{"prompt": list(p.messages)} for p in flat])

    def reward(prompts, completions, **_):
        out = []
        for prompt, completion in zip(prompts, completions, strict=True):
            p = answers[prompt[-1]["content"]]
            out.append(task.score(p, completion[0]["content"]).reward)
        return out

    timing = {"gen": 0.0, "completion_tokens": 0, "train_tokens": 0}
    rows = []

    class Timed(GRPOTrainer):
        def _generate(self, prompts):
            t = time.perf_counter()
            out = super()._generate(prompts)
            timing["gen"] += time.perf_counter() - t
            prompt_ids, completion_ids = out[0], out[1]
            timing["completion_tokens"] += sum(len(c) for c in completion_ids)
            timing["train_tokens"] += sum(
                len(p) + len(c) for p, c in zip(prompt_ids, completion_ids, strict=True)
            )
            return out

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            timing.update(gen=0.0, completion_tokens=0, train_tokens=0, t0=time.perf_counter())

        def on_step_end(self, *a, **k):
            total = time.perf_counter() - timing["t0"]
            rows.append(
                {
                    "gen_s": timing["gen"],
                    "train_s": total - timing["gen"],
                    "completion_tokens": timing["completion_tokens"],
                    "train_tokens": timing["train_tokens"],
                }
            )

    cfg = trl_grpo_config(
        output_dir=str(Path(args.tmp) / "trl"),
        prompts=args.prompts,
        n=args.n,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        lr=args.lr,
        steps=len(prompts_per_step),
    )
    trainer = Timed(
        model=model,
        reward_funcs=reward,
        args=cfg,
        train_dataset=dataset,
        processing_class=tok,
        callbacks=[StepTimer()],
    )
    trainer.train()
    return rows


def summarise(rows, warmup, *, nonembed_params):
    rows = rows[warmup:]
    flop_per_token = 6 * nonembed_params  # forward + backward matmuls, embeddings excluded
    return {
        "train_gflop_per_s": statistics.median(
            flop_per_token * r["train_tokens"] / r["train_s"] / 1e9 for r in rows
        ),
        "gen_tokens_per_s": statistics.median(r["completion_tokens"] / r["gen_s"] for r in rows),
        "train_tokens_per_s": statistics.median(r["train_tokens"] / r["train_s"] for r in rows),
        "gen_s": statistics.median(r["gen_s"] for r in rows),
        "train_s": statistics.median(r["train_s"] for r in rows),
        "steps": len(rows),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6, help="measured steps per side (plus one warm-up)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--micro-batch-tokens", type=int, default=4096)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--tmp", default="/tmp/echo2-bench")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    task = make_task(ArithmeticTaskConfig(), seed=0)
    total = args.steps + 1
    prompts = [[task.train_prompt(s * args.prompts + i) for i in range(args.prompts)] for s in range(total)]

    ours_rows, nonembed = run_echo2(args, task, prompts)
    ours = summarise(ours_rows, warmup=1, nonembed_params=nonembed)
    trl = summarise(run_trl(args, task, prompts), warmup=1, nonembed_params=nonembed)  # same model
    result = {
        "setup": {k: v for k, v in vars(args).items() if k not in ("json", "tmp")},
        "echo2": ours,
        "trl": trl,
        "ratio": {
            "generation": ours["gen_tokens_per_s"] / trl["gen_tokens_per_s"],
            "training": ours["train_tokens_per_s"] / trl["train_tokens_per_s"],
        },
        "versions": {m: __import__(m).__version__ for m in ("torch", "transformers", "trl")},
    }
    print(json.dumps(result, indent=2))
    write_json(args.json, result)


if __name__ == "__main__":
    main()
