"""The learner's key is pinned by each worker for the run, and the coordinator can speak TLS.

What was seen: the learner's public key arrived in the plain-HTTP registration reply and was
replaced at every re-registration, so an on-path proxy that swapped key and manifest got a real
worker to install its weights. Now a worker trusts the first key it sees (or the fingerprint it was
given) and stops, installing nothing, when a registration presents another."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import ipaddress
import random

import pytest
from hostile_relay import KeySwapProxy
from support import make_state

from echo2.broadcast.tracker import BroadcastPolicy
from echo2.coordinator.server import Coordinator
from echo2.rollout.broadcast_peer import BroadcastPeer
from echo2.rollout.worker_config import KeyChanged, PeerConfig
from echo2.wire.client import CoordinatorClient, RetryPolicy, Unreachable
from echo2.wire.identity import fingerprint
from echo2.wire.protocol import RegisterRequest

TOKEN = "key-token"
CHUNK = 64 * 1024


def bounded(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def start_coordinator(**kw):
    state = make_state(heartbeat_timeout=30.0, broadcast=BroadcastPolicy(mode="star", chunk_size=CHUNK))
    server = Coordinator(
        state, token=TOKEN, run_info={"broadcast": {"progress_timeout_s": 2.0}}, heartbeat_interval=0.2, **kw
    )
    server.start()
    return server, state


def snapshot(seed: int) -> bytes:
    return random.Random(seed).randbytes(3 * CHUNK)


async def until(predicate, what: str, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"timed out: {what}"
        await asyncio.sleep(0.02)


def test_a_key_swapped_at_re_registration_stops_the_worker():
    server, state = start_coordinator()
    fake = snapshot(666)

    async def scenario():
        proxy = KeySwapProxy(server.url, fake, CHUNK)
        await proxy.start()
        stop = asyncio.Event()
        peer = BroadcastPeer(PeerConfig(url=proxy.url, token=TOKEN, name="victim"))
        task = asyncio.create_task(peer.run(stop))
        try:
            real = snapshot(0)
            state.publisher.publish(0, real, keep=2)
            await until(lambda: 0 in peer.installed, "the real version 0")
            assert peer.installed[0] == hashlib.sha256(real).hexdigest()
            # the install report first: a report refused by the proxy would use up the one refusal
            # that makes the worker register again (heartbeats would then pass through)
            await until(lambda: 0 in state.publisher.t_bcast_all, "the install report of version 0")
            proxy.swap = True  # from now on: the proxy's key, manifests and chunks
            await until(lambda: task.done() or peer.member.reregistered >= 1, "a re-registration")
            await asyncio.sleep(0.5)
            state.publisher.publish(1, snapshot(1), keep=2)
            await asyncio.sleep(2.0)  # time to fetch and install version 1 through the proxy
            assert 1 not in peer.installed, "the proxy's snapshot was installed"
            assert task.done(), "the worker stopped"
            with pytest.raises(KeyChanged, match="changed"):
                task.result()
        finally:
            stop.set()
            await asyncio.gather(task, return_exceptions=True)
            await proxy.stop()

    try:
        bounded(scenario())
    finally:
        server.stop()


def test_a_worker_given_the_fingerprint_refuses_another_key_at_once():
    server, state = start_coordinator()

    async def scenario():
        proxy = KeySwapProxy(server.url, snapshot(666), CHUNK)
        proxy.swap = True
        await proxy.start()
        stop = asyncio.Event()
        pinned = fingerprint(state.publisher.public_key)
        peer = BroadcastPeer(PeerConfig(url=proxy.url, token=TOKEN, name="victim", learner_key=pinned))
        try:
            with pytest.raises(KeyChanged, match="learner-key"):
                await peer.run(stop)
            assert peer.installed == {}
            honest = BroadcastPeer(
                PeerConfig(url=server.url, token=TOKEN, name="direct", learner_key=pinned[:16])
            )
            task = asyncio.create_task(honest.run(stop))
            await until(lambda: honest.client is not None, "the honest registration")
            assert not task.done()
            stop.set()
            await task
        finally:
            stop.set()
            await proxy.stop()

    try:
        bounded(scenario())
    finally:
        server.stop()


def _self_signed(tmp_path):
    """A certificate for 127.0.0.1, signed by its own key (it is its own CA)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "echo2-test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return str(cert_file), str(key_file)


def test_the_coordinator_speaks_tls(tmp_path):
    """coordinator.tls_cert/tls_key: the URL is https, a worker given the CA registers, and one
    that cannot verify the certificate gets nowhere."""
    from echo2.learning.sources.assembly import tls

    cert, key = _self_signed(tmp_path)
    server, state = start_coordinator(ssl_context=tls(cert, key))
    once = RetryPolicy(max_attempts=1)

    async def scenario():
        assert server.url.startswith("https://127.0.0.1:")
        async with await CoordinatorClient.create(server.url, TOKEN, retry=once, ca_file=cert) as c:
            reply = await c.register(RegisterRequest(name="tls"))
            assert reply.public_key == state.publisher.public_key and c.credential
        async with await CoordinatorClient.create(server.url, TOKEN, retry=once) as c:
            with pytest.raises(Unreachable, match="certificate"):
                await c.register(RegisterRequest(name="unverified"))

    try:
        bounded(scenario())
    finally:
        server.stop()
