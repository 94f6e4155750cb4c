"""Snapshots: each weight sent once (tied aliases left out), read back tensor by tensor from the
chunks a worker holds, and installed parameter by parameter by the HF engine."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load, save

from echo2.broadcast.chunks import SnapshotBytes, split
from echo2.config import LearnerConfig
from echo2.learning import distributed
from echo2.learning.device import snapshot_state
from echo2.learning.sources.remote import serialise
from echo2.models import install_state, tied_names
from echo2.records import Snapshot
from echo2.rollout.engine import HFEngine
from echo2.rollout.safetensors_view import SafetensorsView

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def perturbed(model, seed: int = 0):
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():  # the tied weight once: both names move together
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return out


def test_a_tied_model_snapshot_holds_each_weight_once(tiny):
    model, _ = tiny
    assert model.config.tie_word_embeddings and tied_names(model) == {HEAD: EMBED}
    state = snapshot_state(model, LearnerConfig(dtype="fp32"))
    assert EMBED in state and HEAD not in state
    assert state.keys() == model.state_dict().keys() - {HEAD}
    data = serialise(Snapshot(version=0, state=state))
    assert HEAD not in load(data)
    embed_bytes = model.get_input_embeddings().weight.numel() * 4
    with_duplicate = len(save({k: v.clone() for k, v in model.state_dict().items()}))
    assert len(data) <= with_duplicate - embed_bytes  # the embedding matrix went once, not twice


def test_tied_aliases_come_from_the_model_not_the_gathered_state(tiny, monkeypatch):
    """FSDP2's full state dict gathers each key on its own, so the tied pair arrives as two
    unshared tensors: the alias is still left out, since it is found on the model."""
    model, _ = tiny
    gathered = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert gathered[HEAD].data_ptr() != gathered[EMBED].data_ptr()
    monkeypatch.setattr(distributed, "full_state", lambda m: gathered)
    assert HEAD not in snapshot_state(model, LearnerConfig(dtype="bf16"))


def test_fsdp2_keeps_the_tie_as_one_parameter():
    """fully_shard sets one sharded parameter on both modules (_fsdp_param.py `_setattr_on_modules`),
    so `tied_names` finds the alias on a sharded model (one gloo process)."""
    script = textwrap.dedent(
        """
        import os, torch.distributed as dist
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
        dist.init_process_group("gloo", rank=0, world_size=1)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoModelForCausalLM, LlamaConfig
        from echo2.models import tied_names
        cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=1, num_key_value_heads=1, tie_word_embeddings=True)
        model = AutoModelForCausalLM.from_config(cfg)
        mesh = init_device_mesh("cpu", (1,))
        fully_shard(model.model.layers[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        print(tied_names(model))
        dist.destroy_process_group()
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == str({HEAD: EMBED})


def test_the_hf_engine_installs_a_snapshot_without_its_tied_alias(tiny, rollout_cfg):
    model, tok = tiny
    engine = HFEngine(copy.deepcopy(model), tok, rollout_cfg, version=0)
    target = perturbed(model)
    data = serialise(Snapshot(version=1, state=snapshot_state(target, LearnerConfig(dtype="fp32"))))
    chunks = SnapshotBytes(split(data, 1000), 1000)
    engine.install(Snapshot(version=1, state=SafetensorsView(chunks)))
    got = engine.model.state_dict()
    for name, want in target.state_dict().items():
        assert torch.equal(got[name], want), name
    assert engine.model.lm_head.weight is engine.model.get_input_embeddings().weight  # still tied
    engine.install(Snapshot(version=2, state=dict(model.state_dict())))  # the alias sent anyway: fine
    assert torch.equal(engine.model.lm_head.weight, model.lm_head.weight)


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (lambda s: s.pop("model.norm.weight"), r"missing \['model\.norm\.weight'\]"),
        (lambda s: s.__setitem__("model.extra.weight", torch.zeros(2)), r"unexpected \['model\.extra"),
        (lambda s: s.__setitem__("model.norm.weight", torch.zeros(3)), r"model\.norm\.weight has shape"),
    ],
)
def test_install_state_refuses_a_wrong_snapshot_before_changing_anything(tiny, change, error):
    model, _ = tiny
    target = copy.deepcopy(model)
    state = {k: v + 1 for k, v in snapshot_state(model, LearnerConfig(dtype="fp32")).items()}
    change(state)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ValueError, match=error):
        install_state(target, state)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


def mixed_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {
        "b.weight": torch.randn(5, 7, generator=gen).to(torch.bfloat16),
        "a.weight": torch.randn(3, 4, generator=gen),
        "count": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "empty": torch.zeros(0, 4),
        "mask": torch.tensor([True, False, True]),
    }


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 10**6])
def test_the_view_reads_what_safetensors_reads(chunk_size):
    data = save(mixed_state(), metadata={"format": "pt"})
    view = SafetensorsView(SnapshotBytes(split(data, chunk_size), chunk_size))
    want = load(data)
    assert set(view) == set(want) and len(view) == len(want)
    for name, tensor in want.items():
        assert view.shapes[name] == tuple(tensor.shape)
        assert view[name].dtype == tensor.dtype and torch.equal(view[name], tensor), name


def test_the_view_reads_one_tensor_at_a_time():
    """Building the view reads the header only; each lookup copies that tensor's bytes only."""
    data = save(mixed_state())
    reads: list[tuple[int, int]] = []

    class Spy(SnapshotBytes):
        def read(self, start, end):
            reads.append((start, end))
            return super().read(start, end)

    view = SafetensorsView(Spy(split(data, 16), 16))
    header_end = reads[-1][1]
    assert sum(e - s for s, e in reads) == header_end < len(data) - 100
    reads.clear()
    tensor = view["a.weight"]
    assert reads and sum(e - s for s, e in reads) == tensor.numel() * 4


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda d: d[:-1],  # data cut short
        lambda d: d + b"\0",  # trailing bytes
        lambda d: d[:8],  # header missing
        lambda d: (10**9).to_bytes(8, "little") + d[8:],  # header size absurd
        lambda d: d.replace(b'"F32"', b'"F31"'),  # unknown dtype
        lambda d: d.replace(b"[3,4]", b"[4,4]"),  # shape larger than its bytes
    ],
)
def test_the_view_refuses_a_malformed_file(corrupt):
    data = save({"a.weight": torch.zeros(3, 4), "b": torch.zeros(2)})
    with pytest.raises(ValueError, match="snapshot"):
        SafetensorsView(corrupt(data))
