"""The memory plan (echo2/planning/memory.py, `echo2 plan --memory`): its figures against hand arithmetic
(parameters x bytes, the published parameter counts), the verdicts issue 21 asks for, its activation
count against the tensors a small Qwen3 layer really saves, and the command line."""

from __future__ import annotations

import json

import pytest

from echo2.cli import main
from echo2.planning import memory as memplan
from echo2.planning.memory import ARCHS, GPUS, GiB, Workload, plan_memory

# Published sizes, typed here from the Hub, not taken from memplan: hand arithmetic is params x bytes.
PUBLISHED = {"qwen3-4b": 4.02e9, "qwen3-8b": 8.19e9, "qwq-32b": 32.76e9}
QWEN3_4B_CONFIG = {  # huggingface.co/Qwen/Qwen3-4B config.json (the fields the plan reads)
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "attention_bias": False,
}
PAPER = Workload(  # configs/qwen3-4b-math.toml's figures, resolved on CUDA
    max_prompt_tokens=1024,
    max_new_tokens=8192,
    group_size=16,
    micro_batch_tokens=16384,
    bf16=True,
    gradient_checkpointing=True,
)


def within(got: float, hand: float, tol: float = 0.10) -> bool:
    return abs(got - hand) <= tol * hand


@pytest.mark.parametrize("key", ["qwen3-4b", "qwen3-8b", "qwq-32b"])
def test_parameter_count_is_the_published_one(key):
    assert within(ARCHS[key].params(), PUBLISHED[key], 0.001)


def test_qwen3_4b_parameters_by_hand():
    h, q, kv, inter, vocab = 2560, 32 * 128, 8 * 128, 9728, 151936
    layer = h * q + 2 * h * kv + q * h + 2 * 128 + 3 * h * inter + 2 * h  # q,k,v,o, q/k norms, MLP, norms
    assert ARCHS["qwen3-4b"].params() == 36 * layer + vocab * h + h == 4_022_468_096  # tied: one embedding


@pytest.mark.parametrize("key", ["qwen3-4b", "qwen3-8b"])
def test_learner_and_engine_bytes_agree_with_hand_arithmetic(key):
    """Issue 21: within 10% of params x bytes (weights 4 or 2, gradients 4, AdamW 8)."""
    p = PUBLISHED[key]
    for gpus in (1, 4):
        plan = plan_memory(ARCHS[key], PAPER, GPUS["a100-80"], gpus=gpus)
        ln = plan["learner"]
        assert within(ln["weights"], 4 * p / gpus) and within(ln["gradients"], 4 * p / gpus)
        assert within(ln["adamw"], 8 * p / gpus) and within(ln["static"], 16 * p / gpus)
        assert within(plan["worker"]["weights"], 2 * p)


def test_kv_cache_per_token_sequence_and_group():
    for key, kib in (("qwen3-4b", 144), ("qwen3-8b", 144), ("qwq-32b", 256)):
        assert ARCHS[key].kv_bytes_per_token() == kib * 1024  # 2 x layers x kv heads x head_dim x 2 B
    worker = plan_memory(ARCHS["qwen3-4b"], PAPER, GPUS["h200"])["worker"]
    assert worker["kv_per_sequence"] == 9216 * 144 * 1024
    assert worker["kv_per_group"] == 16 * 9216 * 144 * 1024  # 20.25 GiB
    assert worker["kv_per_group"] / GiB == pytest.approx(20.25)


def test_qwen3_8b_full_fine_tuning_does_not_fit_one_h200_without_sharding():
    for ckpt in (True, False):
        wl = Workload(**{**memplan.asdict(PAPER), "gradient_checkpointing": ckpt})
        learner = plan_memory(ARCHS["qwen3-8b"], wl, GPUS["h200"])["learner"]
        assert not learner["fits"] and learner["peak"] > GPUS["h200"].bytes
    assert 16 * PUBLISHED["qwen3-8b"] > 0.85 * GPUS["h200"].bytes  # static alone: 131 GB of 150.8 GB
    sharded = plan_memory(ARCHS["qwen3-8b"], PAPER, GPUS["a100-80"], gpus=4)["learner"]
    assert sharded["fits"] and sharded["peak_without_checkpointing"] > GPUS["a100-80"].bytes  # ckpt only


def test_qwen3_4b_learner_and_a_4b_vllm_engine_fit_one_h200_with_20_gib_kv():
    plan = plan_memory(ARCHS["qwen3-4b"], PAPER, GPUS["h200"])
    coloc = plan["colocated"]
    assert plan["learner"]["fits"] and coloc["fits"] and coloc["headroom"] > 0
    assert 19 * GiB < coloc["kv_cache"] < 21 * GiB
    assert coloc["total"] == plan["learner"]["peak"] + coloc["engine"]
    assert 0 < coloc["gpu_memory_utilization"] < 0.3
    assert coloc["kv_cache_at_most"] >= coloc["kv_cache"]
    assert plan_memory(ARCHS["qwen3-8b"], PAPER, GPUS["h200"])["colocated"]["fits"] is False
    assert plan_memory(ARCHS["qwen3-4b"], PAPER, GPUS["h200"], gpus=2)["colocated"] is None


def test_activations_and_logits_head_by_hand():
    a = ARCHS["qwen3-4b"]
    ln = plan_memory(a, PAPER, GPUS["h200"])["learner"]
    assert ln["micro_batch_rows"] == 1 and ln["micro_batch_tokens"] == 9216  # 2 x 9216 > 16384
    boundaries = 36 * 4 * 2560 * 9216  # each layer's fp32 input under checkpointing
    assert ln["activations_with_checkpointing"] - boundaries < ln["activations_without_checkpointing"] / 30
    assert ln["logits_head"] == 8193 * 151936 * 14  # K + 1 positions; bf16 + fp32 + 2 fp32 temporaries
    twice = plan_memory(
        a, Workload(**{**memplan.asdict(PAPER), "micro_batch_tokens": 2 * 9216}), GPUS["h200"]
    )
    assert (
        twice["learner"]["activations_without_checkpointing"] == 2 * ln["activations_without_checkpointing"]
    )


def test_activation_count_matches_the_tensors_a_qwen3_layer_saves():
    """Per token, what a (small) transformers Qwen3 decoder layer saves for backward, counted by
    saved-tensor hooks under CPU bf16 autocast and in fp32, against the formula (the difference is
    the rotary cos/sin, which the whole model shares)."""
    torch = pytest.importorskip("torch")
    from transformers import Qwen3Config, Qwen3ForCausalLM

    dims = dict(hidden_size=256, intermediate_size=768, num_attention_heads=8, num_key_value_heads=2)
    cfg = Qwen3Config(**dims, head_dim=32, num_hidden_layers=1, vocab_size=512)
    cfg._attn_implementation = "sdpa"
    model = Qwen3ForCausalLM(cfg).train().model
    arch = memplan.arch_from_hf_config(cfg.to_dict(), name="tiny", source="test")

    def saved(tokens: int, bf16: bool) -> int:
        storages: dict[int, int] = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        pos = torch.arange(tokens)[None]
        x = model.embed_tokens(torch.randint(0, 512, (1, tokens)))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                model.layers[0](x, position_embeddings=model.rotary_emb(x, pos), position_ids=pos)
        return sum(storages.values())

    for bf16 in (True, False):
        per_token = (saved(512, bf16) - saved(256, bf16)) / 256
        formula = memplan.activation_bytes_per_token_layer(arch, bf16=bf16)
        assert formula == pytest.approx(per_token - 2 * 32 * 4, rel=0.01)  # less cos and sin, fp32


def test_lora_trains_only_the_adapter():
    a = ARCHS["qwen3-4b"]
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert memplan.lora_params(a, 8, targets) * 4 == 66_060_288  # r = 8 in fp32: the audit's 66 MB
    wl = Workload(**{**memplan.asdict(PAPER), "lora_rank": 8, "lora_targets": targets})
    ln = plan_memory(a, wl, GPUS["h200"])["learner"]
    assert ln["trainable_params"] == 16_515_072 and ln["adamw"] == 8 * 16_515_072
    assert ln["weights"] == 4 * (a.params() + 16_515_072)
    assert ln["peak"] < plan_memory(a, PAPER, GPUS["h200"])["learner"]["peak"] - 40 * GiB


def test_dedicated_worker_kv_at_its_share():
    plan = plan_memory(ARCHS["qwen3-4b"], PAPER, GPUS["rtx5090"])["worker"]
    assert plan["gpu_memory_utilization"] == memplan.DEDICATED_SHARE and plan["fits"]
    assert plan["kv_cache"] == int(0.85 * GPUS["rtx5090"].bytes) - plan["weights"] - plan["overhead"]
    assert plan["sequences_in_kv"] == plan["kv_cache"] // plan["kv_per_sequence"] >= 1
    assert not plan_memory(ARCHS["qwen3-8b"], PAPER, GPUS["l4"])["worker"]["fits"]  # < one sequence
    fixed = Workload(**{**memplan.asdict(PAPER), "kv_cache_gib": 4.0})
    w = plan_memory(ARCHS["qwen3-8b"], fixed, GPUS["rtx5090"])["worker"]
    assert w["kv_cache"] == 4 * GiB and w["gpu_memory_utilization"] * GPUS["rtx5090"].bytes == pytest.approx(
        w["weights"] + w["overhead"] + 4 * GiB
    )


def test_architecture_from_config_json_and_from_names():
    got = memplan.arch_from_hf_config(QWEN3_4B_CONFIG, name="x", source="y")
    assert got.params() == ARCHS["qwen3-4b"].params() and got.qk_norm and not got.qkv_bias
    assert memplan.arch_from_hf_config({"text_config": QWEN3_4B_CONFIG}, name="x", source="y") == got
    with pytest.raises(ValueError, match="mixture-of-experts"):
        memplan.arch_from_hf_config({**QWEN3_4B_CONFIG, "num_experts": 128}, name="x", source="y")
    with pytest.raises(ValueError, match="vocab_size"):
        memplan.arch_from_hf_config({k: v for k, v in QWEN3_4B_CONFIG.items() if k != "vocab_size"}, name="x", source="y")  # fmt: skip
    names = {
        "~/models/Qwen3-4B": "qwen3-4b",
        "Qwen/Qwen3-8B-Base": "qwen3-8b",
        "/data/qwen3_4b_instruct": "qwen3-4b",
        "Qwen/QwQ-32B-AWQ": "qwq-32b",
        "Qwen/Qwen3-40B": None,
        "Qwen/Qwen3-14B": None,
        "meta-llama/Llama-3.1-8B": None,
    }
    assert {n: memplan.arch_matching(n) for n in names} == names


def test_gpu_names_and_sizes():
    assert memplan.gpu_named("H200") is GPUS["h200"] and GPUS["h200"].bytes == 143771 * 2**20
    assert memplan.gpu_named("48GiB").bytes == 48 * GiB and memplan.gpu_named("24GB").bytes == 24 * 10**9
    with pytest.raises(ValueError, match="unknown GPU"):
        memplan.gpu_named("h2000")


def test_cuda_micro_batch_default_is_the_learners():
    device = pytest.importorskip("echo2.learning.device")
    from echo2.planning.memory_cli import CUDA_MICRO_BATCH_TOKENS

    assert device.MICRO_BATCH_TOKENS["cuda"] == CUDA_MICRO_BATCH_TOKENS


# ---------------------------------------------------------------------------- command line
def write_config(tmp_path, model_path: str, extra: str = "") -> str:
    path = tmp_path / "c.toml"
    path.write_text(
        f'[model]\ntype = "hf"\npath = "{model_path}"\n[task]\ntype = "arithmetic"\n'
        "[rollout]\nmax_prompt_tokens = 1024\nmax_new_tokens = 8192\ngroup_size = 16\n" + extra
    )
    return str(path)


def test_cli_reads_the_model_directory_and_prints_json(tmp_path, capsys):
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_4B_CONFIG))
    argv = ["plan", "--memory", write_config(tmp_path, str(model)), "--gpu", "h200", "--json"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"]["source"] == str(model / "config.json") and plan["model"]["name"] == "my-model"
    assert plan["learner"]["params"] == ARCHS["qwen3-4b"].params() and plan["colocated"]["fits"]
    assert plan["workload"]["micro_batch_tokens"] == 16384 and plan["workload"]["gradient_checkpointing"]
    assert main([*argv, "--learner.micro_batch_tokens=20000"]) == 0  # overrides as for `run`
    assert json.loads(capsys.readouterr().out)["learner"]["micro_batch_rows"] == 2


def test_cli_table_from_the_built_in_architecture(tmp_path, capsys):
    config = write_config(tmp_path, "~/no-such-dir/Qwen3-8B")
    assert main(["plan", "--memory", config, "--gpu", "h200"]) == 1  # the learner does not fit
    out = capsys.readouterr().out
    assert "Qwen3-8B: 8.19 B parameters" in out and "DOES NOT FIT" in out
    assert main(["plan", "--memory", config, "--gpu", "a100-80", "--gpus", "4"]) == 0
    assert "colocated: not applicable" in capsys.readouterr().out
    assert main(["plan", "--memory", write_config(tmp_path, "/x/model"), "--gpu", "h100", "--gpus", "2", "--arch", "qwen3-4b"]) == 0  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "model_path", "message"),
    [
        (["--gpu", "h2000"], "~/Qwen3-4B", "--gpu: unknown GPU 'h2000'"),
        ([], "~/Qwen3-4B", "--gpu: required with --memory"),
        (["--gpu", "h200", "--gpus", "0"], "~/Qwen3-4B", "--gpus: must be >= 1"),
        (["--gpu", "h200", "--arch", "llama"], "~/Qwen3-4B", "--arch: unknown 'llama'"),
        (["--gpu", "h200"], "/models/some-model", "model.path: /models/some-model: no config.json"),
        (["--gpu", "h200", "--learner.nope=1"], "~/Qwen3-4B", "learner.nope"),
    ],
)
def test_cli_mistakes_exit_2_naming_the_flag(tmp_path, capsys, argv, model_path, message):
    assert main(["plan", "--memory", write_config(tmp_path, model_path), *argv]) == 2
    assert message in capsys.readouterr().err


def test_cli_capacity_plan_still_needs_its_flags(capsys):
    assert main(["plan", "--t-train", "10", "--batch", "3"]) == 2
    assert "--t-bcast, --staleness, --pool: required" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["qwen3-4b-math", "qwen3-8b-math"])
def test_the_paper_configs(name, capsys):
    """configs/qwen3-*-math.toml (no model directory here: the built-in table by name)."""
    from pathlib import Path

    path = Path(__file__).parents[2] / "configs" / f"{name}.toml"
    if not path.is_file():
        pytest.skip(f"{path} not written yet")
    rc = main(["plan", "--memory", str(path), "--gpu", "h200", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"]["name"] == ("Qwen3-4B" if "4b" in name else "Qwen3-8B")
    assert (rc == 0) == ("4b" in name) and plan["colocated"]["fits"] == ("4b" in name)


def test_the_plan_shows_echo2s_own_vllm_arguments(tmp_path, capsys):
    """rollout/vllm_args.py sizes the engine echo2 builds: alone on the card the same share as the
    plan's worker; beside the learner the plan counts the KV cache that share leaves (about 20 GiB)."""
    from echo2.rollout import vllm_args

    assert vllm_args.DEDICATED_UTILIZATION == memplan.DEDICATED_SHARE
    argv = ["plan", "--memory", write_config(tmp_path, "~/models/Qwen3-4B"), "--gpu", "h200", "--json"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    args, coloc = plan["echo2_vllm_args"], plan["colocated"]
    assert args["worker"]["gpu_memory_utilization"] == plan["worker"]["gpu_memory_utilization"]
    assert coloc["gpu_memory_utilization"] == pytest.approx(
        args["colocated"]["gpu_memory_utilization"], abs=0.002
    )
    assert 18 * GiB < coloc["kv_cache"] < 21 * GiB and coloc["fits"] and plan["fits"]
    assert main([*argv[:-1], "--rollout.vllm.kv_cache_gib=30"]) == 0  # a fixed KV cache is kept as given
    assert "kv_cache_memory_bytes=30.00 GiB" in capsys.readouterr().out
