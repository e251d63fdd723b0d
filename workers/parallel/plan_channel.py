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

LEN = struct.Struct("<Q")  # a frame's length prefix
HELLO = struct.Struct("<I32s")  # a rank's first bytes: its rank and the replica's secret


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """Exactly ``n`` bytes from ``sock``, or None at end-of-file."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return bytes(buf)


def rank_listener(host: str, world_size: int) -> socket.socket:
    """A socket on ``host`` (any free port) for ranks 1..N-1 to connect to."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((host, 0))
    listener.listen(world_size)
    return listener


def accept_ranks(listener: socket.socket, world_size: int, secret: bytes, timeout_s: float,
                 what: str) -> dict[int, socket.socket]:
    """Accept one connection from each of ranks 1..N-1 on ``listener`` (each sends ``HELLO``
    with the replica's ``secret``; others are dropped), then close the listener."""
    conns: dict[int, socket.socket] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(conns) < world_size - 1:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([listener], [], [], left)[0]:
                missing = sorted(set(range(1, world_size)) - set(conns))
                raise TensorParallelError(f"tensor-parallel ranks {missing} did not connect to the {what} "
                                          f"within {timeout_s}s")
            conn, _ = listener.accept()
            conn.settimeout(max(left, 1.0))
            try:
                hello = recv_exact(conn, HELLO.size)
            except OSError:
                hello = None
            if hello is None:
                conn.close()
                continue
            rank, given = HELLO.unpack(hello)
            if not hmac.compare_digest(given, secret) or not 0 < rank < world_size or rank in conns:
                conn.close()
                continue
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conns[rank] = conn
    except BaseException:
        for conn in conns.values():
            conn.close()
        raise
    finally:
        listener.close()
    return conns


def connect_rank(host: str, port: int, rank: int, secret: str, timeout_s: float, what: str) -> socket.socket:
    """A rank's connection to rank 0's ``host:port``, hello sent."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as exc:
        raise TensorParallelError(f"rank {rank} cannot reach rank 0's {what} at {host}:{port}: {exc}") from exc
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(HELLO.pack(rank, secret.encode()[:32].ljust(32, b"\0")))
    sock.settimeout(None)
    return sock


class PlanSender:
    """Rank 0's end: ``listen``, hand out the port, ``accept`` every rank, then ``send`` per step."""

    def __init__(self, host: str, world_size: int, secret: str) -> None:
        self.world_size, self.secret = world_size, secret
        self._secret = secret.encode()[:32].ljust(32, b"\0")
        self._listener = rank_listener(host, world_size)
        self.port = self._listener.getsockname()[1]
        self._conns: dict[int, socket.socket] = {}
        self.lost: int | None = None  # a rank whose connection closed
        self._lock = threading.Lock()

    def accept(self, timeout_s: float) -> None:
        """Wait for ranks 1..N-1 (each proves it holds the replica's secret)."""
        self._conns = accept_ranks(self._listener, self.world_size, self._secret, timeout_s, "plan channel")
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
        frame = LEN.pack(len(payload)) + payload
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
        self._sock = connect_rank(host, port, rank, secret, timeout_s, "plan channel")

    def recv(self) -> bytes | None:
        """The next frame; None once rank 0 has closed the channel (or died)."""
        try:
            head = recv_exact(self._sock, LEN.size)
            if head is None:
                return None
            return recv_exact(self._sock, LEN.unpack(head)[0])
        except OSError:
            return None

    def close(self) -> None:
        self._sock.close()
