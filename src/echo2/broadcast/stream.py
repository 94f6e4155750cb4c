"""Chunk streams: the frame format spoken by the learner, relays and receivers, and the serving side.

A receiver opens ONE `GET /v1/chunks/{version}?from=K[&to=J]` on its parent (the learner's
coordinator or a peer's relay server) and reads frames until the stream ends after chunk J - 1
(default: the last chunk). A frame is an 8-byte header, big-endian `u32 index, u32 length`, then
`length` bytes of chunk `index`. A parent writes each chunk as soon as it holds it, so several
chunks are in flight at once and no chunk costs a round trip. While it does not hold the next chunk
yet it writes a keep-alive frame (index `KEEPALIVE`, length 0) every `keepalive_s`, so a receiver can
tell a parent that waits on its own upstream from a dead one.

Every byte written goes through the sender's upload `TokenBucket` (shared by all its streams) in
pieces of at most `PIECE` bytes, so concurrent streams interleave and share the cap fairly.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Awaitable, Callable

from aiohttp import web

from echo2.broadcast.bucket import TokenBucket

HEADER = struct.Struct(">II")
KEEPALIVE = 0xFFFFFFFF
GONE = 0xFFFFFFFE
"""Last frame of a stream whose parent no longer holds the version (not the parent's fault)."""
PIECE = 64 * 1024


class BadRange(ValueError):
    """The `from`/`to` query parameters are not a valid chunk range."""


def parse_range(query, num_chunks: int | None = None) -> tuple[int, int | None]:
    """(`from`, `to`) from a request's query: integers, 0 <= from, from < to; `to` is clamped to
    `num_chunks` when it is known. None for `to` means the last chunk."""
    try:
        start = int(query.get("from", "0"))
        end = int(query["to"]) if "to" in query else None
    except ValueError:
        raise BadRange("from and to must be integers") from None
    if start < 0 or (end is not None and end <= start):
        raise BadRange(f"bad chunk range from={start} to={end}")
    if num_chunks is not None:
        end = num_chunks if end is None else min(end, num_chunks)
    return start, end


async def write_chunk(
    resp: web.StreamResponse,
    index: int,
    data: bytes | memoryview,
    bucket: TokenBucket | None,
    timeout: float,
    stream_bucket: TokenBucket | None = None,
) -> None:
    """One frame, in pieces paced by `bucket` (shared by all streams) and `stream_bucket` (this
    stream's own cap); each write must drain within `timeout` seconds (a receiver that stops reading
    does not hold the sender forever)."""
    view = memoryview(data)
    async with asyncio.timeout(timeout):
        await resp.write(HEADER.pack(index, len(view)))
    for at in range(0, len(view), PIECE):
        piece = view[at : at + PIECE]
        if stream_bucket is not None:
            await stream_bucket.consume(len(piece))
        if bucket is not None:
            await bucket.consume(len(piece))
        async with asyncio.timeout(timeout):
            await resp.write(piece)


async def serve_stream(
    request: web.Request,
    *,
    start: int,
    end: Callable[[], int | None],
    get_chunk: Callable[[int, float], Awaitable[bytes | memoryview | None]],
    bucket: TokenBucket | None,
    keepalive_s: float,
    write_timeout_s: float,
    stream_bucket: TokenBucket | None = None,
) -> web.StreamResponse:
    """Stream chunks `start .. end() - 1` in order. `get_chunk(i, wait)` returns chunk i, or None if
    it did not arrive within `wait` seconds (a keep-alive is sent and it is asked again); it raises
    LookupError if the chunk will never come (a `GONE` frame ends the stream, and the receiver goes
    elsewhere without blaming this parent). `end()` is None until the number of chunks is known (a relay waiting for the
    manifest)."""
    resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    await resp.prepare(request)
    index = start
    while True:
        last = end()
        if last is not None and index >= last:
            break
        try:
            data = await get_chunk(index, keepalive_s)
        except LookupError:
            async with asyncio.timeout(write_timeout_s):
                await resp.write(HEADER.pack(GONE, 0))
            break
        if data is None:
            async with asyncio.timeout(write_timeout_s):
                await resp.write(HEADER.pack(KEEPALIVE, 0))
            continue
        await write_chunk(resp, index, data, bucket, write_timeout_s, stream_bucket)
        index += 1
    await resp.write_eof()
    return resp
