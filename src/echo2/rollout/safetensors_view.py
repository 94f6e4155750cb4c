"""A received snapshot read one tensor at a time: a lazy mapping over the safetensors bytes.

`safetensors.torch.load(bytes)` copies every tensor out of the bytes at once (safetensors/torch.py:
`deserialize`, then `_view2torch`), so a worker installing that way holds the snapshot two or three
times (its relay's chunks, the joined bytes, the tensors). `SafetensorsView` parses only the
header, then copies each tensor out of the verified chunks when it is looked up
(`broadcast.chunks.SnapshotBytes.read`): an engine copying parameter by parameter holds one
tensor beyond its own weights. `safe_open` reads only from a file; writing one would add a copy
in the page cache (mapped pages count as resident) and disk I/O, for bytes already in memory.

The header is checked as safetensors checks it (safetensors/src/tensor.rs `Metadata::validate`):
at most 100 MB, tensors contiguous from offset 0 in offset order, each exactly numel × itemsize
bytes, the data ending where the snapshot ends; a malformed one raises ValueError. Little-endian
only, as safetensors writes it. Knows nothing of engines, versions or the network.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from collections.abc import Iterator, Mapping

import torch

from echo2.broadcast.chunks import SnapshotBytes

MAX_HEADER = 100_000_000
"""safetensors' own limit on the JSON header (MAX_HEADER_SIZE)."""
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""safetensors dtype names (safetensors/torch.py `_TYPES`) of the dtypes a snapshot can hold."""


class SafetensorsView(Mapping[str, torch.Tensor]):
    """name -> tensor of a safetensors file held as `SnapshotBytes` (or bytes). Iterates in the
    file's data order (a layer's weights together, as vLLM's layerwise reload wants them); each
    lookup returns a new tensor that owns its memory. `shapes` needs no tensor read."""

    def __init__(self, data: SnapshotBytes | bytes) -> None:
        if sys.byteorder != "little":
            raise ValueError("snapshot: safetensors data is little-endian; this machine is not")
        self.data = data if isinstance(data, SnapshotBytes) else SnapshotBytes.of(data)
        size = len(self.data)
        if size < 8:
            raise ValueError(f"snapshot: {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", self.data.read(0, 8))
        if n > MAX_HEADER or 8 + n > size:
            raise ValueError(f"snapshot: header of {n} bytes in a file of {size}")
        try:
            header = json.loads(self.data.read(8, 8 + n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"snapshot: header is not JSON: {e}") from None
        if not isinstance(header, dict):
            raise ValueError("snapshot: header is not a JSON object")
        header.pop("__metadata__", None)
        self._entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        at = 0
        for name, info in sorted(header.items(), key=lambda kv: _offsets(kv[0], kv[1])):
            begin, end = _offsets(name, info)
            dtype, shape = DTYPES.get(info.get("dtype")), info.get("shape")
            if dtype is None or not isinstance(shape, list) or not all(_natural(d) for d in shape):
                raise ValueError(f"snapshot: {name}: dtype {info.get('dtype')!r}, shape {shape!r}")
            if begin != at or end - begin != math.prod(shape) * dtype.itemsize:
                raise ValueError(f"snapshot: {name}: bytes [{begin}, {end}) do not fit its shape")
            self._entries[name] = (dtype, tuple(shape), 8 + n + begin, 8 + n + end)
            at = end
        if 8 + n + at != size:
            raise ValueError(f"snapshot: tensors end at byte {8 + n + at} of {size}")
        self.shapes = {name: entry[1] for name, entry in self._entries.items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        dtype, shape, begin, end = self._entries[name]
        if begin == end:
            return torch.empty(shape, dtype=dtype)  # frombuffer refuses an empty buffer
        return torch.frombuffer(self.data.read(begin, end), dtype=dtype).reshape(shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def _natural(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _offsets(name: str, info) -> tuple[int, int]:
    offsets = info.get("data_offsets") if isinstance(info, dict) else None
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_natural(x) for x in offsets)):
        raise ValueError(f"snapshot: {name}: data_offsets {offsets!r}")
    begin, end = offsets
    if end < begin:
        raise ValueError(f"snapshot: {name}: data_offsets {offsets!r}")
    return begin, end


def mapped_file(path: str) -> tuple[memoryview, dict[str, torch.Tensor]]:
    """The safetensors file at `path` mapped copy-on-write (private and writable: a loader that
    writes to a tensor gets its own page; the file never changes) and name -> tensor views of its
    pages, in the file's data order, nothing copied (the server engine's install,
    rollout/vllm_ext.py: vLLM's loader makes the one copy, into its parameters). The header is
    checked as `SafetensorsView` checks it. The map lives while the bytes or a tensor does."""
    import mmap

    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < 8:
            raise ValueError(f"{path}: too short for a safetensors header")
        mapped = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    data = memoryview(mapped)
    parsed = SafetensorsView(SnapshotBytes.of(data))
    whole = torch.frombuffer(mapped, dtype=torch.uint8)
    tensors = {}
    for name, (dtype, shape, begin, end) in parsed._entries.items():
        raw = whole[begin:end]
        if begin % dtype.itemsize:  # unaligned: a copy (safetensors writers align every tensor)
            raw = raw.clone()
        tensors[name] = raw.view(dtype).reshape(shape)
    return data, tensors
