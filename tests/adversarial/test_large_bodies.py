"""Issue 22 case 7: large bodies are refused before they are read, and heartbeats stay responsive
while a large push is being processed.

At 97ea5ef a push's body was read and parsed on the event loop before its sender's quarantine was
checked, and a refused body was drained for up to 10 s: twelve 61 MiB pushes, quarantined senders
among them, delayed honest heartbeats up to 5.4 s. Here a client sends a push's headers and only the
first 64 KiB of a declared 61 MiB body; the refusal must come back while the rest is unsent.
"""

from __future__ import annotations

import gc
import json
import socket
import threading
import time
import urllib.request
import uuid

import pytest

from echo2.config import CoordinatorConfig
from echo2.coordinator import server as coordinator_module
from echo2.coordinator.leases import Limits, Work
from echo2.coordinator.server import Coordinator
from echo2.coordinator.state import CoordinatorState
from echo2.data.buffer import ReplayBuffer

TOKEN = "run-token"
DECLARED = 61 * 2**20
SENT = 64 * 2**10


def new_state() -> CoordinatorState:
    return CoordinatorState(
        CoordinatorConfig(lease_timeout=30.0, heartbeat_timeout=60.0, max_leases_per_worker=4),
        work=Work(
            buffer=ReplayBuffer(staleness=1, group_size=2),
            limits=Limits(
                vocab_size=1000, max_prompt_tokens=64, max_new_tokens=64, group_size=2, reward_range=(0, 1)
            ),
            group_id_of=lambda i: f"g{i}",
        ),
    )


@pytest.fixture
def served():
    state = new_state()
    server = Coordinator(state, token=TOKEN, run_info={}, heartbeat_interval=1.0, max_body=64 * 2**20)
    server.start()
    state.publisher.publish(0, b"weights-v0", keep=2)
    yield state, server
    server.stop()


def call(url: str, path: str, body: dict, secret: str) -> tuple[int, dict]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST")
    req.add_header("Authorization", f"Bearer {secret}")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def register(url: str, name: str) -> tuple[str, str]:
    status, body = call(url, "/v1/register", {"name": name}, TOKEN)
    assert status == 200, body
    return body["worker_id"], body["credential"]


def half_sent_push(url: str, secret: str, declared: int = DECLARED) -> tuple[int, float]:
    """Headers declaring `declared` bytes and only the first SENT of them; (status, seconds to the
    answer). Never sends the rest: a server that waited for it would time out here."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        head = (
            f"POST /v1/trajectories HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {secret}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n"
        )
        started = time.monotonic()
        sock.sendall(head.encode() + b"[" * SENT)
        answer = b""
        while b"\r\n" not in answer:
            chunk = sock.recv(4096)
            assert chunk, "closed without an answer"
            answer += chunk
        return int(answer.split()[1]), time.monotonic() - started


def test_a_quarantined_senders_large_body_is_refused_unread(served):
    state, server = served
    worker, secret = register(server.url, "mallory")
    state.intake.integrity.quarantined.add(worker)
    status, seconds = half_sent_push(server.url, secret)
    assert status == 403
    assert seconds < 5.0


def test_an_unknown_senders_large_body_is_refused_unread(served):
    _, server = served
    status, _ = half_sent_push(server.url, "w-nobody.not-a-secret")
    assert status in (401, 404)
    status, _ = half_sent_push(server.url, TOKEN)  # the run token is no worker's credential
    assert status == 403


def test_a_body_declared_over_the_cap_is_refused_unread(served):
    _, server = served
    _, secret = register(server.url, "big")
    status, _ = half_sent_push(server.url, secret, declared=server.max_body + 1)
    assert status == 413


def test_connections_over_the_cap_are_closed_at_once(served, monkeypatch):
    _, server = served
    server.max_connections = 4
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    held = [socket.create_connection((host, int(port)), timeout=5) for _ in range(4)]
    try:
        time.sleep(0.2)
        extra = socket.create_connection((host, int(port)), timeout=5)
        extra.sendall(b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            assert extra.recv(1) == b""  # closed without an answer
        except ConnectionResetError:
            pass
        extra.close()
        assert server.refused_connections >= 1
    finally:
        for s in held:
            s.close()


def test_an_idle_or_slowloris_connection_is_closed_after_the_keepalive(monkeypatch):
    monkeypatch.setattr(coordinator_module, "KEEPALIVE_S", 0.5)
    state = CoordinatorState(
        CoordinatorConfig(lease_timeout=30.0, heartbeat_timeout=60.0, max_leases_per_worker=4),
        work=Work(
            buffer=ReplayBuffer(staleness=1, group_size=2),
            limits=Limits(
                vocab_size=10, max_prompt_tokens=8, max_new_tokens=8, group_size=2, reward_range=(0, 1)
            ),
            group_id_of=lambda i: f"g{i}",
        ),
    )
    server = Coordinator(state, token=TOKEN, run_info={}, heartbeat_interval=1.0)
    server.start()
    try:
        host, port = server.url.removeprefix("http://").rsplit(":", 1)
        idle = socket.create_connection((host, int(port)), timeout=5)
        slow = socket.create_connection((host, int(port)), timeout=5)
        slow.sendall(b"POST /v1/heartbeat HTTP/1.1\r\nHost: x\r\n")  # headers never finished
        for sock in (idle, slow):
            started = time.monotonic()
            try:
                assert sock.recv(1) == b""
            except ConnectionResetError:
                pass
            assert time.monotonic() - started < 4.0
            sock.close()
    finally:
        server.stop()


def test_honest_heartbeats_stay_responsive_while_a_big_push_is_processed(served):
    """A push of 16,384 records (about 9 MiB of JSON) is parsed and checked off the event loop, in
    the parser process (pushparse.py: pydantic would hold the GIL for the whole parse): heartbeats
    keep being answered meanwhile, each far faster than the push takes."""
    _, server = served
    pusher, push_secret = register(server.url, "pusher")  # starts the parser process
    beater, beat_secret = register(server.url, "beater")
    while server.parser.outcome(b"{}", pusher, {}) is None:  # until it is ready
        time.sleep(0.05)
    record = {
        "group_id": "g0",
        "prompt_ids": list(range(30)),
        "response_ids": list(range(16)),
        "behaviour_logprobs": [-0.5] * 16,
        "loss_mask": [1] * 16,
        "reward": 1.0,
        "version": 0,
        "metadata": {"correct": True, "answer": "12"},
    }
    records = [{**record, "record_id": uuid.uuid4().hex} for _ in range(16_384)]
    body = {"worker_id": pusher, "lease_id": "none", "records": records}
    done = threading.Event()
    push_time: list[float] = []

    def push() -> None:
        started = time.monotonic()
        call(server.url, "/v1/trajectories", body, push_secret)  # refused in the end: no such lease
        push_time.append(time.monotonic() - started)
        done.set()

    beats: list[tuple[float, float]] = []
    thread = threading.Thread(target=push)
    thread.start()
    while not done.is_set():
        started = time.monotonic()
        status, _ = call(server.url, "/v1/heartbeat", {"worker_id": beater, "version": 0}, beat_secret)
        assert status == 200
        beats.append((started, time.monotonic() - started))
        time.sleep(0.01)
    thread.join()
    during = [latency for _, latency in beats]
    print(f"push {push_time[0]:.2f}s; {len(during)} heartbeats, max {max(during) * 1e3:.0f} ms")
    assert len(during) >= 3, f"{len(during)} heartbeats answered during a {push_time[0]:.2f}s push"
    assert max(during) < push_time[0] / 2, (max(during), push_time[0])


def test_a_full_collection_does_not_walk_what_the_process_held_at_start():
    """What the learner's process holds when the coordinator starts (torch, the model, the
    tokenizer: about 400,000 containers for the quickstart) is frozen out of the collector's sight,
    so a full collection during pushes walks only what arrived since. Before, each one walked the
    whole heap with every thread stopped (about 290 ms in bench/heartbeat_load.py's stream, where
    heartbeats waited for it). `stop` gives the objects back to the collector."""
    held = [[i] for i in range(200_000)]  # the heap a learner brings
    gc.collect()
    assert len(gc.get_objects(generation=2)) >= len(held)
    server = Coordinator(new_state(), token="t", run_info={}, heartbeat_interval=2.0)
    server.start()
    try:
        assert gc.get_freeze_count() >= len(held)
        assert len(gc.get_objects(generation=2)) < len(held) // 4
    finally:
        server.stop()
    assert gc.get_freeze_count() == 0
    assert len(gc.get_objects(generation=2)) >= len(held)
