"""The fuzzers' HTTP client reads an answer the door sends before reading the whole body.

The coordinator refuses an oversized or unauthenticated body without reading it (lingering_time 0:
it answers, then closes). A client still writing the body then gets EPIPE or ECONNRESET, though the
answer is already on its socket. `Wire` used to treat that as a failed request, retry once and
raise `BrokenPipeError` (tests/adversarial/test_fuzz_worker.py::test_lease on a loaded machine,
where the door read the headers before the client had written its body). Here the body is 8 MB
and the server never reads it, so the client is always still writing when the answer comes.
"""

from __future__ import annotations

import socket
import threading

from fuzz_wire import Wire

ANSWER = (
    b"HTTP/1.1 413 Payload Too Large\r\nContent-Type: application/json\r\nContent-Length: 17\r\n"
    b'Connection: close\r\n\r\n{"error":"large"}'
)


def test_an_answer_sent_before_the_body_is_read_is_the_answer():
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    server.bind(("127.0.0.1", 0))
    server.listen(2)
    server.settimeout(30)

    def serve() -> None:
        for _ in range(2):  # the old client tried twice
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                head = b""
                while b"\r\n\r\n" not in head:
                    head += conn.recv(1024)
                conn.sendall(ANSWER)  # and close with the body unread

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        answer = Wire(f"http://127.0.0.1:{server.getsockname()[1]}").send("POST", "/x", raw=b"[" * 8_000_000)
    finally:
        server.close()
        thread.join(timeout=10)
    assert answer.status == 413 and answer.payload == b'{"error":"large"}'
