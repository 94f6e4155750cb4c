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


UNTOUCHED = "echo2-untouched:"
"""Prefix of an install refusal raised before any weight changed (the server keeps its version)."""


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
            try:
                self.reload_weights(weights_iterator=with_tied_aliases(counted, aliases))
            except BaseException:
                abandon_reload(self.get_model())
                raise
        return counted.count

    def echo2_install_file(self, path: str, digest: str, partial: bool = False) -> dict[str, Any]:
        """Install the safetensors file at `path` (the server engine's route, rollout/server_admin.py,
        through `POST /collective_rpc`; every tensor-parallel rank reads the file and loads its own
        shard). The file is mapped, not read (`safetensors_view.mapped_file`); its digest
        (rollout/install_digest.py) must be `digest`, else ValueError starting with `UNTOUCHED` and
        no weight changes. After the reload every parameter whose name and shape are the file's
        (embeddings, norms: vLLM keeps them unfused) is compared with the file's value; returns
        {"count": tensors given, "digest", "checked": parameters compared, "mismatched": names}."""
        import torch

        from echo2.rollout.install_digest import buffer_digest
        from echo2.rollout.safetensors_view import mapped_file

        try:
            data, tensors = mapped_file(path)
        except (OSError, ValueError) as e:
            raise ValueError(f"{UNTOUCHED} {path}: {e}") from None
        with data:
            found = buffer_digest(data)
        if found != digest:
            raise ValueError(f"{UNTOUCHED} {path}: digest {found[:16]}, not {digest[:16]}")
        count = self.echo2_install_weights(iter(tensors.items()), partial)
        params = dict(self.get_model().named_parameters())
        checked, mismatched = 0, []
        for name, value in tensors.items():
            param = params.get(name)
            if param is None or tuple(param.shape) != tuple(value.shape):
                continue  # fused, packed or sharded by vLLM: not comparable here
            checked += 1
            if not torch.equal(param.data.cpu(), value.to(param.dtype)):
                mismatched.append(name)
        return {"count": count, "digest": digest, "checked": checked, "mismatched": mismatched}

    def echo2_settings(self) -> dict[str, Any]:
        """What a running server was started with that echo2 depends on: its log-prob mode and
        logits processors (a server attached by url is checked against the run's sampling)."""
        mc = self.vllm_config.model_config
        procs = getattr(mc, "logits_processors", None) or []
        return {
            "logprobs_mode": str(getattr(mc, "logprobs_mode", "")),
            "logits_processors": [p if isinstance(p, str) else f"{p.__module__}:{p.__qualname__}" for p in procs],
            "dtype": str(mc.dtype).removeprefix("torch."),
        }

    def echo2_packed_modules(self) -> dict[str, list[str]]:
        """The model's fused layers: vLLM name -> the Hugging Face module names it packs."""
        return {k: list(v) for k, v in getattr(self.get_model(), "packed_modules_mapping", {}).items()}


def abandon_reload(model) -> None:
    """Undo what a reload that raised left behind, so the next one works. vLLM 0.32's layerwise
    reload (reload/layerwise.py) puts every layer on the meta device and buffers its weights until
    the layer is complete; an exception skips `finalize_layerwise_reload`, and the next
    `initialize_layerwise_reload` skips the layers still marked loading (`info.can_load()`), so
    their stale buffers are replayed. Here each such layer gets its kernel tensors back (what
    finalize does for a layer given nothing: `_place_kernel_tensors`) and its state is reset.
    Layers that completed keep their new weights: the model is a mix, and the caller must not
    claim either version for it."""
    from vllm.model_executor.model_loader.reload import layerwise

    for layer in model.modules():
        info = layerwise.get_layerwise_info(layer)
        if info.can_load():
            if info.kernel_tensors is not None:
                layerwise._place_kernel_tensors(layer, info)
            info.reset()
    layerwise.LOADING_LAYERS.clear()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload


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
