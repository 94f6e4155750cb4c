"""Delta snapshots (broadcast/delta.py): applied on its base a delta gives the full snapshot's exact
bytes and hash, in fp32 and bf16, for random, sparse and no changes, with tied weights sent once;
a wrong base is refused as such, a tampered delta fails its checks, and chains of deltas (a worker
that missed versions) end on the right bytes."""

from __future__ import annotations

import copy
import hashlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save

from echo2.broadcast.chunks import SnapshotBytes, VerificationError, split
from echo2.broadcast.delta import MAGIC, BaseMismatch, apply, encode, read_header
from echo2.config import LearnerConfig
from echo2.learning.device import snapshot_state
from echo2.models import install_state, tied_names
from echo2.rollout.safetensors_view import SafetensorsView


def wire(model, dtype: str) -> bytes:
    """The snapshot as the learner publishes it (learning.sources.remote.serialise of snapshot_state)."""
    return save(snapshot_state(model, LearnerConfig(dtype=dtype)))


@torch.no_grad()
def perturb(model, kind: str, seed: int) -> None:
    """An update as a small-lr optimizer step makes it: every weight moved (random), or a few (sparse)."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        step = torch.randn(p.shape, generator=gen) * 1e-3 * p.abs().clamp_min(1e-3)
        if kind == "sparse":
            step *= torch.rand(p.shape, generator=gen) < 0.01
        p.add_(step)


def sha(b) -> str:
    return hashlib.sha256(b).hexdigest()


@pytest.fixture
def model(tiny):
    m = copy.deepcopy(tiny[0])
    assert tied_names(m), "the tiny model ties its LM head to the embedding"
    return m


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["random", "sparse", "none"])
def test_a_delta_on_its_base_gives_the_full_snapshot_bit_for_bit(model, dtype, kind):
    base = wire(model, dtype)
    if kind != "none":
        perturb(model, kind, seed=1)
    new = wire(model, dtype)
    delta = encode(base, new, base_version=3, version=4)
    out = apply(base, delta)
    assert bytes(out) == new and sha(out) == sha(new)
    header, _ = read_header(delta)
    assert (header.base_version, header.version, header.sha256, header.size) == (3, 4, sha(new), len(new))
    methods = {s.method for s in header.segments if s.name != "__header__"}
    if kind == "none":
        assert methods == {"same"}
    elif kind == "sparse":  # 1% of the elements: positions and values beat the whole XOR
        assert "sparse" in methods and "xor" not in methods and "raw" not in methods
    else:  # all changed: the dense XOR (sparse ties with it when every gap is 0)
        assert methods <= {"xor", "sparse", "same"} and ("xor" in methods or dtype == "bf16")
    if kind != "random":
        assert len(delta) < len(new) / 10
    # tied weights once: the delta names the tensors of the snapshot, which leaves the alias out
    names = {s.name for s in header.segments} - {"__header__"}
    assert names == set(SafetensorsView(new)) and not names & set(tied_names(model))
    target = copy.deepcopy(model)
    install_state(target, SafetensorsView(bytes(out)))
    assert target.lm_head.weight is target.get_input_embeddings().weight


def test_a_base_held_as_chunks_works_as_bytes_do(model):
    base = wire(model, "bf16")
    perturb(model, "sparse", seed=2)
    new = wire(model, "bf16")
    delta = encode(SnapshotBytes(split(base, 1000), 1000), new, base_version=0, version=1)
    assert bytes(apply(SnapshotBytes(split(base, 777), 777), delta)) == new


def test_new_reshaped_and_removed_tensors_and_other_dtypes_round_trip():
    gen = torch.Generator().manual_seed(0)
    base = save(
        {
            "a": torch.randn(10, 7, generator=gen),
            "b": torch.randn(4, generator=gen).to(torch.bfloat16),
            "gone": torch.randn(3, generator=gen),
            "steps": torch.arange(5, dtype=torch.int64),
            "empty": torch.zeros(0, 3),
        }
    )
    new_state = {
        "a": torch.randn(10, 7, generator=gen),  # every element changed
        "b": torch.randn(2, 2, generator=gen).to(torch.bfloat16),  # reshaped: no counterpart
        "new": torch.randn(6, generator=gen).half(),
        "steps": torch.arange(5, dtype=torch.int64) + (torch.arange(5) == 2),
        "empty": torch.zeros(0, 3),
        "flags": torch.tensor([True, False, True]),
    }
    new = save(new_state)
    delta = encode(base, new, base_version=0, version=1)
    assert bytes(apply(base, delta)) == new
    header, _ = read_header(delta)
    by_name = {s.name: s.method for s in header.segments}
    assert by_name["b"] == by_name["new"] == by_name["flags"] == "raw"
    assert by_name["empty"] == "same" and by_name["a"] in ("xor", "sparse")


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(0, 300),
    density=st.sampled_from([0.0, 0.001, 0.05, 0.5, 1.0]),
    dtype=st.sampled_from(["<f4", "<u2", "<f8", "u1"]),
)
def test_any_change_of_any_width_round_trips(seed, n, density, dtype):
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 256, size=n * np.dtype(dtype).itemsize, dtype=np.uint8).view(dtype)
    new = old.copy()
    mask = rng.random(n) < density
    new.view(np.uint8).reshape(n, old.itemsize)[mask] ^= rng.integers(
        1, 256, size=(int(mask.sum()), 1), dtype=np.uint8
    )
    as_torch = {"<f4": torch.float32, "<u2": torch.bfloat16, "<f8": torch.float64, "u1": torch.uint8}[dtype]

    def snap(a):
        return save(
            {
                "w": torch.frombuffer(bytearray(a.tobytes()), dtype=as_torch)
                if n
                else torch.zeros(0, dtype=as_torch)
            }
        )

    base_b, new_b = snap(old), snap(new)
    assert bytes(apply(base_b, encode(base_b, new_b, base_version=0, version=1))) == new_b


def test_a_wrong_base_is_refused_as_such(model):
    v0 = wire(model, "bf16")
    perturb(model, "sparse", seed=3)
    v1 = wire(model, "bf16")
    perturb(model, "sparse", seed=4)
    v2 = wire(model, "bf16")
    delta = encode(v1, v2, base_version=1, version=2)
    for wrong in (v0, v2, v1[:-1], b""):
        with pytest.raises(BaseMismatch, match="needs base"):
            apply(wrong, delta)
    wrong_size = bytearray(v1)
    wrong_size[-1] ^= 1  # same size, one bit off
    with pytest.raises(BaseMismatch):
        apply(bytes(wrong_size), delta)


@pytest.mark.parametrize("where", ["payload", "header_hash", "truncated", "magic"])
def test_a_tampered_delta_fails_its_checks(model, where):
    base = wire(model, "fp32")
    perturb(model, "random", seed=5)
    new = wire(model, "fp32")
    delta = bytearray(encode(base, new, base_version=0, version=1))
    header, payload_start = read_header(delta)
    if where == "payload":  # a bit of a changed tensor's compressed bytes
        segment = next(s for s in header.segments if s.method == "xor")
        delta[payload_start + (segment.payload[0] + segment.payload[1]) // 2] ^= 0x10
    elif where == "header_hash":  # a delta claiming another result
        at = bytes(delta).index(header.sha256.encode())
        delta[at] = ord("0") if delta[at] != ord("0") else ord("1")
    elif where == "truncated":
        del delta[-1]
    else:
        delta[:8] = b"\x00" * 8
    with pytest.raises(VerificationError) as e:
        apply(base, bytes(delta))
    assert not isinstance(e.value, BaseMismatch)


def test_no_byte_flip_in_a_small_delta_gives_wrong_bytes():
    """Each flip raises, or touches only what the bytes do not depend on (a version number, a
    name, the fields a `same` segment ignores): the result is then still the snapshot, by its
    hash. The versions a delta claims are checked against its signed manifest, not here."""
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(64, generator=gen)
    base = save({"w": a})
    new = save({"w": a + (torch.arange(64) % 9 == 0) * 1e-3})
    delta = encode(base, new, base_version=0, version=1)
    assert delta.startswith(MAGIC)
    caught = 0
    for i in range(len(delta)):
        bad = bytearray(delta)
        bad[i] ^= 0x01
        try:
            assert bytes(apply(base, bytes(bad))) == new
        except VerificationError:
            caught += 1
    assert caught > len(delta) * 0.9


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_worker_that_missed_versions_applies_the_deltas_in_turn(model, dtype):
    versions = [wire(model, dtype)]
    for v in range(1, 6):
        perturb(model, "sparse" if v % 2 else "random", seed=10 + v)
        versions.append(wire(model, dtype))
    deltas = [encode(versions[v], versions[v + 1], base_version=v, version=v + 1) for v in range(5)]
    held = versions[1]  # a worker on version 1 that missed 2..4
    for delta in deltas[1:]:
        held = apply(held, delta)
    assert bytes(held) == versions[5]
    # or one delta across them (kappa 4), the same bytes
    assert (
        bytes(apply(versions[1], encode(versions[1], versions[5], base_version=1, version=5))) == versions[5]
    )
    with pytest.raises(BaseMismatch):  # skipping one delta of the chain
        apply(apply(versions[0], deltas[0]), deltas[2])


def test_the_delta_is_the_same_bytes_on_any_number_of_threads(model):
    """Tensors are encoded and rebuilt on a thread pool (issue 42: the codec on all cores): the
    delta does not depend on the thread count, and every count rebuilds the snapshot, from bytes
    and from chunks; a count below 1 is refused."""
    v1 = wire(model, "bf16")
    perturb(model, "sparse", seed=5)
    v2 = wire(model, "bf16")
    deltas = {n: encode(v1, v2, base_version=1, version=2, threads=n) for n in (1, 2, 7)}
    assert deltas[1] == deltas[2] == deltas[7]
    chunks = SnapshotBytes(split(v1, 4096), 4096)
    for n in (1, 3):
        assert apply(v1, deltas[1], threads=n) == v2
        assert apply(chunks, deltas[1], threads=n) == v2
    with pytest.raises(ValueError, match="threads"):
        encode(v1, v2, base_version=1, version=2, threads=0)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_base_whose_digest_the_holder_gives_is_not_hashed_again(model, threads):
    """A worker holds its installed snapshot and the SHA-256 it took on receipt; `apply` then skips
    hashing the base (one of decode's two serial hash passes), and still refuses a delta whose base
    is another snapshot, before any work."""
    v1 = wire(model, "bf16")
    perturb(model, "sparse", seed=6)
    v2 = wire(model, "bf16")
    delta = encode(v1, v2, base_version=1, version=2)

    hashed = []

    class Held(SnapshotBytes):
        __slots__ = ()

        def sha256(self) -> str:
            hashed.append(self.known_sha256 is None)
            return super().sha256()

    held = Held(split(v1, 4096), 4096)
    assert apply(held, delta, threads=threads, base_sha256=sha(v1)) == v2
    assert hashed == [], "the given digest stands for the base's hash"
    with pytest.raises(BaseMismatch):
        apply(held, delta, threads=threads, base_sha256=sha(v2))
    assert apply(held, delta, threads=threads) == v2 and hashed == [True], "without it, hashed once"
    assert apply(held, delta, threads=threads) == v2 and hashed == [True], "then its kept digest"
    assert apply(v1, delta, threads=threads, base_sha256=sha(v1)) == v2, "plain bytes with a given digest"
    other = SnapshotBytes(split(v2, 4096), 4096)
    with pytest.raises(BaseMismatch, match="needs base"):
        apply(other, delta, threads=threads)
