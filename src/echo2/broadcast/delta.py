"""Delta snapshots: the bytes of published version v+k given those of version v, losslessly.

A snapshot on the wire is a safetensors file in the wire dtype (fp32 or bf16;
`learning.sources.remote.serialise`), each weight once: tied aliases are left out (`models.tied_names`), so a delta, which
is taken over those bytes, also carries every tied weight once. `encode` pairs each tensor of the
new snapshot with the same name, dtype and shape in the base and stores, per tensor, whichever of
these is smallest, by measurement:

- `same`: the tensor's bytes did not change (nothing stored);
- `xor`: new XOR base over the whole tensor, its bytes split into planes (every element's byte 0,
  then every byte 1, ...) and compressed with zstd. Weights that moved by a few ulps keep their
  sign and exponent, so the high planes are zeros and compress to almost nothing;
- `sparse`: the positions of the elements that changed (gaps between them, uint32) and their XOR
  values, both split into planes, in one zstd frame. Small at low learning rates in bf16, where
  most elements do not change at all; tried only when at most `SPARSE_MAX` of them changed;
- `raw`: the new bytes, split into planes and compressed (a tensor, or the safetensors header,
  with no counterpart in the base).

Wire layout: `MAGIC`, the header length (u64, little-endian), the header (`DeltaHeader` as JSON),
then the payloads. The header names the base by its SHA-256 and the result by its SHA-256 (the
full snapshot's hash): `apply` refuses a base with another hash (`BaseMismatch`, so the caller
fetches the full snapshot instead) and any delta whose result hashes differently
(`VerificationError`). A delta is one byte string, so it is chunked, hashed and signed exactly like
a full snapshot (`chunks.make_manifest`); the signature over its chunks covers the header, and so
the result's hash.

Pure: no I/O, no torch (numpy, zstandard), tensors coded on `threads` threads; knows nothing of
versions beyond the two it records, of workers or of the network. `apply(base, encode(base, new,
...))` returns `new` bit for bit, or raises.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import numpy as np
import zstandard
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from echo2.broadcast.chunks import SnapshotBytes, VerificationError

MAGIC = b"echo2\x00d1"  # first 8 bytes of a delta (a full snapshot starts with its header length)
MAX_HEADER = 100_000_000  # largest delta header accepted, as safetensors limits its own
LEVEL = 1
"""zstd level. Measured on SmolLM2-135M deltas (docs/benchmarks.md, "Delta snapshots"): level 1
compresses them as small as level 3, or smaller, 1.1-1.5 times faster."""
SPARSE_MAX = 0.5  # largest fraction of a tensor's elements changed for which sparse is tried
WIDTHS = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
"""Bytes per element of the safetensors dtypes a snapshot can hold (rollout/safetensors_view.py)."""

Method = Literal["same", "xor", "sparse", "raw"]
Buffer = bytes | bytearray | memoryview | SnapshotBytes  # whole, or the verified chunks a worker holds


class BaseMismatch(VerificationError):
    """The base offered is not the one the delta was taken against: fetch the full snapshot."""


class Segment(BaseModel):
    """Bytes [start, end) of the new snapshot: one tensor, or the safetensors header."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    """The tensor's name; "__header__" for the safetensors header."""
    method: Method
    start: int = Field(ge=0)
    end: int = Field(ge=0)
    width: Literal[1, 2, 4, 8]
    """Bytes per element: the unit of XOR, of the sparse form's positions and of the planes."""
    base_start: int = Field(default=0, ge=0)
    """Where the same bytes start in the base (same, xor, sparse); the length is end - start."""
    count: int = Field(default=0, ge=0)
    """Elements that changed (sparse)."""
    payload: tuple[int, int] = (0, 0)
    """[begin, end) of the compressed payload, from the end of the header; empty for `same`."""

    @model_validator(mode="after")
    def _shape(self) -> Segment:
        if self.end < self.start or (self.end - self.start) % self.width:
            raise ValueError(f"{self.name}: [{self.start}, {self.end}) is not whole elements of {self.width}")
        if not 0 <= self.payload[0] <= self.payload[1]:
            raise ValueError(f"{self.name}: payload {self.payload}")
        if self.count > (self.end - self.start) // self.width:
            raise ValueError(
                f"{self.name}: {self.count} changes in {(self.end - self.start) // self.width} elements"
            )
        return self


class DeltaHeader(BaseModel):
    """What a delta turns into what: the base and the result by version, size and SHA-256, and the
    segments that tile the result in order."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["echo2-delta-v1"] = "echo2-delta-v1"
    base_version: int = Field(ge=0)
    version: int = Field(ge=0)
    base_size: int = Field(ge=0)
    base_sha256: str = Field(pattern="^[0-9a-f]{64}$")
    size: int = Field(ge=0)
    sha256: str = Field(pattern="^[0-9a-f]{64}$")
    """The full snapshot's hash: what a worker applying the delta must end on."""
    segments: list[Segment]

    @model_validator(mode="after")
    def _tiles(self) -> DeltaHeader:
        at = 0
        for s in self.segments:
            if s.start != at:
                raise ValueError(f"{s.name}: starts at {s.start}, the previous segment ends at {at}")
            if s.method != "raw" and s.base_start + s.end - s.start > self.base_size:
                raise ValueError(f"{s.name}: base bytes beyond the base's {self.base_size}")
            at = s.end
        if at != self.size:
            raise ValueError(f"segments end at {at}, the snapshot at {self.size}")
        return self


def encode(
    base: Buffer,
    new: Buffer,
    *,
    base_version: int,
    version: int,
    level: int = LEVEL,
    threads: int | None = None,
) -> bytes:
    """The delta that turns snapshot `base` (version `base_version`) into `new` (`version`). Both
    are safetensors bytes as the learner publishes them; ValueError if either does not parse.
    Tensors are encoded on `threads` threads (default: every core; numpy's array work, zstd and
    SHA-256 release the GIL), the result the same bytes whatever the count."""
    base_b, new_b = _whole(base), _whole(new)
    base_u8, new_u8 = np.frombuffer(base_b, np.uint8), np.frombuffer(new_b, np.uint8)
    base_layout = {name: (dtype, shape, b, e) for name, dtype, shape, b, e in _layout(base_b)}
    layout = _layout(new_b)
    header_end = layout[0][3] if layout else len(new_b)
    base_header_end = min((b for _, _, b, _ in base_layout.values()), default=len(base_b))
    parts: list[tuple[str, int, int, int, int | None]] = [
        ("__header__", 0, header_end, 1, 0 if base_header_end == header_end else None)
    ]
    for name, dtype, shape, begin, end in layout:  # contiguous from header_end (`_layout`)
        match = base_layout.get(name)
        paired = match is not None and match[:2] == (dtype, shape)
        parts.append((name, begin, end, WIDTHS[dtype], match[2] if paired else None))
    local = threading.local()

    def one(part: tuple[str, int, int, int, int | None]) -> tuple[Method, int, bytes]:
        _name, start, end, width, base_start = part
        if not hasattr(local, "compressor"):  # a ZstdCompressor is used by one thread at a time
            local.compressor = zstandard.ZstdCompressor(level=level)
        new_part = new_u8[start:end]
        if base_start is None:
            return "raw", 0, local.compressor.compress(_planes(new_part, width))
        return _smallest(new_part, base_u8[base_start : base_start + end - start], width, local.compressor)

    with ThreadPoolExecutor(max_workers=_threads(threads, len(parts))) as pool:
        base_hash = pool.submit(lambda: hashlib.sha256(base_b).hexdigest())
        new_hash = pool.submit(lambda: hashlib.sha256(new_b).hexdigest())
        encoded = list(pool.map(one, parts))
        hashes = base_hash.result(), new_hash.result()
    segments: list[Segment] = []
    at = 0
    for (name, start, end, width, base_start), (method, count, blob) in zip(parts, encoded, strict=True):
        segments.append(
            Segment(
                name=name,
                method=method,
                start=start,
                end=end,
                width=width,
                base_start=base_start or 0,
                count=count,
                payload=(at, at + len(blob)),
            )
        )
        at += len(blob)
    header = DeltaHeader(
        base_version=base_version,
        version=version,
        base_size=len(base_b),
        base_sha256=hashes[0],
        size=len(new_b),
        sha256=hashes[1],
        segments=segments,
    )
    text = header.model_dump_json().encode()
    return b"".join([MAGIC, struct.pack("<Q", len(text)), text, *(blob for _, _, blob in encoded)])


def _check_base(header: DeltaHeader, base_hash: str, size: int) -> None:
    """BaseMismatch unless the offered base (its hash and size) is the delta's."""
    if base_hash != header.base_sha256:
        raise BaseMismatch(
            f"delta {header.base_version} -> {header.version} needs base {header.base_sha256[:12]}, "
            f"offered {base_hash[:12]} ({size} bytes)"
        )


def _threads(threads: int | None, tasks: int) -> int:
    """Threads for `tasks` independent tensors: `threads`, default every core, at most `tasks`."""
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be at least 1 (got {threads})")
    return max(1, min(threads or os.cpu_count() or 1, tasks))


def read_header(delta: bytes | bytearray | memoryview) -> tuple[DeltaHeader, int]:
    """The validated header of `delta` and where its payloads start; VerificationError if the
    delta is malformed (it comes from the network)."""
    delta = memoryview(delta)
    if len(delta) < 16 or bytes(delta[:8]) != MAGIC:
        raise VerificationError("not a delta snapshot (no magic)")
    (n,) = struct.unpack("<Q", delta[8:16])
    if n > MAX_HEADER or 16 + n > len(delta):
        raise VerificationError(f"delta header of {n} bytes in a delta of {len(delta)}")
    try:
        header = DeltaHeader.model_validate_json(bytes(delta[16 : 16 + n]))
    except ValidationError as e:
        raise VerificationError(f"malformed delta header: {e}") from None
    payload_size = len(delta) - 16 - n
    if any(s.payload[1] > payload_size for s in header.segments):
        raise VerificationError("a delta segment's payload runs past the end of the delta")
    return header, 16 + n


def apply(
    base: Buffer,
    delta: bytes | bytearray | memoryview,
    *,
    threads: int | None = None,
    base_sha256: str | None = None,
) -> bytearray:
    """The snapshot `delta` encodes, rebuilt on `base`: bit for bit the full snapshot, its SHA-256
    checked against the header. `BaseMismatch` if `base` is not the delta's base (fetch the full
    snapshot); VerificationError if the delta is malformed or tampered with. Segments are rebuilt
    on `threads` threads (default: every core), each into its own bytes of the result.

    `base_sha256`: the base's SHA-256 as its holder took it when the base was verified; the base is
    then not hashed again, and whoever passes it vouches that `base` has not changed since. A base
    held as `SnapshotBytes` gives its own `known_sha256` (a worker's installed snapshot was hashed
    on receipt, rollout/broadcast_client.py). Hashing the base was one of decode's two serial
    SHA-256 streams (docs/benchmarks.md)."""
    header, payload_start = read_header(delta)
    if len(base) != header.base_size:
        raise BaseMismatch(
            f"delta {header.version} needs base {header.base_sha256[:12]} ({header.base_size} bytes)"
        )
    base_u8 = None if isinstance(base, SnapshotBytes) else np.frombuffer(base, np.uint8)
    payloads = memoryview(delta)[payload_start:]
    out = bytearray(header.size)
    out_u8 = np.frombuffer(out, np.uint8)
    local = threading.local()

    def one(s: Segment) -> None:
        if not hasattr(local, "decompressor"):  # one ZstdDecompressor per thread
            local.decompressor = zstandard.ZstdDecompressor()
        decompressor = local.decompressor
        length, dest = s.end - s.start, out_u8[s.start : s.end]
        if s.method == "raw":
            blob = payloads[s.payload[0] : s.payload[1]]
            _unplanes(_decompress(decompressor, blob, length, s.name), s.width, out=dest)
            return
        src = (
            base_u8[s.base_start : s.base_start + length]
            if base_u8 is not None
            else np.frombuffer(base.read(s.base_start, s.base_start + length), np.uint8)
        )
        if s.method == "same":
            dest[:] = src
            return
        blob = payloads[s.payload[0] : s.payload[1]]
        if s.method == "xor":
            np.bitwise_xor(src, _unplanes(_decompress(decompressor, blob, length, s.name), s.width), out=dest)
            return
        dest[:] = src
        raw = _decompress(decompressor, blob, s.count * (4 + s.width), s.name)
        gaps = _unplanes(raw[: 4 * s.count], 4).view("<u4").astype(np.int64)
        positions = np.cumsum(gaps + 1) - 1
        if s.count and positions[-1] >= length // s.width:
            raise VerificationError(f"delta segment {s.name}: a change past the tensor's end")
        values = _unplanes(raw[4 * s.count :], s.width).view(f"<u{s.width}")
        dest.view(f"<u{s.width}")[positions] ^= values

    def hash_base() -> str:
        return base.sha256() if isinstance(base, SnapshotBytes) else hashlib.sha256(base).hexdigest()

    n = _threads(threads, len(header.segments))
    if base_sha256 is None and isinstance(base, SnapshotBytes):
        base_sha256 = base.known_sha256
    if base_sha256 is not None:  # known: checked before any work
        _check_base(header, base_sha256, len(base))
    if n == 1:  # one core: the base checked first, then each segment, then the result hashed
        if base_sha256 is None:
            _check_base(header, hash_base(), len(base))
        for s in header.segments:
            one(s)
        got = hashlib.sha256(out).hexdigest()
    else:  # the base's hash and the segments on the pool; the result hashed here in order as they finish
        digest = hashlib.sha256()
        view = memoryview(out)
        with ThreadPoolExecutor(max_workers=n) as pool:
            base_hash = pool.submit(hash_base) if base_sha256 is None else None
            for s, done in [(s, pool.submit(one, s)) for s in header.segments]:
                done.result()  # the first segment's error, in the header's order
                digest.update(view[s.start : s.end])  # segments are contiguous from 0 (DeltaHeader)
            if base_hash is not None:
                _check_base(header, base_hash.result(), len(base))  # a mismatch discards the result
        got = digest.hexdigest()
    if got != header.sha256:
        raise VerificationError(
            f"delta {header.base_version} -> {header.version} rebuilt bytes hashing {got[:12]}, "
            f"not the snapshot's {header.sha256[:12]}: the delta was altered"
        )
    return out


def _smallest(new: np.ndarray, base: np.ndarray, width: int, compressor) -> tuple[Method, int, bytes]:
    """`same`, or whichever of `xor` and `sparse` compresses smaller: (method, changes, payload).
    The sparse form is tried only up to `SPARSE_MAX` of the elements changed: beyond, its
    positions cost more than the XOR's zeros (bf16 weights changed by one ulp at random places:
    the two sizes cross at about half of them changed), and building it is the slow part."""
    xor = np.bitwise_xor(new.view(f"<u{width}"), base.view(f"<u{width}"))
    count = int(np.count_nonzero(xor))
    if count == 0:
        return "same", 0, b""
    dense = compressor.compress(_planes(xor.view(np.uint8), width))
    if count > SPARSE_MAX * xor.size or xor.size >= 2**32:  # positions are uint32 gaps
        return "xor", 0, dense
    changed = np.flatnonzero(xor)
    gaps = np.diff(changed, prepend=-1) - 1
    sparse = compressor.compress(
        np.concatenate(
            [_planes(gaps.astype("<u4").view(np.uint8), 4), _planes(xor[changed].view(np.uint8), width)]
        )
    )
    if len(sparse) < len(dense):
        return "sparse", count, sparse
    return "xor", 0, dense


def _planes(u8: np.ndarray, width: int) -> np.ndarray:
    """Bytes of elements of `width` bytes regrouped by byte position: every element's byte 0, then
    every byte 1, ... (the high planes of small changes are zeros, which compress well). One
    strided copy per plane: several times faster than a transposed copy."""
    if width == 1:
        return u8
    out = np.empty(u8.size, np.uint8)
    n = u8.size // width
    for i in range(width):
        out[i * n : (i + 1) * n] = u8[i::width]
    return out


def _unplanes(u8: np.ndarray, width: int, out: np.ndarray | None = None) -> np.ndarray:
    """The inverse of `_planes`, into `out` if given, else into a new array (width 1: `u8` itself)."""
    if out is None:
        if width == 1:
            return u8
        out = np.empty(u8.size, np.uint8)
    n = u8.size // width
    for i in range(width):
        out[i::width] = u8[i * n : (i + 1) * n]
    return out


def _decompress(decompressor, blob: memoryview, size: int, name: str) -> np.ndarray:
    """A payload that must decompress to exactly `size` bytes; the frame's declared size is
    checked first, so a tampered one cannot make this allocate more."""
    try:
        declared = zstandard.frame_content_size(blob)
        if declared != size:
            raise VerificationError(f"delta segment {name}: payload declares {declared} bytes, not {size}")
        raw = decompressor.decompress(blob, max_output_size=size)
    except zstandard.ZstdError as e:
        raise VerificationError(f"delta segment {name}: payload does not decompress: {e}") from None
    if len(raw) != size:
        raise VerificationError(f"delta segment {name}: payload gives {len(raw)} bytes, not {size}")
    return np.frombuffer(raw, np.uint8)


def _whole(data: Buffer) -> bytes | bytearray | memoryview:
    return bytes(data) if isinstance(data, SnapshotBytes) else data


def _layout(data: bytes | bytearray | memoryview) -> list[tuple[str, str, tuple[int, ...], int, int]]:
    """(name, dtype, shape, begin, end) of each tensor of safetensors bytes in data order, offsets
    from the start of the file. The encoder reads only the learner's own bytes; a malformed file
    is a ValueError all the same."""
    view = memoryview(data)
    if len(view) < 8:
        raise ValueError(f"snapshot: {len(view)} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", view[:8])
    if n > MAX_HEADER or 8 + n > len(view):
        raise ValueError(f"snapshot: header of {n} bytes in a file of {len(view)}")
    header = json.loads(bytes(view[8 : 8 + n]))
    header.pop("__metadata__", None)
    entries = []
    for name, info in header.items():
        begin, end = info["data_offsets"]
        if info["dtype"] not in WIDTHS:
            raise ValueError(f"snapshot: {name}: dtype {info['dtype']!r}")
        entries.append((name, info["dtype"], tuple(info["shape"]), 8 + n + begin, 8 + n + end))
    entries.sort(key=lambda e: e[3])
    at = 8 + n
    for name, _, _, begin, end in entries:
        if begin != at or end < begin:
            raise ValueError(f"snapshot: {name}: bytes [{begin}, {end}) are not contiguous")
        at = end
    if at != len(view):
        raise ValueError(f"snapshot: tensors end at byte {at} of {len(view)}")
    return entries
