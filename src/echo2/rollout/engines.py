"""Which engine generates where: the factory for the learner's in-process engine and a worker's.

`learner_engine` builds the engine `echo2 run`/`echo2 learner` generate or evaluate with, from the
learner's policy; `worker_engine` the one `echo2 worker` generates with, from the model section
alone (its weights arrive as snapshots). Both put the engine on a device in the dtype snapshots
arrive in (`engine_dtype`). Under torchrun (WORLD_SIZE > 1) the learner never builds vLLM: vLLM's
in-process engine would find echo2's NCCL world initialised and build its groups over every rank
with `new_group`, which the other ranks never call, so rank 0 would hang (vllm/distributed/
parallel_state.py `init_distributed_environment`, `initialize_model_parallel`; docs/gpu.md).
"""

from __future__ import annotations

import logging
import os

import torch

from echo2.config import Config, LearnerConfig
from echo2.rollout.engine import Engine, HFEngine

logger = logging.getLogger(__name__)


def torchrun_world() -> int:
    """WORLD_SIZE as torchrun sets it (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def engine_dtype(config: LearnerConfig, device: torch.device) -> torch.dtype:
    """The dtype snapshots arrive in (learner.dtype; "auto": bf16 on a CUDA device that supports it,
    as the learner resolves it), which a GPU engine generates in. CPU engines keep fp32 for the HF
    engine (see `hf_dtype`)."""
    if config.dtype == "bf16":
        return torch.bfloat16
    if config.dtype == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def hf_dtype(config: LearnerConfig, device: torch.device) -> torch.dtype:
    """The HF engine's dtype: the snapshot dtype on a GPU; fp32 on the CPU, as before (transformers'
    CPU kernels gain little from bf16, and CPU results stay what they were)."""
    return engine_dtype(config, device) if device.type == "cuda" else torch.float32


def learner_engine(config: Config, *, model, tokenizer, version: int, device: torch.device) -> Engine:
    """The learner's own engine (rollouts in `echo2 run`, evaluation everywhere), generating with
    `model`'s current weights. `model` is the learner's CPU policy before placement, possibly
    LoRA-wrapped: the engine gets a copy (its base weights under LoRA, which adapter snapshots merge
    into) and `model` itself is left as it was."""
    from echo2.learning.lora import engine_copy, is_lora

    rcfg = config.rollout
    engine = rcfg.engine
    world = torchrun_world()
    if engine == "vllm" and world > 1:
        logger.warning(
            "rollout.engine = vllm: under torchrun (WORLD_SIZE=%d) the learner evaluates with the hf "
            "engine on %s instead (an in-process vLLM would build its process groups over echo2's NCCL "
            "world, which only rank 0 joins, and hang); workers still use vllm",
            world,
            device,
        )
        engine = "hf"
    if engine == "hf":
        return HFEngine(
            engine_copy(model),
            tokenizer,
            rcfg,
            version=version,
            device=device,
            dtype=hf_dtype(config.learner, device),
        )
    from echo2.rollout.vllm_engine import make_engine

    return make_engine(
        rcfg,
        model=engine_copy(model),
        tokenizer=tokenizer,
        version=version,
        seed=config.run.seed,
        dtype=str(engine_dtype(config.learner, device)).removeprefix("torch."),
        adapters=is_lora(model),
    )


def worker_engine(config: Config, *, tokenizer, engine: str | None, device: torch.device) -> Engine:
    """An `echo2 worker`'s engine: `engine` ("hf" or "vllm"; None: the run's rollout.engine) on
    `device`, in the dtype snapshots arrive in. It starts from the model section's weights
    (version -1 until the first snapshot installs)."""
    from echo2.models import load_model
    from echo2.rollout.vllm_engine import make_engine

    rcfg = config.rollout if engine is None else config.rollout.model_copy(update={"engine": engine})
    model = load_model(config.model, vocab_size=len(tokenizer), seed=config.run.seed)
    if rcfg.engine == "hf":
        return HFEngine(
            model, tokenizer, rcfg, version=-1, device=device, dtype=hf_dtype(config.learner, device)
        )
    return make_engine(
        rcfg,
        model=model,
        tokenizer=tokenizer,
        version=-1,
        seed=config.run.seed,
        dtype=str(engine_dtype(config.learner, device)).removeprefix("torch."),
        adapters=config.learner.lora is not None,  # LoRA runs publish adapter snapshots
    )
