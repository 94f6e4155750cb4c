"""One-shot TCP transfer used to measure a shaped link (run as a script, not imported as a package
module, so a process inside a namespace starts in milliseconds and never imports echo2).

    python tcp_transfer.py recv BIND_IP PORT      prints "READY <port>", takes one connection, reads
                                                  to EOF, prints one JSON line with the receive-side
                                                  timing
    python tcp_transfer.py send HOST PORT NBYTES  connects (retrying for 5 s), sends NBYTES,
                                                  half-closes, waits for the receiver to close,
                                                  prints one JSON line
"""

from __future__ import annotations

import json
import socket
import sys
import time

CHUNK = 256 * 1024


def recv(bind_ip: str, port: int) -> None:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((bind_ip, port))
    srv.listen(1)
    print(f"READY {srv.getsockname()[1]}", flush=True)
    conn, _ = srv.accept()
    total = 0
    marks: list[tuple[float, int]] = []  # (time, bytes so far) after every read
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    while True:
        n = conn.recv_into(view)
        if n == 0:
            break
        total += n
        marks.append((time.perf_counter(), total))
    conn.close()
    srv.close()
    out: dict[str, float | int] = {"bytes": total}
    if len(marks) >= 2:
        (t0, b0), (t1, b1) = marks[0], marks[-1]
        out["seconds"] = t1 - t0
        out["start"], out["end"] = t0, t1
        out["mbps"] = (b1 - b0) * 8 / max(t1 - t0, 1e-9) / 1e6
        # steady state: skip the first 20% of the bytes (the token bucket starts full)
        ts, bs = next((t, b) for t, b in marks if b >= total * 0.2)
        if t1 > ts:
            out["steady_mbps"] = (b1 - bs) * 8 / (t1 - ts) / 1e6
    print(json.dumps(out), flush=True)


def send(host: str, port: int, nbytes: int) -> None:
    deadline = time.monotonic() + 5.0
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=5.0)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
    sock.settimeout(120.0)
    payload = memoryview(bytes(range(256)) * (CHUNK // 256))
    t0 = time.perf_counter()
    left = nbytes
    while left > 0:
        k = min(left, CHUNK)
        sock.sendall(payload[:k])
        left -= k
    sock.shutdown(socket.SHUT_WR)
    while sock.recv(4096):
        pass
    t1 = time.perf_counter()
    sock.close()
    print(json.dumps({"bytes": nbytes, "seconds": t1 - t0}), flush=True)


def main(argv: list[str]) -> None:
    if argv[:1] == ["recv"] and len(argv) == 3:
        recv(argv[1], int(argv[2]))
    elif argv[:1] == ["send"] and len(argv) == 4:
        send(argv[1], int(argv[2]), int(argv[3]))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
