"""One request inside the engine: token counters, state, lifecycle timestamps."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from baton_serve.workers.errors import InvalidRequestError
from baton_serve.workers.sampling.params import SamplingParams


class RequestStatus(enum.Enum):
    """Engine-side states (seed 000 §0.2); the FINISHED_* ones are terminal."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    MIGRATED = "migrated"  # prefill done here, KV shipped to a decode worker: terminal on this worker

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI ``finish_reason`` for a terminal state, else None (also None for MIGRATED)."""
        return self.value if self in _CLIENT_FINISHED else None


_CLIENT_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                    RequestStatus.FINISHED_ABORTED}
_FINISHED = _CLIENT_FINISHED | {RequestStatus.MIGRATED}


@dataclass
class Request:
    """A sequence the scheduler runs. There is no prefill/decode flag: only counters.

    ``num_computed_tokens`` counts positions whose KV is in the cache; the request needs
    ``num_tokens - num_computed_tokens`` more positions computed before it can sample again.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_total_tokens: int  # prompt + output may not exceed this (context window / max_tokens)
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    tenant: str = ""  # who shares a priority class fairly with whom (policy "fair"); "" is one tenant
    cache_salt: str | None = None
    parent_id: str | None = None  # the client request when n > 1
    index: int = 0  # position among the n samples
    status: RequestStatus = RequestStatus.WAITING
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit of the first scheduling; -1 until known
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    generator: torch.Generator | None = None
    fork_pending: int = 0  # siblings still to fork off this request when its prompt is done
    prefill_only: bool = False  # disaggregated prefill: park after the first token for KV shipping
    swapped_blocks: list[int] = field(default_factory=list)  # host blocks holding its KV while swapped out
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    matcher: Any = None  # the grammar's state (structured output), advanced by every emitted token
    kv_expect: list[tuple[int, int, int]] | None = None  # arriving KV: (block, logical index, crc) to check

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        if self.params.seed is not None and self.generator is None:
            # mod 2**64: torch takes [-2**63, 2**64) and reads a negative seed as its two's complement,
            # so every seed that fitted keeps its stream and a larger one (any int is valid) still works.
            self.generator = torch.Generator().manual_seed((self.params.seed * 1_000_003 + self.index) % 2**64)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)


@dataclass
class SampleResume:
    """Where one sample stood when the worker running it died: its index among the request's
    samples and the tokens the client has received, which the next worker continues from."""

    index: int
    output_token_ids: list[int]

    def check(self, params: SamplingParams, prompt_len: int, max_model_len: int) -> None:
        """Raise InvalidRequestError unless this can continue a sample of ``params``."""
        if params.n != 1:
            raise InvalidRequestError("a resumed sample is resubmitted on its own (n = 1)", param="n")
        if self.index < 0:
            raise InvalidRequestError(f"sample index must be >= 0, got {self.index}", param="index")
        room = max_model_len - prompt_len if params.max_tokens is None else min(params.max_tokens,
                                                                                 max_model_len - prompt_len)
        if len(self.output_token_ids) >= room:
            raise InvalidRequestError(f"{len(self.output_token_ids)} tokens emitted leave no room for another "
                                      f"(at most {room})", param="max_tokens")

    def advance(self, generator: torch.Generator | None) -> None:
        """Draw what the sampler drew for the emitted tokens: one uniform per token
        (``workers.sampling.sampler``), so a seeded sample continues its own stream."""
        if generator is None:
            return
        for _ in self.output_token_ids:
            torch.rand(1, dtype=torch.float64, generator=generator)


@dataclass
class RequestGroup:
    """A client request and its ``n`` samples (engine-internal ids)."""

    request_id: str
    member_ids: list[str]
    num_prompt_tokens: int
