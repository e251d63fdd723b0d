"""One request's stream at the front: what its caller has, per sample, and the order deltas from
two workers reach it in. Plain state and rules, no I/O: the client feeds it and carries out what
it says."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from baton_serve.workers.engine.outputs import TokenDelta


@dataclass
class Migrate:
    """Queued to a stream when a worker of its placement died: place it again and resume."""

    worker_id: str
    error: BaseException
    suspects: tuple[str, ...] = ()  # live workers of a failed transfer: probed before re-routing


@dataclass
class Stream:
    """A request in flight: its samples' progress, the workers of its current placement and the
    wire ids they know it by. ``queue`` is where its deltas wait for the caller (an asyncio.Queue
    in the live front)."""

    queue: Any
    remaining: int
    workers: set[str]  # the workers of the current placement
    wire_id: str  # the id the workers know this attempt by (unique, unlike a client's id)
    paused: bool = False
    flow_seq: int = 0  # orders pause/resume calls, which a threaded actor may run out of order
    n: int = 1
    prefill_id: str | None = None  # the prefill worker, until every sample has reached the decode worker
    decode_id: str | None = None
    handed: set[int] = field(default_factory=set)  # samples the decode worker has sent deltas for
    finished: set[int] = field(default_factory=set)  # samples whose final delta went to the caller
    # Sample index -> the wire id it runs under now: the request's own at first; after a migration,
    # each unfinished sample is resubmitted alone under one of its own.
    wires: dict[int, str] = field(default_factory=dict)
    emitted: dict[int, list[int]] = field(default_factory=dict)  # tokens the caller has, per sample
    migrations: int = 0
    placed_n: int = 1  # samples the current placement runs
    # Per sample: the position the next delta to queue starts at, and deltas that came before their
    # turn (a decode worker's tokens can overtake the prefill worker's first one), by position.
    next_position: dict[int, int] = field(default_factory=dict)
    early: dict[int, dict[int, list[tuple[TokenDelta, str | None]]]] = field(default_factory=dict)

    def in_order(self, delta: TokenDelta, source: str | None) -> list[tuple[TokenDelta, str | None]]:
        """The deltas (with their sources) that may go to the caller now that ``delta`` came: none
        while one before it is missing; it and every held one it lets through otherwise."""
        if delta.position < 0:
            return [(delta, source)]
        i = delta.index
        expected = self.next_position.get(i, 0)
        if delta.position > expected:
            self.early.setdefault(i, {}).setdefault(delta.position, []).append((delta, source))
            return []
        if delta.position < expected:  # a repeat: the engine numbers every delta it makes
            return []
        ready = [(delta, source)]
        expected += len(delta.token_ids)
        held = self.early.get(i)
        while held and expected in held:
            for d, src in held.pop(expected):
                ready.append((d, src))
                expected += len(d.token_ids)
        self.next_position[i] = expected
        return ready

    def restart_order(self) -> None:
        """A new placement continues each sample from the tokens its caller has."""
        self.early.clear()
        self.next_position = {i: len(toks) for i, toks in self.emitted.items()}

    def hands_over(self, delta: TokenDelta, source: str | None) -> bool:
        """Whether ``delta``, queued now, shows its sample reached the decode worker (or ended
        before it had to). Counted when queued, not when it came: one held for the prefill
        worker's first token keeps the prefill worker's death the stream's concern."""
        return self.prefill_id is not None and source is not None and (
            source == self.decode_id or (source == self.prefill_id and delta.finish_reason is not None))

    def handed_over(self, index: int) -> None:
        """Sample ``index`` is past the prefill worker. Once every sample is, the prefill worker holds
        nothing of the request: its death, or an abort, no longer concerns the stream."""
        self.handed.add(index)
        if len(self.handed) >= self.placed_n:
            self.workers.discard(self.prefill_id)
            self.prefill_id = None

    def unfinished(self) -> list[int]:
        """The samples whose caller still waits for tokens."""
        return [i for i in range(self.n) if i not in self.finished]

    def resume_tokens(self) -> list[int]:
        """The longest output an unfinished sample has: a new placement's prompt continues with it."""
        return max((self.emitted.get(i, []) for i in self.unfinished()), key=len, default=[])

    def take(self, delta: TokenDelta) -> bool:
        """Record ``delta`` as the caller's; False (drop it) when its sample had already ended here
        (a stop string, an abort that raced the worker's own end)."""
        if delta.index in self.finished:
            return False
        if delta.finish_reason is not None:
            self.finished.add(delta.index)
        self.emitted.setdefault(delta.index, []).extend(delta.token_ids)
        return True
