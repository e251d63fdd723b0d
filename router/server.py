"""HTTP plumbing: run an ASGI app with uvicorn, SSE responses, and client-disconnect watching.

The server runs in the foreground (``run_server``) or on a background thread (``ServerThread``).
The socket is bound before uvicorn starts, so ``port=0`` picks a free port that is known at
once and a port in use fails in ``start()`` rather than inside the thread.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import uvicorn
from starlette.responses import StreamingResponse

LOOPBACK = "127.0.0.1"


def bind_socket(host: str = LOOPBACK, port: int = 0, reuse_port: bool = False) -> socket.socket:
    """A listening-ready TCP socket on ``host:port`` (0: a free port).

    ``reuse_port`` lets several front replicas bind one port; the kernel spreads connections.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _config(app: Any, host: str, log_level: str, graceful_timeout_s: float) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, log_level=log_level, access_log=False, lifespan="on",
                          timeout_graceful_shutdown=graceful_timeout_s)


def run_server(app: Any, host: str = LOOPBACK, port: int = 8000, log_level: str = "info",
               graceful_timeout_s: float = 10.0) -> None:
    """Serve ``app`` in the foreground until SIGINT/SIGTERM (open streams get ``graceful_timeout_s``)."""
    sock = bind_socket(host, port)
    try:
        uvicorn.Server(_config(app, host, log_level, graceful_timeout_s)).run(sockets=[sock])
    finally:
        sock.close()


class ServerThread:
    """uvicorn serving ``app`` on a daemon thread.

    ``start()`` returns once the server accepts connections; ``stop()`` asks it to exit, gives
    open connections ``graceful_timeout_s``, and joins the thread. Usable as a context manager.
    """

    def __init__(self, app: Any, host: str = LOOPBACK, port: int = 0, log_level: str = "warning",
                 graceful_timeout_s: float = 5.0, reuse_port: bool = False) -> None:
        self.host = host
        self._sock = bind_socket(host, port, reuse_port)
        self.port: int = self._sock.getsockname()[1]
        self._server = uvicorn.Server(_config(app, host, log_level, graceful_timeout_s))
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        """``http://host:port`` (no trailing slash)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        """Start serving; raise RuntimeError if the server is not up within ``timeout`` seconds."""
        if self._thread is not None:
            raise RuntimeError("server already started")
        self._thread = threading.Thread(target=self._run, name=f"uvicorn-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f"server on {self.url} failed to start: {self._error!r}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server on {self.url} did not start within {timeout}s")
            time.sleep(0.01)
        return self

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._sock])
        except BaseException as exc:  # SystemExit from a failed startup included
            self._error = exc

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving and join the thread (idempotent)."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                self._server.force_exit = True
                self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no caching, no proxy buffering


class EventStreamResponse(StreamingResponse):
    """SSE response that runs ``on_close`` however the stream ends (done, error, client gone)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None],
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={**SSE_HEADERS, **(headers or {})})
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def run_until_disconnected(receive: Any, work: Coroutine[Any, Any, Any]) -> Any:
    """Await ``work`` unless the client disconnects first (then cancel it, raise ClientGone).

    ``receive`` is the ASGI receive callable; the body must already have been read, so the
    next message it returns is ``http.disconnect``.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.wait({task})
    raise ClientGone()


class ClientGone(Exception):
    """The HTTP client went away before the response was ready."""


async def _wait_disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
