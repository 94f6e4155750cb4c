"""A short supervised warm-up for poker (issue 23): a format-valid, card-blind starting policy, so
that GRPO starts from a model that names legal actions of every kind instead of one that repeats
the observation (every untrained reply is malformed, docs/tasks.md).

The targets are the `random` baseline's replies (experiments/poker/poker_baselines.py: a uniform legal action kind,
fold only facing a bet, a raise to a uniform legal size) at each deal's first decision, on training
deals only: deal k of warm-up seed s is the initial state of `stable_id("env-warmup", s, k)`, a
seed space apart from both the learner's training and held-out deals (checked). The context is the
learner's own: the chat-rendered system prompt and observation, then the env's reply prefix
(`<answer>`); the loss is cross-entropy on the reply tokens only (the action, `</answer>` and the
EOS that ends the message). The cards never decide the target, so whatever the warmed model does with its
cards afterwards is GRPO's.

    OMP_NUM_THREADS=2 python experiments/poker/poker_warmup.py --config configs/poker.toml --deals 512 \\
        --threads 2 --out runs/poker-warm --json docs/bench/poker_warm/warmup.json   # ~13 min, CPU

`--out` is an HF model directory (config.json, safetensors, tokenizer) with `poker.toml`, the
config's copy with this model: `echo2 run runs/poker-warm/poker.toml --run.seed=1` trains from it and
`python experiments/poker/poker_eval.py play --model runs/poker-warm/poker.toml` plays it.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # the harness the benchmarks share: bench/common.py, bench/stats.py


def warmup_examples(config, tokenizer, deals: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(context ids, reply ids) for the first decision of `deals` warm-up deals."""
    from poker_baselines import baseline_reply

    from echo2.data.tasks import make_task
    from echo2.data.tasks.base import stable_id
    from echo2.rollout.episodes import ChatTokens

    task = make_task(config.task, seed=config.run.seed)
    env = task.make_env()
    chat = ChatTokens(tokenizer).for_env(env)
    held_out = {p.metadata["env_seed"] for p in task.eval_prompts(1000)}  # poker_eval's deals
    out = []
    for k in range(deals):
        deal = int(stable_id("env-warmup", seed, k), 16)
        if deal in held_out:
            raise AssertionError(f"warm-up deal {deal} is a held-out deal")
        prompt = task._prompt(stable_id("env-warmup", seed, k), deal)  # as EnvTask builds every prompt
        context = chat.first(prompt, max_tokens=config.rollout.max_prompt_tokens) + chat.prefix
        env.reset(deal)
        reply = baseline_reply("random", env, random.Random(f"warmup/{seed}/{deal}"))
        out.append((context, chat.ids(reply.removeprefix(chat.prefix_text) + tokenizer.eos_token)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/poker.toml")
    ap.add_argument("--deals", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True, help="the warmed model's HF directory")
    ap.add_argument("--json", help="write the losses and settings here")
    args = ap.parse_args()

    import torch
    from common import write_json
    from tqdm import tqdm

    from echo2.config import dump_toml, load_config
    from echo2.config.workload import HFModelConfig
    from echo2.learning import build

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    config = load_config(args.config)
    learner = build.load(config)
    model, tokenizer = learner.model, learner.tokenizer
    examples = warmup_examples(config, tokenizer, args.deals, args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    model.train()
    losses, rng, t0 = [], random.Random(args.seed), time.perf_counter()
    order = [i for _ in range(args.epochs) for i in rng.sample(range(len(examples)), len(examples))]
    batches = [order[i : i + args.batch] for i in range(0, len(order), args.batch)]
    for batch in tqdm(batches, desc="poker warm-up", unit="batch"):
        optimizer.zero_grad()
        tokens = sum(len(examples[i][1]) for i in batch)
        total = 0.0
        for i in batch:
            context, reply = examples[i]
            ids = torch.tensor([context + reply])
            logits = model(ids).logits[0, len(context) - 1 : -1].float()
            loss = torch.nn.functional.cross_entropy(logits, ids[0, len(context) :], reduction="sum") / tokens
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(total)
    model.eval()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    warm = config.model_copy(update={"model": HFModelConfig(path=str(Path(args.out).resolve()))})
    (Path(args.out) / "poker.toml").write_text(dump_toml(warm))  # the config to train and play it
    print(f"loss per reply token: first batch {losses[0]:.3f}, last {losses[-1]:.3f}; {args.out}")
    write_json(
        args.json,
        {
            "command": "python experiments/poker/poker_warmup.py " + " ".join(sys.argv[1:]),
            "settings": vars(args),
            "examples": len(examples),
            "seconds": round(time.perf_counter() - t0, 1),
            "loss_per_batch": [round(x, 4) for x in losses],
        },
    )


if __name__ == "__main__":
    main()
