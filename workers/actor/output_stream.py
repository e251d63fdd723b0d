"""A worker's per-step output batches pushed to each front over a socket.

Pulling them with a Ray call per step (a long poll) cost ~1 ms of CPU per batch across the
front, the actor and their gRPC threads, and woke ~8 threads; on cores shared with a spinning
OpenMP team each wake-up preempts a team thread and stalls its partner at the next barrier.
Here the engine thread writes a front's batch straight into that front's socket: one
non-blocking send, no other thread woken. Bytes the socket cannot take at once wait for a
writer thread. A front connects, sends a hello frame holding its front id, gets an empty batch
as the answer once it is registered, then reads frames until EOF, which means the worker is gone.

Frame: 4-byte little-endian length, then the payload (a msgpack batch, ``workers.actor.messages``).
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import logging
import select
import socket
import struct
import threading
from collections.abc import Callable

from baton_serve.workers.thread_name import name_this_thread

log = logging.getLogger("baton.output")

FRAME = struct.Struct("<I")
MAX_HELLO = 256
# A front that stops reading loses its connection past this much unsent output (it then sees EOF
# and fails its requests) instead of growing the worker's memory without bound.
MAX_PENDING = 64 << 20


def frame(payload: bytes) -> bytes:
    """``payload`` with its length in front."""
    return FRAME.pack(len(payload)) + payload


def read_frame(sock: socket.socket, limit: int) -> bytes:
    """One frame from a blocking socket; ConnectionError on EOF or a frame over ``limit`` bytes."""
    (size,) = FRAME.unpack(_read_exactly(sock, FRAME.size))
    if size > limit:
        raise ConnectionError(f"frame of {size} bytes (limit {limit})")
    return _read_exactly(sock, size)


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)


class FrontConnection:
    """One front's socket: sends never block the caller; what does not fit waits for the writer."""

    def __init__(self, sock: socket.socket, front_id: str, writer: _Writer) -> None:
        sock.setblocking(False)
        self.sock, self.front_id, self._writer = sock, front_id, writer
        self._pending = bytearray()
        self._lock = threading.Lock()
        self.closed = False

    def send(self, payload: bytes) -> bool:
        """Queue one frame; False once the connection is closed (the caller keeps the data)."""
        data = frame(payload)
        with self._lock:
            if self.closed:
                return False
            if self._pending:  # keep order: the writer owns the socket until it has drained
                self._pending += data
            else:
                sent = self._try_send(data)
                if sent is None:
                    return False
                if sent < len(data):
                    self._pending += data[sent:]
            if len(self._pending) > MAX_PENDING:
                log.error("front %s stopped reading (%d bytes unsent): closing its output stream",
                          self.front_id, len(self._pending))
                self._close_locked()
                return True  # dropped on purpose: the front sees EOF and fails its requests
            waiting = bool(self._pending)
        if waiting:
            self._writer.wake(self)
        return True

    def flush(self, on_drained: Callable[[FrontConnection], None]) -> None:
        """Writer thread: send what is pending; once nothing is (or the connection closed), call
        ``on_drained(self)`` still holding the lock, so that a ``send`` racing with it either
        finds bytes pending (and the writer still owns them) or comes after the writer let go
        (and wakes it again): no byte is ever left with nobody to send it."""
        with self._lock:
            if not self.closed and self._pending:
                sent = self._try_send(bytes(self._pending))
                if sent is not None:
                    del self._pending[:sent]
            if self.closed or not self._pending:
                on_drained(self)

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def _try_send(self, data: bytes) -> int | None:
        try:
            return self.sock.send(data)
        except BlockingIOError:
            return 0
        except OSError as exc:  # the front went away
            if exc.errno not in (errno.EPIPE, errno.ECONNRESET, errno.EBADF):
                log.warning("output stream to front %s failed: %r", self.front_id, exc)
            self._close_locked()
            return None

    def _close_locked(self) -> None:
        if not self.closed:
            self.closed = True
            self._pending.clear()
            with contextlib.suppress(OSError):
                self.sock.close()


class _Writer:
    """One thread that drains connections whose socket was full; asleep otherwise."""

    def __init__(self) -> None:
        self._waiting: set[FrontConnection] = set()
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="baton-output-writer", daemon=True)
        self._thread.start()

    def wake(self, conn: FrontConnection) -> None:
        with self._cv:
            self._waiting.add(conn)
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()

    def _drained(self, conn: FrontConnection) -> None:
        with self._cv:  # under conn's lock (flush): no lock ever nests the other way
            self._waiting.discard(conn)

    def _run(self) -> None:
        name_this_thread("baton-output")
        poller = select.poll()  # not select(): a Ray worker's descriptors can pass 1024
        while True:
            with self._cv:
                while not self._waiting and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                conns = list(self._waiting)
            by_fd = {}
            for conn in conns:
                with contextlib.suppress(OSError, ValueError):
                    fd = conn.sock.fileno()
                    if fd >= 0:
                        by_fd[fd] = conn
                        poller.register(fd, select.POLLOUT)
            ready = poller.poll(100) if by_fd else []
            for fd in by_fd:
                with contextlib.suppress(KeyError, OSError):
                    poller.unregister(fd)
            for fd, _ in ready:
                by_fd[fd].flush(self._drained)
            for conn in conns:
                if conn.closed:
                    with self._cv:
                        self._waiting.discard(conn)


def hello_payload(front_id: str, secret: str = "") -> bytes:
    """What a front sends first: its id, and the deployment's secret when there is one."""
    return front_id.encode() + (b"\x00" + secret.encode() if secret else b"")


class OutputServer:
    """Listens for fronts; ``on_hello(front_id, conn)`` registers each (it must send the answer)."""

    def __init__(self, host: str, on_hello: Callable[[str, FrontConnection], None],
                 hello_timeout_s: float = 5.0, secret: str = "") -> None:
        # ``secret``: the deployment's, which a front's hello must carry (``hello_payload``); a
        # connection without it gets nothing, so only this deployment's fronts read its tokens.
        self._secret = secret.encode()
        self._listener = socket.create_server((host, 0))
        self.address = (host, self._listener.getsockname()[1])
        self._on_hello, self._hello_timeout_s = on_hello, hello_timeout_s
        self._writer = _Writer()
        self._conns: list[FrontConnection] = []
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="baton-output-accept", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop accepting and close every front's connection (their readers see EOF)."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._listener.close()
        for conn in list(self._conns):
            conn.close()
        self._writer.stop()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                continue
            try:
                sock.settimeout(self._hello_timeout_s)
                raw_id, _, given = read_frame(sock, MAX_HELLO).partition(b"\x00")
                if self._secret and not hmac.compare_digest(given, self._secret):
                    log.warning("refused an output connection from %s: wrong deployment secret", peer)
                    sock.close()
                    continue
                front_id = raw_id.decode()
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn = FrontConnection(sock, front_id, self._writer)
                self._conns = [c for c in self._conns if not c.closed] + [conn]
                self._on_hello(front_id, conn)
            except (OSError, ConnectionError, UnicodeDecodeError) as exc:
                log.warning("a front's output connection failed at hello: %r", exc)
                with contextlib.suppress(OSError):
                    sock.close()
