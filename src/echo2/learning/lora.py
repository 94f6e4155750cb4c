"""LoRA: the learner trains a peft adapter, snapshots carry only the adapter, engines merge it.

Owns the learner's side of LoRA: wrapping the policy with peft (`apply_lora`, only adapter
parameters trainable) and the adapter snapshot (`adapter_state`, gathered from every rank under
torchrun and published in the learner's snapshot dtype). The rollout side's install lives
in echo2/models.py (`merge_adapter`: weight = base + B @ A, recomputed from the base each time,
never accumulated), which both planes import; it needs no peft. Knows nothing of tasks, optimizers
or transport: an adapter snapshot is a plain state dict and travels like any other.

Adapter snapshot format (`echo2.records.Snapshot.is_adapter`), keys named after the base model's
modules: `NAME.lora_A` [r, in] and `NAME.lora_B` [out, r] with the scale alpha / r already folded
into B, so that the engine needs nothing but the two matrices: delta W(NAME) = lora_B @ lora_A.
"""

from __future__ import annotations

import copy
import sys

import torch

from echo2.config import ConfigError, LoraConfig
from echo2.records import LORA_A, LORA_B

ADAPTER = "default"  # peft's name for the one adapter we train


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)  # peft's rule for a list of names


def apply_lora(model, config: LoraConfig):
    """The policy wrapped with peft's LoRA; only adapter parameters require grad. A target that
    names no linear layer, or one tied to the embedding, is a ConfigError naming the key."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    modules = dict(model.named_modules())
    tied = model.get_output_embeddings() if getattr(model.config, "tie_word_embeddings", False) else None
    for target in config.target_modules:
        hits = [m for n, m in modules.items() if _matches(n, target)]
        if not hits:
            raise ConfigError(f"learner.lora.target_modules: {target!r} names no module of the model")
        if not all(isinstance(m, torch.nn.Linear) for m in hits):
            raise ConfigError(f"learner.lora.target_modules: {target!r} is not a linear layer")
        if tied is not None and any(m is tied for m in hits):
            raise ConfigError(
                f"learner.lora.target_modules: {target!r} shares its weight with the embedding "
                "(tie_word_embeddings); a merged adapter would change both"
            )
    peft_config = PeftLoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=list(config.target_modules),
        bias="none",
    )
    return get_peft_model(model, peft_config)


def is_lora(model) -> bool:
    peft = sys.modules.get("peft")  # a run without LoRA never pays for importing peft
    return peft is not None and isinstance(model, peft.PeftModel)


def lora_layers(model):
    """(base module name, peft LoRA layer) for every adapted layer of a peft-wrapped policy."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.get_base_model().named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            yield name, module


@torch.no_grad()
def adapter_state(model, *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The adapter snapshot of a peft-wrapped policy: fresh CPU copies in `dtype` (default: the
    weights' own), scale folded into B.

    Under FSDP2 each adapter weight is a DTensor shard: every rank takes part in gathering it with
    `full_tensor()` (an all-gather; rank 0 orders it with GATHER, and every rank walks the layers in
    the same order) and only rank 0 gets the adapter; the others get {}."""
    from torch.distributed.tensor import DTensor

    from echo2.learning import distributed

    sharded = distributed.is_sharded(model)
    if sharded and distributed.rank() == 0:
        distributed.lead(distributed.Order.GATHER)
    state = {}
    for name, layer in lora_layers(model):
        a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
        a, b = (t.full_tensor() if isinstance(t, DTensor) else t for t in (a, b))
        b = b * layer.scaling[ADAPTER]
        state[name + LORA_A] = a.detach().to("cpu", dtype=dtype or a.dtype, copy=True).contiguous()
        state[name + LORA_B] = b.detach().to("cpu", dtype=dtype or b.dtype, copy=True).contiguous()
    return state if distributed.rank() == 0 else {}


def engine_copy(model):
    """A copy of the policy for a rollout engine: for a LoRA policy its base weights only (the
    engine merges each adapter snapshot into them), otherwise the whole policy."""
    clone = copy.deepcopy(model)
    return clone.unload() if is_lora(model) else clone
