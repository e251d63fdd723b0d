"""Rank 0's step plans to the other ranks of its replica: one length-prefixed frame per step down
a TCP connection per rank.

Not a collective: a replica idles between requests for as long as it likes, and a rank waiting
for the next plan must neither time out nor spin. A rank whose rank 0 is gone reads end-of-file
and exits; rank 0 learns of a rank that is gone when its connection closes (``lost``) or the
next all-reduce fails.
"""

from __future__ import annotations

import hmac
import select
import socket
import struct
import threading
import time

from baton_serve.workers.errors import TensorParallelError

_LEN = struct.Struct("<Q")
_HELLO = struct.Struct("<I32s")


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return bytes(buf)


class PlanSender:
    """Rank 0's end: ``listen``, hand out the port, ``accept`` every rank, then ``send`` per step."""

    def __init__(self, host: str, world_size: int, secret: str) -> None:
        self.world_size, self.secret = world_size, secret
        self._secret = secret.encode()[:32].ljust(32, b"\0")
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind((host, 0))
        self._listener.listen(world_size)
        self.port = self._listener.getsockname()[1]
        self._conns: dict[int, socket.socket] = {}
        self.lost: int | None = None  # a rank whose connection closed
        self._lock = threading.Lock()

    def accept(self, timeout_s: float) -> None:
        """Wait for ranks 1..N-1 (each proves it holds the replica's secret)."""
        deadline = time.monotonic() + timeout_s
        while len(self._conns) < self.world_size - 1:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._listener], [], [], left)[0]:
                missing = sorted(set(range(1, self.world_size)) - set(self._conns))
                raise TensorParallelError(f"tensor-parallel ranks {missing} did not connect within {timeout_s}s")
            conn, _ = self._listener.accept()
            conn.settimeout(max(left, 1.0))
            try:
                hello = _recv_exact(conn, _HELLO.size)
            except OSError:
                hello = None
            if hello is None:
                conn.close()
                continue
            rank, secret = _HELLO.unpack(hello)
            if not hmac.compare_digest(secret, self._secret) or not 0 < rank < self.world_size or rank in self._conns:
                conn.close()
                continue
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._conns[rank] = conn
        self._listener.close()
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()

    def _watch(self) -> None:
        # Ranks never write after their hello: readable means closed (the rank died).
        conns = dict(self._conns)
        while conns and self.lost is None:
            try:
                ready, _, _ = select.select(list(conns.values()), [], [], 1.0)
            except (OSError, ValueError):
                return
            for rank, conn in list(conns.items()):
                if conn in ready:
                    try:
                        data = conn.recv(1, socket.MSG_PEEK)
                    except OSError:
                        data = b""
                    if not data:
                        self.lost = rank
                        return

    def check(self) -> None:
        """Raise ``TensorParallelError`` if a rank is known to be gone."""
        if self.lost is not None:
            raise TensorParallelError(f"tensor-parallel rank {self.lost} of {self.world_size} is gone")

    def send(self, payload: bytes) -> None:
        """The same frame to every rank, in rank order."""
        self.check()
        frame = _LEN.pack(len(payload)) + payload
        with self._lock:
            for rank, conn in self._conns.items():
                try:
                    conn.sendall(frame)
                except OSError as exc:
                    self.lost = rank
                    raise TensorParallelError(f"tensor-parallel rank {rank} is gone: {exc}") from exc

    def close(self) -> None:
        """Close every connection: the ranks read end-of-file and exit."""
        with self._lock:
            for conn in self._conns.values():
                conn.close()
            self._conns.clear()
        self._listener.close()


class PlanReceiver:
    """A rank's end: connect to rank 0, then ``recv`` frames until rank 0 closes (None)."""

    def __init__(self, host: str, port: int, rank: int, secret: str, timeout_s: float) -> None:
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as exc:
            raise TensorParallelError(f"rank {rank} cannot reach rank 0's plan channel at {host}:{port}: "
                                      f"{exc}") from exc
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.sendall(_HELLO.pack(rank, secret.encode()[:32].ljust(32, b"\0")))
        self._sock.settimeout(None)

    def recv(self) -> bytes | None:
        """The next frame; None once rank 0 has closed the channel (or died)."""
        try:
            head = _recv_exact(self._sock, _LEN.size)
            if head is None:
                return None
            return _recv_exact(self._sock, _LEN.unpack(head)[0])
        except OSError:
            return None

    def close(self) -> None:
        self._sock.close()
