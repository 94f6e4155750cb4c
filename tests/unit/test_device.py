"""learner.device, learner.dtype and gradient checkpointing on CPU; the GPU defaults ("auto"/None
resolved per device); FSDP2's mixed-precision arguments; snapshot dtype and size."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from support import TINY

from echo2.cli import main
from echo2.config import ConfigError, LearnerConfig, load_config, read_toml
from echo2.learning import distributed
from echo2.learning.device import place, resolve_device, resolved, resolved_learner, snapshot_state
from echo2.learning.step import make_optimizer, train_step
from echo2.models import tied_names
from echo2.records import Trajectory

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")


def groups(tiny, *, seed: int = 0) -> list[list[Trajectory]]:
    """2 groups of 3 on-policy trajectories of random tokens with mixed rewards."""
    from echo2.data.tasks.base import to_tensors
    from echo2.learning.step import response_logprobs

    model, tok = tiny
    gen = torch.Generator().manual_seed(seed)
    records = [
        Trajectory(
            group_id=f"g{g}",
            prompt_ids=tuple(torch.randint(1, len(tok), (4,), generator=gen).tolist()),
            response_ids=tuple(torch.randint(1, len(tok), (3 + i,), generator=gen).tolist()),
            behaviour_logprobs=(0.0,) * (3 + i),
            loss_mask=(1,) * (3 + i),
            reward=float(i == g),
            version=0,
        )
        for g in range(2)
        for i in range(3)
    ]
    batch = to_tensors(records, pad_id=tok.pad_token_id, advantages=[0.0] * len(records))
    with torch.no_grad():
        logp = response_logprobs(copy.deepcopy(model).eval(), batch, temperature=1.0)
    out = [
        Trajectory.from_dict(
            {
                **r.to_dict(),
                "behaviour_logprobs": tuple(logp[j, logp.shape[1] - len(r.response_ids) :].tolist()),
            }
        )
        for j, r in enumerate(records)
    ]
    return [out[:3], out[3:]]


def one_step(tiny, config: LearnerConfig):
    model, tok = tiny
    m, optimizer, _ = place(copy.deepcopy(model), None, None, config, make_optimizer=make_optimizer)
    stats = train_step(m, optimizer, groups(tiny), config, pad_id=tok.pad_token_id, temperature=1.0)
    return m, optimizer, stats


def test_cpu_and_auto_resolve_on_this_machine():
    assert resolve_device(LearnerConfig(device="cpu")) == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device(LearnerConfig(device="auto")).type == expected


@NO_GPU
def test_cuda_without_a_gpu_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"^learner\.device: cuda"):
        resolve_device(LearnerConfig(device="cuda"))


@NO_GPU
def test_cli_refuses_cuda_without_a_gpu_before_writing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["run", TINY, "--learner.device=cuda", f"--run.dir={run_dir}", "-q"]) == 2
    assert "learner.device" in capsys.readouterr().err
    assert not run_dir.exists()


QUICKSTART = str(Path(__file__).parents[2] / "configs" / "quickstart.toml")


def test_the_cpu_quickstart_resolves_to_exactly_todays_settings():
    config = load_config(QUICKSTART, {"learner.device": "cpu"})
    lcfg = config.learner
    assert (lcfg.dtype, lcfg.gradient_checkpointing, lcfg.micro_batch_tokens) == ("auto", None, None)
    got = resolved(config).learner
    assert (got.dtype, got.gradient_checkpointing, got.micro_batch_tokens) == ("fp32", False, 4096)
    assert resolved(config).model_dump(exclude={"learner"}) == config.model_dump(exclude={"learner"})


@pytest.fixture
def cuda(monkeypatch):
    """A machine whose torch sees a GPU (nothing is put on it: only the defaults are resolved)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    return monkeypatch


def test_gpu_defaults_on_a_cuda_device(cuda):
    for device in ("auto", "cuda"):
        got = resolved_learner(LearnerConfig(device=device))
        assert (got.dtype, got.gradient_checkpointing, got.micro_batch_tokens) == ("bf16", True, 16384)
    # learner.device = "cpu" beside a GPU keeps the CPU values; explicit values are never changed
    cpu = resolved_learner(LearnerConfig(device="cpu"))
    assert (cpu.dtype, cpu.gradient_checkpointing, cpu.micro_batch_tokens) == ("fp32", False, 4096)
    mine = LearnerConfig(dtype="fp32", gradient_checkpointing=False, micro_batch_tokens=2048)
    assert resolved_learner(mine) is mine


def test_auto_dtype_is_fp32_on_a_gpu_without_bf16(cuda):
    cuda.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolved_learner(LearnerConfig(device="cuda")).dtype == "fp32"


def test_config_toml_holds_the_resolved_values(tmp_path):
    run_dir = tmp_path / "run"
    assert main(["run", TINY, f"--run.dir={run_dir}", "--learner.steps=1", "--run.eval_size=0", "-q"]) == 0
    learner = read_toml(run_dir / "config.toml")["learner"]
    assert (learner["dtype"], learner["gradient_checkpointing"], learner["micro_batch_tokens"]) == (
        ("bf16", True, 16384) if torch.cuda.is_available() else ("fp32", False, 4096)
    )


def test_fsdp_gathers_bf16_and_reduces_fp32_when_the_learner_is_bf16(tiny, monkeypatch):
    """P1: device.place hands shard the compute dtype, and shard hands fully_shard a
    MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32); none for fp32."""
    from torch.distributed import fsdp

    asked = []
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed, "shard", lambda model, *, param_dtype: asked.append(param_dtype))
    for dtype in ("bf16", "fp32"):
        place(
            copy.deepcopy(tiny[0]),
            None,
            None,
            LearnerConfig(device="cpu", dtype=dtype),
            make_optimizer=make_optimizer,
        )
    assert asked == [torch.bfloat16, None]
    monkeypatch.undo()

    class Stop(Exception):
        pass

    policies = []

    def fully_shard(module, **kwargs):
        policies.append(kwargs.get("mp_policy"))
        raise Stop  # the arguments are all this test wants

    monkeypatch.setattr(fsdp, "fully_shard", fully_shard)
    for param_dtype in (torch.bfloat16, None):
        with pytest.raises(Stop):
            distributed.shard(copy.deepcopy(tiny[0]), param_dtype=param_dtype)
    assert policies == [
        fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        fsdp.MixedPrecisionPolicy(),
    ]


def test_bf16_step_keeps_fp32_state_and_is_close_to_fp32(tiny):
    m32, _, s32 = one_step(tiny, LearnerConfig(lr=1e-3, device="cpu", dtype="fp32"))
    m16, opt16, s16 = one_step(tiny, LearnerConfig(lr=1e-3, device="cpu", dtype="bf16"))
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in m16.parameters())
    adam = [s for s in opt16.state.values()]
    assert adam and all(s["exp_avg"].dtype == torch.float32 for s in adam)
    assert all(s["exp_avg_sq"].dtype == torch.float32 for s in adam)
    assert s16["train/grad_norm"] > 0
    # bf16 log-probs are off by ~1e-2 against fp32 behaviour log-probs, so the ratio is ~1 +- 2%.
    assert abs(s16["train/ratio_mean"] - 1) < 0.02 and abs(s32["train/ratio_mean"] - 1) < 1e-5
    assert abs(s16["train/loss"] - s32["train/loss"]) < 0.02
    assert abs(s16["train/grad_norm"] - s32["train/grad_norm"]) < 0.1 * s32["train/grad_norm"]
    # Both steps moved the weights the same way (Adam's first step is ~lr * sign(grad)).
    w16, w32 = m16.state_dict(), m32.state_dict()
    start = tiny[0].state_dict()
    d16 = torch.cat([(w16[k] - start[k]).flatten() for k in start])
    d32 = torch.cat([(w32[k] - start[k]).flatten() for k in start])
    assert torch.nn.functional.cosine_similarity(d16, d32, dim=0) > 0.9


def test_gradient_checkpointing_gives_the_same_update(tiny):
    plain, _, s1 = one_step(tiny, LearnerConfig(lr=1e-3, device="cpu"))
    ckpt, _, s2 = one_step(tiny, LearnerConfig(lr=1e-3, device="cpu", gradient_checkpointing=True))
    flag = (
        "is_activation_checkpointing"
        if hasattr(plain, "is_activation_checkpointing")
        else "is_gradient_checkpointing"
    )
    assert getattr(ckpt, flag) and not getattr(plain, flag)
    assert abs(s1["train/loss"] - s2["train/loss"]) < 1e-6
    w1, w2 = plain.state_dict(), ckpt.state_dict()
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < 1e-6


def test_bf16_snapshot_is_half_the_bytes(tiny):
    model, _ = tiny
    full = snapshot_state(model, LearnerConfig(dtype="fp32"))
    half = snapshot_state(model, LearnerConfig(dtype="bf16"))
    # every weight once: a tied alias (the tiny model's lm_head) is left out (models.tied_names)
    assert set(full) == set(half) == set(model.state_dict()) - set(tied_names(model))
    assert all(v.dtype == torch.bfloat16 and v.device.type == "cpu" for v in half.values())
    size = lambda state: sum(v.numel() * v.element_size() for v in state.values())  # noqa: E731
    assert size(half) / size(full) == pytest.approx(0.5, abs=0.01)
    # The snapshot is a copy: training the model does not change it.
    key = next(iter(full))
    assert full[key].data_ptr() != model.state_dict()[key].data_ptr()
    assert (half[key].float() - full[key]).abs().max() < 1e-2 * full[key].abs().max()


def test_one_process_deals_every_micro_batch_live():
    batches = [[0, 1], [2], [3, 4]]
    assert list(distributed.share(iter(batches), records=[])) == [(b, True) for b in batches]
    assert distributed.world_size() == 1 and distributed.rank() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check.sh)")
def test_bf16_step_on_cuda_matches_the_cpu_step(tiny):
    """The same bf16 step on the GPU: weights stay fp32 and finite on cuda, and the loss agrees
    with the CPU fp32 step within bf16 precision."""
    _, _, s32 = one_step(tiny, LearnerConfig(lr=1e-3, device="cpu", dtype="fp32"))
    m16, _, s16 = one_step(tiny, LearnerConfig(lr=1e-3, device="cuda", dtype="bf16"))
    params = list(m16.parameters())
    assert all(p.is_cuda and p.dtype == torch.float32 and torch.isfinite(p).all() for p in params)
    assert abs(s16["train/loss"] - s32["train/loss"]) < 0.02
    assert abs(s16["train/ratio_mean"] - 1) < 0.02


def test_a_torchrun_rank_leaves_past_teardown_and_loses_no_output(tmp_path):
    """distributed.leave: a rank that joined a process group ends with its code, its log and an
    unterminated stdout line flushed, and no interpreter teardown (an atexit handler does not run:
    gloo's worker threads cannot abort it); in a process that never joined it returns."""
    import subprocess
    import sys

    distributed.leave(3)  # this process never joined: a no-op
    script = (
        "import atexit, logging, sys\n"
        "from echo2.learning import distributed\n"
        "logging.basicConfig(stream=sys.stderr)\n"
        "atexit.register(lambda: print('teardown ran', file=sys.stderr))\n"
        "distributed._joined = True  # as start() sets it under torchrun\n"
        "logging.getLogger('echo2').warning('logged')\n"
        "print('no newline', end='')\n"
        "distributed.leave(3)\n"
        "print('after leave')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr[-2000:]
    assert done.stdout == "no newline"
    assert "logged" in done.stderr and "teardown ran" not in done.stderr
