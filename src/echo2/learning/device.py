"""Where and in what precision the learner trains, and the dtype its snapshots are published in.

Owns `learner.device`, `learner.dtype` and `learner.gradient_checkpointing`: resolving the device
(refusing cuda without a GPU, as a ConfigError naming the key), placing the policy, its reference
and its optimizer there (sharded by FSDP2 when several processes train, see distributed.py), the
autocast context of the forward pass, moving a micro-batch to the policy's device, and turning the
learner's fp32 weights into a snapshot's state dict in the rollout dtype.

bf16 is fp32 master weights with bf16 autocast: parameters, gradients and AdamW state stay fp32,
matmuls run in bf16, and log-softmax runs in fp32 (models.token_logprobs casts logits up). Knows
nothing of GRPO, tasks, rollouts or the coordinator.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os

import torch

from echo2 import gpu_env
from echo2.config import ConfigError, LearnerConfig
from echo2.learning import distributed

logger = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve_device(config: LearnerConfig) -> torch.device:
    """learner.device as a torch device; under torchrun on CUDA, this rank's GPU (LOCAL_RANK)."""
    has_gpu = torch.cuda.is_available()
    if not has_gpu:  # cuda, or auto beside a GPU torch cannot use: exit 2 with the reason (gpu_env.py)
        gpu_env.check_device(config.device, key="learner.device")
    if config.device == "cpu" or not has_gpu:
        return torch.device("cpu")
    return torch.device("cuda", distributed.local_rank())


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

    The optimizer is rebuilt over the placed parameters (FSDP2 replaces them with sharded ones);
    state loaded on resume is carried over on one device. `make_optimizer(model, config)` builds it.
    """
    device = resolve_device(config)
    if config.gradient_checkpointing:
        _checkpoint_activations(model)
    model.to(device)
    if ref_model is not None:
        ref_model.to(device)
    state = optimizer.state_dict() if optimizer is not None else None
    if distributed.world_size() > 1:
        if state and state["state"]:
            raise ConfigError("--resume: resuming a run is not supported under torchrun yet")
        distributed.shard(model)
        if ref_model is not None:
            distributed.shard(ref_model)
        state = None
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
    if config.dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=_device_of(model).type, dtype=DTYPES[config.dtype])


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
    """The learner's full weights as new CPU tensors in the snapshot dtype (learner.dtype).

    Under FSDP2 every rank takes part in the gather (rank 0 orders it) and only rank 0 gets the
    weights; the others get {}.
    """
    dtype = DTYPES[config.dtype]
    state = distributed.full_state(model)
    return {
        k: v.detach().to("cpu", dtype=dtype if v.is_floating_point() else v.dtype, copy=True)
        for k, v in state.items()
    }
