"""A fake OpenAI-compatible streaming server with known delays, to test the measurement itself.

Raw asyncio HTTP/1.1 on 127.0.0.1 in a background thread: ``GET /v1/models`` and streamed
``POST /v1/completions`` / ``/v1/chat/completions``. Each response sends its headers (and, for
chat, the role chunk) at once, then ``max_tokens`` one-token chunks: the first ``ttft_s`` after
the request arrived, the rest ``itl_s`` apart, then a usage chunk and ``[DONE]``. A body with
``"stream": false`` gets one JSON response, with usage, when its last token is due. A *stall*
(triggered by the ``stall_at``-th request, 0-based) holds every emission for ``stall_s``
seconds, like a GC pause or a preempted host.

    python -m baton_serve.cluster.bench.fakeserver --port 8123 --ttft-ms 200 --itl-ms 50   # try `baton bench` on it
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class FakeServerConfig:
    """Injected behaviour. ``ttft_for(i)`` overrides ``ttft_s`` for the i-th request (arrival order);
    every ``fail_every``-th request (1-based) gets HTTP 500; ``capacity`` > 0 serves at most that
    many streams at once, the rest queueing (so latency grows with load past saturation).
    ``cached_tokens_for(i, prompt_tokens)`` gives the i-th request's usage
    ``prompt_tokens_details.cached_tokens``; None (the default, or returned) leaves the details out."""

    ttft_s: float = 0.2
    itl_s: float = 0.05
    ttft_for: Callable[[int], float] | None = None
    stall_at: int | None = None
    stall_s: float = 0.0
    fail_every: int = 0
    capacity: int = 0
    model: str = "fake-model"
    cached_tokens_for: Callable[[int, int], int | None] | None = None


@dataclass
class _State:
    count: int = 0
    stall_until: float = 0.0
    bodies: list[dict[str, Any]] = field(default_factory=list)


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


class FakeOpenAIServer:
    """Use as a context manager; ``url`` is the base URL, ``bodies`` the JSON bodies received."""

    def __init__(self, config: FakeServerConfig | None = None, port: int = 0) -> None:
        self.config = config or FakeServerConfig()
        self.port = port
        self.state = _State()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._slots: asyncio.Semaphore | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def bodies(self) -> list[dict[str, Any]]:
        return self.state.bodies

    async def _hold(self) -> None:
        # A stall holds every emission, not just new arrivals.
        wait = self.state.stall_until - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)

    async def _sleep_until(self, t: float) -> None:
        await asyncio.sleep(max(0.0, t - time.perf_counter()))
        await self._hold()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            arrived = time.perf_counter()
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
            raw = await reader.readexactly(int(headers.get("content-length", "0")))
            if method == "GET" and path == "/v1/models":
                payload = json.dumps({"object": "list", "data": [{"id": self.config.model, "object": "model"}]})
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                             + f"Content-Length: {len(payload)}\r\n\r\n{payload}".encode())
            elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
                await self._stream(json.loads(raw), path.endswith("chat/completions"), arrived, writer)
            else:
                writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass  # a client that went away mid-request: nothing to do
        finally:
            writer.close()

    async def _stream(self, body: dict[str, Any], chat: bool, arrived: float,
                      writer: asyncio.StreamWriter) -> None:
        cfg, st = self.config, self.state
        index = st.count
        st.count += 1
        st.bodies.append(body)
        if cfg.stall_at is not None and index == cfg.stall_at:
            st.stall_until = arrived + cfg.stall_s
        if cfg.fail_every and (index + 1) % cfg.fail_every == 0:
            msg = json.dumps({"error": {"message": "injected failure", "type": "server_error", "code": 500}})
            writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n"
                         + f"Connection: close\r\nContent-Length: {len(msg)}\r\n\r\n{msg}".encode())
            return
        if body.get("stream") is False:  # only when asked: a body without "stream" is streamed, as before
            await self._whole(body, chat, arrived, index, writer)
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
        base = {"id": f"fake-{index}", "model": cfg.model, "created": int(time.time())}
        if chat:
            writer.write(_sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}))
        await writer.drain()
        if self._slots is not None:
            async with self._slots:
                await self._tokens(body, chat, time.perf_counter(), index, writer)
        else:
            await self._tokens(body, chat, arrived, index, writer)

    async def _tokens(self, body: dict[str, Any], chat: bool, start: float, index: int,
                      writer: asyncio.StreamWriter) -> None:
        cfg = self.config
        base = {"id": f"fake-{index}", "model": cfg.model, "created": int(time.time())}
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        ttft = cfg.ttft_for(index) if cfg.ttft_for is not None else cfg.ttft_s
        await self._sleep_until(start + ttft)
        first = time.perf_counter()
        for k in range(n):
            if k:
                # Against a fixed grid from the first token, so sleep overshoot does not accumulate.
                await self._sleep_until(max(first + k * cfg.itl_s, time.perf_counter()))
            last = k == n - 1
            choice: dict[str, Any] = ({"index": 0, "delta": {"content": " tok"}} if chat
                                      else {"index": 0, "text": " tok"})
            choice["finish_reason"] = "length" if last else None
            writer.write(_sse({**base, "choices": [choice]}))
            await writer.drain()
        if (body.get("stream_options") or {}).get("include_usage"):
            writer.write(_sse({**base, "choices": [], "usage": self._usage(body, index, n)}))
        writer.write(b"data: [DONE]\n\n")

    def _usage(self, body: dict[str, Any], index: int, n_out: int) -> dict[str, Any]:
        prompt = body.get("prompt", "")
        n_in = len(prompt) if isinstance(prompt, list) else len(str(prompt or body.get("messages", "")).split())
        usage: dict[str, Any] = {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}
        cached = self.config.cached_tokens_for(index, n_in) if self.config.cached_tokens_for else None
        if cached is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    async def _whole(self, body: dict[str, Any], chat: bool, arrived: float, index: int,
                     writer: asyncio.StreamWriter) -> None:
        """A non-streamed response, sent when a stream's last token would have been (``capacity`` applies)."""
        cfg = self.config
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        ttft = cfg.ttft_for(index) if cfg.ttft_for is not None else cfg.ttft_s
        async with self._slots or contextlib.nullcontext():
            start = arrived if self._slots is None else time.perf_counter()
            await self._sleep_until(start + ttft + (n - 1) * cfg.itl_s)
        text = " tok" * n
        choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat
                                  else {"index": 0, "text": text})
        choice["finish_reason"] = "length"
        payload = json.dumps({"id": f"fake-{index}", "object": "chat.completion" if chat else "text_completion",
                              "model": cfg.model, "created": int(time.time()), "choices": [choice],
                              "usage": self._usage(body, index, n)})
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                     + f"Content-Length: {len(payload)}\r\n\r\n{payload}".encode())

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._slots = asyncio.Semaphore(self.config.capacity) if self.config.capacity > 0 else None
        server = await asyncio.start_server(self._handle, "127.0.0.1", self.port, backlog=1024)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        async with server:
            await self._stop.wait()

    def start(self) -> FakeOpenAIServer:
        """Start serving in a daemon thread; returns once the port is bound."""
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True,
                                        name="fake-openai-server")
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fake server did not start")
        return self

    def stop(self) -> None:
        """Stop serving and join the thread (bounded)."""
        thread, loop, stop = self._thread, self._loop, self._stop
        if thread is not None and thread.is_alive() and loop is not None and stop is not None:
            loop.call_soon_threadsafe(stop.set)
            thread.join(10)

    def __enter__(self) -> FakeOpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    """Serve until Ctrl-C."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--ttft-ms", type=float, default=200.0)
    p.add_argument("--itl-ms", type=float, default=50.0)
    args = p.parse_args(argv)
    server = FakeOpenAIServer(FakeServerConfig(ttft_s=args.ttft_ms / 1e3, itl_s=args.itl_ms / 1e3), args.port)
    with server:
        print(f"fake OpenAI server on {server.url}", flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
