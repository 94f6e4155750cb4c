"""FSDP2 on two CPU processes (gloo) trains exactly what one process trains.

Rank 0 drives the steps the way the learner loop does (orders the followers, trains, gathers the
full state dict); rank 1 runs `distributed.follow`. Same fixed groups, same seed: the parameters
after the steps equal the single-process ones within 1e-5 (fp32; the only difference is the order
in which the two ranks' gradient shares are summed).
"""

from __future__ import annotations

import copy
import os
import socket

import torch
import torch.multiprocessing as mp

from echo2.config import Config, LearnerConfig, RolloutConfig, TinyModelConfig
from echo2.data.tasks.base import to_tensors
from echo2.learning.step import make_optimizer, response_logprobs, train_step
from echo2.records import Trajectory

STEPS = 3
TEMPERATURE = 0.9
# A small token budget: 16 rows of 7-14 tokens make an odd number of micro-batches, so one rank
# runs a dead (zero-weight) micro-batch to stay in step.
LEARNER = LearnerConfig(lr=1e-3, micro_batch_tokens=40, device="cpu")


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


def _rank(rank: int, port: int, groups, out: str) -> None:
    from echo2.learning import distributed
    from echo2.learning.device import place, snapshot_state
    from echo2.models import load_model, load_tokenizer

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2"
    )
    torch.set_num_threads(1)
    config = Config(
        model=TinyModelConfig(),
        learner=LEARNER,
        rollout=RolloutConfig(temperature=TEMPERATURE),
        run={"threads": 1},
    )
    assert distributed.start(config.learner) == rank
    if rank > 0:
        assert distributed.follow(config)["steps"] == STEPS
        return
    tok = load_tokenizer(config.model)
    model = load_model(config.model, vocab_size=len(tok), seed=0)
    model, optimizer, _ = place(model, None, None, LEARNER, make_optimizer=make_optimizer)
    stats = []
    for _ in range(STEPS):
        distributed.lead(distributed.Order.TRAIN, groups)
        stats.append(
            train_step(model, optimizer, groups, LEARNER, pad_id=tok.pad_token_id, temperature=TEMPERATURE)
        )
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
    expected = [
        train_step(single, optimizer, groups, LEARNER, pad_id=tok.pad_token_id, temperature=TEMPERATURE)
        for _ in range(STEPS)
    ]

    out = tmp_path / "rank0.pt"
    mp.spawn(_rank, args=(_free_port(), groups, str(out)), nprocs=2, join=True)
    got = torch.load(out, weights_only=False)

    reference = single.state_dict()
    assert set(got["state"]) == set(reference)
    moved = max((reference[k] - model.state_dict()[k]).abs().max().item() for k in reference)
    assert moved > 1e-3, "the steps changed the weights"
    diff = max((got["state"][k] - reference[k]).abs().max().item() for k in reference)
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
