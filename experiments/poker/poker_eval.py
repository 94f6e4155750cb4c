"""Poker, honestly measured (issue 23): policies played on the same held-out deals against fixed
opponents, paired against fixed baselines, with the malformed share apart from the chip result.

    python experiments/poker/poker_eval.py play --policies fold_check check_call random hand_strength \\
        --opponents call_station rule_based random --hands 1000
    taskset -c 0 env OMP_NUM_THREADS=1 python experiments/poker/poker_eval.py play --model configs/poker.toml \\
        --opponents call_station rule_based --hands 1000
    python experiments/poker/poker_eval.py play --run-dir runs/poker-callstation-seed0 --opponents call_station rule_based
    python experiments/poker/poker_eval.py summarize            # docs/bench/poker/summary.json (+ summary.md)

The deals are the learner's held-out ones: deal i is the initial state of seed
`int(stable_id("env-eval", i), 16)` (`EnvTask.eval_prompts`, the seeds `run.eval_size` takes, so the
learner's 100 held-out deals are the first 100 here), a seed space apart from the training seeds
`stable_id("env-train", run seed, index)`; `play` checks that none of them is a training seed of run
seeds 0-9 for the first 100,000 training indices. The opponent is a query option of the env (the same
seed gives the same cards and seat whatever the opponent).

Every policy plays as the learner's evaluation does: at most `task.max_turns` decisions per hand
(configs/poker.toml: 2), then the env's default actions (check if possible, else fold) finish the
hand. The model plays through `echo2.rollout.episodes.play` (greedy, batches of `run.eval_batch_size`,
the engine the learner evaluates with), so its numbers are the learner's `eval/*` on these deals. The
fixed baselines (`fold_check`, `check_call`, `random` seeded per deal, `hand_strength`; the rules in
experiments/poker/poker_baselines.py) answer with a well-formed `<answer>...</answer>` through the same env parser.

Per hand (docs/bench/poker/hands/POLICY__OPPONENT.jsonl.gz): deal index and seed, seat, chip result
in BB (without penalties), return (with them), whether a reply was malformed, the policy's decisions
(category: fold / check / call / raise / malformed, and what the env applied) and the default actions
that finished the hand. `summarize` reads them all: per policy x opponent the mean chip result with
its 95% t-interval, the malformed shares, the decision histogram, and per opponent the paired
difference (same deals) of each model policy against each baseline (bench/stats.py's `paired_ci`).
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import random
import sys
import time
from pathlib import Path

from poker_baselines import BASELINES, baseline_reply

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # the harness the benchmarks share: bench/common.py, bench/stats.py
from poker_summary import category, markdown, summarize  # noqa: E402

OUT = ROOT / "docs" / "bench" / "poker"
TRAIN_CHECK_SEEDS, TRAIN_CHECK_INDICES = 10, 100_000


# ---------------------------------------------------------------------------- deals and envs
def deal_seeds(count: int) -> list[int]:
    """The learner's held-out deal seeds (`EnvTask.eval_prompts`), first `count`."""
    from echo2.data.tasks.base import stable_id

    return [int(stable_id("env-eval", i), 16) for i in range(count)]


def check_held_out(seeds: list[int]) -> int:
    """Raises if a deal seed is a training seed of run seeds 0-9 (first 100,000 indices each);
    returns how many training seeds were checked."""
    from echo2.data.tasks.base import stable_id

    held = set(seeds)
    for run_seed in range(TRAIN_CHECK_SEEDS):
        for index in range(TRAIN_CHECK_INDICES):
            if int(stable_id("env-train", run_seed, index), 16) in held:
                raise AssertionError(f"held-out deal = training deal (run seed {run_seed}, index {index})")
    return TRAIN_CHECK_SEEDS * TRAIN_CHECK_INDICES


def env_spec(base: str, opponent: str) -> str:
    """`base` ("poker:heads_up?opponent=call_station&stack_bb=20") with the opponent replaced."""
    from urllib.parse import urlencode

    from echo2.data.envs import parse_env_spec

    name, variant, options = parse_env_spec(base)
    options["opponent"] = opponent
    text = {k: (str(v).lower() if isinstance(v, bool) else v) for k, v in options.items()}
    return f"{name}:{variant}?{urlencode(text)}"


class Recorded:
    """An env that records the policy's decisions and the default actions that end the hand."""

    def __init__(self, env) -> None:
        self.env = env
        self.decisions: list[dict] = []
        self.auto: list[str] = []
        self.replies: list[str] = []

    def __getattr__(self, name):
        return getattr(self.env, name)

    def reset(self, seed: int) -> str:
        self.decisions, self.auto, self.replies = [], [], []
        return self.env.reset(seed)

    def step(self, action_text: str):
        result = self.env.step(action_text)
        self.replies.append(action_text)
        self.decisions.append({"cat": category(result.action, result.malformed), "applied": result.action})
        return result

    def finish(self) -> float:
        start = len(self.env.log)
        reward = self.env.finish()
        self.auto.extend(a for a in self.env.log[start:] if a.startswith("you "))
        return reward


def hand_row(env: Recorded, *, index: int, seed: int, ret: float, truncated: bool, replies: bool) -> dict:
    row = {
        "i": index,
        "seed": seed,
        "seat": "sb" if env.agent == 1 else "bb",
        "chips": env.result(),
        "return": round(ret, 6),
        "malformed": any(d["cat"] == "malformed" for d in env.decisions),
        "decisions": env.decisions,
        "auto": env.auto,
        "truncated": truncated,
    }
    if replies:
        row["replies"] = env.replies
    return row


def play_baseline(
    policy: str, make_env, seeds: list[int], *, max_turns: int, rng_seed: int = 0
) -> list[dict]:
    rows = []
    for i, seed in enumerate(seeds):
        env = Recorded(make_env())
        env.reset(seed)
        rng = random.Random(f"{rng_seed}/{seed}")
        rewards, done = [], False
        for _ in range(max_turns):
            result = env.step(baseline_reply(policy, env, rng))
            rewards.append(result.reward)
            if result.done:
                done = True
                break
        if not done:
            rewards.append(env.finish())
        rows.append(hand_row(env, index=i, seed=seed, ret=sum(rewards), truncated=not done, replies=False))
    return rows


# ---------------------------------------------------------------------------- the model
def load_model_engine(config_path: str | None, run_dir: str | None, device: str = "cpu", dtype: str = "fp32"):
    """(config, engine, label): the initial model of a config, or a run directory's checkpoint
    (its config.toml, weights and version), with the learner's evaluation engine on `device` ("cpu"
    or "cuda") in `dtype` ("fp32", as every CPU result, or "bf16")."""
    import torch

    from echo2.config import load_config
    from echo2.learning import build
    from echo2.learning.device import resolved
    from echo2.learning.engine import learner_engine

    def on_device(config):
        learner = config.learner.model_copy(update={"device": device, "dtype": dtype})
        return resolved(config.model_copy(update={"learner": learner}))

    if run_dir is not None:
        config = on_device(load_config(Path(run_dir) / "config.toml"))
        learner = build.load(config, resume_from=Path(run_dir))
        label = f"model_{Path(run_dir).name}_v{learner.state.version}"
    else:
        config = on_device(load_config(config_path))
        learner = build.load(config)
        label = f"model_{Path(config_path).stem}_initial"
    torch.set_num_threads(config.run.threads or 1)
    engine = learner_engine(
        config,
        model=learner.model,
        tokenizer=learner.tokenizer,
        version=learner.state.version,
        device=torch.device(device),
    )
    return config, engine, label


def play_model(config, engine, opponent: str, seeds: list[int], *, log=print) -> list[dict]:
    from echo2.data.tasks import make_task
    from echo2.rollout.episodes import play

    task_cfg = config.task.model_copy(update={"env": env_spec(config.task.env, opponent)})
    task = make_task(task_cfg, seed=config.run.seed)
    make_env = task.make_env
    task.make_env = lambda: Recorded(make_env())
    prompts = task.eval_prompts(len(seeds))
    assert [p.metadata["env_seed"] for p in prompts] == seeds
    rows, batch = [], config.run.eval_batch_size
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch):
        groups = play(
            engine,
            task,
            prompts[start : start + batch],
            n=1,
            greedy=True,
            max_new_tokens=config.rollout.max_new_tokens,
            max_prompt_tokens=config.rollout.max_prompt_tokens,
        )
        for k, (e,) in enumerate(groups):
            rows.append(
                hand_row(
                    e.env,
                    index=start + k,
                    seed=seeds[start + k],
                    ret=e.ret,
                    truncated=e.truncated,
                    replies=True,
                )
            )
        log(f"  {opponent}: {len(rows)}/{len(seeds)} hands, {time.perf_counter() - t0:.0f} s")
    return rows


# ---------------------------------------------------------------------------- files
def write_hands(path: Path, rows: list[dict]) -> None:
    """Gzipped JSONL, byte-identical for the same rows (no timestamp in the gzip header)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows).encode()
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0, filename="") as f:
        f.write(text)
    path.write_bytes(buf.getvalue())


def record_runs(path: Path, entries: dict) -> None:
    """Merge `entries` into the runs file under an exclusive lock, written whole then renamed: `play`
    processes run side by side (one per core) and each must keep the others' entries."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    folder = os.open(path.parent, os.O_RDONLY)  # the lock is the folder's: no lock file left behind
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        runs = json.loads(path.read_text()) if path.exists() else {}
        runs.update(entries)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(runs, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    finally:
        os.close(folder)  # closing the descriptor releases the lock


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    pl = sub.add_parser("play", help="play policies on the held-out deals; write OUT/hands/*.jsonl.gz")
    pl.add_argument("--policies", nargs="*", default=[], choices=BASELINES)
    pl.add_argument("--model", help="a config: its initial model plays (greedy, as the learner evaluates)")
    pl.add_argument("--run-dir", help="a run directory: its checkpoint plays")
    pl.add_argument("--config", default=str(ROOT / "configs" / "poker.toml"),
                    help="the task settings for the baselines (env spec, max_turns)")  # fmt: skip
    pl.add_argument("--opponents", nargs="+", default=["call_station", "rule_based"])
    pl.add_argument("--hands", type=int, default=1000)
    pl.add_argument("--out", type=Path, default=OUT)
    pl.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model plays")
    pl.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="the model's dtype")
    sm = sub.add_parser("summarize", help="OUT/summary.json and OUT/summary.md from OUT/hands")
    sm.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)

    if args.command == "summarize":
        summary = summarize(args.out)
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        (args.out / "summary.md").write_text(markdown(summary))
        print(markdown(summary))
        return 0

    from echo2.config import load_config
    from echo2.data.tasks import make_task

    seeds = deal_seeds(args.hands)
    checked = check_held_out(seeds)
    print(f"{len(seeds)} held-out deals; none among {checked} training seeds (run seeds 0-9)")
    runs = {}  # this invocation's entries, merged into out/runs.json at the end (record_runs)
    base_cfg = load_config(args.config)
    for opponent in args.opponents:
        cfg = base_cfg.task.model_copy(update={"env": env_spec(base_cfg.task.env, opponent)})
        task = make_task(cfg, seed=0)
        for policy in args.policies:
            t0 = time.perf_counter()
            rows = play_baseline(policy, task.make_env, seeds, max_turns=cfg.max_turns)
            write_hands(args.out / "hands" / f"{policy}__{opponent}.jsonl.gz", rows)
            runs[f"{policy}__{opponent}"] = {
                "env": cfg.env, "max_turns": cfg.max_turns, "seconds": round(time.perf_counter() - t0, 1),
                "command": "python experiments/poker/poker_eval.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            }  # fmt: skip
            print(f"{policy} vs {opponent}: {sum(r['chips'] for r in rows) / len(rows):+.3f} BB/hand")
    if args.model or args.run_dir:
        config, engine, label = load_model_engine(args.model, args.run_dir, args.device, args.dtype)
        for opponent in args.opponents:
            t0 = time.perf_counter()
            rows = play_model(config, engine, opponent, seeds)
            seconds = time.perf_counter() - t0
            write_hands(args.out / "hands" / f"{label}__{opponent}.jsonl.gz", rows)
            runs[f"{label}__{opponent}"] = {
                "env": env_spec(config.task.env, opponent), "max_turns": config.task.max_turns,
                "seconds": round(seconds, 1), "threads": config.run.threads, "device": args.device,
                "dtype": args.dtype,
                "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                "command": "python experiments/poker/poker_eval.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            }  # fmt: skip
            print(
                f"{label} vs {opponent}: {sum(r['chips'] for r in rows) / len(rows):+.3f} BB/hand, {seconds:.0f} s"
            )
    record_runs(args.out / "runs.json", runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
