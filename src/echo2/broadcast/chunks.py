"""Snapshot wire format: fixed-size chunks, a manifest of their SHA-256 hashes, an Ed25519 signature.

The learner signs the manifest; relays are untrusted. A worker verifies the manifest against the
learner's public key before using it, and every chunk against the manifest before storing,
forwarding or installing it (docs/architecture.md, invariants). No I/O except the key file.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Literal

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

_DOMAIN = b"echo2-snapshot-manifest-v1\n"
"""Prefixed to the signed bytes so a manifest signature cannot be replayed as another message."""


class VerificationError(ValueError):
    """A manifest or chunk failed verification; the message says why."""


def split(data: bytes, chunk_size: int) -> list[bytes]:
    """Consecutive pieces of `chunk_size` bytes (the last may be shorter); no chunks for no data."""
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    return [data[i : i + chunk_size] for i in range(0, len(data), chunk_size)]


def sha256_hex(b: bytes | memoryview) -> str:
    return hashlib.sha256(b).hexdigest()


class SnapshotBytes:
    """A snapshot's bytes held as its consecutive chunks, never joined: `read` copies out one byte
    range, so a worker installs tensor by tensor from the chunks its relay holds anyway, with no
    second copy of the snapshot (rollout/safetensors_view.py). Holds the chunk objects by
    reference; whoever builds it vouches for them (`ChunkStore.snapshot`: every one verified)."""

    __slots__ = ("_chunks", "_chunk_size", "size", "_sha256")

    def __init__(self, chunks: list[bytes], chunk_size: int, *, sha256: str | None = None) -> None:
        """`sha256`: the bytes' SHA-256 when the builder has already checked it (a delta's rebuild);
        else taken on the first `sha256()` and kept (the chunks are never written to)."""
        if chunk_size <= 0 or any(len(c) != chunk_size for c in chunks[:-1]):
            raise ValueError("every chunk but the last must be chunk_size bytes")
        self._chunks, self._chunk_size = chunks, chunk_size
        self.size = sum(len(c) for c in chunks)
        self._sha256 = sha256

    @classmethod
    def of(cls, data: bytes) -> SnapshotBytes:
        """Bytes held whole (one chunk)."""
        return cls([data] if data else [], max(len(data), 1))

    def __len__(self) -> int:
        return self.size

    def read(self, start: int, end: int) -> bytearray:
        """A fresh, writable copy of bytes [start, end)."""
        pieces = self.views(start, end)
        out, at = bytearray(end - start), 0
        for piece in pieces:
            out[at : at + len(piece)] = piece
            at += len(piece)
        return out

    def views(self, start: int, end: int) -> list[memoryview]:
        """Bytes [start, end) as read-only views of the chunks that hold them (nothing copied)."""
        if not 0 <= start <= end <= self.size:
            raise ValueError(f"byte range [{start}, {end}) outside a snapshot of {self.size} bytes")
        out, at, c = [], start, self._chunk_size
        while at < end:
            index, offset = divmod(at, c)
            piece = memoryview(self._chunks[index]).toreadonly()[offset : offset + end - at]
            out.append(piece)
            at += len(piece)
        return out

    def sha256(self) -> str:
        """SHA-256 of the whole snapshot, fed chunk by chunk the first time, then kept."""
        if self._sha256 is None:
            h = hashlib.sha256()
            for chunk in self._chunks:
                h.update(chunk)
            self._sha256 = h.hexdigest()
        return self._sha256

    @property
    def known_sha256(self) -> str | None:
        """The SHA-256 if already taken or given, else None (nothing is hashed)."""
        return self._sha256

    def __bytes__(self) -> bytes:
        return b"".join(self._chunks)


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int = Field(ge=0)
    total_size: int = Field(ge=0)
    chunk_size: int = Field(gt=0)
    chunk_sha256: list[str]
    form: Literal["full", "delta"] = "full"
    """"full": the chunks are the snapshot. "delta": they are a delta (broadcast/delta.py) that
    rebuilds it on the snapshot of `base_version`."""
    base_version: int | None = Field(None, ge=0)
    """A delta's base version (null for a full snapshot)."""
    base_sha256: str | None = None
    """The SHA-256 of the base a delta applies to (null for a full snapshot)."""
    sha256: str | None = None
    """For a delta, the full snapshot's SHA-256: the install check of the rebuilt bytes."""
    signature: str = ""
    """Hex Ed25519 signature over `signed_bytes()`; empty before signing."""

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        expected = -(-self.total_size // self.chunk_size)
        if len(self.chunk_sha256) != expected:
            raise ValueError(
                f"chunk_sha256 lists {len(self.chunk_sha256)} hashes; "
                f"total_size {self.total_size} in chunks of {self.chunk_size} makes {expected}"
            )
        if not all(_is_hex64(h) for h in self.chunk_sha256):
            raise ValueError("chunk_sha256 entries must be 64 lowercase hex digits")
        delta = (self.base_version, self.base_sha256, self.sha256)
        if self.form == "full" and delta != (None, None, None):
            raise ValueError("a full snapshot's manifest names no base_version, base_sha256 or sha256")
        if self.form == "delta":
            if self.base_version is None or self.base_version >= self.version:
                raise ValueError("a delta's base_version must be an older version")
            if not all(_is_hex64(h) for h in (self.base_sha256, self.sha256)):
                raise ValueError("a delta's base_sha256 and sha256 must be 64 lowercase hex digits")
        return self

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_sha256)

    def chunk_range(self, index: int) -> tuple[int, int]:
        """[start, end) byte offsets of chunk `index` in the snapshot."""
        if not 0 <= index < self.num_chunks:
            raise IndexError(f"chunk {index} out of range 0..{self.num_chunks - 1}")
        start = index * self.chunk_size
        return start, min(start + self.chunk_size, self.total_size)

    def signed_bytes(self) -> bytes:
        """Canonical bytes of every field but the signature (sorted keys, compact JSON)."""
        body = self.model_dump(exclude={"signature"})
        return _DOMAIN + json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """Parse and validate; a malformed manifest raises VerificationError naming the field."""
        try:
            return cls.model_validate_json(text)
        except ValidationError as e:
            raise VerificationError(f"malformed manifest: {e}") from e


def _is_hex64(h: str | None) -> bool:
    return isinstance(h, str) and len(h) == 64 and not h.strip("0123456789abcdef")


def make_manifest(
    version: int, data: bytes, chunk_size: int, key: Ed25519PrivateKey, **delta: Any
) -> tuple[Manifest, list[bytes]]:
    """Split `data`, hash every chunk and sign the manifest with the learner's key. For a delta,
    `delta` gives form="delta", base_version, base_sha256 and sha256 (the full snapshot's)."""
    chunks = split(data, chunk_size)
    unsigned = Manifest(
        version=version,
        total_size=len(data),
        chunk_size=chunk_size,
        chunk_sha256=[sha256_hex(c) for c in chunks],
        **delta,
    )
    signature = key.sign(unsigned.signed_bytes()).hex()
    return unsigned.model_copy(update={"signature": signature}), chunks


def verify_manifest(manifest: Manifest, public_key: Ed25519PublicKey | str) -> None:
    """Raise VerificationError unless the learner's key signed exactly these fields."""
    key = load_public_key(public_key) if isinstance(public_key, str) else public_key
    if not manifest.signature:
        raise VerificationError(f"manifest for version {manifest.version} is not signed")
    try:
        signature = bytes.fromhex(manifest.signature)
    except ValueError as e:
        raise VerificationError("manifest signature is not hex") from e
    try:
        key.verify(signature, manifest.signed_bytes())
    except InvalidSignature as e:
        raise VerificationError(
            f"bad signature on the manifest for version {manifest.version}: "
            "altered, or not signed by the learner's key"
        ) from e


def verify_chunk(manifest: Manifest, index: int, data: bytes | memoryview) -> bool:
    """Whether `data` is chunk `index` of the snapshot: right length and SHA-256."""
    if not 0 <= index < manifest.num_chunks:
        return False
    start, end = manifest.chunk_range(index)
    return len(data) == end - start and sha256_hex(data) == manifest.chunk_sha256[index]


def load_or_create_key(path: str | Path) -> Ed25519PrivateKey:
    """The learner's signing key: read from PEM at `path`, or generated and saved there (mode
    0600, never overwriting a key another process saved first) and reused afterwards."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        pem = Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, pem)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # atomic and no-clobber: a concurrent creator's key wins
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path} holds a {type(key).__name__}, not an Ed25519 private key")
    return key


def public_key_hex(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """The raw 32-byte public key in hex (what workers are configured with)."""
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()


def load_public_key(hex_key: str) -> Ed25519PublicKey:
    try:
        raw = bytes.fromhex(hex_key)
    except ValueError as e:
        raise ValueError("public key is not hex") from e
    if len(raw) != 32:
        raise ValueError(f"an Ed25519 public key is 32 bytes, got {len(raw)}")
    return Ed25519PublicKey.from_public_bytes(raw)


def manifest_of(data: Any, version: int, public_key: str, form: str = "full") -> Manifest:
    """The manifest of `version` in `form`, its shape and its signature checked (VerificationError
    if not)."""
    try:
        manifest = Manifest.model_validate(data)
    except ValidationError as e:
        raise VerificationError(f"malformed manifest for version {version}: {e}") from None
    verify_manifest(manifest, public_key)
    if manifest.version != version:
        raise VerificationError(f"asked for version {version}, got a manifest for {manifest.version}")
    if manifest.form != form:
        raise VerificationError(f"asked for the {form} form of version {version}, got a {manifest.form} one")
    return manifest
