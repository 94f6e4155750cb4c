"""Snapshot broadcast's HTTP surface over loopback: every broadcast endpoint refuses bad input with a
4xx, a relay asks no credential but checks its ranges, a broadcast-only worker process installs, and
a relay that drops a version mid-stream is routed around."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from broadcast_net import (
    TOKEN,
    bounded,
    publish,
    snapshot_bytes,
    start_coordinator,
)
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from echo2.broadcast.relay import RelayServer

CREDENTIALS: dict[str, str] = {}


def call(server, method, path, body=None, *, token=TOKEN):
    """One request; a body naming a worker registered by `call` goes with its credential."""
    data = json.dumps(body).encode() if body is not None else None
    if token == TOKEN and isinstance(body, dict) and body.get("worker_id") in CREDENTIALS:
        token = CREDENTIALS[body["worker_id"]]
    req = urllib.request.Request(server.url + path, data=data, method=method)
    req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def test_broadcast_endpoints_refuse_bad_input():
    server, state = start_coordinator()
    try:
        status, body = call(server, "POST", "/v1/register", {"name": "w", "inbound": True, "relay_port": 5})
        wid = json.loads(body)["worker_id"]
        CREDENTIALS[wid] = json.loads(body)["credential"]
        assert state.registry.workers[wid].relay_url == "http://127.0.0.1:5"
        assert call(server, "GET", "/v1/manifest/0")[1]["error"] == "no_snapshot"
        digest = publish(state, 0)
        assert call(server, "GET", "/v1/manifest/0")[0] == 200
        assert call(server, "GET", "/v1/chunks/0?from=-1")[0] == 400
        assert call(server, "GET", "/v1/chunks/x")[0] == 400
        assert call(server, "GET", "/v1/published?after=zz")[0] == 400
        assert call(server, "POST", "/v1/broadcast/route", {"worker_id": wid, "version": 9})[0] == 404
        assert call(server, "POST", "/v1/broadcast/route", {"worker_id": "nobody", "version": 0})[0] == 403
        bad_reason = {"worker_id": wid, "version": 0, "parent_id": None, "reason": "bored"}
        assert call(server, "POST", "/v1/broadcast/failure", bad_reason)[0] == 422
        wrong = {"worker_id": wid, "version": 0, "sha256": "0" * 64}
        status, got = call(server, "POST", "/v1/broadcast/installed", wrong)
        assert (status, got["error"]) == (422, "wrong_snapshot")
        assert wid not in state.publisher.bcast.installs.installed_at.get(0, {}), (
            "a refused report changes nothing"
        )
        transfers = [{"parent_id": None, "bytes": 1, "seconds": 0.1}]
        ok = {"worker_id": wid, "version": 0, "sha256": digest, "transfers": transfers}
        assert call(server, "POST", "/v1/broadcast/installed", ok)[0] == 200
        assert wid in state.publisher.bcast.installs.installed_at[0]
        assert call(server, "GET", "/v1/published?after=0&wait=0")[1] == b'{"version": 0}'
    finally:
        server.stop()


def test_relay_asks_no_credential_but_a_valid_range():
    async def scenario():
        from echo2.broadcast.relay import ChunkStore

        relay = RelayServer(ChunkStore())
        url = await relay.start()
        try:
            import aiohttp

            async with aiohttp.ClientSession() as s:
                async with s.get(f"{url}/v1/chunks/0?from=3&to=2") as r:
                    assert r.status == 400 and (await r.json())["error"] == "malformed"
                async with s.get(f"{url}/v1/chunks/0?child=a/b") as r:
                    assert r.status == 400 and (await r.json())["error"] == "malformed"
        finally:
            await relay.stop()

    bounded(scenario(), 20)


def test_broadcast_only_worker_process():
    """`python -m echo2.rollout.broadcast_peer` (what the broadcast bench runs per host) imports no torch,
    registers as a relay, installs and reports a snapshot, and exits 0 on SIGTERM."""
    import signal
    import subprocess
    import sys
    import time

    check = "import sys, echo2.rollout.broadcast_peer; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", check], timeout=60).returncode == 0
    server, state = start_coordinator(mode="chain", chains=1)
    cmd = [
        sys.executable,
        "-m",
        "echo2.rollout.broadcast_peer",
        "--coordinator",
        server.url,
        "--token",
        TOKEN,
    ]
    proc = subprocess.Popen([*cmd, "--name", "proc", "--inbound", "--relay-host", "127.0.0.1", "-q"])
    try:
        deadline = time.monotonic() + 60
        while not state.registry.workers and time.monotonic() < deadline:
            time.sleep(0.05)
        (info,) = state.registry.workers.values()
        assert info.relay_url.startswith("http://127.0.0.1:")
        publish(state, 0)
        while (
            info.worker_id not in state.publisher.bcast.installs.installed_at.get(0, {})
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert (
            info.worker_id in state.publisher.bcast.installs.installed_at[0]
            and 0 in state.publisher.t_bcast_all
        )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        server.stop()


def test_a_relay_that_drops_the_version_mid_stream_says_so():
    """A relay whose store drops a version while a child streams it ends the stream with a GONE
    frame (the child then reroutes with reason "gone", which costs the relay no score)."""

    async def scenario():
        import aiohttp

        from echo2.broadcast.chunks import make_manifest
        from echo2.broadcast.relay import ChunkStore
        from echo2.broadcast.stream import GONE, HEADER

        key = Ed25519PrivateKey.generate()
        store = ChunkStore(keep=2)
        manifests = [make_manifest(v, snapshot_bytes(v, 64 * 1024), 16 * 1024, key) for v in range(3)]
        store.add_manifest(manifests[0][0])
        assert store.put(0, 0, manifests[0][1][0])
        relay = RelayServer(store, keepalive_s=0.1)
        url = await relay.start()
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(f"{url}/v1/chunks/0?from=0") as r:
                    assert r.status == 200
                    index, length = HEADER.unpack(await r.content.readexactly(HEADER.size))
                    assert index == 0
                    await r.content.readexactly(length)
                    store.add_manifest(manifests[1][0])
                    store.add_manifest(manifests[2][0])  # keep = 2: version 0 is dropped
                    frames = []
                    while len(frames) < 50:
                        index, length = HEADER.unpack(await r.content.readexactly(HEADER.size))
                        frames.append(index)
                        if index == GONE:
                            break
                    assert frames[-1] == GONE
                    assert await r.content.read() == b"", "the stream ends after GONE"
        finally:
            await relay.stop()

    bounded(scenario(), 20)
