"""Honest heartbeats under exhaustion before authentication (issue 41 item 5): p95 latency of an
honest worker's heartbeats, each on a new connection from 127.0.0.2, against a real coordinator on
127.0.0.1, with no attack, beside N idle sockets held from 127.0.0.1, and beside four
unauthenticated 60 MiB `POST /ui` bodies sent whole (again and again while the heartbeats run).

Run it on the code to compare, the same way, side by side (the raw output names the commit):
    python bench/preauth.py --json docs/bench/preauth.json
    PYTHONPATH=/tmp/old/src python bench/preauth.py        # a worktree of the earlier commit
Both processes (coordinator and attacker) are this one; the attacker's sockets are blocking ones
in threads, so the coordinator's event loop is what is measured."""

from __future__ import annotations

import argparse
import json
import resource
import socket
import statistics
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from common import write_json

import echo2
from echo2.config import CoordinatorConfig
from echo2.coordinator.leases import Limits, Work
from echo2.coordinator.server import Coordinator
from echo2.coordinator.state import CoordinatorState
from echo2.data.buffer import ReplayBuffer

TOKEN = "run-token"


class Source(urllib.request.HTTPHandler):
    """urllib from a chosen source address (a second peer address on loopback)."""

    def __init__(self, source: str) -> None:
        super().__init__()
        self.source = source

    def http_open(self, req):
        import http.client

        return self.do_open(
            lambda host, **kw: http.client.HTTPConnection(host, source_address=(self.source, 0), **kw), req
        )


def call(opener, url: str, path: str, body: dict, secret: str) -> int:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST")
    req.add_header("Authorization", f"Bearer {secret}")
    try:
        with opener.open(req, timeout=10) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return -1  # refused or closed without an answer


def heartbeats(opener, url: str, worker: str, secret: str, count: int) -> dict:
    latencies, failed = [], 0
    for _ in range(count):
        started = time.perf_counter()
        status = call(opener, url, "/v1/heartbeat", {"worker_id": worker, "version": 0}, secret)
        if status == 200:
            latencies.append(time.perf_counter() - started)
        else:
            failed += 1
        time.sleep(0.02)
    q = statistics.quantiles(latencies, n=20) if len(latencies) >= 2 else [float("nan")] * 19
    return {"answered": len(latencies), "failed": failed, "p50_ms": 1e3 * statistics.median(latencies) if latencies else None,
            "p95_ms": 1e3 * q[18], "max_ms": 1e3 * max(latencies) if latencies else None}  # fmt: skip


def idle_sockets(host: str, port: int, n: int) -> list[socket.socket]:
    held = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        try:
            s.connect((host, port))
            held.append(s)
        except OSError:
            s.close()
    return held


def ui_bodies(host: str, port: int, size: int, stop: threading.Event) -> None:
    """One attacker thread: POST /ui with a whole `size`-byte form, again until `stop`."""
    head = (f"POST /ui HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/x-www-form-urlencoded\r\n"
            f"Content-Length: {size}\r\n\r\n").encode()  # fmt: skip
    body = b"token=" + b"x" * (size - 6)
    while not stop.is_set():
        try:
            with socket.create_connection((host, port), timeout=10, source_address=("127.0.0.1", 0)) as s:
                s.sendall(head)
                view, at = memoryview(body), 0
                while at < size and not stop.is_set():
                    at += s.send(view[at : at + 2**20])
                s.recv(64)
        except OSError:
            time.sleep(0.01)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sockets", type=int, default=4146)
    ap.add_argument("--beats", type=int, default=200)
    ap.add_argument("--ui-mib", type=int, default=60)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 3 * args.sockets + 256)), hard))
    state = CoordinatorState(
        CoordinatorConfig(lease_timeout=30.0, heartbeat_timeout=600.0, max_leases_per_worker=4),
        work=Work(buffer=ReplayBuffer(staleness=1, group_size=2),
                  limits=Limits(vocab_size=1000, max_prompt_tokens=64, max_new_tokens=64, group_size=2, reward_range=(0, 1)),
                  group_id_of=lambda i: f"g{i}"),
    )  # fmt: skip
    server = Coordinator(state, token=TOKEN, run_info={}, heartbeat_interval=1.0, max_body=64 * 2**20)
    server.start()
    state.publisher.publish(0, b"weights-v0", keep=2)
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    opener = urllib.request.build_opener(Source("127.0.0.2"))
    req = urllib.request.Request(server.url + "/v1/register", data=b'{"name": "honest"}', method="POST")
    req.add_header("Authorization", f"Bearer {TOKEN}")
    with opener.open(req, timeout=10) as resp:
        reg = json.loads(resp.read())
    worker, secret = reg["worker_id"], reg["credential"]
    src = Path(echo2.__file__).resolve().parents[2]
    commit = subprocess.run(
        ["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    out = {"commit": commit, "config": vars(args)}
    try:
        out["none"] = heartbeats(opener, server.url, worker, secret, args.beats)
        print(f"{commit} no attack: {out['none']}", flush=True)
        held = idle_sockets(host, int(port), args.sockets)
        time.sleep(1.0)
        out["idle_sockets"] = heartbeats(opener, server.url, worker, secret, args.beats)
        out["idle_sockets"]["attacker_sockets_open"] = len(held)
        out["idle_sockets"]["refused_connections"] = server.refused_connections
        print(f"{commit} {len(held)} idle sockets from 127.0.0.1: {out['idle_sockets']}", flush=True)
        for s in held:
            s.close()
        time.sleep(1.0)
        stop = threading.Event()
        threads = [
            threading.Thread(target=ui_bodies, args=(host, int(port), args.ui_mib * 2**20, stop))
            for _ in range(4)
        ]
        for t in threads:
            t.start()
        time.sleep(0.5)
        out["ui_bodies"] = heartbeats(opener, server.url, worker, secret, args.beats)
        stop.set()
        for t in threads:
            t.join(timeout=30)
        print(f"{commit} four {args.ui_mib} MiB POST /ui bodies: {out['ui_bodies']}", flush=True)
    finally:
        server.stop()
    print(json.dumps(out))
    write_json(args.json, out)


if __name__ == "__main__":
    main()
