"""Output streams: a worker pushes per-step batches to a front over a socket (workers.output_stream)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from workers import output_stream
from workers.output_stream import FRAME, OutputServer, frame, read_frame


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
