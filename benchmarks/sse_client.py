"""A lean streaming HTTP/1.1 client for load generators: POST JSON, yield the SSE ``data:`` payloads.

On a 2-core box the load generator shares the cores with the server it measures, and every
preemption of a worker's OpenMP thread stalls its whole team, so the client's own CPU shows up
in the served figure. httpx (anyio cancel scopes, reader re-registration per read) spent ~4% of
a core at ~260 events/s here; this reads the socket in large blocks and splits events with bytes
operations. It speaks only what the benchmarks need: one request per connection, a ``200``
response with a chunked or close-delimited body.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from urllib.parse import urlsplit


class HTTPStatusError(RuntimeError):
    """The server answered with a status other than 200."""


async def stream_sse(url: str, body: dict, read_size: int = 1 << 16) -> AsyncIterator[bytes]:
    """POST ``body`` as JSON to ``url`` and yield each SSE event's data (bytes, no ``data: ``)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, port, limit=read_size * 4)
    try:
        writer.write(b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                     b"Accept: text/event-stream\r\nConnection: close\r\nContent-Length: %d\r\n\r\n"
                     % ((parts.path or "/").encode(), host.encode(), port, len(payload)) + payload)
        status = await reader.readline()
        headers = (await reader.readuntil(b"\r\n\r\n")).lower()
        if status.split(b" ", 2)[1:2] != [b"200"]:
            raise HTTPStatusError(f"{status.decode().strip()}: {(await reader.read()).decode(errors='replace')[:500]}")
        chunked = b"transfer-encoding: chunked" in headers
        body_bytes = _chunked(reader) if chunked else _until_close(reader, read_size)
        pending = b""
        async for block in body_bytes:
            pending += block
            *events, pending = pending.split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if line.startswith(b"data: "):
                        yield line[6:]
    finally:
        writer.close()


async def _chunked(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while True:
        size = int((await reader.readline()).split(b";", 1)[0], 16)
        if size == 0:
            return
        yield await reader.readexactly(size)
        await reader.readexactly(2)  # the CRLF after each chunk


async def _until_close(reader: asyncio.StreamReader, read_size: int) -> AsyncIterator[bytes]:
    while block := await reader.read(read_size):
        yield block
