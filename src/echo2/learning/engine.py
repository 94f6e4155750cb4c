"""The learner's own engine: what `echo2 run` generates rollouts with and every learner evaluates
with, built from the learner's policy (possibly LoRA-wrapped) with rollout/engines.py's parts.

Under torchrun (WORLD_SIZE > 1) it is never vLLM: vLLM's in-process engine would find echo2's NCCL
world initialised and build its groups over every rank with `new_group`, which the other ranks
never call, so rank 0 would hang (vllm/distributed/parallel_state.py `init_distributed_environment`,
`initialize_model_parallel`; docs/gpu.md).
"""

from __future__ import annotations

import logging

import torch

from echo2.config import Config
from echo2.learning.lora import engine_copy, is_lora
from echo2.rollout.engine import Engine, HFEngine
from echo2.rollout.engines import hf_dtype, torchrun_world, vllm_dtype

logger = logging.getLogger(__name__)


def learner_engine(config: Config, *, model, tokenizer, version: int, device: torch.device) -> Engine:
    """The learner's own engine (rollouts in `echo2 run`, evaluation everywhere), generating with
    `model`'s current weights. `model` is the learner's CPU policy before placement, possibly
    LoRA-wrapped: the engine gets a copy (its base weights under LoRA, which adapter snapshots merge
    into) and `model` itself is left as it was."""
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
    if engine == "server":  # a worker's engine (rollout/server_engine.py): the learner evaluates with hf
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
    from echo2.rollout.vllm_engine import make_engine, model_source

    lora = is_lora(model)
    # vLLM loads model.path itself, in the engine's dtype (no copy written), when the engine's weights
    # are the section's: at version 0, or always under LoRA (the base never trains).
    source = model_source(config.model) if version == 0 or lora else None
    return make_engine(
        rcfg,
        model=engine_copy(model) if source is None or lora else None,
        tokenizer=tokenizer,
        version=version,
        seed=config.run.seed,
        dtype=vllm_dtype(config.learner, device),
        adapters=lora,
        model_dir=source,
        shared=device.type == "cuda",  # the learner trains on this GPU too
        device_kind="cuda" if device.type == "cuda" else "cpu",
    )
