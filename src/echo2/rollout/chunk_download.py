"""One chunk stream from a parent (the learner or a relay): a streaming GET from a first chunk
to the last, each chunk checked against the signed manifest as it is stored. What a receiver does
around it (routes, failure reports, deltas, following versions) is BroadcastClient's
(broadcast_client.py); this is the transport.

Every wait is bounded: `sock_read` covers the headers and each read, and a parent that sends only
keep-alives for `STARVED_FACTOR` progress timeouts is stalled, and so is a relay that sends only
keep-alives for more than one progress timeout and then says it no longer holds the version (a
"gone" that costs it nothing would let it hold every child for free). With a `RelayMeter`, each piece's
wait is measured against the relay's floors (the time this worker's own download cap takes is not
counted). Redirects are never followed.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp

from echo2.broadcast.bucket import TokenBucket
from echo2.broadcast.chunks import Manifest
from echo2.broadcast.meter import ParentFailed, RelayMeter
from echo2.broadcast.relay import API, STARVED_FACTOR, ChunkStore
from echo2.broadcast.stream import GONE, HEADER, KEEPALIVE, PIECE


class DroppedVersion(ParentFailed):
    """A chunk the store would not keep because the version left it (superseded while it was being
    received): not the parent's fault."""


class ChunkDownload:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        progress_timeout: float,
        download_bucket: TokenBucket | None = None,
        min_rate_bps: float | None = None,
    ) -> None:
        self.session = session
        self.progress_timeout = progress_timeout
        self.download_bucket = download_bucket
        """This worker's own download cap (paces every piece read)."""
        self.min_rate_bps = min_rate_bps
        """The receiver's stall floor for relays (`broadcast.min_relay_mbps`)."""

    async def get(
        self,
        base_url: str,
        version: int,
        manifest: Manifest,
        store: ChunkStore,
        *,
        start: int,
        relay_floor_bps: float | None,
        child: str | None,
        headers: dict[str, str],
    ) -> int:
        """Chunks `start`.. of `version` from `base_url` into `store`; the bytes received. A relay
        (`child` given: it is told who receives) is metered against the stall floor and the
        coordinator's `relay_floor_bps`. Raises ParentFailed on anything but a complete, valid
        stream."""
        relay = child is not None
        timeout = aiohttp.ClientTimeout(
            total=None, connect=10, sock_connect=10, sock_read=self.progress_timeout
        )
        meter = (
            RelayMeter(
                stall_bps=self.min_rate_bps,
                slow_bps=relay_floor_bps or 0.0,
                window_s=self.progress_timeout,
            )
            if relay and (self.min_rate_bps or relay_floor_bps)
            else None
        )
        params: dict[str, str | int] = {"from": start, "child": child} if relay else {"from": start}
        if manifest.form == "delta":
            params["form"] = "delta"
        received = 0
        try:
            async with self.session.get(
                f"{base_url}{API}/chunks/{version}",
                params=params,
                headers=headers,
                timeout=timeout,
                allow_redirects=False,
            ) as resp:
                if resp.status != 200:
                    body = (await resp.text())[:200]
                    # a relay that no longer holds the version is not at fault: "gone", not "refused"
                    reason = "gone" if resp.status == 404 and "not_held" in body else "refused"
                    raise ParentFailed(reason, f"HTTP {resp.status}: {body}")
                last_chunk = time.monotonic()
                while (header := await self._read(resp.content, HEADER.size, at_frame=True)) is not None:
                    index, length = HEADER.unpack(header)
                    if index == KEEPALIVE:
                        if time.monotonic() - last_chunk > STARVED_FACTOR * self.progress_timeout:
                            raise ParentFailed("stalled", "only keep-alives, no chunk")
                        continue
                    if index == GONE:
                        held = time.monotonic() - last_chunk
                        if relay and held > self.progress_timeout:
                            # keep-alives for a progress timeout, then "gone": it held the child with
                            # nothing, which costs score like slow bytes (issue 41 item 7)
                            raise ParentFailed("stalled", f"keep-alives for {held:.1f}s, no chunk, then gone")
                        raise ParentFailed("gone", "the parent no longer holds this version")
                    if not 0 <= index < manifest.num_chunks or length != _chunk_len(manifest, index):
                        raise ParentFailed("bad_chunk", f"frame for chunk {index} of {length} bytes")
                    data = await self._read(resp.content, length, meter=meter)
                    if not store.put(version, index, data):
                        if version not in store.manifests:
                            raise DroppedVersion("gone", f"version {version} left the store")
                        raise ParentFailed("bad_chunk", f"chunk {index} does not match its hash")
                    received += length
                    last_chunk = time.monotonic()
        except TimeoutError:  # before OSError, of which it is a subclass
            raise ParentFailed("stalled", f"nothing for {self.progress_timeout}s") from None
        except (aiohttp.ClientError, OSError, asyncio.IncompleteReadError) as e:
            raise ParentFailed("unreachable", repr(e)) from None
        if not store.complete(version):
            raise ParentFailed("incomplete", "the stream ended before the last chunk")
        return received

    async def _read(
        self,
        content: aiohttp.StreamReader,
        n: int,
        *,
        at_frame: bool = False,
        meter: RelayMeter | None = None,
    ) -> bytes | None:
        """`n` bytes, each piece within the progress timeout and paced by the download cap. At a
        frame boundary a clean end of stream returns None."""
        if at_frame and n <= PIECE:
            try:
                async with asyncio.timeout(self.progress_timeout):
                    return await content.readexactly(n)
            except asyncio.IncompleteReadError as e:
                if not e.partial:
                    return None
                raise
        parts = []
        for at in range(0, n, PIECE):
            size = min(PIECE, n - at)
            if self.download_bucket is not None:
                await self.download_bucket.consume(size)
            t0 = time.monotonic()
            async with asyncio.timeout(self.progress_timeout):
                parts.append(await content.readexactly(size))
            if meter is not None:
                meter.add(size, time.monotonic() - t0)
        return b"".join(parts)


def _chunk_len(manifest: Manifest, index: int) -> int:
    start, end = manifest.chunk_range(index)
    return end - start
