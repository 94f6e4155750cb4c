"""A snapshot as the learner keeps and serves it: its bytes, their SHA-256, the manifest signed by
the learner's key, and one view per chunk into the bytes (no copy). The publisher keeps one per
kept version (coordinator/publisher.py); the broadcast bookkeeping plans who receives it
(broadcast/tracker.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from echo2.broadcast.chunks import Manifest, make_manifest


class NotKept(KeyError):
    """The version is not (or no longer) kept."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotBlob:
    version: int
    data: bytes
    sha256: str
    manifest: Manifest
    """Signed by the learner's key."""
    chunks: list[memoryview]
    """Views into `data`, one per manifest entry."""


def make_blob(version: int, data: bytes, chunk_size: int, key: Ed25519PrivateKey) -> SnapshotBlob:
    """Hash, cut and sign a snapshot (no copy of the bytes)."""
    manifest, chunks = make_manifest(version, memoryview(data), chunk_size, key)
    return SnapshotBlob(
        version=version, data=data, sha256=hashlib.sha256(data).hexdigest(), manifest=manifest, chunks=chunks
    )
