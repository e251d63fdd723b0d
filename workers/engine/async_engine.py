"""An asyncio front to ``EngineCore``: the engine loop runs on its own thread.

``generate`` yields one request's token deltas as they are produced; leaving the iterator early
(client gone, task cancelled) aborts the request inside the engine, which frees its KV blocks
within one step. The Ray worker actor and the in-process (colocated) HTTP server both use it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from baton_serve.workers.actor.core_share import CoreShare
from baton_serve.workers.engine.core import EngineCore
from baton_serve.workers.engine.outputs import TokenDelta
from baton_serve.workers.engine.stats import EngineStats, engine_stats  # noqa: F401 (EngineStats: re-exported)
from baton_serve.workers.sampling.params import SamplingParams
from baton_serve.workers.thread_name import name_this_thread


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    remaining: int  # samples not finished yet
    done: bool = False


class AsyncEngine:
    """Thread-owned engine loop with asyncio producers and consumers.

    Only the loop thread touches the engine; other threads post commands to the inbox.
    ``on_step`` (optional) is called on the loop thread after each step with its deltas.
    ``engine`` may be a factory: the loop thread then builds the engine (and ``__init__`` waits
    for it), so that one thread does all of the model's compute, loading included. That keeps
    the process at one OpenMP team, which libgomp needs to spin-wait (see ``kernels.openmp``).
    ``core_share`` (optional): each step first waits for its turn at cores this worker shares
    with others on the machine (``workers.actor.core_share``).
    """

    def __init__(self, engine: EngineCore | Callable[[], EngineCore],
                 on_step: Callable[[list[TokenDelta]], None] | None = None,
                 idle_wait_s: float = 0.05, core_share: CoreShare | None = None) -> None:
        self.core_share = core_share
        factory = engine if callable(engine) and not isinstance(engine, EngineCore) else None
        self.engine = engine if factory is None else None
        self.on_step = on_step
        self.idle_wait_s = idle_wait_s
        self._inbox: list[Callable[[], None]] = []
        self._turn_inbox: list[Callable[[], None]] = []  # run while holding the cores (call_in_turn)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stop = False
        self._error: BaseException | None = None
        built = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(factory, built), name="baton-engine",
                                        daemon=True)
        self._thread.start()
        built.wait()
        if self.engine is None:  # the factory raised: its error, as is, to the caller
            raise self._error

    # ------------------------------------------------------------------ public API
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, cache_salt: str | None = None,
                       arrival_time: float | None = None, tenant: str = "",
                       ticket: Any = None) -> AsyncIterator[TokenDelta]:
        """Yield the request's deltas until all ``n`` samples finish.

        ``ticket`` (an admission ticket, when a gate runs in front) names the tenant when ``tenant``
        does not; this engine has no KV admission of its own, so nothing else of it is used.

        Raises InvalidRequestError before queueing anything when the request cannot run.
        """
        self._raise_if_dead()
        tenant = tenant or getattr(ticket, "tenant_name", "")
        self.engine.validate(prompt_token_ids, params)  # read-only: safe off the loop thread
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue(), params.n)
        arrival = arrival_time or time.monotonic()

        def add() -> None:
            try:
                self.engine.add_request(request_id, prompt_token_ids, params, priority=priority,
                                        cache_salt=cache_salt, arrival_time=arrival, tenant=tenant)
            except Exception as exc:  # duplicate id and the like: fail this stream only
                self._streams.pop(request_id, None)
                loop.call_soon_threadsafe(stream.queue.put_nowait, exc)

        with self._lock:
            if request_id in self._streams:
                from baton_serve.workers.errors import InvalidRequestError

                raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
            self._streams[request_id] = stream
        self._post(add)
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    stream.remaining -= 1
                    if stream.remaining == 0:
                        stream.done = True
                        return
        finally:
            if not stream.done:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if unknown or finished); takes effect before the next step."""
        def do_abort() -> None:
            self.engine.abort_request(request_id)
            self._streams.pop(request_id, None)

        self._post(do_abort)

    def finish_sample(self, request_id: str, index: int, stop: str) -> None:
        """A stop string matched on the front: finish that sample in the engine."""
        self._post(lambda: self.engine.finish_request(request_id, index, "stop", stop))

    def stats(self) -> EngineStats:
        return engine_stats(self.engine)

    def submit(self, fn: Callable[[EngineCore], Any]) -> None:
        """Run ``fn(engine)`` on the loop thread before the next step; do not wait for it."""
        self._post(lambda: fn(self.engine))

    def call(self, fn: Callable[[EngineCore], Any], timeout: float = 30.0) -> Any:
        """Run ``fn(engine)`` on the loop thread and return its result (for control operations)."""
        return self._call(fn, timeout, in_turn=False)

    def call_in_turn(self, fn: Callable[[EngineCore], Any], timeout: float = 30.0) -> Any:
        """Like ``call``, but ``fn`` runs right before a step, while this worker holds its turn at
        cores it shares: bulk work (a KV copy) then runs on the whole team and preempts no other
        worker's step. Raises TimeoutError if it has not run within ``timeout``."""
        return self._call(fn, timeout, in_turn=True)

    def _call(self, fn: Callable[[EngineCore], Any], timeout: float, in_turn: bool) -> Any:
        done = threading.Event()
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn(self.engine)
            except BaseException as exc:
                box["error"] = exc
            done.set()

        self._post(run, in_turn)
        if not done.wait(timeout):
            raise TimeoutError(f"engine loop did not answer within {timeout}s")
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)
        if getattr(self, "engine", None) is not None:
            self.engine.shutdown()  # a tensor-parallel replica's other ranks

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    # ------------------------------------------------------------------ the loop thread
    def _post(self, fn: Callable[[], None], in_turn: bool = False) -> None:
        with self._lock:
            (self._turn_inbox if in_turn else self._inbox).append(fn)
        self._wake.set()
        if self.core_share is not None:  # the loop may be waiting for its turn at the cores
            self.core_share.ring()

    def _raise_if_dead(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"engine loop died: {self._error!r}") from self._error

    def _run(self, factory: Callable[[], EngineCore] | None, built: threading.Event) -> None:
        name_this_thread("baton-engine")  # before the first torch op: its OpenMP team inherits the name
        try:
            if factory is not None:
                self.engine = factory()
        except BaseException as exc:
            self._error = exc
            if self.core_share is not None:
                self.core_share.close()
            return
        finally:
            built.set()
        engine, share = self.engine, self.core_share
        idle = True
        try:
            while not self._stop:
                self._run_commands()
                if not engine.has_unfinished_requests() and not self._turn_inbox:
                    if not idle and share is not None:
                        share.release()
                    idle = True
                    self._wake.wait(self.idle_wait_s)
                    continue
                idle = False
                if share is not None:
                    share.before_step(on_wake=self._run_commands)
                try:
                    self._run_commands(in_turn=True)
                    deltas = engine.step() if engine.has_unfinished_requests() else []
                finally:
                    if share is not None:
                        share.after_step()
                if deltas:
                    self._dispatch(deltas)
        except BaseException as exc:  # surface to every waiting stream instead of hanging them
            self._error = exc
            for stream in list(self._streams.values()):
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, RuntimeError(f"engine failed: {exc!r}"))
            self._streams.clear()
            raise
        finally:
            if share is not None:
                share.close()

    def _run_commands(self, in_turn: bool = False) -> None:
        with self._lock:
            if in_turn:
                commands, self._turn_inbox = self._turn_inbox, []
            else:
                commands, self._inbox = self._inbox, []
                self._wake.clear()
        for cmd in commands:
            cmd()

    def _dispatch(self, deltas: list[TokenDelta]) -> None:
        if self.on_step is not None:
            self.on_step(deltas)
        done = set()
        for d in deltas:
            stream = self._streams.get(d.request_id)
            if stream is None:
                continue
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, d)
            if d.finish_reason is not None and all_finished(self.engine, d.request_id):
                done.add(d.request_id)  # forget only after this step: other samples may finish too
        for rid in done:
            self._streams.pop(rid, None)


def all_finished(engine: EngineCore, request_id: str) -> bool:
    """True when the engine no longer tracks any sample of ``request_id``."""
    return request_id not in engine.groups
