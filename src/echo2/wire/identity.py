"""Who is calling: worker credentials, the learner key's fingerprint, and the relay-address rule.

Pure functions, no I/O and no state (the registry holds each worker's credential digest). A worker's
credential is `WORKER_ID.SECRET`: the id says which registration it claims, the secret (random, 32
bytes, given once in the registration reply) proves it. Only the SHA-256 of the secret is kept, and
it is compared in constant time. The learner's public key is pinned by workers as a fingerprint,
the SHA-256 of its raw bytes in hex (what `echo2 learner` logs and `--learner-key` takes).
docs/security.md says what each of these defends against.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets

from echo2.wire.errors import Forbidden

SLOT_SECRET_ENV = "ECHO2_SLOT_SECRET"
"""Where a provider puts the secret of the slot it starts, in the worker's environment: the worker
sends it when it registers (`RegisterRequest.slot_proof`), proving it is the slot's own worker."""


def new_secret() -> str:
    """A fresh worker secret (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def credential(worker_id: str, secret: str) -> str:
    assert "." not in worker_id, "worker ids carry no dot"
    return f"{worker_id}.{secret}"


def split(credential: str) -> tuple[str, str]:
    """(worker id, secret) of a credential; ("", "") if it has no such shape."""
    worker_id, dot, secret = credential.partition(".")
    return (worker_id, secret) if dot and worker_id and secret else ("", "")


def matches(secret: str, expected_digest: bytes) -> bool:
    return bool(expected_digest) and hmac.compare_digest(digest(secret), expected_digest)


def proves(proof: str | None, secret: str | None) -> bool:
    """Whether a registration's `proof` is the slot's `secret` (constant time; no secret: never)."""
    return bool(secret) and proof is not None and hmac.compare_digest(proof.encode(), secret.encode())


def fingerprint(public_key_hex: str) -> str:
    """SHA-256 (hex) of the learner's raw Ed25519 public key."""
    return hashlib.sha256(bytes.fromhex(public_key_hex)).hexdigest()


def same_fingerprint(given: str, public_key_hex: str) -> bool:
    """Whether `given` (a fingerprint, or its first 16+ hex digits, or the public key itself in
    hex) names this key."""
    given = given.strip().lower()
    full = fingerprint(public_key_hex)
    if given == public_key_hex.lower():
        return True
    return len(given) >= 16 and full.startswith(given)


def same_host(advertised: str, observed: str) -> bool:
    """Whether a relay's advertised host is the address its registration came from (addresses are
    compared as addresses: ::ffff:1.2.3.4 is 1.2.3.4; a host name is never the same)."""
    try:
        a = ipaddress.ip_address(advertised.strip("[]"))
        b = ipaddress.ip_address(observed.strip("[]"))
    except ValueError:
        return False
    a = a.ipv4_mapped or a if isinstance(a, ipaddress.IPv6Address) else a
    b = b.ipv4_mapped or b if isinstance(b, ipaddress.IPv6Address) else b
    return a == b


def relay_url(port: int | None, advertised: str | None, observed: str, *, any_host: bool) -> str | None:
    """Where a registering worker's relay is reached: the address its registration came from, or
    the host it advertises if that is the same host (or `coordinator.any_relay_host` allows any);
    None without a relay port. Raises Forbidden for a host the worker may not claim."""
    if port is None:
        return None
    if advertised and not (any_host or same_host(advertised, observed)):
        raise Forbidden(
            f"relay_host {advertised!r} is not the address this registration came from "
            f"({observed}); see coordinator.any_relay_host"
        )
    host = advertised or observed
    if ":" in host and not host.startswith("["):  # IPv6 literal
        host = f"[{host}]"
    return f"http://{host}:{port}"


SEQ_HEADER = "X-Echo2-Seq"
"""The header carrying a worker client's request number (coordinator/sessions.py)."""
