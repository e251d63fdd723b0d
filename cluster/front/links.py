"""Each worker's deltas into the front: from its output stream (a socket the worker pushes per-step
msgpack batches into, ``workers.actor.output_stream``), or, where the front cannot connect, by
polling it over Ray. I/O only: what the deltas mean is the client's and the streams' business.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from baton_serve.cluster.front.workers import WorkerRef
from baton_serve.workers.actor.messages import decode_deltas
from baton_serve.workers.actor.output_stream import FRAME, frame, hello_payload
from baton_serve.workers.engine.outputs import TokenDelta

log = logging.getLogger("baton.pool")

Deliver = Callable[[list[TokenDelta], str | None], None]


class WorkerLinks:
    """Reads every worker's deltas for front ``front_id``: ``deliver(deltas, worker_id)`` gets them,
    ``on_dead(worker, error)`` hears when a worker's stream ends or its polls fail."""

    def __init__(self, front_id: str, deliver: Deliver, on_dead: Callable[[WorkerRef, BaseException], None]) -> None:
        self.front_id = front_id
        self.deliver = deliver
        self.on_dead = on_dead
        self._writers: list[asyncio.StreamWriter] = []

    async def listen(self, w: WorkerRef) -> asyncio.Task:
        """Start taking ``w``'s deltas: from its output stream, or by polling it. Returns the task."""
        reader = await self._connect(w)
        loop = self._read_loop(w, reader, w.incarnation) if reader is not None else self._poll_loop(w, w.incarnation)
        return asyncio.create_task(loop)

    def close(self) -> None:
        for writer in self._writers:
            writer.close()
        self._writers.clear()

    async def _connect(self, w: WorkerRef, timeout_s: float = 10.0) -> asyncio.StreamReader | None:
        """Open ``w``'s output stream; None (poll it instead) where it has none or it fails."""
        address = w.info.get("output_address")
        if not address:
            return None

        async def hello() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            reader, writer = await asyncio.open_connection(address[0], int(address[1]))
            try:
                # The secret comes with the worker's info, over Ray: only members of the Ray cluster
                # can read it, and only its holders can read the worker's output socket.
                writer.write(frame(hello_payload(self.front_id, w.info.get("output_secret", ""))))
                # The worker answers once it has registered us: from then on nothing goes to an
                # outbox that nobody polls. The answer carries what that outbox held.
                self.deliver(decode_deltas(await _read_frame(reader)), w.worker_id)
            except BaseException:
                writer.close()
                raise
            return reader, writer

        try:
            reader, writer = await asyncio.wait_for(hello(), timeout_s)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
            log.warning("no output stream from worker %s at %s (%r): polling it over Ray", w.worker_id,
                        address, exc)
            return None
        self._writers.append(writer)
        return reader

    async def _read_loop(self, w: WorkerRef, reader: asyncio.StreamReader, incarnation: int) -> None:
        try:
            while True:
                self.deliver(decode_deltas(await _read_frame(reader)), w.worker_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # EOF or reset: the worker process is gone
            if w.incarnation == incarnation:  # (not a restarted one's stream ending late)
                log.error("worker %s closed its output stream: %r", w.worker_id, exc)
                self.on_dead(w, exc)

    async def _poll_loop(self, w: WorkerRef, incarnation: int) -> None:
        while w.incarnation == incarnation:
            try:
                data = await w.handle.poll.remote(self.front_id, 0.5)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the actor died: fail its requests, stop routing to it
                if w.incarnation == incarnation:
                    log.error("worker %s failed: %r", w.worker_id, exc)
                    self.on_dead(w, exc)
                return
            if data:
                self.deliver(decode_deltas(data), w.worker_id)


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    (size,) = FRAME.unpack(await reader.readexactly(FRAME.size))
    return await reader.readexactly(size)
