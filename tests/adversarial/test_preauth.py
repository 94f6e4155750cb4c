"""Issue 41 item 5: exhaustion before authentication.

Seen at ec77695: 4,146 idle sockets from one address took the coordinator's connection slots
(10 of 12 new connections refused for 60 s), and four unauthenticated 60 MiB `POST /ui` bodies
were read whole (the sign-in form comes before any credential), raising honest heartbeat p95 from
1.7 to 215 ms. Here one address holds every socket it is let open and another address still gets
answered; a sign-in body over 4 KiB, or with no length, is refused before it is read. (Loopback
127.0.0.2 reaches a server bound on 127.0.0.1 as a second peer address.) The heartbeat latency
under both attacks is measured in bench/preauth.py."""

from __future__ import annotations

import socket
import time

import pytest
from test_large_bodies import TOKEN, call, register, served  # noqa: F401 - served: the fixture

from echo2.coordinator.status_page import FORM_MAX


def address(server) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def connect(server, source: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.bind((source, 0))
    sock.connect(address(server))
    return sock


def answered(sock: socket.socket) -> bool:
    """Whether a GET /status on `sock` gets an HTTP answer (a 401: no credential) rather than a close."""
    try:
        sock.sendall(b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n")
        return sock.recv(12).startswith(b"HTTP/1.1")
    except (ConnectionResetError, BrokenPipeError):
        return False


def test_one_address_cannot_take_the_slots_every_other_address_needs(served):  # noqa: F811
    _, server = served
    server.max_connections, server.max_connections_per_address = 40, 8
    held = [connect(server, "127.0.0.1") for _ in range(30)]  # idle, as the attacker's were
    try:
        time.sleep(0.3)
        assert server.refused_connections >= 30 - 8, "the attacker's sockets beyond its share are closed"
        others = [connect(server, "127.0.0.2") for _ in range(12)]
        try:
            assert sum(answered(s) for s in others) >= 8, "another address gets its own share"
        finally:
            for s in others:
                s.close()
        same = connect(server, "127.0.0.1")
        assert not answered(same), "the attacker's address is at its share"
        same.close()
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)  # closed: the address's count goes back down
    again = connect(server, "127.0.0.1")
    assert answered(again)
    again.close()


def sign_in_head(server, length: int | None) -> bytes:
    host, port = address(server)
    size = f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
    return (
        f"POST /ui HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/x-www-form-urlencoded\r\n"
        f"{size}\r\n"
    ).encode()


@pytest.mark.parametrize("length", [60 * 2**20, FORM_MAX + 1, None])
def test_a_sign_in_body_over_4_kib_or_of_no_length_is_refused_unread(served, length):  # noqa: F811
    """Headers and the first 64 KiB (at most the declared length) only: a server that read the body
    would wait for the rest, and the client's 5 s timeout would end the test."""
    _, server = served
    sock = connect(server, "127.0.0.1")
    try:
        started = time.monotonic()
        sent = 64 * 2**10 if length is None else min(64 * 2**10, length - 1)
        body = (
            f"{2**20:x}\r\n".encode() + b"t" * sent if length is None else b"t" * sent
        )  # chunked: 1 MiB announced
        sock.sendall(sign_in_head(server, length) + body)
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = sock.recv(4096)
            assert chunk, "closed without an answer"
            answer += chunk
        assert answer.split()[1] == b"413", answer[:200]
        assert b"application/json" in answer.split(b"\r\n\r\n")[0]
        assert time.monotonic() - started < 2.0
    finally:
        sock.close()


def test_a_sign_in_form_within_the_cap_still_signs_in(served):  # noqa: F811
    _, server = served
    form = f"token={TOKEN}".encode()
    sock = connect(server, "127.0.0.1")
    try:
        sock.sendall(sign_in_head(server, len(form)) + form)
        assert sock.recv(12).split()[1] == b"302"
    finally:
        sock.close()
    worker, secret = register(server.url, "honest")
    assert call(server.url, "/v1/heartbeat", {"worker_id": worker, "version": 0}, secret)[0] == 200
