"""The vLLM worker extension that installs a snapshot's weights in place (handing vLLM the tied
aliases a snapshot leaves out), and which weights a merged LoRA install must send.

vLLM mixes `WeightInstaller` into its worker (`LLM(worker_extension_cls=...)`); `VLLMEngine.install`
calls it through `collective_rpc`. It owns only the hand-over of weights to vLLM's in-place reload,
which maps Hugging Face parameter names onto vLLM's fused and CPU-packed layouts; it knows nothing
of versions, signatures or the broadcast plane. The method is not named `update_weights`: vLLM's
CPU worker already defines one, and an extension may not override it.

A partial install is sound as vLLM 0.32's layerwise reload treats it
(vllm/model_executor/model_loader/reload/layerwise.py `finalize_layerwise_processing`): a layer
given none of its weights gets its own tensors back unchanged, but a layer given only some of them
is rebuilt from `torch.empty_strided` (reload/meta.py `materialize_meta_tensor`) with the rest
left uninitialised. So a partial install must give whole vLLM layers: `layers_to_send` adds the
siblings that vLLM fuses with an adapted layer (the model's `packed_modules_mapping`, e.g. q_proj,
k_proj and v_proj into qkv_proj).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

PARTIAL_NOISE = {
    "vllm.model_executor.model_loader.reload.layerwise": "%s: Failed to load weights",
    "vllm.model_executor.model_loader.reload.inplace": (
        "Following weights were not loaded from checkpoint: %s"
    ),
}
"""vLLM's warnings for layers a reload did not give (logger -> message format): expected, once per
untouched layer, on every partial install."""


class WeightInstaller:
    """Mixed into vLLM's worker; `self` is that worker."""

    def echo2_install_weights(
        self, weights: Iterable[tuple[str, Any]] | Mapping[str, Any], partial: bool = False
    ) -> int:
        """Reload weights from (parameter name, tensor) pairs; returns how many were given.

        The pairs are consumed one at a time, so a lazy iterator keeps one tensor alive beyond what
        vLLM buffers for the layer it is filling (with the in-process engine arguments arrive by
        reference: nothing is copied before vLLM's loader copies each tensor into its own, possibly
        re-packed and re-typed, parameter). A snapshot leaves out tied aliases (lm_head.weight);
        each is handed to vLLM here, as the same tensor right after the weight it shares
        (`with_tied_aliases`). `partial`: only some layers are given (whole layers, see the module
        docstring); vLLM's warnings about the others are dropped."""
        pairs = weights.items() if isinstance(weights, Mapping) else weights
        counted = _Counted(pairs)
        with _quiet(PARTIAL_NOISE) if partial else contextlib.nullcontext():
            aliases = tied_aliases(self.get_model())  # now: the reload takes the layers apart
            self.reload_weights(weights_iterator=with_tied_aliases(counted, aliases))
        return counted.count

    def echo2_packed_modules(self) -> dict[str, list[str]]:
        """The model's fused layers: vLLM name -> the Hugging Face module names it packs."""
        return {k: list(v) for k, v in getattr(self.get_model(), "packed_modules_mapping", {}).items()}


def tied_aliases(model) -> dict[str, list[str]]:
    """Parameter name -> the names tied to it (the same parameter), in module order: the inverse of
    `echo2.models.tied_names`."""
    from echo2.models import tied_names

    aliases: dict[str, list[str]] = {}
    for alias, kept in tied_names(model).items():
        aliases.setdefault(kept, []).append(alias)
    return aliases


def with_tied_aliases(
    pairs: Iterable[tuple[str, Any]], aliases: Mapping[str, list[str]]
) -> Iterator[tuple[str, Any]]:
    """`pairs`, each name once, every tied alias (`tied_aliases` of the vLLM model, taken before
    the reload starts) following the weight it shares, as the same tensor.

    vLLM skips a tied alias only when loading a fresh model: a reload first puts every layer back
    on the meta device one by one (reload/layerwise.py `initialize_layerwise_reload`, reload/meta.py
    `restore_layer_on_meta`), so lm_head.weight is no longer embed_tokens' parameter when
    `AutoWeightsLoader` looks for aliases (models/utils.py `_get_tied_embedding_params`) and is
    loaded on its own. A head given nothing keeps its old processed form: on the CPU the GEMM
    handle packed at load time (layers/utils.py `dispatch_cpu_unquantized_gemm`), which would
    keep computing the old logits."""
    seen: set[str] = set()
    for name, tensor in pairs:
        if name in seen:  # an alias sent anyway, after its weight: given already
            continue
        seen.add(name)
        yield name, tensor
        for alias in aliases.get(name, ()):
            if alias not in seen:
                seen.add(alias)
                yield alias, tensor


def layers_to_send(adapted: Iterable[str], packed: Mapping[str, list[str]]) -> set[str]:
    """The Hugging Face module names whose weights a merged adapter install sends: each adapted
    layer and every layer vLLM fuses it with (`packed`: fused name -> member names)."""
    siblings = {member: members for members in packed.values() for member in members}
    out = set()
    for name in adapted:
        parent, _, leaf = name.rpartition(".")
        out.update(f"{parent}.{m}" if parent else m for m in siblings.get(leaf, [leaf]))
    return out


class _Counted:
    def __init__(self, pairs: Iterable[tuple[str, Any]]) -> None:
        self.pairs, self.count = pairs, 0

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        for pair in self.pairs:
            self.count += 1
            yield pair


class _DropMessages(logging.Filter):
    def __init__(self, message: str) -> None:
        super().__init__()
        self.message = message

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != self.message


@contextlib.contextmanager
def _quiet(noise: Mapping[str, str]):
    filters = [(logging.getLogger(name), _DropMessages(msg)) for name, msg in noise.items()]
    for logger, f in filters:
        logger.addFilter(f)
    try:
        yield
    finally:
        for logger, f in filters:
            logger.removeFilter(f)
