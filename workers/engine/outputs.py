"""Messages out of the engine: per-step token deltas, and the offline API's results."""

from __future__ import annotations

from dataclasses import dataclass


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
    recoverable: bool = False  # ended here by a fault another placement may not meet (a failed KV transfer)
    # How many output tokens the sample had before these: a front merging a sample's deltas from two
    # workers (the prefill worker's first token, the decode worker's next) puts them in this order.
    # -1: not counted (an end decided outside the engine), delivered as it comes.
    position: int = -1


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
