"""Snapshot chunks, signed manifests and the learner's key file."""

from __future__ import annotations

import json
import stat

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from echo2.broadcast import chunks as ck
from echo2.broadcast.chunks import Manifest, VerificationError
from echo2.broadcast.relay import ChunkStore

DATA = bytes(range(256)) * 40 + b"tail"  # 10_244 bytes: 11 chunks of 1000, the last of 244


def store_with(manifest: Manifest, chunks: dict[int, bytes]) -> ChunkStore:
    """A worker's chunk store holding `manifest` and whichever of `chunks` it accepts."""
    store = ChunkStore()
    store.add_manifest(manifest)
    for i, data in chunks.items():
        store.put(manifest.version, i, data)
    return store


@pytest.fixture(scope="module")
def key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


@pytest.fixture(scope="module")
def signed(key):
    return ck.make_manifest(7, DATA, 1000, key)


def test_split_and_ranges():
    parts = ck.split(DATA, 1000)
    assert len(parts) == 11 and len(parts[-1]) == 244 and b"".join(parts) == DATA
    assert ck.split(b"", 1000) == [] and ck.split(b"abc", 10) == [b"abc"]
    with pytest.raises(ValueError):
        ck.split(DATA, 0)
    assert ck.sha256_hex(b"") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def test_round_trip(signed, key):
    manifest, parts = signed
    assert manifest.num_chunks == 11 and manifest.total_size == len(DATA)
    assert manifest.chunk_range(0) == (0, 1000) and manifest.chunk_range(10) == (10_000, 10_244)
    with pytest.raises(IndexError):
        manifest.chunk_range(11)
    parsed = Manifest.from_json(manifest.to_json())
    assert parsed == manifest
    ck.verify_manifest(parsed, key.public_key())
    ck.verify_manifest(parsed, ck.public_key_hex(key))  # a configured hex key works too
    assert all(ck.verify_chunk(parsed, i, c) for i, c in enumerate(parts))
    shuffled = {i: parts[i] for i in reversed(range(len(parts)))}
    assert store_with(parsed, shuffled).assemble(7) == DATA  # chunks arrive in any order


def test_empty_snapshot(key):
    manifest, parts = ck.make_manifest(0, b"", 1000, key)
    assert parts == [] and manifest.num_chunks == 0
    ck.verify_manifest(manifest, key.public_key())
    assert store_with(manifest, {}).assemble(0) == b""


def test_tampered_chunk_is_detected(signed):
    manifest, parts = signed
    bad = bytearray(parts[3])
    bad[0] ^= 1
    assert not ck.verify_chunk(manifest, 3, bytes(bad))
    assert not ck.verify_chunk(manifest, 3, parts[3] + b"x")
    assert not ck.verify_chunk(manifest, 4, parts[3])  # right bytes, wrong place
    assert not ck.verify_chunk(manifest, 11, parts[3]) and not ck.verify_chunk(manifest, -1, parts[3])
    store = store_with(manifest, {**dict(enumerate(parts)), 3: bytes(bad)})
    assert store.get(7, 3) is None and store.first_missing(7) == 3, "a bad chunk is never stored"
    with pytest.raises(VerificationError, match="chunk 3 missing"):
        store.assemble(7)
    assert store.put(7, 3, parts[3]) and store.assemble(7) == DATA  # the right bytes fill the gap


def test_the_store_refuses_missing_extra_and_unknown_chunks(signed):
    manifest, parts = signed
    have = dict(enumerate(parts))
    del have[5]
    store = store_with(manifest, have)
    with pytest.raises(VerificationError, match="chunk 5 missing"):
        store.assemble(7)
    assert not store.put(7, 11, b"x") and 11 not in store.chunks[7], "no index past the manifest"
    assert not store.put(8, 0, parts[0]), "no chunk of a version without a manifest"


@pytest.mark.parametrize(
    "change",
    [
        lambda m: {"version": m.version + 1},
        lambda m: {"total_size": m.total_size - 1},
        lambda m: {"chunk_sha256": [ck.sha256_hex(b"evil")] + m.chunk_sha256[1:]},
    ],
    ids=["version", "total_size", "chunk_hash"],
)
def test_tampered_manifest_field_is_refused(signed, key, change):
    manifest, _ = signed
    forged = manifest.model_copy(update=change(manifest))
    with pytest.raises(VerificationError, match="bad signature"):
        ck.verify_manifest(forged, key.public_key())


def test_bad_or_missing_signature_is_refused(signed, key):
    manifest, _ = signed
    flipped = ("0" if manifest.signature[0] != "0" else "1") + manifest.signature[1:]
    with pytest.raises(VerificationError, match="bad signature"):
        ck.verify_manifest(manifest.model_copy(update={"signature": flipped}), key.public_key())
    with pytest.raises(VerificationError, match="not hex"):
        ck.verify_manifest(manifest.model_copy(update={"signature": "zz"}), key.public_key())
    with pytest.raises(VerificationError, match="not signed"):
        ck.verify_manifest(manifest.model_copy(update={"signature": ""}), key.public_key())


def test_wrong_key_is_refused(signed):
    manifest, _ = signed
    with pytest.raises(VerificationError, match="bad signature"):
        ck.verify_manifest(manifest, Ed25519PrivateKey.generate().public_key())


def test_malformed_manifest_json_is_refused(signed):
    manifest, _ = signed
    d = json.loads(manifest.to_json())
    for bad in [
        {**d, "chunk_sha256": d["chunk_sha256"][:-1]},  # hash count does not match the size
        {**d, "extra": 1},
        {**d, "chunk_size": 0},
        {**d, "chunk_sha256": ["XYZ"] * 11},
    ]:
        with pytest.raises(VerificationError, match="malformed manifest"):
            Manifest.from_json(json.dumps(bad))
    with pytest.raises(VerificationError):
        Manifest.from_json(b"not json")


def test_key_file_created_0600_and_reused(tmp_path):
    path = tmp_path / "keys" / "learner.pem"
    first = ck.load_or_create_key(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    pem = path.read_bytes()
    second = ck.load_or_create_key(path)
    assert ck.public_key_hex(second) == ck.public_key_hex(first)
    assert path.read_bytes() == pem
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind
    manifest, _ = ck.make_manifest(1, b"abc", 2, first)
    ck.verify_manifest(manifest, ck.load_public_key(ck.public_key_hex(second)))


def test_key_file_of_another_type_is_refused(tmp_path):
    path = tmp_path / "ec.pem"
    path.write_bytes(
        ec.generate_private_key(ec.SECP256R1()).private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    with pytest.raises(ValueError, match="not an Ed25519"):
        ck.load_or_create_key(path)


def test_public_key_hex_round_trip_and_errors(key):
    hex_key = ck.public_key_hex(key)
    assert len(hex_key) == 64 and ck.public_key_hex(ck.load_public_key(hex_key)) == hex_key
    with pytest.raises(ValueError, match="not hex"):
        ck.load_public_key("nothex")
    with pytest.raises(ValueError, match="32 bytes"):
        ck.load_public_key("abcd")
