"""The vLLM engine's computed arguments (rollout/vllm_args.py): memory share, KV cache and maximum
length on CPU and GPU, the log-prob mode for top_p, and the per-prompt seeds on a GPU."""

from __future__ import annotations

import pytest
import torch

from echo2.config import ConfigError, RolloutConfig, build_config
from echo2.rollout import vllm_args
from echo2.rollout.vllm_args import GIB, kv_bytes_per_token, llm_kwargs, logprobs_mode, request_seeds

QWEN3_4B = {  # config.json of Qwen/Qwen3-4B (the fields that size its KV cache)
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_size": 2560,
}
QWEN3_4B_BF16_WEIGHTS = 4_022_468_096 * 2
H200 = 143_771 * 2**20  # what torch.cuda.mem_get_info reports as an H200's total
PAPER = RolloutConfig(engine="vllm", max_prompt_tokens=1024, max_new_tokens=8192, top_p=0.95)


def qwen3_4b(config: RolloutConfig, **kwargs) -> dict:
    """llm_kwargs for a bf16 Qwen3-4B engine, on an H200 unless said otherwise."""
    args = {"device_kind": "cuda", "total_bytes": H200, "shared": False} | kwargs
    return llm_kwargs(
        config, weight_bytes=QWEN3_4B_BF16_WEIGHTS, kv_per_token=kv_bytes_per_token(QWEN3_4B, 2), **args
    )


def test_qwen3_kv_bytes_per_token_from_its_config():
    assert kv_bytes_per_token(QWEN3_4B, 2) == 144 * 1024
    no_head_dim = {k: v for k, v in QWEN3_4B.items() if k not in ("head_dim", "num_key_value_heads")}
    assert kv_bytes_per_token(no_head_dim, 4) == 2 * 36 * 32 * 80 * 4  # MHA, head dim from hidden size


def test_cpu_keeps_a_one_gib_kv_cache_and_eager_mode():
    args = llm_kwargs(
        RolloutConfig(), device_kind="cpu", total_bytes=None, weight_bytes=0, kv_per_token=4096, shared=False
    )
    assert args == {"max_model_len": 256 + 32, "kv_cache_memory_bytes": GIB, "enforce_eager": True}


def test_kv_size_from_the_config_then_the_environment():
    cpu = {
        "device_kind": "cpu",
        "total_bytes": None,
        "weight_bytes": 0,
        "kv_per_token": 4096,
        "shared": False,
    }
    assert llm_kwargs(RolloutConfig(), env_kv_gib=2.0, **cpu)["kv_cache_memory_bytes"] == 2 * GIB
    configured = RolloutConfig(vllm={"kv_cache_gib": 0.5})
    assert llm_kwargs(configured, env_kv_gib=2.0, **cpu)["kv_cache_memory_bytes"] == GIB // 2


def test_a_one_gib_cache_cannot_hold_one_paper_length_sequence():
    """B3: 1024 + 8192 Qwen3 tokens need 1.27 GiB; vLLM would refuse to start."""
    with pytest.raises(
        ConfigError, match=r"rollout\.vllm\.kv_cache_gib.*rollout\.vllm\.max_model_len = 9216"
    ):
        qwen3_4b(PAPER, env_kv_gib=1.0)


def test_a_dedicated_gpu_passes_a_utilization_and_lets_vllm_size_the_kv_cache():
    """B4: without gpu_memory_utilization vLLM demands 0.92 of the card free at start."""
    args = qwen3_4b(PAPER)
    assert args == {"max_model_len": 9216, "gpu_memory_utilization": 0.85, "enforce_eager": False}


def test_beside_the_learner_the_share_is_weights_plus_20_gib_kv_plus_overhead():
    args = qwen3_4b(PAPER, shared=True)
    need = QWEN3_4B_BF16_WEIGHTS + 20 * GIB + 4 * GIB
    assert need / H200 <= args["gpu_memory_utilization"] < need / H200 + 0.001
    assert args["gpu_memory_utilization"] < 0.25, "the learner keeps three quarters of the H200"
    assert "kv_cache_memory_bytes" not in args  # vLLM sizes the KV cache within that share


def test_beside_the_learner_on_a_small_card_the_kv_cache_is_what_fits_or_refused():
    card = 48 * GIB  # half of it: 24 GiB - 7.5 GiB weights - 4 GiB overhead = 12.5 GiB of KV
    args = qwen3_4b(PAPER, shared=True, total_bytes=card)
    assert args["gpu_memory_utilization"] == pytest.approx(0.5, abs=0.001)
    with pytest.raises(ConfigError, match="beside the learner"):
        qwen3_4b(PAPER, shared=True, total_bytes=24 * GIB)


def test_configured_kv_and_utilization_are_passed_through():
    args = qwen3_4b(PAPER.model_copy(update={"vllm": PAPER.vllm.model_copy(update={"kv_cache_gib": 30.0})}))
    assert args["kv_cache_memory_bytes"] == 30 * GIB and args["gpu_memory_utilization"] == 0.85
    shared = qwen3_4b(
        PAPER.model_copy(update={"vllm": PAPER.vllm.model_copy(update={"kv_cache_gib": 30.0})}), shared=True
    )
    assert shared["gpu_memory_utilization"] == pytest.approx(
        (QWEN3_4B_BF16_WEIGHTS + 34 * GIB) / H200, abs=0.001
    )
    util = qwen3_4b(
        PAPER.model_copy(update={"vllm": PAPER.vllm.model_copy(update={"gpu_memory_utilization": 0.6})})
    )
    assert util["gpu_memory_utilization"] == 0.6
    with pytest.raises(ConfigError, match="exceed this GPU"):
        qwen3_4b(PAPER.model_copy(update={"vllm": PAPER.vllm.model_copy(update={"kv_cache_gib": 200.0})}))


def test_max_model_len_below_a_whole_rollout_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"rollout\.vllm\.max_model_len: 100 < "):
        build_config(
            {"rollout": {"max_prompt_tokens": 64, "max_new_tokens": 64, "vllm": {"max_model_len": 100}}}
        )
    longer = build_config({"rollout": {"vllm": {"max_model_len": 4096}}}).rollout
    assert vllm_args.max_model_len(longer) == 4096


def test_top_p_below_one_takes_raw_logprobs_and_only_at_temperature_one():
    assert logprobs_mode(RolloutConfig(temperature=0.8, sampling="multinomial")) == "processed_logprobs"
    assert logprobs_mode(RolloutConfig(top_p=0.95, sampling="multinomial")) == "raw_logprobs"
    vllm_args.check_sampling(RolloutConfig(top_p=0.95, sampling="multinomial"))
    with pytest.raises(ConfigError, match=r"rollout\.top_p"):
        vllm_args.check_sampling(RolloutConfig(top_p=0.95, temperature=0.7, sampling="multinomial"))
    with pytest.raises(ConfigError, match=r"rollout\.top_p"):
        build_config(
            {"rollout": {"engine": "vllm", "sampling": "multinomial", "top_p": 0.95, "temperature": 0.7}}
        )


def _torch_draw(k: int) -> list[int]:
    return torch.randint(0, vllm_args.SEED_RANGE, (k,)).tolist()


def test_gpu_seeds_follow_torch_manual_seed_and_the_cpu_gets_none():
    """B5: vLLM's GPU sampler ignores torch's generator, so each prompt is seeded from it."""
    torch.manual_seed(7)
    first = request_seeds("cuda", 4, _torch_draw)
    torch.manual_seed(7)
    assert request_seeds("cuda", 4, _torch_draw) == first
    assert len(set(first)) == 4 and all(0 <= s < vllm_args.SEED_RANGE for s in first)
    torch.manual_seed(8)
    assert request_seeds("cuda", 4, _torch_draw) != first
    assert request_seeds("cpu", 4, _torch_draw) is None
