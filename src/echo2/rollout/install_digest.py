"""The digest of a server-engine install file (rollout/server_engine.py writes it, the server's
`echo2_install_file` in rollout/vllm_ext.py checks it before touching a weight): SHA-256 over the
file's size and the SHA-256s of its 16 MiB blocks. The worker takes it while writing (each block
hashed on a pool thread, straight from the received chunks, as the next is written); the server
takes it over the file's mapped pages on every core. hashlib releases the GIL, so both run at
about the cores' rate rather than one core's. It binds as a plain SHA-256 of the file does: two
files with one digest need a SHA-256 collision in a block or in the list
(tests/unit/test_install_digest.py)."""

from __future__ import annotations

import hashlib
import mmap
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

BLOCK = 1 << 24
TAG = b"echo2-install-blocks-v1"

Buffer = bytes | bytearray | memoryview


def combine(size: int, block_digests: Iterable[bytes]) -> str:
    """The digest of a file of `size` bytes whose blocks have these SHA-256s (in order)."""
    h = hashlib.sha256(TAG)
    h.update(size.to_bytes(8, "little"))
    for d in block_digests:
        h.update(d)
    return h.hexdigest()


def _threads() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


def buffer_digest(data: Buffer, *, block: int = BLOCK, threads: int | None = None) -> str:
    """The digest of the bytes `data` holds, its blocks hashed on `threads` threads (default:
    every core)."""
    view = memoryview(data).cast("B")

    def one(start: int) -> bytes:
        return hashlib.sha256(view[start : start + block]).digest()

    with ThreadPoolExecutor(threads or _threads()) as pool:
        return combine(len(view), list(pool.map(one, range(0, len(view), block))))


def file_digest(path: str | Path, *, block: int = BLOCK, threads: int | None = None) -> str:
    """The digest of the file at `path` (read through a shared read-only map)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return combine(0, [])
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                return buffer_digest(view, block=block, threads=threads)
            finally:
                view.release()


def _sha256_of(pieces: Sequence[Buffer]) -> bytes:
    h = hashlib.sha256()
    for piece in pieces:
        h.update(piece)
    return h.digest()


def write_hashed(
    path: Path, size: int, views: Callable[[int, int], Sequence[Buffer]], *, block: int = BLOCK
) -> str:
    """Write the `size` bytes that `views(start, end)` gives (buffers, in order) to `path`, block by
    block, each block hashed on a pool thread while the next is written; the file's digest."""
    futures: list[Future[bytes]] = []
    with ThreadPoolExecutor(_threads()) as pool, open(path, "wb") as f:
        for start in range(0, size, block):
            pieces = views(start, min(start + block, size))
            futures.append(pool.submit(_sha256_of, pieces))
            for piece in pieces:
                f.write(piece)
        return combine(size, [fut.result() for fut in futures])
