"""A base snapshot and a realistic successor for the broadcast benchmark's delta runs (issue 24):
safetensors bytes of a small transformer-shaped set of bf16 tensors (pure numpy, no torch), and a
successor with a fraction of the elements moved by one ulp at random places, which is what an RL
step at a small learning rate does to bf16 weights (docs/benchmarks.md, "Delta snapshots": at lr
1e-6 a median 0.64% of the elements change per step, and the delta is 0.66% of the full snapshot).

`pair(nbytes, fraction, seed)` gives (base, successor); `delta_ratio` measures what the codec
(broadcast/delta.py, the publisher's own) makes of a pair; `calibrate` finds the fraction whose
delta is a given share of the full snapshot, by bisection on the codec's own measurement (the
changed elements of a smaller fraction are a prefix of a larger one's, so the ratio grows with it).
"""

from __future__ import annotations

import json
import math
import struct
import time

import numpy as np

BF16_BYTES = 2


def layout(nbytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of bf16 tensors filling about `nbytes` (within one embedding row): a width d
    (a power of two), as many layers (q, k, v, o: d x d; gate, up: 2d x d; down: d x 2d; two norms)
    as fit in 4/5 of it, a final norm, and an embedding of the rows left."""
    elements = max(1, nbytes // BF16_BYTES)
    d = max(8, 2 ** int(math.log2(max(1.0, math.sqrt(elements / 24)))))
    per_layer = 10 * d * d + 2 * d
    layers = max(1, int(0.8 * elements) // per_layer)
    rows = max(1, (elements - layers * per_layer - d) // d)
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (rows, d))]
    for i in range(layers):
        p = f"model.layers.{i}"
        out += [(f"{p}.self_attn.{x}_proj.weight", (d, d)) for x in "qkvo"]
        out += [(f"{p}.mlp.gate_proj.weight", (2 * d, d)), (f"{p}.mlp.up_proj.weight", (2 * d, d))]
        out += [(f"{p}.mlp.down_proj.weight", (d, 2 * d))]
        out += [(f"{p}.input_layernorm.weight", (d,)), (f"{p}.post_attention_layernorm.weight", (d,))]
    out.append(("model.norm.weight", (d,)))
    return out


def safetensors_bytes(shapes: list[tuple[str, tuple[int, ...]]], flat: np.ndarray) -> bytes:
    """Safetensors bytes of the bf16 tensors `shapes`, whose elements are `flat` (uint16 bit
    patterns) in that order; the header padded to 8 bytes, as safetensors writes it."""
    header, at = {}, 0
    for name, shape in shapes:
        n = math.prod(shape) * BF16_BYTES
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    if at != flat.size * BF16_BYTES:
        raise ValueError(f"{flat.size} elements for a layout of {at // BF16_BYTES}")
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + flat.astype("<u2").tobytes()


class Pair:
    """The base of a seed and its successors: the base's weights (bf16 of N(0, 0.02), norms near 1),
    and one random order of the elements with a direction (+-1 ulp) for each."""

    def __init__(self, nbytes: int, seed: int = 0) -> None:
        self.shapes = layout(nbytes)
        rng = np.random.default_rng(seed)
        parts = []
        for name, shape in self.shapes:
            n = math.prod(shape)
            w = rng.normal(1.0, 0.02, n) if name.endswith("norm.weight") else rng.normal(0.0, 0.02, n)
            bits = w.astype(np.float32).view(np.uint32)  # to bf16, rounding to nearest even:
            parts.append(((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16))
        self.weights = np.concatenate(parts)
        self.order = rng.permutation(self.weights.size)
        step = np.where(rng.random(self.weights.size) < 0.5, 1, -1).astype(np.int32)
        # one ulp in magnitude, never through zero (a bf16 of +-0 only moves up)
        step[(self.weights[self.order] & 0x7FFF) == 0] = 1
        self.moved = (self.weights[self.order].astype(np.int32) + step).astype(np.uint16)
        self.base = safetensors_bytes(self.shapes, self.weights)

    def successor(self, fraction: float) -> bytes:
        """The base with the first `fraction` of the elements (in this pair's random order) moved."""
        if not 0 <= fraction <= 1:
            raise ValueError(f"changed fraction: must be in [0, 1] (got {fraction})")
        k = int(round(fraction * self.weights.size))
        w = self.weights.copy()
        w[self.order[:k]] = self.moved[:k]
        return safetensors_bytes(self.shapes, w)


def pair(nbytes: int, fraction: float, seed: int = 0) -> tuple[bytes, bytes]:
    """(base, successor) of about `nbytes` each, `fraction` of the successor's elements changed."""
    p = Pair(nbytes, seed)
    return p.base, p.successor(fraction)


def delta_ratio(base: bytes, new: bytes) -> dict[str, float | int]:
    """What the publisher's codec makes of the pair: delta bytes, full bytes, their ratio, encode
    seconds (wall) and how many tensors each method stored."""
    from echo2.broadcast.delta import encode, read_header

    t0 = time.perf_counter()
    delta = encode(base, new, base_version=0, version=1)
    t1 = time.perf_counter()
    header, _ = read_header(delta)
    methods: dict[str, int] = {}
    for s in header.segments:
        methods[s.method] = methods.get(s.method, 0) + 1
    return {
        "delta_bytes": len(delta),
        "full_bytes": len(new),
        "ratio": len(delta) / len(new),
        "encode_s": t1 - t0,
        "methods": methods,
    }


def calibrate(nbytes: int, target: float, seed: int = 0, iters: int = 20) -> tuple[float, dict]:
    """The changed fraction whose delta is closest to `target` x the full snapshot (bisection on
    the codec's measurement), and that measurement."""
    if not 0 < target < 1:
        raise ValueError(f"delta ratio: must be in (0, 1) (got {target})")
    p = Pair(nbytes, seed)
    lo, hi = 0.0, 0.5
    best: tuple[float, dict] | None = None
    for _ in range(iters):
        mid = (lo + hi) / 2
        got = delta_ratio(p.base, p.successor(mid))
        if best is None or abs(got["ratio"] - target) < abs(best[1]["ratio"] - target):
            best = (mid, got)
        lo, hi = (mid, hi) if got["ratio"] < target else (lo, mid)
    assert best is not None
    return best
