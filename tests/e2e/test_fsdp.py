"""FSDP2 on two CPU processes (gloo) trains exactly what one process trains.

Rank 0 drives the steps the way the learner loop does (orders the followers, trains, gathers the
full state dict); rank 1 runs `build.follow`, which builds its policy on the meta device and
receives rank 0's weights while sharding. Same fixed groups, same seed: the parameters after the
steps equal the single-process ones within 1e-5 (fp32; the only difference is the order in which
the two ranks' gradient shares are summed). The same holds for a LoRA adapter with a reference
model (gathered with full_tensor), and a follower's start-up never holds a whole model.
"""

from __future__ import annotations

import copy
import os
import re
import socket

import pytest
import torch
import torch.multiprocessing as mp

from echo2.config import Config, HFModelConfig, LearnerConfig, LoraConfig, RolloutConfig, TinyModelConfig
from echo2.data.tasks.base import to_tensors
from echo2.learning.step import make_optimizer, response_logprobs, train_step
from echo2.records import Trajectory

STEPS = 3
TEMPERATURE = 0.9
# A small token budget: 16 rows of 7-14 tokens make an odd number of micro-batches, so one rank
# runs a dead (zero-weight) micro-batch to stay in step.
LEARNER = LearnerConfig(lr=1e-3, micro_batch_tokens=40, device="cpu", dtype="fp32")
# Every other record one version stale: rank 0's TRAIN order carries it, so the follower trains the
# fresh rows on its own log-probs and caps the stale ones' ratios exactly as rank 0 does.
STALENESS = [i % 2 for i in range(16)]


def _step(model, optimizer, groups, pad_id: int) -> dict[str, float]:
    """One step of LEARNER on the half-stale `groups`, as both sides of the comparison take it."""
    return train_step(
        model, optimizer, groups, LEARNER, pad_id=pad_id, temperature=TEMPERATURE, staleness=STALENESS
    )


def fixed_groups(model, *, pad_id: int, vocab: int) -> list[list[Trajectory]]:
    """4 groups of 4 deterministic trajectories with the model's own (on-policy) log-probs."""
    gen = torch.Generator().manual_seed(1)
    records = []
    for g in range(4):
        prompt = tuple(torch.randint(1, vocab, (3 + g,), generator=gen).tolist())
        for i in range(4):
            response = tuple(torch.randint(1, vocab, (4 + (g + i) % 5,), generator=gen).tolist())
            records.append(
                Trajectory(
                    group_id=f"g{g}",
                    prompt_ids=prompt,
                    response_ids=response,
                    behaviour_logprobs=(0.0,) * len(response),
                    loss_mask=(1,) * len(response),
                    reward=float((g + i) % 2 if g < 3 else 1),  # the last group has no signal
                    version=0,
                )
            )
    batch = to_tensors(records, pad_id=pad_id, advantages=[0.0] * len(records))
    with torch.no_grad():
        logp = response_logprobs(model.eval(), batch, temperature=TEMPERATURE)
    out = []
    for row, r in enumerate(records):
        k = len(r.response_ids)
        lp = tuple(logp[row, logp.shape[1] - k :].tolist())
        out.append(Trajectory.from_dict({**r.to_dict(), "behaviour_logprobs": lp}))
    return [out[i : i + 4] for i in range(0, len(out), 4)]


def _join(rank: int, port: int, learner: LearnerConfig) -> Config:
    """This process as `rank` of a 2-process gloo group on loopback; the tiny model's config."""
    from echo2.learning import distributed
    from echo2.learning.device import resolve_device

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2"
    )
    torch.set_num_threads(1)
    config = Config(
        model=TinyModelConfig(),
        learner=learner,
        rollout=RolloutConfig(temperature=TEMPERATURE),
        run={"threads": 1},
    )
    assert distributed.start(resolve_device(config.learner)) == rank
    return config


def _rank(rank: int, port: int, groups, out: str) -> None:
    from echo2.learning import build, distributed
    from echo2.learning.device import place, snapshot_state
    from echo2.models import load_model, load_tokenizer

    config = _join(rank, port, LEARNER)
    if rank > 0:
        assert build.follow(config)["steps"] == STEPS
        return
    tok = load_tokenizer(config.model)
    model = load_model(config.model, vocab_size=len(tok), seed=0)
    model, optimizer, _ = place(model, None, None, LEARNER, make_optimizer=make_optimizer)
    stats = []
    for _ in range(STEPS):
        distributed.lead(
            distributed.Order.TRAIN,
            build.train_order(groups, staleness=STALENESS, checks=False, version=None),
        )
        stats.append(_step(model, optimizer, groups, tok.pad_token_id))
    state = snapshot_state(model, LEARNER)
    distributed.stop()
    torch.save({"state": state, "stats": stats}, out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_fsdp_ranks_match_one_process(tiny, tmp_path):
    model, tok = tiny
    groups = fixed_groups(copy.deepcopy(model), pad_id=tok.pad_token_id, vocab=len(tok))

    single = copy.deepcopy(model)
    optimizer = make_optimizer(single, LEARNER)
    expected = [_step(single, optimizer, groups, tok.pad_token_id) for _ in range(STEPS)]

    out = tmp_path / "rank0.pt"
    mp.spawn(_rank, args=(_free_port(), groups, str(out)), nprocs=2, join=True)
    got = torch.load(out, weights_only=False)

    reference = single.state_dict()
    assert set(got["state"]) <= set(reference) and "model.embed_tokens.weight" in got["state"]  # tied once
    moved = max((reference[k] - model.state_dict()[k]).abs().max().item() for k in reference)
    assert moved > 1e-3, "the steps changed the weights"
    diff = max((v - reference[k]).abs().max().item() for k, v in got["state"].items())
    assert diff < 1e-5
    for a, b in zip(expected, got["stats"], strict=True):
        for key in ("train/loss", "train/grad_norm", "train/ratio_mean", "train/clip_fraction"):
            assert abs(a[key] - b[key]) < 1e-5, key


def test_torchrun_learner_writes_full_checkpoint_on_rank_0(tiny, tmp_path):
    """`torchrun --standalone --nproc-per-node 2 -m echo2.cli run`: the loop's hooks under FSDP2
    (orders, bf16 snapshots gathered for the final evaluation, a full checkpoint, clean stop)."""
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    run_dir = tmp_path / "run"
    tiny_toml = Path(__file__).parents[2] / "configs" / "tiny.toml"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "echo2.cli", "run", str(tiny_toml), f"--run.dir={run_dir}", "--run.threads=1"]
    cmd += ["--learner.steps=2", "--learner.dtype=bf16", "--learner.device=cpu", "-q"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2
    saved = load_file(run_dir / "checkpoint" / "model.safetensors")
    model, _ = tiny
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    assert {k: v.shape for k, v in saved.items()}.items() <= shapes.items()  # tied head saved once
    assert "model.embed_tokens.weight" in saved and all(v.dtype == torch.float32 for v in saved.values())
    optimizer = torch.load(run_dir / "checkpoint" / "optimizer.pt", weights_only=True)
    assert "model.layers.0.mlp.up_proj.weight" in optimizer["state"]  # full, keyed by name


def _memory_kib() -> tuple[int, int]:
    """(peak, current) resident memory of this process in KiB (/proc/self/status VmHWM, VmRSS)."""
    status = open("/proc/self/status").read()
    return tuple(int(re.search(rf"{k}:\s+(\d+)", status).group(1)) for k in ("VmHWM", "VmRSS"))


def _start_up_rank(rank: int, port: int, config: Config, out: str) -> None:
    """Rank 0 builds the learner as loop.run does and gathers the sharded weights; rank 1 is a
    follower. Each measures its peak resident memory from just before the build (VmHWM reset)."""
    import torch.distributed.checkpoint.state_dict  # noqa: F401  imports are not the build
    import torch.distributed.fsdp  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    from echo2.learning import build, distributed
    from echo2.learning.device import resolve_device
    from echo2.models import load_tokenizer

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2"
    )
    torch.set_num_threads(1)
    load_tokenizer(config.model)  # warm the tokenizer's files (both ranks load it again in the build)
    assert distributed.start(resolve_device(config.learner)) == rank
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak to the current resident size (Linux >= 4.0)
    baseline = _memory_kib()[1]
    if rank > 0:
        build.follow(config)
        torch.save({"peak_kib": _memory_kib()[0] - baseline}, out + ".1")
        return
    learner = build.place(build.load(config), config)
    model = learner.model
    peak = _memory_kib()[0] - baseline
    rotary = {k: v.clone() for k, v in model.named_buffers() if k.endswith("inv_freq")}
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    state = distributed.full_state(model)
    distributed.stop()
    torch.save({"state": state, "peak_kib": peak, "rotary": rotary, "tied": tied}, out + ".0")


def test_sharded_start_up_never_holds_a_whole_model_on_a_follower(tiny, tmp_path):
    """S1: rank 1's start-up peak stays under the size of the fp32 model (the old follower loaded
    it whole, then sharded it), rank 0 is the only one that reads it, and the shards hold exactly
    the weights one process loads: tied head, rotary buffers and all."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from echo2.models import load_model

    shape = LlamaConfig(
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    path = tmp_path / "model"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(shape, dtype=torch.float32).save_pretrained(path)
    tiny[1].save_pretrained(path)
    config = Config(
        model=HFModelConfig(path=str(path)),
        learner=LearnerConfig(device="cpu", dtype="fp32"),
        run={"threads": 1},
    )
    single = load_model(config.model, vocab_size=len(tiny[1]), seed=0)
    expected = single.state_dict()
    full_kib = sum(v.numel() * v.element_size() for v in single.parameters()) // 1024  # ~160 MiB

    out = str(tmp_path / "rank")
    mp.spawn(_start_up_rank, args=(_free_port(), config, out), nprocs=2, join=True)
    got, follower = torch.load(out + ".0", weights_only=False), torch.load(out + ".1")

    assert follower["peak_kib"] < 0.75 * full_kib, (follower["peak_kib"], full_kib)
    assert got["peak_kib"] > 0.9 * full_kib, "rank 0 reads the whole model: the measure sees it"
    assert got["tied"]
    assert set(got["state"]) <= set(expected) and "model.embed_tokens.weight" in got["state"]
    assert all(torch.equal(v, expected[k]) for k, v in got["state"].items())
    buffers = dict(single.named_buffers())
    assert got["rotary"] and all(torch.equal(v, buffers[k]) for k, v in got["rotary"].items())


LORA_LEARNER = LearnerConfig(
    lr=1e-3, micro_batch_tokens=40, device="cpu", dtype="fp32", kl_beta=0.1, lora=LoraConfig(rank=4)
)


def _lora_rank(rank: int, port: int, groups, out: str) -> None:
    from echo2.learning import build, distributed
    from echo2.learning.loop import make_snapshot

    config = _join(rank, port, LORA_LEARNER)
    if rank > 0:
        assert build.follow(config)["steps"] == STEPS
        return
    learner = build.place(build.load(config), config)
    for _ in range(STEPS):
        distributed.lead(
            distributed.Order.TRAIN, build.train_order(groups, staleness=None, checks=False, version=None)
        )
        train_step(
            learner.model,
            learner.optimizer,
            groups,
            LORA_LEARNER,
            pad_id=learner.tokenizer.pad_token_id,
            temperature=TEMPERATURE,
            ref_model=learner.ref_model,
        )
    snapshot = make_snapshot(learner.model, STEPS, LORA_LEARNER)  # a GATHER the follower joins
    distributed.stop()
    torch.save(snapshot.state, out)


def test_two_fsdp_ranks_train_and_gather_the_same_lora_adapter(tiny, tmp_path):
    """S2: under torchrun both ranks build the LoRA policy and its reference (the follower used to
    train the full model), train it sharded, and rank 0 gathers the adapter whole with
    full_tensor(): it equals the single-process adapter."""
    from echo2.learning.lora import adapter_state, apply_lora
    from echo2.models import load_model

    model, tok = tiny
    groups = fixed_groups(copy.deepcopy(model), pad_id=tok.pad_token_id, vocab=len(tok))
    single = apply_lora(load_model(TinyModelConfig(), vocab_size=len(tok), seed=0), LORA_LEARNER.lora)
    ref = copy.deepcopy(single).eval().requires_grad_(False)
    optimizer = make_optimizer(single, LORA_LEARNER)
    for _ in range(STEPS):
        train_step(
            single,
            optimizer,
            groups,
            LORA_LEARNER,
            pad_id=tok.pad_token_id,
            temperature=TEMPERATURE,
            ref_model=ref,
        )
    expected = adapter_state(single)

    out = tmp_path / "adapter.pt"
    mp.spawn(_lora_rank, args=(_free_port(), groups, str(out)), nprocs=2, join=True)
    got = torch.load(out, weights_only=True)

    assert set(got) == set(expected) and len(got) == 2 * 7 * 2
    assert all(type(v) is torch.Tensor and v.dtype == torch.float32 for v in got.values())
    assert max(v.abs().max().item() for k, v in got.items() if k.endswith("lora_B")) > 1e-4, "trained"
    assert max((got[k] - v).abs().max().item() for k, v in expected.items()) < 1e-5


def _one_gpu_rank(rank: int, port: int, groups, out: str) -> None:
    """FSDP2 over a one-rank NCCL group on cuda:0: the sharded start-up path on a GPU (meta,
    to_empty on cuda, rank 0's weights broadcast over NCCL, bf16 MixedPrecisionPolicy)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from echo2.learning import distributed
    from echo2.models import load_model, load_tokenizer

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1"
    )
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    config = LearnerConfig(lr=1e-3, device="cuda", dtype="bf16")
    tok = load_tokenizer(TinyModelConfig())
    model = load_model(TinyModelConfig(), vocab_size=len(tok), seed=0)
    inv_freq = {k: v.clone() for k, v in model.named_buffers() if k.endswith("inv_freq")}
    distributed.shard(model, param_dtype=torch.bfloat16)
    params = list(model.parameters())
    assert all(
        isinstance(p, DTensor) and p.device.type == "cuda" and p.dtype == torch.float32 for p in params
    )
    assert model.lm_head.weight is model.model.embed_tokens.weight
    buffers = dict(model.named_buffers())
    assert all(buffers[k].is_cuda and torch.equal(buffers[k].cpu(), v) for k, v in inv_freq.items())
    stats = train_step(
        model, make_optimizer(model, config), groups, config, pad_id=tok.pad_token_id, temperature=TEMPERATURE
    )
    torch.save(stats, out)
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check.sh)")
def test_sharded_start_up_and_bf16_step_on_one_gpu(tiny, tmp_path):
    """The GPU half of the start-up and P1 tests: FSDP2 over NCCL on one GPU loads the weights into
    cuda shards (tied head and rotary buffers kept), and a bf16-gathered step agrees with the CPU
    fp32 step within bf16 precision."""
    model, tok = tiny
    groups = fixed_groups(copy.deepcopy(model), pad_id=tok.pad_token_id, vocab=len(tok))
    config = LearnerConfig(lr=1e-3, device="cpu", dtype="fp32")
    single = copy.deepcopy(model)
    expected = train_step(
        single,
        make_optimizer(single, config),
        groups,
        config,
        pad_id=tok.pad_token_id,
        temperature=TEMPERATURE,
    )
    out = tmp_path / "stats.pt"
    mp.spawn(_one_gpu_rank, args=(_free_port(), groups, str(out)), nprocs=1, join=True)
    got = torch.load(out, weights_only=False)
    assert abs(got["train/loss"] - expected["train/loss"]) < 0.02
    assert abs(got["train/ratio_mean"] - 1) < 0.05


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL)")
def test_torchrun_learner_on_two_gpus(tmp_path):
    """`torchrun --nproc-per-node 2 -m echo2.cli run` on two GPUs: NCCL, sharded start-up, the GPU
    defaults (bf16 with a bf16 MixedPrecisionPolicy, checkpointing, 16384-token micro-batches) and
    the HF evaluation engine on rank 0's GPU."""
    import subprocess
    import sys
    from pathlib import Path

    from echo2.config import read_toml

    run_dir = tmp_path / "run"
    tiny_toml = Path(__file__).parents[2] / "configs" / "tiny.toml"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "echo2.cli", "run", str(tiny_toml), f"--run.dir={run_dir}", "--learner.steps=2"]
    cmd += ["--learner.device=cuda", "-q"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2
    learner = read_toml(run_dir / "config.toml")["learner"]
    bf16 = torch.cuda.is_bf16_supported()
    assert learner["dtype"] == ("bf16" if bf16 else "fp32")
    assert (learner["gradient_checkpointing"], learner["micro_batch_tokens"]) == (True, 16384)
