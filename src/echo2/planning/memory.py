"""`echo2 plan --memory`: GPU memory of the learner, a vLLM rollout worker, and both on one GPU.

Pure: an architecture, a workload and a GPU in, a JSON-ready dict of bytes out. No file, no torch,
no config object: planning/memory_cli.py reads those and prints the table. Every figure is an
estimate from tensor sizes; what each line counts, and the library source it follows, is said
where it is computed. docs/gpu.md "Memory plan" has the hand arithmetic these must agree with.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

MiB, GiB = 2**20, 2**30
CUDA_CONTEXT = GiB
"""Per process, outside PyTorch's allocator: CUDA context, cuBLAS workspaces, NCCL (an allowance)."""
CUDA_GRAPHS = GiB
"""vLLM's captured CUDA graphs (an allowance; vLLM measures them itself at start-up:
vllm/v1/worker/gpu_worker.py `determine_available_memory`, `profile_cudagraph_memory`)."""
DEDICATED_SHARE = 0.85
"""A worker alone on its card gives vLLM this share (the agreed `rollout.vllm` default)."""
KV_BLOCK = 16
"""vLLM's default KV block size in tokens: a sequence takes whole blocks."""
TIGHT = 0.05
"""Headroom under this share of the card is reported as tight (allocator fragmentation)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GPU:
    name: str
    bytes: int
    source: str


# Total memory as `nvidia-smi` prints it (MiB). torch.cuda.mem_get_info, which vLLM's
# gpu_memory_utilization multiplies, reports about 1% less on some cards (A100-80: 85,056,798,720 B).
GPUS: dict[str, GPU] = {
    g.name.lower().replace(" ", ""): g
    for g in (
        GPU(name="H200", bytes=143771 * MiB, source="nvidia-smi on an H200 SXM (141 GB HBM3e)"),
        GPU(name="H100", bytes=81559 * MiB, source="nvidia-smi on an H100 80GB HBM3"),
        GPU(name="A100-80", bytes=81920 * MiB, source="nvidia-smi on an A100-SXM4-80GB"),
        GPU(name="A100-40", bytes=40960 * MiB, source="nvidia-smi on an A100-SXM4-40GB"),
        GPU(name="L40S", bytes=46068 * MiB, source="nvidia-smi on an L40S"),
        GPU(name="L4", bytes=23034 * MiB, source="nvidia-smi on an L4"),
        GPU(name="RTX5090", bytes=32607 * MiB, source="nvidia-smi on a GeForce RTX 5090"),
        GPU(name="RTX4090", bytes=24564 * MiB, source="nvidia-smi on a GeForce RTX 4090"),
    )
}


def gpu_named(spec: str) -> GPU:
    """A GPU from the table, or `48GiB` / `48GB` for any other card; ValueError otherwise."""
    key = spec.strip().lower().replace(" ", "").replace("_", "-")
    if key in GPUS:
        return GPUS[key]
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(gib|gb)", key)
    if m:
        size = float(m[1]) * (GiB if m[2] == "gib" else 10**9)
        return GPU(name=spec.strip(), bytes=int(size), source="given on the command line")
    raise ValueError(f"unknown GPU {spec!r}: one of {', '.join(GPUS)}, or a size such as 48GiB")


@dataclass(frozen=True, slots=True, kw_only=True)
class Arch:
    """A dense decoder-only transformer (Llama/Qwen shape: GQA attention, SwiGLU MLP, RMSNorm)."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool = False
    """Qwen2 (QwQ-32B) has biases on q, k and v."""
    qk_norm: bool = False
    """Qwen3 normalises each head of q and k (an RMSNorm of head_dim weights each)."""
    source: str = ""

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_params(self) -> int:
        h, q, kv, inter = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        attn = h * (q + 2 * kv) + q * h + (q + 2 * kv) * self.qkv_bias + 2 * self.head_dim * self.qk_norm
        return attn + 3 * h * inter + 2 * h  # + gate/up/down and the two RMSNorms

    def root_params(self) -> int:
        """Embedding, final norm and (when untied) the lm_head: what sits outside the layers."""
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2) + self.hidden_size

    def params(self) -> int:
        return self.num_layers * self.layer_params() + self.root_params()

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V of every layer (vllm/v1/kv_cache_interface.py: 2 x block x heads x head_dim x size)."""
        return 2 * self.num_layers * self.kv_dim * dtype_bytes


def _qwen(name, h, layers, heads, inter, vocab, tied, *, qwen2=False, url):
    return Arch(
        name=name,
        hidden_size=h,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=inter,
        vocab_size=vocab,
        tied_embeddings=tied,
        qkv_bias=qwen2,
        qk_norm=not qwen2,
        source=f"built-in table, from {url}/blob/main/config.json",
    )


# The paper's models, from their published config.json on the Hugging Face Hub.
ARCHS: dict[str, Arch] = {
    "qwen3-4b": _qwen("Qwen3-4B", 2560, 36, 32, 9728, 151936, True, url="huggingface.co/Qwen/Qwen3-4B"),
    "qwen3-8b": _qwen("Qwen3-8B", 4096, 36, 32, 12288, 151936, False, url="huggingface.co/Qwen/Qwen3-8B"),
    "qwq-32b": _qwen(
        "QwQ-32B", 5120, 64, 40, 27648, 152064, False, qwen2=True, url="huggingface.co/Qwen/QwQ-32B"
    ),
}
PUBLISHED_PARAMS = {"qwen3-4b": 4.02e9, "qwen3-8b": 8.19e9, "qwq-32b": 32.76e9}
"""The Hub's safetensors parameter counts, which `Arch.params` must reproduce."""


def arch_matching(name: str) -> str | None:
    """The built-in key a model path or hub id names ("/models/Qwen3-4B-Instruct" -> "qwen3-4b")."""
    low = name.lower().replace("_", "-")
    for key in ARCHS:
        if re.search(rf"(?<![\w.]){re.escape(key)}(?![\d.])", low):
            return key
    return None


def arch_from_hf_config(cfg: dict, *, name: str, source: str) -> Arch:
    """An Arch from a transformers config.json (dict); ValueError naming what is missing or unsupported."""
    cfg = cfg.get("text_config", cfg)  # multimodal configs nest the language model's
    if cfg.get("num_experts") or cfg.get("num_local_experts"):
        raise ValueError("mixture-of-experts models are not covered by the memory plan")
    try:
        heads, h = cfg["num_attention_heads"], cfg["hidden_size"]
        model_type = cfg.get("model_type", "")
        return Arch(
            name=name,
            hidden_size=h,
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or h // heads,
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=model_type.startswith("qwen3"),
            source=source,
        )
    except KeyError as e:
        raise ValueError(f"config.json has no {e.args[0]!r}") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """The config's figures the plan needs, resolved as on a CUDA device."""

    max_prompt_tokens: int
    max_new_tokens: int
    group_size: int
    micro_batch_tokens: int
    bf16: bool
    gradient_checkpointing: bool
    lora_rank: int | None = None
    lora_targets: tuple[str, ...] = ()
    reference_model: bool = False
    kv_cache_gib: float | None = None
    gpu_memory_utilization: float | None = None

    @property
    def row_tokens(self) -> int:
        return self.max_prompt_tokens + self.max_new_tokens

    @property
    def rows(self) -> int:
        """Rows of a micro-batch when every row is as long as allowed (learning/step.py packs
        rows so rows x longest row <= micro_batch_tokens; one row always goes in)."""
        return max(1, self.micro_batch_tokens // self.row_tokens)


def lora_params(arch: Arch, rank: int, targets: tuple[str, ...]) -> int:
    """B @ A adapters (A: r x in, B: out x r) on each target projection of every layer."""
    h, q, kv, inter = arch.hidden_size, arch.q_dim, arch.kv_dim, arch.intermediate_size
    shapes = {
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
        "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h),
    }  # fmt: skip
    hit = [s for name, s in shapes.items() if any(t.split(".")[-1] == name for t in targets)]
    return arch.num_layers * sum(rank * (i + o) for i, o in hit)


def activation_bytes_per_token_layer(arch: Arch, *, bf16: bool) -> int:
    """Bytes one decoder layer keeps for backward per token (transformers' Qwen3/Llama layer).

    bf16 autocast with fp32 master weights: the residual stream is fp32 (the embedding is not an
    autocast op), each RMSNorm keeps its fp32 input and normalised output (8h), and every linear
    keeps its own bf16 cast of its input (autocast caches casts of leaf weights only:
    aten/src/ATen/autocast_mode.cpp `cached_cast`): q/k/v 6h, gate/up 4h. q and k keep their fp32
    upcast and bf16 normalised copy in q_norm/k_norm and a bf16 copy for attention (8 per element),
    v 2, the attention output 2 x q_dim; the MLP keeps gate, silu(gate), up and their product (8I);
    and 4 bytes per norm row (rsqrt) and per head (attention's logsumexp). fp32: every tensor 4 bytes,
    no casts, and each norm's output is kept once as its linears' input (4h). tests/unit/test_memplan.py
    checks this against the tensors a small Qwen3 layer saves.
    """
    h, q, kv, inter = arch.hidden_size, arch.q_dim, arch.kv_dim, arch.intermediate_size
    small = 4 * (2 + (arch.num_heads + arch.num_kv_heads) * arch.qk_norm) + 4 * arch.num_heads
    if bf16:
        qk = 8 if arch.qk_norm else 2
        return (8 + 6) * h + (qk + 2) * q + (qk + 2) * kv + (8 + 4) * h + 8 * inter + small
    qk = 12 if arch.qk_norm else 4
    return 12 * h + (qk + 4) * q + (qk + 4) * kv + 12 * h + 16 * inter + small


def learner_memory(arch: Arch, wl: Workload, *, gpus: int) -> dict:
    """Bytes on each of `gpus` GPUs (FSDP2 shards parameters, gradients and AdamW state over them)."""
    p = arch.params()
    adapter = lora_params(arch, wl.lora_rank, wl.lora_targets) if wl.lora_rank else 0
    trainable = adapter or p
    weights = 4 * (p + adapter) // gpus  # fp32 master weights (models.py loads fp32)
    grads = 4 * trainable // gpus
    adamw = 8 * trainable // gpus  # exp_avg and exp_avg_sq, fp32
    reference = 4 * p // gpus if wl.reference_model else 0  # learner.kl_beta > 0: a frozen copy
    # bf16 compute copy of the weights. One GPU: autocast caches a bf16 cast of every trainable fp32
    # weight until the forward's autocast region ends (the logits head runs inside it); a frozen
    # (LoRA base) weight is not cached but each linear keeps its cast for backward, so only
    # checkpointing bounds it to one layer. FSDP2 with a bf16 MixedPrecisionPolicy all-gathers one
    # unit at a time: the root (embeddings, lm_head) plus a layer and the prefetched next one.
    one_layer = 2 * arch.layer_params()
    if not wl.bf16:
        copy_ckpt = copy_full = 0
    elif gpus > 1:
        copy_ckpt = copy_full = 2 * arch.root_params() + 2 * one_layer
    else:
        copy_full = 2 * p
        copy_ckpt = one_layer if adapter else 2 * p
    tokens = wl.rows * wl.row_tokens
    per_layer = activation_bytes_per_token_layer(arch, bf16=wl.bf16) * tokens
    all_layers = arch.num_layers * per_layer
    boundaries = arch.num_layers * 4 * arch.hidden_size * tokens  # each layer's fp32 input
    # logits_to_keep = K + 1 positions per row (learning/step.py), then models.token_logprobs:
    # bf16 logits (2 B), .float() / temperature (4), logsumexp's x - max and exp (8).
    head = wl.rows * (wl.max_new_tokens + 1) * arch.vocab_size * (14 if wl.bf16 else 16)
    static = weights + grads + adamw + reference
    adamw_step = 4 * trainable // gpus  # foreach AdamW's sqrt(exp_avg_sq) temporary (torch/optim/adam.py)
    peak_ckpt = CUDA_CONTEXT + max(
        static + copy_ckpt + boundaries + max(head, per_layer), static + adamw_step
    )
    peak_full = CUDA_CONTEXT + max(static + copy_full + all_layers + head, static + adamw_step)
    return {
        "gpus": gpus,
        "params": p,
        "trainable_params": trainable,
        "weights": weights,
        "gradients": grads,
        "adamw": adamw,
        "reference_model": reference,
        "static": static,
        "bf16_weight_copy_with_checkpointing": copy_ckpt,
        "bf16_weight_copy_without_checkpointing": copy_full,
        "micro_batch_rows": wl.rows,
        "micro_batch_tokens": tokens,
        "activations_with_checkpointing": boundaries + per_layer,
        "activations_without_checkpointing": all_layers,
        "logits_head": head,
        "adamw_step_temporary": adamw_step,
        "cuda_context": CUDA_CONTEXT,
        "peak_with_checkpointing": peak_ckpt,
        "peak_without_checkpointing": peak_full,
        "peak": peak_ckpt if wl.gradient_checkpointing else peak_full,
        "gradient_checkpointing": wl.gradient_checkpointing,
    }


def engine_memory(arch: Arch, wl: Workload, gpu: GPU) -> dict:
    """One vLLM engine alone on `gpu`: weights, KV cache per sequence and group, and what fits."""
    dtype_bytes = 2 if wl.bf16 else 4
    weights = dtype_bytes * arch.params()
    kv_token = arch.kv_bytes_per_token()
    seq = kv_token * math.ceil(wl.row_tokens / KV_BLOCK) * KV_BLOCK
    group = wl.group_size * seq
    # vLLM's LLM-class defaults (vllm/engine/arg_utils.py, _get_default_max_num_seqs_and_batched_tokens):
    # 16384 tokens / 1024 sequences on cards of >= 70 GiB other than A100s, else 8192 / 256.
    large = gpu.bytes >= 70 * GiB and "a100" not in gpu.name.lower()
    batched, seqs = (16384, 1024) if large else (8192, 256)
    # Its start-up profile run: one forward of `batched` tokens (one layer's qkv, gate_up, silu and
    # two hidden-size buffers live at once) and a sampler over `seqs` rows (fp32 logits, probabilities,
    # log-probabilities); the KV cache gets what is left (gpu_worker.py determine_available_memory).
    h, inter = arch.hidden_size, arch.intermediate_size
    forward = batched * dtype_bytes * (arch.q_dim + 2 * arch.kv_dim + 3 * inter + 2 * h)
    sampler = seqs * arch.vocab_size * 4 * 3
    overhead = forward + sampler + CUDA_GRAPHS + CUDA_CONTEXT
    share = wl.gpu_memory_utilization or DEDICATED_SHARE
    # vLLM's budget is share x total (vllm/v1/worker/utils.py request_memory); a fixed kv_cache_gib
    # replaces the KV share and needs that much beside weights and overhead.
    kv = int(wl.kv_cache_gib * GiB) if wl.kv_cache_gib else int(share * gpu.bytes) - weights - overhead
    needed = weights + overhead + max(kv, 0)
    return {
        "dtype_bytes": dtype_bytes,
        "weights": weights,
        "kv_bytes_per_token": kv_token,
        "kv_per_sequence": seq,
        "kv_per_group": group,
        "max_num_batched_tokens": batched,
        "max_num_seqs": seqs,
        "forward_activations": forward,
        "sampler": sampler,
        "cuda_graphs": CUDA_GRAPHS,
        "cuda_context": CUDA_CONTEXT,
        "overhead": overhead,
        "gpu_memory_utilization": share if not wl.kv_cache_gib else needed / gpu.bytes,
        "kv_cache": max(kv, 0),
        "sequences_in_kv": max(kv, 0) // seq,
        "groups_in_kv": max(kv, 0) // group,
        "fits": kv >= seq and needed <= gpu.bytes,
    }


def colocated_memory(learner: dict, engine: dict, wl: Workload, gpu: GPU, *, kv: int | None = None) -> dict:
    """Learner (one GPU) and vLLM on the same card, both resident (no sleep mode). The engine keeps
    `kv` bytes of KV cache (default rollout.vllm.kv_cache_gib, else one GRPO group); vLLM refuses to
    start unless its share of the card is free then (vllm/v1/worker/utils.py request_memory)."""
    if kv is None:
        kv = int(wl.kv_cache_gib * GiB) if wl.kv_cache_gib else engine["kv_per_group"]
    engine_total = engine["weights"] + kv + engine["overhead"]
    total = learner["peak"] + engine_total
    spare = gpu.bytes - total
    return {
        "kv_cache": kv,
        "groups_in_kv": kv // engine["kv_per_group"],
        "sequences_in_kv": kv // engine["kv_per_sequence"],
        "engine": engine_total,
        "learner_peak": learner["peak"],
        "total": total,
        "headroom": spare,
        "gpu_memory_utilization": engine_total / gpu.bytes,
        "kv_cache_at_most": max(0, kv + spare),
        "fits": spare >= 0,
    }


def plan_memory(
    arch: Arch, wl: Workload, gpu: GPU, *, gpus: int = 1, colocated_kv: int | None = None
) -> dict:
    """The whole plan; `colocated_kv`: the KV cache echo2 gives an engine beside the learner, when
    the caller knows it (planning/memory_cli.py asks rollout/vllm_args.py)."""
    learner = learner_memory(arch, wl, gpus=gpus)
    engine = engine_memory(arch, wl, gpu)
    learner["fits"] = learner["peak"] <= gpu.bytes
    learner["headroom"] = gpu.bytes - learner["peak"]
    return {
        "model": asdict(arch),
        "gpu": {**asdict(gpu), "gib": gpu.bytes / GiB},
        "gpus": gpus,
        "workload": asdict(wl),
        "learner": learner,
        "worker": engine,
        # Under torchrun (gpus > 1) the learner builds no vLLM engine: workers run it.
        "colocated": colocated_memory(learner, engine, wl, gpu, kv=colocated_kv) if gpus == 1 else None,
    }
