"""Messages out of the engine: per-step token deltas, and the offline API's results."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenDelta:
    """New tokens of one sample (request ``request_id``, sample ``index``) after one step.

    Token ids only: detokenization and stop strings happen in the output processor (or the
    HTTP front), so workers can batch these per step and ship them cheaply.
    """

    request_id: str
    index: int
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    kv_ready: bool = False  # prefill-only request parked with its KV, ready to ship


@dataclass
class RequestMetrics:
    """Lifecycle timestamps (``time.monotonic``) recorded once per request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One of the ``n`` samples of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class RequestOutput:
    """Everything about one client request so far (final when ``finished``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    extra: dict = field(default_factory=dict)
