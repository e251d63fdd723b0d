"""Output streams: a worker pushes per-step batches to a front over a socket (workers.actor.output_stream)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from baton_serve.workers.actor import output_stream
from baton_serve.workers.actor.output_stream import FRAME, OutputServer, frame, read_frame


class _Registry:
    """What a worker does on hello: keep the connection and answer with an empty batch."""

    def __init__(self) -> None:
        self.conns: dict[str, output_stream.FrontConnection] = {}
        self.ready = threading.Event()

    def __call__(self, front_id: str, conn: output_stream.FrontConnection) -> None:
        self.conns[front_id] = conn
        conn.send(b"")
        self.ready.set()


def _front(server: OutputServer, front_id: str = "front-a") -> socket.socket:
    sock = socket.create_connection(server.address, timeout=10)
    sock.sendall(frame(front_id.encode()))
    assert read_frame(sock, 1 << 20) == b""  # the answer: registered
    return sock


@pytest.fixture
def connected():
    """(the front's socket, the worker side's connection to it) on a running server."""
    reg = _Registry()
    server = OutputServer("127.0.0.1", reg)
    try:
        sock = _front(server)
        yield sock, reg.conns["front-a"]
    finally:
        server.close()


def test_frames_arrive_in_order_for_the_front_that_said_hello(connected):
    sock, conn = connected
    payloads = [bytes([i]) * (i * 37) for i in range(50)]
    for p in payloads:
        assert conn.send(p)
    assert [read_frame(sock, 1 << 20) for _ in payloads] == payloads


def test_a_slow_reader_never_blocks_the_sender_and_still_gets_every_byte_in_order(connected):
    sock, conn = connected
    # Far more than a loopback socket buffers: the sender must return at once each time and
    # leave the rest to the writer thread.
    payloads = [bytes([i % 251]) * 500_000 for i in range(40)]  # 20 MB
    started = time.monotonic()
    for p in payloads:
        assert conn.send(p)
    assert time.monotonic() - started < 5.0
    assert conn._pending  # the socket could not take it all: the writer holds the rest
    assert [read_frame(sock, 1 << 20) for _ in payloads] == payloads


def test_a_front_that_hangs_up_makes_send_report_false(connected):
    sock, conn = connected
    sock.close()
    deadline = time.monotonic() + 10
    while conn.send(b"x" * 1000):  # the first sends may still land in the kernel's buffer
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert conn.closed


def test_closing_the_server_gives_fronts_eof():
    reg = _Registry()
    server = OutputServer("127.0.0.1", reg)
    sock = _front(server)
    server.close()
    with pytest.raises(ConnectionError):
        read_frame(sock, 1 << 20)


def test_a_bad_hello_is_dropped_and_the_server_keeps_accepting():
    reg = _Registry()
    server = OutputServer("127.0.0.1", reg, hello_timeout_s=2.0)
    try:
        bad = socket.create_connection(server.address, timeout=10)
        bad.sendall(FRAME.pack(output_stream.MAX_HELLO + 1) + b"x" * 10)  # over the hello limit
        with pytest.raises(ConnectionError):
            read_frame(bad, 1 << 20)
        _front(server, "front-b")
        assert set(reg.conns) == {"front-b"}
    finally:
        server.close()


def test_a_front_that_stops_reading_is_cut_off_at_the_pending_limit(connected, monkeypatch):
    monkeypatch.setattr(output_stream, "MAX_PENDING", 1 << 20)
    sock, conn = connected
    for _ in range(200):  # 20 MB at most; the socket holds a few MB, the limit 1 MB more
        conn.send(b"z" * 100_000)
        if conn.closed:
            break
    assert conn.closed
    sock.settimeout(10)
    with pytest.raises(ConnectionError):  # it reads what the kernel had, then EOF
        while True:
            read_frame(sock, 1 << 20)


class _ScriptedSocket:
    """A socket whose ``send`` takes at most the next scripted count (all, when none is left),
    keeping what it took; ``fileno`` is a real, always writable socket's, for the writer's poll."""

    def __init__(self) -> None:
        self._pair = socket.socketpair()
        self.taken = bytearray()
        self.limits: list[int] = []

    def fileno(self) -> int:
        return self._pair[0].fileno()

    def setblocking(self, flag: bool) -> None:
        pass

    def send(self, data: bytes) -> int:
        n = min(len(data), self.limits.pop(0)) if self.limits else len(data)
        self.taken += data[:n]
        return n

    def close(self) -> None:
        for s in self._pair:
            s.close()


def test_a_send_racing_the_writer_as_it_drains_is_never_stranded(monkeypatch):
    """The writer has just sent the last pending byte when the engine thread sends again and the
    socket takes only part of it: the rest must still reach the front. (It used to stay pending
    with no writer watching until some later send, which, for a stream's last frame, never came:
    the front then waited for ever.)"""
    writer = output_stream._Writer()
    sock = _ScriptedSocket()
    conn = output_stream.FrontConnection(sock, "front-a", writer)
    original = output_stream.FrontConnection.flush
    raced: list[bool] = []

    def flush_then_send(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if not raced:  # right after the writer drained the socket, before it looks again
            raced.append(True)
            sock.limits = [3]  # the socket takes 3 bytes of the next frame
            assert self.send(b"second")
        return result

    monkeypatch.setattr(output_stream.FrontConnection, "flush", flush_then_send)
    try:
        sock.limits = [0]  # full: all of the first frame waits for the writer
        assert conn.send(b"first")
        want = frame(b"first") + frame(b"second")
        deadline = time.monotonic() + 5
        while bytes(sock.taken) != want and time.monotonic() < deadline:
            time.sleep(0.01)
        assert raced and bytes(sock.taken) == want
    finally:
        writer.stop()
        conn.close()


def test_a_hello_without_the_deployments_secret_gets_nothing():
    reg = _Registry()
    server = OutputServer("127.0.0.1", reg, hello_timeout_s=2.0, secret="s3cret")
    try:
        for payload in (b"front-x", output_stream.hello_payload("front-x", "guess")):
            intruder = socket.create_connection(server.address, timeout=10)
            intruder.sendall(frame(payload))
            with pytest.raises(ConnectionError):
                read_frame(intruder, 1 << 20)
        sock = socket.create_connection(server.address, timeout=10)
        sock.sendall(frame(output_stream.hello_payload("front-ok", "s3cret")))
        assert read_frame(sock, 1 << 20) == b""
        assert set(reg.conns) == {"front-ok"}
    finally:
        server.close()
