"""The install file's digests (rollout/install_digest.py): what the worker takes while writing is
what the server takes reading, and it binds every byte, the block order and the size; the server
reads the file through a copy-on-write map."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
from safetensors.torch import save

from echo2.broadcast.chunks import SnapshotBytes
from echo2.rollout.install_digest import buffer_digest, combine, file_digest, write_hashed
from echo2.rollout.safetensors_view import SafetensorsView, mapped_file


def safetensors_bytes(n: int) -> bytes:
    return save({"a": torch.arange(float(n)), "b": torch.ones(3, dtype=torch.bfloat16)})


@pytest.mark.parametrize("chunk", [5, 64, 100, 10_000])
@pytest.mark.parametrize("n", [1, 16, 40])
def test_written_and_read_digests_agree(tmp_path, chunk, n):
    data = safetensors_bytes(n)
    held = SnapshotBytes([data[i : i + chunk] for i in range(0, len(data), chunk)], chunk)
    path = tmp_path / "f"
    full = write_hashed(path, len(data), held.views, block=64)
    assert path.read_bytes() == data
    assert full == file_digest(path, block=64, threads=3)
    assert full == combine(
        len(data), [hashlib.sha256(data[i : i + 64]).digest() for i in range(0, len(data), 64)]
    )
    assert full == buffer_digest(data, block=64)


def test_one_changed_byte_swapped_blocks_or_size_change_the_digest(tmp_path):
    data = bytearray(os.urandom(256))
    (tmp_path / "a").write_bytes(data)
    base = file_digest(tmp_path / "a", block=64)
    data[200] ^= 1
    (tmp_path / "b").write_bytes(data)
    (tmp_path / "c").write_bytes(data[64:128] + data[:64] + data[128:])
    (tmp_path / "d").write_bytes(data + b"\0")
    assert len({base} | {file_digest(tmp_path / n, block=64) for n in "bcd"}) == 4
    assert file_digest(tmp_path / "a", block=64) != file_digest(tmp_path / "a", block=128)


def test_a_mapped_install_file_gives_its_tensors_uncopied_and_copy_on_write(tmp_path):
    state = {
        "b": torch.arange(6.0).reshape(2, 3),
        "a": torch.ones(4, dtype=torch.bfloat16),
        "e": torch.ones(0),
    }
    (tmp_path / "f").write_bytes(save(state))
    data, tensors = mapped_file(str(tmp_path / "f"))
    assert buffer_digest(data) == file_digest(tmp_path / "f")
    assert list(tensors) == list(SafetensorsView(SnapshotBytes.of(save(state))))  # data order
    assert all(torch.equal(tensors[k], v) and tensors[k].dtype == v.dtype for k, v in state.items())
    tensors["b"][0, 0] = 99.0  # a loader writing to its source gets its own page
    assert (tmp_path / "f").read_bytes() == save(state)
    (tmp_path / "g").write_bytes(save(state)[:-4])
    with pytest.raises(ValueError, match="tensors end"):
        mapped_file(str(tmp_path / "g"))


def test_views_are_the_bytes_uncopied():
    data = bytes(range(50))
    held = SnapshotBytes([data[i : i + 7] for i in range(0, 50, 7)], 7)
    for a, b in [(0, 50), (3, 4), (6, 15), (49, 50), (20, 20)]:
        views = held.views(a, b)
        assert b"".join(bytes(v) for v in views) == data[a:b] == bytes(held.read(a, b))
        assert all(v.readonly for v in views)
    with pytest.raises(ValueError):
        held.views(10, 51)
