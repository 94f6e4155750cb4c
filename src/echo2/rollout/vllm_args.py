"""The vLLM engine's memory, length, log-prob and seed arguments, as pure functions (no I/O, no vllm
import): `llm_kwargs` from `[rollout.vllm]`, the device and the model's sizes; `logprobs_mode` and
`check_sampling` from the sampling settings; `request_seeds` for per-prompt seeds on a GPU.

What vLLM 0.32 does with them (vllm/config/cache.py, vllm/v1/worker/gpu_worker.py, utils.py):
- `gpu_memory_utilization` u: at start vLLM requests ceil(u x total GPU memory) and refuses to
  start unless that much is free (utils.py `request_memory`, called from gpu_worker.py
  `init_device` even when the KV size is given); without `kv_cache_memory_bytes` the KV cache is
  what is left of that request after the weights, the profiled activation peak and the CUDA-graph
  estimate (gpu_worker.py `determine_available_memory`). vLLM's default u is 0.92.
- `kv_cache_memory_bytes`: the KV cache is exactly this size and u no longer sizes it (only the
  start-up check above still applies).
- one sequence of `max_model_len` tokens must fit the KV cache, or vLLM refuses to start
  (vllm/v1/core/kv_cache_utils.py `check_enough_kv_cache_memory`, which also holds one block back).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from echo2.config import ConfigError, RolloutConfig

GIB = 2**30
CPU_KV_GIB = 1.0
"""KV cache of a CPU engine (env ECHO2_VLLM_KV_CACHE_GIB or rollout.vllm.kv_cache_gib override it):
small, so a learner and several workers share one machine's RAM."""
DEDICATED_UTILIZATION = 0.85
"""gpu_memory_utilization of an engine alone on its GPU; vLLM sizes its KV cache within it. Below
vLLM's 0.92, leaving room for a worker's snapshot install and other processes' CUDA contexts."""
SHARED_KV_GIB = 20.0
"""Default KV cache of an engine sharing its GPU with the learner: one GRPO group of 16 x 9.2k
Qwen3-4B tokens (144 KiB each) in flight."""
SHARED_MAX_FRACTION = 0.5
"""Beside the learner, the engine (weights, KV, overhead) takes at most this share of the card by
default: the KV cache is SHARED_KV_GIB or what fits under it."""
CUDA_OVERHEAD_GIB = 4.0
"""Estimate of a GPU engine's memory beyond weights and KV: the profiled activation peak, CUDA graphs,
sampler buffers and the CUDA context (docs/gpu.md)."""
BLOCK_TOKENS = 16
"""vLLM's default KV block (vllm/config/cache.py CacheConfig.DEFAULT_BLOCK_SIZE)."""
SEED_RANGE = 2**31
"""Per-request seeds are drawn below this; the n samples of a prompt use seed + index."""

DeviceKind = Literal["cpu", "cuda"]


def kv_bytes_per_token(model_config: dict[str, Any], dtype_bytes: int) -> int:
    """KV-cache bytes of one token: 2 (K and V) x layers x KV heads x head dim x dtype bytes, from a
    model's config.json (Qwen3-4B and 8B in bf16: 2 x 36 x 8 x 128 x 2 = 144 KiB)."""
    heads = model_config["num_attention_heads"]
    kv_heads = model_config.get("num_key_value_heads") or heads
    head_dim = model_config.get("head_dim") or model_config["hidden_size"] // heads
    return 2 * model_config["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes


def max_model_len(config: RolloutConfig) -> int:
    """rollout.vllm.max_model_len, else the longest sequence a rollout makes (prompt + response)."""
    return config.vllm.max_model_len or config.max_prompt_tokens + config.max_new_tokens


def sequence_kv_bytes(tokens: int, per_token: int) -> int:
    """KV bytes one sequence of `tokens` needs, in whole blocks, plus the block vLLM holds back."""
    return (math.ceil(tokens / BLOCK_TOKENS) + 1) * BLOCK_TOKENS * per_token


def _utilization(need: int, total: int) -> float:
    """need/total rounded up to a thousandth (vLLM requests ceil(u x total))."""
    return min(1.0, math.ceil(need / total * 1000) / 1000)


def llm_kwargs(
    config: RolloutConfig,
    *,
    device_kind: DeviceKind,
    total_bytes: int | None,
    weight_bytes: int,
    kv_per_token: int,
    shared: bool,
    env_kv_gib: float | None = None,
) -> dict[str, Any]:
    """The memory and length keyword arguments of vLLM's `LLM(...)` for this engine.

    `total_bytes`: the GPU's memory (None on the CPU); `weight_bytes`: the engine's weights in its
    dtype; `kv_per_token`: `kv_bytes_per_token`; `shared`: a learner trains on the same GPU;
    `env_kv_gib`: ECHO2_VLLM_KV_CACHE_GIB. The KV size is rollout.vllm.kv_cache_gib, else the
    environment's, else CPU: 1 GiB; GPU alone: vLLM's own within utilization 0.85; GPU shared: 20 GiB
    or what fits in half the card. ConfigError, naming the keys to change, when one sequence of
    max_model_len tokens cannot fit the KV cache, or the engine cannot fit the GPU."""
    vcfg = config.vllm
    length = max_model_len(config)
    kv_gib = vcfg.kv_cache_gib if vcfg.kv_cache_gib is not None else env_kv_gib
    kv = int(kv_gib * GIB) if kv_gib is not None else None
    out: dict[str, Any] = {"max_model_len": length}
    if device_kind == "cpu":
        kv = kv if kv is not None else int(CPU_KV_GIB * GIB)
        # eager: a start of seconds rather than a compile (CUDA graphs do not exist on a CPU)
        out |= {"kv_cache_memory_bytes": kv, "enforce_eager": True}
    else:
        assert total_bytes is not None and total_bytes > 0
        overhead = int(CUDA_OVERHEAD_GIB * GIB)
        if kv is None and shared and vcfg.gpu_memory_utilization is None:
            room = int(SHARED_MAX_FRACTION * total_bytes) - weight_bytes - overhead
            target = min(int(SHARED_KV_GIB * GIB), room)
            _check_fits(max(target, 0), length, kv_per_token, why="beside the learner, ")
            utilization = _utilization(weight_bytes + target + overhead, total_bytes)
        elif vcfg.gpu_memory_utilization is not None:
            utilization = vcfg.gpu_memory_utilization
        elif shared:  # kv given: the share holds the weights, that KV and the overhead
            utilization = _utilization(weight_bytes + kv + overhead, total_bytes)
        else:
            utilization = DEDICATED_UTILIZATION
        if kv is not None and weight_bytes + kv + overhead > total_bytes:
            raise ConfigError(
                f"rollout.vllm.kv_cache_gib: {kv / GIB:.1f} GiB of KV cache + {weight_bytes / GIB:.1f} "
                f"GiB of weights + ~{CUDA_OVERHEAD_GIB:.0f} GiB of overhead exceed this GPU's "
                f"{total_bytes / GIB:.1f} GiB"
            )
        # CUDA graphs: in-place installs keep them valid (reload_weights writes into the same storage)
        out |= {"gpu_memory_utilization": utilization, "enforce_eager": False}
        if kv is not None:
            out["kv_cache_memory_bytes"] = kv
    if kv is not None:
        _check_fits(kv, length, kv_per_token, why="")
    return out


def _check_fits(kv: int, length: int, per_token: int, *, why: str) -> None:
    need = sequence_kv_bytes(length, per_token)
    if kv < need:
        raise ConfigError(
            f"rollout.vllm.kv_cache_gib: {why}a {kv / GIB:.2f} GiB KV cache holds "
            f"{kv // per_token} tokens, less than one sequence of rollout.vllm.max_model_len = {length} "
            f"tokens ({need / GIB:.2f} GiB at {per_token // 1024} KiB per token): raise "
            "rollout.vllm.kv_cache_gib (or ECHO2_VLLM_KV_CACHE_GIB), or lower "
            "rollout.max_prompt_tokens + rollout.max_new_tokens"
        )


def logprobs_mode(config: RolloutConfig) -> str:
    """The vLLM `logprobs_mode` whose sampled-token log-prob is the learner's recomputation,
    log_softmax(logits / T) with no top-p renormalisation (models.token_logprobs):
    - sampling = "gumbel": "processed_logits", the row the echo2 logits processor leaves, which holds
      that log-prob at the token it picks (rollout/vllm_sampling.py; any T and top_p);
    - top_p = 1: "processed_logprobs", taken after temperature (V1 sampler:
      vllm/v1/sample/ops/topk_topp_sampler.py `forward_native`/`forward_cpu`; V2 GPU sampler:
      vllm/v1/worker/gpu/sample/sampler.py `apply_sampling_params`); nothing is truncated;
    - top_p < 1 at T = 1: "raw_logprobs", log_softmax of the logits before any processing
      (vllm/v1/sample/sampler.py `Sampler.forward`; V2 `compute_topk_scores` on the raw logits);
      the processed ones would be renormalised over the nucleus.
    Other settings are refused by `check_sampling`."""
    if config.sampling == "gumbel":
        return "processed_logits"
    return "processed_logprobs" if config.top_p == 1 else "raw_logprobs"


GUMBEL_PROCESSOR = "echo2.rollout.vllm_sampling:GumbelLogitsProcessor"
"""The logits processor of rollout.sampling = "gumbel" (`LLM(logits_processors=[...])`)."""


def sampling_kwargs(config: RolloutConfig) -> dict[str, Any]:
    """`LLM(...)` keyword arguments of the sampling settings: the log-prob mode and, for "gumbel",
    the keyed Gumbel-max logits processor."""
    out: dict[str, Any] = {"logprobs_mode": logprobs_mode(config)}
    if config.sampling == "gumbel":
        out["logits_processors"] = [GUMBEL_PROCESSOR]
    return out


def check_sampling(config: RolloutConfig) -> None:
    """ConfigError naming rollout.top_p for what vLLM's own sampler cannot give the learner's
    log-probs for: top_p < 1 with temperature != 1 (its processed log-probs are renormalised over the
    nucleus, its raw ones lack the temperature). Under sampling = "gumbel" the echo2 processor
    truncates and reports the log-probs itself, so every T and top_p is accepted."""
    if config.sampling == "gumbel":
        return
    if config.top_p < 1 and config.temperature != 1:
        raise ConfigError(
            f"rollout.top_p: the vllm engine samples top_p = {config.top_p} < 1 only at "
            f"rollout.temperature = 1.0 (got {config.temperature}) with rollout.sampling = "
            '"multinomial": vLLM returns either raw log-probs (no temperature) or ones renormalised '
            'over the nucleus, neither the learner\'s (rollout.sampling = "gumbel" has no such limit)'
        )


def request_seeds(device_kind: DeviceKind, count: int, draw) -> list[int] | None:
    """One sampling seed per prompt on a GPU, drawn by `draw(count)` (torch's global generator, so
    `torch.manual_seed` before `generate` fixes the samples); vLLM seeds a prompt's n samples with
    seed + index (vllm/v1/engine/parallel_sampling.py `get_child_sampling_params`). vLLM's V2 GPU
    sampler ignores torch's generator and seeds an unseeded request from numpy
    (vllm/v1/worker/gpu/sample/states.py `add_request`), hence explicit seeds there.

    None on the CPU: its sampler draws from torch's global generator already (topk_topp_sampler.py
    `forward_cpu`) and refuses a per-request seed ("CPU Generator does not use offset")."""
    if device_kind == "cpu":
        return None
    return [int(s) for s in draw(count)]


GUMBEL_KEY = "echo2_gumbel"
"""`SamplingParams.extra_args` key of a keyed request (vllm_sampling.py; over a server:
`vllm_xargs`): [seed, record key, response offset, temperature, top_p]."""
GREEDY_KEY = "echo2_greedy"
"""`extra_args` key of a greedy request whose returned logits must be its log-probs."""


def gumbel_extra_args(keys, *, n: int, temperature: float, top_p: float) -> list[dict[str, Any]]:
    """One `extra_args` per request, in the engines' row order (context i's n samples together);
    `keys`: rollout/sampling.py's `SamplingKeys`."""
    records, starts = keys.records(n).tolist(), keys.starts(n).tolist()
    return [
        {GUMBEL_KEY: [int(keys.seed), int(r), int(s), float(temperature), float(top_p)]}
        for r, s in zip(records, starts, strict=True)
    ]
