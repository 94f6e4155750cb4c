"""LoRA: the learner trains a peft adapter, snapshots carry only the adapter, engines merge it.

Owns the three places LoRA touches: wrapping the policy with peft (`apply_lora`, only adapter
parameters trainable), the adapter snapshot (`adapter_state`), and its install on the rollout side
(`merge_adapter`: weight = base + B @ A, recomputed from the base each time, never accumulated). Knows
nothing of tasks, optimizers or transport: an adapter snapshot is a plain state dict and travels like
any other. peft is imported only by the learner-side functions; a rollout engine merges without it.

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
    """The adapter snapshot of a peft-wrapped policy: fresh copies, scale folded into B."""
    state = {}
    for name, layer in lora_layers(model):
        a = layer.lora_A[ADAPTER].weight
        b = layer.lora_B[ADAPTER].weight * layer.scaling[ADAPTER]
        state[name + LORA_A] = a.detach().to(dtype or a.dtype, copy=True).contiguous()
        state[name + LORA_B] = b.detach().to(dtype or b.dtype, copy=True).contiguous()
    return state


def engine_copy(model):
    """A copy of the policy for a rollout engine: for a LoRA policy its base weights only (the
    engine merges each adapter snapshot into them), otherwise the whole policy."""
    clone = copy.deepcopy(model)
    return clone.unload() if is_lora(model) else clone


@torch.no_grad()
def merge_adapter(model, state: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> None:
    """Set every adapted layer's weight to base + lora_B @ lora_A, in place. `base` holds the
    original weight of each layer ever adapted (captured here on first use, then read only);
    a layer adapted before but absent from `state` goes back to its base weight. Validates the
    snapshot (it may come from the network) and raises ValueError before changing anything."""
    names = {k.removesuffix(LORA_A) for k in state if k.endswith(LORA_A)}
    if {k for k in state} != {n + s for n in names for s in (LORA_A, LORA_B)}:
        raise ValueError("adapter snapshot: every layer needs exactly one lora_A and one lora_B")
    weights = {}
    for name in names:
        try:
            weight = model.get_submodule(name).weight
        except AttributeError:
            raise ValueError(f"adapter snapshot: the model has no layer {name!r}") from None
        a, b = state[name + LORA_A], state[name + LORA_B]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or (b.shape[0], a.shape[1]) != weight.shape:
            raise ValueError(
                f"adapter snapshot: {name} has A {tuple(a.shape)}, B {tuple(b.shape)} "
                f"for a weight {tuple(weight.shape)}"
            )
        weights[name] = weight
    for name, weight in weights.items():
        if name not in base:
            base[name] = weight.detach().clone()
        a, b = state[name + LORA_A], state[name + LORA_B]
        weight.copy_(base[name]).addmm_(b.to(weight.dtype), a.to(weight.dtype))  # no temporary
    for name in base.keys() - names:
        model.get_submodule(name).weight.copy_(base[name])
