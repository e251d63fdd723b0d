"""The load generator's streaming client: events split across chunks, errors, close-delimited bodies."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.sse_client import HTTPStatusError, stream_sse


async def _serve(response: bytes, seen: list[bytes]) -> tuple[asyncio.AbstractServer, str]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1])
        seen.append(head + await reader.readexactly(length))
        for i in range(0, len(response), 7):  # dribble it out: chunks and events straddle reads
            writer.write(response[i:i + 7])
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"


def _chunked(body: bytes, size: int) -> bytes:
    out = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size]) for i in range(0, len(body), size))
    return out + b"0\r\n\r\n"


def _collect(response: bytes) -> tuple[list[bytes], list[bytes]]:
    async def main() -> tuple[list[bytes], list[bytes]]:
        seen: list[bytes] = []
        server, url = await _serve(response, seen)
        async with server:
            return [d async for d in stream_sse(url, {"prompt": "hi", "stream": True})], seen
    return asyncio.run(main())


EVENTS = b'data: {"a":1}\n\n: a comment\n\ndata: {"usage":{"completion_tokens":3}}\n\ndata: [DONE]\n\n'


def test_chunked_events_are_reassembled_across_chunk_boundaries():
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    events, seen = _collect(head + _chunked(EVENTS, 5))
    assert events == [b'{"a":1}', b'{"usage":{"completion_tokens":3}}', b"[DONE]"]
    assert seen[0].startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert seen[0].endswith(b'{"prompt": "hi", "stream": true}')


def test_a_close_delimited_body_and_an_error_status():
    events, _ = _collect(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n" + EVENTS)
    assert events[-1] == b"[DONE]" and len(events) == 3
    with pytest.raises(HTTPStatusError, match='400 Bad Request: {"error"'):
        _collect(b'HTTP/1.1 400 Bad Request\r\ncontent-length: 11\r\n\r\n{"error":1}')
