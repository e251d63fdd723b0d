"""Where a request's samples run, and what that adds to each worker's load as this front counts it.

The counts (``WorkerLoad.outstanding``, ``local_pending_prefill``, ``local_pending_requests``,
``local_decode_left``) are what routing prices a worker's queue by; every placement adds to them
once when it opens and takes off exactly what it added, whichever way it ends. Plain code: the
live client and the simulator both call it.
"""

from __future__ import annotations

from dataclasses import dataclass

from baton_serve.cluster.front.workers import WorkerRef
from baton_serve.router.routing import Decision
from baton_serve.workers.engine.outputs import TokenDelta


@dataclass
class Placement:
    """Where a request's unfinished samples run: the worker that computes their prompt (and
    first token) and, disaggregated, the decode worker that continues them."""

    first: WorkerRef
    decode: WorkerRef | None
    pending: int  # prompt positions ``first`` has left to compute, until its first token
    hashes: list[bytes]
    estimated_ttft_s: float | None
    prefilling: bool = True
    max_tokens: int = 0  # each sample's output budget
    decode_left: int = 0  # output tokens its samples may still produce, counted on the decoding worker

    @classmethod
    def open(cls, decision: Decision, hashes: list[bytes], prompt_len: int, resumed_len: int,
             outputs_left: int, max_tokens: int, block_size: int) -> Placement:
        """Place a request per ``decision`` and charge the workers' loads: its prompt (plus the
        ``resumed_len`` tokens a migrated sample continues from) less what ``first`` holds, and
        ``outputs_left`` tokens still to produce on the decoding worker."""
        pending = prompt_len + resumed_len - decision.matched_blocks * block_size
        placed = cls(decision.first, decision.decode, pending, hashes, decision.estimated_ttft_s,
                     max_tokens=max_tokens, decode_left=outputs_left)
        first = decision.first.load
        first.outstanding += 1
        first.local_pending_prefill += pending
        first.local_pending_requests += 1
        placed.decoding.load.local_decode_left += outputs_left
        if decision.decode is not None:
            decision.decode.load.outstanding += 1
        return placed

    @property
    def decoding(self) -> WorkerRef:
        return self.decode if self.decode is not None else self.first

    def first_token(self) -> None:
        """The first worker is past the prompt: its pending work comes off its load."""
        self.prefilling = False
        self.first.load.local_pending_prefill -= self.pending
        self.first.load.local_pending_requests -= 1

    def produced(self, delta: TokenDelta, emitted: list[int]) -> None:
        """A sample's tokens (``emitted``: all it has produced) come off what the decoding worker has
        left to produce, and its whole rest when it ends sooner (a stop)."""
        done = len(delta.token_ids)
        if delta.finish_reason is not None:
            done += max(self.max_tokens - len(emitted), 0)
        done = min(done, self.decode_left)
        self.decode_left -= done
        self.decoding.load.local_decode_left -= done

    def close(self) -> None:
        """Take off the loads whatever this placement still adds to them (it ended or moved)."""
        self.first.load.outstanding -= 1
        self.decoding.load.local_decode_left -= self.decode_left
        if self.prefilling:
            self.first.load.local_pending_prefill -= self.pending
            self.first.load.local_pending_requests -= 1
        if self.decode is not None:
            self.decode.load.outstanding -= 1
