"""Where and in what precision the learner trains, and the dtype its snapshots are published in.

Owns `learner.device`, `learner.dtype`, `learner.gradient_checkpointing` and the default of
`learner.micro_batch_tokens`: resolving the device (refusing cuda without a GPU, as a ConfigError
naming the key) and the GPU defaults ("auto"/None become concrete values once, at the learner's
start: `resolved`), placing the policy, its reference and its optimizer there (sharded by FSDP2
when several processes train, see distributed.py), the autocast context of the forward pass, moving
a micro-batch to the policy's device, and turning the learner's fp32 weights into a snapshot's
state dict in the rollout dtype.

bf16 is fp32 master weights with bf16 autocast: parameters, gradients and AdamW state stay fp32,
matmuls run in bf16, and log-softmax runs in fp32 (models.token_logprobs casts logits up). Under
FSDP2 the gathered parameters are bf16 and gradients are reduced in fp32 (distributed.shard). Knows
nothing of GRPO, tasks, rollouts or the coordinator.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os

import torch

from echo2 import gpu_env
from echo2.config import Config, ConfigError, LearnerConfig
from echo2.learning import distributed

logger = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# learner.micro_batch_tokens = None by device type (docs/config.md). The CPU value is the one every
# CPU result so far was measured with; a GPU takes several rows per FSDP gather and reduction.
MICRO_BATCH_TOKENS = {"cpu": 4096, "cuda": 16384}


def resolve_device(config: LearnerConfig) -> torch.device:
    """learner.device as a torch device; under torchrun on CUDA, this rank's GPU (LOCAL_RANK)."""
    has_gpu = torch.cuda.is_available()
    if not has_gpu:  # cuda, or auto beside a GPU torch cannot use: exit 2 with the reason (gpu_env.py)
        gpu_env.check_device(config.device, key="learner.device")
    if config.device == "cpu" or not has_gpu:
        return torch.device("cpu")
    return torch.device("cuda", distributed.local_rank())


def resolved(config: Config) -> Config:
    """A copy of `config` whose learner.dtype, gradient_checkpointing and micro_batch_tokens are
    concrete for this machine's learner device: the learner calls it once at start, before
    config.toml is written, so the run directory and the workers only ever see concrete values."""
    learner = resolved_learner(config.learner)
    return config if learner is config.learner else config.model_copy(update={"learner": learner})


def resolved_learner(config: LearnerConfig) -> LearnerConfig:
    """learner.dtype "auto" -> bf16 on a CUDA device that supports it, else fp32;
    gradient_checkpointing None -> on for CUDA, off for the CPU; micro_batch_tokens None -> 4096 on
    the CPU, 16384 on CUDA. A config with nothing left to resolve is returned as it is (the device
    is then not probed again)."""
    if config.dtype != "auto" and config.gradient_checkpointing is not None and config.micro_batch_tokens:
        return config
    kind = resolve_device(config).type
    cuda = kind == "cuda"
    update = {}
    if config.dtype == "auto":
        update["dtype"] = "bf16" if cuda and torch.cuda.is_bf16_supported() else "fp32"
    if config.gradient_checkpointing is None:
        update["gradient_checkpointing"] = cuda
    if config.micro_batch_tokens is None:
        update["micro_batch_tokens"] = MICRO_BATCH_TOKENS[kind]
    return config.model_copy(update=update)


def check_start(config: LearnerConfig, *, resume: bool = False) -> None:
    """Refuse, before anything is written, a device or dtype this machine cannot train with, and a
    resume under torchrun (not supported yet)."""
    if resume and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("--resume: resuming a run is not supported under torchrun yet")
    device = resolve_device(config)
    if config.dtype == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("learner.dtype: bf16 needs a GPU that supports it (Ampere or newer); use fp32")


def place(model, optimizer, ref_model, config: LearnerConfig, *, make_optimizer):
    """(model, optimizer, ref_model) on the learner's device, sharded when several processes train.

    One process: moved whole. Several (torchrun): FSDP2 shards each model without ever moving it
    whole, and rank 0's weights are broadcast into every rank's shards, so ranks > 0 may pass a
    model built on the meta device (distributed.shard). The optimizer is rebuilt over the placed
    parameters (FSDP2 replaces them with sharded ones); state loaded on resume is carried over on
    one device. `make_optimizer(model, config)` builds it.
    """
    config = resolved_learner(config)
    device = resolve_device(config)
    if config.gradient_checkpointing:
        _checkpoint_activations(model)
    state = optimizer.state_dict() if optimizer is not None else None
    if distributed.world_size() > 1:
        if state and state["state"]:
            raise ConfigError("--resume: resuming a run is not supported under torchrun yet")
        param_dtype = None if config.dtype == "fp32" else DTYPES[config.dtype]
        distributed.shard(model, param_dtype=param_dtype)
        if ref_model is not None:
            distributed.shard(ref_model, param_dtype=param_dtype)
        state = None
    else:
        model.to(device)
        if ref_model is not None:
            ref_model.to(device)
    optimizer = make_optimizer(model, config)
    if state is not None:
        optimizer.load_state_dict(state)  # moves AdamW state to the parameters' device
    logger.info(
        "learner on %s in %s (%d process(es)%s)",
        device,
        config.dtype,
        distributed.world_size(),
        ", gradient checkpointing" if config.gradient_checkpointing else "",
    )
    return model, optimizer, ref_model


def _checkpoint_activations(model) -> None:
    """Non-reentrant checkpointing of every decoder layer (transformers renamed the method in 5.x)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _device_of(model) -> torch.device:
    return next(model.parameters()).device


def precision(model, config: LearnerConfig) -> contextlib.AbstractContextManager:
    """The context a forward pass runs in: bf16 autocast on the model's device, or nothing."""
    dtype = resolved_learner(config).dtype
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=_device_of(model).type, dtype=DTYPES[dtype])


def on_device(batch, model):
    """A micro-batch (a dataclass of tensors) on the model's device."""
    device = _device_of(model)
    if device.type == "cpu":
        return batch
    moved = {
        f.name: getattr(batch, f.name).to(device, non_blocking=True)
        for f in dataclasses.fields(batch)
        if isinstance(getattr(batch, f.name), torch.Tensor)
    }
    return dataclasses.replace(batch, **moved)


def snapshot_state(model, config: LearnerConfig) -> dict[str, torch.Tensor]:
    """The learner's full weights as new CPU tensors in the snapshot dtype (learner.dtype), each
    once: a tied alias (lm_head.weight under tie_word_embeddings) is left out, since every engine
    loads the weight it shares (models.install_state, vllm_ext.py).

    Under FSDP2 every rank takes part in the gather (rank 0 orders it) and only rank 0 gets the
    weights; the others get {}. The aliases are found on the model (`tied_names`): the gathered
    full state holds them as separate tensors.
    """
    from echo2.models import tied_names

    dtype = DTYPES[config.dtype]
    tied = tied_names(model)
    state = distributed.full_state(model)
    return {
        k: v.detach().to("cpu", dtype=dtype if v.is_floating_point() else v.dtype, copy=True)
        for k, v in state.items()
        if k not in tied
    }
